"""The package as a user installs it: declared dependencies match the library's imports, and a
wheel built from the source tree holds every module and works without the editable install."""

from __future__ import annotations

import ast
import configparser
import importlib.metadata
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "sdadapt"
ADAPTERS = ROOT / "adapters"
LIBRARY_FILES = sorted([*SRC.rglob("*.py"), *ADAPTERS.rglob("*.py")])
IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError"}
# declared dependencies the library never imports itself, each with what needs it at run time
RUNTIME_ONLY = {
    "numpy": "torch's object collectives (all_gather_object, broadcast_object_list, DCP's save planning) unpickle through it",
}

# modules whose distribution is named per CUDA major version; an extra may declare any of them
PER_CUDA = {"kvikio": {"kvikio-cu12", "kvikio-cu13"}}


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _dist_name(requirement: str) -> str:
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert m, requirement
    return re.sub(r"[-_.]+", "-", m.group(1)).lower()


def _third_party(name: str) -> str | None:
    top = name.split(".")[0]
    if top in sys.stdlib_module_names or top in {"sdadapt", "__future__"}:
        return None
    return top


def _guarded(parents: list[ast.AST]) -> bool:
    """The import sits in a ``try`` whose handler catches ImportError (an optional dependency)."""
    for p in parents:
        if isinstance(p, ast.Try):
            for h in p.handlers:
                names = [h.type] if not isinstance(h.type, ast.Tuple) else list(h.type.elts)
                if any(isinstance(n, ast.Name) and n.id in IMPORT_ERRORS for n in names):
                    return True
    return False


def library_imports(files: list[Path] = LIBRARY_FILES, root: Path = ROOT) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Third-party top-level modules the library imports: ``(required, optional)``, each
    ``module -> ["file:line", ...]``. Optional: inside a function and guarded by an ImportError
    handler; everything else (module level, or unguarded) is required."""
    required: dict[str, list[str]] = {}
    optional: dict[str, list[str]] = {}

    def visit(node: ast.AST, parents: list[ast.AST], path: Path) -> None:
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        for name in names:
            top = _third_party(name)
            if top is None:
                continue
            in_function = any(isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef)) for p in parents)
            where = required if not (in_function and _guarded(parents)) else optional
            where.setdefault(top, []).append(f"{path.relative_to(root)}:{node.lineno}")
        for child in ast.iter_child_nodes(node):
            visit(child, [*parents, node], path)

    for path in files:
        visit(ast.parse(path.read_text(), str(path)), [], path)
    return required, optional


def _distributions_of(module: str) -> set[str]:
    dists = importlib.metadata.packages_distributions().get(module, PER_CUDA.get(module, [module]))
    return {_dist_name(d) for d in dists}


def test_required_imports_are_declared_dependencies():
    declared = {_dist_name(r) for r in _project()["dependencies"]}
    required, _ = library_imports()
    assert required, "the import scan found nothing; it is broken"
    undeclared = {m: where for m, where in required.items() if not _distributions_of(m) & declared}
    assert undeclared == {}, f"imported but not in [project].dependencies: {undeclared}"


def test_every_declared_dependency_is_imported():
    required, _ = library_imports()
    imported = set().union(*(_distributions_of(m) for m in required))
    unused = {_dist_name(r) for r in _project()["dependencies"]} - imported - set(RUNTIME_ONLY)
    assert unused == set(), f"declared in [project].dependencies but never imported by the library: {unused}"


def test_runtime_only_dependencies_are_declared_and_not_imported():
    """A run-time-only dependency is declared, and stops being an exception once imported."""
    declared = {_dist_name(r) for r in _project()["dependencies"]}
    required, optional = library_imports()
    assert set(RUNTIME_ONLY) <= declared
    assert not set(RUNTIME_ONLY) & (set(required) | set(optional))


def test_optional_imports_are_declared_extras():
    extras = {_dist_name(r) for reqs in _project().get("optional-dependencies", {}).values() for r in reqs}
    _, optional = library_imports()
    undeclared = {m: where for m, where in optional.items() if not _distributions_of(m) & extras}
    assert undeclared == {}


def test_the_scan_sees_guarded_and_module_level_imports(tmp_path):
    text = (
        "import torch\nimport os\nfrom pydantic import BaseModel\n"
        "def f():\n    try:\n        import transformers\n"
        "    except ImportError as e:\n        raise RuntimeError('pip install sdadapt[models]') from e\n"
        "def g():\n    import numpy\n"
    )
    probe = tmp_path / "probe.py"
    probe.write_text(text)
    required, optional = library_imports([probe], tmp_path)
    assert sorted(required) == ["numpy", "pydantic", "torch"] and sorted(optional) == ["transformers"]


def _copy_tree(dst: Path) -> Path:
    skip = shutil.ignore_patterns(".venv", ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis")
    shutil.copytree(ROOT, dst, ignore=skip)
    return dst


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tree = _copy_tree(tmp_path_factory.mktemp("tree") / "sdadapt")
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(out)]
    subprocess.run(cmd, cwd=tree, check=True, timeout=300)
    (whl,) = out.glob("sdadapt-*.whl")
    return whl


def _expected_modules() -> set[str]:
    mods = {"sdadapt/" + p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py")}
    return mods | {"sdadapt/adapters/" + p.relative_to(ADAPTERS).as_posix() for p in ADAPTERS.rglob("*.py")}


def test_wheel_holds_every_module_and_nothing_else(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert _expected_modules() - names == set()
    python = {n for n in names if n.endswith(".py")}
    assert python - _expected_modules() == set()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"sdadapt", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"}
    assert not any(part in {"tests", "bench", "examples"} for n in names for part in n.split("/"))


RUN_INSTALLED = """
import configparser, importlib, pathlib, pkgutil, runpy, sys
target, site = sys.argv[1], sys.argv[2]
sys.path[:0] = [target]
sys.path.append(site)
import sdadapt
assert sdadapt.__file__.startswith(target), sdadapt.__file__
names = ["sdadapt"] + sorted(m.name for m in pkgutil.walk_packages(sdadapt.__path__, "sdadapt."))
for name in names:
    if name == "sdadapt.__main__":
        continue  # runs the CLI on import: run below with runpy
    mod = importlib.import_module(name)
    assert mod.__file__.startswith(target), (name, mod.__file__)
print("modules", len(names))
(info,) = pathlib.Path(target).glob("sdadapt-*.dist-info")
eps = configparser.ConfigParser()
eps.read(info / "entry_points.txt")
module, _, attr = eps["console_scripts"]["sdadapt"].partition(":")
main = getattr(importlib.import_module(module), attr)
from sdadapt.cli import build_parser
commands = sorted(build_parser()._subparsers._group_actions[0].choices)
for argv in [["--help"]] + [[c, "--help"] for c in commands]:
    try:
        main(argv)
    except SystemExit as e:
        assert e.code == 0, (argv, e.code)
    else:
        raise AssertionError(f"{argv}: --help did not exit")
    print("help", " ".join(argv))
sys.argv = ["sdadapt", "adapters"]
try:
    runpy.run_module("sdadapt", run_name="__main__")
except SystemExit as e:
    assert e.code == 0, e.code
print("python -m sdadapt adapters: ok")
"""


def test_wheel_installs_imports_and_runs_the_cli(wheel, tmp_path):
    target = tmp_path / "target"
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(target), str(wheel)]
    subprocess.run(cmd, check=True, timeout=120)
    site = sysconfig.get_paths()["purelib"]
    # -I -S: no PYTHONPATH, no user site, and no .pth files (the editable install is one):
    # only the target folder and the venv's site-packages (torch, pydantic) are on the path
    res = subprocess.run(
        [sys.executable, "-I", "-S", "-c", RUN_INSTALLED, str(target), site],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    for sub in ("adapters", "convert", "diff", "draft", "inspect"):
        assert f"help {sub} --help" in out
    assert "help --help" in out and "python -m sdadapt adapters: ok" in out
    eps = configparser.ConfigParser()
    eps.read(next(target.glob("sdadapt-*.dist-info")) / "entry_points.txt")
    assert eps["console_scripts"]["sdadapt"] == "sdadapt.cli:main"
    requires = importlib.metadata.Distribution.at(next(target.glob("sdadapt-*.dist-info"))).requires or []
    assert {_dist_name(r) for r in requires if "extra ==" not in r} == {_dist_name(r) for r in _project()["dependencies"]}


NO_NUMPY = """
import sys
sys.modules["numpy"] = None  # as if numpy were not installed
import torch
from sdadapt.cli import main
src, dst = sys.argv[1], sys.argv[2]
torch.save({"a": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4), "b": torch.ones(2)}, src)
code = main(["convert", src, dst, "--to", "safetensors", "--read-back"])
assert code == 0, code
import sdadapt
sdadapt.write_checksums(dst)
model = torch.nn.Module()
model.a = torch.nn.Parameter(torch.zeros(3, 4, dtype=torch.bfloat16))
model.register_buffer("b", torch.zeros(2))
sdadapt.load(model, dst, checksums=True)
assert torch.equal(model.a, torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)) and torch.equal(model.b, torch.ones(2))
print("ok")
"""


def test_convert_and_checksums_work_without_numpy(tmp_path):
    res = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", NO_NUMPY, str(tmp_path / "ck.pt"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout + res.stderr


def test_wheel_smoke_imports_only_declared_dependencies():
    """scripts/wheel_smoke.py runs in a venv holding only the wheel and its dependencies (.ci/run):
    every third-party module it imports is a declared dependency, none comes from an extra."""
    declared = {_dist_name(r) for r in _project()["dependencies"]}
    required, optional = library_imports([ROOT / "scripts" / "wheel_smoke.py"])
    imported = {**required, **optional}
    assert {"torch"} <= set(imported)
    undeclared = {m: where for m, where in imported.items() if not _distributions_of(m) & declared}
    assert undeclared == {}, f"scripts/wheel_smoke.py imports what the wheel does not declare: {undeclared}"
