"""Refit through a user-supplied send function: the engine is not in the trainer's process group
(another cluster, a vLLM server reached over its own channel), so each trainer rank makes the
regions of the engine's whole tensors that it can make from the shards it owns and hands them to
``send`` in buckets, ``[(engine key, global box, piece), ...]``.

Which rank makes which region is :mod:`~sdadapt._export.export_local`'s rule (of replicated shards, one rank owns
each; a region whose recipe reads several ranks' shards is cut until each part reads one rank's),
decided once at planning. The pieces are views of one buffer of at most ``bucket_bytes``, reused
after ``send`` returns: a send function copies them or finishes with them before it returns.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .._base.regions import Box, box_shape, full_box
from .._export import owned_shard, regions
from .._recipes.nodes import Node
from ..errors import ExportError, RefitError
from .refit_schedule import ALIGN

SendFn = Callable[[list[tuple[str, Box, torch.Tensor]]], None]
"""``send(bucket)``: ``bucket`` is a list of ``(engine key, global box, piece)``; the pieces are
views of a buffer reused once ``send`` returns."""


@dataclass(frozen=True)
class Region:
    """Region ``box`` of engine tensor ``key``, made on this rank, ``nbytes`` in the bucket."""

    key: str
    box: Box
    nbytes: int


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _fit(key: str, box: Box, item: int, bucket: int) -> list[Region]:
    """``box`` cut along its first dim into regions of at most ``bucket`` bytes (aligned)."""
    shape = box_shape(box)
    n = math.prod(shape) * item
    if _aligned(n) <= bucket:
        return [Region(key, box, n)]
    row = math.prod(shape[1:]) * item
    if len(shape) < 2 or _aligned(row) > bucket:
        raise RefitError(
            f"bucket_bytes={bucket} is too small for one row of engine tensor {key!r} ({row} bytes); "
            f"give bucket_bytes of at least {_aligned(max(row, item))}"
        )
    per = bucket // _aligned(row) if row % ALIGN else bucket // row
    (a, b), rest = box[0], box[1:]
    return [Region(key, ((s, min(b, s + per)),) + rest, min(b - s, per) * row) for s in range(a, b, per)]


def plan_regions(
    trainer: dict[str, torch.Tensor], dtypes: dict[str, torch.dtype], recipes: dict[str, Node], rank: int, bucket: int
) -> list[Region]:
    """The regions of every engine tensor this rank makes from the trainer shards it owns
    (``trainer``: the tensors whose copy here counts, that of the lowest rank among copies; ``dtypes``: every trainer
    tensor's, held here or not)."""
    owned: dict[str, Box] = {}
    for k, t in trainer.items():
        got = owned_shard(t, 0, k, copy=False)  # a plain tensor here is the copy that counts
        if got is not None:
            owned[k] = got[0]
    out: list[Region] = []
    for key in sorted(recipes):
        node = recipes[key]
        try:
            boxes = list(regions(node, full_box(tuple(node.shape)), owned, dtypes, rank, key))
        except ExportError:
            raise RefitError(
                f"send=: engine tensor {key!r} has an element made from values several trainer ranks hold (a computed "
                "recipe, such as an FP8 block, across shards), which no one rank can make; put the engine's ranks in "
                "the process group instead (engine=...), or shard the trainer along the block boundaries"
            ) from None
        for box in boxes:
            out += _fit(key, box, node.dtype.itemsize, bucket)
    return out


class LocalShards:
    """A source reading this rank's trainer shards (global boxes), on their device."""

    def __init__(self, local: dict[str, torch.Tensor], boxes: dict[str, Box], device: torch.device):
        self.local, self.boxes, self.device = local, boxes, device

    def read(self, key: str, box: Box) -> torch.Tensor:
        origin = self.boxes[key]
        return self.local[key][tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(box, origin, strict=True))]


def send_regions(
    todo: list[Region], recipes: dict[str, Node], io: LocalShards, send: SendFn, bucket: int, done: set[str]
) -> tuple[int, int, int]:
    """Make ``todo`` into buckets and send each, adding to ``done`` each engine key whose regions
    here are all sent; returns (bytes sent, buckets, the buffer's bytes)."""
    if not todo:
        return 0, 0, 0
    left: dict[str, int] = {}
    for r in todo:
        left[r.key] = left.get(r.key, 0) + 1
    size = min(bucket, sum(_aligned(r.nbytes) for r in todo))  # each region fits the bucket (plan_regions)
    buffer = torch.empty(size, dtype=torch.uint8, device=io.device)
    pending: list[tuple[str, Box, torch.Tensor]] = []
    offset = sent = calls = 0

    def flush() -> None:
        send(pending)
        for key, _, _ in pending:
            left[key] -= 1
            if left[key] == 0:
                done.add(key)

    for r in todo:
        if offset + _aligned(r.nbytes) > size:
            flush()
            pending, offset, calls = [], 0, calls + 1
        node = recipes[r.key]
        dest = buffer[offset : offset + r.nbytes].view(node.dtype).view(box_shape(r.box))
        for step in node.steps(r.box, dest):
            step.run(io)
        pending.append((r.key, r.box, dest))
        offset += _aligned(r.nbytes)
        sent += r.nbytes
    flush()
    return sent, calls + 1, size


__all__ = ["LocalShards", "Region", "SendFn", "plan_regions", "send_regions"]
