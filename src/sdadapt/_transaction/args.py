"""Argument checks shared by the public entry points: a model and a checkpoint path passed in
each other's place is said to be swapped, with the call's signature, before anything runs."""

from __future__ import annotations

import os
from typing import Any

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
            f"call {call}"
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
