"""Releases written by compressed-tensors (FP8 per tensor / per channel / block, NVFP4, int4 and
int8 pack-quantized with and without zero points, MXFP8), ModelOpt NVFP4 / FP8 and per-tensor
FP8 written by hand from the published layouts: ``sdadapt.dequant_rules`` reads each config, and
the loaded values equal the format's own reference decompression.

References: compressed-tensors' own decompressors for a bf16 model (its arithmetic: the product
of an exact code and a bf16 scale rounded once, or float32 arithmetic for NVFP4's two scales);
for a float32 model, compressed-tensors' ``dequantize`` on its own unpacked codes with the scales
given as float32 (the same formula computed in float32, not a bf16 result widened). ModelOpt and
per-tensor FP8: element-by-element loops over the stored bytes.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from support.checkpoints import write_safetensors
from support.scaled_releases import CT_FORMATS, HAND_FORMATS, Tiny, adapter_for, bits, export_case, write_case

import sdadapt
from sdadapt._engine import device_step, warm_up
from sdadapt._engine.planner import bands_of
from sdadapt._recipes import quant_scaled as S
from sdadapt.errors import AdapterError

# --- ModelOpt and per-tensor FP8, by hand from the published layouts ------------------------------


# --- tests ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, dict]]:
    root = tmp_path_factory.mktemp("quant_ct")
    return {n: (str(root / n), write_case(str(root / n), n)) for n in CT_FORMATS + HAND_FORMATS}


@pytest.mark.parametrize("name", CT_FORMATS + HAND_FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_release_loads_with_the_reference_values(cases, name: str, dtype: torch.dtype) -> None:
    folder, want = cases[name]
    adapter = adapter_for(folder)
    if dtype == torch.float32:  # the release's bf16 embedding, norm and head are widened by a rule
        adapter = sdadapt.Adapter([*adapter.rules, sdadapt.cast("**", "model", from_dtype="bfloat16")])
    with torch.device("meta"):
        model = Tiny(dtype)
    rep = sdadapt.load(model, folder, adapter)
    ref = want[str(dtype).removeprefix("torch.")]
    for k, v in model.state_dict().items():
        assert v.dtype == dtype and torch.equal(bits(v), bits(ref[k])), (name, k, (v.float() - ref[k].float()).abs().max())
    if name.startswith("fp8") or name.startswith("modelopt"):  # activation scales dropped on purpose, and said so
        assert "model.layers.0.w1.input_scale" in rep.report.dropped


@pytest.mark.parametrize("name", CT_FORMATS + HAND_FORMATS)
def test_region_reads_equal_the_whole(cases, name: str) -> None:
    """Every region of every dequantised weight (cut inside packs, groups and blocks) equals the
    same region of the whole tensor, and reads only its own rows' bytes."""
    folder, _ = cases[name]
    _, plan = sdadapt.plan_load(Tiny(), folder, adapter_for(folder))
    with sdadapt.sources.open_source(folder) as src:
        from support.checkpoints import DictIO

        io = DictIO({k: src.read(k, tuple((0, n) for n in i.shape)).clone() for k, i in src.schema.items()})
        for key in ("layers.0.w1.weight", "layers.0.w2.weight"):
            node = plan.recipes[key]
            whole = node.full(io)
            rows, cols = node.shape
            for box in (((0, rows), (0, cols)), ((3, 17), (5, 37)), ((rows - 9, rows), (cols - 27, cols)), ((7, 8), (33, 34))):
                before = io.bytes_read
                got = node.read(box, io)
                assert torch.equal(bits(got), bits(whole[box[0][0] : box[0][1], box[1][0] : box[1][1]])), (name, key, box)
                assert io.bytes_read - before == _own_bytes(node, box), (name, key, box)


def _own_bytes(node, box) -> int:
    """What a region must read and nothing more: the codes of its rows and of the whole packs
    its columns touch; the scale (and zero-point) grid entries it touches, zero points in whole
    packed words of rows; one global scale."""
    (r0, r1), (c0, c1) = box
    unit = S.PER_UNIT[node.codec]
    b0, b1 = node.block
    n = (r1 - r0) * (-(-c1 // unit) - c0 // unit) * node.values.dtype.itemsize
    g0, g1, h0, h1 = r0 // b0, -(-r1 // b0), c0 // b1, -(-c1 // b1)
    if len(node.scale.shape) < 2:
        n += node.scale.dtype.itemsize
    else:
        n += (g1 - g0) * (h1 - h0) * node.scale.dtype.itemsize
    if node.zero is not None:
        per = 32 // S.BITS[node.codec] if node.codec in ("int4", "int8_packed") else 1
        n += (-(-g1 // per) - g0 // per) * (h1 - h0) * node.zero.dtype.itemsize
    if node.glob is not None:
        n += 4
    return n


def test_dequant_rules_read_each_config(cases) -> None:
    kinds = {}
    for name in CT_FORMATS + HAND_FORMATS:
        (rule,) = sdadapt.dequant_rules(cases[name][0])
        kinds[name] = (rule.codec, rule.strategy, rule.values_suffix, rule.zero_suffix, rule.global_suffix)
    assert kinds["fp8_channel"] == ("e4m3", "channel", "", None, None)
    assert kinds["fp8_block"][:2] == ("e4m3", "block")
    assert kinds["nvfp4"] == ("e2m1", "group", "_packed", None, "_global_scale")
    assert kinds["w4a16_asym"] == ("int4", "group", "_packed", "_zero_point", None)
    assert kinds["w8a16"][0] == "int8_packed"
    assert kinds["mxfp8"][:2] == ("e4m3", "group")
    assert kinds["modelopt_nvfp4"] == ("e2m1", "group", "", None, "_scale_2")
    assert kinds["modelopt_fp8"][:2] == kinds["fp8_per_tensor"][:2] == ("e4m3", "tensor")
    assert kinds["mxfp8_e8m0"][:2] == ("e4m3", "group")
    assert sdadapt.dequant_rules(cases["mxfp8_e8m0"][0])[0].scale_dtype == "float8_e8m0fnu"


def test_unconsumed_scale_is_an_error_and_activation_scales_are_dropped(cases, tmp_path) -> None:
    folder, _ = cases["fp8_channel"]
    rules = [r.model_copy(update={"drop": []}) for r in sdadapt.dequant_rules(folder)]
    rep = sdadapt.diff(Tiny(), folder, sdadapt.Adapter([*rules, sdadapt.rename("model.{rest:*}", "{rest}")]))
    assert "layers.0.w1.input_scale" in rep.unexpected and not rep.ok
    rep = sdadapt.diff(Tiny(), folder, adapter_for(folder))
    assert rep.ok and "model.layers.0.w1.input_scale" in rep.dropped
    # a rule that leaves the zero points out: they stay unexpected, never silently ignored
    folder, _ = cases["w4a16_asym"]
    rules = [r.model_copy(update={"zero_suffix": None}) for r in sdadapt.dequant_rules(folder)]
    rep = sdadapt.diff(Tiny(), folder, sdadapt.Adapter([*rules, sdadapt.rename("model.{rest:*}", "{rest}")]))
    assert {"layers.0.w1.weight_zero_point", "layers.0.w2.weight_zero_point"} <= set(rep.unexpected)
    assert "root cause" in str(rep) and "dequant" in str(rep)


def test_scale_of_the_wrong_shape_is_a_plan_problem(cases, tmp_path) -> None:
    folder, _ = cases["w4a16"]
    with sdadapt.sources.open_source(folder) as src:
        tensors = {k: src.read(k, tuple((0, n) for n in i.shape)).clone() for k, i in src.schema.items()}
    tensors["model.layers.0.w1.weight_scale"] = tensors["model.layers.0.w1.weight_scale"][:, :1].clone()
    os.makedirs(tmp_path / "bad")
    write_safetensors(tmp_path / "bad" / "model.safetensors", tensors)
    with open(os.path.join(folder, "config.json")) as f:
        (tmp_path / "bad" / "config.json").write_text(f.read())
    rep = sdadapt.diff(Tiny(), str(tmp_path / "bad"), adapter_for(str(tmp_path / "bad")))
    text = str(rep)
    assert "scale 'model.layers.0.w1.weight_scale' has shape [160, 1], but strategy='group', group_size=32" in text


def test_bad_quantization_config_names_the_file_and_field(tmp_path) -> None:
    for qc, field in (
        ({"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": "Linear"}}}, "config_groups.g.targets"),
        ({"quant_method": "compressed-tensors",
          "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": "4", "type": "int"}}}},
         "config_groups.g.weights.num_bits"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
        ({"quant_method": "modelopt", "quant_algo": 4}, "quant_algo"),
    ):
        (tmp_path / "config.json").write_text(json.dumps({"quantization_config": qc}))
        with pytest.raises(AdapterError, match=rf"config.json: quantization_config.{field}"):
            sdadapt.dequant_rules(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": ["fp8"]}))
    with pytest.raises(AdapterError, match="must be a JSON object"):
        sdadapt.dequant_rules(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "bitsandbytes"}}))
    with pytest.raises(AdapterError, match="'bitsandbytes' is not supported"):
        sdadapt.dequant_rules(str(tmp_path))


def test_formats_give_the_same_bits_as_the_loops() -> None:
    """The format functions against loops over stored bytes (int4 words, zero points packed by rows)."""
    g = torch.Generator().manual_seed(9)
    vals = torch.randint(-8, 8, (16, 24), generator=g, dtype=torch.int8)
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    packed = pack_to_int32(vals, 4)
    assert torch.equal(S.decode_codes(packed, "int4")[:, :24], vals.float())
    zp = torch.randint(-8, 8, (16, 3), generator=g, dtype=torch.int8)
    assert torch.equal(S.decode_zero_rows(pack_to_int32(zp, 4, packed_dim=0), 4)[:16], zp.float())
    v8 = torch.randint(-128, 128, (5, 12), generator=g, dtype=torch.int8)
    assert torch.equal(S.decode_codes(pack_to_int32(v8, 8), "int8_packed")[:, :12], v8.float())


@pytest.mark.parametrize("name", ["fp8_tensor", "fp8_channel", "fp8_block"])
def test_fp8_export_gives_the_release_bytes_from_a_float32_model(cases, name: str, tmp_path) -> None:
    """FP8 weights with bf16 scales, held exactly by a float32 model: every weight and scale comes
    back byte for byte (the activation scales were dropped on load and are not written)."""
    original, exported = export_case(cases, name, torch.float32, tmp_path)
    assert sorted(exported) == sorted(k for k in original if not k.endswith("input_scale"))
    for k, v in exported.items():
        assert v.dtype == original[k].dtype and torch.equal(bits(v), bits(original[k])), k


def test_nvfp4_export_gives_the_release_bytes(cases, tmp_path) -> None:
    """NVFP4 from a float32 model: the global scale is chosen again from the tensor as
    compressed-tensors chooses it (``448 * 6 / amax``, or the float32 neighbour that reproduces the
    values), then each group's e4m3 scale: the release's bytes come back, and load to the same values."""
    original, exported = export_case(cases, "nvfp4", torch.float32, tmp_path)
    assert sorted(exported) == sorted(original)
    for k, v in exported.items():
        assert v.dtype == original[k].dtype and torch.equal(bits(v), bits(original[k])), k
    folder, want = cases["nvfp4"]
    import shutil

    shutil.copy(os.path.join(folder, "config.json"), tmp_path / "nvfp4" / "config.json")
    model = Tiny(torch.float32)
    adapter = adapter_for(str(tmp_path / "nvfp4"))
    sdadapt.load(model, str(tmp_path / "nvfp4"), sdadapt.Adapter([*adapter.rules, sdadapt.cast("**", "model", from_dtype="bfloat16")]))
    for k, v in model.state_dict().items():
        assert torch.equal(v, want["float32"][k]), k


def test_every_format_read_inverts_to_its_own_format(cases) -> None:
    """Each release's rule inverts to a quantizer of the same keys, codec, geometry and scale
    dtype (``test_quant_ct_export`` checks the bytes that come back); inverting that gives the rule."""
    for name in CT_FORMATS + HAND_FORMATS:
        (rule,) = sdadapt.dequant_rules(cases[name][0])
        (inv,) = rule.inverse()
        assert inv.kind == "quantize_scaled" and inv.model_dump(exclude={"kind"}) == rule.model_dump(exclude={"kind"}), name
        assert inv.inverse()[0] == rule, name


@pytest.mark.parametrize("name", CT_FORMATS + HAND_FORMATS)
def test_kernels_stay_on_the_inputs_device(cases, name: str) -> None:
    """Each dequantisation's kernel (the warm-up a GPU load runs) allocates on its inputs' device
    (``meta`` stands in for a GPU: a tensor made on the CPU would fail to mix with it), and its
    raw inputs are plain reads (what the engine gathers onto the device)."""
    folder, _ = cases[name]
    _, plan = sdadapt.plan_load(Tiny(), folder, adapter_for(folder))
    for key in ("layers.0.w1.weight", "layers.0.w2.weight"):
        node = plan.recipes[key]
        step = device_step(node)
        assert step is not None and step.node is node
        warm_up(node, torch.device("meta"))


def _bands(node, box: tuple, max_bytes: int) -> list:
    """The bands the engine cuts ``node``'s computation of ``box`` into."""
    (step,) = node.steps(box, torch.empty([b - a for a, b in box], dtype=node.dtype))
    return bands_of(step, max_bytes)


def _band_gathers(src, node, band: tuple, min_span: int) -> bool:
    """Whether the planner may gather ``band``: every input the step declares is a stored region
    taken as it is, and each lies in one run or in runs of at least ``min_span`` bytes."""
    from sdadapt._engine.geometry import box_spans

    (step,) = node.steps(band, torch.empty([b - a for a, b in band], dtype=torch.bfloat16))
    reads = [i.read for i in step.inputs]
    if not all(reads):
        return False
    for key, box in ((r.key, r.box) for r in reads if r is not None):
        starts, run = box_spans(src.schema[key].shape, src.schema[key].dtype.itemsize, box)
        if len(starts) > 1 and run < min_span:
            return False
    return True


@pytest.mark.parametrize("name", CT_FORMATS + HAND_FORMATS)
def test_shards_gather_their_inputs_on_the_device_lane(cases, name: str) -> None:
    """With a device lane (the CPU standing in for a GPU), every band of an FSDP dim-0 shard of a
    dequantised weight gathers its inputs (codes or packed words: one run of whole rows; scales,
    zero points and the global scale: their grid rows) instead of going through a reader's band
    buffer; a column slice (runs shorter than ``min_span_bytes``) takes the band path. Gathered,
    band path and the eager whole-tensor dequantisation give the same bits, from the same bytes."""
    from sdadapt._engine import EngineConfig, IOEngine, Job

    folder, _ = cases[name]
    _, plan = sdadapt.plan_load(Tiny(), folder, adapter_for(folder))
    with sdadapt.sources.open_source(folder) as src:
        from support.checkpoints import DictIO

        io = DictIO({k: src.read(k, tuple((0, n) for n in i.shape)).clone() for k, i in src.schema.items()})
        jobs_of: list[tuple[object, tuple]] = []
        for key in ("layers.0.w1.weight", "layers.0.w2.weight"):
            node = plan.recipes[key]
            rows, cols = node.shape
            unit = 32 // S.BITS[node.codec] * node.block[0] if node.zero is not None else node.block[0] if node.block[0] < rows else 1
            cut = max(unit, rows // 4 // unit * unit)
            for r0 in range(0, rows, cut):  # four ranks' dim-0 shards, on whole blocks / packed zero words
                jobs_of.append((node, ((r0, min(rows, r0 + cut)), (0, cols))))
            jobs_of.append((node, ((0, rows), (0, cols // 2))))  # a column slice (a TP row-wise shard)
        stats = {}
        for gather in (True, False):
            cfg = EngineConfig(threads=3, chunk_bytes=1024, band_bytes=2048, gather_bytes=2048, min_span_bytes=4096, gather_inputs=gather)
            jobs = [Job("w", node, box, torch.full([b - a for a, b in box], float("nan"), dtype=torch.bfloat16)) for node, box in jobs_of]
            stats[gather] = IOEngine(src, cfg, cpu_lane=True).run(jobs)
            for job in jobs:
                whole = job.node.full(io)
                (r0, r1), (c0, c1) = job.box
                assert torch.equal(bits(job.dest), bits(whole[r0:r1, c0:c1])), (name, gather, job.box)
        bands = [(node, band, box[1] == (0, node.shape[1])) for node, box in jobs_of for band in _bands(node, box, 2048)]
        g, b = stats[True], stats[False]
        assert [_band_gathers(src, n, band, 4096) for n, band, _ in bands] == [whole for _, _, whole in bands], name
        assert g.gathered == sum(whole for _, _, whole in bands) > 0, (name, g.gathered, len(bands))
        assert b.gathered == 0 and b.computed == len(bands)
        assert g.computed == len(bands) - g.gathered  # the column slices
        assert g.bytes_read == b.bytes_read


# what moves data between the host and a device: a table made from host data waits for the
# stream on a GPU, a value read back waits for the device
_HOST_CALLS = {"tensor", "as_tensor", "from_numpy", "item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__"}


@pytest.mark.parametrize("name", CT_FORMATS + HAND_FORMATS)
def test_kernels_do_no_host_work(cases, name: str) -> None:
    """A dequantisation's kernel (run per band on the device lane) neither copies host data to
    the device nor reads a value back: either waits for everything queued on the GPU's stream,
    and the lane queues no further copy meanwhile. The e2m1 table is made once per device."""
    from torch.overrides import TorchFunctionMode

    class Calls(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.names.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    folder, _ = cases[name]
    _, plan = sdadapt.plan_load(Tiny(), folder, adapter_for(folder))
    node = plan.recipes["layers.0.w1.weight"]
    warm_up(node, torch.device("meta"))  # the first call may make per-device tables
    calls = Calls()
    with calls:
        warm_up(node, torch.device("meta"))
    assert {"copy_", "mul_"} & set(calls.names)  # the mode sees the kernel's writes
    assert not _HOST_CALLS & set(calls.names), (name, sorted(_HOST_CALLS & set(calls.names)))


_INTO = {"fp8_tensor", "fp8_channel", "nvfp4", "mxfp8", "mxfp4", "modelopt_nvfp4", "modelopt_fp8", "fp8_per_tensor", "mxfp8_e8m0",
         "mxfp8_method", "mxfp8_method_e8m0"}


@pytest.mark.parametrize("name", CT_FORMATS + HAND_FORMATS)
def test_kernels_write_into_the_destination_with_the_same_bits(cases, name: str, monkeypatch) -> None:
    """Where a region is whole column groups of one-row (or one whole-tensor) scales and the codes
    are exact in the target's dtype (e4m3, e2m1; bf16, fp16, float32), the kernel converts the
    codes straight into the destination and scales them in place (no float32 temporary): the
    same bits as the general path and the eager whole-tensor dequantisation, for every region,
    cut or not; the other formats (zero points, packed ints, 2-D blocks) keep the general path."""
    import random

    from support.checkpoints import DictIO

    took: list[bool] = []
    real = S.dequantize_into

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        took.append(real(*args, **kwargs))
        return took[-1]

    monkeypatch.setattr(S, "dequantize_into", spy)
    folder, _ = cases[name]
    _, plan = sdadapt.plan_load(Tiny(), folder, adapter_for(folder))
    rng = random.Random(name)
    with sdadapt.sources.open_source(folder) as src:
        io = DictIO({k: src.read(k, tuple((0, n) for n in i.shape)).clone() for k, i in src.schema.items()})
        for key in ("layers.0.w1.weight", "layers.0.w2.weight"):
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                node = plan.recipes[key].as_dtype(dtype)
                whole = node.full(io)
                rows, cols = node.shape
                boxes = [((0, rows), (0, cols)), ((5, 9), (0, cols))]
                for _ in range(12):
                    r0, c0 = rng.randrange(rows), rng.randrange(cols)
                    boxes.append(((r0, rng.randrange(r0 + 1, rows + 1)), (c0, rng.randrange(c0 + 1, cols + 1))))
                for box in boxes:
                    took.clear()
                    (r0, r1), (c0, c1) = box
                    dest = torch.full((r1 - r0, c1 - c0), float("nan"), dtype=dtype)
                    (step,) = node.steps(box, dest)
                    step.run(io)
                    assert torch.equal(bits(dest), bits(whole[r0:r1, c0:c1])), (name, key, dtype, box)
                    if box[1] == (0, cols):  # whole rows: the fast path wherever the format has it
                        assert any(took) == (name in _INTO), (name, key, dtype, box, took)
