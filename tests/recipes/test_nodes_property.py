"""Property tests of the transform algebra (hypothesis), on an in-memory SourceIO.

A random case is a few independent groups; each group has ``L`` layers whose source tensors
``g{g}.layers.{l}.in{j}`` go through a random chain of rules:
optional cast first -> fuse of k parts (unequal sizes along a random dim) -> optional rename
-> optional split (random sizes, declared or taken from the target) -> optional cast last
-> optional second cast. Values are small integers (exact in every dtype) or, in lossy
groups, fractions, so that casts truncate or round (f32 -> int32 -> f32 loses the fraction).
The expected outputs are computed here, independently of sdadapt, with plain torch ops.

Checked for every case:
- the plan predicts exactly the shapes/dtypes of the independent computation and is ok;
- ``node.full(io)`` equals the independent result, bit-exactly;
- ``node.read(box, io)`` equals ``node.full(io)[box]`` for random boxes, and reads exactly the
  box's volume from the source (box-to-box rules read nothing extra);
- the I/O engine, on a safetensors file of the source tensors, fills destinations (contiguous
  and strided; direct, staged and strided-copy reads) with ``node.full(io)[box]`` bit-exactly,
  reading exactly the boxes' volume;
- ``adapter.inverse()`` planned on the forward outputs gives back the original keys/tensors
  (exact groups only: a lossy cast has no inverse);
- ``Adapter.from_json(a.to_json()) == a`` (forward and inverse).
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.checkpoints import DictIO, write_safetensors

import sdadapt
from sdadapt._base.regions import box_shape, full_box
from sdadapt._base.schema import TensorInfo
from sdadapt._engine import EngineConfig, IOEngine, Job
from sdadapt._plan.plan import build_plan
from sdadapt.sources import open_source

# Small integers are exact in all these dtypes, so casts of exact groups round-trip exactly.
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.int16]

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass
class Group:
    g: int
    layers: int
    shape: list[int]  # shape of part 0; other parts differ along fuse_dim
    fuse_dim: int  # may be negative
    part_sizes: list[int]
    declare_fuse_sizes: bool
    rename: bool
    split_dim: int | None  # may be negative; None: no split
    split_sizes: list[int]
    declare_split_sizes: bool
    src_dtype: torch.dtype
    cast_to: torch.dtype | None
    cast_first: bool
    cast_back: torch.dtype | None  # a second cast, after everything (needs cast_to)
    lossy: bool  # fractional values: casts truncate or round
    seed: int


@st.composite
def groups(draw, g: int) -> Group:
    nd = draw(st.integers(1, 3))
    shape = draw(st.lists(st.integers(1, 5), min_size=nd, max_size=nd))
    fuse_dim = draw(st.integers(-nd, nd - 1))
    k = draw(st.integers(1, 3))
    part_sizes = draw(st.lists(st.integers(0, 5), min_size=k, max_size=k))
    total = list(shape)
    total[fuse_dim] = sum(part_sizes)
    split_dim = draw(st.one_of(st.none(), st.integers(-nd, nd - 1)))
    split_sizes: list[int] = []
    if split_dim is not None:
        n = total[split_dim]
        m = draw(st.integers(2, 3))
        cuts = sorted(draw(st.lists(st.integers(0, n), min_size=m - 1, max_size=m - 1)))
        split_sizes = [b - a for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
    src_dtype = draw(st.sampled_from(DTYPES))
    cast_to = draw(st.one_of(st.none(), st.sampled_from([d for d in DTYPES if d != src_dtype])))
    cast_back = None
    if cast_to is not None:
        cast_back = draw(st.one_of(st.none(), st.sampled_from([d for d in DTYPES if d != cast_to])))
    return Group(
        g=g,
        layers=draw(st.integers(1, 2)),
        shape=shape,
        fuse_dim=fuse_dim,
        part_sizes=part_sizes,
        declare_fuse_sizes=draw(st.booleans()),
        rename=draw(st.booleans()),
        split_dim=split_dim,
        split_sizes=split_sizes,
        declare_split_sizes=draw(st.booleans()),
        src_dtype=src_dtype,
        cast_to=cast_to,
        cast_first=draw(st.booleans()),
        cast_back=cast_back,
        lossy=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@st.composite
def cases(draw) -> list[Group]:
    n = draw(st.integers(1, 3))
    return [draw(groups(g)) for g in range(n)]


def _part_shape(gr: Group, j: int) -> list[int]:
    s = list(gr.shape)
    s[gr.fuse_dim] = gr.part_sizes[j]
    return s


def _exact(case: list[Group]) -> list[Group]:
    """The case without lossy values and second casts (what can be inverted)."""
    return [replace(gr, lossy=False, cast_back=None) for gr in case]


def build_case(case: list[Group]) -> tuple[dict[str, torch.Tensor], sdadapt.Adapter, dict[str, torch.Tensor]]:
    """Source tensors, the adapter, and the expected outputs (computed without sdadapt)."""
    source: dict[str, torch.Tensor] = {}
    expected: dict[str, torch.Tensor] = {}
    rules: list = []
    for gr in case:
        gen = torch.Generator().manual_seed(gr.seed)
        k = len(gr.part_sizes)
        pre = f"g{gr.g}"
        srcs = [f"{pre}.layers.{{l}}.in{j}" for j in range(k)]
        fused = f"{pre}.layers.{{l}}.fused" if k > 1 else srcs[0]
        moved = f"{pre}.blocks.{{l}}.x" if gr.rename else fused
        outs = [f"{pre}.blocks.{{l}}.out{m}" for m in range(len(gr.split_sizes))]
        cast = None
        if gr.cast_to is not None:
            cast = sdadapt.cast(f"{pre}.**", gr.cast_to, from_dtype=gr.src_dtype)
        if cast is not None and gr.cast_first:
            rules.append(cast)
        if k > 1:
            declared = gr.declare_fuse_sizes or len(set(gr.part_sizes)) > 1  # unequal parts need their sizes
            rules.append(sdadapt.fuse(srcs, fused, dim=gr.fuse_dim, sizes=gr.part_sizes if declared else None))
        if gr.rename:
            rules.append(sdadapt.rename(fused, moved))
        if gr.split_dim is not None:
            rules.append(
                sdadapt.split(
                    moved, outs, dim=gr.split_dim, sizes=gr.split_sizes if gr.declare_split_sizes else None
                )
            )
        if cast is not None and not gr.cast_first:
            rules.append(cast)
        if gr.cast_back is not None:
            rules.append(sdadapt.cast(f"{pre}.**", gr.cast_back, from_dtype=gr.cast_to))

        for layer in range(gr.layers):
            parts = []
            for j in range(k):
                if gr.lossy:
                    t = (torch.randn(_part_shape(gr, j), generator=gen, dtype=torch.float64) * 8).to(gr.src_dtype)
                else:
                    t = torch.randint(-8, 9, _part_shape(gr, j), generator=gen).to(gr.src_dtype)
                source[srcs[j].format(l=layer)] = t
                parts.append(t)
            value = torch.cat(parts, dim=gr.fuse_dim)
            if gr.cast_to is not None:
                value = value.to(gr.cast_to)  # elementwise: commutes with fuse and split
            if gr.cast_back is not None:
                value = value.to(gr.cast_back)
            if gr.split_dim is None:
                expected[moved.format(l=layer)] = value
            else:
                start = 0
                for name, size in zip(outs, gr.split_sizes, strict=True):
                    expected[name.format(l=layer)] = value.narrow(gr.split_dim, start, size)
                    start += size
    return source, sdadapt.Adapter(rules, name="random"), expected


def _schema(tensors: dict[str, torch.Tensor]) -> dict[str, TensorInfo]:
    return {k: TensorInfo(tuple(v.shape), v.dtype) for k, v in tensors.items()}


def _boxes(draw, shape: tuple[int, ...], n: int) -> list[tuple[tuple[int, int], ...]]:
    out = []
    for _ in range(n):
        box = []
        for size in shape:
            a = draw(st.integers(0, size))
            b = draw(st.integers(a, size))
            box.append((a, b))
        out.append(tuple(box))
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@SETTINGS
@given(case=cases(), data=st.data())
def test_forward_read_box_equals_full_slice(case, data):
    source, adapter, expected = build_case(case)
    plan = build_plan(_schema(source), _schema(expected), adapter)
    assert plan.report.ok, plan.report.format()
    assert set(plan.recipes) == set(expected)
    for key, node in plan.recipes.items():
        want = expected[key]
        assert node.shape == tuple(want.shape), key
        assert node.dtype == want.dtype, key
        io = DictIO(source)
        full = node.full(io)
        assert _same(full, want), key
        leaf_size = source[node.leaves()[0]].element_size()
        for box in _boxes(data.draw, node.shape, 3):
            io = DictIO(source)
            got = node.read(box, io)
            assert _same(got, full[tuple(slice(a, b) for a, b in box)]), (key, box, node.describe())
            assert io.bytes_read == math.prod(b - a for a, b in box) * leaf_size, (key, box, io.reads)
        # the whole box through the lazy path is the eager result too
        assert _same(node.read(full_box(node.shape), DictIO(source)), want)


ENGINE_CONFIGS = [
    EngineConfig(threads=2, direct_min_bytes=0, chunk_bytes=4096, min_span_bytes=0),
    EngineConfig(threads=2, direct_min_bytes=1 << 40, chunk_bytes=4096, staging_bytes=2 * 4096, min_span_bytes=0),
    EngineConfig(threads=1),
]


@SETTINGS
@given(case=cases(), data=st.data())
def test_engine_fills_boxes_bit_exactly(case, data):
    source, adapter, expected = build_case(case)
    plan = build_plan(_schema(source), _schema(expected), adapter)
    assert plan.report.ok, plan.report.format()
    io = DictIO(source)
    fulls = {key: node.full(io) for key, node in plan.recipes.items()}
    with tempfile.TemporaryDirectory() as tmp:
        path = write_safetensors(Path(tmp) / "src.safetensors", source)
        with open_source(path) as src:
            for i, cfg in enumerate(ENGINE_CONFIGS):
                jobs, want, volume = [], [], 0
                for key, node in plan.recipes.items():
                    for box in _boxes(data.draw, node.shape, 2):
                        shape = box_shape(box)
                        if i == 1 and len(shape) >= 2:  # a strided destination (a column slice of a wider tensor)
                            wide = torch.full((*shape[:-1], shape[-1] + 2), 7, dtype=node.dtype)
                            dest = wide[..., 1 : 1 + shape[-1]]
                        else:
                            dest = torch.full(shape, 7, dtype=node.dtype)
                        jobs.append(Job(key, node, box, dest))
                        want.append(fulls[key][tuple(slice(a, b) for a, b in box)])
                        volume += math.prod(shape) * source[node.leaves()[0]].element_size()
                stats = IOEngine(src, cfg).run(jobs)
                for job, w in zip(jobs, want, strict=True):
                    assert _same(job.dest, w), (job.key, job.box, job.node.describe())
                assert stats.bytes_read == volume


@SETTINGS
@given(case=cases())
def test_inverse_after_forward_is_identity(case):
    source, adapter, expected = build_case(_exact(case))
    forward = build_plan(_schema(source), _schema(expected), adapter)
    assert forward.report.ok, forward.report.format()
    io = DictIO(source)
    exported = {k: n.full(io) for k, n in forward.recipes.items()}

    inverse = adapter.inverse()
    back = build_plan(_schema(exported), _schema(source), inverse)
    assert back.report.ok, adapter.describe() + "\n" + inverse.describe() + "\n" + back.report.format()
    assert set(back.recipes) == set(source)
    io2 = DictIO(exported)
    for key, node in back.recipes.items():
        assert _same(node.full(io2), source[key]), key
        assert (node.shape, node.dtype) == (tuple(source[key].shape), source[key].dtype)


@SETTINGS
@given(case=cases())
def test_adapter_json_round_trip(case):
    _, adapter, _ = build_case(case)
    for a in (adapter, adapter.inverse()):
        text = a.to_json()
        again = sdadapt.Adapter.from_json(text)
        assert again == a
        assert again.to_json() == text
        assert sdadapt.Adapter.from_json(a.to_json(indent=None)) == a
