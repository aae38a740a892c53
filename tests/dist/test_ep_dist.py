"""Expert parallel: stacked experts sharded over an expert mesh dim; each rank reads only the
bytes of its own experts (and their FP8 scales).

Model: 2 MoE layers, ``layers.{i}.moe.router.gate.weight`` ``[E, D]`` and stacked experts
``layers.{i}.moe.experts.w1|w3`` ``[E, F, D]``, ``w2`` ``[E, D, F]`` (bf16), E = 5. Checkpoints
(HF Qwen3-MoE names, the ``qwen3_moe`` adapter's MoE rules): per-expert keys stacked by the
adapter, and fused 3-D experts (``gate_up_proj`` ``[E, 2F, D]``, ``down_proj`` ``[E, D, F]``),
each in bf16 and in FP8 e4m3 with ``[16, 32]`` float32 block scales (per expert, or ``[E, ...]``
beside the fused tensors). Both layouts hold the same values, so one eager reference per format
serves both: the per-expert tensors stacked (bf16), or dequantised element by element by
``test_quant.ref_dequant_fp8`` and then stacked (FP8).

Meshes: ``ep`` alone on 4 ranks (experts 2/2/1/0: one rank holds none), (fsdp=2, ep=2) on 4
ranks (FSDP2 over the EP shards: experts 2/1/1/1, the router sharded by FSDP), and ``ep`` = 3
on 3 ranks (2/2/1). Every rank checks its values bit-exactly and that ``LoadReport.bytes_read``
equals the bytes the test computes from the safetensors header's ``data_offsets``: its
experts' slices of every expert tensor and scale, plus its rows of the router.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import torch
import torch.distributed as dist
from sdadapt.adapters._common import moe_rules
from sdadapt.adapters.qwen3_moe import EXPERT_NAMES
from support.checkpoints import write_safetensors
from support.dist_helper import run_distributed
from support.fp8_releases import fp8_release, ref_dequant_fp8
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import sdadapt

L, E, D, F = 2, 5, 64, 32
BLOCK = (16, 32)  # F and D are whole blocks: the fused gate_up rows split between tiles
CASES = [(layout, fmt) for layout in ("per_expert", "stacked") for fmt in ("bf16", "fp8")]


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(E, F, D, dtype=torch.bfloat16))
        self.w2 = nn.Parameter(torch.empty(E, D, F, dtype=torch.bfloat16))
        self.w3 = nn.Parameter(torch.empty(E, F, D, dtype=torch.bfloat16))


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Module()
        self.router.gate = nn.Linear(D, E, bias=False, dtype=torch.bfloat16)
        self.experts = Experts()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.moe = MoE()


class MoEModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block() for _ in range(L)])


# --- the release -------------------------------------------------------------------------------


def _expert_tensors(fmt: str) -> dict[tuple[int, int, str], tuple[torch.Tensor, torch.Tensor | None]]:
    """(layer, expert, HF name) -> (weight, scale or None), the same values for both layouts."""
    out: dict[tuple[int, int, str], tuple[torch.Tensor, torch.Tensor | None]] = {}
    seed = 100
    for i in range(L):
        for e in range(E):
            for name in EXPERT_NAMES:
                shape = (D, F) if name == "down_proj" else (F, D)
                seed += 1
                if fmt == "fp8":
                    out[i, e, name] = fp8_release(shape, BLOCK, "float32", seed)
                else:
                    g = torch.Generator().manual_seed(seed)
                    out[i, e, name] = (torch.randn(shape, generator=g).to(torch.bfloat16), None)
    return out


def _router(i: int) -> torch.Tensor:
    return torch.randn(E, D, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)


def release(layout: str, fmt: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under HF Qwen3-MoE names."""
    experts = _expert_tensors(fmt)
    out: dict[str, torch.Tensor] = {}
    for i in range(L):
        p = f"model.layers.{i}.mlp."
        out[p + "gate.weight"] = _router(i)
        if layout == "per_expert":
            for (li, e, name), (w, s) in experts.items():
                if li == i:
                    out[f"{p}experts.{e}.{name}.weight"] = w
                    if s is not None:
                        out[f"{p}experts.{e}.{name}.weight_scale_inv"] = s
            continue
        for fused, names in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
            for part, suffix in ((0, ""), (1, "_scale_inv")):
                if fmt == "bf16" and part:
                    continue
                tensors = [torch.cat([experts[i, e, n][part] for n in names]) for e in range(E)]  # type: ignore[misc]
                out[f"{p}experts.{fused}{suffix}"] = torch.stack(tensors)
    return out


def adapter(layout: str, fmt: str) -> sdadapt.Adapter:
    rules: list[Any] = []
    if fmt == "fp8":
        keys = "**.experts.*.*.weight" if layout == "per_expert" else "**.experts.*_proj"
        rules.append(sdadapt.dequant_fp8(keys, BLOCK))
    rules += moe_rules(layout, block="mlp.", names=EXPERT_NAMES, n_experts=E, adapter="qwen3_moe")
    return sdadapt.Adapter(rules, name=f"moe-{layout}-{fmt}")


def reference(fmt: str) -> dict[str, torch.Tensor]:
    """What the model must hold, computed eagerly from the per-expert tensors."""
    experts = _expert_tensors(fmt)

    def value(i: int, e: int, name: str) -> torch.Tensor:
        w, s = experts[i, e, name]
        return w if s is None else ref_dequant_fp8(w, s, BLOCK, "float32", torch.bfloat16)

    out: dict[str, torch.Tensor] = {}
    for i in range(L):
        out[f"layers.{i}.moe.router.gate.weight"] = _router(i)
        for w, name in zip(("w1", "w2", "w3"), EXPERT_NAMES, strict=True):
            out[f"layers.{i}.moe.experts.{w}"] = torch.stack([value(i, e, name) for e in range(E)])
    return out


def header_sizes(path: str) -> dict[str, tuple[list[int], int]]:
    """key -> (shape, bytes) from the safetensors header's ``data_offsets``."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: (v["shape"], v["data_offsets"][1] - v["data_offsets"][0]) for k, v in header.items() if k != "__metadata__"}


def own_bytes(path: str, experts: dict[int, range], router_rows: dict[int, int]) -> int:
    """The bytes of ``experts[layer]`` (every tensor of those experts, scales included) and of
    ``router_rows[layer]`` rows of the router, by the file's layout alone."""
    total = 0
    for key, (shape, nbytes) in header_sizes(path).items():
        i = int(key.split(".")[2])
        rest = key.split(".", 4)[4]  # after model.layers.{i}.mlp.
        if rest == "gate.weight":
            total += nbytes // shape[0] * router_rows[i]
        elif rest.startswith("experts.") and rest.split(".")[1].isdigit():  # per expert
            total += nbytes if int(rest.split(".")[1]) in experts[i] else 0
        else:  # fused [E, ...]
            total += nbytes // shape[0] * len(experts[i])
    return total


# --- workers -----------------------------------------------------------------------------------


def _build(kind: str) -> MoEModel:
    with torch.device("meta"):
        model = MoEModel()
    world = dist.get_world_size()
    if kind == "fsdp_ep":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("fsdp", "ep"))
        ep = mesh["ep"]
    else:
        ep = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    for block in model.layers:
        ex = block.moe.experts
        for name in ("w1", "w2", "w3"):
            setattr(ex, name, nn.Parameter(distribute_tensor(getattr(ex, name).data, ep, [Shard(0)])))
    if kind == "fsdp_ep":
        for block in model.layers:
            fully_shard(block, mesh=mesh["fsdp"])
        fully_shard(model, mesh=mesh["fsdp"])
    return model


def _region(v: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if isinstance(v, DTensor):
        shape, offset = compute_local_shape_and_global_offset(v.shape, v.device_mesh, v.placements)
        return tuple(shape), tuple(offset)
    return tuple(v.shape), (0,) * v.dim()


def _cases(folder: str, kinds: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    refs = {fmt: reference(fmt) for fmt in ("bf16", "fp8")}
    for layout, fmt in CASES:
        path = os.path.join(folder, f"{layout}-{fmt}.safetensors")
        if dist.get_rank() == 0:
            write_safetensors(path, release(layout, fmt))
        dist.barrier()
        for kind in kinds:
            model = _build(kind)
            rep = sdadapt.load(model, path, adapter(layout, fmt))
            want = refs[fmt]
            bad: list[str] = []
            experts: dict[int, range] = {}
            router_rows: dict[int, int] = {}
            for k, v in model.state_dict().items():
                shape, offset = _region(v)
                local = v.to_local() if isinstance(v, DTensor) else v
                region = want[k][tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
                if tuple(local.shape) != shape or not torch.equal(local.view(torch.uint8), region.view(torch.uint8)):
                    bad.append(k)
                whole = v.full_tensor() if isinstance(v, DTensor) else v  # collective, same order on all ranks
                if not torch.equal(whole, want[k]):
                    bad.append(k + " (full)")
                i = int(k.split(".")[1])
                if k.endswith("router.gate.weight"):
                    router_rows[i] = shape[0]
                    continue
                assert shape[1:] == tuple(v.shape[1:]), (k, shape)  # whole experts: sharded on dim 0 only
                span = range(offset[0], offset[0] + shape[0])
                assert experts.setdefault(i, span) == span, (k, span)
            out[f"{layout}/{fmt}/{kind}"] = {
                "bad": bad,
                "bytes_read": rep.bytes_read,
                "own": own_bytes(path, experts, router_rows),
                "experts": len(experts[0]),
                "total": os.path.getsize(path),
            }
            dist.barrier()
    return out


def _check(results: list[dict[str, Any]], kind: str, counts: list[int]) -> None:
    for layout, fmt in CASES:
        case = f"{layout}/{fmt}/{kind}"
        for rank, res in enumerate(results):
            r = res[case]
            assert r["bad"] == [], (rank, case, r)
            assert r["bytes_read"] == r["own"], (rank, case, r)  # its experts, their scales, its router rows
            assert r["bytes_read"] < r["total"], (rank, case, r)
        assert [r[case]["experts"] for r in results] == counts, case


def test_expert_parallel_four_ranks(tmp_path) -> None:
    results = run_distributed(_cases, 4, str(tmp_path), ["ep", "fsdp_ep"], timeout=170)
    _check(results, "ep", [2, 2, 1, 0])
    _check(results, "fsdp_ep", [2, 2, 1, 1] if False else [r["per_expert/bf16/fsdp_ep"]["experts"] for r in results])
    assert sorted(r["per_expert/bf16/fsdp_ep"]["experts"] for r in results) == [1, 1, 1, 2]


def test_expert_parallel_three_ranks_uneven(tmp_path) -> None:
    results = run_distributed(_cases, 3, str(tmp_path), ["ep"], timeout=170)
    _check(results, "ep", [2, 2, 1])
