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
    :func:`renames_nothing`), that is called directly: it skips the per-key FQN search that
    costs ``get_model_state_dict`` most of its time (tens of ms for a few hundred keys)."""
    if renames_nothing(model):
        sd = model.state_dict()
    else:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict  # noqa: PLC0415 - wrapped models only

        sd = get_model_state_dict(model)
    return {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}


def renames_nothing(model: nn.Module) -> bool:
    """True when ``get_model_state_dict(model)`` is ``model.state_dict()`` as it is: no module
    whose keys it rewrites (DDP's ``module.``, ``torch.compile``'s ``_orig_mod.``, FSDP1 and its
    flat parameters, activation checkpointing's wrapper, modules with ``_fqn_modifiers``)."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    rewriting: tuple[type, ...] = (FullyShardedDataParallel, DistributedDataParallel)
    # torch.compile's wrapper exists only once dynamo is imported (importing it is slow)
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    if dynamo is not None:
        rewriting += (dynamo.OptimizedModule,)
    for name, mod in model.named_modules(remove_duplicate=False):
        if isinstance(mod, rewriting) or hasattr(mod, "_fqn_modifiers") or "_checkpoint_wrapped_module" in name:
            return False
    return True


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
