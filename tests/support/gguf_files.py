"""GGUF test files written by the ``gguf`` package's own writer (the one llama.cpp's converter uses).

``gguf`` quantizes F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 itself; it cannot quantize K-quants,
so those are random blocks made valid (finite f16 scales). :func:`oracle` is ``gguf``'s own
reading and dequantization of a whole tensor (``GGUFReader`` + ``gguf.quants.dequantize``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

gguf = __import__("pytest").importorskip("gguf", reason="the gguf package (test extra) writes and reads GGUF files")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import quants  # noqa: E402

LISTED = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K"]
"""The types issue 60 lists; every other type gguf dequantizes is tested alongside."""

# byte offsets of each K-quant block's f16 scales (d, dmin): made finite so values compare bit for bit
_F16_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q8_K": ()}


def blocks_for(values: np.ndarray, qtype: str, seed: int = 0) -> np.ndarray:
    """``values`` (float32, rows last) as ``qtype`` blocks: quantized by gguf where it can,
    else random blocks of the right size with finite scales (K-quants)."""
    t = Q[qtype]
    if qtype in ("F32",):
        return values.astype(np.float32)
    try:
        return quants.quantize(values.astype(np.float32), t)
    except NotImplementedError:
        pass
    block, size = gguf.GGML_QUANT_SIZES[t]
    rows = values.shape[:-1]
    nb = values.shape[-1] // block
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(*rows, nb, size), dtype=np.uint8)
    for off in _F16_FIELDS.get(qtype, ()):
        scale = (rng.random((*rows, nb)) * 0.01 + 0.001).astype(np.float16)
        raw[..., off : off + 2] = scale.view(np.uint8).reshape(*rows, nb, 2)
    if qtype == "Q8_K":
        raw[..., 0:4] = (rng.random((*rows, nb, 1)) * 0.01 + 0.001).astype(np.float32).view(np.uint8)
    return raw.reshape(*rows, nb * size)


def write_gguf(
    path: str | os.PathLike[str],
    tensors: Mapping[str, tuple[np.ndarray, str]],
    metadata: Mapping[str, Any] | None = None,
    arch: str = "llama",
) -> str:
    """Write ``name -> (float32 values, ggml type name)`` with ``gguf.GGUFWriter``."""
    path = os.fspath(path)
    w = gguf.GGUFWriter(path, arch=arch)
    for key, value in (metadata or {}).items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, list(value))
    for i, (name, (values, qtype)) in enumerate(tensors.items()):
        data = blocks_for(values, qtype, seed=i)
        if qtype in ("F32", "F16"):
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=Q[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def oracle(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of ``path`` as gguf reads and dequantizes it (float32; F16 and BF16 as stored)."""
    out = {}
    for t in gguf.GGUFReader(path).tensors:
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        if t.tensor_type == Q.F16:
            out[t.name] = torch.from_numpy(np.array(t.data).view(np.float16).reshape(shape))
        elif t.tensor_type == Q.BF16:
            out[t.name] = torch.from_numpy(np.array(t.data).view(np.uint16).reshape(shape).astype(np.int16)).view(torch.bfloat16)
        else:
            out[t.name] = torch.from_numpy(np.ascontiguousarray(quants.dequantize(np.array(t.data), t.tensor_type))).reshape(shape)
    return out


def dequantizable() -> list[str]:
    """Every type the installed gguf dequantizes (beyond F32 and F16)."""
    traits = getattr(quants, "_type_traits", {})
    return sorted(q.name for q, cls in traits.items() if "dequantize_blocks" in vars(cls))
