"""Refit into each quantized engine on one process: FP8 per 128 x 128 block, FP8 per channel and
per tensor, MXFP8 and NVFP4 (``support.refit_eager.QUANT_FORMATS``), from a float32 and a bfloat16
trainer. Every engine tensor equals the eager quantization of the whole weights bit for bit, each
weight is quantized where its trainer values are (its codes and scales move, nothing is staged),
and a second run gives the same bytes."""

from __future__ import annotations

import pytest
import torch
from sdadapt.adapters import vllm_llama
from support.refit_eager import QUANT_FORMATS, bits, eager, llama_weights, quant_adapter, quant_engine

import sdadapt

DIMS = (64, 4, 2, 16, 64)  # hidden, heads, kv heads, head dim, MLP hidden: whole 32-value groups, 2 x 2 blocks of 32


@pytest.mark.parametrize("fmt", sorted(QUANT_FORMATS))
def test_refit_into_a_quantized_engine(fmt: str) -> None:
    base = vllm_llama.build(n_heads=DIMS[1], n_kv_heads=DIMS[2], head_dim=DIMS[3], hidden_dim=DIMS[4], tp=1)
    adapter = base + quant_adapter(fmt, block=(32, 32))
    for dtype in (torch.float32, torch.bfloat16):
        full = llama_weights(1, DIMS, 101, 7, dtype)
        whole = eager(full, adapter)
        engine = quant_engine({k: tuple(v.shape) for k, v in full.items()}, adapter, torch.bfloat16)
        refit = sdadapt.refit_plan(full, engine, adapter)
        rep = refit()
        for k, t in engine.items():
            assert torch.equal(bits(t), bits(whole[k].to(t.dtype))), (fmt, k)
        quantized = [k for k in engine if k.endswith("_scale_inv")]
        assert len(quantized) == 4 and all(engine[k.removesuffix("_scale_inv")].element_size() == 1 for k in quantized)
        padding = (128 - 101) * DIMS[0] * 2 * 2  # vLLM's vocabulary rows, filled
        assert rep.bytes_local == sum(t.numel() * t.element_size() for t in engine.values()) - padding, fmt
        assert rep.staged_bytes == 0, fmt  # no whole tensor staged for a per-tensor or global scale
        again = {k: t.clone() for k, t in engine.items()}
        assert refit().bytes_local == rep.bytes_local
        assert all(torch.equal(bits(again[k]), bits(engine[k])) for k in engine)
