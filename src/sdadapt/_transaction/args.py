"""Argument checks shared by the public entry points, run before anything is read or written.

Every public function takes the model first, then the checkpoint (``load(model, src)``,
``load_state(model, src)``, ``save_state(model, dst)``, ``export(model, dst)``): a model and a
checkpoint path passed in each other's place are said to be swapped, with the call's signature.
A keyword that was renamed (:func:`renamed_keywords`) is refused with the new name, never
silently accepted. Every rank makes the same call, so every rank raises the same error before
any collective."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from torch import nn

from ..errors import UsageError


def _pathlike(x: Any) -> bool:
    from ..sources import Source

    return isinstance(x, (str, os.PathLike, Source))


def _show(x: Any) -> str:
    if isinstance(x, nn.Module):
        return f"a model ({type(x).__name__})"
    if isinstance(x, (str, os.PathLike)):
        return f"the path {os.fspath(x)!r}"
    return f"a {type(x).__name__}"


def check_model_and_path(call: str, model: Any, path: Any, *, model_arg: str = "model", path_arg: str = "src") -> None:
    """Raise :class:`UsageError` unless ``model`` is an ``nn.Module``. ``call`` is the signature
    to show (``"sdadapt.load(model, src, adapter=None, ...)"``); when ``path`` is the module and
    ``model`` a path, the message says the two are swapped."""
    if isinstance(model, nn.Module):
        return
    name = call.split("(", 1)[0]
    if isinstance(path, nn.Module) and _pathlike(model):
        raise UsageError(
            f"{name}: the arguments are swapped: {model_arg} got {_show(model)} and {path_arg} got {_show(path)}; "
            f"the model comes first, then the checkpoint: call {call}"
        )
    raise UsageError(f"{name}: {model_arg} must be a torch.nn.Module, not {_show(model)}; call {call}")


def check_not_a_model(call: str, path: Any, *, path_arg: str = "src", other: Any = None, other_arg: str = "target") -> None:
    """Raise :class:`UsageError` when ``path`` is an ``nn.Module`` (a checkpoint goes there); when
    ``other`` is then a path, the two are swapped."""
    if not isinstance(path, nn.Module):
        return
    name = call.split("(", 1)[0]
    if other is not None and _pathlike(other):
        raise UsageError(
            f"{name}: the arguments are swapped: {other_arg} got {_show(other)} and {path_arg} got {_show(path)}; "
            f"call {call}"
        )
    raise UsageError(f"{name}: {path_arg} must be a checkpoint path, not {_show(path)}; call {call}")


P = ParamSpec("P")
R = TypeVar("R")


def renamed_keywords(call: str, renamed: dict[str, tuple[str, str]]) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Refuse the old names of renamed keyword arguments: ``renamed`` maps an old name to its new
    name and what the new one does; a call passing an old name raises :class:`UsageError` naming
    the new keyword (before the function runs), instead of being accepted or failing with
    Python's bare ``unexpected keyword argument``. ``call`` is the public name shown
    (``"sdadapt.load"``). The wrapped function keeps its signature and docstring."""

    def wrap(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def checked(*args: P.args, **kwargs: P.kwargs) -> R:
            old = [k for k in renamed if k in kwargs]
            if old:
                said = "; ".join(
                    f"the keyword {k}= is now {renamed[k][0]}= ({renamed[k][1]}): call {call}(..., {renamed[k][0]}={kwargs[k]!r})"
                    for k in old
                )
                raise UsageError(f"{call}: {said}")
            return fn(*args, **kwargs)

        return checked

    return wrap
