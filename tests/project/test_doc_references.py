"""Every Sphinx-style cross-reference (``:mod:``, ``:class:``, ``:func:``, ``:meth:``, ``:data:``,
``:attr:``, ``:exc:``) in the docstrings and comments of ``src/sdadapt`` and ``adapters/``, and in
README.md and docs/*.md, names something that exists: a module that imports, and an attribute
found on it. A name without a module is looked up where the reference stands: the module's own
names (imports under ``TYPE_CHECKING`` included), then the attributes of its classes (a
``:meth:`` of the class it documents), then the public names of ``sdadapt`` and the error
classes of ``sdadapt.errors``.
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib
import inspect
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
ROLE = re.compile(r":(mod|class|func|meth|data|attr|exc):`([^`]+)`")


def _module_of(path: Path) -> str:
    if path.is_relative_to(ROOT / "adapters"):
        parts = ["sdadapt", "adapters", *path.relative_to(ROOT / "adapters").with_suffix("").parts]
    else:
        parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _target(text: str) -> str:
    """``~sdadapt.rules.Cast`` / ``Title <sdadapt.x>`` / ``load()`` -> the dotted name."""
    m = re.search(r"<([^>]+)>$", text)
    name = m.group(1) if m else text
    return name.strip().lstrip("~!").removesuffix("()")


def _import_longest(dotted: str) -> tuple[Any, list[str]] | None:
    """The longest importable module prefix of ``dotted`` and the names left after it."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            mod = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        return mod, parts[i:]
    return None


def _walk(obj: Any, names: list[str]) -> bool:
    for n in names:
        if not hasattr(obj, n):
            ann = getattr(obj, "__annotations__", {}) if isinstance(obj, type) else {}
            fields = getattr(obj, "model_fields", {}) or getattr(obj, "__dataclass_fields__", {})
            return n in ann or n in fields or _instance_attribute(obj, n)  # a field or an attribute set in a method
        obj = getattr(obj, n)
    return True


def _instance_attribute(obj: Any, name: str) -> bool:
    """``name`` is set as ``self.<name>`` in a method of class ``obj`` (or of a base class)."""
    if not isinstance(obj, type):
        return False
    for cls in obj.__mro__:
        source = _class_source(cls)
        if source is not None and re.search(rf"\bself\.{re.escape(name)}\s*(:[^=]+)?=", source):
            return True
    return False


@functools.cache
def _class_source(cls: type) -> str | None:
    """A class's source (None where it has none): read once, as many references ask about one class."""
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return None


def _is_package(name: str) -> bool:
    return hasattr(importlib.import_module(name), "__path__")


def _imported_names(module: ModuleType) -> dict[str, str]:
    """``name -> dotted target`` of every import in the module's source (``TYPE_CHECKING`` ones too)."""
    return _imports_of(module.__name__, getattr(module, "__file__", None))


@functools.cache
def _imports_of(name: str, path: str | None) -> dict[str, str]:
    """:func:`_imported_names` of the module ``name`` at ``path``, parsed once."""
    if not path:
        return {}
    out: dict[str, str] = {}
    pkg = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(Path(path).read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")
                up = up[: len(up) - node.level + 1]
                base = ".".join([*up, base]) if base else ".".join(up)
            for a in node.names:
                out[a.asname or a.name] = f"{base}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
    return out


def resolves(target: str, where: str | None) -> bool:
    if target.startswith("."):  # relative to the package of the module it stands in
        if where is None:
            return False
        dots = len(target) - len(target.lstrip("."))
        base = where.split(".")
        base = base[: len(base) - dots] if not _is_package(where) else base[: len(base) - dots + 1]
        return resolves(".".join([*base, target.lstrip(".")]), None)
    if where is not None:
        module = importlib.import_module(where)
        head, *rest = target.split(".")
        if head in vars(module):
            return _walk(getattr(module, head), rest)
        imported = _imported_names(module)
        if head in imported:
            return resolves(".".join([imported[head], *rest]), None)
        for value in vars(module).values():  # a method or attribute of one of its classes
            if isinstance(value, type) and value.__module__ == module.__name__ and _walk(value, [head, *rest]):
                return True
        if where.startswith("sdadapt.") and any(resolves(f"{pkg}.{target}", None) for pkg in ("sdadapt", "sdadapt.errors")):
            return True  # a public name or an error class written without its module
    if "." not in target and hasattr(builtins, target):
        return True  # OSError, ValueError...
    found = _import_longest(target)
    return found is not None and _walk(found[0], found[1])


def _references() -> list[tuple[str, str, str | None]]:
    refs: list[tuple[str, str, str | None]] = []
    for path in sorted([*(SRC / "sdadapt").rglob("*.py"), *(ROOT / "adapters").glob("*.py")]):
        text = path.read_text()
        for m in ROLE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            refs.append((f"{path.relative_to(ROOT)}:{line}", _target(m.group(2)), _module_of(path)))
    for path in sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")]):
        text = path.read_text()
        for m in ROLE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            refs.append((f"{path.relative_to(ROOT)}:{line}", _target(m.group(2)), None))
    return refs


REFS = _references()


def test_there_are_references_to_check() -> None:
    assert len(REFS) > 300


def test_every_reference_names_something_that_exists() -> None:
    broken = [f"{where}: {target}" for where, target, module in REFS if not resolves(target, module)]
    assert not broken, "references to names that do not exist:\n" + "\n".join(broken)


@pytest.mark.parametrize(
    ("target", "where", "ok"),
    [("sdadapt.rules.Cast", None, True), ("sdadapt.rules._nowhere", None, False),
     ("DequantScaled", "sdadapt.rules._quant_detect", True), ("TensorInfo", "sdadapt.rules._quant_detect", True),
     ("NoSuchThing", "sdadapt.rules._quant_detect", False), ("errors.AdapterError", "sdadapt.rules", True)],  # fmt: skip
)
def test_the_resolver_itself(target: str, where: str | None, ok: bool) -> None:
    assert resolves(target, where) is ok
