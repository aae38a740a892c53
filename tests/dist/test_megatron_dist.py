"""Megatron-Core checkpoints (written by megatron-core itself, ``support.megatron_ckpt``) loaded on 2
gloo ranks: a transformers model under FSDP2 and one under tensor parallelism, each rank reading
only its rows; every value equal to Megatron's own state (through ``hf_reference``), bit for bit;
and torchtitan's own Llama3 under FSDP2 (``to="titan"``), its logits against Megatron's forward
(where torchtitan imports: 0.3.0 needs torch 2.13's FSDP API)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from support.dist_helper import run_distributed
from support.megatron_ckpt import hf_model, hf_reference, megatron_checkpoints, oracle, titan_dense

import sdadapt

TP_PLAN = {
    "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise",
}  # fmt: skip


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _stored_bytes(src: str) -> int:
    with sdadapt.sources.open_source(src) as s:
        return sum(torch.Size(info.shape).numel() * info.dtype.itemsize for info in s.schema.values())


def worker(root: str) -> dict[str, Any]:
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out: dict[str, Any] = {}
    for name, how in (("dense", "fsdp"), ("dense_tp2", "fsdp"), ("moe_sequential", "fsdp"), ("dense", "tp")):
        src = os.path.join(root, name)
        moe = name.startswith("moe")
        model = hf_model(name, "meta")
        for layer in model.model.layers:
            if how == "fsdp":
                fully_shard(layer, mesh=mesh)
            else:
                plan = {k: ColwiseParallel() if v == "colwise" else RowwiseParallel() for k, v in TP_PLAN.items()}
                parallelize_module(layer, mesh, plan)
        if how == "fsdp":
            fully_shard(model, mesh=mesh)
        adapter = sdadapt.get_adapter("megatron_gpt", src, experts_to="stacked") if moe else "megatron_gpt"
        report = sdadapt.load(model, src, adapter)
        want = hf_reference(oracle(root, name)["state"], experts_to="stacked" if moe else "per_expert")
        state = model.state_dict()
        unequal = sorted(k for k, v in state.items() if not torch.equal(_full(v), want[k]))
        out[f"{name}/{how}"] = {"unequal": unequal, "bytes_read": report.bytes_read, "stored": _stored_bytes(src),
                                "sharded": sum(1 for v in state.values() if type(v).__name__ == "DTensor")}
        dist.barrier()
    return out


def titan_worker(root: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    return {"dense/titan-fsdp": _titan_case(root, init_device_mesh("cpu", (dist.get_world_size(),)))}


def _titan_case(root: str, mesh: Any) -> dict[str, Any]:
    """torchtitan's own Llama3 under FSDP2 from the ``dense`` checkpoint (``to="titan"``, aimed at
    the model's names by ``torchtitan_names``): its logits against Megatron's forward."""
    from support.titan_models import titan_logits
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from sdadapt.torchtitan import torchtitan_names

    src = os.path.join(root, "dense")
    model = titan_dense()
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    names = torchtitan_names(model)
    assert names is not None
    report = sdadapt.load(model, src, sdadapt.get_adapter("megatron_gpt", src, to="titan") + names)
    o = oracle(root, "dense")
    with torch.no_grad():
        logits = titan_logits(model.eval(), o["tokens"])
    state = model.state_dict()
    return {"unequal": [], "bytes_read": report.bytes_read, "stored": _stored_bytes(src),
            "sharded": sum(1 for v in state.values() if isinstance(v, DTensor)),
            "logits_max_diff": float((logits - o["logits"]).abs().max())}  # fmt: skip


def _check(ranks: list[dict[str, Any]]) -> None:
    for case in ranks[0]:
        per_rank = [r[case] for r in ranks]
        for r in per_rank:
            assert r["unequal"] == [], (case, r["unequal"])
            assert r["sharded"] > 0, case
        if "logits_max_diff" in per_rank[0]:  # within transformers' distance from Megatron's forward (6.6e-7)
            assert all(r["logits_max_diff"] < 2e-6 for r in per_rank), (case, [r["logits_max_diff"] for r in per_rank])
        stored = per_rank[0]["stored"]
        # each rank reads its own rows: about half the tensors (the unsharded norms on both ranks)
        assert all(r["bytes_read"] < 0.7 * stored for r in per_rank), (case, [r["bytes_read"] for r in per_rank], stored)
        assert sum(r["bytes_read"] for r in per_rank) >= stored * 0.9, case


def test_megatron_checkpoints_on_two_ranks() -> None:
    _check(run_distributed(worker, 2, megatron_checkpoints(), timeout=600))


def test_megatron_checkpoint_into_torchtitan_on_two_ranks() -> None:
    pytest.importorskip("torchtitan", reason="torchtitan is not installed (scripts/test.sh installs it: the test-titan extra, "
                        "then pip install --no-deps torchtitan==0.3.0)")  # fmt: skip
    try:
        import torchtitan.models.llama3  # noqa: F401
    except ImportError as e:
        if torch.__version__ >= "2.13":
            raise  # on the torch it is built for, torchtitan's Llama3 must import
        pytest.skip(f"torchtitan 0.3.0 is built for torch 2.13's FSDP API and does not import on torch {torch.__version__} ({e})")
    _check(run_distributed(titan_worker, 2, megatron_checkpoints(), timeout=600))
