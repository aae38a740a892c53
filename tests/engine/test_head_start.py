"""The head start (``EngineConfig.head_bytes``, sdadapt._engine.head): a one-rank
GPU load has kvikio read its first plain reads into pinned host memory while the model is
materialised, and its run copies them from there.

On CPU (CI) the engine runs on the CPU lane with a host stand-in for kvikio
(:mod:`support.kvikio_host`): bit-exact against the file, the tensors read ahead are not read
again, a failed read ahead leaves the run to read them itself, the buffer is kept for the next
load (pinned in the background where none is kept), and an untaken head start is closed. Where
CUDA and kvikio are installed, the same run into GPU destinations through the real kvikio."""

from __future__ import annotations

import importlib.util
import time

import pytest
import torch
from support.checkpoints import write_safetensors
from support.kvikio_host import HostCuFile

from sdadapt._engine import EngineConfig, IOEngine, Job, devread
from sdadapt._engine import head as H
from sdadapt._engine.pinned import Slab, SlabCache, register_slab
from sdadapt._recipes import nodes as N
from sdadapt.sources import open_source

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    devread.forget()
    monkeypatch.setattr(HostCuFile, "short", set())
    monkeypatch.setattr(HostCuFile, "offsets", [])
    yield
    devread.forget()
    assert not H._HEADS and HostCuFile.reading == 0  # every head start closed, every read ended


def _checkpoint(tmp_path):
    g = torch.Generator().manual_seed(5)
    sd = {
        "a": torch.randn(64, 256, generator=g).to(torch.bfloat16),  # 32 KiB
        "b": torch.randn(256, 256, generator=g),  # 256 KiB
        "c": torch.randn(128, 512, generator=g).to(torch.bfloat16),  # 128 KiB
        "d": torch.randn(1000, generator=g).to(torch.bfloat16),
    }
    path = write_safetensors(tmp_path / "m.safetensors", sd)
    leaves = {k: N.Leaf(k, tuple(t.shape), t.dtype) for k, t in sd.items()}
    # plan order: a computed recipe first (never read ahead), then the plain reads
    recipes = {"c32": N.Converted(leaves["c"], torch.float32), **leaves}
    return path, sd, recipes


def _host_kvikio(monkeypatch):
    reads = devread.DeviceReads(type("kvikio", (), {"CuFile": HostCuFile}), 3, 4096, False)
    monkeypatch.setattr(devread, "select", lambda device, *a: reads if device is not None else None)


def _slabs(nbytes: int) -> SlabCache:
    cache = SlabCache(allocate=lambda n: Slab(torch.empty(n, dtype=torch.uint8)), keep=1)
    cache.put(Slab(torch.empty(nbytes, dtype=torch.uint8)))
    return cache


def _jobs(sd, recipes, device):
    """Whole tensors and an FSDP row shard of each 2-d one, into NaN-filled destinations."""
    out = []
    for key, t in sd.items():
        boxes = [tuple((0, n) for n in t.shape)] + ([((t.shape[0] // 4, t.shape[0] // 2), (0, t.shape[1]))] if t.dim() == 2 else [])
        for box in boxes:
            dest = torch.full(N.box_shape(box), float("nan"), dtype=t.dtype, device=device)
            out.append((Job(key, recipes[key], box, dest), t[tuple(slice(a, b) for a, b in box)]))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8)


def _cfg(**kw) -> EngineConfig:
    return EngineConfig(threads=2, direct_min_bytes=4096, chunk_bytes=64 << 10, **kw)


def test_plain_reads_are_whole_stored_tensors_in_plan_order_within_the_budget(tmp_path):
    path, sd, recipes = _checkpoint(tmp_path)
    with open_source(path) as src:
        pieces = H.plain_reads(src, recipes, (32 + 128) << 10)
        loc = {k: src.locate(k) for k in sd}
    # "c32" computes (skipped); "b" (256 KiB) does not fit after "a"; "c" and "d" do
    assert [(p.offset, p.nbytes) for p in pieces] == [(loc[k].offset, sd[k].numel() * sd[k].element_size()) for k in ("a", "c")]
    assert [p.at for p in pieces] == [0, 32 << 10] and all(p.path == path for p in pieces)
    with open_source(path) as src:
        assert H.plain_reads(src, recipes, 0) == []


def test_a_run_copies_what_the_head_start_read_and_reads_only_the_rest(tmp_path, monkeypatch):
    """Bit-exact; every piece of a tensor read ahead (whole, or an FSDP row shard of it) is
    copied from the buffer, none of it read again; the buffer goes back to its cache."""
    _host_kvikio(monkeypatch)
    path, sd, recipes = _checkpoint(tmp_path)
    cfg = _cfg(head_bytes=(32 + 128) << 10)
    slabs = _slabs(1 << 20)
    with open_source(path) as src:
        head = H.begin_head(CPU, src, recipes, cfg, slabs)
        assert head is not None and H.take_head(CPU) is head
        H._HEADS[CPU] = head  # for the run
        pairs = _jobs(sd, recipes, "cpu")
        stats = IOEngine(src, cfg, cpu_lane=True).run([j for j, _ in pairs])
    for job, want in pairs:
        assert torch.equal(_bits(job.dest), _bits(want)), (job.key, job.box)
    ahead = sum(want.numel() * want.element_size() for job, want in pairs if job.key in ("a", "c"))
    assert stats.head_bytes == ahead == stats.kvikio_bytes
    assert stats.bytes_read == sum(want.numel() * want.element_size() for _, want in pairs)
    assert sorted(HostCuFile.offsets) == sorted((path, p.offset) for p in head.pieces)  # read once, ahead
    assert H.take_head(CPU) is None and slabs.take_kept(1 << 20) is not None


def test_a_failed_read_ahead_leaves_the_run_to_read_those_tensors(tmp_path, monkeypatch):
    _host_kvikio(monkeypatch)
    path, sd, recipes = _checkpoint(tmp_path)
    monkeypatch.setattr(HostCuFile, "short", {path})  # the head start's reads come back short
    cfg = _cfg(head_bytes=1 << 20)
    slabs = _slabs(1 << 20)
    with open_source(path) as src:
        assert H.begin_head(CPU, src, recipes, cfg, slabs) is not None
        pairs = _jobs(sd, recipes, "cpu")
        stats = IOEngine(src, cfg, cpu_lane=True).run([j for j, _ in pairs])
    for job, want in pairs:
        assert torch.equal(_bits(job.dest), _bits(want)), (job.key, job.box)
    assert stats.head_bytes == 0 and slabs.take_kept(1 << 20) is not None


def test_without_a_kept_buffer_none_starts_and_one_is_pinned_for_the_next_load(tmp_path, monkeypatch):
    _host_kvikio(monkeypatch)
    path, _, recipes = _checkpoint(tmp_path)
    cfg = _cfg(head_bytes=1 << 20)
    slabs = SlabCache(allocate=lambda n: Slab(torch.empty(n, dtype=torch.uint8)), keep=1)
    with open_source(path) as src:
        assert H.begin_head(CPU, src, recipes, cfg, slabs) is None
        deadline = time.monotonic() + 10
        while (slab := slabs.take_kept(1 << 20)) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert slab is not None and slab.nbytes >= 1 << 20
        slabs.put(slab)
        assert H.begin_head(CPU, src, recipes, cfg, slabs) is not None
        H.take_head(CPU).close()  # type: ignore[union-attr]


def test_a_head_start_no_run_took_is_closed_when_the_load_ends(tmp_path, monkeypatch):
    _host_kvikio(monkeypatch)
    path, _, recipes = _checkpoint(tmp_path)
    slabs = _slabs(1 << 20)
    monkeypatch.setattr(H, "HEAD_SLABS", slabs)
    monkeypatch.setattr(H, "wants_head", lambda *a: True)
    with open_source(path) as src:
        with pytest.raises(RuntimeError, match="materialising failed"), H.heading(CPU, src, recipes, _cfg(head_bytes=1 << 20), True):
            assert CPU in H._HEADS
            raise RuntimeError("materialising failed")
    assert not H._HEADS and slabs.take_kept(1 << 20) is not None


def test_head_bytes_setting_and_when_a_load_gets_a_head_start(tmp_path, monkeypatch):
    monkeypatch.setenv("SDADAPT_IO_HEAD_MB", "64")
    assert EngineConfig.from_env().head_bytes == 64 << 20
    monkeypatch.delenv("SDADAPT_IO_HEAD_MB")
    assert EngineConfig.from_env().head_bytes == 0  # off by default
    with pytest.raises(ValueError, match="head_bytes"):
        EngineConfig(head_bytes=-1)
    path, _, _ = _checkpoint(tmp_path)
    gpu = torch.device("cuda", 0)
    on = EngineConfig(head_bytes=1 << 20)
    with open_source(path) as src:
        devread._ASKED.add(on.kvikio_settings())  # kvikio asked for: not a process's first GPU load
        assert H.wants_head(gpu, src, on, True)
        assert not H.wants_head(gpu, src, on, False)  # several ranks
        assert not H.wants_head(CPU, src, on, True)
        assert not H.wants_head(None, src, on, True)
        assert not H.wants_head(gpu, src, EngineConfig(), True)  # head_bytes 0
        assert not H.wants_head(gpu, src, EngineConfig(head_bytes=1 << 20, kvikio=False), True)
        devread.forget()
        assert not H.wants_head(gpu, src, on, True)  # the first GPU load reads without kvikio


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the head start copies into GPU memory: needs a CUDA device")
@pytest.mark.skipif(
    importlib.util.find_spec("kvikio") is None,
    reason="the head start reads through kvikio: needs kvikio (pip install 'sdadapt[cuda]')",
)
def test_gpu_run_copies_the_head_start_through_kvikio_bit_exact(tmp_path):
    path, sd, recipes = _checkpoint(tmp_path)
    gpu = torch.device("cuda", 0)
    cfg = _cfg(head_bytes=1 << 20, kvikio=True, kvikio_threads=3, kvikio_task_bytes=64 << 10)
    slabs = SlabCache(keep=1)
    slabs.put(register_slab(1 << 20))
    with open_source(path) as src:
        assert H.begin_head(gpu, src, recipes, cfg, slabs) is not None
        pairs = _jobs(sd, recipes, "cuda")
        stats = IOEngine(src, cfg).run([j for j, _ in pairs])
    for job, want in pairs:
        assert torch.equal(_bits(job.dest), _bits(want)), (job.key, job.box)
    assert stats.head_bytes > 0 and stats.kvikio_bytes == stats.direct_bytes
    slabs.clear()


def test_reads_the_head_start_holds_wait_for_it_only_once_planned(tmp_path, monkeypatch):
    """A covered read planned before the head start's reads have ended is served after the
    plan (planning never waits for it): bit-exact, all of it from the buffer."""
    _host_kvikio(monkeypatch)
    monkeypatch.setattr(H.HeadStart, "done", lambda self: False)
    path, sd, recipes = _checkpoint(tmp_path)
    cfg = _cfg(head_bytes=1 << 20)
    with open_source(path) as src:
        assert H.begin_head(CPU, src, recipes, cfg, _slabs(1 << 20)) is not None
        pairs = _jobs(sd, recipes, "cpu")
        stats = IOEngine(src, cfg, cpu_lane=True).run([j for j, _ in pairs])
    for job, want in pairs:
        assert torch.equal(_bits(job.dest), _bits(want)), (job.key, job.box)
    assert stats.head_bytes == stats.direct_bytes == stats.bytes_read - stats.staged_bytes > 0  # "d" is small: staged


def test_after_a_first_gpu_run_the_memory_is_pinned_for_the_next_load_of_one_rank(monkeypatch):
    slabs = SlabCache(allocate=lambda n: Slab(torch.empty(n, dtype=torch.uint8)), keep=1)
    monkeypatch.setattr(H, "HEAD_SLABS", slabs)
    H.pin_later(CPU, EngineConfig())  # no head start asked for: nothing pinned
    assert not slabs._pending
    H.pin_later(CPU, EngineConfig(head_bytes=1 << 20))
    deadline = time.monotonic() + 10
    while (slab := slabs.take_kept(1 << 20)) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert slab is not None and slabs.take_kept(1) is None  # one slab, of the head start's size
