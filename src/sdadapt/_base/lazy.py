"""Lazy public modules: one table of ``name -> module`` per public module, imported on first use.

A public module (``sdadapt``, ``sdadapt.rules``, ``sdadapt.reports``) keeps one table of the names
it shows and the private module each lives in, and one table of the names it no longer shows
with their new spelling. :func:`attach` turns them into the module's ``__getattr__``,
``__dir__`` and ``__all__``: a name's module is imported when the name is first used (so that
``import sdadapt`` does not import torch), and an old name raises an :class:`AttributeError`
that says how it is spelled now (an :class:`ImportError` saying the same in a ``from sdadapt
import ...`` statement, which would otherwise report only "cannot import name"). Type checkers read the same names from the module's
``TYPE_CHECKING`` imports, which a test compares with the table.
"""

from __future__ import annotations

import dis
import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

from .gc import gc_paused


def attach(
    package: str,
    table: Mapping[str, str],
    moved: Mapping[str, str] | None = None,
    submodules: tuple[str, ...] = (),
) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """``__getattr__``, ``__dir__`` and ``__all__`` for module ``package``.

    Args:
        package: the public module's name (``__name__``).
        table: public name -> the module that defines it, relative to ``package`` (``"._plan.adapter"``)
            or absolute (``"sdadapt.errors"``).
        moved: old name -> its new spelling, for names the module no longer shows.
        submodules: public submodules reachable as attributes without their own import
            (``sdadapt.errors.PlanError`` after ``import sdadapt``); not in ``__all__``.

    Returns:
        ``(__getattr__, __dir__, __all__)`` to assign in the module; ``__all__`` is the table's names
        in its order.
    """
    moved = dict(moved or {})

    def __getattr__(name: str) -> Any:
        where = table.get(name)
        if where is None and name in submodules:
            return _imported(f"{package}.{name}", package)  # importing sets the attribute
        if where is None:
            if name in moved:
                if _importing_from(sys._getframe(1)):
                    # ``from sdadapt import Rename`` would turn an AttributeError into a bare
                    # "cannot import name" and drop the new spelling: say it in the ImportError
                    raise ImportError(f"cannot import name {name!r} from {package!r}: it is spelled {moved[name]} now", name=package)
                raise AttributeError(f"module {package!r} has no attribute {name!r}: it is spelled {moved[name]} now")
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = _imported(where, package)
        value = getattr(module, name)
        setattr(sys.modules[package], name, value)  # cached: the next access is a plain attribute
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *table, *submodules})

    return __getattr__, __dir__, list(table)


def _imported(where: str, package: str) -> Any:
    """The module ``where`` (relative to ``package`` when it starts with a dot), imported with the
    cycle collector paused. Importing a public name's modules makes many objects that live as
    long as the process (classes, functions, pydantic's schemas): enough to set off a full
    collection, which walks every object of the process (torch's too), in the middle of the
    import, the first load's critical path. Such a collection frees nothing of the import's, nor
    does one of the youngest generation: the pause ends with the import's objects moved to the
    oldest generation (``long_lived``, see ``sdadapt._base.gc``), and a full collection the
    process owes runs in the caller's code later, not as the import returns."""
    with gc_paused(long_lived=True):
        return importlib.import_module(where, package) if where.startswith(".") else importlib.import_module(where)


_IMPORT_FROM = dis.opmap["IMPORT_FROM"]


def _importing_from(frame: Any) -> bool:
    """Whether ``frame`` is running a ``from module import name`` statement right now (the
    instruction it stopped at is ``IMPORT_FROM``); ``False`` when that cannot be told."""
    try:
        return bool(frame.f_code.co_code[frame.f_lasti] == _IMPORT_FROM)
    except (AttributeError, IndexError, TypeError):
        return False
