"""The public surface: one table per public module, the names that moved, the adapters' imports,
the docstrings' sections, and where errors live."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
import types
from pathlib import Path

import pytest
import torch

import sdadapt
import sdadapt.errors
import sdadapt.reports
import sdadapt.rules
import sdadapt.sources
import sdadapt.torchtitan
import sdadapt.vllm

SRC = Path(sdadapt.__file__).parent
ADAPTERS = Path(__file__).resolve().parents[2] / "adapters"
# sdadapt.torchtitan is public: torchtitan users import its state-dict adapter bridge by module
PUBLIC_MODULES = {
    "sdadapt",
    "sdadapt.errors",
    "sdadapt.reports",
    "sdadapt.sources",
    "sdadapt.rules",
    "sdadapt.cli",
    "sdadapt.adapters",
    "sdadapt.torchtitan",
    "sdadapt.vllm",
}
# the top level before it was cut to one table: each name is still there or in sdadapt._MOVED
OLD_FACE = """
LoadReport Plan Report build_plan diff load plan_load ExportReport StateLoadReport convert export export_iter
load_state save_state write_checksums ShrinkReport VerifyReport shrink verify EngineConfig Source TensorInfo
open_source release_pinned_memory Adapter Draft draft get_adapter hf_adapter list_adapters resolve_adapter
resolve_target AddPrefix Affine Cast Deinterleave Drop Fuse Interleave Pad Rename Rotary Rule Split Stack StripPrefix
Tie Transpose Trim Unstack add_prefix affine cast deinterleave drop fuse interleave pad rename rotary split stack
strip_prefix tie transpose trim unstack DequantFP8 DequantMXFP4 DequantScaled QuantizeFP8 QuantizeMXFP4
QuantizeScaled dequant_fp8 dequant_mxfp4 dequant_scaled dequant_rules Compute Node RuleBase ValueRule emit
register_rule AdapterError ExportError LoadError ModelError PlanError RemoteRankError ResolveError SdadaptError
ShrinkError SourceError StateError UsageError VerifyError
""".split()
# the public names whose docstrings must have Args: / Returns: / Example: sections
DOCUMENTED = {
    "sdadapt": sdadapt.__all__,
    "sdadapt.rules": sdadapt.rules.__all__,
    "sdadapt.sources": sdadapt.sources.__all__,
    "sdadapt.reports": sdadapt.reports.__all__,
    "sdadapt.torchtitan": sdadapt.torchtitan.__all__,
    "sdadapt.vllm": [n for n in sdadapt.vllm.__all__ if n != "BACKEND"],
}


def _own_doc(obj: object) -> str:
    """The docstring ``obj`` itself carries (a class's own, not one inherited from a base)."""
    if isinstance(obj, type) or not (inspect.isroutine(obj) or hasattr(obj, "__wrapped__")):
        own = vars(obj).get("__doc__") if hasattr(obj, "__dict__") else None
        return own or ""
    return obj.__doc__ or ""


def _submodules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(sdadapt.__path__, "sdadapt."))


# --- the top level: one table, at most 45 names ------------------------------------------------
def test_face_is_small_and_from_one_table():
    assert len(sdadapt.__all__) <= 45, len(sdadapt.__all__)
    assert sdadapt.__all__ == list(sdadapt._PUBLIC)
    assert len(sdadapt.__all__) == len(set(sdadapt.__all__))
    assert [n for n in sdadapt.__all__ if not hasattr(sdadapt, n)] == []
    assert set(dir(sdadapt)) >= set(sdadapt.__all__)


def test_rules_are_functions_at_the_top_level():
    """No rule class is on the face; each rule function builds the class sdadapt.rules shows."""
    objects = {n: getattr(sdadapt, n) for n in sdadapt.__all__}
    classes = [n for n, o in objects.items() if isinstance(o, type) and issubclass(o, sdadapt.rules.RuleBase)]
    assert classes == []
    for cls_name, fn_name in sdadapt._RULE_FUNCTION.items():
        assert fn_name in sdadapt.__all__ and cls_name in sdadapt.rules.__all__
        assert getattr(sdadapt.rules, cls_name).model_fields["kind"].default == fn_name


def test_rule_functions_build_the_public_classes():
    assert isinstance(sdadapt.rename("a", "b"), sdadapt.rules.Rename)
    assert isinstance(sdadapt.dequant_fp8(), sdadapt.rules.DequantFP8)
    rule = sdadapt.fuse(["a", "b"], "c")
    assert sdadapt.rules.rule_from_data(rule.model_dump()) == rule


@pytest.mark.parametrize("name", sdadapt.__all__)
def test_public_name_is_not_a_submodule(name):
    obj = getattr(sdadapt, name)
    assert not isinstance(obj, types.ModuleType)
    # ``import sdadapt.<name>`` must not exist beside a function or class of that name
    assert f"sdadapt.{name}" not in _submodules()


def test_import_of_a_public_function_name_fails():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("sdadapt.load")


def test_only_api_modules_are_public():
    public = [m for m in _submodules() if not any(part.startswith("_") for part in m.split(".")[1:])]
    inside_public = [m for m in public if m not in PUBLIC_MODULES and not m.startswith(("sdadapt.cli.", "sdadapt.adapters."))]
    assert inside_public == []


def _type_checking_imports(path: Path, package: str) -> dict[str, str]:
    """``name -> absolute module`` of the ``if TYPE_CHECKING:`` imports of a module's source."""
    found: dict[str, str] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom)
                base = importlib.util.resolve_name("." * imp.level + (imp.module or ""), package) if imp.level else imp.module
                for alias in imp.names:
                    assert alias.asname == alias.name, f"{path}: {alias.name} is re-exported as itself"
                    found[alias.name] = base if imp.module else f"{base}.{alias.name}"
    return found


@pytest.mark.parametrize(
    ("module", "path", "table"),
    [
        (sdadapt, SRC / "__init__.py", {**sdadapt._PUBLIC, **{m: f".{m}" for m in sdadapt._SUBMODULES}}),
        (sdadapt.rules, SRC / "rules" / "__init__.py", sdadapt.rules._LAZY),
        (sdadapt.reports, SRC / "reports.py", sdadapt.reports._PUBLIC),
    ],
)
def test_type_checking_imports_follow_the_table(module, path, table):
    """What type checkers see is what the table imports: the same names from the same modules."""
    package = module.__name__ if path.name == "__init__.py" else module.__name__.rpartition(".")[0]
    absolute = {n: importlib.util.resolve_name(w, package) if w.startswith(".") else w for n, w in table.items()}
    seen = _type_checking_imports(path, package)
    for name in sdadapt._SUBMODULES if module is sdadapt else ():
        seen[name] = f"sdadapt.{name}"
    assert seen == absolute


def test_every_public_rules_name_exists():
    assert [n for n in sdadapt.rules.__all__ if not hasattr(sdadapt.rules, n)] == []
    assert [n for n in sdadapt.reports.__all__ if not hasattr(sdadapt.reports, n)] == []
    assert [n for n in sdadapt.sources.__all__ if not hasattr(sdadapt.sources, n)] == []


# --- names that left the top level -------------------------------------------------------------
def test_every_old_name_is_public_or_moved():
    assert [n for n in OLD_FACE if n not in sdadapt.__all__ and n not in sdadapt._MOVED] == []
    assert not set(sdadapt._MOVED) & set(sdadapt.__all__)


@pytest.mark.parametrize("name", sorted(sdadapt._MOVED))
def test_a_moved_name_fails_naming_its_new_spelling(name):
    with pytest.raises(AttributeError) as e:
        getattr(sdadapt, name)
    spelling = sdadapt._MOVED[name]
    assert spelling in str(e.value) and name in str(e.value)
    # every public spelling the message gives exists: sdadapt.rules.Rename, sdadapt.rename, ...
    named = re.findall(r"\bsdadapt(?:\.\w+)+", spelling)
    assert named
    for dotted in named:
        obj: object = sdadapt
        for part in dotted.split(".")[1:]:
            obj = getattr(obj, part)
        assert not dotted.split(".")[-1].startswith("_")
    # the import statement old code most often holds says the same (not only "cannot import name")
    with pytest.raises(ImportError) as imp:
        exec(f"from sdadapt import {name}", {})
    assert str(imp.value) == f"cannot import name {name!r} from 'sdadapt': it is spelled {spelling} now"
    assert hasattr(sdadapt, name) is False  # hasattr and getattr(..., default) still see an AttributeError


def test_a_name_never_public_fails_plainly():
    with pytest.raises(AttributeError, match="has no attribute 'nonsense'$"):
        sdadapt.nonsense  # noqa: B018


# --- the shipped adapters are templates a user can copy ------------------------------------------
def _sdadapt_uses(tree: ast.Module) -> list[tuple[str, str]]:
    """``(module, name)`` of every ``sdadapt`` import and ``sdadapt.x.y`` attribute chain."""
    uses: list[tuple[str, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "sdadapt" and not node.level:
            uses += [(node.module or "", a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            uses += [(a.name.rpartition(".")[0], a.name.rpartition(".")[2]) for a in node.names if a.name.startswith("sdadapt.")]
        elif isinstance(node, ast.Attribute):
            chain = []
            inner: ast.expr = node
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id == "sdadapt" and isinstance(node, ast.Attribute):
                dotted = ["sdadapt", *reversed(chain)]
                for i in range(1, len(dotted)):
                    uses.append((".".join(dotted[:i]), dotted[i]))
    return uses


def _is_public(module: str, name: str) -> bool:
    if module == "sdadapt.adapters" or module.startswith("sdadapt.adapters."):
        return True  # the adapters' own helpers (_common) ship beside them and are copied with them
    if any(part.startswith("_") for part in module.split(".")):
        return False
    mod = importlib.import_module(module)
    shown = set(getattr(mod, "__all__", [])) | set(getattr(mod, "_SUBMODULES", ()))
    if module == "sdadapt.errors":
        shown |= {n for n, o in vars(mod).items() if isinstance(o, type) and issubclass(o, sdadapt.SdadaptError)}
    submodule = f"{module}.{name}" in PUBLIC_MODULES
    return name in shown or submodule or (module == "sdadapt" and name == "__version__")


ADAPTER_FILES = sorted(ADAPTERS.glob("*.py"))


@pytest.mark.parametrize("path", ADAPTER_FILES, ids=[p.name for p in ADAPTER_FILES])
def test_adapters_use_only_public_names(path):
    private = sorted({f"{m}.{n}" for m, n in _sdadapt_uses(ast.parse(path.read_text())) if not _is_public(m, n)})
    assert private == [], f"{path.name} uses private names: a user copying it would depend on them"


def test_the_adapter_check_sees_private_uses():
    tree = ast.parse("import sdadapt\nfrom sdadapt._recipes.quant import ScaleFormat\nx = sdadapt.Rename\ny = sdadapt.rules.Rename")
    private = {f"{m}.{n}" for m, n in _sdadapt_uses(tree) if not _is_public(m, n)}
    assert private == {"sdadapt._recipes.quant.ScaleFormat", "sdadapt.Rename"}


# --- docstrings: Args / Returns / Example on every public function and class --------------------
def _documented() -> list[tuple[str, str, object]]:
    out = []
    for module, names in DOCUMENTED.items():
        mod = importlib.import_module(module)
        for name in names:
            obj = getattr(mod, name)
            if inspect.isroutine(obj) or isinstance(obj, type):
                out.append((module, name, obj))
    return out


def _takes_arguments(obj: object) -> bool:
    target = obj.__init__ if isinstance(obj, type) else obj  # type: ignore[misc]
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        return True
    return any(p.name not in ("self", "cls") for p in params)


SECTION = re.compile(r"^\s*(Args|Arguments|Attributes|Returns|Yields|Raises|Example|Examples)(?: \([^)]*\))?::?\s*$", re.M)


def _sections(doc: str) -> set[str]:
    return {m.group(1) for m in SECTION.finditer(doc)}


@pytest.mark.parametrize(("module", "name", "obj"), _documented(), ids=[f"{m}.{n}" for m, n, _ in _documented()])
def test_public_docstring_has_sections(module, name, obj):
    doc = inspect.cleandoc(_own_doc(obj))
    assert doc, f"{module}.{name} has no docstring"
    found = _sections(doc)
    missing = []
    if not found & {"Example", "Examples"}:
        missing.append("Example:")
    if isinstance(obj, type):
        if _takes_arguments(obj) and not found & {"Args", "Attributes"}:
            missing.append("Args: (or Attributes:)")
    else:
        if _takes_arguments(obj) and "Args" not in found:
            missing.append("Args:")
        if not found & {"Returns", "Yields"}:
            missing.append("Returns:")
    assert missing == [], f"{module}.{name}'s docstring lacks {', '.join(missing)}"


# --- errors ---------------------------------------------------------------------------------------
def _error_classes(tree: ast.Module) -> list[str]:
    return [
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        and (
            node.name.endswith(("Error", "Exception"))
            or any(isinstance(b, ast.Name) and b.id.endswith(("Error", "Exception")) for b in node.bases)
        )
    ]


def test_every_error_class_lives_in_errors():
    stray = {}
    for path in [*SRC.rglob("*.py"), *ADAPTERS.rglob("*.py")]:
        if path == SRC / "errors.py":
            continue
        found = _error_classes(ast.parse(path.read_text(), str(path)))
        if found:
            stray[str(path)] = found
    assert stray == {}


def test_every_error_is_an_sdadapt_error_in_errors():
    errors = [obj for _, obj in inspect.getmembers(sdadapt.errors, inspect.isclass) if obj.__module__ == "sdadapt.errors"]
    assert len(errors) >= 10
    for cls in errors:
        assert issubclass(cls, sdadapt.SdadaptError) and issubclass(cls, Exception)
        assert getattr(sdadapt.errors, cls.__name__) is cls
    assert sdadapt.SdadaptError is sdadapt.errors.SdadaptError


def test_errors_keep_their_names_in_private_modules():
    from sdadapt._export import exporting as _export
    from sdadapt._plan import resolve as _resolve
    from sdadapt._state import state as _state

    assert _export.ExportError is sdadapt.errors.ExportError
    assert _resolve.ResolveError is sdadapt.errors.ResolveError
    assert _state.StateError is sdadapt.errors.StateError


# --- options typed once: the functions that hand key patterns on take **patterns: Unpack[KeyPatterns]
HAND_ON = {"sdadapt.plan_load": sdadapt.plan_load, "sdadapt.diff": sdadapt.diff, "sdadapt.dry_run": sdadapt.dry_run,
           "sdadapt.vllm.connect": sdadapt.vllm.connect}  # fmt: skip


@pytest.mark.parametrize("name", sorted(HAND_ON))
def test_functions_that_hand_key_patterns_on_type_them_once(name):
    params = inspect.signature(HAND_ON[name]).parameters
    assert params["patterns"].kind is inspect.Parameter.VAR_KEYWORD
    assert params["patterns"].annotation == "Unpack[KeyPatterns]"
    assert not {"allow_missing", "allow_unexpected"} & set(params)
    assert "KeyPatterns" in inspect.getdoc(HAND_ON[name])


def test_key_patterns_keep_the_keywords_and_refuse_others_by_the_call_name(tmp_path):
    from safetensors.torch import save_file
    from torch import nn

    path = tmp_path / "model.safetensors"
    save_file({"weight": torch.zeros(3, 4), "extra": torch.zeros(1)}, str(path))
    model = nn.Linear(4, 3)
    assert sdadapt.KeyPatterns.__optional_keys__ == {"allow_missing", "allow_unexpected"}
    assert not sdadapt.diff(model, str(path)).ok
    assert sdadapt.diff(model, str(path), allow_missing=["bias"], allow_unexpected=["extra"]).ok
    patterns: sdadapt.KeyPatterns = {"allow_missing": ["bias"], "allow_unexpected": ["extra"]}
    source, plan = sdadapt.plan_load(model, str(path), **patterns)
    with source:
        assert plan.report.ok
    with pytest.raises(TypeError, match=r"^sdadapt\.diff\(\) got an unexpected keyword argument 'allow_mising'$"):
        sdadapt.diff(model, str(path), allow_mising=["bias"])  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"^sdadapt\.dry_run\(\) got an unexpected keyword argument 'strict'$"):
        sdadapt.dry_run(model, str(path), mesh="dp_shard=2", strict=False)  # type: ignore[call-arg]
