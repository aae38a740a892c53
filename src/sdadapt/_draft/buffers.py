"""Values for the non-persistent buffers of the numerical check's model copy.

The draft's numerical check (:mod:`.numeric`) loads candidates into a shrunken copy of the
target model. A target built on the meta device gets real memory with ``to_empty``, which
gives its non-persistent buffers (rotary ``freqs_cis`` / ``inv_freq`` tables, masks) no values;
they are not in the state dict, so no load fills them. A copy running on such garbage makes
every candidate agree alike, or none agree, and the experiment would prove nothing.

So the buffers are first set to NaN (an integer buffer to its dtype's smallest value), then
filled by the first way that exists, in this order: the caller's ``init_buffers(model)``; the
copy's own ``init_weights()`` (torchtitan's and transformers' convention), ``init_buffers()``
or ``reset_parameters()``; the same methods of each module that owns a buffer still unfilled;
and last ``rebuild()``, a model built again off the meta device (its parameters stay on meta,
see :func:`parameters_on_meta`) whose buffers are copied by name. A buffer that still holds the
marker afterwards stops the check with :class:`~sdadapt.errors.ModelError` naming it and what
to pass.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._base.keyruns import compress
from ..errors import ModelError

log = logging.getLogger(__name__)

OWN_METHODS = ("init_weights", "init_buffers", "reset_parameters")
"""Methods of a model (or of a module owning a buffer) that compute its buffers, in the order tried."""


def _mark(t: torch.Tensor) -> None:
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(False)
    else:
        t.fill_(torch.iinfo(t.dtype).min)


def _marked(t: torch.Tensor) -> bool:
    """Whether ``t`` still holds :func:`_mark`'s value everywhere (a buffer nothing filled)."""
    if t.numel() == 0 or t.dtype == torch.bool:
        return False
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(t).all())
    return bool((t == torch.iinfo(t.dtype).min).all())


@dataclass(frozen=True)
class Check:
    """How :func:`sdadapt.draft`'s numerical check builds its copies: ``reference``, ``layers`` and
    ``init_buffers`` as that function takes them, built once there (or by the CLI) and handed down;
    ``rebuild()``, the target built again, is the CLI's (its ``--target`` function)."""

    reference: str | Callable[[dict[str, Any]], nn.Module] | None = "auto"
    layers: int = 2
    init_buffers: Callable[[nn.Module], None] | None = None
    rebuild: Callable[[], nn.Module] | None = None


def _call(fn: Callable[[], Any]) -> None:
    with torch.no_grad():
        fn()


def fill_buffers(model: nn.Module, names: list[str], check: Check) -> str:
    """Give the non-persistent buffers ``names`` of ``model`` (just materialised with ``to_empty``)
    values, as the module docstring says; returns how (for the summary). Raises ``ModelError``
    naming the buffers left without values."""
    if not names:
        return ""
    for n in names:
        _mark(model.get_buffer(n))

    def left() -> list[str]:
        return [n for n in names if _marked(model.get_buffer(n))]

    init_buffers, rebuild = check.init_buffers, check.rebuild
    if init_buffers is not None:
        _call(lambda: init_buffers(model))
        if not left():
            return "init_buffers"
    else:
        for method in OWN_METHODS:
            fn = getattr(model, method, None)
            if callable(fn):
                _call(fn)
                if not left():
                    return f"the model's {method}()"
                break
    used = []
    for owner in sorted({n.rpartition(".")[0] for n in left()}):
        mod = model.get_submodule(owner) if owner else model
        fn = next((getattr(mod, m) for m in OWN_METHODS if callable(getattr(mod, m, None))), None)
        if fn is not None and mod is not model:
            _call(fn)
            used.append(f"{owner}.{fn.__name__}()")
    if used and not left():
        return ", ".join(used)
    if rebuild is not None and left():
        with parameters_on_meta():
            fresh = rebuild()
        theirs = dict(fresh.named_buffers())
        for n in left():
            got = theirs.get(n)
            if got is not None and not got.is_meta and tuple(got.shape) == tuple(model.get_buffer(n).shape):
                with torch.no_grad():
                    model.get_buffer(n).copy_(got)
        if not left():
            return "the model built again off the meta device"
    missing = left()
    if missing:
        tried = "init_buffers" if init_buffers is not None else "the model's " + "/".join(OWN_METHODS)
        raise ModelError(
            f"the model's copy for the numerical check has non-persistent buffers {', '.join(compress(missing))} "
            f"without values: they are not in the state dict and {tried} did not compute them (the model was "
            "built on the meta device). Pass init_buffers=fn(model) computing them (the CLI's --init-buffers "
            "module:function), or skip the check (reference=None, the CLI's --reference none)"
        )
    return ", ".join(used) or "the model"


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Build modules with their parameters on the meta device and their buffers where they are
    computed (``nn.Module.register_parameter`` moves each parameter to meta as it is set): a
    model built this way costs its buffers only."""
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(self, name, param)
        p = self._parameters.get(name)
        if p is not None and not p.is_meta:
            self._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]
