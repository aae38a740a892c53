"""GPU reads through kvikio (sdadapt._engine.devread) and the thread counts that follow the cores.

On CPU (CI): the thread counts from the CPUs this process may use and the ranks per node; the
choice between kvikio and the staged path (kvikio absent, failing to start, turned off, asked
for), with the one log line that says which; a CPU run never looks for kvikio. Only the import
is replaced there (:data:`sdadapt._engine.devread.importer`). Where CUDA is available, the
engine runs for real with GPU destinations, with kvikio where it is installed and without it:
bit-exact against the file's bytes, the contiguous pieces read by kvikio, the rest staged."""

from __future__ import annotations

import importlib.util
import logging
import os
import random

import pytest
import torch
from support.checkpoints import write_safetensors
from support.kvikio_host import HostCuFile as _CuFile

from sdadapt._base import later
from sdadapt._engine import EngineConfig, IOEngine, Job, default_threads, devread
from sdadapt._engine.config import local_ranks, process_cpus, rank_cpus
from sdadapt._recipes import moves as MV
from sdadapt._recipes import nodes as N
from sdadapt.errors import LoadError, UsageError
from sdadapt.sources import open_source

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
HAS_KVIKIO = importlib.util.find_spec("kvikio") is not None


@pytest.fixture(autouse=True)
def _fresh_choice(monkeypatch):
    """Every test chooses (and logs) anew, with the real import unless it replaces it."""
    devread.forget()
    yield
    devread.forget()


# --- thread counts -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cpus", "ranks", "threads", "pool"),
    [
        (2, 2, 1, 1),  # the 2-core VM with 2 gloo ranks: one reader per rank
        (2, 1, 2, 2),
        (2, 8, 1, 1),  # more ranks than CPUs: still one
        (16, 1, 12, 16),  # a GPU host: a quarter of the CPUs left to the rest of the process
        (16, 16, 1, 1),
        (128, 8, 12, 16),
        (256, 1, 32, 256),  # at most 32 readers
    ],
)
def test_thread_counts_follow_the_cpus_this_process_may_use_and_the_ranks_per_node(monkeypatch, cpus, ranks, threads, pool):
    monkeypatch.delenv("SDADAPT_IO_THREADS", raising=False)
    monkeypatch.delenv("SDADAPT_IO_KVIKIO_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    assert (process_cpus(), local_ranks(), rank_cpus()) == (cpus, ranks, max(1, cpus // ranks))
    assert default_threads() == threads <= max(1, cpus // ranks)
    cfg = EngineConfig.from_env()
    assert (cfg.threads, cfg.kvikio_pool()) == (threads, pool)


def test_thread_counts_use_the_affinity_not_the_machine(monkeypatch):
    """A process pinned to 3 of the machine's CPUs counts 3, whatever ``os.cpu_count`` says."""
    monkeypatch.delenv("SDADAPT_IO_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5, 6, 7}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "")
    assert (process_cpus(), local_ranks(), default_threads()) == (3, 1, 3)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not a number")
    assert local_ranks() == 1


def test_kvikio_settings_from_the_environment_and_their_checks(monkeypatch):
    monkeypatch.setenv("SDADAPT_IO_KVIKIO", "0")
    monkeypatch.setenv("SDADAPT_IO_KVIKIO_THREADS", "7")
    monkeypatch.setenv("SDADAPT_IO_KVIKIO_TASK_MB", "8")
    cfg = EngineConfig.from_env()
    assert (cfg.kvikio, cfg.kvikio_pool(), cfg.kvikio_task_bytes) == (False, 7, 8 << 20)
    monkeypatch.setenv("SDADAPT_IO_KVIKIO", "1")
    assert EngineConfig.from_env().kvikio is True
    monkeypatch.delenv("SDADAPT_IO_KVIKIO")
    assert EngineConfig.from_env().kvikio is None
    with pytest.raises(ValueError, match="kvikio_threads"):
        EngineConfig(kvikio_threads=0)
    with pytest.raises(ValueError, match="kvikio_task_bytes"):
        EngineConfig(kvikio_task_bytes=100)
    assert EngineConfig.from_env().kvikio_settings() == (7, 8 << 20, None)  # kvikio's own bounce buffers by default
    monkeypatch.setenv("SDADAPT_IO_KVIKIO_BOUNCE_MB", "1")
    assert EngineConfig.from_env().kvikio_bounce_bytes == 1 << 20
    monkeypatch.setenv("SDADAPT_IO_KVIKIO_BOUNCE_MB", "0")  # kvikio's own size
    assert EngineConfig.from_env().kvikio_bounce_bytes is None
    with pytest.raises(ValueError, match="kvikio_bounce_bytes"):
        EngineConfig(kvikio_bounce_bytes=100)


# --- the choice --------------------------------------------------------------------------------

GPU = torch.device("cuda", 0)


def _absent():
    raise ImportError("No module named 'kvikio'")


def _failing():
    raise OSError("libcufile.so.0: cannot open shared object file")


def test_without_kvikio_gpu_reads_take_the_staged_path_said_once(monkeypatch, caplog):
    monkeypatch.setattr(devread, "importer", _absent)
    with caplog.at_level(logging.INFO, logger=devread.__name__):
        assert devread.select(GPU, None, 4, 16 << 20) is None
        assert devread.select(GPU, None, 4, 16 << 20) is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "staged path" in lines[0] and "sdadapt[cuda]" in lines[0]


def test_kvikio_failing_to_start_falls_back_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(devread, "importer", _failing)
    with caplog.at_level(logging.INFO, logger=devread.__name__):
        assert devread.select(GPU, None, 4, 16 << 20) is None
    (rec,) = caplog.records
    assert rec.levelno == logging.WARNING and "failed to start" in rec.getMessage() and "libcufile" in rec.getMessage()


@pytest.mark.parametrize("importer", [_absent, _failing])
def test_asking_for_kvikio_where_it_cannot_run_is_an_error_naming_the_extra(monkeypatch, importer):
    monkeypatch.setattr(devread, "importer", importer)
    with pytest.raises(UsageError, match=r"kvikio=True.*(not installed.*sdadapt\[cuda\]|failed to start)"):
        devread.select(GPU, True, 4, 16 << 20)
    devread.forget()
    assert devread.select(GPU, None, 4, 16 << 20) is None  # the default falls back
    with pytest.raises(UsageError, match=r"sdadapt\[cuda\]"):
        devread.select(GPU, True, 4, 16 << 20)  # the kept choice, asked for again


def test_kvikio_is_never_looked_for_off_the_gpu_or_when_turned_off(monkeypatch, tmp_path):
    def looked():
        raise AssertionError("kvikio was imported")

    monkeypatch.setattr(devread, "importer", looked)
    for device in (None, torch.device("cpu")):
        assert devread.select(device, None, 4, 16 << 20) is None
        assert devread.select(device, True, 4, 16 << 20) is None
    assert devread.select(GPU, False, 4, 16 << 20) is None
    # a CPU run, large contiguous pieces included, never chooses
    w = torch.randn(512, 256)
    path = write_safetensors(tmp_path / "m.safetensors", {"w": w})
    with open_source(path) as src:
        dest = torch.empty(512, 256)
        job = Job("w", N.Leaf("w", (512, 256), torch.float32), ((0, 512), (0, 256)), dest)
        stats = IOEngine(src, EngineConfig(threads=2, kvikio=True)).run([job])
    assert torch.equal(dest, w) and stats.direct_bytes == w.numel() * 4 and stats.kvikio_bytes == 0


# --- the real path, on a GPU --------------------------------------------------------------------


def _checkpoint(tmp_path):
    """A file with large tensors (read directly) and small ones (staged), in bf16 and fp32."""
    g = torch.Generator().manual_seed(0)
    sd = {
        "big": torch.randn(1024, 640, generator=g).to(torch.bfloat16),  # 1.25 MiB
        "wide": torch.randn(96, 4096, generator=g),  # 1.5 MiB float32
        "norm": torch.randn(640, generator=g).to(torch.bfloat16),  # small: staged
        "odd": torch.randn(333, 777, generator=g).to(torch.bfloat16),  # rows of an odd length
    }
    return write_safetensors(tmp_path / "m.safetensors", sd), sd


def _jobs(sd, rng: random.Random, device: str) -> list[tuple[Job, torch.Tensor]]:
    """Whole tensors, row ranges (an FSDP shard), column slices, a cast and a concatenation,
    each into a NaN-filled destination on ``device``; with the expected value."""
    out = []
    for key, t in sd.items():
        leaf = N.Leaf(key, tuple(t.shape), t.dtype)
        boxes = [tuple((0, n) for n in t.shape)]
        if t.dim() == 2:
            a = rng.randrange(0, t.shape[0] // 2)
            boxes.append(((a, rng.randrange(a + 1, t.shape[0] + 1)), (0, t.shape[1])))
            c = rng.randrange(0, t.shape[1] // 2)
            boxes.append(((0, t.shape[0]), (c, c + 3)))
        for box in boxes:
            dest = torch.full(N.box_shape(box), float("nan"), dtype=t.dtype, device=device)
            out.append((Job(key, leaf, box, dest), t[tuple(slice(a, b) for a, b in box)]))
    big = N.Leaf("big", tuple(sd["big"].shape), torch.bfloat16)
    cast = N.Converted(big, torch.float32)
    out.append((Job("big32", cast, ((0, 1024), (0, 640)), torch.empty(1024, 640, device=device)), sd["big"].float()))
    cat = MV.Concatenated((big, big), 0)
    out.append((Job("cat", cat, ((512, 1536), (0, 640)), torch.empty(1024, 640, dtype=torch.bfloat16, device=device)),
                torch.cat([sd["big"], sd["big"]])[512:1536]))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8)


@CUDA
@pytest.mark.parametrize("kvikio", [None, False])
def test_gpu_run_is_bit_exact_with_kvikio_and_without(tmp_path, kvikio):
    """With kvikio installed (and not turned off), the contiguous pieces are read by it straight
    into their destinations (``kvikio_bytes``) and the rest staged; without it, everything is
    staged. Both give the file's bits, with large and small reads per task."""
    path, sd = _checkpoint(tmp_path)
    rng = random.Random(str(kvikio))
    with open_source(path) as src:
        for cfg in (
            EngineConfig(threads=4, kvikio=kvikio),
            EngineConfig(threads=2, kvikio=kvikio, kvikio_task_bytes=4096, kvikio_threads=3, direct_min_bytes=4096),
        ):
            # the process's first run with these settings reads without kvikio and queues its
            # start (begun when the public call returns); the second waits for that start and
            # reads through it
            for run in (1, 2):
                pairs = _jobs(sd, rng, "cuda")
                first = devread.deferred(cfg.kvikio, *cfg.kvikio_settings())
                mark = later.enter()  # as inside a public call, which starts what it queued as it ends
                stats = IOEngine(src, cfg).run([j for j, _ in pairs])
                queued, still = later.queued(), devread.deferred(cfg.kvikio, *cfg.kvikio_settings())
                later.leave(mark)
                for job, want in pairs:
                    assert torch.equal(_bits(job.dest), _bits(want)), (run, job.key, job.box)
                if kvikio is None and HAS_KVIKIO and run == 2:
                    assert stats.kvikio_bytes > 0 and stats.staged_bytes > 0
                    assert stats.kvikio_bytes == stats.direct_bytes
                else:
                    assert stats.kvikio_bytes == 0 == stats.direct_bytes
                assert first is (kvikio is None and run == 1)
                # kvikio's start and the head start's pinning, queued until the call ends
                assert queued == (2 if first else 0) and still is first
                assert devread.deferred(cfg.kvikio, *cfg.kvikio_settings()) is False


@CUDA
def test_gpu_run_falls_back_when_kvikio_fails_to_start(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(devread, "importer", _failing)
    path, sd = _checkpoint(tmp_path)
    with open_source(path) as src, caplog.at_level(logging.INFO, logger=devread.__name__):
        for _ in range(2):  # the first run starts kvikio afterwards; the second waits for that start
            pairs = _jobs(sd, random.Random(1), "cuda")
            stats = IOEngine(src, EngineConfig(threads=3)).run([j for j, _ in pairs])
            assert stats.kvikio_bytes == 0
            for job, want in pairs:
                assert torch.equal(_bits(job.dest), _bits(want)), (job.key, job.box)
    assert any("failed to start" in r.getMessage() for r in caplog.records)


@CUDA
@pytest.mark.skipif(not HAS_KVIKIO, reason="needs kvikio (sdadapt[cuda])")
def test_a_truncated_file_fails_the_kvikio_read_naming_the_key(tmp_path):
    """The file cut short after its header was read: kvikio's short read is an error that
    names the target key and the file, raised once every read of the run has ended."""
    path, sd = _checkpoint(tmp_path)
    with open_source(path) as src:
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.truncate(size - 4096)
        dest = torch.zeros(333, 777, dtype=torch.bfloat16, device="cuda")
        job = Job("model.odd", N.Leaf("odd", (333, 777), torch.bfloat16), ((0, 333), (0, 777)), dest)
        with pytest.raises(LoadError, match=r"key 'model.odd' \(source key 'odd' in .*m.safetensors\).*(truncated|EOF)"):
            IOEngine(src, EngineConfig(threads=2, kvikio=True)).run([job])


def test_only_the_first_run_of_default_settings_defers_kvikio(monkeypatch, tmp_path):
    """``kvikio=None``: deferred until anything asks kvikio to start with those settings
    (a run's :func:`start_later`, :func:`select`, :func:`prefetch`, :func:`warm`); asked for
    explicitly or turned off, never deferred."""
    monkeypatch.setattr(devread, "importer", _absent)
    assert devread.deferred(None, 2, 4096) and devread.deferred(None, 2, 4096, 8192)
    assert not devread.deferred(True, 2, 4096) and not devread.deferred(False, 2, 4096)
    path = write_safetensors(tmp_path / "m.safetensors", {"w": torch.zeros(8)})
    devread.start_later(GPU, [path], None, 2, 4096)
    assert not devread.deferred(None, 2, 4096)  # asked for at once, before its thread runs
    assert devread.select(GPU, None, 2, 4096) is None  # waits for that start: kvikio is absent
    assert devread.deferred(None, 2, 4096, 8192)  # other settings: their own first run
    devread.prefetch(GPU, None, 2, 4096, 8192)
    assert not devread.deferred(None, 2, 4096, 8192)
    devread.forget()
    assert devread.deferred(None, 2, 4096)
    devread.start_later(GPU, [], None, 2, 4096)  # nothing to warm on: the choice alone
    assert not devread.deferred(None, 2, 4096)


def test_warm_up_needs_a_gpu_a_file_and_kvikio_not_turned_off(monkeypatch, tmp_path):
    monkeypatch.setattr(devread, "importer", _absent)
    path = write_safetensors(tmp_path / "m.safetensors", {"w": torch.zeros(8)})
    assert devread.warm(torch.device("cpu"), [path], None, 2, 4096) is None
    assert devread.warm(GPU, [], None, 2, 4096) is None
    assert devread.warm(GPU, [str(tmp_path / "missing")], None, 2, 4096) is None
    assert devread.warm(GPU, [path], False, 2, 4096) is None
    th = devread.warm(GPU, [path], None, 2, 4096)  # kvikio absent: the thread chooses the staged path
    assert th is not None
    th.join(30)
    assert devread.select(GPU, None, 2, 4096) is None
    assert devread.warm(GPU, [path], None, 2, 4096) is None  # once per process and settings
    assert devread.warm(GPU, [path], None, 2, 4096, 8192) is not None
    monkeypatch.setenv("SDADAPT_IO_KVIKIO_WARM", "0")
    assert EngineConfig.from_env().kvikio_warm is False


@CUDA
@pytest.mark.skipif(not HAS_KVIKIO, reason="needs kvikio (sdadapt[cuda])")
def test_warm_up_reads_once_per_pool_thread_and_leaves_kvikio_chosen(tmp_path, caplog):
    path, sd = _checkpoint(tmp_path)
    with caplog.at_level(logging.DEBUG, logger=devread.__name__):
        th = devread.warm(GPU, [path], None, 3, 64 << 10)
        assert th is not None
        th.join(60)
    assert not [r for r in caplog.records if "failed" in r.getMessage()]
    assert devread.select(GPU, None, 3, 64 << 10) is not None
    with open_source(path) as src:
        pairs = _jobs(sd, random.Random(2), "cuda")
        stats = IOEngine(src, EngineConfig(threads=2, kvikio_threads=3, kvikio_task_bytes=64 << 10)).run([j for j, _ in pairs])
    assert stats.kvikio_bytes > 0
    for job, want in pairs:
        assert torch.equal(_bits(job.dest), _bits(want)), (job.key, job.box)


# --- a gather's inputs read by kvikio (a stand-in for kvikio on the CPU lane) --------------------


def _fp8_checkpoint(tmp_path):
    from sdadapt._recipes import quant as Q
    from sdadapt._recipes import quant_nodes as QN

    g = torch.Generator().manual_seed(3)
    x = torch.randn(96, 160, generator=g) * torch.exp2(torch.randint(-6, 6, (96, 160), generator=g).float())
    w, s = Q.quantize_fp8(x, (16, 32), "float32")
    path = write_safetensors(tmp_path / "fp8.safetensors", {"w": w, "w_scale_inv": s})
    leaves = N.Leaf("w", tuple(w.shape), w.dtype), N.Leaf("w_scale_inv", tuple(s.shape), s.dtype)
    node = QN.DequantizedFP8(*leaves, (16, 32), "float32", torch.bfloat16)
    return node, path


@pytest.mark.parametrize("staging", [1 << 20, 8192])  # room for every gather at once; one gather out at a time
def test_gathers_are_read_by_kvikio_into_the_device_buffer_and_computed_there(tmp_path, monkeypatch, staging):
    """A run that reads through kvikio has each gathered computation's inputs read by it
    straight into the gather's buffer on the lane's device (the CPU here, with kvikio's reads
    on the host), in one read per input run; the lane runs the kernel once they have ended.
    The bits are the eager reference's, every input byte is kvikio's and none is staged, with
    room for every gather at once or for one at a time."""
    from sdadapt._engine import CountingIO

    reads = devread.DeviceReads(type("kvikio", (), {"CuFile": _CuFile}), 3, 4096, False)
    monkeypatch.setattr(devread, "select", lambda device, *a: reads if device is not None else None)
    monkeypatch.setattr(_CuFile, "short", set())
    node, path = _fp8_checkpoint(tmp_path)
    rng = random.Random(staging)
    with open_source(path) as src:
        full = node.full(CountingIO(src))
        boxes = [N.full_box(node.shape), ((0, 16), (0, 32)), ((16, 80), (32, 160))]
        for _ in range(6):
            a, c = rng.randrange(95), rng.randrange(159)
            boxes.append(((a, rng.randrange(a + 1, 97)), (c, rng.randrange(c + 1, 161))))
        jobs = [Job("w", node, box, torch.full(N.box_shape(box), float("nan"), dtype=torch.bfloat16)) for box in boxes]
        cfg = EngineConfig(threads=2, staging_bytes=staging, chunk_bytes=4096, min_span_bytes=1, gather_bytes=4096, kvikio_gathers=True)
        stats = IOEngine(src, cfg, cpu_lane=True).run(jobs)
    for job in jobs:
        assert torch.equal(_bits(job.dest), _bits(full[tuple(slice(a, b) for a, b in job.box)])), job.box
    assert stats.gathered > len(jobs) and stats.computed == 0
    assert stats.kvikio_bytes == stats.bytes_read > 0 and stats.staged_bytes == 0 == stats.direct_bytes


def test_a_failed_gather_read_fails_the_run_naming_the_key_and_every_read_ends(tmp_path, monkeypatch):
    node, path = _fp8_checkpoint(tmp_path)
    reads = devread.DeviceReads(type("kvikio", (), {"CuFile": _CuFile}), 3, 4096, False)
    monkeypatch.setattr(devread, "select", lambda device, *a: reads if device is not None else None)
    monkeypatch.setattr(_CuFile, "short", {path})
    with open_source(path) as src:
        dest = torch.full(node.shape, float("nan"), dtype=torch.bfloat16)
        cfg = EngineConfig(threads=2, staging_bytes=8192, chunk_bytes=4096, min_span_bytes=1, gather_bytes=4096, kvikio_gathers=True)
        with pytest.raises(LoadError, match=r"key 'w'.*truncated"):
            IOEngine(src, cfg, cpu_lane=True).run([Job("w", node, N.full_box(node.shape), dest)])
    assert _CuFile.reading == 0  # every read queued had ended when the run raised


def test_gathers_stay_staged_unless_kvikio_gathers_is_asked_for(tmp_path, monkeypatch):
    """By default a run that reads through kvikio still stages its gathers' inputs (kvikio's
    gathers were measured slower): the bits are the reference's and kvikio reads none of them."""
    from sdadapt._engine import CountingIO

    reads = devread.DeviceReads(type("kvikio", (), {"CuFile": _CuFile}), 3, 4096, False)
    monkeypatch.setattr(devread, "select", lambda device, *a: reads if device is not None else None)
    monkeypatch.setattr(_CuFile, "short", set())
    node, path = _fp8_checkpoint(tmp_path)
    with open_source(path) as src:
        full = node.full(CountingIO(src))
        dest = torch.full(node.shape, float("nan"), dtype=torch.bfloat16)
        cfg = EngineConfig(threads=2, staging_bytes=1 << 20, chunk_bytes=4096, min_span_bytes=1, gather_bytes=4096)
        assert cfg.kvikio_gathers is False
        stats = IOEngine(src, cfg, cpu_lane=True).run([Job("w", node, N.full_box(node.shape), dest)])
    assert torch.equal(_bits(dest), _bits(full))
    assert stats.gathered > 0 and stats.kvikio_bytes == 0 and stats.staged_bytes == stats.bytes_read > 0
