"""FP8 (float32 and UE8M0 scales) and MXFP4 releases loaded into DTensor shards (gloo).

The release and the model are those of ``test_quant``: w1 ``[40, 64]`` and w2 ``[64, 40]`` are
FP8 with ``[16, 32]`` scale tiles, the experts ``[3, 40, 64]`` are MXFP4. Meshes: 2x2 FSDP2+TP
(w1 column-parallel: each rank holds 10 rows, less than a 16-row tile, and TP ranks share tiles;
w2 row-parallel: its 20-column TP shards share a 32-column tile) and 3 ranks, TP alone (14/13/13
rows, experts cut inside their 32-value MXFP4 blocks) and FSDP alone (uneven). Every rank checks
its shard bit-exactly against the loop references of ``test_quant`` and that it read exactly its
own bytes: the FP8 bytes of its region, the scale tiles that region touches, the whole MXFP4
blocks (and their scale bytes) it touches, nothing else.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from support.dist_helper import run_distributed
from support.fp8_releases import BLOCK, Tiny, expected_model, fp8_adapter, parallelize_tiny, release_tensors, write_release
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import sdadapt


def _build(kind: str, dtype: torch.dtype) -> Tiny:
    with torch.device("meta"):
        model = Tiny(dtype)
    return parallelize_tiny(model, kind, shard_experts=True)


def _own_bytes(key: str, offset: tuple[int, ...], shape: tuple[int, ...], fmt: str) -> int:
    """The bytes a rank must read for its shard of ``key`` and nothing more."""
    if 0 in shape:
        return 0
    vol = 1
    for n in shape:
        vol *= n
    if key.endswith(("w1.weight", "w2.weight")):
        (r0, c0), (r1, c1) = offset, (offset[0] + shape[0], offset[1] + shape[1])
        tiles = (-(-r1 // BLOCK[0]) - r0 // BLOCK[0]) * (-(-c1 // BLOCK[1]) - c0 // BLOCK[1])
        return vol + tiles * (4 if fmt == "float32" else 1)  # e4m3 bytes + scale tiles
    if key.endswith("experts"):
        c0, c1 = offset[2], offset[2] + shape[2]
        return shape[0] * shape[1] * (-(-c1 // 32) - c0 // 32) * (16 + 1)  # whole blocks + their scale bytes
    return vol * 2  # bf16 as stored (widened to float32 on the rank)


def _cases(folder: str, kinds: list[str], fmts: list[str], dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)) -> dict[str, Any]:
    """Each ``fmt`` x ``kind`` x ``dtype``: the model built in ``dtype`` (float32: FSDP2's master
    weights) and loaded with no ``dtype=`` option: the dequantised values take the model's dtype
    (the release's bf16 tensors, which have a dtype of their own, are widened by a cast rule that
    only matches bf16 tensors)."""
    out: dict[str, Any] = {}
    for fmt, dtype in [(f, d) for f in fmts for d in dtypes]:
        sub = os.path.join(folder, fmt)
        if dist.get_rank() == 0:
            os.makedirs(sub, exist_ok=True)
            write_release(sub, fmt)
        dist.barrier()
        path = os.path.join(sub, "model.safetensors")
        want = expected_model(fmt, dtype)
        total = sum(t.numel() * t.element_size() for t in release_tensors(fmt).values())
        for kind in kinds:
            model = _build(kind, dtype)
            adapter = fp8_adapter(fmt)  # no cast: the release's bf16 embedding and norm widen exactly
            rep = sdadapt.load(model, path, adapter)
            if dtype == torch.float32:
                assert rep.report.widened, "a float32 model: the release's bf16 tensors are widened"
            bad, own, small_shard, shared_tile, cut_block, uneven = [], 0, False, False, False, False
            for k, v in model.state_dict().items():
                if isinstance(v, DTensor):
                    shape, offset = compute_local_shape_and_global_offset(v.shape, v.device_mesh, v.placements)
                    local, whole = v.to_local(), v.full_tensor()  # collective, same order on all ranks
                else:  # left whole on every rank (embedding and norm under TP alone)
                    shape, offset, local, whole = tuple(v.shape), (0,) * v.dim(), v, v
                region = want[k][tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
                same = local.dtype == dtype and tuple(local.shape) == tuple(shape)
                if not same or not torch.equal(local.view(torch.uint8), region.view(torch.uint8)):
                    bad.append(k)
                if not torch.equal(whole, want[k]):
                    bad.append(k + " (full)")
                own += _own_bytes(k, tuple(offset), tuple(shape), fmt)
                if k.endswith("w1.weight") and 0 < shape[0] < BLOCK[0]:
                    small_shard = True
                if k.endswith(("w1.weight", "w2.weight")) and 0 not in shape and (offset[0] % BLOCK[0] or offset[1] % BLOCK[1]):
                    shared_tile = True
                if k.endswith("experts") and 0 not in shape and (offset[2] % 32 or shape[2] % 32):
                    cut_block = True
                for d, p in enumerate(v.placements if isinstance(v, DTensor) else ()):
                    if p.is_shard() and v.shape[p.dim] % v.device_mesh.size(d):
                        uneven = True
            out[f"{fmt}/{kind}" + ("/float32" if dtype == torch.float32 else "")] = {
                "bad": bad,
                "bytes_read": rep.bytes_read,
                "own": own,
                "total": total,
                "small_shard": small_shard,
                "shared_tile": shared_tile,
                "cut_block": cut_block,
                "uneven": uneven,
            }
            dist.barrier()
    return out


def _check(results: list[dict[str, Any]], case: str) -> None:
    for rank, res in enumerate(results):
        r = res[case]
        assert r["bad"] == [], (rank, case, r)
        assert r["bytes_read"] == r["own"], (rank, case, r)  # its weight bytes and scale tiles only
        assert r["bytes_read"] < r["total"], (rank, case, r)


def test_quantized_fsdp_tp_2x2(tmp_path):
    """bf16 and float32 models (FP8 block with float32 and UE8M0 scales, MXFP4 experts): the
    float32 model takes ``float(w) * scale`` in float32 with no option."""
    dtypes = (torch.bfloat16, torch.float32)
    results = run_distributed(_cases, 4, str(tmp_path), ["fsdp_tp_2x2"], ["float32", "ue8m0"], dtypes, timeout=200)
    for case in [f"{fmt}/fsdp_tp_2x2{d}" for fmt in ("float32", "ue8m0") for d in ("", "/float32")]:
        _check(results, case)
        assert all(r[case]["small_shard"] for r in results)  # 10-row shards of 16-row tiles
        assert any(r[case]["shared_tile"] for r in results)
        assert any(r[case]["uneven"] for r in results)  # 3 experts over 2 FSDP ranks


def test_quantized_three_ranks_uneven(tmp_path):
    results = run_distributed(_cases, 3, str(tmp_path), ["tp", "fsdp"], ["float32"], timeout=170)
    for kind in ("tp", "fsdp"):
        _check(results, f"float32/{kind}")
        assert any(r[f"float32/{kind}"]["uneven"] for r in results), kind
    assert any(r["float32/tp"]["cut_block"] for r in results)  # TP cuts MXFP4 blocks
    assert any(r["float32/tp"]["shared_tile"] for r in results)
