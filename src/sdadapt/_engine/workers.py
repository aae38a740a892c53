"""The engine's I/O threads: each takes tasks off a shared queue and runs them by type."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .._nodes import Box, box_shape
from ..sources._base import Source
from . import syscalls
from .geometry import box_spans, round_up
from .lanes import TaskLanes
from .staging import StagingPool
from .tasks import ComputeTask, DirectRead, FillTask, SourceRead, StagedRead, Task


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
        self.bytes_read += t.numel() * t.element_size()
        self.reads += 1
        return t


class StagingIO:
    """The ``SourceIO`` a worker hands a computation's ``inputs``: reads that the source
    locates in one opened file, in runs no shorter than ``min_span``, are read with ``preadv``
    one after the other into the thread's band buffer (pinned on a GPU, so that the copies to
    the device start from there) while they fit; every other read goes through the source
    (:class:`CountingIO`). The buffer stays untouched until the worker has copied what it holds
    (:meth:`Worker.to_device`) or the kernel has run on it."""

    _ALIGN = 64  # each input starts on a multiple of this in the buffer (any dtype's alignment)

    def __init__(self, worker: Worker):
        self.worker = worker
        self.buffer: torch.Tensor | None = None  # the band buffer, once an input is staged in it
        self.pos = 0

    def begin(self) -> None:
        """A new computation: nothing staged yet."""
        self.buffer, self.pos = None, 0

    def read(self, key: str, box: Box) -> torch.Tensor:
        w = self.worker
        located = w.locate(key, box)
        if located is not None:
            path, segments, dtype = located
            n = sum(size for _, size in segments)
            start = round_up(self.pos, self._ALIGN) if self.buffer is not None else 0
            if start + n <= w.shared.bands.size:
                if self.buffer is None:
                    self.buffer = w.band_buffer()
                w.staged += w._read_into(path, segments, self.buffer, start)
                self.pos = start + n
                return w.typed_view(self.buffer, start, dtype, box_shape(box))
        return w.counter.read(key, box)


@dataclass
class Shared:
    """What the worker threads of one run share."""

    source: Source
    work: TaskLanes
    fds: dict[str, int]
    pool: StagingPool
    chunk: int
    device: torch.device | None
    bands: StagingPool  # at least one buffer per thread that computes, taken on its first computation
    min_span: int = 64 * 1024  # shortest run a computation's input is read in with preadv
    errors: list[BaseException] = field(default_factory=list)
    failed: threading.Event = field(default_factory=threading.Event)


class Worker:
    """One I/O thread: takes tasks until none are left (or one failed anywhere).

    Staged reads cycle through a small ring of this thread's own staging buffers (taken from
    the shared bounded pool, given back at the end): a buffer is reused once the host-to-device
    copy out of it has finished (its event), so the next read overlaps the copy. On a GPU the
    thread's own stream is current for the whole run."""

    def __init__(self, shared: Shared, depth: int = 2, band_depth: int = 1, computes: bool = True):
        self.shared = shared
        self.computes = computes  # takes computations (see TaskLanes); the band pool holds a buffer for it
        self.depth = depth  # staging buffers of this thread
        self.band_depth = band_depth  # band buffers of this thread, at most
        self.counter = CountingIO(shared.source)
        self.inputs = StagingIO(self)
        self.nbytes = self.calls = self.direct = self.staged = self.computed = 0
        self.busy = self.reading = self.waiting = 0.0  # seconds: running tasks; of which in preadv, and waiting for buffers
        self.ring: list[list[Any]] = []  # [buffer, event or None]
        self.turn = 0
        self.bands: list[list[Any]] = []  # [buffer, event or None] of the band buffers this thread holds
        self.band: list[Any] | None = None  # the one of them in use: see band_buffer
        self.stream: Any = None
        self.landing: torch.Tensor | None = None  # see _landing
        self._typed: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}  # see typed_view

    def run(self) -> None:
        """The thread's body: errors are collected in ``shared`` and re-raised by the engine."""
        sh = self.shared
        try:
            if sh.device is not None:
                with torch.cuda.device(sh.device):
                    self.stream = torch.cuda.Stream(sh.device)
                    self.stream.wait_stream(torch.cuda.current_stream(sh.device))  # destinations were made there
                    try:
                        with torch.cuda.stream(self.stream):
                            self._loop()
                    finally:
                        self.stream.synchronize()  # no copy out of a staging buffer outlives the run
            else:
                self._loop()
        except BaseException as e:  # noqa: BLE001 - re-raised by IOEngine.run
            sh.errors.append(e)
            sh.failed.set()
        finally:
            for buf, _ in self.ring:
                sh.pool.put(buf)
            for buf, _ in self.bands:
                sh.bands.put(buf)

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
                sh.errors.append(task.where.error(e))
                sh.failed.set()
            self.busy += time.perf_counter() - start

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
                task.step.run(self.counter)

    def _buffer(self) -> torch.Tensor:
        """A staging buffer free to write: a new one while the ring is short, else the oldest
        once its copy has finished."""
        pool = self.shared.pool
        start = time.perf_counter()
        try:
            if len(self.ring) < self.depth:
                buf = pool.try_get() if self.ring else pool.get()
                if buf is not None:
                    self.ring.append([buf, None])
                    self.turn = len(self.ring) - 1
                    return buf
            self.turn = (self.turn + 1) % len(self.ring)
            slot = self.ring[self.turn]
            if slot[1] is not None:
                slot[1].synchronize()
            return slot[0]
        finally:
            self.waiting += time.perf_counter() - start

    def band_buffer(self) -> torch.Tensor:
        """This thread's buffer for a computation's inputs (a band of at most ``bands.size``
        bytes), taken from the pool on the first computation and kept (the pool holds one for
        every thread that computes, so taking it never waits). With ``band_depth`` above 1 the
        thread takes more band buffers while the pool has some free (never waiting for one) and
        cycles through them, so that reading the next band overlaps the copy of the last one to
        the GPU; otherwise a buffer is reused once the copy out of it has finished."""
        start = time.perf_counter()
        if not self.bands:
            self.bands.append([self.shared.bands.get(), None])
            self.band = self.bands[0]
        else:
            assert self.band is not None
            at = next(i for i, slot in enumerate(self.bands) if slot is self.band)
            if len(self.bands) < self.band_depth and self.band[1] is not None:
                buf = self.shared.bands.try_get()
                if buf is not None:
                    self.bands.append([buf, None])
            self.band = self.bands[(at + 1) % len(self.bands)]
            if self.band[1] is not None:
                self.band[1].synchronize()
        self.waiting += time.perf_counter() - start
        return self.band[0]

    def _copied(self, slot: list[Any] | None = None) -> None:
        """Mark the current ring buffer (or ``slot``, a [buffer, event]) in use until the
        copies just queued on the stream finish."""
        if self.stream is not None:
            slot = self.ring[self.turn] if slot is None else slot
            if slot[1] is None:
                slot[1] = torch.cuda.Event()
            slot[1].record(self.stream)

    def _read_into(self, path: str, segments: list[tuple[int, int]], mem: torch.Tensor, pos: int = 0) -> int:
        """Read the file's ``segments`` one after the other into uint8 ``mem`` from byte ``pos``
        on; returns the bytes read."""
        fd = self.shared.fds[path]
        first = pos
        start = time.perf_counter()
        for off, n in segments:
            self.calls += syscalls.preadv_into(fd, mem, pos, off, n)
            pos += n
        self.reading += time.perf_counter() - start
        self.nbytes += pos - first
        return pos - first

    def typed_view(self, buf: torch.Tensor, at: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """Bytes ``at`` onward of the uint8 buffer ``buf`` as a contiguous ``dtype`` tensor of
        ``shape`` (``buf`` starts, and ``at`` falls, on a multiple of ``dtype``'s size). The
        thread views each of its buffers as each dtype once and cuts every later view out of
        that in one ``as_strided`` call: a band's inputs cost a tensor call each, and every
        tensor call lets the other threads take the interpreter lock."""
        key = (buf.data_ptr(), buf.device, dtype)
        whole = self._typed.get(key)
        if whole is None:
            usable = buf.numel() // dtype.itemsize * dtype.itemsize
            whole = self._typed[key] = buf[:usable].view(dtype)
        strides, step = [], 1
        for n in reversed(shape):
            strides.append(step)
            step *= n
        return whole.as_strided(shape, strides[::-1], whole.storage_offset() + at // dtype.itemsize)

    def _direct(self, task: DirectRead) -> None:
        syscalls.populate(task.dest)
        self.direct += self._read_into(task.path, task.segments, task.dest)

    def _staged(self, task: StagedRead) -> None:
        buf = self._buffer()
        self.staged += self._read_into(task.path, task.segments, buf)
        non_blocking = self.stream is not None
        for dl in task.deliveries:
            dl.dest.copy_(buf[dl.offset : dl.offset + dl.nbytes].view(dl.dtype).view(dl.shape), non_blocking=non_blocking)
        self._copied()

    def _upload(self, value: torch.Tensor, dest: torch.Tensor) -> None:
        """Copy the host tensor ``value`` into ``dest`` (same shape and dtype, on a device)
        through this thread's staging buffers (pinned on a GPU, so each copy is queued on the
        thread's stream without waiting): whole, or in slices along dim 0 that fit a buffer;
        directly where one entry of dim 0 does not fit."""
        nb = value.numel() * value.element_size()
        if nb > self.shared.chunk:
            rows = self.shared.chunk // max(1, nb // value.shape[0]) if value.dim() else 0
            if rows == 0:
                dest.copy_(value)
                return
            for r in range(0, value.shape[0], rows):
                self._upload(value[r : r + rows], dest[r : r + rows])
            return
        stage = self._buffer()[:nb].view(value.dtype).view(value.shape)
        stage.copy_(value)
        dest.copy_(stage, non_blocking=self.stream is not None)
        self._copied()

    def _compute(self, task: ComputeTask) -> None:
        """A computation: inputs of the ``inputs``/``kernel`` form through :class:`StagingIO`
        (moved to the destination's device first when that is a GPU), others through the source."""
        step = task.step
        if not step.on_device:
            step.run(self.counter)
        else:
            self.inputs.begin()
            try:
                step.run(self.inputs, self.to_device if step.dest.device.type != "cpu" else None)
            finally:
                self.inputs.begin()
        self.computed += 1

    def locate(self, key: str, box: Box) -> tuple[str, list[tuple[int, int]], torch.dtype] | None:
        """Where region ``box`` of source tensor ``key`` is: an opened file, its (offset, nbytes)
        runs in order, the stored dtype; ``None`` when its bytes are not all in one opened
        file, or lie in several runs shorter than ``min_span``."""
        sh = self.shared
        located = sh.source.locate_region(key, box)
        if not located or len(located) != 1:
            return None
        chunk_box, loc = located[0]
        if loc.path not in sh.fds or any(a < o or b > e for (a, b), (o, e) in zip(box, chunk_box, strict=True)):
            return None
        local = tuple((a - o, b - o) for (a, b), (o, _) in zip(box, chunk_box, strict=True))
        starts, run = box_spans(loc.shape, loc.dtype.itemsize, local)
        if len(starts) > 1 and run < sh.min_span:
            return None
        return loc.path, [(loc.offset + s, run) for s in starts], loc.dtype

    def _landing(self, device: torch.device) -> torch.Tensor:
        """This thread's buffer of a band on ``device`` that staged inputs are copied into:
        reused by every computation, since each one's copy and kernel are queued on the
        thread's one stream in order (the next copy into it starts after the last kernel
        reading it)."""
        if self.landing is None or self.landing.device != device:
            self.landing = torch.empty(self.shared.bands.size, dtype=torch.uint8, device=device)
        return self.landing

    def to_device(self, values: tuple[torch.Tensor, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
        """``values`` (host tensors a computation read) as new tensors on ``device``: the
        ``move`` of :meth:`~sdadapt._nodes.Compute.run`. Where some values are views of what
        :class:`StagingIO` staged, the buffer's used bytes cross in one copy (first, so that the
        buffer is marked in use before any other is taken), each such value a view of that; the
        rest (values computed on the host, e.g. rows gathered out of a staged read) through
        :meth:`_upload`."""
        out: list[torch.Tensor | None] = [None] * len(values)
        staged, used = self.inputs.buffer, self.inputs.pos
        inside: dict[int, int] = {}  # value index -> its offset in the staged bytes
        if staged is not None:
            base = staged.data_ptr()
            for i, v in enumerate(values):
                at = v.data_ptr() - base
                if v.device.type == "cpu" and v.is_contiguous() and 0 <= at and at % v.element_size() == 0:
                    if at + v.numel() * v.element_size() <= used:
                        inside[i] = at
        if inside:  # staged bytes that no value is a view of (read, then computed on) stay on the host
            assert staged is not None
            landing = self._landing(device)
            landing[:used].copy_(staged[:used], non_blocking=self.stream is not None)
            self._copied(self.band)
            for i, at in inside.items():
                v = values[i]
                out[i] = self.typed_view(landing, at, v.dtype, tuple(v.shape))
        for i, v in enumerate(values):
            if out[i] is None:
                out[i] = dest = torch.empty(v.shape, dtype=v.dtype, device=device)
                self._upload(v, dest)
        return tuple(t for t in out if t is not None)

    def _source_read(self, task: SourceRead) -> None:
        piece = task.piece
        value = self.counter.read(piece.key, piece.box)
        self.computed += 1
        if self.stream is not None and piece.dest.device.type == "cuda":
            self._upload(value, piece.dest)
        else:
            piece.dest.copy_(value)
