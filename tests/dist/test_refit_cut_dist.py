"""Refit into quantized engines when the trainer's shards cut the scale blocks, on 4 gloo ranks.

FP8 (block 4 x 4, vLLM's layout) from trainers whose shards cut blocks: FSDP over 3 ranks (11/11/10
rows), FSDP over 4 (9 rows each) and FSDP x TP 2 x 2 (18 rows per FSDP rank), float32 (some weights
dequantised from FP8 first, so that the exact-neighbour scale search decides; FSDP 4 also
bfloat16). Every engine shard equals the eager quantization of the whole weights
(``support.refit_eager``: the arithmetic compressed-tensors' block quantization gives,
``test_vllm_fp8_against_compressed_tensors``),
bit for bit, and the bytes the plan moves are the engine's own (no float32 block goes over the
wire). MXFP8 (1 x 32 scales along rows) from FSDP 3: its blocks are never cut by rows.
FP8 with one scale per weight (compressed-tensors' ``strategy="tensor"``) from FSDP 3, FSDP 4
(bfloat16) and 2 x 2: no rank holds a weight whole, its holders agree on its largest magnitude
and each sends its rows' codes (the scale is written on the engine from the agreed value).
"""

from __future__ import annotations

import math

import torch
from sdadapt.adapters import vllm_fp8, vllm_llama
from support.dist_helper import run_distributed
from support.refit_eager import bits, eager, llama_weights, local_shape, quant_adapter

import sdadapt
from sdadapt._base.regions import box_shape
from sdadapt._base.schema import slices

BLOCK = (4, 4)
V = 101
# TP 4: each rank's share of every cut dim is whole 4 x 4 blocks; FSDP 4 over the hidden dim (36) is not
D, H, KV, HD, F = 36, 4, 4, 8, 32
D3, H3, KV3, HD3, F3 = 32, 4, 2, 8, 24  # TP 2, FSDP over 3 ranks: 11 / 11 / 10 rows


def hf(dims: tuple[int, int, int, int, int], dtype: torch.dtype, from_fp8: bool, fmt: str = "fp8") -> dict[str, torch.Tensor]:
    """A one-layer Llama in HF's layout; ``from_fp8``: o_proj and down_proj hold values dequantised
    from FP8 blocks (:func:`from_fp8_blocks`), or for ``fmt="nvfp4"`` from NVFP4 (:func:`from_nvfp4`)."""
    sd = llama_weights(1, dims, V, 5)
    if from_fp8 and fmt == "nvfp4":
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            k = f"model.layers.0.{name}.weight"
            sd[k] = from_nvfp4(sd[k])
    elif from_fp8:
        g = torch.Generator().manual_seed(6)
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            k = f"model.layers.0.{name}.weight"
            sd[k] = from_fp8_blocks(sd[k].shape, g)
    return {k: v.to(dtype) for k, v in sd.items()}


def from_fp8_blocks(shape: torch.Size, g: torch.Generator) -> torch.Tensor:
    """Values dequantised from e4m3 codes (448 in every block) and float32 block scales whose
    ``448 * s / 448`` is not ``s``: ``amax / 448`` misses each block's scale by a unit in the
    last place, which the exact-neighbour search finds."""
    b0, b1 = BLOCK
    nr, nc = shape[0] // b0, shape[1] // b1
    s = torch.rand(64 * nr * nc, generator=g) * 1e-3 + 1e-5
    s = s[(s * 448) / torch.full_like(s, 448.0) != s][: nr * nc].reshape(nr, nc)
    codes = (torch.randn(shape, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    codes[::b0, ::b1] = 448.0
    return codes * s.repeat_interleave(b0, 0).repeat_interleave(b1, 1)


def adapter(dims: tuple[int, int, int, int, int], tp: int, fmt: str) -> sdadapt.Adapter:
    _, h, kv, hd, f = dims
    ad = vllm_llama.build(n_heads=h, n_kv_heads=kv, head_dim=hd, hidden_dim=f, tp=tp)
    if fmt == "fp8":
        return ad + vllm_fp8.build(block=BLOCK)
    if fmt in ("fp8_tensor", "nvfp4"):
        return ad + quant_adapter(fmt)
    rule = sdadapt.dequant_scaled("model.layers.**.*_proj.weight", codec="e4m3", strategy="group", group_size=32,
                                  scale_dtype="uint8", scale_suffix=vllm_fp8.SCALE_SUFFIX)  # fmt: skip
    return ad + sdadapt.Adapter([rule]).inverse()


def engine_of(whole: dict[str, torch.Tensor], layout) -> dict[str, torch.Tensor]:
    """One rank's engine tensors: the eager result's dtypes (bf16 for the unquantized), zeros."""
    return {k: torch.zeros(local_shape(layout, t, k), dtype=t.dtype if t.element_size() == 1 or t.dim() >= 2 and "_scale" in k
                           else torch.bfloat16) for k, t in whole.items()}  # fmt: skip


QUANT_SUFFIXES = ("_proj.weight", vllm_fp8.SCALE_SUFFIX, "_global_scale")


def quant_layout(base, whole: dict[str, torch.Tensor], erank: int):  # noqa: ANN001, ANN201 - a vLLM ShardLayout
    """``base`` (a vLLM layout) with the quantized tensors (codes, scales along their weight's rows
    or columns) cut along their weight's TP dim, a one-value scale (per-tensor FP8, NVFP4's global
    scale) whole on every engine rank."""

    def layout(k: str, t: torch.Tensor):  # noqa: ANN202
        if not k.endswith(QUANT_SUFFIXES):
            return base(k, t)
        shape = tuple(whole[k].shape)
        d = base.dim_of(k.removesuffix(vllm_fp8.SCALE_SUFFIX)) if k.endswith(("_proj.weight", vllm_fp8.SCALE_SUFFIX)) else None
        d = d if d is not None and len(shape) == 2 else None
        return shape, tuple((erank * n // base.size, (erank + 1) * n // base.size) if i == d else (0, n) for i, n in enumerate(shape))

    return layout


def from_nvfp4(w: torch.Tensor) -> torch.Tensor:
    """Values dequantised from NVFP4 under a global scale near ``448 * 6 / amax`` whose dequantised
    values' own ``448 * 6 / amax`` misses it by a float32 unit: the neighbour search decides."""
    from support.checkpoints import DictIO

    from sdadapt._recipes import quant_scaled as S
    from sdadapt._recipes.nodes import Leaf
    from sdadapt._recipes.quant_scaled_nodes import GlobalScaleOf

    node = GlobalScaleOf(Leaf("w", tuple(w.shape), torch.float32), "divide")
    for k in range(64):
        g = torch.nextafter(torch.full((1,), 448.0 * 6.0) / w.abs().amax().reshape(1) * (1 + k / 64), torch.zeros(1))
        q, sc = S.quantize_nvfp4(w, g, "divide")
        deq = S.dequantize(q, "e2m1", sc, (1, 16), w.shape[-1], torch.float32, glob=g)
        if not torch.equal(node.full(DictIO({"w": deq})), torch.full((1,), 448.0 * 6.0) / deq.abs().amax().reshape(1)):
            return deq
    raise AssertionError("no global scale whose dequantised values miss it")


def _case(name: str, trainer, engine_ranks: list[int], dims, tp: int, dtype: torch.dtype, fmt: str, from_fp8: bool) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    full = hf(dims, dtype, from_fp8, fmt)
    ad = adapter(dims, tp, fmt)
    whole = eager(full, ad)
    erank = engine_ranks.index(rank) if rank in engine_ranks else -1
    layout = vllm_llama.layout(tp, erank) if erank >= 0 else None
    engine = None
    if layout is not None and fmt in ("fp8_tensor", "nvfp4"):
        layout = quant_layout(layout, whole, erank)
        engine = {k: torch.zeros(box_shape(layout(k, t)[1]), dtype=t.dtype) if k.endswith(QUANT_SUFFIXES)
                  else engine_of({k: t}, vllm_llama.layout(tp, erank))[k] for k, t in whole.items()}  # fmt: skip
    elif layout is not None:  # the scales cut as their weights, whole blocks per rank
        layout = vllm_fp8.layout(layout, BLOCK if fmt == "fp8" else (1, 32))
        engine = engine_of(whole, layout)
    refit = sdadapt.refit_plan(trainer(full), engine, ad, engine_layout=layout, bucket_bytes=4096)
    rep = refit()
    engine_bytes = 0
    if engine is not None:
        for k, t in engine.items():
            _, box = layout(k, t)
            assert torch.equal(bits(t), bits(whole[k][slices(box)].to(t.dtype))), (name, k)
            rows = V if k.endswith(("embed_tokens.weight", "lm_head.weight")) else None
            kept = t.numel() if rows is None else max(0, min(box[0][1], rows) - box[0][0]) * math.prod(t.shape[1:])
            engine_bytes += kept * t.element_size()
        assert rep.staged_bytes == 0, (name, rep)  # no block's inputs were sent to be quantized here
    again = refit()  # the plan reused: the same bytes again
    assert again.bytes_received == rep.bytes_received and again.bytes_local == rep.bytes_local
    moved = sum(t.nbytes for t in refit.transfers)
    return {"engine_bytes": engine_bytes, "moved": moved, "cut_bands": len(refit.mine.cut.bands),
            "received": rep.bytes_received + rep.bytes_local}  # fmt: skip


def _cases() -> dict[str, dict]:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    def sharded(mesh, place):
        return lambda full: {k: distribute_tensor(v, mesh, place(k), src_data_rank=None) for k, v in full.items()}

    import torch.distributed as dist

    rank = dist.get_rank()
    trio = DeviceMesh("cpu", [0, 1, 2], mesh_dim_names=("dp",))
    four = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    rowwise = ("o_proj.weight", "down_proj.weight")
    fsdp3 = sharded(trio, lambda k: [Shard(0)])
    fsdp4 = sharded(four, lambda k: [Shard(0)])
    two_d = sharded(grid, lambda k: [Shard(0), Shard(1) if k.endswith(rowwise) else Shard(0)])
    def trainer3(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        return fsdp3(full) if rank < 3 else None

    out = {}
    out["fsdp3"] = _case("fsdp3", trainer3, [2, 3], (D3, H3, KV3, HD3, F3), 2, torch.float32, "fp8", True)
    out["2x2"] = _case("2x2", two_d, [0, 1, 2, 3], (D, H, KV, HD, F), 4, torch.float32, "fp8", True)
    for dtype in (torch.float32, torch.bfloat16):  # bfloat16: no scale search, one agreement only
        out[f"fsdp4_{str(dtype).removeprefix('torch.')}"] = _case("fsdp4", fsdp4, [0, 1, 2, 3], (D, H, KV, HD, F), 4, dtype, "fp8", True)
    out["mxfp8_fsdp3"] = _case("mxfp8", trainer3, [2, 3], (32, 4, 2, 16, 64), 2, torch.float32, "mxfp8", False)
    out["tensor_fsdp3"] = _case("tensor_fsdp3", trainer3, [2, 3], (D3, H3, KV3, HD3, F3), 2, torch.float32, "fp8_tensor", False)
    out["tensor_fsdp4"] = _case("tensor_fsdp4", fsdp4, [0, 1, 2, 3], (D, H, KV, HD, F), 4, torch.bfloat16, "fp8_tensor", False)
    out["tensor_2x2"] = _case("tensor_2x2", two_d, [0, 1, 2, 3], (D, H, KV, HD, F), 4, torch.float32, "fp8_tensor", False)
    fp4 = (32, 4, 2, 16, 64)  # rows of whole groups of 16 on every engine rank (TP 2 and 4)
    out["nvfp4_fsdp3"] = _case("nvfp4_fsdp3", trainer3, [2, 3], fp4, 2, torch.float32, "nvfp4", True)
    out["nvfp4_fsdp4"] = _case("nvfp4_fsdp4", fsdp4, [0, 1, 2, 3], fp4, 4, torch.bfloat16, "nvfp4", False)
    out["nvfp4_2x2"] = _case("nvfp4_2x2", two_d, [0, 1, 2, 3], fp4, 4, torch.float32, "nvfp4", True)
    return out


def test_refit_cut_blocks_move_the_engines_bytes() -> None:
    results = run_distributed(_cases, 4, timeout=300)
    for case in results[0]:
        engine = sum(r[case]["engine_bytes"] for r in results)
        moved = results[0][case]["moved"]  # every rank plans the same transfers
        assert all(r[case]["moved"] == moved for r in results)
        assert sum(r[case]["received"] for r in results) == moved, case
        assert moved <= 1.05 * engine, (case, moved, engine, moved / engine)
        if case.startswith(("fsdp", "2x2", "tensor", "nvfp4")):  # blocks (weights) were cut, and quantized by their holders
            assert sum(r[case]["cut_bands"] for r in results) > 0, case
