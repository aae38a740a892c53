"""Process groups ended while the interpreter is whole: an exit handler.

After FSDP2 / DTensor work, ``destroy_process_group()`` does not end a gloo group: torch 2.13's
DTensor caches (sharding propagation, redistribute plans, mesh topology) keep the DeviceMesh,
and the mesh keeps its ProcessGroup, so the group's threads run on while the interpreter
finalizes. A gloo thread that retires a collective whose tensor's Python object it alone still
holds must take the GIL to release that object, inside the work's destructor; once finalization
has begun, CPython ends such a thread with ``pthread_exit``, whose unwinding through the
noexcept destructor calls ``std::terminate``: "terminate called without an active exception",
and the process aborts (tests/reports/teardown-abort-cpu2-2026-12-07.md).

:func:`release_groups` runs at exit, before finalization: once the world was destroyed it empties
those caches and collects the cycles that hold a model's meshes, so that a group nothing else
holds is destroyed there, and its destructor joins its threads while they can still take the GIL.
torch 2.11 also keeps the mesh of every DTensor view op (``detach``, ``alias``: FSDP2 detaches each
parameter it makes) through a reference that no Python object holds, so no cache emptied here
frees it: that mesh's groups end with the process (their threads idle once the world is destroyed).
Before it, the handler runs what :func:`at_exit` was given (a background save's writer finishing
its save and ending its group: a thread still working when finalization begins would meet the
same end). What :func:`at_exit` is given also runs earlier, as the main thread ends and before
any ``atexit`` handler (Python runs those last-registered first, so a handler a program
registered after sdadapt's would otherwise run first, and one that destroys the process group
or calls ``os._exit`` would cut a save short): through ``threading``'s hook for that moment,
which ``concurrent.futures`` uses to let its pools finish their work.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import logging
import os
import sys
import threading
from collections.abc import Callable

import torch.distributed as dist

log = logging.getLogger(__name__)

GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")
"""The names of a gloo group's threads (its workers and its transport's event loop)."""

# torch's caches that keep a DeviceMesh once its world is destroyed: (module, attribute path of
# the call that empties one); a name this torch lacks is skipped
_CACHES = (
    ("torch.distributed.tensor.debug", "_clear_sharding_prop_cache"),
    ("torch.distributed.tensor._redistribute", "clear_redistribute_planner_cache"),
    ("torch.distributed.tensor._redistribute", "_gen_transform_infos.cache_clear"),
    ("torch.distributed.tensor._collective_utils", "MeshTopoInfo.build_from_mesh.cache_clear"),
)


def thread_names() -> list[str] | None:
    """The names of this process's threads (Linux's ``/proc``); ``None`` where they cannot be read."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    names = []
    for task in tasks:
        with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/comm", encoding="utf-8") as f:
            names.append(f.read().strip())
    return names


def gloo_threads() -> int | None:
    """How many gloo threads this process runs; ``None`` where threads cannot be read."""
    names = thread_names()
    return None if names is None else sum(n in GLOO_THREADS for n in names)


def release_groups() -> None:
    """End the process groups that only torch's DTensor caches still hold, once the world is
    destroyed: empty the caches, collect garbage. A live world is left alone (its groups end with
    the caller's ``destroy_process_group()``), as is a process that runs no gloo thread."""
    if not dist.is_available() or dist.is_initialized() or "torch.distributed.tensor" not in sys.modules:
        return
    if gloo_threads() == 0:
        return
    for module, path in _CACHES:
        try:
            target: object = importlib.import_module(module)
            for part in path.split("."):
                target = getattr(target, part)
            target()  # type: ignore[operator]
        except Exception as e:  # noqa: BLE001 - another torch's layout: that cache is not emptied
            log.debug("cannot empty %s.%s: %s", module, path, e)
    gc.collect()
    left = gloo_threads()
    if left:
        log.debug("%d gloo thread(s) still run at exit: a process group is still held", left)


_REGISTERED: list[bool] = []
_FIRST: list[Callable[[], None]] = []  # run by the exit handler before release_groups, in this order


def _exit() -> None:
    _first()
    release_groups()


def register() -> None:
    """Run the exit handler at this process's exit: what :func:`at_exit` was given, then
    :func:`release_groups` (registered once, however often called)."""
    if not _REGISTERED:
        atexit.register(_exit)
        _REGISTERED.append(True)


_EARLY: list[bool] = []  # whether the main thread's end runs _first (threading's hook): registered once


def _first() -> None:
    for fn in _FIRST:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the next one still runs; threading's hook would stop at a raise
            log.warning("at exit, %s failed (%s: %s)", getattr(fn, "__qualname__", fn), type(e).__name__, e)


def at_exit(fn: Callable[[], None]) -> None:
    """Have ``fn`` (once, however often given) run as the main thread ends, before any ``atexit``
    handler, and again in the exit handler before it releases the groups (for work handed over
    after that: a thread of the program's own still running), while the interpreter is whole
    and the world not yet released by sdadapt. ``fn`` must do nothing the second time unless
    there is new work."""
    register()
    if fn not in _FIRST:
        _FIRST.append(fn)
    early = getattr(threading, "_register_atexit", None)  # CPython's, since 3.9; absent: the exit handler only
    if not _EARLY and early is not None:
        try:
            early(_first)
            _EARLY.append(True)
        except RuntimeError:  # the main thread has ended already: the exit handler runs it
            log.debug("the main thread has ended; %s runs in the exit handler only", getattr(fn, "__qualname__", fn))


__all__ = ["GLOO_THREADS", "at_exit", "gloo_threads", "register", "release_groups", "thread_names"]
