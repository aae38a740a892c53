"""The engine's I/O threads: each takes tasks off a shared queue and runs them by type."""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .._base.regions import Box, box_shape
from ..sources import Source
from . import syscalls
from .device import DeviceLane
from .geometry import round_up
from .lanes import TaskQueues
from .locate import Runs, file_runs
from .staging import StagingPool
from .tasks import ComputeTask, Delivery, DirectRead, FillTask, SourceRead, StagedRead, Task, Where, task_bytes
from .views import TypedViews

if TYPE_CHECKING:
    from ..sources import ObjectFile


class CountingIO:
    """A ``SourceIO`` over ``source`` that counts the bytes and reads it hands out (one per
    thread: no shared counter, no lock)."""

    def __init__(self, source: Source):
        self.source = source
        self.bytes_read = 0
        self.reads = 0
        self.seconds = 0.0  # spent in Source.read

    def read(self, key: str, box: Box) -> torch.Tensor:
        start = time.perf_counter()
        t = self.source.read(key, box)
        self.seconds += time.perf_counter() - start
        stored = self.source.region_bytes(key, box)  # quantized blocks: the file's bytes, not the values'
        self.bytes_read += sum(b - a for _, a, b in stored) if stored is not None else t.numel() * t.element_size()
        self.reads += 1
        return t


class Buffers:
    """One thread's share of a bounded pool: up to ``depth`` buffers, taken from the pool as the
    thread needs them (the first one waiting for the pool, later ones only while it has one
    free), each handed out again once given back (by the device lane: once the copy out of it
    has finished)."""

    def __init__(self, pool: StagingPool, depth: int):
        self.pool = pool
        self.depth = depth
        self.held: list[torch.Tensor] = []
        self._back: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        self.waits = 0  # takes that waited for a buffer to come back

    def take(self) -> torch.Tensor:
        """A buffer free to write: one given back, a new one while under ``depth``, else the
        next one given back (waiting for it)."""
        try:
            return self._back.get_nowait()
        except queue.Empty:
            pass
        if len(self.held) < self.depth:
            buf = self.pool.try_get() if self.held else self.pool.get()
            if buf is not None:
                self.held.append(buf)
                return buf
        self.waits += 1
        return self._back.get()

    def give_back(self, buf: torch.Tensor) -> None:
        """``buf`` may be written again (called from any thread)."""
        self._back.put(buf)

    def drain(self) -> None:
        """Wait for every buffer to be given back, then return them all to the pool (for the
        threads still running)."""
        for _ in self.held:
            self._back.get()
        for buf in self.held:
            self.pool.put(buf)
        self.held = []


class StagingIO:
    """The ``SourceIO`` a worker reads a computation's declared inputs through: reads that the
    source locates in one opened file, in runs no shorter than ``min_span``, are read with ``preadv``
    one after the other into the thread's band buffer (pinned on a GPU, so that the copy to the
    device starts from there) while they fit; every other read goes through the source
    (:class:`CountingIO`). The band buffer stays untouched until it is given back: after the
    kernel on the host, or once the device lane has copied what it holds."""

    _ALIGN = 64  # each input starts on a multiple of this in the buffer (any dtype's alignment)

    def __init__(self, worker: Worker):
        self.worker = worker
        self.buffer: torch.Tensor | None = None  # the band buffer, once an input is staged in it
        self.pos = 0

    def begin(self) -> None:
        """A new computation: nothing staged yet."""
        self.buffer, self.pos = None, 0

    def read(self, key: str, box: Box) -> torch.Tensor:
        return self.stage(key, box)[0]

    def stage(self, key: str, box: Box) -> tuple[torch.Tensor, int | None]:
        """Region ``box`` of ``key`` and where it was staged: its offset in the band buffer, or
        ``None`` where it was read through the source."""
        w = self.worker
        located = w.locate(key, box)
        if located is not None:
            path, segments, dtype = located
            n = sum(size for _, size in segments)
            start = round_up(self.pos, self._ALIGN) if self.buffer is not None else 0
            if start + n <= w.shared.bands.size:
                if self.buffer is None:
                    self.buffer = w._take(w.bands)
                w.staged += w._read_into(path, segments, self.buffer, start)
                self.pos = start + n
                return w.views.cut(self.buffer, start, dtype, box_shape(box)), start
        return w.counter.read(key, box), None


# an internal record: no generated __eq__ / __repr__ (unused; each costs the import an exec)
@dataclass(eq=False, repr=False)
class Shared:
    """What the worker threads of one run share."""

    source: Source
    work: TaskQueues
    fds: dict[str, int]
    pool: StagingPool
    chunk: int
    bands: StagingPool  # at least one buffer per thread that computes, taken on its first computation
    objects: dict[str, ObjectFile] = field(default_factory=dict)  # mirror path -> its object, fetched into memory
    lane: DeviceLane | None = None  # a GPU run's device side: the readers make no device calls
    min_span: int = 0  # shortest run a computation's input is read in with preadv (0: any)
    gap: int = 0  # gaps up to this are read through, joining runs into one preadv (EngineConfig.gap_bytes)
    errors: list[BaseException] = field(default_factory=list)
    failed: threading.Event = field(default_factory=threading.Event)
    first_done: float | None = None  # when the run's first task finished (``time.perf_counter``)
    on_done: Callable[[int], None] | None = None  # progress: called with each finished task's destination bytes

    def readable(self, path: str) -> bool:
        """A file opened for ``preadv`` or an object fetched into memory."""
        return path in self.fds or path in self.objects

    def fail(self, e: BaseException) -> None:
        """Record ``e`` and stop the run."""
        self.errors.append(e)
        self.failed.set()


class Worker:
    """One I/O thread: takes tasks until none are left (or one failed anywhere).

    Staged reads cycle through ``depth`` staging buffers of this thread (taken from the shared
    bounded pool), computations through ``band_depth`` band buffers: a buffer is refilled once
    the copy out of it has finished, so the next read overlaps the copy. On a GPU the thread
    makes no device calls: it hands each filled buffer to the run's :class:`DeviceLane`, which
    gives it back once copied."""

    def __init__(self, shared: Shared, depth: int = 2, band_depth: int = 1, computes: bool = True):
        self.shared = shared
        self.computes = computes  # takes computations (see TaskQueues); the band pool holds a buffer for it
        self.counter = CountingIO(shared.source)
        self.inputs = StagingIO(self)
        self.staging = Buffers(shared.pool, depth)
        self.bands = Buffers(shared.bands, band_depth)
        self.views = TypedViews()
        self.nbytes = self.calls = self.direct = self.staged = self.computed = 0
        self.fetched = self.requests = 0  # from object storage, straight into memory
        self.extents: dict[str, list[tuple[int, int]]] = {}  # file -> (start, stop) of each call
        self._sink: torch.Tensor | None = None  # the gaps of joined reads land here
        self.busy = self.reading = self.waiting = 0.0  # seconds: running tasks; of which in preadv, and waiting for buffers

    def run(self) -> None:
        """The thread's body: errors are collected in ``shared`` and re-raised by the engine."""
        sh = self.shared
        try:
            if sh.lane is not None and sh.lane.device.type == "cuda":
                # this thread's CUDA calls (pinning a slab, waiting on a copy) go to the load's
                # device; a thread's current device is otherwise device 0, where they would
                # open a context of their own
                torch.cuda.set_device(sh.lane.device)
            self._loop()
        except BaseException as e:  # noqa: BLE001 - re-raised by IOEngine.run
            sh.fail(e)
        finally:
            self.staging.drain()
            self.bands.drain()

    def _loop(self) -> None:
        sh = self.shared
        while True:
            task = sh.work.get(self.computes)
            if task is None or sh.failed.is_set():
                return
            start = time.perf_counter()
            try:
                self._run(task)
            except Exception as e:  # noqa: BLE001 - named and re-raised by run()
                sh.fail(task.where.error(e))
            end = time.perf_counter()
            if sh.on_done is not None:
                sh.on_done(task_bytes(task))
            self.busy += end - start
            if sh.first_done is None:  # unlocked: two threads finishing together may both set it, moments apart
                sh.first_done = end

    def _run(self, task: Task) -> None:
        match task:
            case DirectRead():
                self._direct(task)
            case StagedRead():
                self._staged(task)
            case SourceRead():
                self._source_read(task)
            case ComputeTask():
                self._compute(task)
            case FillTask():
                self._fill(task)

    def _lane_for(self, dest: torch.Tensor) -> DeviceLane | None:
        """The device lane when ``dest`` is on its device, else ``None`` (a host destination)."""
        lane = self.shared.lane
        return lane if lane is not None and dest.device == lane.device else None

    def _take(self, buffers: Buffers) -> torch.Tensor:
        start = time.perf_counter()
        buf = buffers.take()
        self.waiting += time.perf_counter() - start
        return buf

    def _read_into(self, path: str, segments: list[tuple[int, int]], mem: torch.Tensor, pos: int = 0) -> int:
        """Read the file's ``segments`` one after the other into uint8 ``mem`` from byte ``pos``
        on (:func:`~sdadapt._engine.syscalls.read_runs`); returns the bytes read; the file
        extents the calls asked for (gaps read through included) go to ``extents``."""
        sh = self.shared
        obj = sh.objects.get(path)
        if obj is not None:  # an object's ranges fetched into mem, never through the mirror file
            start = time.perf_counter()
            requests, fetched = obj.read_into(segments, mem, pos, sh.gap)
            self.reading += time.perf_counter() - start
            self.requests += requests
            self.fetched += fetched
            n = sum(size for _, size in segments)
            self.nbytes += n
            return n
        fd = sh.fds[path]
        gap = sh.gap if len(segments) > 1 else 0
        if gap and self._sink is None:
            self._sink = torch.empty(gap, dtype=torch.uint8)
        start = time.perf_counter()
        calls, extents = syscalls.read_runs(fd, mem, pos, segments, gap, self._sink)
        self.calls += calls
        self.reading += time.perf_counter() - start
        self.extents.setdefault(path, []).extend(extents)
        n = sum(size for _, size in segments)  # the gaps read through count in storage_bytes only
        self.nbytes += n
        return n

    def _direct(self, task: DirectRead) -> None:
        syscalls.populate(task.dest)
        self.direct += self._read_into(task.path, task.segments, task.dest)

    def _deliver(self, buf: torch.Tensor, deliveries: list[Delivery], where: Where) -> None:
        """Copy the deliveries out of staging buffer ``buf`` (through the device lane when their
        destinations are on its device), then give ``buf`` back once that is done."""
        lane = self._lane_for(deliveries[0].dest)
        if lane is not None and all(dl.dest.device == lane.device for dl in deliveries):
            lane.upload(buf, deliveries, functools.partial(self.staging.give_back, buf), where)
            return
        try:
            for dl in deliveries:
                assert dl.into is None, "a gather's pieces go through the device lane"
                dl.dest.copy_(self.views.cut(buf, dl.offset, dl.dtype, dl.shape))
        finally:
            self.staging.give_back(buf)

    def _staged(self, task: StagedRead) -> None:
        buf = self._take(self.staging)
        try:
            self.staged += self._read_into(task.path, task.segments, buf)
        except BaseException:
            self.staging.give_back(buf)
            raise
        self._deliver(buf, task.deliveries, task.where)

    def _upload(self, value: torch.Tensor, dest: torch.Tensor, where: Where) -> None:
        """Copy the host tensor ``value`` into ``dest`` (same shape and dtype, on the lane's
        device) through this thread's staging buffers (pinned on a GPU): whole, or in slices
        along dim 0 that fit a buffer; through the lane directly where one entry of dim 0 does
        not fit."""
        nb = value.numel() * value.element_size()
        if nb > self.shared.chunk:
            rows = self.shared.chunk // max(1, nb // value.shape[0]) if value.dim() else 0
            if rows == 0:
                lane = self._lane_for(dest)
                assert lane is not None
                lane.call(functools.partial(dest.copy_, value), where)
                return
            for r in range(0, value.shape[0], rows):
                self._upload(value[r : r + rows], dest[r : r + rows], where)
            return
        buf = self._take(self.staging)
        shape = tuple(value.shape)
        try:
            self.views.cut(buf, 0, value.dtype, shape).copy_(value)
        except BaseException:
            self.staging.give_back(buf)
            raise
        self._deliver(buf, [Delivery(0, nb, value.dtype, shape, dest, where)], where)

    def _compute(self, task: ComputeTask) -> None:
        """A computation: on the lane's device, the declared inputs of a kernel read through
        :class:`StagingIO` (a stored region straight into the band buffer, where it fits) and
        the kernel run by the lane, host results (``fn``) uploaded; on the host, inputs through
        :class:`StagingIO` too, the kernel run here."""
        step = task.step
        lane = self._lane_for(step.dest)
        if not step.on_device:
            if lane is None:
                step.run(self.counter)
            else:
                assert step.fn is not None
                self._upload(step.fn(self.counter), step.dest, task.where)
            self.computed += 1
            return
        assert step.kernel is not None
        io = self.inputs
        io.begin()
        args: list[torch.Tensor] = []
        inside: dict[int, int] = {}  # arg index -> its offset in the band buffer
        try:
            for i, inp in enumerate(step.inputs):
                if inp.read is None:
                    args.append(inp.value(io))
                    continue
                value, at = io.stage(inp.read.key, inp.read.box)
                args.append(value.view(inp.read.shape) if at is not None else value.reshape(inp.read.shape))
                if at is not None and lane is not None:
                    inside[i] = at
        except BaseException:
            if io.buffer is not None:
                self.bands.give_back(io.buffer)
            raise
        staged, used = io.buffer, io.pos
        io.begin()
        release = functools.partial(self.bands.give_back, staged) if staged is not None else _nothing
        if lane is not None:
            lane.compute(step, tuple(args), staged, used, inside, release, task.where)
        else:
            try:
                step.kernel.run(step.dest, *args)
            finally:
                release()
        self.computed += 1

    def _fill(self, task: FillTask) -> None:
        lane = self._lane_for(task.step.dest)
        if lane is None:
            task.step.run(self.counter)
        else:
            lane.call(functools.partial(task.step.run, self.counter), task.where)

    def locate(self, key: str, box: Box) -> Runs | None:
        """Where region ``box`` of source tensor ``key`` is: an opened file, its (offset, nbytes)
        runs in order, the stored dtype (see :func:`~sdadapt._engine.locate.file_runs`)."""
        sh = self.shared
        return file_runs(sh.source, key, box, sh.min_span, sh.readable)

    def _source_read(self, task: SourceRead) -> None:
        piece = task.piece
        value = self.counter.read(piece.key, piece.box)
        self.computed += 1
        if self._lane_for(piece.dest) is not None:
            self._upload(value, piece.dest, task.where)
        else:
            piece.dest.copy_(value)


def _nothing() -> None:
    """The release of a computation that staged nothing (so nothing is copied out of a buffer)."""
