"""A tensor's raw bytes, for checksums and for writers."""

from __future__ import annotations

import ctypes

import torch


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes in C order (little-endian hosts): a view of its memory when it is a
    contiguous CPU tensor, else of a contiguous CPU copy. Made through ctypes rather than
    ``Tensor.numpy()``, so numpy is not needed; the view keeps that memory alive."""
    flat = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    if not flat.numel():
        return memoryview(b"")
    buf = (ctypes.c_ubyte * flat.numel()).from_address(flat.data_ptr())
    vars(buf)["owner"] = flat  # from_address holds no reference to the memory it maps
    return memoryview(buf).cast("B")
