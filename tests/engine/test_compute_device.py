"""Computations that run on the destination's device (dequantisation after the host-to-device
copy), exercised on CPU: the engine worker's device path (raw inputs read on the host, copied
through its staging buffers to ``dest.device``, kernel run there) with the CPU as the "device"
gives the same bits as the host path and as the eager whole-tensor reference. Where CUDA is
available, the engine itself is run with GPU destinations against the same reference."""

from __future__ import annotations

import math
import random
import threading
import time

import pytest
import torch
from support.checkpoints import write_safetensors

import sdadapt._recipes.moves as MV
import sdadapt._recipes.nodes as N
from sdadapt._engine.device import DeviceLane, device_step
from sdadapt._engine.lanes import TaskQueues
from sdadapt._engine.planner import bands_of
from sdadapt._engine.staging import StagingPool
from sdadapt._engine.tasks import ComputeTask, Delivery, Where
from sdadapt._engine.views import TypedViews
from sdadapt._engine.workers import Buffers, Shared, Worker
from sdadapt._recipes import quant as Q
from sdadapt._recipes import quant_nodes as QN
from sdadapt._recipes.interleave import Interleaved
from sdadapt.sources import open_source


def _bands(node: N.Node, box: tuple, max_bytes: int) -> list:
    """The bands the engine cuts ``node``'s computation of ``box`` into."""
    (step,) = node.steps(box, torch.empty(N.box_shape(box), dtype=node.dtype))
    assert isinstance(step, N.Compute)
    return bands_of(step, max_bytes)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _worker(src, chunk: int, depth: int, lane: bool = False) -> Worker:
    """A CPU worker whose staging buffers and band buffer hold ``chunk`` bytes (inputs larger
    than that are copied without staging), ``depth`` staging buffers per thread; with
    ``lane``, a started device lane with the CPU as its device (what a GPU run's readers hand
    their buffers to), which :func:`_finish` closes."""
    shared = Shared(src, TaskQueues(), {}, StagingPool(4, chunk, pin=False), chunk, StagingPool(1, chunk, pin=False))
    if lane:
        shared.lane = DeviceLane(torch.device("cpu"), chunk, shared.fail, slots=2)
        shared.lane.start()
    return Worker(shared, depth)


def _on_lane(worker: Worker, step: N.Step) -> None:
    """Run a computation as the engine's reader does: inputs read here, kernel on the lane."""
    assert isinstance(step, N.Compute)
    worker._compute(ComputeTask(step, Where("w", None, None, step.box)))


def _finish(worker: Worker) -> None:
    """Close the worker's lane (everything queued done, every buffer given back) and raise
    what failed."""
    assert worker.shared.lane is not None
    worker.shared.lane.close()
    worker.staging.drain()
    worker.bands.drain()
    assert not worker.shared.errors, worker.shared.errors


def _boxes(shape: tuple[int, ...], rng: random.Random, n: int, block: tuple[int, int] | None = None) -> list[N.Box]:
    """The whole tensor, its first and last element, ``n`` random boxes, and with ``block``
    boxes of whole blocks (dequantised straight into the destination)."""
    out = [N.full_box(shape), tuple((0, 1) for _ in shape), tuple((s - 1, s) for s in shape)]
    if block is not None:
        (b0, b1), lead = block, tuple((0, s) for s in shape[:-2])
        aligned = [lead + ((0, b0), (0, b1)), lead + ((b0, 2 * b0), (0, 2 * b1)), ((1, 2),) * len(lead) + ((0, 2 * b0), (b1, 2 * b1))]
        out += [box for box in aligned if box[-2][1] <= shape[-2] and box[-1][1] <= shape[-1]]
    for _ in range(n):
        box = []
        for s in shape:
            a = rng.randrange(s)
            box.append((a, rng.randrange(a + 1, s + 1)))
        out.append(tuple(box))
    return out


def _fp8_node(tmp_path, fmt: str, block: tuple[int, int]):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 45, 70, generator=g) * torch.exp2(torch.randint(-6, 6, (3, 45, 70), generator=g).float())
    w, s = Q.quantize_fp8(x, block, fmt)  # type: ignore[arg-type]
    path = write_safetensors(tmp_path / "fp8.safetensors", {"w": w, "w_scale_inv": s})
    w_leaf, s_leaf = N.Leaf("w", tuple(w.shape), w.dtype), N.Leaf("w_scale_inv", tuple(s.shape), s.dtype)
    node = QN.DequantizedFP8(w_leaf, s_leaf, block, fmt, torch.bfloat16)  # type: ignore[arg-type]
    return node, path


def _mxfp4_node(tmp_path):
    blocks, scales = Q.quantize_mxfp4(torch.randn(2, 5, 4 * Q.MX_BLOCK, generator=torch.Generator().manual_seed(4)))
    path = write_safetensors(tmp_path / "mx.safetensors", {"e_blocks": blocks, "e_scales": scales})
    node = QN.DequantizedMXFP4(
        N.Leaf("e_blocks", tuple(blocks.shape), blocks.dtype), N.Leaf("e_scales", tuple(scales.shape), scales.dtype), torch.bfloat16
    )
    return node, path


def _mxfp4_rows_node(tmp_path):
    """MXFP4 whose rows are stored alternating (GPT-OSS's gate/up), de-interleaved under the
    dequantisation: its inputs are gathered on the host from covering reads."""
    blocks, scales = Q.quantize_mxfp4(torch.randn(2, 6, 4 * Q.MX_BLOCK, generator=torch.Generator().manual_seed(5)))
    path = write_safetensors(tmp_path / "mx_rows.safetensors", {"e_blocks": blocks, "e_scales": scales})

    def rows(key: str, t: torch.Tensor) -> N.Node:
        return Interleaved(N.Leaf(key, tuple(t.shape), t.dtype), 1, (3, 3), 3, inverse=True)

    return QN.DequantizedMXFP4(rows("e_blocks", blocks), rows("e_scales", scales), torch.bfloat16), path


def _node_of(kind: str, tmp_path):
    """The dequantisation node and file a test kind names: ``"mxfp4"``, ``"mxfp4-rows"``
    (alternating rows), or ``"fp8-<scale format>-<rows>x<cols>"`` (the block)."""
    if kind == "mxfp4":
        return _mxfp4_node(tmp_path)
    if kind == "mxfp4-rows":
        return _mxfp4_rows_node(tmp_path)
    _, fmt, blk = kind.split("-")
    b0, b1 = blk.split("x")
    return _fp8_node(tmp_path, fmt, (int(b0), int(b1)))


@pytest.mark.parametrize("chunk, depth", [(1 << 20, 2), (512, 1)])  # all staged; large inputs unstaged, one buffer
@pytest.mark.parametrize("kind", ["fp8-float32-16x32", "fp8-ue8m0-7x9", "mxfp4", "mxfp4-rows"])
def test_device_path_equals_host_path_and_full(tmp_path, kind, chunk, depth):
    node, path = _node_of(kind, tmp_path)
    rng = random.Random(kind)
    with open_source(path) as src:
        worker = _worker(src, chunk, depth, lane=True)
        _open_all(worker, src)
        full = node.full(worker.counter)
        results = []
        for box in _boxes(node.shape, rng, 15, getattr(node, "block", None)):
            host = torch.full(N.box_shape(box), float("nan"), dtype=torch.bfloat16)
            moved = torch.full(N.box_shape(box), float("nan"), dtype=torch.bfloat16)
            host_steps, moved_steps = node.steps(box, host), node.steps(box, moved)
            assert [type(s) for s in moved_steps] == [N.Compute] and all(s.on_device for s in moved_steps)
            for step in host_steps:
                step.run(worker.counter)
            for step in moved_steps:
                _on_lane(worker, step)
            results.append((box, host, moved))
        _finish(worker)
        for box, host, moved in results:
            want = full[tuple(slice(a, b) for a, b in box)]
            assert torch.equal(_bits(host), _bits(want)), box
            assert torch.equal(_bits(moved), _bits(want)), box
        assert worker.shared.pool.allocated <= depth  # unstaged inputs went through this thread's ring only
        assert worker.shared.bands.allocated == 1  # staged inputs through its one band buffer
        if chunk > 4096:
            assert worker.staged > 0  # read with preadv into the band buffer


def _open_all(worker: Worker, src) -> None:
    """Open the source's files for the worker's ``preadv`` reads (the engine does it when planning)."""
    import os

    for f in src.files():
        worker.shared.fds[f] = os.open(f, os.O_RDONLY)


def test_uploads_stage_in_slices_that_fit_and_copy_the_rest(tmp_path, monkeypatch):
    """A host value bound for the lane's device crosses through the thread's staging buffers:
    whole, or in slices along dim 0 that fit one; where one entry of dim 0 does not fit, the
    lane copies it directly."""
    path = write_safetensors(tmp_path / "t.safetensors", {"t": torch.arange(12.0)})
    with open_source(path) as src:
        worker = _worker(src, 64, 1, lane=True)
        lane = worker.shared.lane
        assert lane is not None
        staged: list[int] = []
        direct: list[int] = []
        upload, call = lane.upload, lane.call
        monkeypatch.setattr(lane, "upload", lambda buf, dls, release, where: (staged.append(len(dls)), upload(buf, dls, release, where)))
        monkeypatch.setattr(lane, "call", lambda fn, where: (direct.append(1), call(fn, where)))
        cases = [
            (torch.arange(10, dtype=torch.int32)[::2], 1, 0),  # 20 bytes, not contiguous: one staged copy
            (torch.randn(40, 3)[:, 1], 3, 0),  # 160 bytes: staged in slices of 16 entries
            (torch.randn(5, 7, 3).transpose(0, 1), 7, 0),  # 7 rows of 60 bytes: one row per slice
            (torch.randn(2, 20), 0, 1),  # a row of 80 bytes fits no buffer: copied directly
        ]
        outs = []
        for value, copies, calls in cases:
            staged.clear()
            direct.clear()
            out = torch.full(value.shape, -1, dtype=value.dtype)
            worker._upload(value, out, Where("t", None, None, ()))
            assert len(staged) == copies and len(direct) == calls, (value.shape, staged, direct)
            outs.append((value, out))
        _finish(worker)
        for value, out in outs:
            assert torch.equal(out, value)
        assert worker.shared.pool.allocated == 1


def test_only_computations_given_as_inputs_and_kernel_say_they_run_on_device():
    leaf = N.Leaf("a", (4, 6), torch.float32)
    dest = torch.empty(4, 6, dtype=torch.int32)
    cast = N.Converted(leaf, torch.float16).steps(N.full_box((4, 6)), dest)
    perm = MV.UnitPermuted(leaf, 0, 2, (1, 0)).steps(N.full_box((4, 6)), dest)
    assert [s.on_device for s in cast + perm if isinstance(s, N.Compute)] == [False, False]
    with pytest.raises(ValueError, match="either fn, or inputs and kernel"):
        N.Compute(leaf, N.full_box((4, 6)), dest)
    with pytest.raises(ValueError, match="either fn, or inputs and kernel"):
        N.Compute(leaf, N.full_box((4, 6)), dest, fn=lambda io: dest, kernel=N.Kernel(lambda dest: None, "k", ((0, 1), (0, 1))))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["fp8-float32-128x128", "fp8-float32-16x32", "fp8-ue8m0-16x32", "mxfp4", "mxfp4-rows"])
def test_engine_dequantises_on_the_gpu_bit_identical_to_the_cpu(tmp_path, kind):
    """The engine with CUDA destinations (staging pinned, every copy and kernel queued by the
    device lane) gives the bits of the eager CPU reference, with buffers small enough to slice
    inputs, and one landing buffer on the device (each copy into it waits for the last kernel)."""
    from sdadapt._engine import CountingIO, EngineConfig, IOEngine, Job

    node, path = _node_of(kind, tmp_path)
    rng = random.Random(kind)
    with open_source(path) as src:
        full = node.full(CountingIO(src))
        boxes = _boxes(node.shape, rng, 20, getattr(node, "block", None))
        configs = (
            EngineConfig(threads=4),
            EngineConfig(threads=2, chunk_bytes=4096, depth=1),
            EngineConfig(threads=4, chunk_bytes=4096, band_bytes=16384),  # gathers of several pieces
            EngineConfig(threads=3, band_bytes=4096, band_depth=2, gather_inputs=False),  # small bands, two buffers per thread
            EngineConfig(threads=4, band_bytes=4096, landing_buffers=1, gather_inputs=False),
        )
        for cfg in configs:
            jobs = [Job("w", node, box, torch.full(N.box_shape(box), float("nan"), dtype=torch.bfloat16, device="cuda")) for box in boxes]
            stats = IOEngine(src, cfg).run(jobs)
            assert stats.computed + stats.gathered >= len(jobs)
            if kind != "mxfp4-rows" and cfg.gather_inputs:
                assert stats.gathered > 0
            for job in jobs:
                assert torch.equal(_bits(job.dest.cpu()), _bits(full[tuple(slice(a, b) for a, b in job.box)])), job.box


@pytest.mark.parametrize("kind", ["fp8-float32-16x32", "fp8-ue8m0-7x9", "mxfp4"])
def test_bands_tile_the_region_on_block_rows(tmp_path, kind):
    """A dequantisation region cut into bands: disjoint, covering it, never cut along the last
    dim, FP8 row cuts on whole scale blocks, and each band within the budget unless it cannot
    be cut further (one index of every dim but the last; for FP8 rows, one block)."""
    node, _ = _node_of(kind, tmp_path)
    per_value = 0.5 if kind == "mxfp4" else 1
    b0 = getattr(node, "block", (1, 1))[0]
    rng = random.Random(kind)
    for box in _boxes(node.shape, rng, 40):
        for max_bytes in (1, 16, 100, 700, 1 << 20):
            bands = _bands(node, box, max_bytes)
            cover = torch.zeros(N.box_shape(box), dtype=torch.int32)
            for band in bands:
                assert band[-1] == box[-1]
                cover[tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(band, box, strict=True))] += 1
                size = per_value
                for a, b in band:
                    size *= b - a
                if kind != "mxfp4":
                    r0, r1 = band[-2]
                    assert r0 == box[-2][0] or r0 % b0 == 0, (box, band)
                    atomic = all(b - a == 1 for a, b in band[:-2]) and r1 - r0 <= b0
                else:
                    atomic = all(b - a == 1 for a, b in band[:-1])
                assert size <= max_bytes or atomic, (box, max_bytes, band)
            assert bool((cover == 1).all()), (box, max_bytes)


@pytest.mark.parametrize("chunk, min_span", [(4096, 64 * 1024), (4096, 1), (1 << 20, 1)])
def test_engine_computes_bands_from_staged_reads_with_exact_bytes(tmp_path, chunk, min_span):
    """On CPU destinations, the engine cuts each region into bands of at most a chunk of weight
    bytes, reads a band's weight with ``preadv`` into staging where its runs are long enough,
    and gives the bits of the eager reference, reading exactly the bands' weight bytes plus the
    scale tiles each band touches."""
    from sdadapt._engine import CountingIO, EngineConfig, IOEngine, Job
    from sdadapt._engine.geometry import box_spans

    node, path = _fp8_node(tmp_path, "float32", (16, 32))
    b0, b1 = node.block
    cfg = EngineConfig(threads=2, chunk_bytes=chunk, min_span_bytes=min_span, band_bytes=chunk)
    rng = random.Random(chunk + min_span)
    with open_source(path) as src:
        full = node.full(CountingIO(src))
        boxes = _boxes(node.shape, rng, 20, node.block)
        jobs = [Job("w", node, box, torch.full(N.box_shape(box), float("nan"), dtype=torch.bfloat16)) for box in boxes]
        want_bytes = want_staged = tasks = 0
        for box in boxes:
            for band in _bands(node, box, cfg.band_bytes):
                tasks += 1
                n = 1
                for a, b in band:
                    n *= b - a
                (r0, r1), (c0, c1) = band[-2:]
                tiles = (Q.cdiv(r1, b0) - r0 // b0) * (Q.cdiv(c1, b1) - c0 // b1)
                scale_bytes = 4 * tiles * (band[0][1] - band[0][0])
                want_bytes += n + scale_bytes
                scale_box = band[:1] + ((r0 // b0, Q.cdiv(r1, b0)), (c0 // b1, Q.cdiv(c1, b1)))
                # the weight, then the scale tiles, go one after the other into one buffer while
                # they fit (each input on a multiple of 64 bytes), where their runs are long enough
                pos = 0
                for box_, shape, size, nbytes in ((band, node.shape, 1, n), (scale_box, node.scale.shape, 4, scale_bytes)):
                    starts, run = box_spans(shape, size, box_)
                    start = -(-pos // 64) * 64
                    if start + nbytes <= cfg.band_buffer_bytes() and (len(starts) == 1 or run >= min_span):
                        want_staged += nbytes
                        pos = start + nbytes
        stats = IOEngine(src, cfg).run(jobs)
        for job in jobs:
            assert torch.equal(_bits(job.dest), _bits(full[tuple(slice(a, b) for a, b in job.box)])), job.box
        assert stats.tasks == tasks
        assert tasks > len(jobs) if chunk == 4096 else tasks == len(jobs)  # banded only when over a chunk
        assert stats.bytes_read == want_bytes
        assert stats.staged_bytes == want_staged
        if min_span == 1:
            assert stats.staged_bytes > stats.bytes_read // 2  # every band's weight


@pytest.mark.parametrize("chunk, min_span", [(4096, 1), (4096, 64 * 1024), (1 << 20, 1)])
@pytest.mark.parametrize("kind", ["fp8-float32-16x32", "fp8-ue8m0-7x9", "mxfp4", "mxfp4-rows"])
def test_gathered_inputs_give_the_reference_bits_reading_each_byte_once(tmp_path, kind, chunk, min_span):
    """With a device lane (on the CPU here, as a GPU run has one), a computation whose inputs
    are stored regions read as they are is planned as a gather: its inputs read in staged reads
    of at most a chunk from the shared staging pool, delivered into one buffer on the device,
    the kernel run there after the last piece. The bits are the reference's, the bytes read
    those of the band path exactly, all of them staged, and no band is computed by a reader;
    inputs in runs shorter than ``min_span`` (a column slice) or gathered on the host
    (alternating rows, unless a band's rows are one stored group) are computed the band way."""
    from sdadapt._engine import CountingIO, EngineConfig, IOEngine, Job
    from sdadapt._engine.geometry import box_spans

    node, path = _node_of(kind, tmp_path)
    rng = random.Random(f"{kind}{chunk}{min_span}")
    with open_source(path) as src:
        full = node.full(CountingIO(src))
        boxes = _boxes(node.shape, rng, 20, getattr(node, "block", None))
        stats = {}
        for gather in (True, False):
            sizes = {"chunk_bytes": chunk, "band_bytes": chunk, "gather_bytes": 4 * chunk}
            cfg = EngineConfig(threads=3, min_span_bytes=min_span, gather_inputs=gather, **sizes)
            jobs = [Job("w", node, box, torch.full(N.box_shape(box), float("nan"), dtype=torch.bfloat16)) for box in boxes]
            stats[gather] = IOEngine(src, cfg, cpu_lane=True).run(jobs)
            for job in jobs:
                assert torch.equal(_bits(job.dest), _bits(full[tuple(slice(a, b) for a, b in job.box)])), (gather, job.box)
        bands = [band for box in boxes for band in _bands(node, box, 4 * chunk)]
        want = 0
        for band in bands:  # gathered where the inputs are stored regions, in one run or runs of at least min_span
            (step,) = node.steps(band, torch.empty(N.box_shape(band), dtype=torch.bfloat16))
            reads = [i.read for i in step.inputs]
            if not all(reads):  # an input computed on the host (alternating rows gathered)
                continue
            long_runs = []
            for key, box in ((r.key, r.box) for r in reads if r is not None):
                starts, run = box_spans(src.schema[key].shape, src.schema[key].dtype.itemsize, box)
                long_runs.append(len(starts) == 1 or run >= min_span)
            want += all(long_runs)
        g, b = stats[True], stats[False]
        assert g.gathered == want
        assert b.gathered == 0 and b.computed >= len(bands)
        assert g.bytes_read == b.bytes_read
        if g.gathered == len(bands):
            assert g.computed == 0 and g.staged_bytes == g.bytes_read
        if kind != "mxfp4-rows" and min_span == 1:
            assert g.gathered == len(bands) > 0
        if kind == "mxfp4-rows":
            assert 0 < g.gathered < len(bands)  # where a band's rows are one stored group, it is read as stored


def test_a_gathers_staged_reads_cover_each_input_once_in_pieces_of_at_most_a_chunk():
    """``_gather_reads`` cuts a gather's inputs (runs in one or two files) into staged reads of
    at most a chunk, consecutive runs of one file sharing a read; read one after the other
    into a buffer, each delivery's bytes land at its input's place, every byte once."""
    from sdadapt._engine.planner import _gather_reads
    from sdadapt._engine.tasks import Gather

    rng = random.Random(11)
    dest = torch.empty(1)
    for _ in range(200):
        chunk = rng.choice([1, 7, 64, 100, 4096])
        runs, at = [], 0
        for _ in range(rng.randint(1, 3)):
            file = rng.choice(["a", "b"])
            spans, off = [], rng.randrange(1000)
            for _ in range(rng.randint(1, 4)):
                n = rng.randint(1, 300)
                spans.append((off, n))
                off += n + rng.randrange(50)
            at = -(-at // 64) * 64
            runs.append((file, spans, at))
            at += sum(n for _, n in spans)
        gather = Gather(N.Compute(N.Leaf("w", (1,), torch.float32), ((0, 1),), dest, fn=lambda io: dest), at, [])
        reads = _gather_reads(gather, runs, chunk, Where("w", None, None, ((0, 1),)))
        placed: dict[int, tuple[str, int]] = {}  # buffer byte -> (file, file offset)
        for read in reads:
            size = sum(n for _, n in read.segments)
            assert 0 < size <= chunk
            flat = [(read.path, off + i) for off, n in read.segments for i in range(n)]  # the read's bytes in order
            covered = 0
            for dl in read.deliveries:
                assert dl.into is not None and dl.into[0] is gather and dl.offset == covered
                for i in range(dl.nbytes):
                    assert dl.into[1] + i not in placed
                    placed[dl.into[1] + i] = flat[dl.offset + i]
                covered += dl.nbytes
            assert covered == size
        want = {at + i: (file, pos) for file, spans, at in runs for i, pos in enumerate(p for off, n in spans for p in range(off, off + n))}
        assert placed == want


@pytest.mark.parametrize("fmt", ["float32", "ue8m0"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_whole_blocks_dequantise_straight_into_the_destination(fmt, dtype):
    """A region of whole blocks is dequantised into the destination in one multiplication, with
    the bits of the whole-tensor dequantisation; anything else is declined, untouched."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 48, 64, generator=g) * torch.exp2(torch.randint(-9, 9, (2, 48, 64), generator=g).float())
    w, s = Q.quantize_fp8(x, (16, 32), fmt)  # type: ignore[arg-type]
    want = Q.dequantize_fp8(w, s, (16, 32), fmt, dtype)  # type: ignore[arg-type]
    wide = torch.full((2, 48, 96), 7.0, dtype=dtype)
    permuted = torch.zeros(64, 2, 48, dtype=dtype).permute(1, 2, 0)
    for dest in (torch.empty(2, 48, 64, dtype=dtype), wide[..., 16:80], permuted):  # contiguous, column slice, strided
        assert Q.dequantize_fp8_into(dest, w, s, (16, 32), fmt)  # type: ignore[arg-type]
        assert torch.equal(_bits(dest), _bits(want))
    assert bool((wide[..., :16] == 7).all() and (wide[..., 80:] == 7).all())
    part = torch.full((2, 40, 64), 7.0, dtype=dtype)
    assert not Q.dequantize_fp8_into(part, w[:, :40], s, (16, 32), fmt)  # type: ignore[arg-type]  # 40 rows: not whole blocks
    ints = torch.zeros(2, 48, 64, dtype=torch.int32)
    assert not Q.dequantize_fp8_into(ints, w, s, (16, 32), fmt)  # type: ignore[arg-type]
    assert bool((part == 7).all() and (ints == 0).all())


def test_one_band_buffer_shared_by_three_threads_computes_everything(tmp_path):
    """Staging memory for one band buffer only: the thread that takes it computes every band
    while the others wait for it (they take it once it is given back); nothing hangs, the bits
    are the reference's."""
    from sdadapt._engine import CountingIO, EngineConfig, IOEngine, Job

    node, path = _fp8_node(tmp_path, "float32", (16, 32))
    cfg = EngineConfig(threads=3, staging_bytes=4096, chunk_bytes=4096, band_bytes=4096)
    with open_source(path) as src:
        full = node.full(CountingIO(src))
        jobs = [Job("w", node, box, torch.full(N.box_shape(box), float("nan"), dtype=torch.bfloat16))
                for box in _boxes(node.shape, random.Random(9), 10, node.block)]
        stats = IOEngine(src, cfg).run(jobs)
        assert stats.threads == 3 and stats.tasks > len(jobs)
        for job in jobs:
            assert torch.equal(_bits(job.dest), _bits(full[tuple(slice(a, b) for a, b in job.box)])), job.box


def test_staged_reads_and_computations_on_one_buffer_each_never_deadlock(tmp_path):
    """One staging buffer and one band buffer for three threads, with staged reads and
    computations alternating: a thread that waits for the band buffer has given its staging
    buffer back first, so the thread holding the band buffer can always get a staging buffer.
    (Without that, a thread holding the staging buffer and waiting for the band buffer, and
    one holding the band buffer and waiting for the staging buffer, hang within a few runs.)
    Every run finishes within its deadline, with the reference's bits."""

    from sdadapt._engine import EngineConfig, IOEngine, Job

    w, s = Q.quantize_fp8(torch.randn(64, 64), (16, 32), "float32")
    tensors = {"w": w, "w_scale_inv": s, **{f"p{i}": torch.randn(8, 100) for i in range(200)}}
    path = write_safetensors(tmp_path / "both.safetensors", tensors)
    scale = N.Leaf("w_scale_inv", tuple(s.shape), s.dtype)
    node = QN.DequantizedFP8(N.Leaf("w", (64, 64), w.dtype), scale, (16, 32), "float32", torch.bfloat16)
    want = Q.dequantize_fp8(w, s, (16, 32), "float32", torch.bfloat16)
    cfg = EngineConfig(threads=3, staging_bytes=4096, chunk_bytes=4096, band_bytes=4096)
    with open_source(path) as src:
        for _ in range(5):
            jobs = []
            for i in range(200):
                rows = (16 * (i % 4), 16 * (i % 4) + 16)
                jobs.append(Job("w", node, (rows, (0, 64)), torch.full((16, 64), float("nan"), dtype=torch.bfloat16)))
                jobs.append(Job(f"p{i}", N.Leaf(f"p{i}", (8, 100), torch.float32), ((0, 8), (0, 100)), torch.full((8, 100), float("nan"))))
            done: list[object] = []
            th = threading.Thread(target=lambda: done.append(IOEngine(src, cfg).run(jobs)), daemon=True)  # noqa: B023
            th.start()
            th.join(timeout=30)
            assert done, "the engine did not finish: a deadlock between the staging and band buffers"
            for job in jobs:
                expect = want[slice(*job.box[0])] if job.key == "w" else tensors[job.key]
                assert torch.equal(_bits(job.dest), _bits(expect)), job.key


@pytest.mark.parametrize("free", [2, 1])
def test_a_threads_buffers_cycle_taking_from_the_pool_only_while_it_has_one_free(free):
    """``depth=2``: while its first buffer is out (being copied), a thread takes a second one if
    the pool has one free, and from then on cycles through the two as they are given back;
    with none free it waits for its one buffer to come back, never for the pool. ``drain``
    waits for every buffer, then returns them to the pool."""

    pool = StagingPool(free, 64, pin=False)
    bufs = Buffers(pool, 2)
    a = bufs.take()
    if free == 2:
        b = bufs.take()
        assert b.data_ptr() != a.data_ptr() and bufs.waits == 0  # the second buffer, no wait
        bufs.give_back(a)
        assert bufs.take().data_ptr() == a.data_ptr() and bufs.waits == 0
        bufs.give_back(b)
        bufs.give_back(a)
    else:
        timer = threading.Timer(0.05, bufs.give_back, (a,))  # the copy out of it finishes later
        timer.start()
        assert bufs.take().data_ptr() == a.data_ptr() and bufs.waits == 1  # none free: waited for its own
        timer.join()
        bufs.give_back(a)
    assert pool.allocated == free and len(bufs.held) == free
    bufs.drain()
    assert bufs.held == [] and pool.try_get() is not None


class _FakeCopies(DeviceLane):
    """A CPU lane whose copies "finish" only when the test says so: each queued copy gets a
    stand-in event (``query``, ``synchronize``) that passes once the test sets
    ``events[i]``, the i-th copy's ``threading.Event``."""

    def __init__(self, broken: bool = False) -> None:
        self.errors: list[BaseException] = []
        super().__init__(torch.device("cpu"), 64, self.errors.append, slots=1)
        self.events: list[threading.Event] = []
        self.waited: list[int] = []  # which events the lane blocked on
        self.broken = broken  # every check and wait raises, as on a device that failed

    def _use(self, i):
        return "stream"

    def _record(self, stream):
        lane, done, n = self, threading.Event(), len(self.events)
        self.events.append(done)

        class Recorded:
            def query(self):
                if lane.broken:
                    raise RuntimeError("device lost")
                return done.is_set()

            def synchronize(self):
                lane.waited.append(n)
                if lane.broken:
                    raise RuntimeError("device lost")
                done.wait()

        return Recorded()


def test_the_lane_hands_a_buffer_back_only_once_the_copy_out_of_it_has_finished():
    """The lane itself watches each copy's event and releases the buffer once it has passed:
    checked after every piece of work, waited for (oldest first) when no work is queued; at
    the end of the run every buffer is back. The reader never waits on the device."""
    lane = _FakeCopies()
    lane.start()
    released: list[str] = []
    staged = torch.arange(64, dtype=torch.uint8)
    where = Where("a.weight", None, None, ((0, 16),))
    dests = [torch.zeros(16, dtype=torch.uint8) for _ in range(3)]
    for i, name in enumerate("ab"):
        lane.upload(staged, [Delivery(16 * i, 16, torch.uint8, (16,), dests[i], where)], lambda n=name: released.append(n), where)
    deadline = time.monotonic() + 5
    while lane.waited != [0] and time.monotonic() < deadline:  # no work queued: it waits for the oldest copy
        time.sleep(0.001)
    assert lane.waited == [0] and released == []  # both copies queued, neither finished
    lane.events[1].set()  # the newer copy finishes first: its buffer still waits behind the older one's
    time.sleep(0.02)
    assert released == []
    lane.events[0].set()
    while len(released) < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert released == ["a", "b"]
    lane.upload(staged, [Delivery(32, 16, torch.uint8, (16,), dests[2], where)], lambda: released.append("c"), where)
    while len(lane.events) < 3 and time.monotonic() < deadline:
        time.sleep(0.001)
    lane.events[2].set()
    lane.close()
    assert released == ["a", "b", "c"]
    assert [d.tolist() for d in dests] == [staged[16 * i : 16 * i + 16].tolist() for i in range(3)]


def test_a_failed_wait_for_a_copy_fails_the_load_and_still_gives_every_buffer_back():
    """A check of a copy's event that raises (a device that failed) is reported once; every
    buffer out, and those of the work queued after it (skipped), come back all the same."""
    lane = _FakeCopies(broken=True)
    lane.start()
    released: list[int] = []
    staged = torch.arange(64, dtype=torch.uint8)
    where = Where("a.weight", None, None, ((0, 16),))
    for i in range(3):
        dest = torch.zeros(16, dtype=torch.uint8)
        lane.upload(staged, [Delivery(16 * i, 16, torch.uint8, (16,), dest, where)], lambda i=i: released.append(i), where)
    lane.close()
    assert sorted(released) == [0, 1, 2] and lane.failed
    assert len(lane.errors) == 1 and "device lost" in str(lane.errors[0])


def test_band_depth_landing_buffers_and_gathers_are_checked_and_read_from_the_environment(monkeypatch):
    from sdadapt._engine import EngineConfig

    with pytest.raises(ValueError, match="band_depth must be at least 1"):
        EngineConfig(band_depth=0)
    with pytest.raises(ValueError, match="landing_buffers must be at least 1"):
        EngineConfig(landing_buffers=0)
    monkeypatch.setenv("SDADAPT_IO_BAND_DEPTH", "2")
    monkeypatch.setenv("SDADAPT_IO_LANDING", "3")
    cfg = EngineConfig.from_env()
    assert cfg.band_depth == 2 and cfg.landing_buffers == 3
    with pytest.raises(ValueError, match="gather_bytes must be positive"):
        EngineConfig(gather_bytes=0)
    assert EngineConfig(chunk_bytes=1 << 20).gather_band() == 4 << 20  # four chunks by default
    assert EngineConfig.from_env().gather_inputs
    monkeypatch.setenv("SDADAPT_IO_GATHER", "0")
    monkeypatch.setenv("SDADAPT_IO_GATHER_MB", "8")
    cfg = EngineConfig.from_env()
    assert not cfg.gather_inputs and cfg.gather_band() == 8 << 20


def test_bands_share_the_staging_memory_out_so_that_every_thread_computes():
    """By default a band is the staging memory over the threads (4 to 32 MiB): every thread of
    a run holds a band buffer and computes; ``band_bytes`` set keeps the bound it gives."""
    from sdadapt._engine import EngineConfig

    MiB = 1 << 20
    for threads, band in ((12, 256 * MiB // 12), (4, 32 * MiB), (32, 8 * MiB), (1, 32 * MiB)):
        cfg = EngineConfig(threads=threads)
        assert cfg.band() == band and cfg.computing_threads(threads) == threads, threads
    assert EngineConfig(threads=12, staging_bytes=16 * MiB).band() == 4 * MiB  # the floor: 4 of 12 threads compute
    assert EngineConfig(threads=12, staging_bytes=16 * MiB).computing_threads(12) == 4
    fixed = EngineConfig(threads=12, band_bytes=32 * MiB)
    assert fixed.band() == 32 * MiB and fixed.computing_threads(12) == 8


@pytest.mark.parametrize("quant", ["fp8", "mxfp4"])
def test_an_expert_of_fused_experts_crosses_as_a_view_of_its_staged_read(tmp_path, monkeypatch, quant):
    """One expert of a fused 3-D expert tensor (``Select`` of the stored tensor, as Qwen3-MoE's
    and GPT-OSS's fused forms are mapped) is read into the band buffer and copied to the
    device from there, as a tensor of its own is: nothing is gathered into a host tensor and
    uploaded apart, and the values equal the whole-tensor reference."""
    g = torch.Generator().manual_seed(6)
    if quant == "fp8":
        w, s = Q.quantize_fp8(torch.randn(3, 32, 48, generator=g), (16, 16), "float32")
        keys = {"w": w, "w_scale_inv": s}
    else:
        w, s = Q.quantize_mxfp4(torch.randn(3, 8, 4 * Q.MX_BLOCK, generator=g))
        keys = {"w": w, "w_scale_inv": s}
    path = write_safetensors(tmp_path / "experts.safetensors", keys)
    lw, ls = N.Leaf("w", tuple(w.shape), w.dtype), N.Leaf("w_scale_inv", tuple(s.shape), s.dtype)
    uploads: list[int] = []
    with open_source(path) as src:
        worker = _worker(src, 1 << 20, 2, lane=True)
        _open_all(worker, src)
        lane = worker.shared.lane
        assert lane is not None
        real = lane.compute
        staged: list[bool] = []
        def compute(step, args, buf, used, inside, *rest):
            staged.append(buf is not None and len(inside) == len(args))
            real(step, args, buf, used, inside, *rest)

        monkeypatch.setattr(lane, "compute", compute)
        upload = lane.upload
        monkeypatch.setattr(lane, "upload", lambda *a: (uploads.append(1), upload(*a)))
        results = []
        for e in range(3):
            if quant == "fp8":
                node: N.Node = QN.DequantizedFP8(MV.Selected(lw, 0, e), MV.Selected(ls, 0, e), (16, 16), "float32", torch.bfloat16)
            else:
                node = QN.DequantizedMXFP4(MV.Selected(lw, 0, e), MV.Selected(ls, 0, e), torch.bfloat16)
            moved = torch.full(node.shape, float("nan"), dtype=torch.bfloat16)
            (step,) = node.steps(N.full_box(node.shape), moved)
            _on_lane(worker, step)
            results.append((node.full(worker.counter), moved))
        _finish(worker)
    assert staged == [True] * 3  # read with preadv into the band buffer
    for e, (want, moved) in enumerate(results):
        assert torch.equal(_bits(moved), _bits(want)), e
    assert uploads == []  # every input crossed in the band buffer's one copy


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e4m3fn, torch.bfloat16, torch.float32, torch.int64])
def test_typed_views_cut_a_buffer_as_any_dtype(dtype):
    """``TypedViews.cut`` gives the bytes at an offset of a buffer as a contiguous tensor of
    the dtype and shape asked for, the same memory as the two-view way, from a buffer that
    does not start its storage."""
    views = TypedViews()
    storage = torch.arange(1024 + 8, dtype=torch.int64).view(torch.uint8)
    for start in (0, 8):
        buf = storage[start : start + 4096]
        for at, shape in ((0, (4, 8)), (64, (2, 3, 5)), (128, (7,)), (256, ())):
            got = views.cut(buf, at, dtype, shape)
            nbytes = dtype.itemsize * math.prod(shape)
            want = buf[at : at + nbytes].view(dtype).view(shape)
            assert got.shape == want.shape and got.is_contiguous()
            assert got.data_ptr() == want.data_ptr()
            assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))


def test_typed_views_head_is_the_first_bytes_made_once_per_buffer_and_length():
    views = TypedViews()
    a, b = torch.arange(64, dtype=torch.uint8), torch.arange(64, dtype=torch.uint8)
    first = views.head(a, 16)
    assert torch.equal(first, a[:16]) and first.data_ptr() == a.data_ptr()
    assert views.head(a, 16) is first  # the same view again, no new tensor
    assert views.head(a, 8) is not first and views.head(a, 8).numel() == 8  # another length
    assert views.head(b, 16) is not first and views.head(b, 16).data_ptr() == b.data_ptr()  # another buffer


_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_CUDA)])
def test_a_failing_kernel_is_reported_by_key_and_every_buffer_still_comes_back(device):
    """The lane runs what it is given in order; a kernel that raises is reported once, as a
    load error naming its target key, and the lane skips the rest; every buffer handed to it
    is released all the same (its reader would wait for it otherwise), including those of the
    work it skipped."""
    dev = torch.device(device)
    errors: list[BaseException] = []
    lane = DeviceLane(dev, 1024, errors.append, slots=1)
    lane.start()
    released: list[str] = []

    def back(name):
        return lambda: released.append(name)

    staged = torch.arange(256, dtype=torch.uint8)
    leaf = N.Leaf("x", (16,), torch.uint8)
    good = torch.zeros(16, dtype=torch.uint8, device=dev)

    def kernel(dest, x):
        dest.copy_(x)

    def broken(dest, x):
        raise RuntimeError("kernel exploded")

    def step(fn, dest):
        return N.Compute(leaf, ((0, 16),), dest, kernel=N.Kernel(fn, "test", ((0, 16),)))

    box = ((0, 16),)
    where_a, where_b = Where("a.weight", None, None, box), Where("b.weight", None, None, box)
    lane.compute(step(kernel, good), (staged[:16],), staged, 16, {0: 0}, back("good"), where_a)
    bad = torch.zeros(16, dtype=torch.uint8, device=dev)
    lane.compute(step(broken, bad), (staged[16:32],), staged, 32, {0: 16}, back("bad"), where_b)
    after = torch.zeros(16, dtype=torch.uint8, device=dev)
    where = Where("c.weight", "c", None, ((0, 16),))
    lane.upload(staged, [Delivery(0, 16, torch.uint8, (16,), after, where)], back("upload"), where)
    lane.close()
    assert sorted(released) == ["bad", "good", "upload"]
    assert len(errors) == 1 and "b.weight" in str(errors[0]) and "kernel exploded" in str(errors[0])
    assert torch.equal(good.cpu(), staged[:16]) and bool((after == 0).all())  # the upload after the failure was skipped


def test_warm_up_runs_each_kind_of_kernel_once_on_a_small_zero_input(tmp_path, monkeypatch):
    """``device_work`` keeps the first computing node of each recipe, one per kind
    (``Kernel.kind``: the node type, dtypes and scale format), skipping recipes that compute
    nothing; ``warm_kernels`` runs each one's kernel once on a region of at most one block,
    without reading the checkpoint."""
    from sdadapt._engine import device_work, warm_kernels

    def device_kernels(recipes: list[N.Node]) -> list[N.Node]:
        return device_work({str(i): r for i, r in enumerate(recipes)}, {}, gather=True)[0]

    fp8_a, _ = _fp8_node(tmp_path, "float32", (16, 32))
    fp8_b, _ = _fp8_node(tmp_path, "float32", (7, 9))  # same kernels, other block: not warmed again
    ue8m0, _ = _fp8_node(tmp_path, "ue8m0", (16, 32))
    mx, _ = _mxfp4_node(tmp_path)
    stacked = MV.Stacked((fp8_b, fp8_b), 0)
    seen: list[tuple[str, tuple[int, ...]]] = []
    for cls in (QN.DequantizedFP8, QN.DequantizedMXFP4):
        real = cls._kernel

        def kernel(self, box, dest, *args, _real=real):
            seen.append((type(self).__name__, tuple(dest.shape)))
            _real(self, box, dest, *args)

        monkeypatch.setattr(cls, "_kernel", kernel)
    recipes = [N.Leaf("n", (4,), torch.bfloat16), fp8_a, stacked, ue8m0, mx]
    def kind(node: N.Node) -> object:
        step = device_step(node)
        assert step is not None and step.kernel is not None
        return step.kernel.kind

    assert kind(fp8_a) == kind(fp8_b) != kind(ue8m0)
    step = device_step(stacked)
    assert step is not None and step.node is fp8_b and device_step(N.Leaf("n", (4,), torch.bfloat16)) is None
    kernels = device_kernels(recipes)
    assert kernels == [fp8_a, ue8m0, mx] and device_kernels(recipes[:1]) == []
    th = warm_kernels(torch.device("cpu"), kernels)
    assert th is not None
    th.join(timeout=30)
    assert seen == [("DequantizedFP8", (1, 16, 32)), ("DequantizedFP8", (1, 16, 32)), ("DequantizedMXFP4", (1, 1, 32))]
    assert warm_kernels(torch.device("cpu"), []) is None
