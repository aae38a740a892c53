"""Copies between a row-sharing round's buffers and the shards (:mod:`sdadapt._engine.share`),
in blocks that torch runs on the calling thread."""

from __future__ import annotations

import torch

GRAIN = 32768  # torch's grain size: a copy of fewer elements runs on the calling thread alone


def copy_in_blocks(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` (same dtype and shape) in blocks of fewer than :data:`GRAIN`
    elements, each on this thread.

    torch runs a larger copy on its intra-op thread team: with several ranks per host (each
    process a team as large as the host's cores) those teams outnumber the cores, and a round's
    piece copies crawl (bench/reports/rows-timeline-cpu2-2026-12-07.md).
    The bytes are viewed as the widest integers both views allow, so that a block holds more
    of them, and contiguous ones as one run."""
    for wide in (torch.int64, torch.int32):
        if wide.itemsize > dst.element_size():
            try:
                dst, src = dst.view(wide), src.view(wide)
                break
            except RuntimeError:  # a piece's width or offset not a multiple of it
                continue
    if dst.is_contiguous() and src.is_contiguous():
        dst, src = dst.view(-1), src.view(-1)
    _blocks(dst, src)


def _blocks(dst: torch.Tensor, src: torch.Tensor) -> None:
    """:func:`copy_in_blocks`' blocks: whole rows along dim 0 (a row wider than a block, in blocks of
    its own rows)."""
    if dst.numel() < GRAIN or dst.dim() == 0:
        dst.copy_(src)
        return
    rows = dst.shape[0]
    row = dst.numel() // max(1, rows)
    if row >= GRAIN and dst.dim() > 1:
        for i in range(rows):
            _blocks(dst[i], src[i])
        return
    step = max(1, (GRAIN - 1) // max(1, row))
    for s in range(0, rows, step):
        dst[s : s + step].copy_(src[s : s + step])
