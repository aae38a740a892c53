"""Refit into vLLM's layouts with fewer KV heads than TP ranks (vLLM shares each KV head over
``tp / n_kv`` ranks), on real gloo processes.

Every engine shard is compared, bit for bit, with the same transform applied eagerly to the
full weights and cut to the shard's box, and with an independent expectation written from
vLLM's rule (rank ``r`` holds q heads ``r``'s share and KV head ``r // (tp / n_kv)``). One
launched group of 4 ranks runs Llama (KV 2 and KV 1 on TP 4, delta mode), Qwen3-MoE (TP 4,
KV 2) and an FP8 engine (TP 4, KV 2), colocated with an FSDP trainer over the 4 ranks, and
``send=`` of the replicated whole tensors.
"""

from __future__ import annotations

import pytest
import torch
from sdadapt.adapters import vllm_fp8, vllm_llama, vllm_qwen3_moe
from support.dist_helper import run_distributed
from support.refit_eager import bits, eager

import sdadapt
from sdadapt._base.schema import slices
from sdadapt.errors import AdapterError

TP = 4
H, HD, D, F, V = 8, 4, 22, 16, 101
E, FE = 4, 8
BLOCK = (4, 4)
H8, HD8, D8, F8 = 4, 8, 32, 32  # every TP-4 share whole 4 x 4 blocks


def llama_hf(kv: int, h: int = H, hd: int = HD, d: int = D, f: int = F, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {"model.embed_tokens.weight": torch.randn(V, d, generator=g), "model.norm.weight": torch.randn(d, generator=g),
          "lm_head.weight": torch.randn(V, d, generator=g)}  # fmt: skip
    for i in range(2):
        p = f"model.layers.{i}."
        for name, shape in (("self_attn.q_proj", (h * hd, d)), ("self_attn.k_proj", (kv * hd, d)), ("self_attn.v_proj", (kv * hd, d)),
                            ("self_attn.o_proj", (d, h * hd)), ("mlp.gate_proj", (f, d)), ("mlp.up_proj", (f, d)),
                            ("mlp.down_proj", (d, f)), ("input_layernorm", (d,)), ("post_attention_layernorm", (d,))):  # fmt: skip
            sd[p + name + ".weight"] = torch.randn(*shape, generator=g)
    return sd


def qwen3_moe_hf(kv: int) -> dict[str, torch.Tensor]:
    """An HF Qwen3-MoE state dict (per-expert weights)."""
    g = torch.Generator().manual_seed(1)
    sd = llama_hf(kv, seed=1)
    for i in range(2):
        p = f"model.layers.{i}."
        for n in ("gate_proj", "up_proj", "down_proj"):
            del sd[p + f"mlp.{n}.weight"]
        sd[p + "self_attn.q_norm.weight"] = torch.randn(HD, generator=g)
        sd[p + "self_attn.k_norm.weight"] = torch.randn(HD, generator=g)
        sd[p + "mlp.gate.weight"] = torch.randn(E, D, generator=g)
        for e in range(E):
            for n, shape in (("gate_proj", (FE, D)), ("up_proj", (FE, D)), ("down_proj", (D, FE))):
                sd[p + f"mlp.experts.{e}.{n}.weight"] = torch.randn(*shape, generator=g)
    return sd


def engine_shards(whole: dict[str, torch.Tensor], layout, dtype=torch.float32) -> dict[str, torch.Tensor]:
    out = {}
    for k, t in whole.items():
        shape = list(t.shape)
        d = layout.dim_of(k)
        if d is not None:
            shape[d] //= layout.size
        keep = t.dtype if t.element_size() == 1 or k.endswith("_scale_inv") else dtype
        nan = keep.is_floating_point and keep.itemsize > 1  # e4m3 holds no NaN on every build: zeros
        out[k] = torch.full(shape, float("nan"), dtype=keep) if nan else torch.zeros(shape, dtype=keep)
    return out


def check(engine: dict[str, torch.Tensor], whole: dict[str, torch.Tensor], layout) -> None:
    for k, t in engine.items():
        _, box = layout(k, t)
        assert torch.equal(bits(t), bits(whole[k][slices(box)].to(t.dtype))), k


def qkv_of_rank(full: dict[str, torch.Tensor], layer: int, kv: int, rank: int, h: int = H, hd: int = HD) -> torch.Tensor:
    """vLLM's rule, written out: rank ``r`` holds its ``h / tp`` q heads and KV head ``r // (tp / kv)``."""
    p = f"model.layers.{layer}.self_attn."
    head = rank // (TP // kv) if kv < TP else None
    q = full[p + "q_proj.weight"].chunk(TP)[rank]
    if head is None:
        k, v = full[p + "k_proj.weight"].chunk(TP)[rank], full[p + "v_proj.weight"].chunk(TP)[rank]
    else:
        k, v = (full[p + f"{n}_proj.weight"][head * hd : (head + 1) * hd] for n in "kv")
    return torch.cat([q, k, v])


def _cases() -> dict[str, object]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))

    def fsdp(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: distribute_tensor(v.clone(), mesh, [Shard(0)], src_data_rank=None) for k, v in full.items()}

    out: dict[str, object] = {}
    # 1. Llama, KV 2 and KV 1 on TP 4 (each KV head on 2, then 4 ranks), bfloat16; delta mode on KV 2
    for kv in (2, 1):
        full = llama_hf(kv)
        ad = vllm_llama.build(n_heads=H, n_kv_heads=kv, head_dim=HD, hidden_dim=F, tp=TP)
        whole = eager(full, ad)
        layout = vllm_llama.layout(TP, rank)
        engine = engine_shards(whole, layout, torch.bfloat16)
        shapes = vllm_llama.parameter_shapes(n_layers=2, vocab_size=V, dim=D, n_heads=H, n_kv_heads=kv, head_dim=HD, hidden_dim=F, tp=TP)
        assert {k: tuple(t.shape) for k, t in engine.items()} == shapes
        trainer = fsdp(full)
        refit = sdadapt.refit_plan(trainer, engine, ad, engine_layout=layout, bucket_bytes=4096, delta=True)
        rep = refit()
        check(engine, whole, layout)
        for i in range(2):
            qkv = engine[f"model.layers.{i}.self_attn.qkv_proj.weight"]
            assert torch.equal(qkv, qkv_of_rank(full, i, kv, rank).bfloat16()), (kv, i)
        # every rank's engine bytes came from the trainer ranks (the replicated heads too)
        shard_bytes = sum(t.numel() * t.element_size() for k, t in engine.items() if "embed" not in k and "lm_head" not in k)
        assert rep.bytes_received + rep.bytes_local >= shard_bytes
        if kv == 2:
            k = "model.layers.1.self_attn.k_proj.weight"
            with torch.no_grad():
                trainer[k].add_(1.0)
            full2 = dict(full, **{k: full[k] + 1.0})
            rep2 = refit()
            assert rep2.updated == ["model.layers.1.self_attn.qkv_proj.weight"], rep2.updated
            check(engine, eager(full2, ad), layout)
            assert torch.equal(engine["model.layers.1.self_attn.qkv_proj.weight"], qkv_of_rank(full2, 1, kv, rank).bfloat16())
        out[f"llama_kv{kv}"] = rep.model_dump()

    # 2. Qwen3-MoE, KV 2 on TP 4, and with expert parallelism
    moe = qwen3_moe_hf(2)
    for ep in (False, True):
        ad = vllm_qwen3_moe.build(n_heads=H, n_kv_heads=2, head_dim=HD, moe_hidden_dim=FE, n_experts=E, tp=TP, expert_parallel=ep)
        whole = eager(moe, ad)
        layout = vllm_qwen3_moe.layout(TP, rank, expert_parallel=ep)
        engine = engine_shards(whole, layout)
        shapes = vllm_qwen3_moe.parameter_shapes(n_layers=2, vocab_size=V, dim=D, n_heads=H, n_kv_heads=2, head_dim=HD,
                                                 moe_hidden_dim=FE, n_experts=E, tp=TP, expert_parallel=ep)  # fmt: skip
        assert {k: tuple(t.shape) for k, t in engine.items()} == shapes
        sdadapt.refit_plan(fsdp(moe), engine, ad, engine_layout=layout, bucket_bytes=4096)()
        check(engine, whole, layout)
        assert torch.equal(engine["model.layers.0.self_attn.qkv_proj.weight"], qkv_of_rank(moe, 0, 2, rank))

    # 3. an FP8 engine (block 4 x 4), KV 2 on TP 4: each rank's KV head quantized in whole blocks
    full8 = llama_hf(2, h=H8, hd=HD8, d=D8, f=F8, seed=3)
    ad = vllm_llama.build(n_heads=H8, n_kv_heads=2, head_dim=HD8, hidden_dim=F8, tp=TP) + vllm_fp8.build(block=BLOCK)
    whole8 = eager(full8, ad)
    layout = vllm_fp8.layout(vllm_llama.layout(TP, rank), BLOCK)
    engine = engine_shards(whole8, layout, torch.bfloat16)
    sdadapt.refit_plan(fsdp(full8), engine, ad, engine_layout=layout, bucket_bytes=4096)()
    check(engine, whole8, layout)
    qkv = qkv_of_rank(full8, 0, 2, rank, h=H8, hd=HD8)  # its own blocks quantized: the scales of [q_r; k_h; v_h]
    scale = engine["model.layers.0.self_attn.qkv_proj.weight_scale_inv"]
    want = qkv.reshape(qkv.shape[0] // 4, 4, D8 // 4, 4).abs().amax(dim=(1, 3)) / 448
    assert torch.equal(scale, want)

    # 4. send=: the replicated whole tensors (TP 4 layout), described on meta: each rank sends the regions it makes
    full = llama_hf(2)
    ad = vllm_llama.build(n_heads=H, n_kv_heads=2, head_dim=HD, hidden_dim=F, tp=TP)
    described = {k: torch.empty(t.shape, dtype=torch.bfloat16, device="meta") for k, t in eager(full, ad).items()}
    got: list[tuple[str, object, torch.Tensor]] = []
    sdadapt.refit_plan(fsdp(full), described, ad, send=lambda b: got.extend((k, box, p.clone()) for k, box, p in b), bucket_bytes=4096)()
    out["sent"] = got
    return out


def test_refit_kv_heads_fewer_than_tp() -> None:
    results = run_distributed(_cases, 4, timeout=400)
    full = llama_hf(2)
    whole = eager(full, vllm_llama.build(n_heads=H, n_kv_heads=2, head_dim=HD, hidden_dim=F, tp=TP))
    made = {k: torch.full(t.shape, float("nan"), dtype=torch.bfloat16) for k, t in whole.items()}
    seen = {k: torch.zeros(t.shape, dtype=torch.int32) for k, t in whole.items()}
    for r in results:
        for k, box, piece in r["sent"]:
            made[k][slices(box)] = piece
            seen[k][slices(box)] += 1
    for k, t in whole.items():
        assert torch.equal(made[k], t.bfloat16()) and bool((seen[k] == 1).all()), k


def test_kv_replicas_refused_where_vllm_refuses() -> None:
    """A TP degree that is not a multiple of the KV heads (vLLM cannot share them evenly)."""
    with pytest.raises(AdapterError, match="not a multiple of n_kv_heads 3"):
        vllm_llama.build(n_heads=12, n_kv_heads=3, head_dim=4, hidden_dim=8, tp=4)
    with pytest.raises(AdapterError, match="n_kv_heads 6 does not divide by 4"):
        vllm_qwen3_moe.build(n_heads=12, n_kv_heads=6, head_dim=4, moe_hidden_dim=8, tp=4)
