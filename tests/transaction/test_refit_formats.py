"""Refit into each quantized engine on one process: FP8 per 128 x 128 block, FP8 per channel and
per tensor, MXFP8 and NVFP4 (``support.refit_eager.QUANT_FORMATS``), from a float32 and a bfloat16
trainer, on the CPU and (where there is one) a CUDA device, whose kernels quantize. Every engine
tensor equals the eager quantization of the whole weights on the CPU bit for bit, each weight is
quantized where its trainer values are (its codes and scales move, nothing is staged), a second
run gives the same bytes, and a run after the trainer's values changed in place gives theirs."""

from __future__ import annotations

import pytest
import torch
from sdadapt.adapters import vllm_llama
from support.refit_eager import QUANT_FORMATS, bits, eager, llama_weights, quant_adapter, quant_engine

import sdadapt
from sdadapt._recipes import quant_fused as QF

DIMS = (64, 4, 2, 16, 64)  # hidden, heads, kv heads, head dim, MLP hidden: whole 32-value groups, 2 x 2 blocks of 32


# every format on the CPU (node ids [FORMAT]) and, where there is a GPU, on it too ([FORMAT-cuda])
CASES = [pytest.param(f, "cpu", id=f) for f in sorted(QUANT_FORMATS)]
CASES += [pytest.param(f, "cuda", id=f"{f}-cuda") for f in sorted(QUANT_FORMATS) if torch.cuda.is_available()]


@pytest.mark.parametrize("fmt, device", CASES)
def test_refit_into_a_quantized_engine(fmt: str, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    base = vllm_llama.build(n_heads=DIMS[1], n_kv_heads=DIMS[2], head_dim=DIMS[3], hidden_dim=DIMS[4], tp=1)
    adapter = base + quant_adapter(fmt, block=(32, 32))
    for dtype in (torch.float32, torch.bfloat16):
        host = llama_weights(1, DIMS, 101, 7, dtype)
        whole = eager(host, adapter)
        full = {k: v.to(device) for k, v in host.items()}
        engine = quant_engine({k: tuple(v.shape) for k, v in full.items()}, adapter, torch.bfloat16, device)
        refit = sdadapt.refit_plan(full, engine, adapter)
        rep = refit()
        for k, t in engine.items():
            assert torch.equal(bits(t.cpu()), bits(whole[k].to(t.dtype))), (fmt, k)
        quantized = [k for k in engine if k.endswith("_scale_inv")]
        assert len(quantized) == 4 and all(engine[k.removesuffix("_scale_inv")].element_size() == 1 for k in quantized)
        padding = (128 - 101) * DIMS[0] * 2 * 2  # vLLM's vocabulary rows, filled
        assert rep.bytes_local == sum(t.numel() * t.element_size() for t in engine.values()) - padding, fmt
        assert rep.staged_bytes == 0, fmt  # no whole tensor staged for a per-tensor or global scale
        again = {k: t.clone() for k, t in engine.items()}
        made: list[int] = []
        for name in ("_quantize_fp8", "_quantize_scaled"):
            fn = getattr(QF, name)
            monkeypatch.setattr(QF, name, lambda *a, fn=fn, made=made: made.append(1) or fn(*a))
        assert refit().bytes_local == rep.bytes_local
        monkeypatch.undo()
        # each trainer weight quantized once a run, the scales from the codes' pass: q, k, v, o,
        # gate, up, down (no joined copies; per tensor, q|k|v and gate|up under their parts' largest magnitude)
        assert len(made) == 7, (fmt, len(made))
        assert all(torch.equal(bits(again[k]), bits(engine[k])) for k in engine)
        for v in full.values():  # a training step: new values, in place
            v.mul_(-1.5).add_(0.25)
        whole = eager({k: v.cpu() for k, v in full.items()}, adapter)
        refit()
        for k, t in engine.items():
            assert torch.equal(bits(t.cpu()), bits(whole[k].to(t.dtype))), (fmt, k, "after a step")


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4", "fp8_channel"])
def test_codes_written_into_the_engine_where_the_kernels_write(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The path a CUDA engine takes (the codes of each part written into a view of the engine
    tensor, the scales gathered from the parts), taken on the CPU: the same bytes as the eager
    quantization of the joined weights."""
    monkeypatch.setattr(QF, "writable", lambda t, dtype=QF.Q.FP8_DTYPE: t.dtype == dtype and t.dim() in (2, 3) and t.stride(-1) == 1)
    base = vllm_llama.build(n_heads=DIMS[1], n_kv_heads=DIMS[2], head_dim=DIMS[3], hidden_dim=DIMS[4], tp=1)
    adapter = base + quant_adapter(fmt, block=(32, 32))
    full = llama_weights(1, DIMS, 101, 9)
    whole = eager(full, adapter)
    engine = quant_engine({k: tuple(v.shape) for k, v in full.items()}, adapter, torch.bfloat16)
    sdadapt.refit_plan(full, engine, adapter)()
    for k, t in engine.items():
        assert torch.equal(bits(t), bits(whole[k].to(t.dtype))), (fmt, k)


def test_fp8_per_tensor_parts_against_compressed_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """FP8 per tensor into fused q|k|v and gate|up: each part quantized apart under the parts'
    largest magnitude (no joined copy of the parts: no quantization sees a whole fused weight),
    equal to compressed-tensors' per-tensor quantization of the joined weight bit for bit, from
    a float32 and a bfloat16 trainer (CPU)."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True)
    base = vllm_llama.build(n_heads=DIMS[1], n_kv_heads=DIMS[2], head_dim=DIMS[3], hidden_dim=DIMS[4], tp=1)
    adapter = base + quant_adapter("fp8_tensor")
    for dtype in (torch.float32, torch.bfloat16):
        full = llama_weights(1, DIMS, 101, 11, dtype)
        full["model.layers.0.mlp.up_proj.weight"][3, 5] = 9.0  # the largest magnitude in the second part of gate|up
        plain = eager(full, base)
        engine = quant_engine({k: tuple(v.shape) for k, v in full.items()}, adapter, torch.bfloat16)
        refit = sdadapt.refit_plan(full, engine, adapter)
        seen: list[tuple[int, ...]] = []
        fn = QF._quantize_scaled
        monkeypatch.setattr(QF, "_quantize_scaled", lambda x, *a, fn=fn, seen=seen: seen.append(tuple(x.shape)) or fn(x, *a))
        refit()
        monkeypatch.undo()
        assert max(s[0] for s in seen) == DIMS[4], seen  # the largest part quantized: gate or up, never gate|up
        for k in ("model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"):
            x = plain[k].float()
            scale, zp = calculate_qparams(x.amin().reshape(1), x.amax().reshape(1), args)
            want = quantize(x, scale, zp, args).to(torch.float8_e4m3fn)
            assert torch.equal(engine[k + "_scale_inv"].float().reshape(1), scale.float().reshape(1)), (k, dtype)
            assert torch.equal(bits(engine[k]), bits(want)), (k, dtype)
