"""compressed-tensors, ModelOpt and per-tensor FP8 releases loaded into DTensor shards (gloo).

The releases and the model are those of ``test_quant_ct`` (w1 ``[160, 64]`` column-parallel, w2
``[64, 160]`` row-parallel). Meshes: 2x2 FSDP2+TP (bf16 and float32 models) and 3 ranks, TP alone
(54/53/53 rows of w1 and columns of w2: shards cut int4 words, e2m1 bytes, 16- and 32-value
groups, and rows of the 64-row FP8 blocks, so each TP shard of w1 is smaller than a block) and
FSDP alone (uneven). Every rank checks its shard bit-exactly against the format's reference and
that it read less than the whole release. The 2x2 float32 models are exported back (each rank
re-quantizing its shards' regions: packs, groups and packed zero-point words cut by TP), with the
bytes of the same release exported from a model of one process. One launched group runs every format.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support.dist_helper import run_distributed
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import sdadapt
from sdadapt._engine import device_work
from sdadapt._plan.target import model_state_dict

pytest.importorskip("compressed_tensors")

from support.fp8_releases import parallelize_tiny  # noqa: E402
from support.scaled_releases import CT_FORMATS, HAND_FORMATS, Tiny, adapter_for, export_adapter, write_case  # noqa: E402


def _build(kind: str, dtype: torch.dtype) -> Tiny:
    with torch.device("meta"):
        model = Tiny(dtype)
    return parallelize_tiny(model, kind)


def _cases(folder: str, kinds: list[str], names: list[str], dtypes: list[torch.dtype]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        sub = os.path.join(folder, name)
        if dist.get_rank() == 0:
            write_case(sub, name)
        dist.barrier()
        wants = write_case(os.path.join(folder, f"{name}.rank{dist.get_rank()}"), name)  # the same seeds: the references
        total = os.path.getsize(os.path.join(sub, "model.safetensors"))
        for kind in kinds:
            for dtype in dtypes:
                model = _build(kind, dtype)
                adapter = adapter_for(sub)
                if dtype == torch.float32:
                    adapter = sdadapt.Adapter([*adapter.rules, sdadapt.cast("**", "model", from_dtype="bfloat16")])
                if dtype == dtypes[0]:  # would a GPU load pin band buffers (computations it cannot gather)?
                    source, plan = sdadapt.plan_load(model, sub, adapter)
                    source.close()
                    out[f"{name}/{kind}/bands"] = device_work(plan.recipes, model_state_dict(model), gather=True)[1]
                rep = sdadapt.load(model, sub, adapter)
                want = wants[str(dtype).removeprefix("torch.")]
                bad, cut = [], False
                for k, v in model.state_dict().items():
                    if isinstance(v, DTensor):
                        shape, offset = compute_local_shape_and_global_offset(v.shape, v.device_mesh, v.placements)
                        local = v.to_local()
                    else:
                        shape, offset, local = tuple(v.shape), (0,) * v.dim(), v
                    region = want[k][tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
                    same = local.dtype == dtype and tuple(local.shape) == tuple(shape)
                    if not same or not torch.equal(local.contiguous().view(torch.uint8), region.contiguous().view(torch.uint8)):
                        bad.append(k)
                    if k.endswith("w2.weight") and 0 not in shape and offset[1] % 16:
                        cut = True  # a shard that starts inside a pack / group
                out[f"{name}/{kind}/{dtype}"] = {"bad": bad, "bytes_read": rep.bytes_read, "total": total, "cut": cut}
                if kind == "fsdp_tp_2x2" and dtype == torch.float32:  # each rank re-quantizes its shards' regions
                    sdadapt.export(model, os.path.join(folder, f"{name}.export"), export_adapter(sub, dtype))
                dist.barrier()
    return out


def _check(results: list[dict[str, Any]], case: str, sharded: bool = True) -> None:
    for rank, res in enumerate(results):
        r = res[case]
        assert r["bad"] == [], (rank, case, r)
        if sharded:
            assert r["bytes_read"] < r["total"], (rank, case, r)


ALL = CT_FORMATS + HAND_FORMATS


def test_scaled_formats_fsdp_tp_2x2(tmp_path):
    dtypes = [torch.bfloat16, torch.float32]
    results = run_distributed(_cases, 4, str(tmp_path), ["fsdp_tp_2x2"], ALL, dtypes, timeout=400)
    for name in ALL:
        for dtype in dtypes:
            _check(results, f"{name}/fsdp_tp_2x2/{dtype}")
        # w2's TP shards hold part of each row: its inputs lie in runs too short to gather
        assert all(res[f"{name}/fsdp_tp_2x2/bands"] for res in results), name
        _check_export(str(tmp_path), name)


def _check_export(folder: str, name: str) -> None:
    """The export of the sharded float32 model has the bytes of the same release loaded into a
    model of one process and exported (here, in the test's process)."""
    from safetensors.torch import load_file

    release, whole = os.path.join(folder, name), os.path.join(folder, f"{name}.whole")
    model, adapter = Tiny(torch.float32), export_adapter(release, torch.float32)
    sdadapt.load(model, release, adapter)
    sdadapt.export(model, whole, adapter)
    a = load_file(os.path.join(folder, f"{name}.export", "model.safetensors"))
    b = load_file(os.path.join(whole, "model.safetensors"))
    assert sorted(a) == sorted(b), name
    for k, v in a.items():
        same = v.dtype == b[k].dtype and v.shape == b[k].shape
        assert same and torch.equal(v.reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), (name, k)


def test_scaled_formats_three_uneven_ranks(tmp_path):
    results = run_distributed(_cases, 3, str(tmp_path), ["tp", "fsdp"], ALL, [torch.float32], timeout=400)
    for name in ALL:
        _check(results, f"{name}/tp/torch.float32", sharded=False)  # embedding and head stay whole under TP alone
        _check(results, f"{name}/fsdp/torch.float32")
        assert any(r[f"{name}/tp/torch.float32"]["cut"] for r in results), name
        # FSDP shards whole rows: every computation gathers, no band buffer is pinned for it
        assert all(r[f"{name}/tp/bands"] and not r[f"{name}/fsdp/bands"] for r in results), name
