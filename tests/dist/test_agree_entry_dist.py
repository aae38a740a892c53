"""Issue 65 on real gloo processes: ranks that are about to do different things raise before any
byte, on every rank; export gives back what load read (interleave without ``tp=``).

One launched group per world size (2 and 4) runs every case:

- ``load`` of one ``torch.save`` file into an FSDP2 model whose ``qkv`` fuses q, k and v, the last
  rank fusing them in another order: ``DisagreementError`` on every rank naming that rank and
  the order, the meta model still on meta, within seconds;
- the same load with transformers of another release simulated on rank 1: every rank raises,
  naming rank 1's version;
- ``save_state`` with another adapter on the last rank: every rank raises, nothing written;
- ``export`` / ``export_iter`` (both modes) after ``[fuse, interleave (no tp=)]`` on a TP mesh, and
  with a cast after it: the checkpoint's bytes back;
- the same load with every rank agreeing: it loads (the group is still usable);
- on 4 ranks, ``export_iter(local=True)`` on a 2-D (dp x tp) mesh covers a parameter left out of
  the TP plan once, not once per TP rank.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from support.checkpoints import write_torch_save
from support.dist_helper import outcome, run_distributed
from support.models import TinyTransformer, parallelize, split_qkv
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

import sdadapt
from sdadapt._base import agreement


def _qkv(order: str) -> sdadapt.Adapter:
    return sdadapt.Adapter([sdadapt.fuse([f"layers.{{i}}.attn.{p}_proj.{{q}}" for p in order], "layers.{i}.attn.qkv.{q}")], name="qkv")


def _meta_model() -> nn.Module:
    with torch.device("meta"):
        model = TinyTransformer()
    return parallelize(model, init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",)))


class _QK(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qk = nn.Linear(2, 8, bias=False)


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8, bias=False), nn.Linear(4, 6, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x)[..., :6] + self.b(x)


def _cases(folder: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    path = os.path.join(folder, "split.pt")
    out: dict[str, Any] = {}

    model = _meta_model()
    out["disagree"] = outcome(lambda: sdadapt.load(model, path, _qkv("kqv" if rank == world - 1 else "qkv"), subtree="model"))
    out["disagree_meta"] = all(t.is_meta for t in model.state_dict().values())

    real = agreement.installed_versions
    if rank == 1:
        agreement.installed_versions = lambda: {**real(), "transformers": "5.17.0"}  # type: ignore[assignment]
    out["versions"] = outcome(lambda: sdadapt.load(model, path, _qkv("qkv"), subtree="model"))
    agreement.installed_versions = real  # type: ignore[assignment]
    out["versions_meta"] = all(t.is_meta for t in model.state_dict().values())

    out["load"] = outcome(lambda: sdadapt.load(model, path, _qkv("qkv"), subtree="model"))
    dst = os.path.join(folder, f"state-{world}")
    out["save"] = outcome(lambda: sdadapt.save_state(model, dst, adapter=_qkv("vqk" if rank == world - 1 else "qkv")))
    out["save_written"] = os.path.exists(os.path.join(dst, ".metadata"))

    # [fuse, interleave without tp=] on a TP mesh: the degree comes from the model, and back on export
    torch.manual_seed(0)
    q, k = torch.randn(4, 2), torch.randn(4, 2)
    ckpt = os.path.join(folder, f"qk-{world}.pt")
    if rank == 0:
        torch.save({"q.weight": q, "k.weight": k}, ckpt)
    dist.barrier()
    for name, extra in (("interleave", []), ("interleave_cast", [sdadapt.cast("qk.weight", "bfloat16", from_dtype="float32")])):
        adapter = sdadapt.Adapter([sdadapt.fuse(["q.weight", "k.weight"], "qk.weight", sizes=[4, 4]),
                                   sdadapt.interleave("qk.weight", sizes=[4, 4]), *extra], name=name)  # fmt: skip
        tp = _QK().to(torch.bfloat16 if extra else torch.float32)
        parallelize_module(tp, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)), {"qk": ColwiseParallel()})
        got: dict[str, Any] = {"load": outcome(lambda a=adapter, m=tp: sdadapt.load(m, ckpt, a))}
        w = tp.qk.weight
        got["local"] = w.to_local().float().clone() if isinstance(w, DTensor) else None
        got["whole"] = {k: v.float().clone() for k, v in sdadapt.export_iter(tp, adapter)}
        got["pieces"] = [(k, [list(b) for b in box], p.float().clone()) for k, p, box in sdadapt.export_iter(tp, adapter, local=True)]
        out[name] = got
    out["qk"] = (q, k)
    if world == 4:  # a 2-D mesh: a parameter left out of the TP plan is FSDP-sharded on each TP coordinate's dp ranks
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(1)
        two = _Two()
        out["2d_ref"] = {k: v.clone() for k, v in two.state_dict().items()}
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(two, mesh["tp"], {"a": ColwiseParallel()})
        fully_shard(two, mesh=mesh["dp"])
        out["2d_pieces"] = [(k, [list(b) for b in box], p.clone()) for k, p, box in sdadapt.export_iter(two, local=True)]
        out["2d_whole"] = {k: v.clone() for k, v in sdadapt.export_iter(two)}
    return out


def _check(results: list[dict[str, Any]], world: int) -> None:
    last = world - 1
    for r in results:
        assert r["disagree"][0] == "DisagreementError", r["disagree"]
        assert r["disagree"][2] < 30 and r["disagree_meta"], r["disagree"]
        assert r["versions"][0] == "DisagreementError" and r["versions_meta"] and r["versions"][2] < 30, r["versions"]
        assert r["load"][0] == "ok", r["load"]
        assert r["save"][0] == "DisagreementError" and not r["save_written"], r["save"]
    text = results[0]["disagree"][1]
    assert f"rank {last}'s adapter (rule #0) fuses [layers.{{i}}.attn.k_proj.{{q}}, layers.{{i}}.attn.q_proj.{{q}}," in text, text
    assert "nothing was read or written" in text
    assert "rank 1 runs transformers 5.17.0, rank 0" in results[0]["versions"][1], results[0]["versions"][1]
    assert f"rank {last}'s adapter (rule #0) fuses" in results[0]["save"][1]
    q, k = results[0]["qk"]
    for name in ("interleave", "interleave_cast"):
        cast = (lambda t: t.bfloat16().float()) if name.endswith("cast") else (lambda t: t)
        for r, res in enumerate(results):
            got = res[name]
            assert got["load"][0] == "ok", got["load"]
            # rank r's shard holds [q_r; k_r]
            n = 4 // world
            assert torch.equal(got["local"], cast(torch.cat([q[r * n : (r + 1) * n], k[r * n : (r + 1) * n]]))), (name, r)
            assert torch.equal(got["whole"]["q.weight"], cast(q)) and torch.equal(got["whole"]["k.weight"], cast(k)), name
        made = {"q.weight": torch.full((4, 2), float("nan")), "k.weight": torch.full((4, 2), float("nan"))}
        seen = {key: torch.zeros(4, 2, dtype=torch.int32) for key in made}
        for res in results:
            for key, box, piece in res[name]["pieces"]:
                made[key][tuple(slice(a, b) for a, b in box)] = piece
                seen[key][tuple(slice(a, b) for a, b in box)] += 1
        assert torch.equal(made["q.weight"], cast(q)) and torch.equal(made["k.weight"], cast(k)), name
        assert all(bool((s == 1).all()) for s in seen.values()), name
    if world == 4:
        ref = results[0]["2d_ref"]
        made = {k: torch.full_like(v, float("nan")) for k, v in ref.items()}
        seen = {k: torch.zeros(v.shape, dtype=torch.int32) for k, v in ref.items()}
        for res in results:
            assert all(torch.equal(res["2d_whole"][k], v) for k, v in ref.items())
            for key, box, piece in res["2d_pieces"]:
                made[key][tuple(slice(a, b) for a, b in box)] = piece
                seen[key][tuple(slice(a, b) for a, b in box)] += 1
        for k, v in ref.items():
            assert torch.equal(made[k], v) and bool((seen[k] == 1).all()), (k, seen[k])


def _write(folder: str) -> None:
    torch.manual_seed(0)
    sd = TinyTransformer().state_dict()
    write_torch_save(os.path.join(folder, "split.pt"), {"model": split_qkv(sd)})


def test_ranks_agree_two(tmp_path: Any) -> None:
    _write(str(tmp_path))
    _check(run_distributed(_cases, 2, str(tmp_path), timeout=240), 2)


def test_ranks_agree_four(tmp_path: Any) -> None:
    _write(str(tmp_path))
    _check(run_distributed(_cases, 4, str(tmp_path), timeout=300), 4)
