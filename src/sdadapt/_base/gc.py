"""Python's cycle collector paused for the length of a load, and resumed without a collection
falling due inside it.

A full collection walks every object of the process (torch alone makes a few hundred thousand),
so one that lands inside a load stalls it for a noticeable time, and with it every reading
thread (the collector holds the GIL). Where it lands depends on how many objects the process
made before: it is noise to a load, never useful work. Reference counting still frees all
acyclic garbage while the collector is paused; the cycles a load leaves are collected after it.

Resuming is where a collection would land: the objects made while paused all count towards
the next automatic collection, so the first allocation after ``gc.enable()`` sets one off, and
it is a full one whenever the process owes it (its oldest generation has grown by a quarter
since the last full collection: a model built since then, mostly). The pause so ends with a
collection of the youngest generation only (the objects made while paused that are still
alive, a millisecond or so), which starts the count afresh: a full collection the process owes
runs at its next automatic collection, in the caller's code after the call, where it would have
run without sdadapt.

An import's pause (:func:`gc_paused` with ``long_lived=True``) ends without even that collection
where the interpreter allows it: what an import makes (modules, classes, functions, pydantic's
schemas) lives as long as the process, so walking it frees nothing. It is moved to the oldest
generation instead (``gc.freeze()`` then ``gc.unfreeze()``: list splices, whatever the size of
the heap), where the next full collection sees it as it sees the rest of the process. That also
starts every generation's count afresh: a full collection the process owes then runs a little
later in the caller's code (after the oldest generation's count of middle collections), never
inside sdadapt. The pause is one for the whole process, counted across threads: the
collector comes back on when the last pause ends (a background thread's import outlives the
load that started it), and only if it was on when the first began.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_LOCK = threading.RLock()  # re-entrant: a finalizer the collection runs may pause too
_paused = 0  # pauses in progress, all threads together
_resume = False  # the collector was on when the first of them began
_long_lived = True  # every pause in progress has made only long-lived objects (imports)

_SPLICES = sys.version_info < (3, 14) and "t" not in getattr(sys, "abiflags", "")
"""``gc.freeze()`` and ``gc.unfreeze()`` splice the generations' lists (cost independent of the
heap): CPython before 3.14, built with the GIL (3.14's incremental collector and free-threaded
builds walk every object to freeze them)."""


def pause(*, long_lived: bool = False) -> None:
    """Turn the cycle collector off until the matching :func:`resume` (pauses nest, across threads).

    Args:
        long_lived: the paused code makes only objects that live as long as the process (an
            import); the last pause to end then moves them to the oldest generation instead of
            collecting the youngest, if every pause since the first was such a one.
    """
    global _paused, _resume, _long_lived
    with _LOCK:
        if _paused == 0:
            _resume = gc.isenabled()
            _long_lived = True
            gc.disable()
        _long_lived = _long_lived and long_lived
        _paused += 1


def resume() -> None:
    """End a :func:`pause`: the last one to end collects the youngest generation (or, after
    imports only, moves it to the oldest: see the module's docstring), then turns the collector
    back on if it was on when the first pause began."""
    global _paused
    with _LOCK:
        _paused -= 1
        if _paused == 0 and _resume:
            if _long_lived and _SPLICES and gc.get_freeze_count() == 0:  # never thaw what the caller froze
                gc.freeze()
                gc.unfreeze()
            else:
                gc.collect(0)
            gc.enable()


@contextlib.contextmanager
def gc_paused(*, long_lived: bool = False) -> Iterator[None]:
    """No cyclic garbage collection inside the block (:func:`pause`); at its end (also by an
    exception) the collector is back as it was (:func:`resume`).

    Args:
        long_lived: the block makes only objects that live as long as the process (an import).

    Example:
        >>> import gc
        >>> with gc_paused():
        ...     gc.isenabled()
        False
    """
    pause(long_lived=long_lived)
    try:
        yield
    finally:
        resume()


def without_gc(fn: F) -> F:
    """``fn`` run with the cycle collector paused (:func:`gc_paused`)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with gc_paused():
            return fn(*args, **kwargs)

    return run  # type: ignore[return-value]
