"""The target schema: what the (possibly meta, possibly parallelised) model wants."""

from __future__ import annotations

import sys
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .._base.schema import MeshDim, TensorInfo


def model_state_dict(model: nn.Module, plain: bool | None = None) -> dict[str, torch.Tensor]:
    """``get_model_state_dict(model)`` restricted to tensors (DTensors stay sharded).

    Where ``get_model_state_dict`` can only return ``model.state_dict()`` unchanged (see
    :func:`renames_nothing`), that is called directly: it skips the per-key FQN search that
    costs ``get_model_state_dict`` most of its time (tens of ms for a few hundred keys).
    ``plain``: :func:`renames_nothing`'s answer for ``model``, where the caller has it."""
    if renames_nothing(model) if plain is None else plain:
        sd = model.state_dict()
    else:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict  # noqa: PLC0415 - wrapped models only

        sd = get_model_state_dict(model)
    return {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}


def load_targets(model: nn.Module, plain: bool | None = None) -> dict[str, torch.Tensor]:
    """The tensors a load writes into, under :func:`model_state_dict`'s keys. Where that is
    ``model.state_dict()`` (:func:`renames_nothing`): ``model.state_dict(keep_vars=True)``
    restricted to tensors, each value the model's own parameter or buffer rather than a detached
    alias of it (a DTensor's ``detach`` runs through DTensor's operator dispatch: most of
    ``state_dict``'s time for a model's hundreds of parameters); its hooks and modules' own
    ``_save_to_state_dict`` still run. Else :func:`model_state_dict`. Nobody keeps these values
    past the load: training code and refit read :func:`model_state_dict`, whose detached aliases
    share their parameters' version counters.

    Args:
        model: the model a load writes into.
        plain: :func:`renames_nothing`'s answer for ``model``, where the caller has it (a load
            asks it once: materialising changes no module); ``None``: asked here.

    Returns:
        ``key -> tensor`` for every tensor of the model's state dict.

    Example::

        targets = load_targets(model)  # the model's own parameters and buffers, by state-dict key
    """
    if not (renames_nothing(model) if plain is None else plain):
        return model_state_dict(model, False)
    return {k: v for k, v in model.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)}


def renames_nothing(model: nn.Module, modules: Iterable[nn.Module] | None = None) -> bool:
    """True when ``get_model_state_dict(model)`` is ``model.state_dict()`` as it is: no module
    whose keys it rewrites (DDP's ``module.``, ``torch.compile``'s ``_orig_mod.``, FSDP1 and its
    flat parameters, activation checkpointing's wrapper, modules with ``_fqn_modifiers``).
    ``modules``: ``model.modules()`` listed, where the caller has them."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    rewriting: tuple[type, ...] = (FullyShardedDataParallel, DistributedDataParallel)
    # torch.compile's wrapper exists only once dynamo is imported (importing it is slow)
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    if dynamo is not None:
        rewriting += (dynamo.OptimizedModule,)
    name = "_fqn_modifiers"
    # each class asked once: a model repeats a few classes over hundreds of modules
    cleared: set[type] = set()  # neither rewriting nor holding _fqn_modifiers, with nn.Module's __getattr__
    # every module once, each edge's name once (the names named_modules would join, without joining them)
    for mod in model.modules() if modules is None else modules:
        cls = type(mod)
        if cls not in cleared:
            if issubclass(cls, rewriting) or hasattr(cls, name):
                return False
            if cls.__getattr__ is nn.Module.__getattr__:
                cleared.add(cls)
            elif hasattr(mod, name):  # a __getattr__ of its own may answer it
                return False
        # hasattr(mod, name) for nn.Module's __getattr__, without its failing lookup (which builds a message)
        if name in mod.__dict__ or name in mod._parameters or name in mod._buffers or name in mod._modules:
            return False
        if mod._modules and any("_checkpoint_wrapped_module" in k for k in mod._modules):
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
