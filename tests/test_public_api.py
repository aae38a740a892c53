"""The public surface: what ``sdadapt.__all__`` lists, and where errors live."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import types
from pathlib import Path

import pytest

import sdadapt
import sdadapt.errors

SRC = Path(sdadapt.__file__).parent
ADAPTERS = Path(__file__).resolve().parents[1] / "adapters"
# sdadapt.torchtitan is public: torchtitan users import its state-dict adapter bridge by module
PUBLIC_MODULES = {"sdadapt", "sdadapt.errors", "sdadapt.sources", "sdadapt.rules", "sdadapt.cli", "sdadapt.adapters", "sdadapt.torchtitan"}


def _own_doc(obj: object) -> str:
    """The docstring ``obj`` itself carries (a class's own, not one inherited from a base)."""
    if isinstance(obj, type) or not (inspect.isroutine(obj) or hasattr(obj, "__wrapped__")):
        own = vars(obj).get("__doc__") if hasattr(obj, "__dict__") else None
        return own or ""
    return obj.__doc__ or ""


def _submodules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(sdadapt.__path__, "sdadapt."))


def test_all_lists_existing_unique_names():
    assert len(sdadapt.__all__) == len(set(sdadapt.__all__))
    missing = [n for n in sdadapt.__all__ if not hasattr(sdadapt, n)]
    assert missing == []


@pytest.mark.parametrize("name", sdadapt.__all__)
def test_public_name_has_a_docstring(name):
    assert _own_doc(getattr(sdadapt, name)).strip(), f"sdadapt.{name} has no docstring"


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


def test_every_error_is_public_and_an_sdadapt_error():
    errors = [obj for _, obj in inspect.getmembers(sdadapt.errors, inspect.isclass) if obj.__module__ == "sdadapt.errors"]
    assert len(errors) >= 10
    for cls in errors:
        assert issubclass(cls, sdadapt.SdadaptError) and issubclass(cls, Exception)
        assert cls.__name__ in sdadapt.__all__ and getattr(sdadapt, cls.__name__) is cls


def test_errors_keep_their_names_in_private_modules():
    from sdadapt._plan import resolve as _resolve
    from sdadapt._transaction import export as _export
    from sdadapt._transaction import state as _state

    assert _export.ExportError is sdadapt.ExportError
    assert _resolve.ResolveError is sdadapt.ResolveError
    assert _state.StateError is sdadapt.StateError
