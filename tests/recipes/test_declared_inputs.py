"""Computations declare their inputs, and the engine plans from those declarations alone.

For every node kind that computes (casts, permutations, arithmetic, short-block interleaves,
dequantisations, re-quantizations, LoRA merges), on random boxes (hypothesis): each
:class:`~sdadapt._recipes.nodes.Compute` step's declared inputs, expanded to the source regions
they are made of, are exactly the elements the step reads when it runs; an input declared as a
stored region (``Input.read``) gives, read through its node, the bytes of that region as stored.
The planner gathers a computation's inputs onto a device from the declared regions, without
reading or running anything of the recipe.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.checkpoints import DictIO, write_safetensors

import sdadapt._recipes.moves as MV
import sdadapt._recipes.nodes as N
from sdadapt._base.regions import box_shape, full_box
from sdadapt._engine import EngineConfig
from sdadapt._engine.planner import Planner
from sdadapt._engine.tasks import Job, StagedRead
from sdadapt._recipes import quant as Q
from sdadapt._recipes import quant_nodes as QN
from sdadapt._recipes import quant_scaled as S
from sdadapt._recipes import quant_scaled_nodes as QS
from sdadapt._recipes.arithmetic import AffineMapped
from sdadapt._recipes.interleave import Interleaved
from sdadapt._recipes.lora import MergedLora
from sdadapt.sources import open_source

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _tensors() -> dict[str, torch.Tensor]:
    x = _randn(2, 12, 64, seed=1)
    fp8, fp8_s = Q.quantize_fp8(x, (4, 32), "float32")
    mx_b, mx_s = Q.quantize_mxfp4(x)
    ct, ct_s = S.quantize_fp8_scaled(x, (1, 64), torch.float32)
    glob = torch.tensor([448.0 * 6 / float(x.abs().amax())])
    nv, nv_s = S.quantize_nvfp4(x, glob, "divide")
    return {
        "x": x, "xi": (x * 8).round().to(torch.int32), "w": _randn(12, 64, seed=2), "a": _randn(3, 64, seed=3),
        "b": _randn(12, 3, seed=4), "fp8": fp8, "fp8_s": fp8_s, "mx_b": mx_b, "mx_s": mx_s, "ct": ct, "ct_s": ct_s,
        "nv": nv, "nv_s": nv_s, "nv_g": glob,
    }  # fmt: skip


def _leaf(t: dict[str, torch.Tensor], key: str) -> N.Leaf:
    return N.Leaf(key, tuple(t[key].shape), t[key].dtype)


def _nodes(t: dict[str, torch.Tensor]) -> dict[str, N.Node]:
    """One node of every kind that computes, some over rearrangements of leaves (a selected
    expert, a narrow, one part of a concat) whose regions are stored regions."""
    L = lambda key: _leaf(t, key)  # noqa: E731
    x, w = L("x"), L("w")
    return {
        "cast": N.Converted(L("xi"), torch.float32),
        "permute": MV.UnitPermuted(x, 1, 4, (2, 0, 3, 1)),
        "affine": AffineMapped(x, 2.0, 1.0, out_dtype=torch.bfloat16),
        "interleave-rows": Interleaved(MV.Selected(x, 0, 1), 0, (6, 6), 6),
        "dequant-fp8": QN.DequantizedFP8(L("fp8"), L("fp8_s"), (4, 32), "float32", torch.bfloat16),
        "dequant-fp8-expert": QN.DequantizedFP8(
            MV.Selected(L("fp8"), 0, 1), MV.Selected(L("fp8_s"), 0, 1), (4, 32), "float32", torch.float32
        ),
        "dequant-mxfp4": QN.DequantizedMXFP4(L("mx_b"), L("mx_s"), torch.bfloat16),
        "dequant-mxfp4-narrow": QN.DequantizedMXFP4(MV.Narrowed(L("mx_b"), 1, 4, 8), MV.Narrowed(L("mx_s"), 1, 4, 8), torch.bfloat16),
        "dequant-mxfp4-rows": QN.DequantizedMXFP4(
            Interleaved(L("mx_b"), 1, (6, 6), 6, inverse=True), Interleaved(L("mx_s"), 1, (6, 6), 6, inverse=True), torch.bfloat16
        ),
        "dequant-ct": QS.DequantizedScaled(L("ct"), L("ct_s"), None, None, "e4m3", (1, 64), 64, "divide", torch.bfloat16),
        "dequant-ct-concat": QS.DequantizedScaled(
            MV.Concatenated((MV.Narrowed(L("ct"), 1, 0, 6), MV.Narrowed(L("ct"), 1, 6, 6)), 1), L("ct_s"), None, None, "e4m3", (1, 64), 64,
            "divide", torch.bfloat16,
        ),  # fmt: skip
        "dequant-nvfp4": QS.DequantizedScaled(
            N.Converted(L("nv"), torch.uint8), L("nv_s"), None, L("nv_g"), "e2m1", (1, S.NVFP4_GROUP), 64, "divide", torch.bfloat16
        ),
        "quantize-fp8-values": QN.QuantizedFP8(x, (4, 32), "float32", "values"),
        "quantize-fp8-scales": QN.QuantizedFP8(x, (4, 32), "float32", "scales"),
        "quantize-mxfp4": QN.QuantizedMXFP4(x, "values"),
        "quantize-ct": QS.QuantizedScaled(x, "e4m3", (1, 64), "values", torch.float32),
        "quantize-nvfp4-scales": QS.QuantizedScaled(x, "e2m1", (1, S.NVFP4_GROUP), "scales", torch.float8_e4m3fn, L("nv_g")),
        "shape-of": QS.ShapeOf(x),
        "global-scale-of": QS.GlobalScaleOf(MV.Selected(x, 0, 0), "divide"),
        "lora": MergedLora(w, L("a"), L("b"), 0.5),
        "lora-transposed": MergedLora(MV.Transposed(w, 0, 1), L("a"), L("b"), 0.5, transposed=True),
    }


TENSORS = _tensors()
NODES = _nodes(TENSORS)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _mark(masks: dict[str, torch.Tensor], key: str, box: tuple) -> None:
    mask = masks.setdefault(key, torch.zeros(TENSORS[key].shape, dtype=torch.bool))
    mask[tuple(slice(a, b) for a, b in box)] = True


def _declared(inputs: tuple[N.Input, ...], masks: dict[str, torch.Tensor]) -> None:
    """Mark the source elements the declared inputs are made of: the pieces of each input's
    region, and, for a computation among them, its own declared inputs."""
    for inp in inputs:
        for step in inp.node.steps(inp.box, torch.empty(box_shape(inp.box), dtype=inp.node.dtype)):
            if isinstance(step, N.Piece):
                _mark(masks, step.key, step.box)
            elif isinstance(step, N.Compute):
                _declared(step.inputs, masks)


@st.composite
def _box(draw, shape: tuple[int, ...]) -> tuple:
    out = []
    for n in shape:
        a = draw(st.integers(0, n - 1))
        out.append((a, draw(st.integers(a + 1, n))))
    return tuple(out)


@SETTINGS
@pytest.mark.parametrize("kind", sorted(NODES))
@given(data=st.data())
def test_declared_inputs_are_exactly_what_a_computation_reads(kind, data):
    """For each computation of a random region: the declared inputs cover exactly the elements
    its run reads (no more, no fewer); an input with a stored region reads as that region's
    bytes; the region computes to the eager reference's values."""
    node = NODES[kind]
    box = data.draw(_box(node.shape))
    dest = torch.empty(box_shape(box), dtype=torch.float64 if kind == "cast" else node.dtype)  # a cast copy_ cannot do
    steps = node.steps(box, dest)
    for step in steps:  # pieces and fills too: the region is checked whole below
        if not isinstance(step, N.Compute):
            step.run(DictIO(TENSORS))
            continue
        io = DictIO(TENSORS)
        step.run(io)
        read: dict[str, torch.Tensor] = {}
        for key, b in io.reads:
            _mark(read, key, b)
        declared: dict[str, torch.Tensor] = {}
        _declared(step.inputs, declared)
        assert read.keys() == declared.keys(), (kind, box)
        for key in read:
            assert torch.equal(read[key], declared[key]), (kind, box, key)
        for inp in step.inputs:
            if inp.read is not None:
                stored = TENSORS[inp.read.key][tuple(slice(a, b) for a, b in inp.read.box)]
                value = inp.value(DictIO(TENSORS))
                assert inp.read.dtype == stored.dtype == value.dtype and tuple(value.shape) == inp.read.shape
                assert torch.equal(_bits(value), _bits(stored)), (kind, box)
    want = node.full(DictIO(TENSORS))[tuple(slice(a, b) for a, b in box)]
    assert torch.equal(_bits(dest), _bits(want.to(dest.dtype))), (kind, box)


def test_every_kind_that_computes_declares_inputs_and_stored_regions_where_it_can():
    """The kinds above: every computation of the whole tensor declares what it reads (only
    ``ShapeOf`` reads nothing); dequantisations of stored regions declare them as such, and an
    input gathered from alternating rows, or from two parts of a concat, is not one."""
    stored = {}
    for kind, node in NODES.items():
        steps = [s for s in node.steps(full_box(node.shape), torch.empty(node.shape, dtype=node.dtype)) if isinstance(s, N.Compute)]
        assert all(s.inputs for s in steps) or kind == "shape-of", kind
        stored[kind] = all(i.read is not None for s in steps for i in s.inputs)
    for kind in ("dequant-fp8", "dequant-fp8-expert", "dequant-mxfp4", "dequant-mxfp4-narrow", "dequant-ct", "dequant-nvfp4"):
        assert stored[kind], kind
    assert not stored["dequant-mxfp4-rows"] and not stored["dequant-ct-concat"]


def test_planner_gathers_from_the_declared_inputs_without_reading(tmp_path, monkeypatch):
    """With a device lane's device, the planner lays a dequantisation's declared stored regions
    out one after the other in the gather's buffer (their dtype and the shape the kernel takes),
    reading nothing and running no node while it plans; the staged reads cover exactly those
    regions' bytes. A computation with an input that is not a stored region is left to a
    reader."""
    path = write_safetensors(tmp_path / "q.safetensors", {k: TENSORS[k] for k in ("fp8", "fp8_s", "mx_b", "mx_s")})
    jobs = []
    for kind in ("dequant-fp8-expert", "dequant-mxfp4", "dequant-mxfp4-rows"):
        node = NODES[kind]
        jobs.append(Job(kind, node, full_box(node.shape), torch.empty(node.shape, dtype=node.dtype)))

    def no_reads(*args, **kwargs):
        raise AssertionError("the planner read or ran a node")

    tasks: list = []
    with open_source(str(path)) as src:
        cfg = EngineConfig(threads=1, min_span_bytes=1, gather_bytes=1 << 20, chunk_bytes=1 << 20)
        planner = Planner(src, cfg, gather_on=torch.device("cpu"))
        for cls in (N.Node, N.Leaf, MV.Selected):
            monkeypatch.setattr(cls, "read", no_reads)
            monkeypatch.setattr(cls, "full", no_reads)
        monkeypatch.setattr(type(src), "read", no_reads)
        planner.plan(jobs, tasks.append)
    gathers = {}
    for task in tasks:
        if isinstance(task, StagedRead):
            for dl in task.deliveries:
                assert dl.into is not None
                gathers.setdefault(id(dl.into[0]), (dl.into[0], []))[1].append(dl.nbytes)
    assert planner.gathered == len(gathers) == 2
    for gather, delivered in gathers.values():
        reads = [i.read for i in gather.step.inputs]
        assert all(r is not None for r in reads)
        assert [(dtype, shape) for _, dtype, shape in gather.layout] == [(r.dtype, r.shape) for r in reads if r is not None]
        want = sum(math.prod(box_shape(r.box)) * r.dtype.itemsize for r in reads if r is not None)
        assert sum(delivered) == want and gather.pieces >= 1
    assert {g.step.node for g, _ in gathers.values()} == {NODES["dequant-fp8-expert"], NODES["dequant-mxfp4"]}
