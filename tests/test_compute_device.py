"""Computations that run on the destination's device (dequantisation after the host-to-device
copy), exercised on CPU: the engine worker's device path (raw inputs read on the host, copied
through its staging buffers to ``dest.device``, kernel run there) with the CPU as the "device"
gives the same bits as the host path and as the eager whole-tensor reference. Where CUDA is
available, the engine itself is run with GPU destinations against the same reference."""

from __future__ import annotations

import queue
import random

import pytest
import torch
from checkpoints import write_safetensors

import sdadapt._nodes as N
from sdadapt import _quant as Q
from sdadapt import _quant_nodes as QN
from sdadapt._engine.staging import StagingPool
from sdadapt._engine.workers import Shared, Worker
from sdadapt.sources import open_source


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _worker(src, chunk: int, depth: int) -> Worker:
    """A CPU worker whose staging buffers hold ``chunk`` bytes (inputs larger than that are
    copied without staging), ``depth`` of them per thread."""
    shared = Shared(src, queue.SimpleQueue(), {}, StagingPool(4, chunk, pin=False), chunk, None)
    return Worker(shared, depth)


def _boxes(shape: tuple[int, ...], rng: random.Random, n: int) -> list[N.Box]:
    out = [N.full_box(shape), tuple((0, 1) for _ in shape), tuple((s - 1, s) for s in shape)]
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
    node = QN.DequantFP8(N.Leaf("w", tuple(w.shape), w.dtype), N.Leaf("w_scale_inv", tuple(s.shape), s.dtype),
                         block, fmt, torch.bfloat16)  # type: ignore[arg-type]
    return node, path


def _mxfp4_node(tmp_path):
    blocks, scales = Q.quantize_mxfp4(torch.randn(2, 5, 4 * Q.MX_BLOCK, generator=torch.Generator().manual_seed(4)))
    path = write_safetensors(tmp_path / "mx.safetensors", {"e_blocks": blocks, "e_scales": scales})
    node = QN.DequantMXFP4(N.Leaf("e_blocks", tuple(blocks.shape), blocks.dtype),
                           N.Leaf("e_scales", tuple(scales.shape), scales.dtype), torch.bfloat16)
    return node, path


@pytest.mark.parametrize("chunk, depth", [(1 << 20, 2), (512, 1)])  # all staged; large inputs unstaged, one buffer
@pytest.mark.parametrize("kind", ["fp8-float32-16x32", "fp8-ue8m0-7x9", "mxfp4"])
def test_device_path_equals_host_path_and_full(tmp_path, kind, chunk, depth):
    if kind == "mxfp4":
        node, path = _mxfp4_node(tmp_path)
    else:
        _, fmt, blk = kind.split("-")
        b0, b1 = blk.split("x")
        node, path = _fp8_node(tmp_path, fmt, (int(b0), int(b1)))
    rng = random.Random(kind)
    with open_source(path) as src:
        worker = _worker(src, chunk, depth)
        full = node.full(worker.counter)
        for box in _boxes(node.shape, rng, 15):
            want = full[tuple(slice(a, b) for a, b in box)]
            host = torch.full(N.box_shape(box), float("nan"), dtype=torch.bfloat16)
            moved = torch.full(N.box_shape(box), float("nan"), dtype=torch.bfloat16)
            host_steps, moved_steps = node.steps(box, host), node.steps(box, moved)
            assert [type(s) for s in moved_steps] == [N.Compute] and all(s.on_device for s in moved_steps)
            for step in host_steps:
                step.run(worker.counter)
            for step in moved_steps:
                assert isinstance(step, N.Compute)
                step.run(worker.counter, worker.to_device)
            assert torch.equal(_bits(host), _bits(want)), box
            assert torch.equal(_bits(moved), _bits(want)), box
        assert worker.shared.pool.allocated <= depth  # the inputs went through this thread's ring only


def test_to_device_stages_in_slices_that_fit_and_copies_the_rest(tmp_path, monkeypatch):
    path = write_safetensors(tmp_path / "t.safetensors", {"t": torch.arange(12.0)})
    with open_source(path) as src:
        worker = _worker(src, 64, 1)
        staged: list[int] = []
        copied = worker._copied
        monkeypatch.setattr(worker, "_copied", lambda: (staged.append(1), copied()))
        cases = [
            (torch.arange(10, dtype=torch.int32)[::2], 1),  # 20 bytes, not contiguous: one staged copy
            (torch.randn(40, 3)[:, 1], 3),  # 160 bytes: staged in slices of 16 entries
            (torch.randn(5, 7, 3).transpose(0, 1), 7),  # 7 rows of 60 bytes: one row per slice
            (torch.randn(2, 20), 0),  # a row of 80 bytes fits no buffer: copied directly
        ]
        for value, copies in cases:
            staged.clear()
            out = worker.to_device(value, torch.device("cpu"))
            assert torch.equal(out, value) and out.data_ptr() != value.data_ptr()
            assert len(staged) == copies, (value.shape, staged)
        assert worker.shared.pool.allocated == 1


def test_only_computations_given_as_inputs_and_kernel_say_they_run_on_device():
    leaf = N.Leaf("a", (4, 6), torch.float32)
    dest = torch.empty(4, 6, dtype=torch.int32)
    cast = N.Cast(leaf, torch.float16).steps(N.full_box((4, 6)), dest)
    perm = N.UnitPermute(leaf, 0, 2, (1, 0)).steps(N.full_box((4, 6)), dest)
    assert [s.on_device for s in cast + perm if isinstance(s, N.Compute)] == [False, False]
    with pytest.raises(ValueError, match="either fn, or inputs and kernel"):
        N.Compute(leaf, N.full_box((4, 6)), dest)
    with pytest.raises(ValueError, match="either fn, or inputs and kernel"):
        N.Compute(leaf, N.full_box((4, 6)), dest, fn=lambda io: dest, inputs=lambda io: (), kernel=lambda: dest)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["fp8-float32-128x128", "fp8-ue8m0-16x32", "mxfp4"])
def test_engine_dequantises_on_the_gpu_bit_identical_to_the_cpu(tmp_path, kind):
    """The engine with CUDA destinations (staging pinned, per-thread streams, the kernel on the
    GPU) gives the bits of the eager CPU reference, with buffers small enough to slice inputs."""
    from sdadapt._engine import CountingIO, EngineConfig, IOEngine, Job

    if kind == "mxfp4":
        node, path = _mxfp4_node(tmp_path)
    else:
        _, fmt, blk = kind.split("-")
        b0, b1 = blk.split("x")
        node, path = _fp8_node(tmp_path, fmt, (int(b0), int(b1)))
    rng = random.Random(kind)
    with open_source(path) as src:
        full = node.full(CountingIO(src))
        boxes = _boxes(node.shape, rng, 20)
        for cfg in (EngineConfig(threads=4), EngineConfig(threads=2, chunk_bytes=4096, depth=1)):
            jobs = [Job("w", node, box, torch.full(N.box_shape(box), float("nan"), dtype=torch.bfloat16, device="cuda"))
                    for box in boxes]
            stats = IOEngine(src, cfg).run(jobs)
            assert stats.computed >= len(jobs)
            for job in jobs:
                assert torch.equal(_bits(job.dest.cpu()), _bits(full[tuple(slice(a, b) for a, b in job.box)])), job.box
