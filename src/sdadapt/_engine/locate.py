"""Where a region of a source tensor lies as bytes of one file: the runs ``preadv`` reads."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .._base.regions import Box
from ..sources import Source
from .geometry import box_spans

Runs = tuple[str, list[tuple[int, int]], torch.dtype]  # file, its (offset, nbytes) runs in order, stored dtype


def file_runs(source: Source, key: str, box: Box, min_span: int, opened: Callable[[str], bool]) -> Runs | None:
    """Region ``box`` of source tensor ``key`` as runs of one file that ``opened`` accepts;
    ``None`` when its bytes are not all in one such file, or lie in several runs shorter than
    ``min_span`` (``EngineConfig.min_span_bytes``: 0 unless the strided copy out of the source's
    mapping was asked for)."""
    located = source.locate_region(key, box)
    if not located or len(located) != 1:
        return None
    chunk_box, loc = located[0]
    if not opened(loc.path) or any(a < o or b > e for (a, b), (o, e) in zip(box, chunk_box, strict=True)):
        return None
    local = tuple((a - o, b - o) for (a, b), (o, _) in zip(box, chunk_box, strict=True))
    starts, run = box_spans(loc.shape, loc.dtype.itemsize, local)
    if len(starts) > 1 and run < min_span:
        return None
    return loc.path, [(loc.offset + s, run) for s in starts], loc.dtype
