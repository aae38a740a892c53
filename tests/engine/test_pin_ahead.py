"""Pinning the staging slab ahead of a process's first GPU load (sdadapt._engine.pin_ahead):
only where CUDA is initialised and the current device has its context, never with
``SDADAPT_IO_PIN_AHEAD=0``; the slab asked for is the one the engine's first run takes; a failure
is only logged; ``release_pinned_memory`` frees it. CUDA's state is faked (this box has none),
and slabs are plain memory from a recording allocator, as in test_pinned.py."""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import sdadapt
from sdadapt._engine import EngineConfig, engine, pinned
from sdadapt._engine.pin_ahead import ENV_VAR, pin_staging_ahead
from sdadapt._engine.pinned import HUGE_PAGE, Slab, SlabCache
from sdadapt._engine.staging import StagingPool


class _Recording:
    """An allocator of plain slabs that records each size it made, after ``go`` is set."""

    def __init__(self) -> None:
        self.made: list[int] = []
        self.go = threading.Event()
        self.go.set()

    def __call__(self, nbytes: int) -> Slab:
        assert self.go.wait(10)
        self.made.append(nbytes)
        return Slab(torch.empty(nbytes, dtype=torch.uint8))


@pytest.fixture
def gpu_process(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """CUDA initialised on device 0, which has its context; registration's device switch a no-op
    (this box has no CUDA). The switches flip what the process looks like."""
    state: dict[str, object] = {"initialised": True, "context": True}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: state["initialised"])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", lambda index: state["context"], raising=False)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.delenv(ENV_VAR, raising=False)
    return state


def test_pins_the_slab_the_first_run_takes_and_the_load_asks_for_nothing_more(gpu_process, monkeypatch):
    alloc = _Recording()
    cache = SlabCache(alloc)
    monkeypatch.setattr(engine, "SLABS", cache)
    monkeypatch.setattr(engine.devread, "deferred", lambda *a: True)  # a first load: no kvikio
    monkeypatch.setenv("SDADAPT_IO_THREADS", "12")
    cfg = EngineConfig.from_env()
    asked = pin_staging_ahead(cache)
    assert asked == StagingPool.run_slab_bytes(cfg, 12) > cfg.staging_bytes // 2
    engine.prefetch_pinned(torch.device("cuda", 0), False)  # the load, as it starts
    for threads in (12, 3):  # a run with the settings' threads, and one of a small load with fewer
        pool = StagingPool.for_run(cfg, threads, True, cache)
        first = pool.get()
        assert first.untyped_storage().nbytes() == -(-asked // HUGE_PAGE) * HUGE_PAGE  # a view of the one slab
        pool.close()
    assert alloc.made == [-(-asked // HUGE_PAGE) * HUGE_PAGE]


def test_pins_nothing_without_cuda_a_context_or_when_turned_off(gpu_process, monkeypatch):
    alloc = _Recording()
    cache = SlabCache(alloc)
    gpu_process["initialised"] = False
    assert pin_staging_ahead(cache) == 0
    gpu_process["initialised"], gpu_process["context"] = True, False  # registering would make a context
    assert pin_staging_ahead(cache) == 0
    gpu_process["context"] = True
    for off in ("0", "false", "no"):
        monkeypatch.setenv(ENV_VAR, off)
        assert pin_staging_ahead(cache) == 0
    monkeypatch.delattr(torch._C, "_cuda_hasPrimaryContext")  # a torch that cannot tell: nothing
    monkeypatch.setenv(ENV_VAR, "1")
    assert pin_staging_ahead(cache) == 0
    assert cache.take_kept(1) is None and alloc.made == []


def test_a_failure_is_only_logged(gpu_process, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG, logger="sdadapt._engine")

    def failing(nbytes: int) -> Slab:
        raise RuntimeError("no pinned memory")

    cache = SlabCache(failing)
    asked = pin_staging_ahead(cache)
    assert asked > 0
    alloc = _Recording()
    cache.allocate = alloc
    assert cache.get(asked).nbytes >= asked and len(alloc.made) == 1  # the run pins its own
    assert "prefetching" in caplog.text and "no pinned memory" in caplog.text
    monkeypatch.setenv("SDADAPT_IO_THREADS", "many")  # settings the load will refuse: nothing started here
    assert pin_staging_ahead(SlabCache(alloc)) == 0 and "not pinning staging memory ahead" in caplog.text


def test_release_pinned_memory_frees_it_also_while_it_is_being_pinned(gpu_process, monkeypatch):
    alloc = _Recording()
    alloc.go.clear()
    monkeypatch.setattr(pinned, "SLABS", SlabCache(alloc))
    monkeypatch.setattr(pinned, "HEAD_SLABS", SlabCache(alloc, keep=1))
    asked = pin_staging_ahead()  # into pinned.SLABS
    freed: list[int] = []
    releasing = threading.Thread(target=lambda: freed.append(sdadapt.release_pinned_memory()))
    releasing.start()
    releasing.join(0.2)
    assert releasing.is_alive()  # waits for the slab being pinned
    alloc.go.set()
    releasing.join(10)
    assert freed == [-(-asked // HUGE_PAGE) * HUGE_PAGE] and pinned.SLABS.take_kept(1) is None


_CPU_CHILD = """
import json, sys, threading
import torch
import sdadapt._engine.pin_ahead as ahead
before = set(sys.modules)
asked = ahead.pin_staging_ahead()
print(json.dumps({"asked": asked, "imported": sorted(set(sys.modules) - before),
                  "threads": [t.name for t in threading.enumerate()]}))
"""


def test_a_process_without_cuda_imports_and_pins_nothing():
    out = subprocess.run([sys.executable, "-c", _CPU_CHILD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"asked": 0, "imported": [], "threads": ["MainThread"]}


_GPU_CHILD = textwrap.dedent(
    """
    import contextlib, json, sys
    import torch
    torch.cuda.is_initialized = lambda: True  # what a process that has used its GPU answers
    torch.cuda.current_device = lambda: 0
    torch._C._cuda_hasPrimaryContext = lambda index: True
    torch.cuda.device = lambda device: contextlib.nullcontext()
    import sdadapt._engine.pinned as P
    seen = []
    real = P.SlabCache.prefetch
    def prefetch(self, nbytes, device):
        seen.append(["sdadapt._load.loading" in sys.modules, "sdadapt._engine.engine" in sys.modules, nbytes])
        return real(self, nbytes, device)
    P.SlabCache.prefetch = prefetch
    P.SLABS.allocate = lambda n: P.Slab(torch.empty(n, dtype=torch.uint8))
    import sdadapt
    sdadapt.load  # the first lookup imports the load's modules
    print(json.dumps({"seen": seen}))
    """
)


def test_pinning_starts_before_the_load_machinery_is_imported():
    out = subprocess.run([sys.executable, "-c", _GPU_CHILD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])["seen"]
    assert len(seen) == 1 and seen[0][:2] == [False, False] and seen[0][2] > 0
