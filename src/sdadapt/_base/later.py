"""Work a public call leaves until it has returned.

A process's first GPU load reads without kvikio and starts kvikio for the loads after it: an
import and a thread pool started on a background thread. Started inside the load, that thread
competes for the GIL with the load's last Python steps (the checks, the commit, the report);
queued here, it starts once the outermost public call returns (``_transaction.tidy.public``
marks the call: :func:`enter`, :func:`leave`), or when the next engine run begins, whichever
comes first, so the next load still finds it started or under way. Outside a public call (an
engine run under ``dcp.load``, as the torchtitan bridge's reader runs it) it starts at once.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

_LOCK = threading.Lock()
_QUEUED: list[Callable[[], None]] = []
_IN_CALL: contextvars.ContextVar[bool] = contextvars.ContextVar("sdadapt_in_public_call", default=False)


def enter() -> contextvars.Token[bool] | None:
    """A public call begins: a token for :func:`leave` where it is the outermost, else ``None``."""
    return None if _IN_CALL.get() else _IN_CALL.set(True)


def leave(token: contextvars.Token[bool] | None) -> None:
    """A public call ends (also by an error): the outermost one runs what was queued meanwhile."""
    if token is not None:
        _IN_CALL.reset(token)
        run_queued()


def queue(fn: Callable[[], None]) -> None:
    """Run ``fn`` (it should only start background work) once the running public call returns;
    at once where none is running on this thread."""
    if not _IN_CALL.get():
        _run([fn])
        return
    with _LOCK:
        _QUEUED.append(fn)


def run_queued() -> None:
    """Run what :func:`queue` holds, in order, each once; a failure is logged, never raised (what
    runs here only starts work that a later call would otherwise start itself)."""
    with _LOCK:
        todo = _QUEUED[:]
        _QUEUED.clear()
    _run(todo)


def _run(todo: list[Callable[[], None]]) -> None:
    for fn in todo:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - see run_queued
            log.debug("starting %r after the call failed: %s", fn, e)


def queued() -> int:
    """How many are waiting (for tests)."""
    with _LOCK:
        return len(_QUEUED)


def drop() -> None:
    """Forget what is waiting, unrun (for tests)."""
    with _LOCK:
        _QUEUED.clear()
