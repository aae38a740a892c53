"""The schema records every layer shares: what a tensor is without its data.

- :class:`TensorInfo` (global shape and dtype of a source's or a target's tensor) and
  :class:`MeshDim` (one dim of a target DTensor's mesh, with its placement);
- :class:`TensorLocation`: where a tensor stored contiguously lies in a file;
- :func:`dtype_name`: the dtype names rules, reports and JSON write;
- :func:`slices`: a box as index slices.

Sources build these from headers, targets from a model, the layers above read them; they live
here, at the bottom, so that none of those layers imports a checkpoint format to name them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .regions import Box


@dataclass(frozen=True)
class MeshDim:
    """One dim of the device mesh a target DTensor lives on, with its placement there.

    ``shard_dim`` is the tensor dim this mesh dim shards (``Shard`` or ``_StridedShard``), else
    ``None``; ``strided`` is true for ``_StridedShard`` (FSDP2 over a TP-sharded dim)."""

    name: str | None
    size: int
    placement: str
    shard_dim: int | None = None
    strided: bool = False


@dataclass(frozen=True)
class TensorInfo:
    """Global shape and dtype of one tensor (of a source or of a target).

    Args:
        shape: the global shape.
        dtype: the ``torch.dtype``.
        placements: a target DTensor's placements, as text (targets only).
        mesh: the same, structured (targets only).

    Example::

        info = sdadapt.sources.TensorInfo((4096, 4096), torch.bfloat16)
        report = sdadapt.diff({"w.weight": info}, "ckpt/model.safetensors")
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    placements: str | None = None  # target only: e.g. "(Shard(dim=0), Replicate())"
    mesh: tuple[MeshDim, ...] | None = None  # target DTensors only: the same, structured

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


def dtype_name(dtype: torch.dtype) -> str:
    """The name sdadapt writes for a dtype (in rules, reports and JSON).

    Args:
        dtype: a ``torch.dtype``.

    Returns:
        Its name without the ``torch.`` prefix.

    Example::

        assert sdadapt.sources.dtype_name(torch.bfloat16) == "bfloat16"
    """
    return str(dtype).removeprefix("torch.")


def slices(box: Box) -> tuple[slice, ...]:
    """``box`` as the index of a tensor: one ``slice(start, stop)`` per dim."""
    return tuple(slice(a, b) for a, b in box)


@dataclass(frozen=True)
class TensorLocation:
    """A source tensor stored contiguously (row-major) at byte ``offset`` of file ``path``."""

    path: str
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype
