"""Python's cycle collector paused for the length of a load.

A full collection walks every object of the process (torch alone makes a few hundred thousand),
so one that lands inside a load stalls it for a noticeable time, and with it every reading
thread (the collector holds the GIL). Where it lands depends on how many objects the process
made before: it is noise to a load, never useful work. Reference counting still frees all
acyclic garbage while the collector is paused; the cycles a load leaves are collected after it.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside the block; the collector is turned back on when the
    block ends (also by an exception), if it was on when the block began (blocks nest)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def without_gc(fn: F) -> F:
    """``fn`` run with the cycle collector paused (:func:`gc_paused`)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with gc_paused():
            return fn(*args, **kwargs)

    return run  # type: ignore[return-value]
