"""The model's and optimizer's state dicts for a background save, taken again cheaply.

``get_state_dict`` finds every parameter's canonical name by walking the module tree, which
costs far more than listing the parameters; a background save (``save_state(...,
async_=True)``) would hold training for that walk at every save. :func:`take_state` runs it
once per model and optimizer and remembers which live tensor each key names and which name
each optimizer parameter has. A later save reuses that while the model's parameters and
buffers are the same tensors at the same memory (a fingerprint: one pass over the modules,
each tensor's identity, data pointer and shape) and the optimizer holds the same parameters;
the optimizer's state is always read afresh (``optimizer.state_dict()``, whose per-parameter
dicts are the live ones), so a changed learning rate or a new state entry is never missed.

The first take skips that walk too where ``get_state_dict``'s names are the ones
``model.state_dict()`` already has (no module renames keys: no DDP, ``torch.compile``, FSDP1 or
activation-checkpointing wrapper) and the optimizer's state exists (``get_state_dict`` would
create it first): the model's dict holds the live tensors under ``model.state_dict()``'s keys
(found as it finds them, after its pre-hooks, without a ``detach()`` each) and each optimizer
parameter is named by ``model.named_parameters()``, as ``get_state_dict`` names it.

A model whose state dict is not just its tensors is taken in full every time: a module with
``get_extra_state``, a ``state_dict`` hook other than FSDP2's (which only reshards, and a
fingerprint taken while parameters are unsharded differs anyway), FSDP1 (its state dict
gathers), or keys that name no live tensor.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .._plan.target import renames_nothing
from .._transaction import has_meta

_FSDP2_HOOK = "to_sharded_hook"  # fully_shard's state-dict pre-hook: moves parameters to their sharded form


@dataclass
class _Taken:
    fingerprint: tuple[Any, ...]
    tensors: dict[str, weakref.ref[torch.Tensor]]  # model state dict key -> the live parameter or buffer
    optimizer: weakref.ref[torch.optim.Optimizer] | None
    names: tuple[str, ...]  # the optimizer's parameters in param_groups order -> their state dict names


_TAKEN: weakref.WeakKeyDictionary[nn.Module, _Taken] = weakref.WeakKeyDictionary()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


Live = dict[tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype], torch.Tensor]


def _fingerprint(model: nn.Module, optimizer: torch.optim.Optimizer | None, live: Live | None = None) -> tuple[Any, ...] | None:
    """What must stay the same for a remembered state dict to still describe ``model``: every
    parameter's and buffer's identity, data pointer and shape, and the optimizer's parameters.
    ``None`` when the model's state dict holds more than its tensors (never remembered). In the
    same pass, ``live`` (when given) gets every tensor by its memory (pointer, shape, stride,
    dtype)."""
    from torch.distributed.fsdp import FullyShardedDataParallel  # noqa: PLC0415 - loaded with torch.distributed

    seen: list[Any] = []
    for m in model.modules():
        if isinstance(m, FullyShardedDataParallel) or m._state_dict_hooks:
            return None
        if type(m).get_extra_state is not nn.Module.get_extra_state:
            return None
        if any(getattr(h, "__name__", "") != _FSDP2_HOOK for h in m._state_dict_pre_hooks.values()):
            return None
        for t in itertools.chain(m._parameters.values(), m._buffers.values()):
            if t is None:
                seen.append(None)
            else:
                local = _local(t)
                ptr, shape = local.data_ptr(), tuple(local.shape)
                seen.append((id(t), ptr, shape))
                if live is not None:
                    live[(ptr, shape, local.stride(), local.dtype)] = t
    params = () if optimizer is None else tuple(id(p) for g in optimizer.param_groups for p in g["params"])
    return (tuple(seen), id(optimizer), params)


def _remember(model: nn.Module, optimizer: torch.optim.Optimizer | None, model_sd: dict[str, Any],
              optim_sd: dict[str, Any] | None, seen: tuple[tuple[Any, ...], Live] | None = None) -> None:  # fmt: skip
    """Remember which live tensor each of ``model_sd``'s keys is (matched by memory) and each
    optimizer parameter's name, unless the state holds anything else. ``seen``: the fingerprint
    and live tensors the take found, where it found them (else found here)."""
    _TAKEN.pop(model, None)
    live: Live = {}
    fingerprint = _fingerprint(model, optimizer, live) if seen is None else seen[0]
    if seen is not None:
        live = seen[1]
    if fingerprint is None:
        return
    tensors: dict[str, weakref.ref[torch.Tensor]] = {}
    for key, value in model_sd.items():
        if not isinstance(value, torch.Tensor):
            return
        local = _local(value)
        found = live.get((local.data_ptr(), tuple(local.shape), local.stride(), local.dtype))
        if found is None or isinstance(found, DTensor) != isinstance(value, DTensor):
            return
        tensors[key] = weakref.ref(found)
    names: tuple[str, ...] = ()
    if optimizer is not None:
        assert optim_sd is not None
        names = tuple(n for g in optim_sd["param_groups"] for n in g["params"])
        if len(names) != len(fingerprint[2]) or not all(isinstance(n, str) for n in names):
            return
    _TAKEN[model] = _Taken(fingerprint, tensors, weakref.ref(optimizer) if optimizer is not None else None, names)


def _first(model: nn.Module, optimizer: torch.optim.Optimizer | None, live: Live
           ) -> tuple[dict[str, Any], dict[str, Any] | None, tuple[Any, ...]] | None:  # fmt: skip
    """``get_state_dict(model, optimizer)`` without its per-key name search, where its names are
    the state dict's own (see the module docstring), with the model's fingerprint (``live``
    gets its tensors: :func:`_fingerprint`); ``None`` elsewhere, and where one of those tensors
    is on the meta device (``has_meta``, asked before any hook runs: the full take's check,
    ``has_meta`` of the model, raises it)."""
    if optimizer is None or not optimizer.state:
        return None
    fingerprint = _fingerprint(model, optimizer, live)
    if fingerprint is None or has_meta(live.values()) or not renames_nothing(model):
        return None
    model_sd = _live_state_dict(model, "", {})
    if model_sd is None:
        model_sd = model.state_dict()
    name_of = {id(p): n for n, p in model.named_parameters()}
    names = [name_of.get(id(p)) for g in optimizer.param_groups for p in g["params"]]
    if not model_sd or None in names:
        return None  # get_state_dict's own error (a parameter the model does not hold) comes from the full take
    return model_sd, _named(optimizer, names), fingerprint  # type: ignore[arg-type]


def _live_state_dict(module: nn.Module, prefix: str, out: dict[str, Any]) -> dict[str, Any] | None:
    """``module.state_dict(keep_vars=True)``: the live parameters and buffers under the same keys,
    without a ``detach()`` each (a DTensor's costs a dispatch), after the same pre-hooks (FSDP2's
    only: :func:`_fingerprint` checked); ``None`` where a module saves its state its own way."""
    if type(module).state_dict is not nn.Module.state_dict or type(module)._save_to_state_dict is not nn.Module._save_to_state_dict:
        return None
    for hook in module._state_dict_pre_hooks.values():
        hook(module, prefix, True)
    for name, p in module._parameters.items():
        if p is not None:
            out[prefix + name] = p
    for name, b in module._buffers.items():
        if b is not None and name not in module._non_persistent_buffers_set:
            out[prefix + name] = b
    for name, child in module._modules.items():
        if child is not None and _live_state_dict(child, f"{prefix}{name}.", out) is None:
            return None
    return out


def _named(optimizer: torch.optim.Optimizer, names: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """``optimizer.state_dict()`` (the live per-parameter dicts) with each parameter's index
    replaced by its name, as ``get_state_dict`` gives it."""
    osd = optimizer.state_dict()
    state = {names[i]: v for i, v in osd["state"].items()}
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in osd["param_groups"]]
    return {"state": state, "param_groups": groups}


def _again(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict[str, Any], dict[str, Any] | None] | None:
    """The state dicts from what was remembered, or ``None`` when anything moved."""
    taken = _TAKEN.get(model)
    if taken is None or (taken.optimizer() if taken.optimizer is not None else None) is not optimizer:
        return None
    if optimizer is not None and not optimizer.state:
        return None  # get_state_dict gives a fresh optimizer its state first
    if _fingerprint(model, optimizer) != taken.fingerprint:
        return None
    model_sd = {k: ref() for k, ref in taken.tensors.items()}
    if any(v is None for v in model_sd.values()):
        return None
    if optimizer is None:
        return model_sd, None
    return model_sd, _named(optimizer, taken.names)


def take_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, take: Any,
               check: Callable[[], None] | None = None) -> tuple[dict[str, Any], dict[str, Any] | None]:  # fmt: skip
    """``take(model, optimizer)`` (the full ``get_state_dict`` or ``model_state_dict``), or the
    same dicts rebuilt from the last call's while nothing they rest on moved, or made without
    ``get_state_dict``'s name search where it renames nothing. The values of the rebuilt model
    dict are the live parameters and buffers themselves (a copy reads them without autograd);
    its keys and the optimizer dict's layout are ``take``'s. ``check`` (that no tensor is on the
    meta device) runs before a full take; a rebuilt one rests on the tensors it checked (same
    objects, same memory), and the first take without the name search looks at each tensor
    itself, in its one pass over the modules."""
    again = _again(model, optimizer)
    if again is not None:
        return again
    live: Live = {}
    first = _first(model, optimizer, live)
    if first is None:
        if check is not None:
            check()
        model_sd, optim_sd = take(model, optimizer)
        _remember(model, optimizer, model_sd, optim_sd)
    else:  # its fingerprint was taken before FSDP2's pre-hooks ran; a hook that moved a tensor
        # leaves it unmatched below (nothing remembered) or the fingerprint unlike the next one
        model_sd, optim_sd, fingerprint = first
        _remember(model, optimizer, model_sd, optim_sd, (fingerprint, live))
    return model_sd, optim_sd


__all__ = ["take_state"]
