"""sdadapt.refit_plan: trainer shards -> engine shards (vLLM's layouts), on real gloo processes.

Every engine shard is compared with the same transform applied eagerly to the full training
weights (``node.full``), cut to the shard's box. One launched group of 4 ranks runs the
disaggregated (trainer 0,1 -> engine 2,3), colocated, replicated, Qwen3-MoE (TP and EP),
DeepSeek-V3, delta (Llama and DeepSeek-V3 colocated, Qwen3-MoE disaggregated) and bad-input
cases; a 2-rank group checks a rank that leaves mid-refit.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import pytest
import torch
from sdadapt.adapters import vllm_fp8, vllm_llama, vllm_qwen3_moe
from support.dist_helper import WorkerError, run_distributed
from support.models import module_of
from support.refit_eager import bits, eager, llama_weights, local_shape

import sdadapt
from sdadapt._base.schema import slices
from sdadapt._refit.refit_schedule import Transfer, cut_to_fit, rounds_of
from sdadapt.errors import RefitError

# uneven on purpose: 101 vocabulary rows, 22-wide norms, 10 kv rows over 4 FSDP ranks
L, D, H, KV, HD, F, V = 2, 22, 4, 2, 5, 18, 101
E, FE = 4, 8  # I / tp = 4 rows per part and rank: read as pieces (shorter parts are picked from covering reads)


def llama_hf(seed: int = 0) -> dict[str, torch.Tensor]:
    return llama_weights(L, (D, H, KV, HD, F), V, seed)


def qwen3_moe_titan(seed: int = 0) -> dict[str, torch.Tensor]:
    """A Qwen3-MoE trainer's weights in sdadapt's torchtitan-style layout (stacked experts)."""
    g = torch.Generator().manual_seed(seed)
    sd = {"tok_embeddings.weight": torch.randn(V, D, generator=g), "norm.weight": torch.randn(D, generator=g),
          "output.weight": torch.randn(V, D, generator=g)}  # fmt: skip
    for i in range(L):
        p = f"layers.{i}."
        for name, shape in (("attention.wq.weight", (H * HD, D)), ("attention.wk.weight", (KV * HD, D)),
                            ("attention.wv.weight", (KV * HD, D)), ("attention.wo.weight", (D, H * HD)),
                            ("attention.q_norm.weight", (HD,)), ("attention.k_norm.weight", (HD,)),
                            ("attention_norm.weight", (D,)), ("ffn_norm.weight", (D,)), ("moe.router.gate.weight", (E, D)),
                            ("moe.experts.w1", (E, FE, D)), ("moe.experts.w3", (E, FE, D)), ("moe.experts.w2", (E, D, FE))):  # fmt: skip
            sd[p + name] = torch.randn(*shape, generator=g)
    return sd


def llama_adapter(tp: int) -> sdadapt.Adapter:
    return vllm_llama.build(n_heads=H, n_kv_heads=KV, head_dim=HD, hidden_dim=F, tp=tp)


def moe_adapter(tp: int, ep: bool = False) -> sdadapt.Adapter:
    trainer_to_hf = sdadapt.get_adapter("qwen3_moe", n_experts=E).inverse()
    return trainer_to_hf + vllm_qwen3_moe.build(n_heads=H, n_kv_heads=KV, head_dim=HD, moe_hidden_dim=FE, n_experts=E, tp=tp,
                                                expert_parallel=ep)  # fmt: skip


def engine_shards(whole: dict[str, torch.Tensor], layout, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """NaN-filled engine tensors of one rank, shaped as ``layout`` cuts ``whole``."""
    return {k: torch.full(local_shape(layout, t, k), float("nan"), dtype=dtype) for k, t in whole.items()}


def check(engine: dict[str, torch.Tensor], whole: dict[str, torch.Tensor], layout) -> int:
    """Every engine shard equals its box of the eager result (cast); returns the bytes from the
    trainer (the padded vocabulary rows are filled, not sent)."""
    sent = 0
    for k, t in engine.items():
        _, box = layout(k, t)
        want = whole[k][slices(box)].to(t.dtype)
        assert torch.equal(bits(t), bits(want)), k
        rows = V if k.endswith(("embed_tokens.weight", "lm_head.weight")) else None
        if rows is not None:
            kept = max(0, min(box[0][1], rows) - box[0][0])
            sent += kept * math.prod(t.shape[1:]) * t.element_size()
        else:
            sent += t.numel() * t.element_size()
    return sent


def shard(full: dict[str, torch.Tensor], mesh, placements_of) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import distribute_tensor

    return {k: distribute_tensor(v, mesh, placements_of(k, v), src_data_rank=None) for k, v in full.items()}


def unpadded() -> sdadapt.Adapter:
    """vLLM's TP-2 layout less the vocabulary padding (a pad's inverse's inverse needs a size)."""
    return sdadapt.Adapter([r for r in llama_adapter(2).rules if r.kind != "pad"])


FP8_BLOCK = (4, 4)
D8, H8, KV8, HD8, F8 = 32, 4, 2, 8, 24  # every TP-2 share whole 4 x 4 blocks; FSDP over 3 ranks cuts blocks


def llama_fp8_hf(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return llama_weights(1, (D8, H8, KV8, HD8, F8), V, 3, dtype)


def fp8_adapter(tp: int, unquantized: bool = False) -> sdadapt.Adapter:
    ad = vllm_llama.build(n_heads=H8, n_kv_heads=KV8, head_dim=HD8, hidden_dim=F8, tp=tp)
    return ad if unquantized else ad + vllm_fp8.build(block=FP8_BLOCK)


def fp8_engine(whole: dict[str, torch.Tensor], layout) -> dict[str, torch.Tensor]:
    """One rank's FP8 engine: e4m3 weights (zeros), float32 scales, bf16 others (NaN)."""
    shards = engine_shards(whole, layout)
    return {k: torch.zeros(t.shape, dtype=whole[k].dtype) if whole[k].element_size() == 1 or k.endswith("_scale_inv") else t
            for k, t in shards.items()}  # fmt: skip


def dsv3_opts(ep: bool) -> dict[str, object]:
    return dict(n_heads=DSV3["n_heads"], q_lora_rank=DSV3["q_lora_rank"], kv_lora_rank=DSV3["kv_lora_rank"],
                qk_rope_head_dim=DSV3["qk_rope_head_dim"], moe_hidden_dim=FE, hidden_dim=F, n_experts=E, tp=2,
                expert_parallel=ep)  # fmt: skip


def delta_step(refit, engine, whole, whole2, layout, change) -> list[dict[str, object]]:
    """Delta mode over three runs: all sent; after ``change()`` (in place) exactly the engine tensors
    whose eager value moved are sent (a fused one of which one part changed included), the others
    reported unchanged; then nothing moves. Returns the three reports."""
    reps = [refit()]
    if engine is not None:
        check(engine, whole, layout)
        assert sorted(engine) == reps[0].updated and reps[0].unchanged == []
    moved = {k for k in whole if not torch.equal(whole[k], whole2[k])}
    with torch.no_grad():
        change()
    reps += [refit(), refit()]
    if engine is not None:
        check(engine, whole2, layout)
        assert reps[1].updated == sorted(moved) and reps[1].unchanged == sorted(set(engine) - moved), reps[1]
        shards = sum(engine[k].numel() * engine[k].element_size() for k in moved)
        assert reps[1].bytes_received + reps[1].bytes_local == shards, (reps[1], shards)
        assert reps[2].updated == [] and reps[2].unchanged == sorted(engine)
    assert reps[2].bytes_sent == reps[2].bytes_received == reps[2].bytes_local == 0, reps[2]
    return [r.model_dump() for r in reps]


def _cases(bucket: int) -> dict[str, object]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    rank = dist.get_rank()
    out: dict[str, object] = {}
    fsdp = lambda k, v: [Shard(0)]  # noqa: E731
    full = llama_hf()

    # 1. disaggregated: FSDP over trainer ranks 0,1 -> vLLM TP 2 on engine ranks 2,3, bf16
    pair = DeviceMesh("cpu", [0, 1], mesh_dim_names=("dp",))
    whole = eager(full, llama_adapter(2))
    trainer = shard(full, pair, fsdp) if rank < 2 else None
    layout = vllm_llama.layout(2, rank - 2) if rank >= 2 else None
    engine = engine_shards(whole, layout) if layout else None
    refit = sdadapt.refit_plan(trainer, engine, llama_adapter(2), engine_layout=layout, bucket_bytes=bucket)
    rep = refit.run()
    assert rep.buffer_bytes <= bucket, (rep.buffer_bytes, bucket)
    if engine is not None:
        assert rep.bytes_received == check(engine, whole, layout) and rep.bytes_sent == 0
    else:
        assert rep.bytes_received == 0 and rep.updated == []
    out["disaggregated"] = rep.model_dump()

    # 1b. the same with computed recipes (an affine after the fuse) into a float32 engine (the result is no
    #     smaller than its inputs): inputs staged on the engine ranks, received from both trainer ranks in
    #     rounds of a small bucket; into a bfloat16 engine, computed on the trainer ranks (half the bytes)
    computed = llama_adapter(2) + sdadapt.Adapter([sdadapt.affine("model.layers.{i}.self_attn.qkv_proj.weight", scale=2.0, shift=0.5)])
    whole_c = eager(full, computed)
    for dtype in (torch.float32, torch.bfloat16):
        engine = engine_shards(whole_c, layout, dtype) if layout else None
        rep = sdadapt.refit_plan(trainer, engine, computed, engine_layout=layout, bucket_bytes=bucket)()
        if engine is not None:
            sent = check(engine, whole_c, layout)
            assert (rep.staged_bytes > 0) == (dtype == torch.float32) and rep.buffer_bytes <= bucket
            if dtype == torch.bfloat16:
                assert rep.bytes_received == sent

    # 2. colocated: FSDP over all 4 ranks -> two vLLM TP-2 replicas (ranks 0,1 and 2,3), delta mode
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    trainer = shard(full, world, fsdp)
    layout = vllm_llama.layout(2, rank % 2)
    engine = engine_shards(whole, layout)
    refit = sdadapt.refit_plan(trainer, engine, llama_adapter(2), engine_layout=layout, bucket_bytes=bucket, delta=True)
    rep = refit()
    sent = check(engine, whole, layout)
    assert rep.bytes_received + rep.bytes_local == sent and rep.bytes_local > 0
    assert len(rep.updated) == len(engine) and rep.unchanged == []
    rep2 = refit()
    assert rep2.updated == [] and len(rep2.unchanged) == len(engine) and rep2.bytes_received == 0
    changed = "model.layers.1.mlp.up_proj.weight"
    with torch.no_grad():
        trainer[changed].add_(1.0)  # in place, as an optimizer's step: its version counter moves
    full2 = dict(full, **{changed: full[changed] + 1.0})
    whole2 = eager(full2, llama_adapter(2))
    rep3 = refit()
    assert rep3.updated == ["model.layers.1.mlp.gate_up_proj.weight"], rep3.updated
    check(engine, whole2, layout)
    out["colocated_delta"] = [rep.model_dump(), rep2.model_dump(), rep3.model_dump()]

    # 3. 2-D trainer (DDP x TP: replicas along dp) -> one engine holding everything whole on rank 3,
    #    fp32 (no cast), and engines of ranks 0-2 holding nothing
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    rowwise = ("o_proj.weight", "down_proj.weight")
    tp_place = lambda k, v: [Replicate(), Shard(1) if k.endswith(rowwise) else Shard(0)]  # noqa: E731
    trainer = shard(full, mesh2, tp_place)
    whole1 = eager(full, llama_adapter(1))
    layout1 = vllm_llama.layout(1, 0)
    engine = engine_shards(whole1, layout1, torch.float32) if rank == 3 else None
    rep = sdadapt.refit_plan(trainer, engine, llama_adapter(1), engine_layout=layout1 if rank == 3 else None)()
    if engine is not None:
        assert rep.bytes_received + rep.bytes_local == check(engine, whole1, layout1)
    out["replicated"] = rep.model_dump()

    # 4. Qwen3-MoE: experts sharded over FSDP ranks 0,1 (torchtitan layout) -> vLLM TP 2 and EP 2 on 2,3
    moe = qwen3_moe_titan()
    for ep in (False, True):
        whole = eager(moe, moe_adapter(2, ep))
        trainer = shard(moe, pair, fsdp) if rank < 2 else None
        layout = vllm_qwen3_moe.layout(2, rank - 2, expert_parallel=ep) if rank >= 2 else None
        engine = engine_shards(whole, layout) if layout else None
        rep = sdadapt.refit_plan(trainer, engine, moe_adapter(2, ep), engine_layout=layout, bucket_bytes=bucket)()
        if engine is not None:
            assert rep.bytes_received == check(engine, whole, layout)
            w13 = engine["model.layers.0.mlp.experts.routed_experts.w13_weight"]
            assert tuple(w13.shape) == ((E // 2, 2 * FE, D) if ep else (E, FE, D))
        out[f"moe_{'ep' if ep else 'tp'}"] = rep.model_dump()

    # 4b. delta mode, disaggregated (FSDP over 0,1 -> EP 2 on 2,3): one expert's rows of w1 (on trainer rank 1
    #     only) and a norm change in place; w13_weight (w1 and w3 fused) and the norm are resent, the rest skipped
    ad = moe_adapter(2, True)
    trainer = shard({k: v.clone() for k, v in moe.items()}, pair, fsdp) if rank < 2 else None
    layout = vllm_qwen3_moe.layout(2, rank - 2, expert_parallel=True) if rank >= 2 else None
    whole = eager(moe, ad)
    engine = engine_shards(whole, layout) if layout else None
    expert = torch.zeros(E, FE, D)
    expert[3, :3] = 0.5
    moe2 = dict(moe, **{"layers.1.moe.experts.w1": moe["layers.1.moe.experts.w1"] + expert,
                        "layers.0.ffn_norm.weight": moe["layers.0.ffn_norm.weight"] + 1.0})  # fmt: skip
    whole2 = eager(moe2, ad)
    assert {k for k in whole if not torch.equal(whole[k], whole2[k])} == {
        "model.layers.1.mlp.experts.routed_experts.w13_weight", "model.layers.0.post_attention_layernorm.weight"}  # fmt: skip

    def change_moe() -> None:
        if trainer is not None:
            trainer["layers.1.moe.experts.w1"].add_(shard({"x": expert}, pair, fsdp)["x"])
            trainer["layers.0.ffn_norm.weight"].add_(1.0)

    refit = sdadapt.refit_plan(trainer, engine, ad, engine_layout=layout, bucket_bytes=bucket, delta=True)
    out["moe_delta"] = delta_step(refit, engine, whole, whole2, layout, change_moe)

    # 5. export_iter(local=True): each rank's pieces of the vLLM layout, FSDP over 4 and DDP x TP
    to_vllm = unpadded().inverse()  # export_iter applies the inverse of the adapter it is given
    out["local_pieces"] = {
        name: [(k, box, piece.clone()) for k, piece, box in sdadapt.export_iter(module_of(shard(full, mesh, place)), to_vllm, local=True)]
        for name, mesh, place in (("fsdp", world, fsdp), ("2d", mesh2, tp_place))
    }

    # 6. bad input: every rank raises our error, nothing is written
    whole = eager(full, llama_adapter(2))
    layout = vllm_llama.layout(2, rank % 2)
    engine = engine_shards(whole, layout)
    if rank == 2:
        engine["model.norm.weight"] = torch.zeros(D + 1)
    try:
        sdadapt.refit_plan(full if rank == 0 else None, engine, llama_adapter(2), engine_layout=layout)
        raise AssertionError("no error")
    except RefitError as e:
        out["mismatch"] = str(e)
    engine = engine_shards(whole, layout)
    try:
        sdadapt.refit_plan(shard(full, world, fsdp), engine, llama_adapter(2), engine_layout=layout, bucket_bytes=32)
        raise AssertionError("no error")
    except RefitError as e:
        out["small_bucket"] = str(e)
    assert all(torch.isnan(t).all() for t in engine.values())

    # 7. an FP8 (block 4 x 4) engine: trainer FSDP over ranks 0-2, 11/11/10 rows (blocks straddle its shards)
    #    -> vLLM TP 2 on ranks 2,3 (rank 2 holds both); each engine rank quantizes its shard
    trio = DeviceMesh("cpu", [0, 1, 2], mesh_dim_names=("dp",))
    full8 = llama_fp8_hf()
    whole8 = eager(full8, fp8_adapter(2))
    layout = vllm_fp8.layout(vllm_llama.layout(2, rank - 2), FP8_BLOCK) if rank >= 2 else None
    engine = fp8_engine(whole8, layout) if layout else None
    refit = sdadapt.refit_plan(shard(full8, trio, fsdp) if rank < 3 else None, engine, fp8_adapter(2), engine_layout=layout,
                               bucket_bytes=bucket)  # fmt: skip
    rep = refit()
    if engine is not None:
        check(engine, whole8, layout)
        assert engine["model.layers.0.self_attn.qkv_proj.weight"].dtype == torch.float8_e4m3fn
        # the blocks cut by the trainer's shards are quantized by their holders on agreed scales (refit_cut):
        # nothing is staged here, and no more than the engine's own bytes come
        assert rep.staged_bytes == 0
        assert rep.bytes_received + rep.bytes_local <= sum(t.numel() * t.element_size() for t in engine.values())
    out["fp8"] = rep.model_dump()

    # 8. send=: the engine outside the group; each rank sends the regions of vLLM's TP-1 tensors (bf16, described
    #    on the meta device) it makes from the shards it owns: FSDP over 4, and DDP x TP (one replica sends)
    whole1 = eager(full, llama_adapter(1))
    described = {k: torch.empty(t.shape, dtype=torch.bfloat16, device="meta") for k, t in whole1.items()}
    for name, mesh, place in (("fsdp", world, fsdp), ("2d", mesh2, tp_place)):
        got: list[tuple[str, object, torch.Tensor]] = []

        def push(pieces: list[tuple[str, object, torch.Tensor]], got: list = got) -> None:
            assert sum(p.numel() * p.element_size() for _, _, p in pieces) <= bucket
            got.extend((k, box, p.clone()) for k, box, p in pieces)

        rep = sdadapt.refit_plan(shard(full, mesh, place), described, llama_adapter(1), send=push, bucket_bytes=bucket)()
        assert rep.bytes_sent == sum(p.numel() * p.element_size() for _, _, p in got) and rep.buffer_bytes <= bucket
        out[f"sent_{name}"] = got
    # an FP8 block cut by the trainer's shards: no one rank can make it
    try:
        sdadapt.refit_plan(shard(full8, trio, fsdp) if rank < 3 else None, None, fp8_adapter(1), send=lambda pieces: None)
        raise AssertionError("no error")
    except sdadapt.errors.SdadaptError as e:  # RefitError where it failed, RemoteRankError quoting it elsewhere
        out["send_fp8"] = str(e)

    # 10. torchtitan's 2-D trainer, FSDP over a TP-sharded dim: colwise weights _StridedShard(0) x Shard(0), rowwise
    #     Shard(0) x Shard(1), the rest FSDP-sharded and TP-replicated -> two TP-2 replicas, and through send=
    from torch.distributed.tensor.placement_types import _StridedShard

    def titan(k: str, v: torch.Tensor) -> list:
        if v.dim() == 1:
            return [Shard(0), Replicate()]
        return [Shard(0), Shard(1)] if k.endswith(rowwise) else [_StridedShard(0, split_factor=2), Shard(0)]

    trainer = shard(full, mesh2, titan)
    assert any(type(p).__name__ == "_StridedShard" for p in trainer["model.layers.0.self_attn.q_proj.weight"].placements)
    whole = eager(full, llama_adapter(2))
    layout = vllm_llama.layout(2, rank % 2)
    engine = engine_shards(whole, layout)
    rep = sdadapt.refit_plan(trainer, engine, llama_adapter(2), engine_layout=layout, bucket_bytes=bucket)()
    assert rep.bytes_received + rep.bytes_local == check(engine, whole, layout)
    got_titan: list[tuple[str, object, torch.Tensor]] = []
    sdadapt.refit_plan(trainer, described, llama_adapter(1), send=lambda pieces: got_titan.extend((k, b, p.clone()) for k, b, p in pieces),
                       bucket_bytes=bucket)()  # fmt: skip
    out["sent_titan"] = got_titan

    # 9. DeepSeek-V3 shape (MLA, routed and shared experts, a dense layer): FSDP over 4 -> two TP-2 replicas
    #    (colocated), and FSDP over 0,1 -> EP 2 on ranks 2,3
    from sdadapt.adapters import vllm_deepseek_v3 as vd

    ds = deepseek_hf()
    for ep in (False, True):
        ad = vd.build(**dsv3_opts(ep))
        whole = eager(ds, ad)
        if ep:
            trainer, layout = (shard(ds, pair, fsdp), None) if rank < 2 else (None, vd.layout(2, rank - 2, expert_parallel=True))
        else:
            trainer, layout = shard(ds, world, fsdp), vd.layout(2, rank % 2)
        engine = engine_shards(whole, layout, torch.float32) if layout else None
        rep = sdadapt.refit_plan(trainer, engine, ad, engine_layout=layout, bucket_bytes=bucket)()
        if engine is not None:
            assert rep.bytes_received + rep.bytes_local == check(engine, whole, layout)
        out[f"dsv3_{'ep' if ep else 'tp'}"] = rep.model_dump()

    # 9b. delta mode, colocated (FSDP over 4 -> two TP-2 replicas): an MLA projection (q_a, fused with kv_a
    #     into fused_qkv_a_proj), one routed expert's up_proj (stacked into w13_weight) and a norm, this one
    #     changed through the ranks' local shards (as an optimizer over local tensors does); the rest stays
    ad = vd.build(**dsv3_opts(False))
    trainer = shard({k: v.clone() for k, v in ds.items()}, world, fsdp)
    layout = vd.layout(2, rank % 2)
    whole = eager(ds, ad)
    engine = engine_shards(whole, layout, torch.float32)
    a, x = "model.layers.1.self_attn.q_a_proj.weight", "model.layers.1.mlp.experts.2.up_proj.weight"
    norm = "model.layers.0.post_attention_layernorm.weight"
    whole2 = eager(dict(ds, **{a: ds[a] + 0.25, x: ds[x] - 0.5, norm: ds[norm] + 1.0}), ad)
    assert {k for k in whole if not torch.equal(whole[k], whole2[k])} == {
        "model.layers.1.self_attn.fused_qkv_a_proj.weight", "model.layers.1.mlp.experts.routed_experts.w13_weight", norm}  # fmt: skip

    def change_dsv3() -> None:
        trainer[a].add_(0.25)
        trainer[x].sub_(0.5)
        trainer[norm].to_local().add_(1.0)

    refit = sdadapt.refit_plan(trainer, engine, ad, engine_layout=layout, bucket_bytes=bucket, delta=True)
    out["dsv3_delta"] = delta_step(refit, engine, whole, whole2, layout, change_dsv3)
    return out


def test_refit_four_ranks() -> None:
    results = run_distributed(_cases, 4, 4096, timeout=400)
    for r in results:
        assert "model.norm.weight" in r["mismatch"] and "[23]" in r["mismatch"], r["mismatch"]
        assert "bucket_bytes=32 is too small" in r["small_bucket"], r["small_bucket"]
    whole = eager(llama_hf(), unpadded())
    for case in ("fsdp", "2d"):
        made = {k: torch.full_like(t, float("nan")) for k, t in whole.items()}
        seen = {k: torch.zeros(t.shape, dtype=torch.int32) for k, t in whole.items()}
        for r in results:
            for k, box, piece in r["local_pieces"][case]:
                made[k][slices(box)] = piece
                seen[k][slices(box)] += 1
        for k, t in whole.items():
            assert torch.equal(made[k], t) and bool((seen[k] == 1).all()), (case, k)
    whole1 = eager(llama_hf(), llama_adapter(1))
    for case in ("fsdp", "2d", "titan"):  # send=: the ranks' pieces cover every engine tensor once, bit for bit
        made = {k: torch.full(t.shape, float("nan"), dtype=torch.bfloat16) for k, t in whole1.items()}
        seen = {k: torch.zeros(t.shape, dtype=torch.int32) for k, t in whole1.items()}
        for r in results:
            for k, box, piece in r[f"sent_{case}"]:
                made[k][slices(box)] = piece
                seen[k][slices(box)] += 1
        for k, t in whole1.items():
            assert torch.equal(made[k], t.bfloat16()) and bool((seen[k] == 1).all()), (case, k)
    for r in results:
        assert "several trainer ranks" in r["send_fp8"], r["send_fp8"]
    for case in ("moe_delta", "dsv3_delta"):  # every byte sent is received; the third run moves none
        for run in range(3):
            assert sum(r[case][run]["bytes_sent"] for r in results) == sum(r[case][run]["bytes_received"] for r in results)
    assert all(r["moe_delta"][1]["bytes_sent"] > 0 for r in results[:2])  # both trainer ranks hold a changed norm's rows
    assert [r["disaggregated"]["rounds"] for r in results] == [results[0]["disaggregated"]["rounds"]] * 4
    assert results[0]["disaggregated"]["bytes_sent"] + results[1]["disaggregated"]["bytes_sent"] == sum(
        r["disaggregated"]["bytes_received"] for r in results
    )


def _leaves(hang: bool, answered: str) -> dict[str, object]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard

    rank = dist.get_rank()
    deadline = time.monotonic() + 120
    full = llama_hf(0)
    mesh = DeviceMesh("cpu", [0], mesh_dim_names=("dp",))
    trainer = shard(full, mesh, lambda k, v: [Shard(0)]) if rank == 0 else None
    layout = vllm_llama.layout(1, 0)
    whole = eager(full, llama_adapter(1))
    engine = engine_shards(whole, layout) if rank == 1 else None
    refit = sdadapt.refit_plan(trainer, engine, llama_adapter(1), engine_layout=layout if rank == 1 else None,
                               bucket_bytes=4096, timeout=8 if hang else 60)  # fmt: skip
    if rank == 0:
        # hang: the trainer does not take part in the refit until the engine has given up on it
        # (however long a loaded machine takes to get there), then leaves
        while hang and not os.path.exists(answered) and time.monotonic() < deadline:
            time.sleep(0.1)
        os._exit(0)  # the trainer leaves before the engine's refit
    try:
        refit.run()
    except RefitError as e:
        assert e.updated == [] and len(e.not_updated) == len(engine), (e.updated, e.not_updated)
        raise
    finally:
        open(answered, "w").close()
    return {}


@pytest.mark.parametrize("hang", [False, True])
def test_refit_rank_leaves_or_hangs(hang: bool, tmp_path: Path) -> None:
    """A rank that leaves, or stops answering for longer than ``timeout``: the other rank raises
    RefitError naming what it did not update, and does not hang."""
    with pytest.raises(WorkerError) as info:
        run_distributed(_leaves, 2, hang, str(tmp_path / "answered"), timeout=200)
    by_rank = {f.rank: f for f in info.value.failures}
    assert by_rank[0].type_name == "Crash"
    assert by_rank[1].type_name == "RefitError", by_rank[1]
    assert "were not" in by_rank[1].message
    if hang:
        assert "Timed out" in by_rank[1].message or "timed out" in by_rank[1].message, by_rank[1].message
    assert info.value.seconds < 150  # the launch's own time: a loaded machine's waits for a CPU do not count


# ------------------------------------------------------------------------------ one process
def test_refit_one_process_llama_forward() -> None:
    """vLLM's per-rank packing, checked by its forward: each TP rank's qkv_proj rows split as
    vLLM splits them ([q_r, k_r, v_r]) give rank r's heads; gate_up_proj and down_proj partial
    sums add up to the HF MLP."""
    full = llama_hf(1)
    x = torch.randn(3, D, dtype=torch.float64)
    hf = {k: v.double() for k, v in full.items()}
    p = "model.layers.0."
    q, k, v = (x @ hf[p + f"self_attn.{n}_proj.weight"].T for n in "qkv")
    gate, up = x @ hf[p + "mlp.gate_proj.weight"].T, x @ hf[p + "mlp.up_proj.weight"].T
    mlp = (torch.nn.functional.silu(gate) * up) @ hf[p + "mlp.down_proj.weight"].T
    tp = 2
    qs, ks, mlp_sum = [], [], torch.zeros_like(mlp)
    for r in range(tp):
        layout = vllm_llama.layout(tp, r)
        whole = eager(full, llama_adapter(tp))
        engine = engine_shards(whole, layout, torch.float64)
        rep = sdadapt.refit_plan(full, engine, llama_adapter(tp), engine_layout=layout, bucket_bytes=1 << 12)()
        assert rep.bytes_local > 0 and rep.rounds == 0
        check(engine, whole, layout)
        qkv = x @ engine[p + "self_attn.qkv_proj.weight"].T
        qr, kr, vr = qkv.split([H // tp * HD, KV // tp * HD, KV // tp * HD], dim=-1)
        qs.append(qr)
        ks.append(kr)
        g, u = (x @ engine[p + "mlp.gate_up_proj.weight"].T).chunk(2, dim=-1)
        mlp_sum += (torch.nn.functional.silu(g) * u) @ engine[p + "mlp.down_proj.weight"].T
        emb = engine["model.embed_tokens.weight"]
        assert emb.shape[0] == 128 // tp  # padded to 64, split
    torch.testing.assert_close(torch.cat(qs, -1), q)
    torch.testing.assert_close(torch.cat(ks, -1), k)
    torch.testing.assert_close(mlp_sum, mlp)


def test_refit_computed_recipe_and_errors() -> None:
    """A recipe that computes (an affine on the receiving side) stages its inputs; a trainer
    tensor of another dtype on the wire; the errors of planning."""
    t = {"a": torch.randn(5, 4), "b": torch.randn(3, 4)}
    engine = {"a": torch.zeros(5, 4), "b": torch.zeros(3, 4, dtype=torch.float16)}
    ad = sdadapt.Adapter([sdadapt.affine("a", scale=2.0, shift=1.0), sdadapt.cast("b", "float16")])
    rep = sdadapt.refit_plan(t, engine, ad, bucket_bytes=64)()
    assert torch.equal(engine["a"], t["a"] * 2.0 + 1.0) and torch.equal(engine["b"], t["b"].half())
    assert rep.staged_bytes == 5 * 4 * 4 and sorted(rep.updated) == ["a", "b"]
    with pytest.raises(RefitError, match="do not line up"):
        sdadapt.refit_plan(t, {"a": torch.zeros(5, 4), "c": torch.zeros(1)}, allow_unexpected=["b"])
    wrong = engine_shards(eager(llama_hf(), llama_adapter(2)), vllm_llama.layout(2, 0))
    wrong["model.layers.0.mlp.gate_up_proj.weight"] = torch.zeros(F, D + 1)
    with pytest.raises(RefitError, match=r"(?s)do not line up.*gate_up_proj"):
        sdadapt.refit_plan(llama_hf(), wrong, llama_adapter(2), engine_layout=vllm_llama.layout(2, 0))
    with pytest.raises(RefitError, match="bucket_bytes"):
        sdadapt.refit_plan(t, engine, ad, bucket_bytes=8)
    with pytest.raises(RefitError, match="expected a model"):
        sdadapt.refit_plan(t, [1, 2], ad)  # type: ignore[arg-type]


def test_refit_delta_after_a_failed_run() -> None:
    """Delta mode: a run that fails records none of the versions it read, so the next run sends
    again what changed (never stale values reported unchanged); then nothing moves."""
    t = {"a": torch.randn(5, 4), "b": torch.randn(3, 4)}
    made = {k: torch.full(v.shape, float("nan")) for k, v in t.items()}
    fail = [False]

    def push(pieces: list[tuple[str, object, torch.Tensor]]) -> None:
        if fail[0]:
            raise OSError("engine unreachable")
        for k, box, piece in pieces:
            made[k][slices(box)] = piece

    described = {k: torch.empty(v.shape, device="meta") for k, v in t.items()}
    refit = sdadapt.refit_plan(t, described, sdadapt.Adapter([]), send=push, delta=True)
    assert refit().updated == ["a", "b"]
    with torch.no_grad():
        t["a"].add_(1.0)
    fail[0] = True
    with pytest.raises(RefitError, match="engine unreachable"):
        refit()
    fail[0] = False
    rep = refit()
    assert rep.updated == ["a"] and rep.unchanged == ["b"] and rep.bytes_sent == 5 * 4 * 4
    assert all(torch.equal(made[k], t[k]) for k in t)
    rep = refit()
    assert rep.updated == [] and rep.bytes_sent == 0


def test_schedule_bucket_bound() -> None:
    """Cut transfers never exceed the bucket; a round never has a rank over it; a row is never cut."""
    t = Transfer(0, 1, "w", ((0, 7), (0, 5), (0, 9)), "float32", 0, "w")
    parts = cut_to_fit(t, 256)
    assert all(p.padded <= 256 for p in parts)
    assert sum(math.prod(b - a for a, b in p.box) for p in parts) == 7 * 5 * 9
    with pytest.raises(RefitError, match="too small for one row"):
        cut_to_fit(t, 32)
    many = [Transfer(s, d, "w", ((i, i + 1), (0, 9)), "float32", i, "w") for i in range(10) for s, d in ((0, 1), (1, 2), (2, 0))]
    for r in rounds_of(many, 100, 3):
        for rank in range(3):
            assert sum(x.padded for x in r if rank in (x.src, x.dst)) <= 100


@pytest.mark.parametrize("tp", [1, 2])
def test_vllm_shapes_match_the_adapters(tp: int) -> None:
    """The adapters' whole tensors, cut by the layouts, have the shapes vLLM's layers create
    (written out independently in ``parameter_shapes``)."""
    got = {k: tuple(t.shape) for k, t in engine_shards(eager(llama_hf(), llama_adapter(tp)), vllm_llama.layout(tp, 0)).items()}
    assert got == vllm_llama.parameter_shapes(n_layers=L, vocab_size=V, dim=D, n_heads=H, n_kv_heads=KV, head_dim=HD,
                                              hidden_dim=F, tp=tp)  # fmt: skip
    for ep in (False, True):
        whole = eager(qwen3_moe_titan(), moe_adapter(tp, ep))
        got = {k: tuple(t.shape) for k, t in engine_shards(whole, vllm_qwen3_moe.layout(tp, 0, expert_parallel=ep)).items()}
        assert got == vllm_qwen3_moe.parameter_shapes(n_layers=L, vocab_size=V, dim=D, n_heads=H, n_kv_heads=KV, head_dim=HD,
                                                      moe_hidden_dim=FE, n_experts=E, tp=tp, expert_parallel=ep)  # fmt: skip


DSV3 = dict(n_heads=4, q_lora_rank=12, kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5)


def deepseek_hf(seed: int = 0) -> dict[str, torch.Tensor]:
    """A DeepSeek-V3-shaped HF state dict: layer 0 dense, layer 1 MoE with a shared expert."""
    g = torch.Generator().manual_seed(seed)
    c = DSV3
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}
    for i in range(2):
        a = f"model.layers.{i}.self_attn."
        shapes |= {a + "q_a_proj.weight": (c["q_lora_rank"], D), a + "q_a_layernorm.weight": (c["q_lora_rank"],),
                   a + "q_b_proj.weight": (c["n_heads"] * qk, c["q_lora_rank"]),
                   a + "kv_a_proj_with_mqa.weight": (c["kv_lora_rank"] + c["qk_rope_head_dim"], D),
                   a + "kv_a_layernorm.weight": (c["kv_lora_rank"],),
                   a + "kv_b_proj.weight": (c["n_heads"] * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"]),
                   a + "o_proj.weight": (D, c["n_heads"] * c["v_head_dim"]),
                   f"model.layers.{i}.input_layernorm.weight": (D,), f"model.layers.{i}.post_attention_layernorm.weight": (D,)}  # fmt: skip
    m = "model.layers.0.mlp."
    shapes |= {m + "gate_proj.weight": (F, D), m + "up_proj.weight": (F, D), m + "down_proj.weight": (D, F)}
    m = "model.layers.1.mlp."
    shapes |= {m + "gate.weight": (E, D), m + "gate.e_score_correction_bias": (E,)}
    for e in [*(f"experts.{e}." for e in range(E)), "shared_experts."]:
        shapes |= {m + e + "gate_proj.weight": (FE, D), m + e + "up_proj.weight": (FE, D), m + e + "down_proj.weight": (D, FE)}
    return {k: torch.randn(*s, generator=g) for k, s in shapes.items()}


@pytest.mark.parametrize("ep", [False, True])
def test_refit_deepseek_v3_layout(ep: bool) -> None:
    """MLA (fused_qkv_a_proj whole, q_b/kv_b by heads), routed and shared experts, a dense layer:
    each TP rank's tensors have vLLM's shapes and equal the eager transform cut to their box, and
    MLA's projections computed per rank from them equal the trainer's."""
    from sdadapt.adapters import vllm_deepseek_v3 as vd

    full = deepseek_hf()
    opts = dict(n_heads=DSV3["n_heads"], q_lora_rank=DSV3["q_lora_rank"], kv_lora_rank=DSV3["kv_lora_rank"],
                qk_rope_head_dim=DSV3["qk_rope_head_dim"], moe_hidden_dim=FE, hidden_dim=F, n_experts=E, tp=2,
                expert_parallel=ep)  # fmt: skip
    adapter = vd.build(**opts)
    whole = eager(full, adapter)
    # MLA's forward, as vLLM computes it per TP rank: the fused a-projection split into the query's
    # and the key/value's latents, q_b / kv_b giving the rank's heads, o_proj partial sums adding up
    a = "model.layers.1.self_attn."
    hf = {k: v.double() for k, v in full.items()}
    x = torch.randn(3, D, dtype=torch.float64)
    q_lat, kv_lat = x @ hf[a + "q_a_proj.weight"].T, x @ hf[a + "kv_a_proj_with_mqa.weight"].T
    q, kv = q_lat @ hf[a + "q_b_proj.weight"].T, kv_lat[:, : DSV3["kv_lora_rank"]] @ hf[a + "kv_b_proj.weight"].T
    heads = torch.randn(3, DSV3["n_heads"] * DSV3["v_head_dim"], dtype=torch.float64)
    o = heads @ hf[a + "o_proj.weight"].T
    qs, kvs, o_sum = [], [], torch.zeros_like(o)
    for rank in range(2):
        layout = vd.layout(2, rank, expert_parallel=ep)
        engine = engine_shards(whole, layout, torch.float64)
        sdadapt.refit_plan(full, engine, adapter, engine_layout=layout)()
        lat = x @ engine[a + "fused_qkv_a_proj.weight"].T
        ql, kvl = lat.split([DSV3["q_lora_rank"], lat.shape[-1] - DSV3["q_lora_rank"]], dim=-1)
        qs.append(ql @ engine[a + "q_b_proj.weight"].T)
        kvs.append(kvl[:, : DSV3["kv_lora_rank"]] @ engine[a + "kv_b_proj.weight"].T)
        o_sum += heads.chunk(2, dim=-1)[rank] @ engine[a + "o_proj.weight"].T
    torch.testing.assert_close(torch.cat(qs, -1), q)
    torch.testing.assert_close(torch.cat(kvs, -1), kv)
    torch.testing.assert_close(o_sum, o)
    for rank in range(2):
        layout = vd.layout(2, rank, expert_parallel=ep)
        engine = engine_shards(whole, layout, torch.float32)
        assert {k: tuple(t.shape) for k, t in engine.items()} == vd.parameter_shapes(
            n_layers=2,
            n_dense_layers=1,
            vocab_size=V,
            dim=D,
            qk_nope_head_dim=DSV3["qk_nope_head_dim"],
            v_head_dim=DSV3["v_head_dim"],
            **opts,
        )
        sdadapt.refit_plan(full, engine, adapter, engine_layout=layout, bucket_bytes=1 << 12)()
        check(engine, whole, layout)
    a = "model.layers.1.self_attn."
    fused = whole[a + "fused_qkv_a_proj.weight"]
    assert torch.equal(fused, torch.cat([full[a + "q_a_proj.weight"], full[a + "kv_a_proj_with_mqa.weight"]]))


def test_refit_one_process_moe_forward() -> None:
    """FusedMoE's per-rank computation on the refit's w13_weight / w2_weight (each expert's rows
    split [gate_r; up_r] as vLLM's kernel splits them, w2 by columns) summed over the TP ranks
    equals each expert of the trainer's MLP."""
    moe = qwen3_moe_titan(2)
    p = "layers.1.moe.experts."
    w1, w3, w2 = (moe[p + n].double() for n in ("w1", "w3", "w2"))
    x = torch.randn(3, D, dtype=torch.float64)
    want = [(torch.nn.functional.silu(x @ w1[e].T) * (x @ w3[e].T)) @ w2[e].T for e in range(E)]
    tp = 2
    got = [torch.zeros_like(w) for w in want]
    for r in range(tp):
        layout = vllm_qwen3_moe.layout(tp, r)
        engine = engine_shards(eager(moe, moe_adapter(tp)), layout, torch.float64)
        sdadapt.refit_plan(moe, engine, moe_adapter(tp), engine_layout=layout)()
        fused = "model.layers.1.mlp.experts.routed_experts."
        w13_r, w2_r = engine[fused + "w13_weight"], engine[fused + "w2_weight"]
        for e in range(E):
            gate, up = (x @ w13_r[e].T).chunk(2, dim=-1)
            got[e] += (torch.nn.functional.silu(gate) * up) @ w2_r[e].T
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_vllm_fp8_against_compressed_tensors() -> None:
    """vllm_fp8's e4m3 weights and block scales, refit from float32 and from bfloat16 trainers on
    one process, equal compressed-tensors' block quantization (its min-max scales and its
    quantize) of the same vLLM-layout tensors, bit for bit; each weight is quantized where its
    trainer values are (its e4m3 bytes move, not its inputs); a rank's share of a quantized
    weight that is not whole blocks is refused."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=8, type="float", strategy="block", block_structure=list(FP8_BLOCK), symmetric=True)
    b0, b1 = FP8_BLOCK
    for dtype in (torch.float32, torch.bfloat16):
        full = llama_fp8_hf(dtype)
        plain = eager(full, fp8_adapter(1, unquantized=True))
        layout = vllm_fp8.layout(vllm_llama.layout(1, 0), FP8_BLOCK)
        engine = fp8_engine(eager(full, fp8_adapter(1)), layout)
        rep = sdadapt.refit_plan(full, engine, fp8_adapter(1), engine_layout=layout)()
        quantized = [k for k in engine if k.endswith("_scale_inv")]
        assert len(quantized) == 4
        for sk in quantized:
            k = sk.removesuffix("_scale_inv")
            x = plain[k].float()
            rows, cols = x.shape
            blocks = torch.nn.functional.pad(x, (0, -cols % b1, 0, -rows % b0)).reshape(-(-rows // b0), b0, -(-cols // b1), b1)
            scale, zp = calculate_qparams(blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3)), args)
            want = quantize(x, scale, zp, args).to(torch.float8_e4m3fn)
            assert torch.equal(engine[sk], scale), sk
            assert torch.equal(engine[k].view(torch.uint8), want.view(torch.uint8)), k
        # each weight quantized where its trainer values are (here): e4m3 values and float32 scales, not its inputs
        padding = (128 - V) * D8 * 2 * 2  # vLLM's vocabulary rows, filled
        assert rep.bytes_local == sum(t.numel() * t.element_size() for t in engine.values()) - padding
        assert rep.staged_bytes == 0
    cut = vllm_fp8.layout(vllm_llama.layout(2, 1), (8, 8))
    with pytest.raises(sdadapt.errors.SdadaptError, match="not a multiple of the FP8 block"):
        cut("model.layers.0.mlp.down_proj.weight", torch.zeros(D8, F8 // 2, dtype=torch.float8_e4m3fn))
    # what stays unquantized (the embeddings, the head) is cut as vLLM cuts it, whole blocks or not
    assert cut("model.embed_tokens.weight", torch.zeros(3, D8)) == ((6, D8), ((3, 6), (0, D8)))
