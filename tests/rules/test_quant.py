"""Quantized sources: formats, lazy region reads, dequant rules, load, export round trip, plan errors.

The references here are written independently of sdadapt: element-by-element Python loops
over the stored bytes (FP8 block scales, UE8M0 exponents, MXFP4 nibbles), transformers' own
dequantisation functions where they run on CPU, and a brute-force nearest-value search for
e2m1 rounding.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from support.checkpoints import DictIO, write_safetensors
from support.fp8_releases import (
    BLOCK,
    FP4,
    Tiny,
    expected_model,
    fp8_adapter,
    fp8_release,
    mxfp4_release,
    ref_dequant_fp8,
    ref_dequant_mxfp4,
    release_tensors,
    write_release,
)
from torch import nn

import sdadapt
from sdadapt._export import convert
from sdadapt._recipes import quant as Q
from sdadapt._recipes import quant_nodes as QN
from sdadapt._recipes.nodes import Leaf
from sdadapt.errors import AdapterError, PlanError

# --- independent references ------------------------------------------------------------------------


def ref_e2m1(y: float) -> int:
    """Nearest e2m1 code by brute force, ties to the even code, saturating at 6."""
    mags = FP4[:8]
    a = min(abs(y), 6.0)
    best = min(range(8), key=lambda c: (abs(mags[c] - a), c % 2))
    return best | (8 if (y < 0 or (y == 0 and str(y).startswith("-"))) else 0)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


# --- formats ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["float32", "ue8m0", "ue8m0_float32"])
@pytest.mark.parametrize("block", [(4, 8), (5, 3), (16, 16), (1, 7)])
def test_fp8_dequant_matches_loop_reference(fmt, block):
    w, s = fp8_release((2, 13, 21), block, fmt, seed=1)
    assert s.shape == (2, -(-13 // block[0]), -(-21 // block[1]))
    assert s.dtype == (torch.uint8 if fmt == "ue8m0" else torch.float32)
    for dtype in (torch.float32, torch.bfloat16):
        want = ref_dequant_fp8(w, s, block, fmt, dtype)
        assert torch.equal(bits(Q.dequantize_fp8(w, s, block, fmt, dtype)), bits(want))


def _transformers_fp8_dequant(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``w`` dequantised by transformers' own load-time op (``Fp8Dequantize.convert``, the same
    in 5.17 and 5.24; it derives the block from the scale grid, so whole blocks only), through
    its pattern path that pairs ``<name>.weight`` with ``<name>.weight_scale_inv``."""
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    out = fp8.Fp8Dequantize(None).convert({"q.weight": [w], "q.weight_scale_inv": [s]})
    return out["q.weight"][0]


def test_fp8_dequant_matches_transformers():
    w, s = fp8_release((3, 48, 96), (16, 32), "float32", seed=2)
    theirs = _transformers_fp8_dequant(w, s)  # float32 scales: a float32 result, one rounding, as ours
    assert theirs.dtype == torch.float32
    assert torch.equal(Q.dequantize_fp8(w, s, (16, 32), "float32", torch.float32), theirs)
    # UE8M0 exponent bytes, as uint8 and viewed as float8_e8m0fnu: transformers rounds the
    # float32 product once to bf16
    w, s = fp8_release((48, 96), (16, 32), "ue8m0", seed=3)
    ours = Q.dequantize_fp8(w, s, (16, 32), "ue8m0", torch.bfloat16)
    for scales in (s, s.view(torch.float8_e8m0fnu)):
        theirs = _transformers_fp8_dequant(w, scales)
        assert theirs.dtype == torch.bfloat16 and torch.equal(bits(ours), bits(theirs))


def test_mxfp4_dequant_matches_loop_and_transformers():
    g = torch.Generator().manual_seed(4)
    blocks = torch.randint(0, 256, (3, 5, 2, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 150, (3, 5, 2), dtype=torch.uint8, generator=g)
    ours = Q.dequantize_mxfp4(blocks, scales, torch.bfloat16)
    assert ours.shape == (3, 5, 64)
    assert torch.equal(bits(ours), bits(ref_dequant_mxfp4(blocks, scales, torch.bfloat16)))
    mx = pytest.importorskip("transformers.integrations.mxfp4")
    theirs = mx.convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=torch.bfloat16)
    assert torch.equal(bits(ours.transpose(1, 2).contiguous()), bits(theirs))  # GPT-OSS keeps [E, in, out]


def test_e2m1_rounding_ties_to_even_and_saturates():
    vals = [0.0, -0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 100.0, -0.25, -5.0, -5.5, 0.3, 2.9, -1.6]
    g = torch.Generator().manual_seed(5)
    vals += ((torch.rand(300, generator=g) - 0.5) * 16).tolist()
    codes = Q.e2m1_codes(torch.tensor(vals, dtype=torch.float32))
    assert codes.tolist() == [ref_e2m1(v) for v in vals]


def test_ue8m0_decode_encode():
    raw = torch.tensor([0, 1, 126, 127, 128, 254], dtype=torch.uint8)
    want = [2.0 ** (int(b) - 127) for b in raw]
    assert Q.decode_e8m0(raw).tolist() == want
    assert Q.decode_e8m0(raw.view(torch.float8_e8m0fnu)).tolist() == want
    assert torch.isnan(Q.decode_e8m0(torch.tensor([255], dtype=torch.uint8))).all()
    assert torch.equal(Q.encode_e8m0(torch.tensor([-200, -127, 0, 5, 300])), torch.tensor([0, 0, 127, 132, 254], dtype=torch.uint8))


@pytest.mark.parametrize(
    "fmt,dtype",
    [("ue8m0", torch.bfloat16), ("ue8m0", torch.float32), ("float32", torch.float32), ("ue8m0_float32", torch.bfloat16)],
)
def test_fp8_requantize_gives_back_the_bytes(fmt, dtype):
    w, s = fp8_release((300, 517), (7, 16), fmt, seed=6)
    w2, s2 = Q.quantize_fp8(Q.dequantize_fp8(w, s, (7, 16), fmt, dtype), (7, 16), fmt)  # type: ignore[arg-type]
    assert torch.equal(bits(w2), bits(w)) and torch.equal(bits(s2), bits(s))


def test_fp8_float32_scales_through_bf16_keep_weight_bytes():
    """bf16 cannot hold float(w) * scale exactly: the FP8 bytes come back, the scales to 2**-8."""
    w, s = fp8_release((64, 96), (16, 32), "float32", seed=7)
    w2, s2 = Q.quantize_fp8(Q.dequantize_fp8(w, s, (16, 32), "float32", torch.bfloat16), (16, 32), "float32")
    assert torch.equal(bits(w2), bits(w))
    assert ((s2 - s).abs() / s).max() <= 2**-8


@pytest.mark.parametrize("fmt", ["float32", "ue8m0", "ue8m0_float32"])
def test_quantizers_keep_their_input_device(fmt):
    """Every tensor a quantizer makes is on its input's device (``meta`` stands in for a GPU:
    a tensor made on the CPU fails to mix with it as it would with a CUDA one)."""
    for out in (*Q.quantize_fp8(torch.empty(300, 517, device="meta"), (128, 128), fmt),
                *Q.quantize_mxfp4(torch.empty(4, 64, device="meta"))):
        assert out.device.type == "meta"


def test_mxfp4_requantize_gives_back_the_bytes():
    b, s = mxfp4_release((3, 7), 96, seed=8)
    b2, s2 = Q.quantize_mxfp4(Q.dequantize_mxfp4(b, s, torch.bfloat16))
    assert torch.equal(b2, b) and torch.equal(s2, s)
    x = torch.randn(4, 64)
    assert (Q.dequantize_mxfp4(*Q.quantize_mxfp4(x), torch.float32) - x).abs().max() <= x.abs().max() / 4


# --- lazy regions (property tests) ---------------------------------------------------------------------


@st.composite
def _box(draw, shape):
    box = []
    for n in shape:
        a = draw(st.integers(0, n - 1))
        box.append((a, draw(st.integers(a + 1, n))))
    return tuple(box)


@st.composite
def fp8_case(draw):
    lead = draw(st.sampled_from([(), (2,), (3,)]))
    rows, cols = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    block = (draw(st.integers(1, 17)), draw(st.integers(1, 17)))
    fmt = draw(st.sampled_from(["float32", "ue8m0", "ue8m0_float32"]))
    shape = (*lead, rows, cols)
    return shape, block, fmt, draw(_box(shape)), draw(st.integers(0, 2**16))


def _fp8_node(shape, block, fmt, seed, dtype=torch.bfloat16):
    w, s = fp8_release(shape, block, fmt, seed)
    io = DictIO({"w": w, "s": s})
    node = QN.DequantizedFP8(Leaf("w", tuple(w.shape), w.dtype), Leaf("s", tuple(s.shape), s.dtype), block, fmt, dtype)
    return node, io, w, s


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fp8_case())
def test_fp8_region_read_equals_full_and_reads_only_its_bytes(case):
    shape, block, fmt, box, seed = case
    node, io, w, s = _fp8_node(shape, block, fmt, seed)
    full = node.full(io)
    assert torch.equal(bits(full), bits(ref_dequant_fp8(w, s, block, fmt, torch.bfloat16)))
    io.bytes_read = 0
    got = node.read(box, io)
    assert torch.equal(bits(got), bits(full[tuple(slice(a, b) for a, b in box)]))
    (r0, r1), (c0, c1) = box[-2:]
    lead_n = 1
    for a, b in box[:-2]:
        lead_n *= b - a
    scale_cells = lead_n * (-(-r1 // block[0]) - r0 // block[0]) * (-(-c1 // block[1]) - c0 // block[1])
    weight_cells = lead_n * (r1 - r0) * (c1 - c0)
    assert io.bytes_read == weight_cells + scale_cells * s.element_size()  # only its bytes and scale tiles
    assert io.bytes_read < w.numel() + s.numel() * s.element_size() or box == tuple((0, n) for n in shape)


@st.composite
def mxfp4_case(draw):
    lead = draw(st.sampled_from([(1,), (3,), (2, 3)]))
    groups = draw(st.integers(1, 4))
    shape = (*lead, groups * 32)
    return lead, groups, draw(_box(shape)), draw(st.integers(0, 2**16))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mxfp4_case())
def test_mxfp4_region_read_equals_full_and_reads_whole_blocks_only(case):
    lead, groups, box, seed = case
    b, s = mxfp4_release(lead, groups * 32, seed)
    io = DictIO({"b": b, "s": s})
    node = QN.DequantizedMXFP4(Leaf("b", tuple(b.shape), b.dtype), Leaf("s", tuple(s.shape), s.dtype), torch.bfloat16)
    full = node.full(io)
    assert torch.equal(bits(full), bits(ref_dequant_mxfp4(b, s, torch.bfloat16)))
    io.bytes_read = 0
    got = node.read(box, io)
    assert torch.equal(bits(got), bits(full[tuple(slice(a, c) for a, c in box)]))
    c0, c1 = box[-1]
    cells = 1
    for a, c in box[:-1]:
        cells *= c - a
    touched = -(-c1 // 32) - c0 // 32
    assert io.bytes_read == cells * touched * (16 + 1)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fp8_case(), st.sampled_from(["values", "scales"]))
def test_quantize_fp8_region_equals_full(case, part):
    shape, block, fmt, _, seed = case
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(torch.bfloat16)
    io = DictIO({"x": x})
    node = QN.QuantizedFP8(Leaf("x", shape, x.dtype), block, fmt, part)
    full = node.full(io)
    box = tuple((0, n) for n in node.shape)
    box = box[:-2] + ((box[-2][1] // 3, box[-2][1]), (0, max(1, box[-1][1] // 2)))  # cuts blocks
    assert torch.equal(bits(node.read(box, io)), bits(full[tuple(slice(a, b) for a, b in box)]))


def test_quantize_mxfp4_region_equals_full():
    x = torch.randn(3, 5, 96).to(torch.bfloat16)
    io = DictIO({"x": x})
    for part in ("values", "scales"):
        node = QN.QuantizedMXFP4(Leaf("x", tuple(x.shape), x.dtype), part)  # type: ignore[arg-type]
        full = node.full(io)
        for box in [((1, 3), (2, 5), (1, 3), (3, 11)), ((0, 3), (0, 5), (2, 3), (0, 16))]:
            box = box[: len(node.shape)]
            assert torch.equal(node.read(box, io), full[tuple(slice(a, b) for a, b in box)])


def test_two_shards_sharing_a_block_and_a_shard_smaller_than_a_block():
    node, io, _, _ = _fp8_node((40, 72), (16, 32), "float32", seed=9)
    full = node.full(io)
    halves = [node.read(((0, 20), (0, 72)), io), node.read(((20, 40), (0, 72)), io)]  # rows 16..31 shared
    assert torch.equal(torch.cat(halves), full)
    tiny = node.read(((17, 19), (33, 35)), io)  # 2x2 inside one tile
    assert torch.equal(tiny, full[17:19, 33:35])


# --- rules, load and export -------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["float32", "ue8m0", "ue8m0_float32"])
def test_load_fp8_and_mxfp4_release(tmp_path, fmt):
    path = write_release(str(tmp_path), fmt)
    with torch.device("meta"):
        model = Tiny()
    rep = sdadapt.load(model, path, fp8_adapter(fmt))
    want = expected_model(fmt)
    for k, v in model.state_dict().items():
        assert v.dtype == torch.bfloat16 and torch.equal(bits(v), bits(want[k])), k
    assert rep.bytes_read == sum(t.numel() * t.element_size() for t in release_tensors(fmt).values())
    _, plan = sdadapt.plan_load(Tiny(), path, fp8_adapter(fmt))
    recipe = plan.recipes["layers.0.w1.weight"].describe()
    assert recipe.startswith("dequant_fp8(model.layers.0.w1.weight, model.layers.0.w1.weight_scale_inv")


@pytest.mark.parametrize("fmt", ["float32", "ue8m0"])
def test_a_float32_model_gets_the_release_dequantised_in_float32(tmp_path, fmt):
    """``dtype="model"`` into a float32 model (FSDP2's sharded master weights) with the adapter's
    bfloat16 dequantisation: the cast hands the dequantisation float32 instead, so the model holds
    ``float(w) * scale`` in float32, not bfloat16 values widened; the recipe has no cast."""
    path = write_release(str(tmp_path), fmt)
    with torch.device("meta"):
        model = Tiny(torch.float32)
    sdadapt.load(model, path, fp8_adapter(fmt), dtype="model")
    want = expected_model(fmt, torch.float32)
    for k, v in model.state_dict().items():
        assert v.dtype == torch.float32 and torch.equal(bits(v), bits(want[k])), k
    if fmt == "float32":  # power-of-two scales keep FP8 values exact in bfloat16: no difference to see
        w1 = want["layers.0.w1.weight"]
        assert not torch.equal(w1, w1.to(torch.bfloat16).float())
    adapter = sdadapt.Adapter([*fp8_adapter(fmt).rules, sdadapt.cast("**", "model")])
    _, plan = sdadapt.plan_load(Tiny(torch.float32), path, adapter)
    assert plan.report.ok
    recipe = plan.recipes["layers.0.w1.weight"].describe()
    assert recipe.startswith("dequant_fp8(") and recipe.endswith(", dtype=float32)"), recipe
    assert plan.recipes["layers.0.mlp.experts"].describe().endswith(", dtype=float32)")
    assert plan.recipes["embed_tokens.weight"].describe().startswith("cast(")  # stored bfloat16: widened exactly


def test_a_float32_model_loaded_with_dtype_model_exports_the_release_bytes(tmp_path):
    """Dequantised straight into float32, the values still determine the release: exporting
    them (embeddings and norms cast back to the release's bfloat16) gives every byte back, FP8
    weights and float32 scales included."""
    os.makedirs(tmp_path / "src")
    src = write_release(str(tmp_path / "src"), "float32")
    model = Tiny(torch.float32)
    sdadapt.load(model, src, fp8_adapter("float32"), dtype="model")
    rules = fp8_adapter("float32").rules
    casts = [sdadapt.cast(k, torch.float32, from_dtype="bfloat16") for k in ("model.embed_tokens.weight", "model.layers.0.norm")]
    sdadapt.export(model, str(tmp_path / "out"), sdadapt.Adapter(rules[:2] + casts + rules[2:]))
    original, exported = load_file(src), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(exported) == sorted(original)
    for k in original:
        assert exported[k].dtype == original[k].dtype and torch.equal(bits(exported[k]), bits(original[k])), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_cast_after_stacking_dequantised_experts_dequantises_into_the_cast_dtype(tmp_path, dtype):
    """Per-expert FP8 weights dequantised (bfloat16) and stacked into ``[E, R, C]``, then cast:
    every expert's dequantisation computes in the cast's dtype, through the stack (and a rename);
    an explicit cast to a dtype works as ``"model"`` does."""
    tensors, want = {}, []
    for e in range(3):
        w, scale = fp8_release((40, 64), BLOCK, "float32", seed=20 + e)
        tensors[f"e.{e}.weight"], tensors[f"e.{e}.weight_scale_inv"] = w, scale
        want.append(ref_dequant_fp8(w, scale, BLOCK, "float32", torch.float32))
    path = write_safetensors(tmp_path / "experts.safetensors", tensors)
    adapter = sdadapt.Adapter([sdadapt.dequant_fp8("e.*.weight", BLOCK), sdadapt.stack("e.{e}.weight", "stacked", count=3),
                               sdadapt.rename("stacked", "experts"), sdadapt.cast("experts", dtype)])
    model = nn.Module()
    model.experts = nn.Parameter(torch.empty(3, 40, 64, dtype=dtype))
    sdadapt.load(model, path, adapter)
    assert torch.equal(bits(model.experts.data), bits(torch.stack(want).to(dtype)))
    _, plan = sdadapt.plan_load(model, path, adapter)
    name = str(dtype).removeprefix("torch.")
    assert plan.recipes["experts"].describe().startswith("stack([dequant_fp8(") and f", dtype={name})" in plan.recipes["experts"].describe()
    assert "cast(" not in plan.recipes["experts"].describe()


@pytest.mark.parametrize("fmt,dtype", [("ue8m0", torch.bfloat16), ("float32", torch.float32), ("ue8m0_float32", torch.bfloat16)])
def test_export_round_trip_gives_the_same_bytes(tmp_path, fmt, dtype):
    """Load a release, export it unchanged: every tensor (FP8 weights, scales, MXFP4 blocks and
    scales, bf16 tensors) comes back byte for byte, when the model's dtype holds the values exactly."""
    os.makedirs(tmp_path / "src")
    src = write_release(str(tmp_path / "src"), fmt)
    name = str(dtype).removeprefix("torch.")
    rules = [r.model_copy(update={"dtype": name}) if r.kind.startswith("dequant") else r for r in fp8_adapter(fmt).rules]
    casts = [sdadapt.cast(k, dtype, from_dtype="bfloat16") for k in ("model.embed_tokens.weight", "model.layers.0.norm")]
    adapter = sdadapt.Adapter(rules[:2] + casts + rules[2:], name="round-trip")
    assert [r.kind for r in adapter.rules] == ["dequant_fp8", "dequant_mxfp4", "cast", "cast", "rename"]
    model = Tiny(dtype)
    sdadapt.load(model, src, adapter)
    sdadapt.export(model, str(tmp_path / "out"), adapter)
    original, exported = load_file(src), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(exported) == sorted(original)
    for k in original:
        assert exported[k].dtype == original[k].dtype, k
        assert torch.equal(bits(exported[k]), bits(original[k])), k


def test_export_float32_scales_from_bf16_model(tmp_path):
    """The common case (float32 scales, bf16 model): FP8 bytes identical, scales to 2**-8."""
    src = write_release(str(tmp_path), "float32")
    model = Tiny()
    sdadapt.load(model, src, fp8_adapter("float32"))
    sdadapt.export(model, str(tmp_path / "out"), fp8_adapter("float32"))
    original, exported = load_file(src), load_file(str(tmp_path / "out" / "model.safetensors"))
    for k in original:
        if k.endswith("_scale_inv"):
            assert ((exported[k] - original[k]).abs() / original[k]).max() <= 2**-8, k
        else:
            assert torch.equal(bits(exported[k]), bits(original[k])), k


def test_adapter_with_quant_rules_serialises():
    a = fp8_adapter("ue8m0")
    b = sdadapt.Adapter.from_json(a.to_json())
    assert b == a
    inv = a.inverse()
    assert [r.kind for r in inv.rules][-2:] == ["quantize_mxfp4", "quantize_fp8"]
    assert inv.inverse().rules[:2] == a.rules[:2]  # dequant -> quantize -> dequant: the same rules


# --- plan errors ----------------------------------------------------------------------------------


def _report(tmp_path, tensors, adapter):
    path = os.path.join(str(tmp_path), "bad.safetensors")
    write_safetensors(path, tensors)
    return sdadapt.diff(Tiny(), path, adapter)


def _issues(report) -> str:
    return "\n".join(f"{i.key}: {i.message}" for i in report.rule_issues)


def test_missing_scale_is_a_plan_error(tmp_path):
    t = release_tensors("float32")
    del t["model.layers.0.w2.weight_scale_inv"]
    rep = _report(tmp_path, t, fp8_adapter("float32"))
    assert not rep.ok
    assert "model.layers.0.w2.weight: has no scale 'model.layers.0.w2.weight_scale_inv'" in _issues(rep)


def test_misshapen_scale_is_a_plan_error(tmp_path):
    t = release_tensors("float32")
    t["model.layers.0.w1.weight_scale_inv"] = torch.ones(2, 2)  # a [128, 128] grid's shape, not [16, 32]'s
    rep = _report(tmp_path, t, fp8_adapter("float32"))
    assert "has shape [2, 2], but block=[16, 32] over [40, 64] needs [3, 2]; check block=" in _issues(rep)


def test_wrong_scale_format_is_a_plan_error(tmp_path):
    rep = _report(tmp_path, release_tensors("ue8m0"), fp8_adapter("float32"))
    assert "is uint8, not what scale_format='float32' stores (float32); scale_format='ue8m0'?" in _issues(rep)


def test_unconsumed_scale_and_undequantised_weight_are_plan_errors(tmp_path):
    t = release_tensors("float32")
    no_dequant = sdadapt.Adapter([r for r in fp8_adapter("float32").rules if r.kind != "dequant_fp8"])
    rep = _report(tmp_path, t, no_dequant)
    assert {"layers.0.w1.weight_scale_inv", "layers.0.w2.weight_scale_inv"} <= set(rep.unexpected)
    assert {m.key for m in rep.dtype_mismatch} == {"layers.0.w1.weight", "layers.0.w2.weight"}
    text = str(rep)
    assert "root cause: the checkpoint is quantized" in text and "sdadapt.dequant_rules(config.json)" in text
    assert "add a cast rule" not in text  # a cast would load FP8 values without their scales
    with pytest.raises(PlanError, match="dequant_fp8"):
        sdadapt.load(Tiny(), os.path.join(str(tmp_path), "bad.safetensors"), no_dequant)


def test_excluded_weight_leaves_its_scale_unconsumed(tmp_path):
    adapter = fp8_adapter("float32")
    rules = [r.model_copy(update={"exclude": [*r.exclude, "**w2.weight"]}) if r.kind == "dequant_fp8" else r for r in adapter.rules]
    rep = _report(tmp_path, release_tensors("float32"), sdadapt.Adapter(rules))
    assert rep.unexpected == ["layers.0.w2.weight_scale_inv"]
    assert [m.key for m in rep.dtype_mismatch] == ["layers.0.w2.weight"]
    text = str(rep)  # the adapter has its dequant rule: the cause is that rule's exclude=, not a missing rule
    assert "root cause: the adapter's dequant rule(s) #0 dequant_fp8 left quantized tensors unread" in text
    assert "exclude=" in text and "put sdadapt.dequant_rules" not in text


def test_a_rule_problem_of_the_dequant_rule_is_the_root_cause(tmp_path):
    """With the dequant rule in place, a scale it cannot read (stored as float16: no scale_format
    reads that) is the root cause, and the rule's hint names no setting that would refuse it again."""
    t = release_tensors("float32")
    t["model.layers.0.w1.weight_scale_inv"] = t["model.layers.0.w1.weight_scale_inv"].half()
    rep = _report(tmp_path, t, fp8_adapter("float32"))
    text = str(rep)
    assert "root cause: the dequant rule #0 cannot read the quantized tensors: model.layers.0.w1.weight: scale" in text
    assert "no scale_format of dequant_fp8 reads float16 block scales" in text
    assert "scale_format='float32'?" not in text and "put sdadapt.dequant_rules" not in text


def test_matched_unquantized_matrix_is_a_plan_error(tmp_path):
    rules = [r.model_copy(update={"exclude": []}) if r.kind == "dequant_fp8" else r for r in fp8_adapter("float32").rules]
    rep = _report(tmp_path, release_tensors("float32"), sdadapt.Adapter(rules))
    assert "model.embed_tokens.weight: is stored as bfloat16, not float8_e4m3fn; add it to exclude=" in _issues(rep)


def test_mxfp4_blocks_without_rule_or_scales(tmp_path):
    t = release_tensors("float32")
    rules = [r for r in fp8_adapter("float32").rules if r.kind != "dequant_mxfp4"]
    rep = _report(tmp_path, t, sdadapt.Adapter(rules))
    assert "layers.0.mlp.experts_blocks" in rep.unexpected and "layers.0.mlp.experts" in rep.missing
    assert "root cause: the checkpoint is quantized" in str(rep)
    del t["model.layers.0.mlp.experts_scales"]
    rep = _report(tmp_path, t, fp8_adapter("float32"))
    assert "but no scales 'model.layers.0.mlp.experts_scales'" in _issues(rep)


# --- config.json -----------------------------------------------------------------------------------


def test_dequant_rules_from_config(tmp_path):
    assert sdadapt.dequant_rules({"model_type": "llama"}) == []
    (r,) = sdadapt.dequant_rules({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    assert (r.kind, r.block, r.scale_format, r.dtype) == ("dequant_fp8", (128, 128), "float32", None)
    assert "lm_head.weight" in r.exclude
    cfg = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0",
                                   "modules_to_not_convert": ["model.layers.3.mlp.gate"]}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (r,) = sdadapt.dequant_rules(str(tmp_path))
    assert r.scale_format == "ue8m0" and "**model.layers.3.mlp.gate.weight" in r.exclude
    # DeepSeek-V3.1 style: ue8m0 in the config, power-of-two scales stored as float32
    schema = {"a.weight_scale_inv": sdadapt.sources.TensorInfo((2, 2), torch.float32)}
    (r,) = sdadapt.dequant_rules(cfg, schema=schema)
    assert (r.scale_format, r.scale_dtype) == ("ue8m0_float32", None)
    for stored in (torch.uint8, torch.float8_e8m0fnu):  # exponent bytes: export keeps their dtype
        schema = {"a.weight_scale_inv": sdadapt.sources.TensorInfo((2, 2), stored)}
        (r,) = sdadapt.dequant_rules(cfg, schema=schema)
        assert (r.scale_format, r.scale_dtype) == ("ue8m0", str(stored).removeprefix("torch."))
    (r,) = sdadapt.dequant_rules({"quantization_config": {"quant_method": "mxfp4"}})
    assert r.kind == "dequant_mxfp4"
    (r,) = sdadapt.dequant_rules({"quantization_config": {"quant_method": "awq"}})  # AutoAWQ's GEMM layout
    assert (r.kind, r.layout, r.bits, r.group_size) == ("dequant_gptq", "awq", 4, 128)
    with pytest.raises(AdapterError, match="AWQ version 'gemv'"):
        sdadapt.dequant_rules({"quantization_config": {"quant_method": "awq", "version": "gemv"}})
    (r,) = sdadapt.dequant_rules({"quantization_config": {"quant_method": "fp8"}})  # per-tensor FP8
    assert (r.kind, r.codec, r.strategy) == ("dequant_scaled", "e4m3", "tensor")
    with pytest.raises(AdapterError, match="weight_block_size"):
        sdadapt.dequant_rules({"quantization_config": {"quant_method": "fp8", "weight_block_size": 128}})
    with pytest.raises(AdapterError, match="block"):
        sdadapt.dequant_fp8(block=[128])


def test_convert_dequantises_offline_and_back(tmp_path):
    """``convert`` with the dequant rules writes the bf16 twin; converting that twin with the
    inverse adapter writes the UE8M0 release again, byte for byte."""
    src = write_release(str(tmp_path), "ue8m0")
    adapter = fp8_adapter("ue8m0")
    convert(src, str(tmp_path / "bf16"), adapter, read_back=True)
    twin = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    want = expected_model("ue8m0")
    assert sorted(twin) == sorted(want)
    for k, v in want.items():
        assert torch.equal(bits(twin[k]), bits(v)), k
    convert(str(tmp_path / "bf16"), str(tmp_path / "fp8"), adapter.inverse())
    back, original = load_file(str(tmp_path / "fp8" / "model.safetensors")), load_file(src)
    assert sorted(back) == sorted(original)
    for k in original:
        assert torch.equal(bits(back[k]), bits(original[k])), k


def test_a_cast_after_a_dequantisation_pins_its_dtype(tmp_path):
    """An explicit cast to float16 after the dequantisation is what the recipe gives: the plan
    does not hand it the float32 model's dtype instead (a dtype mismatch, reported)."""
    path = write_release(str(tmp_path), "float32")
    adapter = sdadapt.Adapter([*fp8_adapter("float32").rules, sdadapt.cast("layers.0.w1.weight", torch.float16)])
    rep = sdadapt.diff(Tiny(torch.float32), path, adapter)
    assert [(m.key, m.checkpoint) for m in rep.dtype_mismatch if m.key.startswith("layers.0.w")] == [("layers.0.w1.weight", "float16")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp4_pairs_is_the_published_e2m1_table_for_each_byte(dtype):
    """Byte ``b`` -> (value of ``b & 0xF``, value of ``b >> 4``), the OCP e2m1 values, both for
    the table ``fp4_pairs`` hands out (made once per device and dtype, then handed out again)
    and for ``e2m1_pair_table``, the float32 form computed with ops where it is called."""
    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    pairs = Q.fp4_pairs(torch.device("cpu"), dtype)
    assert pairs.shape == (256, 2) and pairs.dtype == dtype
    want = torch.tensor([[e2m1[b & 0xF], e2m1[b >> 4]] for b in range(256)], dtype=dtype)
    assert torch.equal(pairs.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       want.view(torch.int16 if dtype != torch.float32 else torch.int32))  # -0.0 included
    assert Q.fp4_pairs(torch.device("cpu"), dtype) is pairs
    as_bits = Q.e2m1_pair_table(torch.device("cpu")).view(torch.int32)
    assert torch.equal(as_bits, want.to(torch.float32).view(torch.int32))  # -0.0 included
