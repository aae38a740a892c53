"""The interleave node: parts of a fused tensor laid out per TP rank, or the other way back.

A box of the output maps to one box of the child per block it touches. Where those blocks are
long, each is its own piece (read straight into the destination, exactly the box's bytes).
Where they are a row or a few long (parts that alternate row by row, as GPT-OSS stores gate
and up rows), a piece per block would be a read, a task and a Python step per row; there the
box is instead read as one covering region of the child per cluster of blocks, and its rows are
picked into place: one computation per cluster. That reads the other parts' rows in between
too, at most (number of parts) x the cluster's own bytes (a block far from the others starts a
new cluster; a cluster of one block is a piece again): the one place where a region reads more
than its own bytes, traded for a task per row.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from .._base.regions import Box
from .nodes import Compute, Derived, Input, Node, Read, Rearrangement, SourceIO, Step, emit, with_dim

PICK_ROWS = 4
PICK_BELOW = 64 * 1024
"""Blocks of fewer than :data:`PICK_ROWS` entries along the dim and this many bytes (on
average, over a box) are picked out of covering reads, not read one by one. Blocks of whole
attention heads (TP's fused q/k/v) are longer, and are read exactly."""
PICK_COVER_BYTES = 16 << 20
"""The most bytes of the child one picking computation reads."""


@dataclass(frozen=True, eq=False)
class Interleaved(Rearrangement, Derived):
    """A fused tensor ``[part0; part1; ...]`` (``sizes`` along ``dim``) laid out per TP rank:
    ``[p0_r0; p1_r0; ...; p0_r1; p1_r1; ...]``, each part cut in ``tp`` equal blocks, so a
    ``ColwiseParallel`` shard of rank ``r`` holds ``[p0_r; p1_r; ...]``. ``inverse=True``
    maps that layout back to contiguous parts.

    ``replicas``: part ``p`` is shared by ``replicas[p]`` consecutive ranks (vLLM's KV heads
    fewer than its TP degree): it is cut in ``tp / replicas[p]`` blocks and rank ``r`` holds
    block ``r // replicas[p]``, so that part is ``replicas[p]`` times longer in the laid-out
    tensor; the inverse takes each block from the first rank holding it.

    A box maps to several boxes (one per block it touches), each a piece: exactly the box's
    volume is read; short blocks are picked out of covering reads instead (module docstring).
    ``full`` uses ``view``/``cat`` on whole parts.
    """

    child: Node
    dim: int
    sizes: tuple[int, ...]
    tp: int
    inverse: bool = False
    replicas: tuple[int, ...] | None = None
    segments: tuple[tuple[int, int, int], ...] = field(init=False, repr=False)  # (out_start, in_start, length)

    def __post_init__(self) -> None:
        reps = self.replicas or (1,) * len(self.sizes)
        if len(reps) != len(self.sizes) or any(n < 1 or self.tp % n for n in reps):
            raise ValueError(f"replicas {list(reps)}: one per part, each dividing tp={self.tp}")
        laid = sum(s * n for s, n in zip(self.sizes, reps, strict=True))  # the per-rank layout's length
        contiguous = sum(self.sizes)
        if (laid if self.inverse else contiguous) != self.child.shape[self.dim]:
            raise ValueError(f"sizes {self.sizes} (replicas {list(reps)}) do not add up to {self.child.shape[self.dim]}")
        if self.tp <= 0 or any(s % (self.tp // n) for s, n in zip(self.sizes, reps, strict=True)):
            raise ValueError(f"sizes {self.sizes} do not divide by tp={self.tp} (over replicas {list(reps)})")
        size = contiguous if self.inverse else laid
        self.derive(self.child.shape[: self.dim] + (size,) + self.child.shape[self.dim + 1 :], self.child.dtype)
        segs = []
        out = 0
        starts = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        for r in range(self.tp):
            for s, start, n in zip(self.sizes, starts, reps, strict=True):
                blk = s * n // self.tp
                here = start + r // n * blk  # contiguous position of rank r's block  <->  interleaved position out
                if blk and not (self.inverse and r % n):  # back: each block from the first rank holding it
                    segs.append((here, out, blk) if self.inverse else (out, here, blk))
                out += blk
        object.__setattr__(self, "segments", tuple(sorted(segs)))

    def _touched(self, a: int, b: int) -> list[tuple[int, int, int]]:
        """The output rows ``[lo, hi)`` of each block that ``[a, b)`` touches, in order, with
        the shift from an output row to its child row."""
        out = []
        for out0, in0, n in self.segments:
            lo, hi = max(a, out0), min(b, out0 + n)
            if lo < hi:
                out.append((lo, hi, in0 - out0))
        return out

    def produce(self, box: Box, dest: torch.Tensor, out: list[Step]) -> None:
        d = self.dim
        a, b = box[d]
        touched = self._touched(a, b)
        row_bytes = self.child.dtype.itemsize
        for i, (lo, hi) in enumerate(box):
            row_bytes *= 1 if i == d else hi - lo
        n = len(touched)
        short = b - a < PICK_ROWS * n and (b - a) * row_bytes < PICK_BELOW * n
        for cluster in self._clusters(touched, row_bytes) if short else [[seg] for seg in touched]:
            lo, hi = cluster[0][0], cluster[-1][1]
            sub, into = with_dim(box, d, (lo, hi)), dest.narrow(d, lo - a, hi - lo)
            if len(cluster) == 1:
                emit(self.child, with_dim(box, d, (lo + cluster[0][2], hi + cluster[0][2])), into, out)
            else:
                cover = with_dim(box, d, (min(x + s for x, _, s in cluster), max(y + s for _, y, s in cluster)))
                out.append(Compute(self, sub, into, functools.partial(self._pick, sub, tuple(cluster)), (Input(self.child, cover),)))

    def source_region(self, box: Box) -> Read | None:
        touched = self._touched(*box[self.dim])
        if len(touched) != 1:
            return None
        lo, hi, shift = touched[0]
        return self.child.source_region(with_dim(box, self.dim, (lo + shift, hi + shift)))

    def _clusters(self, touched: list[tuple[int, int, int]], row_bytes: int) -> list[list[tuple[int, int, int]]]:
        """``touched`` in clusters, each picked from one covering read: a cluster grows while
        its covering child rows stay within (number of parts) x its own rows and
        :data:`PICK_COVER_BYTES` bytes."""
        parts = sum(1 for s in self.sizes if s)
        clusters: list[list[tuple[int, int, int]]] = []
        first = last = rows = 0
        for lo, hi, shift in touched:
            if clusters:
                f, l_ = min(first, lo + shift), max(last, hi + shift)
                n = rows + hi - lo
                if l_ - f <= parts * n and (l_ - f) * row_bytes <= PICK_COVER_BYTES:
                    clusters[-1].append((lo, hi, shift))
                    first, last, rows = f, l_, n
                    continue
            clusters.append([(lo, hi, shift)])
            first, last, rows = lo + shift, hi + shift, hi - lo
        return clusters

    def _pick(self, box: Box, cluster: tuple[tuple[int, int, int], ...], io: SourceIO) -> torch.Tensor:
        """Region ``box`` (the output rows of ``cluster``'s blocks): the child's rows that cover
        them, read at once, then each block's rows picked out."""
        d = self.dim
        first = min(lo + s for lo, _, s in cluster)
        last = max(hi + s for _, hi, s in cluster)
        cover = self.child.read(with_dim(box, d, (first, last)), io)
        rows = torch.tensor([r for lo, hi, s in cluster for r in range(lo + s - first, hi + s - first)], dtype=torch.int64)
        return cover.index_select(d, rows)

    def full(self, io: SourceIO) -> torch.Tensor:
        t = self.child.full(io)
        d, tp = self.dim, self.tp
        rest = t.shape[d + 1 :]
        reps = self.replicas or (1,) * len(self.sizes)
        if not self.inverse:
            parts = t.split(list(self.sizes), dim=d)
            blocks = [p.reshape(p.shape[:d] + (tp // n, p.shape[d] * n // tp) + rest).repeat_interleave(n, dim=d)
                      for p, n in zip(parts, reps, strict=True)]  # fmt: skip
            return torch.cat(blocks, dim=d + 1).reshape(self.shape)
        v = t.reshape(t.shape[:d] + (tp, t.shape[d] // tp) + rest)
        parts = v.split([s * n // tp for s, n in zip(self.sizes, reps, strict=True)], dim=d + 1)
        firsts = [p.index_select(d, torch.arange(0, tp, n)) for p, n in zip(parts, reps, strict=True)]  # each block's first rank
        return torch.cat([p.reshape(p.shape[:d] + (-1,) + rest) for p in firsts], dim=d)

    def describe(self) -> str:
        name = "deinterleave" if self.inverse else "interleave"
        reps = f", replicas={list(self.replicas)}" if self.replicas and any(n > 1 for n in self.replicas) else ""
        return f"{name}({self.child.describe()}, sizes={list(self.sizes)}, tp={self.tp}{reps}, dim={self.dim})"
