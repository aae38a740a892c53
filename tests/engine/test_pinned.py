"""Pinned staging memory: the slab cache (reuse, smallest fit, bound), staging pools carved out
of one slab and giving it back, and, where CUDA is available, a registered huge-page slab that
copies to the device like torch's own pinned memory."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import sdadapt
from sdadapt._engine import pinned
from sdadapt._engine.pinned import HUGE_PAGE, Slab, SlabCache, register_slab
from sdadapt._engine.staging import StagingPool


class _PlainSlab(Slab):
    """A slab of plain (unpinned) memory whose release is recorded in ``freed`` (and, as a
    registered slab's does, leaves it without its tensor)."""

    freed: list[int]

    def release(self) -> None:
        self.freed.append(self.nbytes)
        del self.tensor


class _Counting:
    """An allocator of plain slabs that counts what it made and what was freed."""

    def __init__(self) -> None:
        self.made: list[int] = []
        self.freed: list[int] = []

    def __call__(self, nbytes: int) -> Slab:
        self.made.append(nbytes)
        slab = _PlainSlab(torch.empty(nbytes, dtype=torch.uint8))
        slab.freed = self.freed
        return slab


def test_cache_rounds_to_huge_pages_and_reuses_the_smallest_fit():
    alloc = _Counting()
    cache = SlabCache(alloc, keep=4)
    a, b = cache.get(1), cache.get(3 * HUGE_PAGE + 1)
    assert (a.nbytes, b.nbytes) == (HUGE_PAGE, 4 * HUGE_PAGE)
    cache.put(b)
    cache.put(a)
    assert cache.get(HUGE_PAGE // 2) is a  # the smallest kept slab that fits
    assert cache.get(2 * HUGE_PAGE) is b
    assert cache.get(5 * HUGE_PAGE).nbytes == 5 * HUGE_PAGE  # none kept fits: a new one
    assert alloc.made == [HUGE_PAGE, 4 * HUGE_PAGE, 5 * HUGE_PAGE]


def test_cache_frees_the_smallest_over_its_bound_and_on_clear():
    alloc = _Counting()
    cache = SlabCache(alloc, keep=2)
    slabs = [cache.get(n * HUGE_PAGE) for n in (3, 1, 2)]
    for s in slabs:
        cache.put(s)
    assert alloc.freed == [HUGE_PAGE]
    cache.clear()
    assert sorted(alloc.freed) == [HUGE_PAGE, 2 * HUGE_PAGE, 3 * HUGE_PAGE]


def test_cache_hands_each_kept_slab_to_one_thread():
    cache = SlabCache(_Counting(), keep=8)
    for s in [cache.get(HUGE_PAGE) for _ in range(8)]:
        cache.put(s)
    got: list[Slab] = []
    lock = threading.Lock()

    def take() -> None:
        s = cache.get(HUGE_PAGE)
        with lock:
            got.append(s)

    threads = [threading.Thread(target=take) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(s) for s in got}) == 8


def test_pinned_pool_carves_disjoint_page_aligned_buffers_from_one_slab_and_gives_it_back():
    alloc = _Counting()
    cache = SlabCache(alloc)
    size, count = 10_000, 5
    pool = StagingPool(count, size, pin=True, slabs=cache)
    bufs = [pool.get() for _ in range(count)]
    assert pool.try_get() is None  # the bound holds
    assert len(alloc.made) == 1 and alloc.made[0] >= count * size
    base = bufs[0].data_ptr() - bufs[0].storage_offset()
    starts = sorted(b.data_ptr() - base for b in bufs)
    assert all(b.numel() == size for b in bufs)
    assert all(s % 4096 == 0 for s in starts)
    assert all(later - earlier >= size for earlier, later in zip(starts, starts[1:], strict=False))  # no overlap
    pool.put(bufs[0])
    assert pool.get() is bufs[0]
    pool.close()
    again = StagingPool(count, size, pin=True, slabs=cache)
    again.get()
    assert len(alloc.made) == 1  # the next run reuses the slab
    again.close()


def test_a_failed_slab_allocation_leaves_the_pool_bound_as_it_was():
    alloc = _Counting()
    failures = [MemoryError("no pinned memory")]

    def flaky(nbytes: int) -> Slab:
        if failures:
            raise failures.pop()
        return alloc(nbytes)

    pool = StagingPool(1, 100, pin=True, slabs=SlabCache(flaky))
    with pytest.raises(MemoryError):
        pool.get()
    assert pool.try_get() is not None and pool.allocated == 1  # the one buffer still exists


def test_release_pinned_memory_frees_what_loads_kept(monkeypatch):
    alloc = _Counting()
    monkeypatch.setattr(pinned, "SLABS", SlabCache(alloc))
    for slab in [pinned.SLABS.get(n * HUGE_PAGE) for n in (2, 1)]:
        pinned.SLABS.put(slab)
    assert sdadapt.release_pinned_memory() == 3 * HUGE_PAGE
    assert sorted(alloc.freed) == [HUGE_PAGE, 2 * HUGE_PAGE]
    assert sdadapt.release_pinned_memory() == 0


def test_unpinned_pool_allocates_each_buffer_on_first_use_and_keeps_no_slab():
    alloc = _Counting()
    pool = StagingPool(3, 100, pin=False, slabs=SlabCache(alloc))
    a, b = pool.get(), pool.get()
    assert a.data_ptr() != b.data_ptr() and pool.allocated == 2
    pool.close()
    assert alloc.made == []


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
def test_registered_slab_is_pinned_and_copies_to_the_device():
    slab = register_slab(3 * HUGE_PAGE)
    assert slab.mapping is not None  # registered, not the torch fallback
    t = slab.tensor
    assert t.is_pinned() and t.numel() == 3 * HUGE_PAGE and t.data_ptr() % HUGE_PAGE == 0
    t.copy_(torch.arange(t.numel(), dtype=torch.int64).to(torch.uint8))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        dev = torch.empty_like(t, device="cuda")
        dev.copy_(t, non_blocking=True)
    stream.synchronize()
    assert torch.equal(dev.cpu(), t)
    slab.release()


class _Gated(_Counting):
    """A counting allocator that blocks until ``go`` is set (a slab still being pinned)."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()

    def __call__(self, nbytes: int) -> Slab:
        assert self.go.wait(10)
        return super().__call__(nbytes)


CPU = torch.device("cpu")


def test_prefetched_slab_is_waited_for_and_handed_out_once():
    """A get for a slab being prefetched waits for it rather than pinning a second one; the
    smallest slab on its way that fits is the one taken; a prefetch that a kept or pending
    slab already covers starts nothing."""
    alloc = _Gated()
    cache = SlabCache(alloc, keep=4)
    cache.prefetch(2 * HUGE_PAGE, CPU)
    cache.prefetch(5 * HUGE_PAGE, CPU)
    cache.prefetch(HUGE_PAGE, CPU)  # covered by the 2-page one on its way
    got: dict[str, Slab] = {}
    taker = threading.Thread(target=lambda: got.setdefault("a", cache.get(HUGE_PAGE + 1)))
    taker.start()
    taker.join(0.2)
    assert taker.is_alive() and alloc.made == []  # waiting for the prefetch, not pinning its own
    alloc.go.set()
    taker.join(10)
    assert got["a"].nbytes == 2 * HUGE_PAGE  # the smallest that fits
    assert cache.get(4 * HUGE_PAGE).nbytes == 5 * HUGE_PAGE
    assert sorted(alloc.made) == [2 * HUGE_PAGE, 5 * HUGE_PAGE]
    cache.put(got["a"])
    cache.prefetch(HUGE_PAGE, CPU)  # a kept slab fits: nothing pinned
    assert cache.get(HUGE_PAGE) is got["a"] and len(alloc.made) == 2


def test_prefetches_are_pinned_one_at_a_time_in_the_order_asked():
    """A second prefetch waits for the first to be pinned (it would share the memory bandwidth
    and the driver with it, delaying the one a load needs first); both end up kept."""
    alloc = _Gated()
    cache = SlabCache(alloc, keep=4)
    cache.prefetch(3 * HUGE_PAGE, CPU)
    cache.prefetch(5 * HUGE_PAGE, CPU)
    time.sleep(0.2)
    assert alloc.made == [] and sum(t.name == "sdadapt-pin" for t in threading.enumerate()) == 1
    alloc.go.set()
    assert cache.get(4 * HUGE_PAGE).nbytes == 5 * HUGE_PAGE
    assert alloc.made == [3 * HUGE_PAGE, 5 * HUGE_PAGE] and cache.get(HUGE_PAGE).nbytes == 3 * HUGE_PAGE


def test_failed_prefetch_leaves_the_get_to_allocate():
    made: list[int] = []

    def flaky(nbytes: int) -> Slab:
        made.append(nbytes)
        if len(made) == 1:
            raise RuntimeError("no pinned memory")
        return Slab(torch.empty(nbytes, dtype=torch.uint8))

    cache = SlabCache(flaky)
    cache.prefetch(HUGE_PAGE, CPU)
    slab = cache.get(HUGE_PAGE)  # waits for the failed prefetch, then pins its own
    assert slab.nbytes == HUGE_PAGE and made == [HUGE_PAGE, HUGE_PAGE]


def test_prefetch_is_sized_as_the_run_asks_for(monkeypatch):
    """prefetch_pinned asks for the slabs a run of the config's threads cuts its pools from:
    the staging pool's always, the band pool's only when asked for (``bands``)."""
    from sdadapt._engine import EngineConfig, engine

    asked: list[int] = []
    monkeypatch.setattr(engine.SLABS, "prefetch", lambda nbytes, device: asked.append(nbytes))
    cfg = EngineConfig(threads=4)
    engine.prefetch_pinned(CPU, False, cfg)
    engine.prefetch_pinned(CPU, True, cfg)
    staging = StagingPool.slab_bytes(cfg.staging_buffers(4), cfg.chunk())
    bands = StagingPool.slab_bytes(cfg.computing_threads(4) * cfg.band_depth, cfg.band_buffer_bytes())
    assert asked == [staging, staging, bands]
    assert staging >= cfg.staging_buffers(4) * cfg.chunk() and bands >= 4 * cfg.band_buffer_bytes()


def test_a_gpu_load_prefetches_bands_only_for_computations_it_cannot_gather(monkeypatch):
    """Once planned, a GPU load pins band buffers only where a computation may use them: not for
    a dequantisation whose inputs are stored regions (gathered on the device; a node anywhere
    below the top, as stacked experts hold them), but when gathering is off; it warms one
    kernel per kind. A plan that computes nothing, or a load off GPUs, does neither."""
    from types import SimpleNamespace

    import sdadapt._recipes.moves as MV
    import sdadapt._recipes.nodes as N
    from sdadapt._load import loading as _load
    from sdadapt._recipes import quant_nodes as QN

    calls: list[tuple[torch.device, bool]] = []
    warmed: list[tuple[torch.device, int]] = []
    monkeypatch.setattr(_load, "prefetch_pinned", lambda device, bands, engine: calls.append((device, bands)))
    monkeypatch.setattr(_load, "warm_kernels", lambda device, recipes: warmed.append((device, len(recipes))))
    w, s = N.Leaf("w", (4, 256, 256), torch.float8_e4m3fn), N.Leaf("s", (4, 2, 2), torch.float32)
    experts = [QN.DequantizedFP8(MV.Selected(w, 0, e), MV.Selected(s, 0, e), (128, 128), "float32", torch.bfloat16) for e in range(4)]
    fp8 = SimpleNamespace(recipes={"n": N.Leaf("n", (8,), torch.bfloat16), "experts": MV.Stacked(tuple(experts), 0)})
    plain = SimpleNamespace(recipes={"n": N.Leaf("n", (8,), torch.bfloat16)})
    gpu = torch.device("cuda:0")
    _load._prepare_device(gpu, {}, fp8, None)  # type: ignore[arg-type]
    _load._prepare_device(gpu, {}, plain, None)  # type: ignore[arg-type]
    _load._prepare_device(None, {}, fp8, None)  # type: ignore[arg-type]
    assert calls == [] and warmed == [(gpu, 1)]  # one kind of kernel (4 experts alike), inputs gathered
    monkeypatch.setenv("SDADAPT_IO_GATHER", "0")
    monkeypatch.setenv("SDADAPT_IO_WARM", "0")
    _load._prepare_device(gpu, {}, fp8, None)  # type: ignore[arg-type]
    assert calls == [(gpu, True)] and len(warmed) == 1


def test_a_gpu_load_pins_its_staging_before_it_plans(tmp_path, monkeypatch):
    """``sdadapt.load`` into a meta model bound for a GPU asks for its staging slab before it
    plans (so a plan that fails has asked already); a load into a model on the CPU does not."""
    from safetensors.torch import save_file

    import sdadapt
    from sdadapt._load import loading as _load
    from sdadapt.errors import PlanError

    save_file({"other.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    events: list[object] = []
    monkeypatch.setattr(_load, "prefetch_pinned", lambda device, bands, engine: events.append((device, bands)))
    real = _load.plan_model
    monkeypatch.setattr(_load, "plan_model", lambda *a, **k: (events.append("plan"), real(*a, **k))[1])
    with pytest.raises(PlanError):
        sdadapt.load(torch.nn.Linear(2, 2), str(tmp_path))
    assert events == ["plan"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with torch.device("meta"):
        model = torch.nn.Linear(2, 2)
    assert _load._gpu_target(model, "cuda:0") == torch.device("cuda:0")
    assert _load._gpu_target(model, "cpu") is None
    assert _load._gpu_target(torch.nn.Linear(2, 2), None) is None  # nothing on meta or a GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("a load into the CPU asked CUDA (it starts the driver)"))
    assert _load._gpu_target(torch.nn.Linear(2, 2), None) is None
    assert _load._gpu_target(model, "cpu") is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    events.clear()
    with pytest.raises(PlanError):
        sdadapt.load(model, str(tmp_path), device="cuda:0")
    assert events == [(torch.device("cuda:0"), False), "plan"]


@cuda
def test_slab_prefetched_on_a_background_thread_is_pinned_for_the_device():
    cache = SlabCache(register_slab)
    cache.prefetch(2 * HUGE_PAGE, torch.device("cuda", torch.cuda.current_device()))
    slab = cache.get(2 * HUGE_PAGE)
    t = slab.tensor
    assert slab.mapping is not None and t.is_pinned()
    t.fill_(7)
    dev = torch.empty_like(t, device="cuda")
    dev.copy_(t, non_blocking=True)
    torch.cuda.synchronize()
    assert bool((dev == 7).all())
    slab.release()


def test_a_load_into_the_cpu_never_asks_cuda(tmp_path, monkeypatch):
    """A whole load into a model on the CPU never calls ``torch.cuda.is_available()``: in a process
    that has not used CUDA on a GPU machine, that call starts the driver (a first-call tax)."""
    from safetensors.torch import save_file

    import sdadapt

    src = torch.nn.Linear(3, 2)
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(tmp_path / "model.safetensors"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("a load into the CPU asked CUDA"))
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: pytest.fail("a load into the CPU started CUDA"))
    model = torch.nn.Linear(3, 2)
    report = sdadapt.load(model, str(tmp_path / "model.safetensors"))
    assert report.keys_loaded == 2
    assert torch.equal(model.weight, src.weight) and torch.equal(model.bias, src.bias)
