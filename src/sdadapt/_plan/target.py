"""The target schema: what the (possibly meta, possibly parallelised) model wants."""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .._base.schema import MeshDim, TensorInfo


def model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``get_model_state_dict(model)`` restricted to tensors (DTensors stay sharded).

    Where ``get_model_state_dict`` can only return ``model.state_dict()`` unchanged (see
    :func:`renames_nothing`), that is made directly: it skips the per-key FQN search that
    costs ``get_model_state_dict`` most of its time (tens of ms for a few hundred keys), and
    where no module saves its state its own way, ``state_dict`` itself (:func:`_plain_state_dict`)."""
    walked = _plain_state_dict(model)
    if walked is not None:
        return walked
    if renames_nothing(model):
        sd = model.state_dict()
    else:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict  # noqa: PLC0415 - wrapped models only

        sd = get_model_state_dict(model)
    return {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}


_SAVING = (nn.Module.state_dict, nn.Module._save_to_state_dict, nn.Module.get_extra_state)


def _plain_state_dict(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """``model.state_dict()``'s keys and tensors, made without it, or ``None`` where they could
    differ or ``get_model_state_dict`` would rename keys (:func:`renames_nothing`): a module with
    state-dict hooks (FSDP2 registers one on its first forward), or whose class saves its state
    its own way. The same walk (pre-order, duplicates kept), each
    parameter and persistent buffer detached; a DTensor's detached alias is built from its parts
    (its local tensor detached, its spec kept), which is what ``detach`` gives through DTensor's
    operator dispatch at a fraction of the cost, for each of a model's hundreds of parameters."""
    out: dict[str, torch.Tensor] = {}
    rewriting = _rewriting()
    for prefix, mod in model.named_modules(remove_duplicate=False):
        cls = type(mod)
        if mod._state_dict_hooks or mod._state_dict_pre_hooks or (
            cls.state_dict, cls._save_to_state_dict, cls.get_extra_state) != _SAVING or _rewrites(prefix, mod, rewriting):  # fmt: skip
            return None
        dot = prefix + "." if prefix else ""
        for name, p in mod._parameters.items():
            if p is not None:
                out[dot + name] = _detached(p)
        skip = mod._non_persistent_buffers_set
        for name, b in mod._buffers.items():
            if b is not None and name not in skip:
                out[dot + name] = _detached(b)
    return out


def _detached(t: torch.Tensor) -> torch.Tensor:
    if type(t) is DTensor:
        return DTensor(t._local_tensor.detach(), t._spec, requires_grad=False)
    return t.detach()


def renames_nothing(model: nn.Module) -> bool:
    """True when ``get_model_state_dict(model)`` is ``model.state_dict()`` as it is: no module
    whose keys it rewrites (DDP's ``module.``, ``torch.compile``'s ``_orig_mod.``, FSDP1 and its
    flat parameters, activation checkpointing's wrapper, modules with ``_fqn_modifiers``)."""
    rewriting = _rewriting()
    return not any(_rewrites(name, mod, rewriting) for name, mod in model.named_modules(remove_duplicate=False))


def _rewriting() -> tuple[type, ...]:
    """The module classes whose keys ``get_model_state_dict`` rewrites."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    rewriting: tuple[type, ...] = (FullyShardedDataParallel, DistributedDataParallel)
    # torch.compile's wrapper exists only once dynamo is imported (importing it is slow)
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    if dynamo is not None:
        rewriting += (dynamo.OptimizedModule,)
    return rewriting


def _rewrites(name: str, mod: nn.Module, rewriting: tuple[type, ...]) -> bool:
    return isinstance(mod, rewriting) or hasattr(mod, "_fqn_modifiers") or "_checkpoint_wrapped_module" in name


def schema_of(state_dict: dict[str, torch.Tensor]) -> dict[str, TensorInfo]:
    """The :class:`TensorInfo` of every tensor of ``state_dict``. A model's parameters share a
    few (mesh, placements) pairs, so each pair's placements and mesh dims are worked out once."""
    out = {}
    # keyed by the mesh's id: ``state_dict`` keeps every tensor, and so its mesh, alive meanwhile
    layouts: dict[tuple[int, tuple[object, ...]], tuple[str, tuple[MeshDim, ...]]] = {}
    for k, t in state_dict.items():
        placements: str | None = None
        mesh: tuple[MeshDim, ...] | None = None
        if isinstance(t, DTensor):
            key = (id(t.device_mesh), tuple(t.placements))
            if (layout := layouts.get(key)) is None:
                layout = layouts[key] = (str(key[1]), mesh_dims(t))
            placements, mesh = layout
        out[k] = TensorInfo(tuple(t.shape), t.dtype, placements, mesh)
    return out


def mesh_dims(t: DTensor) -> tuple[MeshDim, ...]:
    """The mesh dims of ``t`` with their names, sizes and the tensor dim each one shards."""
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    names = t.device_mesh.mesh_dim_names or (None,) * t.device_mesh.ndim
    dims = []
    for i, p in enumerate(t.placements):
        strided = isinstance(p, _StridedShard)
        shard = p.dim if isinstance(p, (Shard, _StridedShard)) else None
        dims.append(MeshDim(names[i], t.device_mesh.size(i), str(p), shard, strided))
    return tuple(dims)


def is_meta(t: torch.Tensor) -> bool:
    return (t._local_tensor if isinstance(t, DTensor) else t).is_meta


def local_nbytes(t: torch.Tensor) -> int:
    local = t._local_tensor if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()
