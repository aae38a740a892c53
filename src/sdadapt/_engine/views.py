"""Typed views of byte buffers: the bytes at an offset of a uint8 buffer as a tensor of any
dtype and shape, in one tensor call."""

from __future__ import annotations

import torch


class TypedViews:
    """Cuts views out of uint8 buffers (staging, band and landing buffers). Each buffer is
    viewed as each dtype once; every later view is one ``as_strided`` call on that, since each
    tensor call lets the other threads take the interpreter lock. A buffer's first bytes
    (:meth:`head`) are viewed once per length. One instance per thread."""

    def __init__(self) -> None:
        self._whole: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}
        self._heads: dict[tuple[int, torch.device, int], torch.Tensor] = {}

    def head(self, buf: torch.Tensor, n: int) -> torch.Tensor:
        """The first ``n`` bytes of uint8 ``buf``, made once per (buffer, length) and handed out
        again after that with no tensor call (a load's bands repeat a few lengths)."""
        key = (buf.data_ptr(), buf.device, n)
        view = self._heads.get(key)
        if view is None:
            view = self._heads[key] = buf[:n]
        return view

    def cut(self, buf: torch.Tensor, at: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """Bytes ``at`` onward of ``buf`` as a contiguous ``dtype`` tensor of ``shape`` (``buf``
        starts, and ``at`` falls, on a multiple of ``dtype``'s size)."""
        key = (buf.data_ptr(), buf.device, dtype)
        whole = self._whole.get(key)
        if whole is None:
            usable = buf.numel() // dtype.itemsize * dtype.itemsize
            whole = self._whole[key] = buf[:usable].view(dtype)
        strides, step = [], 1
        for n in reversed(shape):
            strides.append(step)
            step *= n
        return whole.as_strided(shape, strides[::-1], whole.storage_offset() + at // dtype.itemsize)
