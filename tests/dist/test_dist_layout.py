"""Rotary, interleave, stack and pad read through DTensor shards (gloo, 2x2 FSDP2+TP and 3 ranks).

A checkpoint in an "HF-like" layout (``model.`` prefix, ``_orig_mod.`` segments, q rows in
half-split rotary order, separate q/k/v, one tensor per expert, unpadded vocab) is loaded with
``sdadapt.load`` into a meta-initialised, parallelised model whose fused ``wqkv`` sits under
``ColwiseParallel``. Every rank checks its local shard against the same transforms done
eagerly on full tensors here (plain torch ops), bit-exactly, and that its TP-local ``wqkv`` is
``[q_r; k_r; v_r]`` (what attention code that splits its local projection expects).
Head-cutting and uneven shards are part of the cases (20 rotary rows of 5 heads over 2, 4 and
3 ranks; a partial rotary of 3 heads of 8 rows, 4 rotating, over the same; a per-head fused
query_key_value of 3 heads split into q, k, v of 6 rows; 3 experts over 2 FSDP ranks; 8 vocab
rows over 3 ranks).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from support.dist_helper import run_distributed
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import sdadapt

DIM, HEADS, HD, SIZES, EXPERTS, FFN, VOCAB, PADDED = 8, 5, 4, [12, 6, 6], 3, 6, 7, 8
P_HEADS, P_HD, P_ROT = 3, 8, 4  # partial rotary: 4 of each head's 8 rows rotate (partial_rotary_factor 0.5)
NX_HEADS, NX_HD = 3, 2  # a per-head fused query_key_value [heads, 3, head_dim] (GPT-NeoX), split into q, k, v


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(PADDED, DIM)
        self.wq = nn.Linear(DIM, HEADS * HD, bias=False)
        self.wp = nn.Linear(DIM, P_HEADS * P_HD, bias=False)
        self.nx = nn.ModuleDict({n: nn.Linear(DIM, NX_HEADS * NX_HD) for n in "qkv"})
        self.wqkv = nn.Linear(DIM, sum(SIZES), bias=False)
        self.experts = nn.Parameter(torch.empty(EXPERTS, FFN, DIM))


ADAPTER = sdadapt.Adapter(
    [
        sdadapt.strip_prefix("model."),
        sdadapt.rename("q_proj.weight", "wq.weight"),
        sdadapt.rotary("wq.weight", heads=HEADS, to="interleaved"),
        sdadapt.rename("p_proj.weight", "wp.weight"),
        sdadapt.rotary("wp.weight", heads=P_HEADS, rotary_dim=P_ROT / P_HD),
        sdadapt.split("query_key_value.{p}", ["nx.q.{p}", "nx.k.{p}", "nx.v.{p}"], heads=NX_HEADS),
        sdadapt.fuse(["q.weight", "k.weight", "v.weight"], "wqkv.weight", sizes=SIZES),
        sdadapt.interleave("wqkv.weight", SIZES),  # TP degree from the model's placements
        sdadapt.stack("experts.{e}.w", "experts", count=EXPERTS),
        sdadapt.pad("emb.weight"),  # to the model's vocab
    ],
    name="layout",
)


def source_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    out = {"model.emb.weight": r(VOCAB, DIM), "model._orig_mod.q_proj.weight": r(HEADS * HD, DIM)}
    out["model.p_proj.weight"] = r(P_HEADS * P_HD, DIM)
    out["model.query_key_value.weight"] = r(NX_HEADS * 3 * NX_HD, DIM)
    out["model.query_key_value.bias"] = r(NX_HEADS * 3 * NX_HD)
    for name, n in zip("qkv", SIZES):
        out[f"model.{name}.weight"] = r(n, DIM)
    for e in range(EXPERTS):
        out[f"_orig_mod.model.experts.{e}.w"] = r(FFN, DIM)
    return out


def expected(tp: int) -> dict[str, torch.Tensor]:
    """The transforms, eagerly on full tensors, written independently of sdadapt."""
    s = source_tensors()
    q = s["model._orig_mod.q_proj.weight"]
    wq = q.view(HEADS, 2, HD // 2, DIM).transpose(1, 2).reshape(HEADS * HD, DIM)  # HF -> Meta rotary
    parts = [s[f"model.{n}.weight"] for n in "qkv"]
    wqkv = torch.cat([p.chunk(tp)[r] for r in range(tp) for p in parts])
    experts = torch.stack([s[f"_orig_mod.model.experts.{e}.w"] for e in range(EXPERTS)])
    emb = torch.cat([s["model.emb.weight"], torch.zeros(PADDED - VOCAB, DIM)])
    p = s["model.p_proj.weight"].view(P_HEADS, P_HD, DIM)  # first P_ROT rows of a head: half -> interleaved
    rot = p[:, :P_ROT].reshape(P_HEADS, 2, P_ROT // 2, DIM).transpose(1, 2).reshape(P_HEADS, P_ROT, DIM)
    wp = torch.cat([rot, p[:, P_ROT:]], 1).reshape(P_HEADS * P_HD, DIM)
    nx = {}
    for p_ in ("weight", "bias"):
        t = s[f"model.query_key_value.{p_}"]
        v = t.view(NX_HEADS, 3, NX_HD, *t.shape[1:])
        for j, n in enumerate("qkv"):
            nx[f"nx.{n}.{p_}"] = v[:, j].reshape(NX_HEADS * NX_HD, *t.shape[1:])
    return {"emb.weight": emb, "wq.weight": wq, "wp.weight": wp, "wqkv.weight": wqkv, "experts": experts, **nx}


def _build(kind: str) -> tuple[Block, int]:
    world = dist.get_world_size()
    with torch.device("meta"):
        model = Block()
    tp_plan = {"emb": RowwiseParallel(input_layouts=Replicate()), "wq": ColwiseParallel(), "wp": ColwiseParallel(),
               "wqkv": ColwiseParallel(), **{f"nx.{n}": ColwiseParallel() for n in "qkv"}}
    if kind == "fsdp_tp_2x2":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
        parallelize_module(model, mesh["tp"], tp_plan)
        fully_shard(model, mesh=mesh["fsdp"])
        return model, 2
    if kind == "tp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, tp_plan)
        # experts sharded along their last dim (8 over 3 ranks: uneven)
        model.experts = nn.Parameter(distribute_tensor(model.experts.data, mesh, [Shard(2)]))
        return model, world
    assert kind == "fsdp"
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    fully_shard(model, mesh=mesh)
    return model, 1  # FSDP alone: no TP, the fused rows stay contiguous


def _cases(folder: str, kinds: list[str]) -> dict[str, Any]:
    path = os.path.join(folder, "ckpt.pt")
    if dist.get_rank() == 0:
        torch.save(source_tensors(), path)
    dist.barrier()
    total = sum(t.numel() * t.element_size() for t in source_tensors().values())
    out: dict[str, Any] = {}
    for kind in kinds:
        model, tp = _build(kind)
        rep = sdadapt.load(model, path, ADAPTER)
        want = expected(tp)
        bad, placements, cut_heads, uneven = [], {}, False, False
        for k, v in model.state_dict().items():
            assert isinstance(v, DTensor), k
            placements[k] = str(tuple(v.placements))
            shape, offset = compute_local_shape_and_global_offset(v.shape, v.device_mesh, v.placements)
            region = want[k][tuple(slice(o, o + n) for o, n in zip(offset, shape))]
            if tuple(v.to_local().shape) != tuple(shape) or not torch.equal(v.to_local(), region):
                bad.append(k)
            if (k == "wq.weight" and (offset[0] % HD or shape[0] % HD)) or (k == "wp.weight" and offset[0] % P_HD):
                cut_heads = True
            for mesh_dim, p in enumerate(v.placements):
                if p.is_shard() and v.shape[p.dim] % v.device_mesh.size(mesh_dim):
                    uneven = True
            if not torch.equal(v.full_tensor(), want[k]):  # collective, same order on all ranks
                bad.append(k + " (full)")
        # TP-local wqkv (FSDP gathered, as the layer computes with it) is [q_r; k_r; v_r]
        w = model.wqkv.weight
        if kind == "fsdp_tp_2x2":
            tp_local = w.redistribute(w.device_mesh, [Replicate(), Shard(0)]).to_local()
            r = w.device_mesh.get_local_rank("tp")
        elif kind == "tp":
            tp_local, r = w.to_local(), dist.get_rank()
        else:
            tp_local, r = w.full_tensor(), 0
        src = source_tensors()
        qkv_r = torch.cat([src[f"model.{n}.weight"].chunk(tp)[r] for n in "qkv"])
        out[kind] = {
            "bad": bad,
            "qkv_local_ok": torch.equal(tp_local, qkv_r),
            "placements": placements,
            "cut_heads": cut_heads,
            "uneven": uneven,
            "bytes_read": rep.bytes_read,
            "total": total,
            "tp": tp,
        }
        dist.barrier()
    return out


def _common_checks(results: list[dict[str, Any]], kind: str) -> None:
    for rank, res in enumerate(results):
        r = res[kind]
        assert r["bad"] == [], (rank, kind, r)
        assert r["qkv_local_ok"], (rank, kind, r)
        assert r["bytes_read"] < r["total"], (rank, kind, r)  # lazy: a rank never reads it all


def test_layout_rules_fsdp_tp_2x2(tmp_path):
    results = run_distributed(_cases, 4, str(tmp_path), ["fsdp_tp_2x2"], timeout=150)
    _common_checks(results, "fsdp_tp_2x2")
    assert any(r["fsdp_tp_2x2"]["cut_heads"] for r in results)  # shards cut rotary heads
    assert any(r["fsdp_tp_2x2"]["uneven"] for r in results)  # 3 experts over 2 FSDP ranks
    assert "_StridedShard" in results[0]["fsdp_tp_2x2"]["placements"]["wqkv.weight"]


def test_layout_rules_three_ranks_uneven(tmp_path):
    results = run_distributed(_cases, 3, str(tmp_path), ["tp", "fsdp"], timeout=150)
    for kind in ("tp", "fsdp"):
        _common_checks(results, kind)
        assert any(r[kind]["uneven"] for r in results), kind
    assert results[0]["tp"]["tp"] == 3 and any(r["tp"]["cut_heads"] for r in results)
