"""The transfer schedule of a refit: which rank sends which region of which trainer tensor to
which engine rank, cut to fit the bucket and packed into rounds.

Every rank builds the same schedule from the same gathered metadata (what each rank holds, what
each engine rank asks for), so no rank has to be told what to send. A request is a region of a
trainer tensor one engine rank needs, in a dtype on the wire: a piece of a recipe (its bytes go
straight into a view of the engine tensor) or an input of a computation (staged until the
computation runs). A request is cut where the trainer's shards cut it (one transfer per holding
shard; of replicas, the receiver itself if it holds one, else the least loaded), then along its
leading dims until each transfer fits a round. Rounds are packed first-fit: in one round a rank
sends and receives at most half the bucket in all (two rounds are in flight at a time).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from .._base.regions import Box, box_inside, box_shape, intersect
from .._base.schema import MeshDim
from ..errors import RefitError

ALIGN = 16
"""Every transfer's bytes start at a multiple of this in a bucket (so that each can be viewed
as its own dtype)."""


@dataclass(frozen=True)
class Held:
    """One tensor of one rank: its global shape and dtype (as text) and the box it holds."""

    shape: tuple[int, ...]
    dtype: str
    box: Box
    placements: str | None = None  # a DTensor's, as the schema describes them: an inverse interleave reads its TP degree
    mesh: tuple[MeshDim, ...] | None = None


@dataclass(frozen=True)
class Request:
    """Region ``box`` of trainer tensor ``key`` that engine tensor ``target`` of one engine rank
    needs, sent as ``wire`` (a dtype name); ``index``: its place in that rank's request list.
    ``src >= 0``: region ``box`` of the engine tensor itself (``key == target``), computed by
    trainer rank ``src``, which holds everything it reads (fewer bytes than its inputs);
    ``band >= 0``: the FP8 codes of part of a block cut by the trainer's shards, quantized by
    ``src`` with the block's agreed scale (that rank's band ``band``, ``refit_cut``)."""

    target: str
    key: str
    box: Box
    wire: str
    index: int
    src: int = -1
    band: int = -1


@dataclass(frozen=True)
class Transfer:
    """Region ``box`` (global coordinates) of trainer tensor ``key``, from rank ``src`` to rank
    ``dst``, for request number ``request`` of ``dst`` (whose engine tensor is ``target``)."""

    src: int
    dst: int
    key: str
    box: Box
    wire: str
    request: int
    target: str
    computed: bool = False  # region ``box`` of engine tensor ``target``, computed by ``src``
    band: int = -1  # computed with the agreed scales of ``dst``'s band ``band`` (a cut FP8 block)

    @property
    def nbytes(self) -> int:
        return math.prod(box_shape(self.box)) * getattr(torch, self.wire).itemsize

    @property
    def padded(self) -> int:
        return -(-self.nbytes // ALIGN) * ALIGN


def maker(trainer: list[dict[str, Held]], reads: list[tuple[str, Box]], dst: int) -> int:
    """The trainer rank holding every region ``reads`` names (``dst`` where it does), else -1."""
    ranks = [r for r, held in enumerate(trainer) if all(k in held and box_inside(b, held[k].box) for k, b in reads)]
    return -1 if not ranks else dst if dst in ranks else ranks[0]


def volume(box: Box) -> int:
    return math.prod(box_shape(box))


def holders(trainer: list[dict[str, Held]], key: str) -> list[tuple[Box, list[int]]]:
    """The distinct boxes of ``key`` the trainer ranks hold, each with the ranks that hold it."""
    by_box: dict[Box, list[int]] = {}
    for rank, held in enumerate(trainer):
        if key in held:
            by_box.setdefault(held[key].box, []).append(rank)
    return sorted(by_box.items())


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def round_bytes(bucket_bytes: int) -> int:
    """The most one rank sends and receives in one round: half the bucket (aligned down), as two
    rounds are in flight at a time (one packed while the other moves)."""
    return max(ALIGN, bucket_bytes // 2 // ALIGN * ALIGN)


def cut_to_fit(t: Transfer, bucket: int, bucket_bytes: int | None = None) -> list[Transfer]:
    """``t`` cut along its leading dims into transfers of at most ``bucket`` bytes (aligned); a
    row (the last dim, whole) is never cut, so a bucket smaller than one row is an error
    (``bucket_bytes``: the user's bucket, of which ``bucket`` is a round's half, for the message)."""
    if t.padded <= bucket:
        return [t]
    item = getattr(torch, t.wire).itemsize
    shape = box_shape(t.box)
    row = shape[-1] * item if len(shape) >= 2 else item
    if _aligned(row) > bucket:
        given, need = (bucket, _aligned(row)) if bucket_bytes is None else (bucket_bytes, 2 * _aligned(row))
        raise RefitError(
            f"bucket_bytes={given} is too small for one row of {t.key!r} ({row} bytes on the wire, region "
            f"{list(t.box)}; a round holds half the bucket); give bucket_bytes of at least {need}"
        )
    out: list[Transfer] = []

    def cut(box: Box, d: int) -> None:  # the dims before d have one index each
        if _aligned(volume(box) * item) <= bucket:
            out.append(dataclasses.replace(t, box=box))
            return
        slab = math.prod(box_shape(box)[d + 1 :]) * item
        start, stop = box[d]
        if _aligned(slab) <= bucket:
            per = max(1, (bucket // ALIGN * ALIGN) // slab)
            for a in range(start, stop, per):
                out.append(dataclasses.replace(t, box=box[:d] + ((a, min(stop, a + per)),) + box[d + 1 :]))
        else:
            for i in range(start, stop):
                cut(box[:d] + ((i, i + 1),) + box[d + 1 :], d + 1)

    cut(t.box, 0)
    return out


def transfers_of(
    trainer: list[dict[str, Held]], requests: list[list[Request]], bucket: int, bucket_bytes: int | None = None
) -> list[Transfer]:
    """Every transfer, in the order of the engine ranks' requests, each fitting ``bucket``."""
    boxes = {k: holders(trainer, k) for k in sorted({r.key for reqs in requests for r in reqs if r.src < 0})}
    sent = [0] * len(trainer)
    out: list[Transfer] = []
    for dst, reqs in enumerate(requests):
        for req in reqs:
            if req.src >= 0:  # computed by the trainer rank that holds its inputs
                t = Transfer(req.src, dst, req.key, req.box, req.wire, req.index, req.target, computed=True, band=req.band)
                sent[req.src] += t.nbytes
                out.extend(cut_to_fit(t, bucket, bucket_bytes) if req.src != dst else [t])
                continue
            covered = 0
            for box, ranks in boxes[req.key]:
                part = intersect(box, req.box)
                if part is None:
                    continue
                src = dst if dst in ranks else min(ranks, key=lambda r: (sent[r], r))
                t = Transfer(src, dst, req.key, part, req.wire, req.index, req.target)
                sent[src] += t.nbytes
                covered += volume(part)
                out.extend(cut_to_fit(t, bucket, bucket_bytes) if src != dst else [t])
            if covered != volume(req.box):
                raise RefitError(
                    f"engine tensor {req.target!r} needs region {list(req.box)} of trainer tensor {req.key!r}, "
                    f"which the trainer ranks do not hold whole (they hold {[list(b) for b, _ in boxes[req.key]]}); "
                    "every region of a trainer tensor must be held by some rank"
                )
    return out


def rounds_of(transfers: list[Transfer], bucket: int, world: int) -> list[list[Transfer]]:
    """The transfers between ranks packed into rounds, first fit, in order: in one round a rank
    sends and receives at most ``bucket`` bytes (aligned). A rank's own transfers are not in it."""
    pending = [t for t in transfers if t.src != t.dst]
    rounds: list[list[Transfer]] = []
    while pending:
        load = [0] * world
        this: list[Transfer] = []
        rest: list[Transfer] = []
        for t in pending:
            n = t.padded
            if load[t.src] + n <= bucket and load[t.dst] + n <= bucket:
                load[t.src] += n
                load[t.dst] += n
                this.append(t)
            else:
                rest.append(t)
        rounds.append(this)
        pending = rest
    return rounds


__all__ = ["Held", "Request", "Transfer", "holders", "maker", "round_bytes", "rounds_of", "transfers_of", "volume"]
