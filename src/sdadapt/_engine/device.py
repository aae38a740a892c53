"""The one thread of a run that makes the device calls.

On a GPU run the readers (:mod:`.workers`) only read: they fill their pinned staging and band
buffers with ``preadv`` and hand them to the :class:`DeviceLane`. Its thread makes every
device call of the run (host-to-device copies, kernels such as a dequantisation, and the waits
for copies to finish), so that no two threads call into the CUDA driver at once: with each
reader issuing its own copies and kernels, the time of each call grew with the number of
threads issuing them, and a reader blocked in an event's wait slowed the lane's own calls.
Once a buffer's copy is queued, the lane records an event behind it and goes on; it hands the
buffer back (calls its ``release``) once the event has passed, which it checks after each piece
of work, and waits for when it has nothing else to do. So a buffer
is never refilled while the DMA out of it is pending, and a reader never waits on the device.

A gather's inputs (:class:`~sdadapt._engine.tasks.Gather`) come as ordinary staged reads: the
lane copies each piece into the gather's buffer on the device, made on its first piece, and
runs the kernel on views of it behind the last piece, all on one stream, so that the buffer
goes back to the allocator only behind the kernel. A band buffer's inputs (a computation that
is not gathered) cross in one copy into a landing buffer on the device (a small ring of
them); its kernel runs on the same stream right behind that copy. The ring's buffers take
turns between two streams, each buffer always on the same one: a copy into a landing
buffer is ordered after the kernel that last read it by its stream alone, while the copy on
one stream overlaps the kernel on the other. So a computation costs the lane a copy, an event
and its kernel's calls, and no cross-stream waits (every device call lets the readers take the
interpreter lock, and the lane then waits to get it back). Inputs computed on the host are
copied on their own.

The lane also runs on the CPU as its "device" (copies and kernels then happen in order on its
thread, and buffers come back as soon as they are copied): the tests drive it so.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

from .._base.regions import Box, box_shape, full_box
from .._recipes.nodes import Compute, Node
from .tasks import Delivery, Gather, Where
from .views import TypedViews

log = logging.getLogger(__name__)


Release = Callable[[], None]  # the buffer may be written again


def device_step(recipe: Node) -> Compute | None:
    """The first computation of ``recipe`` that may run on the destination's device (a
    :class:`~sdadapt._recipes.nodes.Kernel`), from the recipe's nodes in order (each planned
    over one element at its origin), or ``None``."""
    todo = [recipe]
    while todo:
        node = todo.pop()
        kids = node.children()
        if kids and all(n > 0 for n in node.shape):  # a node without inputs computes nothing
            box = tuple((0, 1) for _ in node.shape)
            for step in node.steps(box, torch.empty(box_shape(box), dtype=node.dtype)):
                if isinstance(step, Compute) and step.kernel is not None:
                    return step
        todo.extend(reversed(kids))
    return None


def device_work(recipes: Mapping[str, Node], dests: Mapping[str, torch.Tensor], gather: bool) -> tuple[list[Node], bool]:
    """What a load of ``recipes`` (per target key) into ``dests`` (the target tensors, by key)
    computes on its GPU: one node per kind of device kernel (the node of a recipe's first
    computation that may run there, :func:`device_step`, one per
    :attr:`~sdadapt._recipes.nodes.Kernel.kind`; empty when no recipe computes there), and
    whether a computation may read its inputs into band buffers rather than gather them on the
    device (``gather``: ``EngineConfig.gather_inputs``; see
    :meth:`~sdadapt._engine.planner.Planner._gather`): every one when gathering is off, else
    one with an input that is not a stored region, or whose target shard holds only part of
    each row (columns split across ranks: its inputs lie in the file in runs a row's share
    long, often shorter than the planner gathers)."""
    nodes: dict[object, Node] = {}
    bands = False
    for key, recipe in recipes.items():
        step = device_step(recipe)
        if step is None or step.kernel is None:
            continue
        nodes.setdefault(step.kernel.kind, step.node)
        if not bands:
            bands = not gather or _splits_rows(dests.get(key)) or any(i.read is None for i in step.inputs)
    return list(nodes.values()), bands


def _splits_rows(dest: torch.Tensor | None) -> bool:
    """``dest`` is a DTensor sharded along its last dim (each rank holds part of every row)."""
    if not isinstance(dest, DTensor) or dest.dim() == 0:
        return False
    return any(isinstance(p, Shard) and p.dim in (-1, dest.dim() - 1) for p in dest.placements)


class _Zeros:
    """A ``SourceIO`` that hands out zeros on ``device`` in each key's stored dtype (the inputs
    of a warm-up)."""

    def __init__(self, dtypes: dict[str, torch.dtype], device: torch.device):
        self.dtypes = dtypes
        self.device = device

    def read(self, key: str, box: Box) -> torch.Tensor:
        return torch.zeros(box_shape(box), dtype=self.dtypes[key], device=self.device)


def _leaf_dtypes(node: Node) -> dict[str, torch.dtype]:
    """The stored dtype of each source key under ``node`` (a node without children is a
    stored region: its :meth:`~sdadapt._recipes.nodes.Node.source_region` names it)."""
    out: dict[str, torch.dtype] = {}
    todo = [node]
    while todo:
        n = todo.pop()
        kids = n.children()
        read = None if kids else n.source_region(full_box(n.shape))
        if read is not None:
            out[read.key] = read.dtype
        todo.extend(kids)
    return out


def warm_up(node: Node, device: torch.device) -> None:
    """Run the device kernel of ``node``'s computation (:func:`device_step`) once on ``device``,
    over its kernel's small ``sample`` region, from zeros in its leaves' dtypes."""
    first = device_step(node)
    if first is None or first.kernel is None:
        return
    sample = first.kernel.sample
    dest = torch.empty(box_shape(sample), dtype=first.node.dtype, device=device)
    io = _Zeros(_leaf_dtypes(first.node), device)
    for step in first.node.steps(sample, dest):
        if isinstance(step, Compute) and step.kernel is not None:
            step.kernel.run(step.dest, *(i.value(io) for i in step.inputs))


def warm_kernels(device: torch.device, nodes: Sequence[Node]) -> threading.Thread | None:
    """Run, on a background thread and a side stream, the device kernels of each of ``nodes``
    (from :func:`device_work`) once on a small zero input on ``device``. A kernel's first
    launch in a process loads it into the device; done by the lane in the middle of a load,
    that would hold up every copy queued behind it. Returns the thread (``None``: nothing to
    warm); a failure is only logged, since the load itself runs the same kernels and reports
    its own errors."""
    if not nodes:
        return None

    def run() -> None:
        try:
            if device.type != "cuda":
                for node in nodes:
                    warm_up(node, device)
                return
            with torch.cuda.device(device):
                stream = torch.cuda.Stream(device)
                with torch.cuda.stream(stream):
                    for node in nodes:
                        warm_up(node, device)
                stream.synchronize()
        except Exception as e:  # noqa: BLE001 - see the docstring
            log.debug("warming the device kernels up failed: %s", e)

    th = threading.Thread(target=run, name="sdadapt-warm", daemon=True)
    th.start()
    return th


@dataclass(eq=False)
class LaneTimes:
    """Where a lane's thread spent one run, in seconds: ``wall`` from its start to its end,
    ``cpu`` the thread's CPU time (Python and the driver's calls), ``idle`` waiting for work
    (the readers had handed on nothing), ``copy_wait`` waiting for a copy to finish before a
    buffer could go back. What ``wall`` holds beyond the three the thread spent neither running
    nor in those waits: waiting to take the interpreter lock back after a tensor call let it go,
    or inside a driver call that blocks."""

    wall: float = 0.0
    cpu: float = 0.0
    idle: float = 0.0
    copy_wait: float = 0.0

    def __add__(self, other: LaneTimes) -> LaneTimes:
        """Both runs' times together."""
        return LaneTimes(self.wall + other.wall, self.cpu + other.cpu, self.idle + other.idle, self.copy_wait + other.copy_wait)


# internal records: no generated __eq__ / __repr__ (unused; each costs the import an exec)
@dataclass(eq=False, repr=False)
class _Upload:
    buf: torch.Tensor
    deliveries: Sequence[Delivery]
    release: Release
    where: Where
    handed: bool = False  # release left to the lane, behind the copy out of buf


@dataclass(eq=False, repr=False)
class _Kernel:
    step: Compute
    args: tuple[torch.Tensor, ...]
    staged: torch.Tensor | None  # the band buffer holding some of args, or None
    used: int  # its bytes in use
    inside: dict[int, int]  # arg index -> its offset in staged
    release: Release
    where: Where
    handed: bool = False  # release left to the lane, behind the copy out of staged


@dataclass(eq=False, repr=False)
class _Call:
    fn: Callable[[], object]
    where: Where


_STREAMS: dict[torch.device, tuple[Any, Any]] = {}
_STREAMS_LOCK = threading.Lock()


def _streams(device: torch.device) -> tuple[Any, Any]:
    """The two streams of the lanes on ``device``, made once per process: the caching
    allocator reuses a freed block only on the stream it was allocated on, so runs on new
    streams would each leave their landing buffers cached apart."""
    with _STREAMS_LOCK:
        pair = _STREAMS.get(device)
        if pair is None:
            pair = _STREAMS[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return pair


class DeviceLane:
    """Runs the device side of one engine run on its own thread: :meth:`upload`,
    :meth:`compute` and :meth:`call` queue work and return at once; each ``release`` is called
    on the lane's thread once the copy out of its buffer has finished (or at once, where the
    work failed or was skipped after a failure: nothing was copied), and the buffer may then be
    written again. Errors go to ``on_error`` as they happen."""

    def __init__(
        self, device: torch.device, slot_bytes: int, on_error: Callable[[BaseException], None], slots: int = 4
    ):
        self.device = device
        self.slot_bytes = slot_bytes
        self.on_error = on_error
        self.failed = False
        self._views = TypedViews()
        self._cuda = device.type == "cuda"
        self._slots: list[torch.Tensor] = []  # landing buffer i is used on stream i % 2
        self._nslots = max(1, slots)
        self._turn = 0
        self._work: queue.SimpleQueue[_Upload | _Kernel | _Call | None] = queue.SimpleQueue()
        self._inflight: collections.deque[tuple[Any, Release]] = collections.deque()  # (event, release) per queued copy, oldest first
        self._events: list[Any] = []  # events passed, to record again
        self._streams: tuple[Any, ...] = ()
        self._current: Any = None  # the stream the lane's thread has made current
        self._uploads = 0
        self._thread: threading.Thread | None = None
        self.times = LaneTimes()  # complete once close() has returned

    # --- called by the engine and the readers ---------------------------------------------------

    def start(self) -> None:
        """Start the lane's thread; on a GPU the streams first wait for the caller's current
        stream (where the destinations were made)."""
        if self._cuda:
            after = torch.cuda.current_stream(self.device)
            self._streams = _streams(self.device)
            for stream in self._streams:
                stream.wait_stream(after)
        self._thread = threading.Thread(target=self._run, name="sdadapt-device", daemon=True)
        self._thread.start()

    def upload(self, buf: torch.Tensor, deliveries: Sequence[Delivery], release: Release, where: Where) -> None:
        """Copy each delivery's bytes of host buffer ``buf`` into its destination."""
        self._work.put(_Upload(buf, deliveries, release, where))

    def compute(
        self,
        step: Compute,
        args: tuple[torch.Tensor, ...],
        staged: torch.Tensor | None,
        used: int,
        inside: dict[int, int],
        release: Release,
        where: Where,
    ) -> None:
        """Run ``step``'s kernel on the device with ``args`` (host tensors: its inputs' values):
        the first ``used`` bytes of ``staged`` cross in one copy, and each arg ``i`` of
        ``inside`` is the view of those bytes at offset ``inside[i]``; the other args are
        copied apart."""
        self._work.put(_Kernel(step, args, staged, used, inside, release, where))

    def call(self, fn: Callable[[], object], where: Where) -> None:
        """Run ``fn`` (device work with no staged input, e.g. a fill) on the device."""
        self._work.put(_Call(fn, where))

    def close(self) -> None:
        """Finish everything queued, wait for the device, stop the thread."""
        self._work.put(None)
        if self._thread is not None:
            self._thread.join()

    # --- the device thread ------------------------------------------------------------------

    def _run(self) -> None:
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            with self._on_device():
                while (item := self._next()) is not None:
                    self._do(item)
                    self._hand_back(wait=False)
        finally:
            try:
                t = time.perf_counter()
                self._synchronize()
                self.times.copy_wait += time.perf_counter() - t
            except Exception as e:  # noqa: BLE001 - reported like any other failure
                self._fail(e)
            self._release_all()
            self.times.wall = time.perf_counter() - start
            self.times.cpu = time.thread_time() - cpu

    def _next(self) -> _Upload | _Kernel | _Call | None:
        """The next piece of work; while none is queued, the lane waits for the oldest pending
        copy and hands its buffer back, so that its reader goes on (work queued meanwhile waits
        for that copy: waiting for new work instead, checking the copies in between, was
        measured to shorten neither the readers' waits nor the loads)."""
        while self._inflight:
            try:
                return self._work.get_nowait()
            except queue.Empty:
                t = time.perf_counter()
                self._hand_back(wait=True)
                self.times.copy_wait += time.perf_counter() - t
        try:
            return self._work.get_nowait()
        except queue.Empty:
            t = time.perf_counter()
            item = self._work.get()
            self.times.idle += time.perf_counter() - t
            return item

    def _hand_back(self, wait: bool) -> None:
        """Release the buffers whose copies have finished, oldest first; ``wait``: wait for the
        oldest one's copy first. A failed wait or check fails the load (:meth:`_fail`)."""
        try:
            while self._inflight:
                event, release = self._inflight[0]
                if wait:
                    event.synchronize()
                    wait = False
                elif not event.query():
                    return
                self._inflight.popleft()
                self._events.append(event)
                release()
        except Exception as e:  # noqa: BLE001 - reported like any other failure
            self._fail(e)

    def _release_all(self) -> None:
        """Release every buffer still out (the device is idle: nothing is copied out of them)."""
        while self._inflight:
            self._inflight.popleft()[1]()

    @contextlib.contextmanager
    def _on_device(self) -> Iterator[None]:
        if not self._cuda:
            yield
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self._streams[0]):
            self._current = self._streams[0]
            yield

    def _synchronize(self) -> None:
        for stream in self._streams:
            stream.synchronize()

    def _use(self, i: int) -> Any:
        """Make stream ``i`` the thread's current one (the device calls that follow go there);
        returns it (``None`` on the CPU)."""
        if not self._cuda:
            return None
        stream = self._streams[i]
        if stream is not self._current:
            torch.cuda.set_stream(stream)
            self._current = stream
        return stream

    def _fail(self, e: BaseException) -> None:
        """Report ``e`` and stop: the work still queued is skipped, and every buffer out is
        released once the device has finished with it (or failed to: nothing more runs)."""
        self.failed = True
        self.on_error(e)
        with contextlib.suppress(Exception):
            self._synchronize()  # nothing may still be copied out of the buffers
        self._release_all()

    def _do(self, item: _Upload | _Kernel | _Call) -> None:
        try:
            if self.failed:
                return
            match item:
                case _Upload():
                    self._upload(item)
                case _Kernel():
                    self._kernel(item)
                case _Call():
                    item.fn()
        except Exception as e:  # noqa: BLE001 - named and reported
            self._fail(item.where.error(e))
        finally:
            if not isinstance(item, _Call) and not item.handed:
                item.release()

    def _behind_copy(self, stream: Any, release: Release) -> None:
        """Release a buffer once the copies queued on ``stream`` so far have finished (at once
        on the CPU, where they have): an event recorded there, watched by :meth:`_hand_back`.
        The events are blocking-sync: the lane sleeps, not spins, while it waits for one."""
        if stream is None:
            release()
            return
        self._inflight.append((self._record(stream), release))

    def _record(self, stream: Any) -> Any:
        """An event recorded on ``stream`` (one that has passed, reused, or a new one)."""
        ev = self._events.pop() if self._events else torch.cuda.Event(blocking=True)
        ev.record(stream)
        return ev

    def _upload(self, item: _Upload) -> None:
        gather = item.deliveries[0].into
        if gather is not None:
            self._gathered(item, gather[0])
            return
        stream = self._use(self._uploads % 2)
        self._uploads += 1
        cut = self._views.cut
        for dl in item.deliveries:
            dl.dest.copy_(cut(item.buf, dl.offset, dl.dtype, dl.shape), non_blocking=self._cuda)
        item.handed = True
        self._behind_copy(stream, item.release)

    def _gathered(self, item: _Upload, gather: Gather) -> None:
        """Copy a piece of ``gather``'s inputs into its device buffer (made on its first piece,
        on the stream all its pieces and its kernel use, so that they run in order and the
        buffer is reused only behind the kernel); after the last piece, run the kernel on
        views of the buffer."""
        if gather.buffer is None:
            gather.stream = self._uploads % 2
            self._uploads += 1
            stream = self._use(gather.stream)
            gather.buffer = torch.empty(gather.nbytes, dtype=torch.uint8, device=self.device)
        else:
            stream = self._use(gather.stream)
        buf, into = item.buf, gather.buffer
        for dl in item.deliveries:
            assert dl.into is not None and dl.into[0] is gather, "a staged read delivers to one gather"
            at = dl.into[1]
            into[at : at + dl.nbytes].copy_(buf[dl.offset : dl.offset + dl.nbytes], non_blocking=self._cuda)
        item.handed = True
        self._behind_copy(stream, item.release)
        gather.arrived += 1
        if gather.arrived < gather.pieces:
            return
        args = [into[at : at + math.prod(shape) * dtype.itemsize].view(dtype).view(shape) for at, dtype, shape in gather.layout]
        gather.buffer = None  # back to the allocator, which reuses it only for later work on this stream
        step = gather.step
        assert step.kernel is not None
        step.kernel.run(step.dest, *args)

    def _kernel(self, item: _Kernel) -> None:
        args, staged, inside = item.args, item.staged, item.inside
        out: list[torch.Tensor | None] = [None] * len(args)
        if inside:
            assert staged is not None
            i = self._slot()
            slot = self._slots[i]
            stream = self._use(i % 2)  # where this landing buffer is always used
            head = self._views.head
            head(slot, item.used).copy_(head(staged, item.used), non_blocking=self._cuda)
            item.handed = True
            self._behind_copy(stream, item.release)
            for k, at in inside.items():
                v = args[k]
                out[k] = self._views.cut(slot, at, v.dtype, tuple(v.shape))
        for k, v in enumerate(args):
            if out[k] is None:  # computed on the host (e.g. rows gathered out of a read)
                out[k] = dest = torch.empty(v.shape, dtype=v.dtype, device=self.device)
                dest.copy_(v)
        assert item.step.kernel is not None
        item.step.kernel.run(item.step.dest, *out)

    def _slot(self) -> int:
        """The next landing buffer of the ring (made on first use), by its index."""
        if len(self._slots) < self._nslots:
            self._slots.append(torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device))
            return len(self._slots) - 1
        i = self._turn
        self._turn = (self._turn + 1) % self._nslots
        return i
