"""Reads straight into GPU memory through kvikio (the optional extra ``sdadapt[cuda]``).

kvikio (RAPIDS) runs a C++ thread pool that reads file ranges into device memory: through
GPUDirect Storage where the machine has it, else with ``pread`` into its own pinned bounce
buffers and copies from there, all outside the interpreter lock. A GPU run uses it for the
pieces whose bytes land contiguously in their destination shard (the planner makes them
:class:`~sdadapt._engine.tasks.DirectRead` tasks, as for a CPU destination): the planning
thread hands each to kvikio as soon as it is planned, without waiting, so that kvikio's queue
holds every such read of the run, and the run waits for them all at its end (after its reader
threads, and also after a failure: nothing writes into the model once the run has returned).
No reader thread, staging buffer or device-lane copy is involved. With
``EngineConfig.kvikio_gathers`` (off by default: measured slower than staged gathers), a
computation whose inputs are gathered on the device
(:meth:`sdadapt._engine.planner.Planner._gather`) has them read by kvikio too, straight into
the gather's buffer on the device (:class:`GatherReads`), and the device lane runs its kernel
once they have all ended. Everything else (small pieces, other
computations and their inputs, fills) keeps the staged path of :mod:`sdadapt._engine.device`.

:func:`select` makes the choice once per process and setting, and logs it in one line: kvikio
when it imports and initialises, else the staged path (kvikio absent, failing to start, or
turned off with ``EngineConfig.kvikio=False`` / ``SDADAPT_IO_KVIKIO=0``). ``kvikio=True`` asks
for it: then its absence or failure is an error naming the extra.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .._base import later
from .._base.gc import gc_paused
from ..errors import LoadError, UsageError
from .device import DeviceLane
from .tasks import Gather, GatherRead, Where

log = logging.getLogger(__name__)

EXTRA = "pip install 'sdadapt[cuda]'"


@dataclass(frozen=True)
class DeviceReads:
    """kvikio, initialised for a process: ``threads`` in its pool, reads cut into tasks of
    ``task_bytes``; ``gds`` says whether it reads through GPUDirect Storage (else POSIX reads
    through its pinned bounce buffers of ``bounce_bytes`` each, with ``O_DIRECT`` where
    ``direct``: kvikio's ``auto_direct_io_read``, which bypasses the page cache)."""

    kvikio: Any
    threads: int
    task_bytes: int
    gds: bool
    bounce_bytes: int = 16 << 20
    direct: bool = False

    def describe(self) -> str:
        """The path in a few words, for logs."""
        if self.gds:
            how = "GPUDirect Storage"
        else:
            how = f"POSIX reads{' with O_DIRECT' if self.direct else ''} through its pinned bounce buffers of {self.bounce_bytes >> 10} KiB"
        return f"kvikio {getattr(self.kvikio, '__version__', '?')} ({how}, {self.threads} threads, {self.task_bytes >> 20} MiB tasks)"

    def open(self, path: str) -> Any:
        """A kvikio file handle for ``path`` (read-only); :meth:`close` it after the run."""
        return self.kvikio.CuFile(path, "r")

    @staticmethod
    def close(handle: Any) -> None:
        """Close a handle from :meth:`open`."""
        handle.close()

    def submit(self, handle: Any, segments: list[tuple[int, int]], dest: Any, where: Where, pending: Pending) -> None:
        """Hand kvikio the reads of the file's ``segments`` ((offset, nbytes), in order) into
        ``dest`` (a contiguous uint8 tensor on the GPU, or a host buffer as a numpy array: kvikio
        takes no CPU tensor; as long as the segments together), one after the other; each is
        added to ``pending`` as soon as it is queued (so that it is waited for even if a later
        one cannot be queued). Returns at once."""
        pos = 0
        for off, n in segments:
            pending.reads.append((handle.pread(dest[pos : pos + n], n, off), off, n, where))
            pending.nbytes += n
            pos += n

    @staticmethod
    def wait(pending: Pending) -> list[LoadError]:
        """Wait for every read in ``pending``, also after one failed (nothing may write into a
        destination once the run has ended); returns the errors, each naming its key and file
        (a short read is a truncated file)."""
        errors: list[LoadError] = []
        for fut, off, n, where in pending.reads:
            try:
                got = fut.get()
            except Exception as e:  # noqa: BLE001 - named and returned
                errors.append(where.error(e))
                continue
            if got != n:
                short = OSError(f"unexpected end of file at byte {off + got} (wanted {n - got} more bytes); the file is truncated")
                errors.append(where.error(short))
        pending.reads.clear()
        return errors


# an internal record: no generated __eq__ / __repr__ (unused; each costs the import an exec)
@dataclass(eq=False, repr=False)
class Pending:
    """Reads handed to kvikio and not yet waited for: (future, file offset, nbytes, what it
    is for) each, and the bytes they read together."""

    reads: list[tuple[Any, int, int, Where]] = field(default_factory=list)
    nbytes: int = 0


class GatherReads:
    """The gathers of one run read by kvikio: :meth:`submit` (on the planning thread) makes a
    gather's buffer on the lane's device and queues kvikio's reads of its inputs into it; one
    thread of its own waits for each gather's reads in the order they were queued, then hands
    the kernel to the device lane. At most ``budget`` bytes of buffers are out at once
    (:meth:`submit` waits for room; a gather larger than that goes alone). A failed read fails
    the run (``fail``) and its kernel is not run; :meth:`close` returns once every read queued
    has ended, also after a failure."""

    def __init__(self, reads: DeviceReads, lane: DeviceLane, fail: Callable[[BaseException], None], budget: int):
        self.reads = reads
        self.lane = lane
        self.fail = fail
        self.budget = budget
        self.nbytes = 0  # read by kvikio into the gathers' buffers
        self._out = 0  # bytes of buffers out
        self._room = threading.Condition()
        self._queue: queue.SimpleQueue[tuple[GatherRead, torch.Tensor, Pending] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None  # started by the first gather

    def submit(self, task: GatherRead, handle: Callable[[str], Any]) -> None:
        """Queue kvikio's reads of ``task``'s inputs into a new buffer (``handle``: the kvikio
        handle of a file); returns once they are queued."""
        n = task.gather.nbytes
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="sdadapt-kvikio-gathers", daemon=True)
            self._thread.start()
        with self._room:
            while self._out and self._out + n > self.budget:
                self._room.wait()
            self._out += n
        pending = Pending()
        try:
            buffer = torch.empty(n, dtype=torch.uint8, device=self.lane.device)
        except BaseException:
            self._give_back(n)
            raise
        try:
            for path, segments, at in task.runs:
                size = sum(s for _, s in segments)
                self.reads.submit(handle(path), segments, buffer[at : at + size], task.where, pending)
        finally:
            self._queue.put((task, buffer, pending))  # whatever was queued is waited for

    def close(self) -> None:
        """Wait for every read queued and hand the last kernels to the lane; stop the thread."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()

    def _give_back(self, n: int) -> None:
        with self._room:
            self._out -= n
            self._room.notify_all()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            task, buffer, pending = item
            try:
                self.nbytes += pending.nbytes
                errors = DeviceReads.wait(pending)
                if errors:
                    self.fail(errors[0])
                elif not self.lane.failed:
                    self.lane.call(functools.partial(_compute, task.gather, buffer), task.where)
            except Exception as e:  # noqa: BLE001 - named and reported
                self.fail(task.where.error(e))
            finally:
                del buffer, item
                self._give_back(task.gather.nbytes)


def _compute(gather: Gather, buffer: torch.Tensor) -> None:
    """Run ``gather``'s kernel on views of ``buffer`` (on the device lane, whose current stream
    it then runs on); the buffer goes back to the allocator only once that stream has passed
    the kernel."""
    step = gather.step
    assert step.kernel is not None
    args = [buffer[at : at + math.prod(shape) * dtype.itemsize].view(dtype).view(shape) for at, dtype, shape in gather.layout]
    step.kernel.run(step.dest, *args)
    if buffer.is_cuda:
        buffer.record_stream(torch.cuda.current_stream(buffer.device))


_LOCK = threading.Lock()
_CHOSEN: dict[tuple[int, int, int | None], DeviceReads | None] = {}
_WARMED: set[tuple[torch.device, int, int, int | None]] = set()  # warm() has run for these
# kvikio's start was asked for (select, prefetch, warm, start_later): a run no longer defers it
_ASKED: set[tuple[int, int, int | None]] = set()


def _import_kvikio() -> Any:
    """The kvikio module, its ``defaults`` loaded (a hook, so that the tests can make it absent
    or failing)."""
    try:
        import kvikio.defaults
    except ImportError as e:
        raise ImportError(f"kvikio is not installed: {e}") from e
    return kvikio


importer: Callable[[], Any] = _import_kvikio


def _start(threads: int, task_bytes: int, bounce_bytes: int | None) -> DeviceReads:
    """Import kvikio and size its thread pool, tasks and bounce buffers (``None``: kvikio's own
    size, ``KVIKIO_BOUNCE_BUFFER_SIZE`` or 16 MiB); raises whatever that raises. The import runs
    with the cycle collector paused (``sdadapt._base.gc``): started in the background once a first
    load has returned, it would otherwise set off, on its thread, the collection the load deferred;
    what it makes lives as long as the process (``long_lived``: no collection ends the pause)."""
    with gc_paused(long_lived=True):
        kvikio = importer()
    defaults = kvikio.defaults
    if defaults.get("num_threads") != threads:
        defaults.set("num_threads", threads)
    if defaults.get("task_size") != task_bytes:
        defaults.set("task_size", task_bytes)
    if bounce_bytes is not None and defaults.get("bounce_buffer_size") != bounce_bytes:
        defaults.set("bounce_buffer_size", bounce_bytes)
    gds = not bool(defaults.is_compat_mode_preferred())
    bounce = int(defaults.get("bounce_buffer_size"))
    return DeviceReads(kvikio, threads, task_bytes, gds, bounce, bool(defaults.get("auto_direct_io_read")))


def select(
    device: torch.device | None, wanted: bool | None, threads: int, task_bytes: int, bounce_bytes: int | None = None
) -> DeviceReads | None:
    """kvikio for a run whose destinations are on ``device``, or ``None`` for the staged path.

    ``wanted``: ``None`` uses kvikio where it is installed and starts, ``False`` never,
    ``True`` always (its absence or failure raises :class:`~sdadapt.errors.UsageError`). The
    outcome is kept per process and setting, and logged once: which path GPU reads take, and
    why.

    Args:
        device: the run's GPU (``None`` or a CPU: no kvikio).
        wanted: ``EngineConfig.kvikio``.
        threads: kvikio's pool size.
        task_bytes: the size kvikio cuts a read into tasks of.

    Returns:
        The initialised :class:`DeviceReads`, or ``None``.

    Raises:
        UsageError: ``wanted`` is ``True`` and kvikio is absent or fails to start.
    """
    if wanted is False or device is None or device.type != "cuda":
        return None
    key = (threads, task_bytes, bounce_bytes)
    _ASKED.add(key)
    with _LOCK:
        if key in _CHOSEN:
            chosen = _CHOSEN[key]
            if chosen is None and wanted:
                raise UsageError(f"EngineConfig(kvikio=True): kvikio could not be started (logged when first tried); {EXTRA}")
            return chosen
        chosen = None
        try:
            chosen = _start(threads, task_bytes, bounce_bytes)
        except ImportError as e:
            if wanted:
                raise UsageError(f"EngineConfig(kvikio=True) needs kvikio, which is not installed ({e}); {EXTRA}") from None
            log.info("GPU reads: the staged path (pinned buffers, the device lane's copies); kvikio is not installed (%s)", EXTRA)
        except Exception as e:  # noqa: BLE001 - any failure to start falls back, named once
            if wanted:
                raise UsageError(f"EngineConfig(kvikio=True): kvikio failed to start: {type(e).__name__}: {e}") from e
            log.warning("GPU reads: the staged path; kvikio is installed but failed to start: %s: %s", type(e).__name__, e)
        else:
            log.info("GPU reads: %s, straight into the destination shards", chosen.describe())
        _CHOSEN[key] = chosen
        return chosen


def prefetch(device: torch.device, wanted: bool | None, threads: int, task_bytes: int, bounce_bytes: int | None = None) -> None:
    """Make :func:`select`'s choice on a background thread (importing kvikio and starting its
    pool take a while), so that the run finds it made; a run that asks before it is done
    waits for it. Nothing happens where the choice is made already or cannot be kvikio."""
    if wanted is False or device.type != "cuda":
        return
    with _LOCK:
        if (threads, task_bytes, bounce_bytes) in _CHOSEN:
            return
    _ASKED.add((threads, task_bytes, bounce_bytes))

    def run() -> None:
        try:
            select(device, wanted, threads, task_bytes, bounce_bytes)
        except Exception as e:  # noqa: BLE001 - the run's own select raises it again
            log.debug("choosing the GPU read path in the background failed: %s", e)

    threading.Thread(target=run, name="sdadapt-kvikio", daemon=True).start()


def warm(
    device: torch.device, files: list[str], wanted: bool | None, threads: int, task_bytes: int, bounce_bytes: int | None = None
) -> threading.Thread | None:
    """On a background thread: once kvikio is chosen (:func:`select`), read the first bounce
    buffer's worth (at most ``task_bytes``) of the largest of ``files`` once per pool thread
    into a scratch buffer on ``device``, all at once, then free it. kvikio starts its threads
    and makes its pinned bounce buffers on their first reads; done while the model is materialised, the load's own
    reads find them made. Done once per process, device and settings: a later load finds
    kvikio warm. Returns the thread (``None``: nothing to warm); a failure is only logged (the
    load's own reads report theirs)."""
    if wanted is False or device.type != "cuda":
        return None
    sized = [(os.path.getsize(f), f) for f in files if os.path.isfile(f)]
    key = (device, threads, task_bytes, bounce_bytes)
    with _LOCK:
        if not sized or key in _WARMED:
            return None
        _WARMED.add(key)
    largest, path = max(sized)
    _ASKED.add((threads, task_bytes, bounce_bytes))

    def run() -> None:
        try:
            reads = select(device, wanted, threads, task_bytes, bounce_bytes)
            size = min(largest, task_bytes, reads.bounce_bytes) if reads is not None else 0
            if reads is None or size == 0:
                return
            with torch.cuda.device(device):
                scratch = torch.empty(threads * size, dtype=torch.uint8, device=device)
                torch.cuda.current_stream(device).synchronize()
                handle = reads.open(path)
                try:
                    pending = Pending()
                    where = Where("(warm-up)", None, path, ())
                    for i in range(threads):
                        reads.submit(handle, [(0, size)], scratch[i * size : (i + 1) * size], where, pending)
                    errors = reads.wait(pending)
                finally:
                    reads.close(handle)
                del scratch
            if errors:
                log.debug("warming kvikio up failed: %s", errors[0])
        except Exception as e:  # noqa: BLE001 - see the docstring
            log.debug("warming kvikio up failed: %s", e)

    th = threading.Thread(target=run, name="sdadapt-kvikio-warm", daemon=True)
    th.start()
    return th


def deferred(wanted: bool | None, threads: int, task_bytes: int, bounce_bytes: int | None = None) -> bool:
    """Whether a GPU run takes the staged path without starting kvikio: ``wanted`` is ``None``
    (kvikio where it starts) and nothing in this process has asked kvikio to start with these
    settings yet. A process's first GPU load so pays neither kvikio's import nor its threads'
    and bounce buffers' start, which competed with materialising the model and made first loads
    longer than the staged path's wherever it was measured; the run then queues kvikio's start
    in the background (:func:`start_later`) for the loads after it, begun once its public call
    returns (:mod:`sdadapt._base.later`)."""
    return wanted is None and (threads, task_bytes, bounce_bytes) not in _ASKED


def start_later(
    device: torch.device, files: list[str], wanted: bool | None, threads: int, task_bytes: int, bounce_bytes: int | None = None
) -> None:
    """After a deferred run (:func:`deferred`): choose kvikio and warm it up on ``files`` on a
    background thread (:func:`warm`; :func:`prefetch` where there is nothing to warm on), so
    that the next load finds it started, or waits for the start in progress."""
    if warm(device, files, wanted, threads, task_bytes, bounce_bytes) is None:
        prefetch(device, wanted, threads, task_bytes, bounce_bytes)


def forget() -> None:
    """Drop the kept choices, warm-ups and queued starts (the next run chooses, logs and warms
    again); for tests."""
    later.drop()
    with _LOCK:
        _CHOSEN.clear()
        _WARMED.clear()
        _ASKED.clear()

