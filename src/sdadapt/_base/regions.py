"""Regions of tensors: a box is a tuple of ``(start, stop)`` pairs, one per dimension, in global
coordinates. Sources read boxes, recipes map boxes of their output to boxes of their inputs;
:func:`shard_box` is the box a rank's shard of a tensor is, by DTensor's own rule."""

from __future__ import annotations

import functools
import math
from typing import Any

Box = tuple[tuple[int, int], ...]


def full_box(shape: tuple[int, ...]) -> Box:
    """The box that covers a whole tensor of ``shape``."""
    return tuple((0, n) for n in shape)


def box_shape(box: Box) -> tuple[int, ...]:
    """The shape of the region ``box``."""
    return tuple(b - a for a, b in box)


def box_inside(box: Box, outer: Box) -> bool:
    """Whether region ``box`` lies within region ``outer``."""
    return all(o0 <= a and b <= o1 for (a, b), (o0, o1) in zip(box, outer, strict=True))


def intersect(a: Box, b: Box) -> Box | None:
    """The common region of two boxes, or ``None``."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return None if any(s >= e for s, e in out) else out


def shard_box(shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: tuple[int, ...], placements: tuple[Any, ...]) -> Box | None:
    """The box of a tensor of global ``shape`` that the rank at ``coordinate`` of a mesh of
    ``mesh_shape`` holds under ``placements`` (one per mesh dim), by DTensor's own offset rule
    (``torch.distributed.tensor._utils._compute_local_shape_and_global_offset``: uneven and empty
    shards included). ``None`` where the rank's shard is not one box: a placement other than
    ``Shard``, ``_StridedShard`` and ``Replicate``, or a ``_StridedShard`` other than FSDP over a
    TP-sharded dim as torchtitan's 2-D layout places it (``_StridedShard(d, split_factor=s)``
    first on dim ``d``, where the later mesh dims that ``Shard(d)`` have ``s`` ranks in all).
    The one box function of export, refit and the dry run."""
    return _shard_box(tuple(shape), tuple(mesh_shape), tuple(coordinate), tuple(placements))


@functools.lru_cache(maxsize=1 << 16)
def _shard_box(shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: tuple[int, ...], placements: tuple[Any, ...]) -> Box | None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    if not all(isinstance(p, (Shard, _StridedShard, Replicate)) for p in placements):
        return None
    for d in range(len(shape)):
        cuts = [i for i, p in enumerate(placements) if isinstance(p, (Shard, _StridedShard)) and p.dim == d]
        strided = [i for i in cuts if isinstance(placements[i], _StridedShard)]
        if strided and (
            len(strided) > 1 or strided[0] != cuts[0] or placements[strided[0]].split_factor != math.prod(mesh_shape[j] for j in cuts[1:])
        ):
            return None
    if not placements:
        return full_box(shape)
    local, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coordinate), list(placements))
    return tuple((o, o + n) for o, n in zip(offset, local, strict=True))


def dtensor_box(t: Any) -> Box | None:
    """:func:`shard_box` of DTensor ``t`` on this rank, or ``None`` (not one box, or this rank is
    not on its mesh)."""
    mesh = t.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    box = shard_box(tuple(t.shape), tuple(mesh.shape), tuple(coordinate), tuple(t.placements))
    return box if box is not None and box_shape(box) == tuple(t._local_tensor.shape) else None
