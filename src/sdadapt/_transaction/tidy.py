"""The public operations' errors as a user sees them, the clock of a whole call, and the
warnings of torch's that sdadapt's own calls would print for nothing.

An sdadapt error that leaves a public operation (``load``, ``load_state``, ``save_state``,
``export``, ``plan_load``) says what went wrong and what to do in its message; the frames of
sdadapt's internals that raised it and the exception it was made from are noise to a user, so
they are cut: the traceback starts at the public call. ``SDADAPT_DEBUG=1`` keeps them all (for
a bug report). Errors that are not sdadapt's are never touched.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import os
import time
import warnings
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

from .._base import later
from .._base.distributed import CHECKPOINT
from ..errors import SdadaptError

P = ParamSpec("P")
R = TypeVar("R")

_started: contextvars.ContextVar[float | None] = contextvars.ContextVar("sdadapt_call_started", default=None)


def debugging() -> bool:
    """``SDADAPT_DEBUG=1``: errors keep sdadapt's own traceback frames and their cause."""
    return os.environ.get("SDADAPT_DEBUG", "") not in ("", "0")


def public(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` as a public operation: its clock starts on entry (:func:`call_started`), and an
    :class:`SdadaptError` it raises leaves with no internal frames and no exception chain (unless
    :func:`debugging`). Every rank's one-line error names the call's checkpoint (its ``src``, else
    its ``dst``: :data:`~sdadapt._base.distributed.CHECKPOINT`). Once the outermost public call
    ends, what it queued for after it starts (:mod:`sdadapt._base.later`). Put it outermost,
    above the other decorators."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        token = _started.set(time.perf_counter()) if _started.get() is None else None
        named = CHECKPOINT.set(_checkpoint_of(signature, args, kwargs))
        outermost = later.enter()
        try:
            return fn(*args, **kwargs)
        except SdadaptError as error:
            if debugging():
                raise
            raise error.with_traceback(None) from None  # SDADAPT_DEBUG=1 shows sdadapt's own frames
        finally:
            CHECKPOINT.reset(named)
            if token is not None:
                _started.reset(token)
            later.leave(outermost)  # what the call left to start once it returned (kvikio's start)

    return call


def _checkpoint_of(signature: inspect.Signature, args: tuple[object, ...], kwargs: dict[str, object]) -> str | None:
    """The checkpoint a public call names: its ``src`` argument, else its ``dst`` (a path, or an
    open source's path); ``None`` when it has neither or they do not bind."""
    try:
        given = signature.bind_partial(*args, **kwargs).arguments
    except TypeError:  # the call itself reports its bad arguments
        return None
    for name in ("src", "dst"):
        value = given.get(name)
        path = getattr(value, "path", value)
        if isinstance(path, (str, os.PathLike)):
            return os.fspath(path)
    return None


def call_started() -> float:
    """When the outermost public call running now began (``time.perf_counter``); now if none."""
    started = _started.get()
    return time.perf_counter() if started is None else started


@contextlib.contextmanager
def single_process_quiet() -> Iterator[None]:
    """Without DCP's warning that it assumes a single process (``no_dist=True``, or no process
    group): sdadapt passes it on purpose, for one process or for a rank reading alone."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninitialized")
        yield
