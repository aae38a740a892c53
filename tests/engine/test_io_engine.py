"""The I/O engine (sdadapt._engine) without processes: every path bit-exact against the
recipe's own ``read`` (the simple reader's path), coalescing, bounded staging, exact byte
counts, and errors that name the key and the file."""

from __future__ import annotations

import functools
import os
import random
from dataclasses import dataclass, field
from unittest import mock

import pytest
import torch
from support.checkpoints import random_state_dict, write_hf_sharded, write_safetensors, write_torch_save

import sdadapt
from sdadapt._engine import EngineConfig, IOEngine, Job, box_spans, default_threads
from sdadapt._recipes import interleave as interleave_module
from sdadapt._recipes import moves as MV
from sdadapt._recipes import nodes as N
from sdadapt._recipes.interleave import Interleaved
from sdadapt.errors import LoadError
from sdadapt.sources import open_source

SPEC = {
    "a": ((37, 19), torch.bfloat16),
    "b": ((16, 8, 5), torch.float32),
    "c": ((64, 33), torch.float16),
    "q": ((24, 12), torch.bfloat16),
    "k": ((8, 12), torch.bfloat16),
    "v": ((8, 12), torch.bfloat16),
    "s": ((), torch.float32),
    "n": ((7,), torch.int64),
}
CONFIGS = {
    "default": EngineConfig(threads=3),
    "direct": EngineConfig(threads=2, direct_min_bytes=0, chunk_bytes=4096, min_span_bytes=0),
    "staged-tiny-chunks": EngineConfig(
        threads=4, direct_min_bytes=1 << 40, chunk_bytes=4096, staging_bytes=3 * 4096, min_span_bytes=0
    ),
    "one-thread": EngineConfig(threads=1, direct_min_bytes=0),
    "staged-depth-3": EngineConfig(
        threads=2, direct_min_bytes=1 << 40, chunk_bytes=4096, staging_bytes=6 * 4096, min_span_bytes=0, depth=3
    ),
}


def _random_box(shape: tuple[int, ...], rng: random.Random) -> tuple[tuple[int, int], ...]:
    box = []
    for n in shape:
        a = rng.randrange(0, n)
        box.append((a, rng.randrange(a + 1, n + 1)))
    return tuple(box)


def _recipes(src) -> dict[str, N.Node]:
    leaf = {k: N.Leaf(k, i.shape, i.dtype) for k, i in src.schema.items()}
    out: dict[str, N.Node] = dict(leaf)
    out["qkv"] = MV.Concatenated((leaf["q"], leaf["k"], leaf["v"]), 0)
    out["kv_cols"] = MV.Concatenated((leaf["k"], leaf["v"]), 1)
    out["a32"] = N.Converted(leaf["a"], torch.float32)
    out["c_mid"] = MV.Narrowed(leaf["c"], 0, 10, 40)
    out["b_cast_cat"] = N.Converted(MV.Concatenated((leaf["b"], MV.Narrowed(leaf["b"], 0, 4, 6)), 0), torch.float64)
    out["b_int_back"] = N.Converted(N.Converted(leaf["b"], torch.int32), torch.float32)  # truncates
    out["c_bf16_f32"] = N.Converted(N.Converted(leaf["c"], torch.bfloat16), torch.float32)  # rounds
    out["cT"] = MV.Transposed(leaf["c"], 0, 1)
    out["kv_stack"] = MV.Stacked((leaf["k"], leaf["v"]), 0)
    out["b_sel"] = MV.Selected(leaf["b"], 1, 3)
    out["q_perm"] = MV.UnitPermuted(leaf["q"], 0, 4, (0, 2, 1, 3))
    out["a_pad"] = MV.Padded(leaf["a"], 0, 40, 0.0)
    out["a_pad_half"] = MV.Padded(N.Converted(leaf["a"], torch.float16), 1, 23, 0.1)
    out["qkv_tp2"] = Interleaved(MV.Concatenated((leaf["q"], leaf["k"], leaf["v"]), 0), 0, (24, 8, 8), 2)
    # parts alternating row by row (picked out of covering reads), along dim 0 and a middle dim
    out["c_rows_alt"] = Interleaved(leaf["c"], 0, (32, 32), 32, inverse=True)
    out["b_mid_alt"] = Interleaved(leaf["b"], 1, (4, 4), 4, inverse=True)
    return out


class _Plain:
    """A SourceIO without counting (the reference read)."""

    def __init__(self, src):
        self.src = src

    def read(self, key, box):
        return self.src.read(key, box)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    d = tmp_path_factory.mktemp("engine")
    sd = random_state_dict(SPEC, seed=1)
    out = {
        "safetensors": write_safetensors(d / "m.safetensors", sd),
        "hf": write_hf_sharded(d / "hf", sd, max_shard_bytes=3000),
        "torch.save": write_torch_save(d / "m.pt", sd),
    }
    return sd, out


@pytest.mark.parametrize("fmt", ["safetensors", "hf", "torch.save"])
def test_engine_bit_exact_every_path(sources, fmt):
    _, paths = sources
    rng = random.Random(7)
    with open_source(paths[fmt]) as src:
        recipes = _recipes(src)
        ref_io = _Plain(src)
        for cname, cfg in CONFIGS.items():
            jobs, expected = [], []
            for key, node in recipes.items():
                for _ in range(3):
                    box = _random_box(node.shape, rng)
                    want = node.full(ref_io)[tuple(slice(a, b) for a, b in box)]
                    assert torch.equal(node.read(box, ref_io), want), (key, box)
                    dest = torch.full(want.shape, 7, dtype=node.dtype)
                    if rng.random() < 0.3 and dest.dim() == 2:  # a non-contiguous destination (TP-like column slice)
                        dest = torch.full((want.shape[0], want.shape[1] + 3), 7, dtype=node.dtype)[:, 1 : 1 + want.shape[1]]
                    jobs.append(Job(key, node, box, dest))
                    expected.append((key, box, want))
            engine = IOEngine(src, cfg)
            stats = engine.run(jobs)
            for job, (key, box, want) in zip(jobs, expected, strict=True):
                assert torch.equal(job.dest, want), (fmt, cname, key, box)
            assert stats.bytes_read > 0
            assert stats.staging_bytes <= max(cfg.staging_bytes, cfg.chunk())


def test_bytes_counted_exactly(sources):
    """Plain leaves, whole and partial boxes: the engine counts exactly the bytes of the boxes."""
    _, paths = sources
    rng = random.Random(3)
    for cfg in CONFIGS.values():
        with open_source(paths["safetensors"]) as src:
            jobs, want = [], 0
            for key, info in src.schema.items():
                box = _random_box(info.shape, rng)
                n = 1
                for a, b in box:
                    n *= b - a
                want += n * info.dtype.itemsize
                jobs.append(Job(key, N.Leaf(key, info.shape, info.dtype), box, torch.empty([b - a for a, b in box], dtype=info.dtype)))
            assert IOEngine(src, cfg).run(jobs).bytes_read == want


@pytest.mark.parametrize("python_max", [0, 256])
def test_box_spans_match_brute_force(monkeypatch, python_max):
    """Both ways of listing the runs (tensor ops, and plain ints for a few runs) agree with
    indexing the tensor."""
    from sdadapt._engine import geometry

    monkeypatch.setattr(geometry, "_PYTHON_MAX", python_max)
    rng = random.Random(0)
    for _ in range(300):
        nd = rng.randrange(1, 5)
        shape = tuple(rng.randrange(1, 6) for _ in range(nd))
        box = _random_box(shape, rng)
        flat = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.int64)
        want = flat.view(shape)[tuple(slice(a, b) for a, b in box)].reshape(-1)
        starts, run = box_spans(shape, 8, box)
        got = torch.cat([flat[s // 8 : s // 8 + run // 8] for s in starts])
        assert torch.equal(got, want), (shape, box)
        # runs are maximal: whole trailing dims make one run
        assert len(starts) == len(set(starts))
    assert box_spans((), 4, ()) == ([0], 4)


def test_coalescing_merges_adjacent_small_reads(tmp_path):
    sd = {f"w{i:03d}": torch.randn(4, 8) for i in range(64)}  # 128 bytes each, back to back
    path = write_safetensors(tmp_path / "small.safetensors", sd)
    with open_source(path) as src:
        jobs = [Job(k, N.Leaf(k, (4, 8), torch.float32), ((0, 4), (0, 8)), torch.empty(4, 8)) for k in sd]
        stats = IOEngine(src, EngineConfig(threads=2, chunk_bytes=1 << 20)).run(jobs)
        assert stats.coalesced == 64
        assert stats.syscalls == 1  # one read for all 64 tensors
        assert stats.bytes_read == 64 * 128
        for job in jobs:
            assert torch.equal(job.dest, sd[job.key])
        # a chunk limit splits the shared read; a gap of unwanted bytes is not spanned by default
        jobs = [Job(k, N.Leaf(k, (4, 8), torch.float32), ((0, 4), (0, 8)), torch.empty(4, 8)) for k in list(sd)[::2]]
        stats = IOEngine(src, EngineConfig(threads=2, chunk_bytes=512)).run(jobs)
        assert stats.coalesced == 0 and stats.syscalls == 32 and stats.bytes_read == 32 * 128
        # with coalesce_gap, reads span the gaps (and count them)
        stats = IOEngine(src, EngineConfig(threads=2, chunk_bytes=1 << 20, coalesce_gap=128)).run(jobs)
        assert stats.syscalls == 1 and stats.bytes_read == 63 * 128
        for job in jobs:
            assert torch.equal(job.dest, sd[job.key])


def test_large_reads_are_queued_while_planning(tmp_path):
    """Single-span pieces of half a chunk or more go out as they are planned (reading starts
    while later jobs are routed); only smaller ones wait for the coalescing pass at the end."""
    sd = {"a_big": torch.randn(64, 256), "b_small": torch.randn(4, 8), "c_big": torch.randn(64, 256), "d_small": torch.randn(4, 8)}
    path = write_safetensors(tmp_path / "m.safetensors", sd)
    cfg = EngineConfig(threads=2, direct_min_bytes=1 << 40, chunk_bytes=16384)
    with open_source(path) as src:
        jobs = [Job(k, N.Leaf(k, tuple(t.shape), t.dtype), tuple((0, n) for n in t.shape), torch.empty_like(t)) for k, t in sd.items()]
        emitted: list = []
        assert IOEngine(src, cfg).plan(jobs, emitted.append) == []
        order = [tuple(d.where.target for d in t.deliveries) for t in emitted]
        assert order[:-2] == [("a_big",)] * 4 + [("c_big",)] * 4  # 64 KiB each, in 16 KiB reads, in job order
        assert sorted(order[-2:]) == [("b_small",), ("d_small",)]  # not adjacent in the file: two reads
        stats = IOEngine(src, cfg).run(jobs)
        assert stats.staged_bytes == sum(t.numel() * 4 for t in sd.values())
        for job in jobs:
            assert torch.equal(job.dest, sd[job.key])


def _four_matrices(tmp_path) -> tuple[str, list[Job]]:
    """A file of four 64x64 float32 matrices and a job reading each whole."""
    sd = {f"w{i}": torch.randn(64, 64) for i in range(4)}
    path = write_safetensors(tmp_path / "m.safetensors", sd)
    return path, [Job(k, N.Leaf(k, (64, 64), torch.float32), ((0, 64), (0, 64)), torch.empty(64, 64)) for k in sd]


def _intervals_inside(monkeypatch, cls: type, name: str) -> list[float]:
    """Wrap method ``name`` of ``cls`` so that each call records Python's switch interval as
    it starts and as it returns; returns the list the records go to."""
    import sys

    seen: list[float] = []
    real = getattr(cls, name)

    def wrapped(self, *args):
        seen.append(sys.getswitchinterval())
        try:
            return real(self, *args)
        finally:
            seen.append(sys.getswitchinterval())

    monkeypatch.setattr(cls, name, wrapped)
    return seen


@pytest.mark.parametrize(("env", "want"), [(None, None), ("1", 0.001), ("0.25", 0.00025), ("0", None)])
def test_threads_run_with_the_configured_switch_interval(tmp_path, monkeypatch, env, want):
    """While the engine's threads run, Python's thread switch interval is the config's
    (``SDADAPT_IO_SWITCH_MS``; unset or ``0`` leaves the interpreter's own), and it is set back
    after the run, also when a task failed."""
    import sys

    from sdadapt._engine import workers as W

    if env is not None:
        monkeypatch.setenv("SDADAPT_IO_SWITCH_MS", env)
    cfg = EngineConfig.from_env()
    assert cfg.switch_interval == want
    path, jobs = _four_matrices(tmp_path)
    before = sys.getswitchinterval()
    seen = _intervals_inside(monkeypatch, W.Worker, "_run")
    with open_source(path) as src:
        IOEngine(src, cfg).run(jobs)
        assert seen and set(seen) == {before if want is None else want}
        assert sys.getswitchinterval() == before
        monkeypatch.setattr(W.Worker, "_run", lambda self, task: (_ for _ in ()).throw(RuntimeError("boom")))
        with pytest.raises(Exception, match="boom"):
            IOEngine(src, cfg).run(jobs)
        assert sys.getswitchinterval() == before
    with pytest.raises(ValueError, match="switch_interval"):
        EngineConfig(switch_interval=0)


@pytest.mark.parametrize(("env", "want"), [(None, None), ("0.5", 0.0005), ("0", None)])
def test_planning_runs_with_the_configured_plan_switch_interval(tmp_path, monkeypatch, env, want):
    """While the engine plans, the switch interval is ``plan_switch_interval``
    (``SDADAPT_IO_PLAN_SWITCH_MS``; unset or ``0``: the run's own); afterwards the run's again.
    The run reports when its first task finished, after it started and before it ended."""
    import sys

    from sdadapt._engine import planner as P

    monkeypatch.setenv("SDADAPT_IO_SWITCH_MS", "2")
    if env is not None:
        monkeypatch.setenv("SDADAPT_IO_PLAN_SWITCH_MS", env)
    cfg = EngineConfig.from_env()
    assert cfg.plan_switch_interval == want
    path, jobs = _four_matrices(tmp_path)
    before = sys.getswitchinterval()
    seen = _intervals_inside(monkeypatch, P.Planner, "plan")
    with open_source(path) as src:
        stats = IOEngine(src, cfg).run(jobs)
    assert seen == [0.002 if want is None else want] * 2 and sys.getswitchinterval() == before
    assert 0 < stats.first_task_seconds <= stats.seconds
    with pytest.raises(ValueError, match="plan_switch_interval"):
        EngineConfig(plan_switch_interval=-1)


def test_config_rejects_zero_depth():
    with pytest.raises(ValueError, match="depth"):
        EngineConfig(depth=0)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_staging_is_bounded(tmp_path, depth):
    sd = {f"w{i}": torch.randn(64, 256) for i in range(6)}  # 64 KiB each
    path = write_safetensors(tmp_path / "big.safetensors", sd)
    cfg = EngineConfig(threads=4, direct_min_bytes=1 << 40, chunk_bytes=8192, staging_bytes=2 * 8192, min_span_bytes=0, depth=depth)
    with open_source(path) as src:
        # non-contiguous destinations: everything goes through staging, in 8 KiB chunks
        dests = {k: torch.zeros(64, 300)[:, 10:266] for k in sd}
        jobs = [Job(k, N.Leaf(k, (64, 256), torch.float32), ((0, 64), (0, 256)), dests[k]) for k in sd]
        stats = IOEngine(src, cfg).run(jobs)
        assert stats.staging_bytes <= 2 * 8192
        assert stats.staging_buffers <= 2
        assert stats.staged_bytes == 6 * 64 * 256 * 4
        assert stats.tasks >= 6 * 8
        for k in sd:
            assert torch.equal(dests[k], sd[k])


def test_direct_reads_use_no_staging(tmp_path):
    sd = {"big": torch.randn(256, 1024)}  # 1 MiB, read straight into the destination
    path = write_safetensors(tmp_path / "d.safetensors", sd)
    with open_source(path) as src:
        dest = torch.empty(128, 1024)
        stats = IOEngine(src, EngineConfig(threads=2, chunk_bytes=64 * 1024)).run(
            [Job("big", N.Leaf("big", (256, 1024), torch.float32), ((128, 256), (0, 1024)), dest)]
        )
        assert torch.equal(dest, sd["big"][128:])
        assert stats.staging_bytes == 0 and stats.direct_bytes == 128 * 1024 * 4 and stats.tasks == 8


def test_torch_save_locations_are_file_offsets(sources):
    sd, paths = sources
    with open_source(paths["torch.save"]) as src:
        with open(paths["torch.save"], "rb") as f:
            for key, t in sd.items():
                loc = src.locate(key)
                if t.numel() == 0:
                    continue
                assert loc is not None, key
                f.seek(loc.offset)
                raw = f.read(t.numel() * t.element_size())
                assert raw == bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist()), key


def test_steps_cover_every_element(sources):
    """A recipe's steps write every element of the destination exactly once."""
    _, paths = sources
    rng = random.Random(11)
    with open_source(paths["safetensors"]) as src:
        for key, node in _recipes(src).items():
            box = _random_box(node.shape, rng)
            dest = torch.zeros([b - a for a, b in box], dtype=torch.float64)
            for step in node.steps(box, dest):
                step.dest.add_(1)
            assert torch.equal(dest, torch.ones_like(dest)), key


def test_engine_knows_no_node_kinds(sources):
    """Pure data movement becomes pieces read straight from the file; only the unit permutation
    and the lossy casts are computations (no node goes through Source.read whole), and an
    interleave whose blocks are deemed too short to be worth a read each is one picking
    computation."""
    _, paths = sources
    with open_source(paths["safetensors"]) as src:
        recipes = _recipes(src)
        kinds = {}

        def kinds_of(node):
            return {type(s).__name__ for s in node.steps(N.full_box(node.shape), torch.empty(node.shape, dtype=node.dtype))}

        for key, node in recipes.items():
            kinds[key] = kinds_of(node)
        assert kinds["qkv_tp2"] == kinds["kv_stack"] == kinds["cT"] == kinds["b_cast_cat"] == {"Piece"}
        with mock.patch.object(interleave_module, "PICK_ROWS", 100):  # blocks of 12, 4 and 4 rows: "short" now
            assert kinds_of(recipes["qkv_tp2"]) == {"Compute"}
        assert kinds["a_pad"] == {"Piece", "Fill"}
        assert kinds["q_perm"] == kinds["b_int_back"] == kinds["c_bf16_f32"] == {"Compute"}
        assert kinds["a_pad_half"] == {"Piece", "Fill"}  # bf16 -> f16 into an f16 destination: copy_ is the cast


@dataclass(frozen=True, eq=False)
class _BlockScaled(N.Node):
    """A node kind written outside sdadapt with only shape, dtype, produce, full and describe:
    ``weight * scale[i // b0, j // b1]`` in float32, computed over block-aligned reads of both
    inputs (what a dequantisation node does)."""

    weight: N.Node
    scale: N.Node
    block: tuple[int, int]
    shape: tuple[int, ...] = field(init=False)
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", self.weight.shape)

    def produce(self, box, dest, out):
        out.append(N.Compute(self, box, dest, functools.partial(self._dequant, box)))

    def _dequant(self, box, io):
        (b0, b1), ((r0, r1), (c0, c1)) = self.block, box
        rows, cols = (r0 // b0, -(-r1 // b0)), (c0 // b1, -(-c1 // b1))  # the scale tiles the box touches
        wide = ((rows[0] * b0, min(self.shape[0], rows[1] * b0)), (cols[0] * b1, min(self.shape[1], cols[1] * b1)))
        w = self.weight.read(wide, io).float()
        s = self.scale.read((rows, cols), io).repeat_interleave(b0, 0).repeat_interleave(b1, 1)
        v = w * s[: w.shape[0], : w.shape[1]]
        return v[r0 - wide[0][0] : r1 - wide[0][0], c0 - wide[1][0] : c1 - wide[1][0]]

    def full(self, io):
        w, s = self.weight.full(io).float(), self.scale.full(io)
        i = torch.arange(self.shape[0]) // self.block[0]
        j = torch.arange(self.shape[1]) // self.block[1]
        return w * s[i][:, j]

    def describe(self):
        return f"block_scaled({self.weight.describe()}, {self.scale.describe()})"


def test_a_new_computing_node_needs_only_produce(tmp_path):
    """A node that computes over widened reads of two inputs plugs into the region path and
    the engine without either knowing it: bit-exact against its own ``full``."""
    sd = {"w": torch.randn(37, 19).to(torch.bfloat16), "w_scale": torch.rand(5, 3) + 0.5}
    path = write_safetensors(tmp_path / "q.safetensors", sd)
    node = _BlockScaled(N.Leaf("w", (37, 19), torch.bfloat16), N.Leaf("w_scale", (5, 3), torch.float32), (8, 7))
    assert node.leaves() == ["w", "w_scale"]
    rng = random.Random(5)
    with open_source(path) as src:
        full = node.full(_Plain(src))
        boxes = [_random_box(node.shape, rng) for _ in range(12)] + [N.full_box(node.shape)]
        for box in boxes:
            assert torch.equal(node.read(box, _Plain(src)), full[tuple(slice(a, b) for a, b in box)]), box
        for cfg in CONFIGS.values():
            jobs = [Job("w", node, box, torch.zeros([b - a for a, b in box])) for box in boxes]
            stats = IOEngine(src, cfg).run(jobs)
            assert stats.computed >= len(jobs)
            for job in jobs:
                assert torch.equal(job.dest, full[tuple(slice(a, b) for a, b in job.box)]), job.box


def test_error_names_key_and_file_on_truncated_file(tmp_path):
    sd = {"x": torch.randn(64, 64), "y": torch.randn(64, 64)}
    path = str(write_safetensors(tmp_path / "t.safetensors", sd))
    src = open_source(path)  # header read while whole
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)  # y's tail is gone
    try:
        for cfg in (EngineConfig(threads=2, direct_min_bytes=0), EngineConfig(threads=2, direct_min_bytes=1 << 40)):
            # whole rows: read calls, direct and staged; both must name the key and the file
            jobs = [Job("model.y", N.Leaf("y", (64, 64), torch.float32), ((0, 64), (0, 64)), torch.empty(64, 64))]
            with pytest.raises(LoadError) as ei:
                IOEngine(src, cfg).run(jobs)
            msg = str(ei.value)
            assert "'model.y'" in msg and "'y'" in msg and path in msg and "truncated" in msg
    finally:
        src.close()


def test_error_from_a_computed_node_names_key(sources):
    _, paths = sources

    class Boom(N.Node):
        """A computation that fails, written as a new node kind would be."""

        shape = (3,)
        dtype = torch.float32

        def produce(self, box, dest, out):
            out.append(N.Compute(self, box, dest, self._boom))

        def _boom(self, io):
            io.read("a", ((0, 1), (0, 1)))
            raise ValueError("boom")

        def children(self):
            return (N.Leaf("a", (37, 19), torch.bfloat16),)

    with open_source(paths["safetensors"]) as src:
        with pytest.raises(LoadError, match=r"key 'target.w' \(from .*m.safetensors\).*boom"):
            IOEngine(src, EngineConfig(threads=2)).run([Job("target.w", Boom(), ((0, 3),), torch.empty(3))])


def test_default_threads_follow_local_ranks(monkeypatch):
    monkeypatch.delenv("SDADAPT_IO_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    one = default_threads()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1000")
    assert default_threads() == 1
    assert 1 <= one <= 32
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert default_threads() == 12  # 16 CPUs per rank, a quarter left to the rest of the process
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert default_threads() == 4  # under 8 CPUs per rank: all of them
    monkeypatch.setenv("SDADAPT_IO_THREADS", "5")
    assert default_threads() == 5


def test_config_from_environment(monkeypatch):
    monkeypatch.setenv("SDADAPT_IO_THREADS", "4")
    monkeypatch.setenv("SDADAPT_IO_STAGING_MB", "64")
    monkeypatch.setenv("SDADAPT_IO_DEPTH", "4")
    monkeypatch.delenv("SDADAPT_IO_CHUNK_MB", raising=False)
    cfg = EngineConfig.from_env()
    assert (cfg.threads, cfg.staging_bytes, cfg.depth) == (4, 64 << 20, 4)
    assert cfg.chunk() == 4 << 20  # staging / (depth x threads)
    monkeypatch.setenv("SDADAPT_IO_CHUNK_MB", "0.5")
    assert EngineConfig.from_env().chunk() == 1 << 19


def test_populate_keeps_values_and_fresh_memory_reads_right(tmp_path):
    from sdadapt._engine.syscalls import populate

    t = torch.arange(1 << 20, dtype=torch.int32)  # 4 MiB with values: faulting in must not change them
    want = t.clone()
    populate(t)
    assert torch.equal(t, want)
    # a direct read into fresh memory large enough to be populated first
    sd = {"big": torch.randn(1024, 1024)}  # 4 MiB
    path = write_safetensors(tmp_path / "p.safetensors", sd)
    with open_source(path) as src:
        dest = torch.empty(1024, 1024)
        job = Job("big", N.Leaf("big", (1024, 1024), torch.float32), ((0, 1024), (0, 1024)), dest)
        stats = IOEngine(src, EngineConfig(threads=1)).run([job])
        assert stats.direct_bytes == 4 << 20 and torch.equal(dest, sd["big"])


def test_lossy_cast_chain_is_applied(tmp_path):
    """f32 -> int32 -> f32 truncates: the engine must compute the inner cast, not let ``copy_``
    convert f32 straight into the f32 destination."""
    t = torch.tensor([[1.75, -2.5, 3.25], [0.5, -0.75, 9.9]], dtype=torch.float32)
    path = write_safetensors(tmp_path / "c.safetensors", {"w": t})
    with open_source(path) as src:
        node = N.Converted(N.Converted(N.Leaf("w", (2, 3), torch.float32), torch.int32), torch.float32)
        want = node.full(_Plain(src))
        assert torch.equal(want, t.to(torch.int32).to(torch.float32))
        for cfg in CONFIGS.values():
            dest = torch.full((2, 3), 7.0)
            IOEngine(src, cfg).run([Job("w", node, ((0, 2), (0, 3)), dest)])
            assert torch.equal(dest, want)


def test_alternating_rows_are_picked_in_one_task_per_cluster(tmp_path):
    """Gate and up rows stored alternating (GPT-OSS) de-interleaved through the engine: each
    region is one task per part it touches (not a task per row), reads at most twice its
    bytes, and gives the bits of the whole-tensor reference, whatever the box."""
    E, F, D = 3, 40, 64
    t = torch.randn(E, 2 * F, D)
    path = write_safetensors(tmp_path / "gate_up.safetensors", {"gate_up": t})
    node = Interleaved(N.Leaf("gate_up", (E, 2 * F, D), t.dtype), 1, (F, F), F, inverse=True)
    want = torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)
    rng = random.Random(5)
    boxes = [((0, E), (0, F), (0, D)), ((0, E), (F, 2 * F), (0, D)), ((1, 2), (F - 3, F + 5), (8, 40))]
    boxes += [_random_box(node.shape, rng) for _ in range(20)]
    with open_source(path) as src:
        for box in boxes:
            dest = torch.full([b - a for a, b in box], float("nan"))
            stats = IOEngine(src, EngineConfig(threads=2)).run([Job("w", node, box, dest)])
            assert torch.equal(dest, want[tuple(slice(a, b) for a, b in box)]), box
            crosses = box[1][0] < F < box[1][1]  # gate rows and up rows: one cluster each
            assert stats.tasks == (2 if crosses else 1), (box, stats.tasks)
            assert stats.bytes_read <= 2 * dest.numel() * 4, box
        # a cover limit cuts a large region into several computations, each bounded
        with mock.patch.object(interleave_module, "PICK_COVER_BYTES", 8 * E * D * 4):
            dest = torch.empty(E, F, D)
            stats = IOEngine(src, EngineConfig(threads=2)).run([Job("w", node, ((0, E), (0, F), (0, D)), dest)])
            assert torch.equal(dest, want[:, :F]) and stats.tasks == 10


def test_thread_seconds_split_busy_time_into_reads_and_waits(tmp_path):
    """The engine's threads account their time: reading and waiting for buffers happen while
    running tasks, so neither exceeds the busy time (nor do both together); a load reports
    the same split in ``LoadReport.engine_thread_seconds``."""
    sd = {f"w{i}": torch.randn(64, 256) for i in range(8)}
    path = write_safetensors(tmp_path / "m.safetensors", sd)
    with open_source(path) as src:
        jobs = [Job(k, N.Leaf(k, (64, 256), torch.float32), ((0, 64), (0, 256)), torch.empty(64, 256, dtype=torch.float64)) for k in sd]
        stats = IOEngine(src, EngineConfig(threads=2, chunk_bytes=4096)).run(jobs)  # staged: converted on copy
    assert stats.busy_seconds > 0 and stats.read_seconds > 0
    assert stats.read_seconds + stats.wait_seconds <= stats.busy_seconds + 1e-6
    model = torch.nn.ModuleDict({k: torch.nn.Linear(256, 64, bias=False) for k in sd})
    rep = sdadapt.load(model, path, sdadapt.Adapter([sdadapt.rename("w{i}", "w{i}.weight")]))
    times = rep.engine_thread_seconds
    assert set(times) == {"busy", "read", "wait"} and times["busy"] > 0
    assert times["read"] + times["wait"] <= times["busy"] + 1e-5
    assert all(torch.equal(model[k].weight, sd[k]) for k in sd)


def test_device_lane_accounts_its_thread_time(tmp_path):
    """A run with a device lane (on the CPU here, as a GPU run has one) times the lane's thread:
    its CPU time, its waits for work and for copies are parts of its run, and a load reports
    them beside the readers' (``lane*`` keys of ``engine_thread_seconds``); a run without a lane
    counts none."""
    from sdadapt._load.loading import _thread_seconds

    sd = {f"w{i}": torch.randn(64, 256) for i in range(8)}
    path = write_safetensors(tmp_path / "m.safetensors", sd)
    with open_source(path) as src:
        def jobs() -> list[Job]:
            return [Job(k, N.Leaf(k, (64, 256), torch.float32), ((0, 64), (0, 256)), torch.empty(64, 256)) for k in sd]

        cfg = EngineConfig(threads=2, chunk_bytes=4096)
        laned = IOEngine(src, cfg, cpu_lane=True).run(lane_jobs := jobs())
        plain = IOEngine(src, cfg).run(jobs())
    assert all(torch.equal(j.dest, sd[j.key]) for j in lane_jobs)
    assert laned.lane.wall > 0 and laned.lane.cpu > 0
    assert laned.lane.cpu <= laned.lane.wall + 0.01  # the clocks' granularity
    assert laned.lane.idle + laned.lane.copy_wait <= laned.lane.wall
    assert plain.lane.wall == plain.lane.cpu == plain.lane.idle == 0
    times = _thread_seconds(laned)
    assert set(times) == {"busy", "read", "wait", "lane", "lane_cpu", "lane_idle", "lane_copy_wait"}
    assert times["lane"] == round(laned.lane.wall, 6)
    assert set(_thread_seconds(plain)) == {"busy", "read", "wait"}
