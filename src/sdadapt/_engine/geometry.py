"""Byte geometry of boxes in row-major tensors: contiguous runs, and cutting reads into chunks."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._base.regions import Box, box_shape

_PYTHON_MAX = 256  # up to this many runs, their offsets are computed without torch


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is at least ``n``."""
    return -(-n // multiple) * multiple


def box_spans(shape: Sequence[int], itemsize: int, box: Box) -> tuple[list[int], int]:
    """Byte offsets (relative to the tensor's start) of the contiguous runs of ``box`` in a
    row-major tensor of ``shape``, in box order, and the length of each run in bytes."""
    nd = len(shape)
    if nd == 0:
        return [0], itemsize
    strides = [1] * nd
    for i in range(nd - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    # k: the outermost dim such that every dim after it is covered whole
    k = nd - 1
    while k > 0 and box[k] == (0, shape[k]):
        k -= 1
    run = (box[k][1] - box[k][0]) * strides[k] * itemsize
    start = box[k][0] * strides[k]
    if k == 0:
        return [start * itemsize], run
    count = 1
    for d in range(k):
        count *= box[d][1] - box[d][0]
    if count <= _PYTHON_MAX:  # few runs: plain ints beat a handful of tensor ops
        offs_py = [start]
        for d in range(k):
            a, b = box[d]
            offs_py = [o + i * strides[d] for o in offs_py for i in range(a, b)]
        return [o * itemsize for o in offs_py], run
    # offsets of every index combination of dims 0..k-1
    offs = torch.zeros((), dtype=torch.int64)
    for d in range(k):
        a, b = box[d]
        idx = torch.arange(a, b, dtype=torch.int64) * strides[d]
        offs = (offs.unsqueeze(-1) + idx).reshape(-1)
    return ((offs + start) * itemsize).tolist(), run


def split_segments(segments: list[tuple[int, int]], chunk: int) -> list[list[tuple[int, int]]]:
    """Cut a packed list of (file offset, nbytes) segments into groups of at most ``chunk``
    bytes (splitting spans)."""
    groups: list[list[tuple[int, int]]] = []
    cur: list[tuple[int, int]] = []
    size = 0
    for off, n in segments:
        while n > 0:
            take = min(n, chunk - size)
            cur.append((off, take))
            size += take
            off += take
            n -= take
            if size == chunk:
                groups.append(cur)
                cur, size = [], 0
    if cur:
        groups.append(cur)
    return groups


def split_box(box: Box, itemsize: int, chunk: int) -> list[tuple[Box, tuple[slice, ...]]]:
    """Sub-boxes of ``box`` of at most ``chunk`` bytes (where one element row allows), with the
    slices of the box-shaped destination that each fills."""
    shape = box_shape(box)
    nd = len(shape)
    total = itemsize
    for s in shape:
        total *= s
    if total <= chunk or nd == 0:
        return [(box, tuple(slice(None) for _ in shape))]
    # slab[d] = bytes of one index of dim d (all later dims whole)
    slab = [itemsize] * nd
    for d in range(nd - 2, -1, -1):
        slab[d] = slab[d + 1] * shape[d + 1]
    d = 0
    while d < nd - 1 and slab[d] > chunk:
        d += 1
    per = max(1, chunk // slab[d])
    out = []

    def rec(prefix: tuple[int, ...]) -> None:
        i = len(prefix)
        if i == d:
            for s in range(0, shape[d], per):
                e = min(shape[d], s + per)
                sub = tuple((box[j][0] + prefix[j], box[j][0] + prefix[j] + 1) for j in range(d))
                sub += ((box[d][0] + s, box[d][0] + e),) + box[d + 1 :]
                sl = tuple(slice(p, p + 1) for p in prefix) + (slice(s, e),)
                out.append((sub, sl))
            return
        for p in range(shape[i]):
            rec(prefix + (p,))

    rec(())
    return out


def band_boxes(box: Box, value_bytes: float, max_bytes: int, align: dict[int, int], first: int = 0) -> list[Box]:
    """``box`` cut along its outermost dims from ``first`` on (never the last) into bands of at
    most about ``max_bytes`` of input (``value_bytes`` per value), cuts on multiples of
    ``align[dim]`` (absolute coordinates); bands of a dim cut as finely as it allows that are
    still too large are cut along the next dim."""
    n = value_bytes
    for a, b in box:
        n *= b - a
    dim = next((d for d in range(first, len(box) - 1) if box[d][1] - box[d][0] > 1), None)
    if n <= max_bytes or dim is None:
        return [box]
    lo, hi = box[dim]
    step = max(1, int(max_bytes // (n / (hi - lo))))
    unit = align.get(dim, 1)
    step = max(unit, step // unit * unit)
    out: list[Box] = []
    while lo < hi:
        end = min(hi, (lo // step + 1) * step)
        out += band_boxes(box[:dim] + ((lo, end),) + box[dim + 1 :], value_bytes, max_bytes, align, dim + 1)
        lo = end
    return out
