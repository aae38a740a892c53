"""The package layout is the data flow: each layer imports only from the layers below it.

Every import counts: module level, inside functions, and type-only imports under
``TYPE_CHECKING``. Within one layer, modules may import each other, but no module graph has a
circle. No module is over 600 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "sdadapt"

LAYERS: list[tuple[str, ...]] = [
    ("sdadapt._base", "sdadapt.errors"),  # regions, the schema records, agreement; the exceptions
    ("sdadapt.sources",),  # checkpoint formats, the Hub, joined and LoRA sources, JSON
    ("sdadapt._recipes",),  # node kinds and the pure tensor functions they compute with
    ("sdadapt.rules",),  # every rule kind, built-in and user, and their constructors
    ("sdadapt._plan",),  # adapter, plan, report, target; which adapter a name or model means
    ("sdadapt._engine",),  # I/O, staging, the device lane, the DCP storage reader
    ("sdadapt._transaction",),  # what every operation shares: checks, plan steps, the load transaction
    # the operations, one room each: load, training state, export, refit, the dry run; diff, verify, shrink
    ("sdadapt._load", "sdadapt._state", "sdadapt._export", "sdadapt._refit", "sdadapt._dry_run", "sdadapt._tools"),
    ("sdadapt._draft", "sdadapt.torchtitan", "sdadapt.vllm"),  # drafting adapters; the torchtitan bridge; vLLM's backend
    ("sdadapt", "sdadapt.cli", "sdadapt.__main__"),  # the public face and the command line
]
MAX_LINES = 600


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> int:
    best, floor = -1, -1
    for i, layer in enumerate(LAYERS):
        for prefix in layer:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, floor = len(prefix), i
    assert floor >= 0, f"{module} belongs to no layer; add it to LAYERS"
    return floor


def imports_of(module: str) -> set[str]:
    """The sdadapt modules ``module`` imports, resolved: ``from .x import y`` counts ``x.y``
    when that is a module, else ``x``."""
    path = MODULES[module]
    return _imports_in(ast.parse(path.read_text()), module, path)


def _imports_in(tree: ast.AST, module: str, path: Path) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            names = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in MODULES else origin for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:  # ``import sdadapt.x.y`` names module x.y
                name = name.rpartition(".")[0]
            if name.startswith("sdadapt") and name != module:
                found.add(name)
    return found


GRAPH = {m: imports_of(m) for m in MODULES}


def test_every_module_belongs_to_a_layer():
    for module in MODULES:
        layer_of(module)


def test_no_import_runs_up_a_layer():
    upward = [
        f"{m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)})"
        for m, targets in GRAPH.items()
        for t in sorted(targets)
        if layer_of(t) > layer_of(m) and not (m == "sdadapt" and t.startswith("sdadapt."))
    ]
    assert upward == []


def _package_of(module: str) -> str:
    return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]


FACE_EXCEPTIONS: dict[tuple[str, str], str] = {}
"""``(importer, private module)`` pairs allowed to skip the package's face, with the reason."""

FACES_BY_DESIGN = {"sdadapt"}
"""Modules whose job is to name private modules: the top-level face's table of public names."""


def private_imports(module: str) -> set[str]:
    """The private modules (a leading underscore: ``sdadapt.sources._base``) of another package
    that ``module`` imports, instead of that package's face (its ``__init__``)."""
    own = _package_of(module)
    return {
        t
        for t in GRAPH[module]
        if t.rpartition(".")[2].startswith("_") and t.rpartition(".")[0] != own and MODULES[t].name != "__init__.py"
    }


def test_upper_layers_import_a_package_by_its_face():
    """A module imports another package's names from its ``__init__`` (``from ..sources import
    Source``), never from its private modules (``from ..sources._base import Source``): what a
    package offers the layers above is one list, in one place, and its modules can move inside it.
    The shared vocabulary (``TensorInfo``, ``dtype_name``, ``slices``...) lives in
    :mod:`sdadapt._base.schema`, whose modules are not private."""
    found = {
        (m, t)
        for m in MODULES
        if m not in FACES_BY_DESIGN
        for t in private_imports(m)
    }
    assert sorted(found - set(FACE_EXCEPTIONS)) == []
    assert sorted(set(FACE_EXCEPTIONS) - found) == [], "an exception no longer needed"


def test_the_face_check_finds_a_private_import():
    assert "sdadapt.sources._json" in {t for t in GRAPH["sdadapt.sources"]}  # the face itself may
    assert private_imports("sdadapt.sources") == set()
    assert "sdadapt.sources._base" in private_imports_of_text("from ..sources._base import Source", "sdadapt._plan.plan")


def private_imports_of_text(text: str, module: str) -> set[str]:
    """:func:`private_imports` of a module whose source is ``text`` (for the test above)."""
    saved = GRAPH[module]
    path = MODULES[module]
    try:
        GRAPH[module] = _imports_in(ast.parse(text), module, path)
        return private_imports(module)
    finally:
        GRAPH[module] = saved


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    # a package's __init__ importing its own submodules is how a package shows its face; its
    # submodules import each other directly, never their package's __init__
    graph = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in GRAPH.items()}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_is_at_most_600_lines(module):
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{module} has {lines} lines"


# --- bench/: the product (load_bench, its package, the benches the docs cite) and the probes ---

BENCH = Path(__file__).resolve().parents[2] / "bench"

BENCH_PRIVATE: dict[str, dict[str, str]] = {
    # the bench product: what the public API does not offer
    "loadbench/checkpoint.py": {"sdadapt._recipes": "writes the FP8 / MXFP4 twins with the library's own quantizers"},
    "loadbench/twins.py": {"sdadapt._recipes": "writes the scaled formats' twins where no tool package is installed"},
    "loadbench/cli.py": {"sdadapt.sources._dcp_dir": "imports the DCP source before timing (an import, not a call)"},
    "loadbench/paths.py": {"sdadapt._plan.plan": "the plan of a path, to check its shards against the eager recipe",
                           "sdadapt._plan.target": "the model's schema for that plan"},  # fmt: skip
    "loadbench/references.py": {"sdadapt._engine": "the engine's default thread count for the machine references"},
    "write_bench.py": {"sdadapt._state": "times a background save's staging, the take and the copy, on the thread's CPU clock"},
    "object_store_write_bench.py": {"sdadapt._export.spread_remote": "the window an every-rank upload holds: the memory bound"},
    "cold_read_bench.py": {"sdadapt._base.regions": "the shape of each rank's box",
                           "sdadapt._engine": "runs the engine on one simulated rank's jobs; a TP group's shared rows over gloo",
                           "sdadapt._engine.predict": "the dry run's storage figure for the same jobs",
                           "sdadapt._plan.layout": "a rank's boxes on a mesh it does not have (TP x FSDP rules)",
                           "sdadapt._recipes.nodes": "Leaf nodes over the source"},  # fmt: skip
    "gpt_oss_bench.py": {"sdadapt._recipes.quant": "writes the MXFP4 experts and times the whole-tensor dequantisation"},
    "plan_bench.py": {"sdadapt._base.gc": "plans with the collector paused, as load does",
                      "sdadapt._engine": "times the engine's planning on its own",
                      "sdadapt._plan.plan": "times build_plan on its own",
                      "sdadapt.rules._patterns": "the patterns' compile cache, cleared between runs",
                      "sdadapt._base.schema": "the tensor records of a schema-only source of 90k keys (no files)"},  # fmt: skip
    "resume_bench.py": {"sdadapt._transaction": "times the transaction's read phase inside load_state"},
    "agreement_bench.py": {"sdadapt._base.agreement": "times the ranks' agreement on its own",
                           "sdadapt._plan.intent": "the parts a load agrees on, built from a plan",
                           "sdadapt._recipes.nodes": "the leaves of a Llama-shaped plan, without a checkpoint"},  # fmt: skip
    "quant_kernel_bench.py": {"sdadapt._recipes": "times the eager quantizers (quant, quant_scaled) against quant_fused's kernels"},
    # the probes: each asks one question about the engine's internals
    "probes/first_kernel_probe.py": {"sdadapt._recipes": "times the first launch of each dequantisation op",
                                     "sdadapt._recipes.quant": "the e2m1 table built on the device and on the host"},  # fmt: skip
    "probes/refit_host_probe.py": {"sdadapt._recipes": "fakes the fused quantization's kernels to time the host's part"},
    "probes/lane_probe.py": {"sdadapt._base.regions": "whole-tensor boxes for the jobs it builds",
                             "sdadapt._engine": "runs the engine on jobs it builds, without a model",
                             "sdadapt._engine.tasks": "the engine's Job",
                             "sdadapt._recipes": "the FP8 nodes whose kernels the lane runs",
                             "sdadapt._recipes.nodes": "Leaf nodes over the source"},  # fmt: skip
    "probes/row_share_trace.py": {"sdadapt._engine": "times the engine's runs and the row exchange's steps",
                                  "sdadapt._plan.layout": "the TP group's size on the mesh"},
    "probes/steady_overhead_probe.py": {"sdadapt._plan.target": "times the state dict a load takes (--pieces)",
                                        "sdadapt._transaction.materialize": "times materialising as a load does it (--pieces)"},
    "probes/phase_probe.py": {"sdadapt._engine.engine": "wraps the load's steps to time each",
                              "sdadapt._engine.reader": "the same", "sdadapt._engine.direct": "the same",
                              "sdadapt._plan.plan": "the same",
                              "sdadapt._plan.target": "the same", "sdadapt._load.loading": "the same",
                              "sdadapt._transaction.steps": "the same", "sdadapt._transaction.materialize": "the same",
                              "sdadapt._transaction.transaction": "the same"},  # fmt: skip
}
"""Every private sdadapt module a bench or probe imports (or names to patch), with the reason:
a new one must say why the public API does not serve it."""


def _bench_private(path: Path) -> set[str]:
    """The private sdadapt modules ``path`` imports, or names as a string to import or patch."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sdadapt"):
            if any(p.startswith("_") for p in node.module.split(".")[1:]):
                out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("sdadapt.") and any(p.startswith("_") for p in a.name.split(".")[1:])}
        elif isinstance(node, ast.Tuple) and node.elts and isinstance(node.elts[0], ast.Constant):
            name = node.elts[0].value
            if isinstance(name, str) and name.startswith("sdadapt._") and " " not in name:
                out.add(name)  # ("sdadapt._x.y", "function"): a step a probe wraps
    return out


def test_bench_imports_of_private_modules_are_declared():
    found = {str(p.relative_to(BENCH)): _bench_private(p) for p in sorted(BENCH.rglob("*.py"))}
    for rel, mods in found.items():
        declared = set(BENCH_PRIVATE.get(rel, {}))
        assert mods == declared, f"bench/{rel} imports private {sorted(mods - declared)}; declared but unused {sorted(declared - mods)}"
    assert set(BENCH_PRIVATE) <= set(found), sorted(set(BENCH_PRIVATE) - set(found))


BENCH_TEST_IMPORTS = {
    "gpu_scenario.py": {"support.models": "the suite's TinyTransformer and parallelize: the GPU runs the model the CPU tests run"},
    "draft_families_bench.py": {
        "support.draft_natives": "the families' perturbation, as the draft tests write their checkpoints",
        "support.draft_natives2": "the twelve families' configs and the native decoder the draft tests target",
    },
    "object_store_bench.py": {
        "support.dist_helper": "gloo ranks launched as the distributed tests launch them",
        "support.checkpoints": "the reference writer of HF sharded folders",
        "support.object_store_server": "the SeaweedFS the object storage tests start",
    },
    "object_store_clients.py": {"support.object_store_server": "the SeaweedFS the object storage tests start"},
    "object_store_gpu_bench.py": {"support.object_store_server": "the SeaweedFS the object storage tests start"},
    "object_store_write_bench.py": {
        "support.dist_helper": "gloo ranks launched as the distributed tests launch them",
        "support.object_store_server": "the SeaweedFS the object storage tests start",
    },
    "probes/refit_host_probe.py": {"support.refit_eager": "the quantized engines' tensors the refit tests use"},
    "refit_bench.py": {"support.models": "a module tree over a state dict, as the refit tests build their engines",
                       "support.refit_eager": "the quantized engines' adapters and tensors the refit tests use"},  # fmt: skip
    "write_bench.py": {
        "support.models": "the suite's TinyTransformer and parallelize, at a larger size: the export tests' model",
        "support.training": "the training step the background-save tests run",
    },
    "gptq_bench.py": {"support.quant_oracle": "auto-gptq's own packing, as the GPTQ tests write their releases"},
}
"""The modules of tests/support/ a bench imports, with the reason; a bench never imports a test module."""


def _absolute_imports(path: Path) -> list[str]:
    """Every module ``path`` imports by an absolute name (relative imports stay in their package)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [node.module] + [f"{node.module}.{a.name}" for a in node.names if node.module == "support"]
    return out


def test_bench_imports_no_test_module():
    tests = set(TEST_MODULES)
    for p in sorted(BENCH.rglob("*.py")):
        declared = BENCH_TEST_IMPORTS.get(str(p.relative_to(BENCH)), {})
        used = set()
        for name in _absolute_imports(p):
            top = name.split(".")[0]
            assert top not in tests and not top.startswith("test_") and top != "tests", f"bench/{p.relative_to(BENCH)} imports {name}"
            if top == "support" and name != "support":
                used.add(name)
        rel = p.relative_to(BENCH)
        assert used == set(declared), f"bench/{rel}: undeclared {sorted(used - set(declared))}, unused {sorted(set(declared) - used)}"
    assert set(BENCH_TEST_IMPORTS) <= {str(p.relative_to(BENCH)) for p in BENCH.rglob("*.py")}


# --- tests/: test modules in one folder per layer, what they share in tests/support/ ---

TESTS = Path(__file__).resolve().parents[1]
TEST_FOLDERS = {
    "sources": "checkpoint formats, the Hub, object storage, hostile headers",
    "recipes": "node kinds and their declared inputs",
    "rules": "rule kinds, patterns, quantized formats and their dequant rules",
    "plan": "planning, reports, targets, the adapter registry",
    "engine": "the I/O engine: lanes, staging, device reads",
    "transaction": "load, state, export, refit, verify, shrink, dry run",
    "adapters": "the shipped adapters and the torchtitan bridge",
    "draft": "sdadapt draft",
    "cli": "the command line",
    "dist": "the multi-process suites (gloo ranks)",
    "project": "the repository: layers, packaging, public API, docs, examples, bench smoke",
}
"""tests/<folder>/ holds test modules only; tests/support/ what they share (builders, checkpoint writers,
reference models, the gloo launcher, scripts run alone) and no test module."""
TEST_MODULES = {p.stem: p for f in TEST_FOLDERS for p in sorted((TESTS / f).glob("test_*.py"))}


def misplaced_test_files(tests: Path) -> list[str]:
    """Files of ``tests`` outside the layout: a test module outside tests/<folder>/, anything else
    there, a test module in support/, a folder no layer names (reports/ holds the repeated runs'
    reports, no Python), one file name in two folders."""
    out = []
    for p in sorted(tests.rglob("*.py")):
        rel = p.relative_to(tests)
        if rel.parts[0] == "support":
            if p.name.startswith("test_"):
                out.append(f"{rel}: a test module in support/")
        elif rel != Path("conftest.py") and (
            len(rel.parts) != 2 or rel.parts[0] not in TEST_FOLDERS or not (p.name.startswith("test_") or p.name == "conftest.py")
        ):
            out.append(f"{rel}: not tests/<folder>/test_*.py (folders: {', '.join(TEST_FOLDERS)}; helpers go in support/)")
    # pytest imports a test module by its file's name: two folders may not hold the same one
    names = [p.name for f in TEST_FOLDERS for p in (tests / f).glob("test_*.py")]
    out += [f"{n}: in two folders" for n in sorted({n for n in names if names.count(n) > 1})]
    out += [f"{d.name}/: no such layer folder" for d in sorted(tests.iterdir())
            if d.is_dir() and d.name not in {*TEST_FOLDERS, "support", "reports", "__pycache__"}]  # fmt: skip
    return out


def imports_of_test_modules(tests: Path) -> list[str]:
    """Every import, in any file under ``tests``, of a test module (support and conftest included)."""
    modules = {p.stem for p in tests.rglob("test_*.py")}
    return [
        f"{p.relative_to(tests)} imports {name}"
        for p in sorted(tests.rglob("*.py"))
        for name in _absolute_imports(p)
        if name.split(".")[0] in modules or name.split(".")[0] == "tests"
    ]


def test_every_test_file_lives_in_a_layer_folder():
    assert misplaced_test_files(TESTS) == []


def test_no_test_module_imports_another_test_module():
    """A test module imports ``support`` and uses conftest fixtures; ``support`` imports no test module."""
    assert imports_of_test_modules(TESTS) == []


def test_the_tests_checks_find_what_they_look_for(tmp_path: Path):
    (tmp_path / "rules").mkdir()
    (tmp_path / "plan").mkdir()
    (tmp_path / "support").mkdir()
    (tmp_path / "misc").mkdir()
    (tmp_path / "rules" / "test_a.py").write_text("from test_b import helper\n")
    (tmp_path / "plan" / "test_b.py").write_text("import support.x\n\ndef helper(): ...\n")
    (tmp_path / "plan" / "test_a.py").write_text("")
    (tmp_path / "support" / "x.py").write_text("def f():\n    import test_a\n")
    (tmp_path / "support" / "test_c.py").write_text("")
    (tmp_path / "helpers.py").write_text("")
    assert imports_of_test_modules(tmp_path) == ["rules/test_a.py imports test_b", "support/x.py imports test_a"]
    assert misplaced_test_files(tmp_path) == [
        "helpers.py: not tests/<folder>/test_*.py (folders: " + ", ".join(TEST_FOLDERS) + "; helpers go in support/)",
        "support/test_c.py: a test module in support/",
        "test_a.py: in two folders",
        "misc/: no such layer folder",
    ]


def test_support_is_imported_as_the_support_package():
    """``from support.checkpoints import ...``, never ``from checkpoints import ...``: one module object,
    whichever folder the importing test module sits in."""
    support = {p.stem for p in (TESTS / "support").glob("*.py")} | {p.name for p in (TESTS / "support").iterdir() if p.is_dir()}
    support -= {"__init__", "__pycache__"}
    bare = [
        f"{p.relative_to(TESTS)} imports {name}"
        for p in sorted([*TESTS.rglob("*.py"), *BENCH.rglob("*.py")])
        for name in _absolute_imports(p)
        if name.split(".")[0] in support
    ]
    assert bare == []


def test_probes_are_apart_from_the_product():
    """bench/ holds the product (load_bench.py and loadbench/, the benches the docs cite);
    bench/probes/ the probes; nothing in the product imports a probe."""
    probes = {p.stem for p in (BENCH / "probes").glob("*.py")}
    assert probes and not any(p.name.endswith("_probe.py") for p in BENCH.glob("*.py"))
    for p in [*BENCH.glob("*.py"), *(BENCH / "loadbench").glob("*.py")]:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import) or (isinstance(node, ast.ImportFrom) and node.level == 0):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not any(n.split(".")[0] in probes for n in names), (p, names)
