"""Saves that do not stop training: ``save_state(..., async_=True)``.

The caller's thread takes the state dicts (remembered between saves: :mod:`.taken`) and stages
them (tensors copied into host memory by DCP's own stager, ``Stateful`` extras turned into
their ``state_dict()``, other values copied), and nothing more: a thread of this process then
checks the folder, resolves the adapter, agrees with the other ranks (every rank's checks, the
same adapter and versions), makes the report and runs the
collective save of the staged copy (DCP's ``.metadata`` last, then ``sdadapt.json``) over a
gloo group of the same ranks, made once per group by that thread (the first save's caller does
not wait for the ranks to meet), so that the training loop's collectives on its own group go
on meanwhile (as torchtitan's asynchronous checkpointer does). A check that
failed on any rank is raised by every rank's ``wait()``. One save runs at a time per process:
a new one waits for the one before. At exit, sdadapt's exit handler lets the thread end what it
was handed before the interpreter finalizes, for a bounded time (:func:`finish_at_exit`).
"""

from __future__ import annotations

import _thread
import contextlib
import errno
import io
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.stateful import Stateful

from .._base import teardown
from .._base.distributed import is_distributed
from ..errors import SdadaptError, StateError
from .saved import SaveReport

log = logging.getLogger(__name__)

Write = Callable[[dict[str, Any], "dist.ProcessGroup | None"], SaveReport]

# held weakly: torch's world holds each group until destroy_process_group(), which must end it
# (its gloo threads joined) rather than leave it to the interpreter's finalization
_GROUPS: weakref.WeakValueDictionary[tuple[int, ...], dist.ProcessGroup] = weakref.WeakValueDictionary()
_RUNNING: list[SaveHandle] = []  # the save this process runs in the background, if any
_WORLD = threading.Event()  # set once the writing thread was handed work over the process group


def background_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """A gloo group over ``group``'s ranks for the background thread's collectives, made once
    (only its members take part in making it). Called on the writing thread only (see
    :func:`prepare_group`), so groups are made in the same order on every rank while the
    caller's thread goes on with its own collectives."""
    if not is_distributed():
        return None
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    made = _GROUPS.get(ranks)
    if made is None or made not in dist.distributed_c10d._world.pg_map:  # none, or destroyed since (still held elsewhere)
        made = _GROUPS[ranks] = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)
    return made


def prepare_group(group: dist.ProcessGroup | None) -> None:
    """Have the writing thread make the background group over ``group``'s ranks now, while the
    caller goes on (a save made later finds it made; a failure here is met again, and raised,
    by that save)."""

    def make() -> None:
        try:
            background_group(group)
        except Exception as e:  # noqa: BLE001 - the first save tries again and raises it
            log.warning("making the gloo group for background saves failed (%s: %s)", type(e).__name__, e)

    _WORLD.set()
    start_writer().put(make)


_STAGER: list[DefaultStager] = []  # one per process, kept: its host copies are reused by the next save


def stage(state: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``state`` in host memory that training may no longer change: tensors (and
    DTensors' shards) copied, ``Stateful`` values turned into their ``state_dict()``.

    The stager is kept for the process's life: DCP's stager keeps the host copy of each tensor
    it staged (keyed by the tensor's storage, weakly) and copies into it again the next time,
    so a later save touches no fresh memory (a fresh allocation's page faults cost about 4x the
    copy). Safe because one save runs at a time: the copy is reused only after the write that
    read it ended (:func:`start_save` waits for it first)."""
    plain = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}
    if not _STAGER:
        _STAGER.append(DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=False,
                                                    use_non_blocking_copy=False)))  # fmt: skip
    staged = _STAGER[0].stage(plain)
    if not _reusable(_STAGER[0]):
        _STAGER.clear()  # the next save makes a stager of its own
    assert isinstance(staged, dict)
    return staged


def _reusable(stager: DefaultStager) -> bool:
    """Whether ``stager`` can stage again. torch 2.11's ``DefaultStager`` closes its state-dict
    stager after each stage (its table of copiers emptied: a second stage fails on the first
    class it meets); later releases keep it open. Where torch no longer shows that table, a
    new stager each save is the safe answer."""
    inner = getattr(stager, "_state_dict_stager", None)
    return bool(getattr(inner, "_deepcopy_dispatch", None))


class SaveHandle:
    """A ``save_state(..., async_=True)`` writing in the background on this rank.

    Attributes:
        path: the folder being written.
        staging_seconds: how long staging the state took: taking its state dicts and copying
            them into host memory.
        held_seconds: how long the call held the caller: the staging, plus handing the write
            to the writing thread (argument checks, the save before awaited, the thread woken).

    Example::

        pending = sdadapt.save_state(model, "ckpt/step_200", optimizer, async_=True)
        train_more(model)  # the save is written meanwhile
        saved = pending.wait()  # the SaveReport, or the save's error
    """

    def __init__(self, path: str, staging_seconds: float):
        self.path = path
        self.staging_seconds = staging_seconds
        self.held_seconds = staging_seconds
        self._saved: SaveReport | None = None
        self._error: BaseException | None = None
        self._finished = threading.Event()

    def done(self) -> bool:
        """Whether the background write has finished (well or not).

        Returns:
            ``True`` once :meth:`wait` would return or raise at once.

        Example::

            if pending.done():
                pending.wait()
        """
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> SaveReport:
        """Wait for the background write.

        Args:
            timeout: seconds to wait at most (``None``: until it ends).

        Returns:
            The :class:`~sdadapt.reports.SaveReport` of the save.

        Raises:
            StateError: the save failed on this rank or another (every rank raises); or it did not
                end within ``timeout``.

        Example::

            saved = pending.wait()
        """
        if not self._finished.wait(timeout):
            raise StateError(f"saving to {self.path} is still running after {timeout} s")
        if self in _RUNNING:
            _RUNNING.remove(self)
        if self._error is not None:
            e = self._error
            raise e if isinstance(e, SdadaptError) else StateError(f"saving to {self.path} failed ({type(e).__name__}: {e})")
        assert self._saved is not None
        return self._saved

    def __repr__(self) -> str:
        state = "done" if self.done() else "writing"
        return f"SaveHandle({self.path!r}, {state}, held the caller {self.held_seconds:.3f} s, staging {self.staging_seconds:.3f} s)"


def start_save(state: dict[str, Any] | None, path: str, group: dist.ProcessGroup | None, t0: float,
               write: Write, taking: float = 0.0) -> SaveHandle:  # fmt: skip
    """Wait for this process's save before, stage ``state``, hand ``write(staged, group)`` to the
    writing thread, over the background group (made there the first time), and return its
    handle. The caller does nothing else: ``write`` checks, agrees with the other ranks and
    makes the report, in the thread (``state`` is ``None`` on a rank whose checks failed:
    nothing is staged, and the agreement raises the error on every rank). ``taking``: the
    seconds the caller took to take ``state``, counted in the handle's staging with the copy."""
    for h in list(_RUNNING):  # one save at a time: its error is raised here, on every rank
        h.wait()
    t_stage = time.perf_counter()
    with torch.no_grad():  # the state may hold the live parameters: copies without autograd
        staged = stage(state) if state is not None else {}
    handle = SaveHandle(path, taking + time.perf_counter() - t_stage)
    distributed = is_distributed()

    def run() -> None:
        try:
            made = background_group(group) if distributed else None  # made here, not in the call, the first time
            if distributed and made is None:  # never a single-process save of one rank's shards
                raise StateError(f"saving to {path} in the background failed: the process group was destroyed before it "
                                 "was written; wait for the save (handle.wait(), Checkpointer.close()) before "
                                 "destroy_process_group()")  # fmt: skip
            saved = write(staged, made)
            saved.seconds = time.perf_counter() - t0
            handle._saved = saved
            log.info("%s (in the background; the caller was held %.3f s)", saved.format(), handle.held_seconds)
        except BaseException as e:  # noqa: BLE001 - a CheckpointException or a peer gone: raised by wait()
            handle._error = e
        finally:
            handle._finished.set()

    _RUNNING.append(handle)
    if distributed:
        _WORLD.set()
    handle.held_seconds = time.perf_counter() - t0
    start_writer().put(run)  # last: the thread it wakes may take the interpreter lock from here on
    return handle


# by process id (a forked child starts its own): the writing thread's queue (``None`` ends it) and
# the event it sets once it has ended
_WRITER: dict[int, tuple[queue.SimpleQueue[Callable[[], None] | None], threading.Event]] = {}


def start_writer() -> queue.SimpleQueue[Callable[[], None] | None]:
    """The queue of this process's writing thread, started on first use and kept until the
    process exits (:func:`finish_at_exit`). Started with ``_thread.start_new_thread``, which
    returns at once, where ``Thread.start`` waits until the new thread has been scheduled (long
    on a busy host: the first save's caller would wait for it)."""
    pid = os.getpid()
    if pid not in _WRITER:
        jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        ended = threading.Event()

        def serve() -> None:
            try:
                while (job := jobs.get()) is not None:
                    job()
            finally:
                ended.set()

        _thread.start_new_thread(serve, ())
        _WRITER[pid] = (jobs, ended)
        teardown.at_exit(finish_at_exit)
    return _WRITER[pid][0]


EXIT_WAIT_S = 600.0
"""How long exit waits, by default, for a background save while the process group is up:
``SDADAPT_EXIT_WAIT_S`` (seconds; ``inf`` waits without limit) sets it. A save still writing
then is given up, and its folder never counts as complete (:func:`given_up`)."""

DESTROYED_WAIT_S = 10.0
"""How long exit waits at most for a background save once the process group was destroyed under
it (a writer may wait for a rank that will never come)."""

STOP_WAIT_S = 10.0
"""How long exit waits, once it gave a save up, for the writing thread to stop at its next file
write (a thread still writing when the interpreter finalizes, inside torch's serialization,
aborts the process)."""

_GIVEN_UP = threading.Event()  # set once exit stopped waiting for the writing thread


def given_up() -> bool:
    """Whether this process's exit stopped waiting for its background save: the writing thread,
    if it runs on, must write no more (:func:`storage_writer`) nor mark the folder complete
    (``sdadapt.json``)."""
    return _GIVEN_UP.is_set()


class _Stopping(io.BufferedWriter):
    """A file of a save: once exit gave the save up, its next write raises."""

    def write(self, data: Any) -> int:
        if _GIVEN_UP.is_set():
            raise OSError(errno.ECANCELED, "the save was given up at exit")
        return super().write(data)


class _StoppingFileSystem(FileSystem):
    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with _Stopping(io.FileIO(os.fspath(path), "wb")) as stream:
            yield stream


def storage_writer(path: str) -> FileSystemWriter:
    """DCP's writer of the folder ``path``, as ``dcp.save(checkpoint_id=path)`` makes it, whose
    files stop taking writes once exit gave the save up (:func:`given_up`): the writing thread
    then fails at its next write and ends, its ``.metadata`` unwritten."""
    writer = FileSystemWriter(path)
    writer.fs = _StoppingFileSystem()
    return writer


def exit_wait_s() -> float | None:
    """How long exit waits for a background save while the world is up: ``SDADAPT_EXIT_WAIT_S``
    (read at exit, so a program may set it late), else :data:`EXIT_WAIT_S`; ``None``: no limit."""
    raw = os.environ.get("SDADAPT_EXIT_WAIT_S", "").strip()
    if not raw:
        return EXIT_WAIT_S
    try:
        seconds = float(raw)
    except ValueError:
        log.warning("SDADAPT_EXIT_WAIT_S=%r is not a number of seconds (or inf); exit waits %g s for a background save",
                    raw, EXIT_WAIT_S)  # fmt: skip
        return EXIT_WAIT_S
    return None if seconds == float("inf") else max(seconds, 0.0)


def finish_at_exit() -> None:
    """At exit (as the main thread ends, before any ``atexit`` handler, and again in sdadapt's
    exit handler for a save started since: :func:`sdadapt._base.teardown.at_exit`): let the
    writing thread end what it was handed (a save in flight, or making its group: the other
    ranks wait at their exit for theirs too), for :func:`exit_wait_s` at most
    (:data:`DESTROYED_WAIT_S` once the world its saves were made over was destroyed), then end
    the background groups, so that no thread of a save is still working, nor a gloo thread of
    its group, when the interpreter finalizes (see :mod:`sdadapt._base.teardown`). A save that
    failed, or was given up, is logged with its folder (no one waits for it); the one before
    stays the latest complete checkpoint."""
    writer = _WRITER.pop(os.getpid(), None)
    if writer is None:
        return
    jobs, ended = writer
    jobs.put(None)
    destroyed = _WORLD.is_set() and not is_distributed()
    bound = exit_wait_s()
    if destroyed:  # a writer may wait for a rank that will never come (making the group)
        bound = DESTROYED_WAIT_S if bound is None else min(bound, DESTROYED_WAIT_S)
    writing = [h.path for h in _RUNNING if not h.done()]
    if writing and not ended.is_set():
        limit = "without limit" if bound is None else f"up to {bound:g} s"
        log.info("waiting %s for the save to %s (in the background) to end before this process exits",
                 limit, ", ".join(writing))  # fmt: skip
    t0 = time.monotonic()
    try:
        finished = ended.wait(bound)
    except KeyboardInterrupt:  # Ctrl-C while exit waits: give the save up now
        finished, bound = False, None
    if not finished:
        _GIVEN_UP.set()  # before anything else: the writer stops at its next write, and marks no folder complete
        stopped = ended.wait(STOP_WAIT_S)
        what = f"the save to {', '.join(writing)}" if writing else "the background saves' thread (making its group)"
        if bound is None:
            why = f"was interrupted {time.monotonic() - t0:.1f} s after this process began to exit"
        else:
            why = f"did not end {bound:g} s after this process began to exit " + (
                "with the process group destroyed (wait for the save before destroy_process_group())" if destroyed
                else "(SDADAPT_EXIT_WAIT_S sets how long exit waits; or wait for the save, handle.wait() or "
                     "Checkpointer.close(), before exiting)")  # fmt: skip
        still = "" if stopped else f" (its thread still waits, for other ranks, {STOP_WAIT_S:g} s later)"
        log.warning("%s in the background %s; it is given up%s and is not a complete checkpoint", what, why, still)
        if not stopped:
            return
    for h in list(_RUNNING):
        if h._error is not None and not given_up():
            log.warning("the save to %s in the background failed (%s: %s); it is not a complete checkpoint",
                        h.path, type(h._error).__name__, h._error)  # fmt: skip
    _RUNNING.clear()
    for group in list(_GROUPS.values()):  # a destroyed world took its groups with it
        try:
            if dist.is_initialized() and group in dist.distributed_c10d._world.pg_map:
                dist.destroy_process_group(group)
        except Exception as e:  # noqa: BLE001 - left to the interpreter's end
            log.debug("cannot end the background saves' group: %s", e)


__all__ = ["DESTROYED_WAIT_S", "EXIT_WAIT_S", "STOP_WAIT_S", "SaveHandle", "background_group", "exit_wait_s", "finish_at_exit",
           "given_up", "prepare_group", "stage", "start_save", "start_writer", "storage_writer"]
