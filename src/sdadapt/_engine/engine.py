"""One run of the engine: start the threads, plan while they read, collect the counts."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from .._base import later as after_call
from .._base.gc import gc_paused
from ..sources import Source, fetching_for, object_file
from . import devread
from .config import EngineConfig
from .device import DeviceLane, LaneTimes
from .lanes import TaskQueues
from .pinned import SLABS
from .planner import Planner
from .staging import StagingPool
from .syscalls import open_device_file, open_for, storage_bytes
from .tasks import DirectRead, GatherRead, Job, Task, task_paths
from .workers import Shared, Worker

log = logging.getLogger(__name__)

@dataclass(eq=False)
class EngineStats:
    """What one or more runs did: bytes, system calls, tasks, where the bytes went, time."""

    bytes_read: int = 0
    # what a cold page cache reads from storage for the run (read-ahead off): every page its
    # preadv calls touch, once per file, gaps read through included; plus the bytes read
    # through sources (a mapping, object storage) as they were asked for
    storage_bytes: int = 0
    syscalls: int = 0
    tasks: int = 0
    direct_bytes: int = 0
    staged_bytes: int = 0
    coalesced: int = 0  # staged pieces that shared a read with another
    computed: int = 0  # pieces read through Source.read, and computation steps
    gathered: int = 0  # computations whose inputs were gathered on the device (run by the lane, not in computed)
    staging_buffers: int = 0
    staging_bytes: int = 0
    threads: int = 0
    seconds: float = 0.0  # the whole run
    plan_seconds: float = 0.0  # of which turning jobs into tasks
    first_task_seconds: float = 0.0  # from the start to the first task done (its bytes read and handed on)
    # summed over the threads: running tasks, of which reading (preadv and Source.read) and
    # waiting for a staging or band buffer (or for the copy out of it to finish)
    busy_seconds: float = 0.0
    read_seconds: float = 0.0
    wait_seconds: float = 0.0
    lane: LaneTimes = field(default_factory=LaneTimes)  # the device lane's thread (GPU runs)
    kvikio_bytes: int = 0  # of direct_bytes, read by kvikio straight into GPU destinations
    kvikio_wait_seconds: float = 0.0  # waiting for kvikio's reads once the threads had finished
    head_bytes: int = 0  # of kvikio_bytes, copied from a head start's buffer (EngineConfig.head_bytes)
    fetched_bytes: int = 0  # from object storage straight into memory (in storage_bytes too)
    requests: int = 0  # the ranged requests that fetched them

    _PEAKS: ClassVar[tuple[str, ...]] = ("threads", "staging_buffers", "staging_bytes")

    def add(self, other: EngineStats) -> None:
        """Accumulate ``other`` (another run): counts and times (the lane's too) add up, peaks take
        the maximum."""
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            setattr(self, f.name, max(mine, theirs) if f.name in self._PEAKS else mine + theirs)


@contextlib.contextmanager
def switch_interval(seconds: float | None) -> Iterator[None]:
    """Python's thread switch interval set to ``seconds`` inside the block (``None``: left as
    it is), and set back when the block ends. A thread back from a read waits for the
    interpreter lock until its holder lets go or this interval runs out."""
    if seconds is None:
        yield
        return
    before = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def _estimate_tasks(jobs: Sequence[Job], chunk: int) -> int:
    """About how many tasks the jobs make (for sizing the thread pool before planning)."""
    return sum(max(1, -(-j.dest.numel() * j.dest.element_size() // chunk)) for j in jobs)


def prefetch_pinned(device: torch.device, bands: bool, config: EngineConfig | None = None) -> None:
    """Start pinning, in the background, the staging memory that a load to ``device`` (a GPU)
    will pin on its first run (``bands``: its band buffers too, after the staging), as large as
    a run of ``config``'s threads asks for; the run then takes it from the cache of kept slabs
    (:data:`~sdadapt._engine.pinned.SLABS`), waiting only for what is not pinned yet. A load
    calls it as it starts (the staging, pinned while the plan is made and the model
    materialised) and once planned (the band buffers, where its computations may use them:
    :func:`~sdadapt._engine.device.device_work`); what is pinned or on its way already is not
    asked for again. The choice of kvikio for the run's reads is made meanwhile too
    (:func:`~sdadapt._engine.devread.prefetch`), unless the process's first run defers it
    (:func:`~sdadapt._engine.devread.deferred`)."""
    cfg = config or EngineConfig.from_env()
    after_call.run_queued()  # a start an earlier run left for after its call is never skipped
    if device.type == "cuda" and not devread.deferred(cfg.kvikio, *cfg.kvikio_settings()):
        devread.prefetch(device, cfg.kvikio, *cfg.kvikio_settings())
    SLABS.prefetch(StagingPool.run_slab_bytes(cfg, cfg.threads), device)
    if bands:
        SLABS.prefetch(StagingPool.slab_bytes(cfg.band_buffers(cfg.threads), cfg.band_buffer_bytes()), device)


_HEAD = f"{__package__}.head"
"""The head start's module: imported only by a load that asks for one (``EngineConfig.head_bytes``)."""


def _begun_head(device: torch.device) -> Any:
    """The head start begun for ``device`` (``head.take_head``), ``None`` where none was: also
    where no load of the process asked for one, whose module is then never imported."""
    head = sys.modules.get(_HEAD)
    return head.take_head(device) if head is not None else None


def _pin_head_later(device: torch.device, cfg: EngineConfig) -> None:
    """``head.pin_later``, its module imported now (a run queues this only where ``cfg.head_bytes`` asks)."""
    from .head import pin_later  # noqa: PLC0415 - only where a head start is asked for

    pin_later(device, cfg)


class IOEngine:
    """Runs a rank's reads for one ``dcp.load``; see :mod:`sdadapt._engine`."""

    def __init__(
        self, source: Source, config: EngineConfig | None = None, *, cpu_lane: bool = False, on_done: Callable[[int], None] | None = None
    ):
        self.source = source
        self.on_done = on_done  # progress: called from the threads with each finished task's destination bytes
        self.config = config or EngineConfig.from_env()
        self.stats = EngineStats()
        self.cpu_lane = cpu_lane  # tests: CPU destinations go through a device lane on the CPU, as GPU ones do

    def plan(
        self,
        jobs: Sequence[Job],
        emit: Callable[[Task], None] | None = None,
        gather_on: torch.device | None = None,
        direct_on: torch.device | None = None,
        config: EngineConfig | None = None,
    ) -> list[Task]:
        """Turn jobs into tasks. With ``emit``, each task is handed to it as soon as it is made
        (so that reading starts while planning goes on) and the list returned is empty;
        staged pieces under half a chunk, coalesced across all jobs, come last. ``gather_on``:
        the device of the run's device lane (computations there may gather their inputs);
        ``direct_on``: a GPU whose contiguous destinations are read into directly (kvikio)."""
        tasks: list[Task] = []
        planner = Planner(self.source, config or self.config, gather_on, direct_on)
        planner.plan(jobs, emit or tasks.append)
        self.stats.coalesced += planner.coalesced
        self.stats.gathered += planner.gathered
        return tasks

    def run(self, jobs: Sequence[Job]) -> EngineStats:
        """Plan and read ``jobs``; the threads start on the first tasks while planning goes on."""
        start = time.perf_counter()
        after_call.run_queued()  # an earlier run's kvikio start, if its call has not returned yet
        cfg = self.config
        share = sum(j.dest.numel() * j.dest.element_size() for j in jobs)
        fetching = fetching_for(self.source, share, cfg.remote_request_bytes, cfg.remote_concurrency)
        if fetching is not None:
            # an object store: one request per read, one thread per request in flight
            # (docs/object-storage.md, "How ranges are fetched")
            cfg = dataclasses.replace(cfg, threads=max(cfg.threads, fetching.concurrency), chunk_bytes=fetching.request_bytes)
            log.debug("fetching %d bytes: %s", share, fetching)
        chunk = cfg.chunk()
        cuda_devices = {j.dest.device for j in jobs if j.dest.device.type == "cuda"}
        device = next(iter(cuda_devices)) if cuda_devices and torch.cuda.is_available() else None
        if device is None and self.cpu_lane:
            device = torch.device("cpu")
        threads = max(1, min(cfg.threads, _estimate_tasks(jobs, chunk)))
        # Buffers are made on first use; no more than the threads can hold at once.
        pin = device is not None and device.type == "cuda"
        pool = StagingPool.for_run(cfg, threads, pin)
        # The first `computing` threads each hold a band buffer and are the only ones that compute.
        computing = cfg.computing_threads(threads)
        bands = StagingPool(cfg.band_buffers(threads), cfg.band_buffer_bytes(), pin)
        shared = Shared(
            self.source, TaskQueues(), {}, pool, chunk, bands, min_span=cfg.min_span_bytes, gap=cfg.gap_bytes, on_done=self.on_done
        )
        if device is not None:
            shared.lane = DeviceLane(device, bands.size, shared.fail, cfg.landing_buffers)
            shared.lane.start()
        # kvikio reads files: never the mirror of an object store; a process's first GPU run
        # reads without it and starts it for the next (devread.deferred)
        kvikio = device is not None and fetching is None
        later = kvikio and device is not None and device.type == "cuda" and devread.deferred(cfg.kvikio, *cfg.kvikio_settings())
        reads = devread.select(device, cfg.kvikio, *cfg.kvikio_settings()) if kvikio and not later else None
        if reads is not None and device is not None and device.type == "cuda":
            # kvikio writes from its own threads and streams: whatever the caller's stream
            # still has queued for the destinations (their allocation, a materialised model's
            # values) finishes first
            torch.cuda.current_stream(device).synchronize()
        # the gathers' inputs, read by kvikio into device buffers of at most twice the staging memory at once
        gathers = None
        if reads is not None and shared.lane is not None:
            gathers = devread.GatherReads(reads, shared.lane, shared.fail, 2 * cfg.staging_bytes)
        pending = devread.Pending()
        # a head start begun by the load: the tensors it read ahead are copied from its buffer
        head = _begun_head(device) if reads is not None and device is not None else None
        handles: dict[str, Any] = {}  # path -> kvikio file handle
        workers = [Worker(shared, cfg.depth, cfg.band_depth, computes=i < computing) for i in range(threads)]
        pool_threads = [threading.Thread(target=w.run, name=f"sdadapt-io-{i}", daemon=True) for i, w in enumerate(workers)]
        for th in pool_threads:
            th.start()
        count = 0

        def handle(target: str, path: str) -> Any:
            """kvikio's handle of ``path``, opened on first use (``target``: the key, for errors)."""
            if path not in handles:
                assert reads is not None
                handles[path] = open_device_file(reads, path, target)
            return handles[path]

        waiting: list[DirectRead] = []  # the head start holds them, its reads not ended yet

        def from_head(task: DirectRead) -> bool:
            """Whether ``task`` was served from the head start (or failed the run trying)."""
            assert head is not None
            try:
                return head.serve(task)
            except Exception as e:  # noqa: BLE001 - named; the reads queued so far are still waited for
                shared.fail(task.where.error(e))
                return True

        def push(task: Task, ahead: bool = True) -> None:
            nonlocal count
            if shared.failed.is_set():
                return  # a thread failed: the load fails, reading on is no use
            count += ahead
            if isinstance(task, GatherRead):
                assert gathers is not None, "gathers are read by kvikio only in runs that read through it"
                try:
                    gathers.submit(task, functools.partial(handle, task.where.target))
                except Exception as e:  # noqa: BLE001 - named; the reads queued so far are still waited for
                    shared.fail(task.where.error(e))
                return
            if ahead and head is not None and isinstance(task, DirectRead) and task.dest.device == head.device and head.covers(task):
                if not head.done():
                    waiting.append(task)  # served once planned, so that planning never waits for the head start
                    return
                if from_head(task):
                    return
            if reads is not None and isinstance(task, DirectRead) and task.dest.device.type == "cuda":
                # kvikio's: queued at once, waited for at the end of the run
                try:
                    reads.submit(handle(task.where.target, task.path), task.segments, task.dest, task.where, pending)
                except Exception as e:  # noqa: BLE001 - named; the reads queued so far are still waited for
                    shared.fail(task.where.error(e))
                return
            for path in task_paths(task):  # opened before any thread sees the task
                if not shared.readable(path):
                    obj = object_file(path) if fetching is not None else None
                    if obj is not None:
                        shared.objects[path] = obj
                    else:
                        shared.fds[path] = open_for(path, task.where.target, cfg.readahead)
            shared.work.put(task)

        planned = start
        kvikio_wait = 0.0
        # a full collection would hold the GIL, and with it every thread, mid-read
        with gc_paused(), switch_interval(cfg.switch_interval):
            try:
                with switch_interval(cfg.plan_switch_interval):
                    self.plan(jobs, push, device, device if reads is not None else None, cfg)
                for task in waiting:  # kvikio's queue runs in order: the head start's reads end before the run's own
                    if not from_head(task):
                        push(task, ahead=False)
            except BaseException as e:  # noqa: BLE001 - stop the threads, then raise
                shared.errors.insert(0, e)
                shared.failed.set()
            finally:
                planned = time.perf_counter()
                shared.work.close()
                for th in pool_threads:
                    th.join()
                if gathers is not None:
                    gathers.close()  # every gather's reads have ended and its kernel is queued
                if shared.lane is not None:
                    shared.lane.close()  # every copy and kernel has finished
                t = time.perf_counter()
                shared.errors.extend(devread.DeviceReads.wait(pending))  # every kvikio read has ended
                if head is not None:
                    head.close()  # its copies have ended too
                kvikio_wait = time.perf_counter() - t
                pool.close()
                bands.close()
                for fd in shared.fds.values():
                    os.close(fd)
                for handle in handles.values():
                    devread.DeviceReads.close(handle)
                for obj in shared.objects.values():
                    obj.remote.drop_kept()
        st = self.stats
        extents: dict[str, list[tuple[int, int]]] = {}
        for w in workers:
            for path, ext in w.extents.items():
                extents.setdefault(path, []).extend(ext)
            st.storage_bytes += w.counter.bytes_read
            st.bytes_read += w.nbytes + w.counter.bytes_read
            st.syscalls += w.calls
            st.direct_bytes += w.direct
            st.staged_bytes += w.staged
            st.computed += w.computed
            st.busy_seconds += w.busy
            st.read_seconds += w.reading + w.counter.seconds
            st.wait_seconds += w.waiting
            st.fetched_bytes += w.fetched
            st.requests += w.requests
            st.storage_bytes += w.fetched
        if shared.lane is not None:
            st.lane += shared.lane.times
        st.storage_bytes += sum(storage_bytes(ext) for ext in extents.values())
        st.tasks += count
        served = head.served if head is not None else 0  # read by kvikio into the head start's buffer
        st.kvikio_bytes += pending.nbytes + served
        st.head_bytes += served
        st.storage_bytes += pending.nbytes + served + (gathers.nbytes if gathers is not None else 0)
        st.direct_bytes += pending.nbytes + served
        st.bytes_read += pending.nbytes + served
        if gathers is not None:
            st.kvikio_bytes += gathers.nbytes
            st.bytes_read += gathers.nbytes
        st.kvikio_wait_seconds += kvikio_wait
        st.threads = threads
        st.staging_buffers = max(st.staging_buffers, pool.allocated + bands.allocated)
        st.staging_bytes = max(st.staging_bytes, pool.allocated * pool.size + bands.allocated * bands.size)
        st.plan_seconds += planned - start
        st.first_task_seconds += (shared.first_done or planned) - start
        st.seconds += time.perf_counter() - start
        if shared.errors:
            raise shared.errors[0]
        if later:  # started once the public call returns: not competing with its last steps for the GIL
            assert device is not None
            after_call.queue(functools.partial(devread.start_later, device, sorted(shared.fds), cfg.kvikio, *cfg.kvikio_settings()))
            if cfg.head_bytes > 0:
                after_call.queue(functools.partial(_pin_head_later, device, cfg))
        return st
