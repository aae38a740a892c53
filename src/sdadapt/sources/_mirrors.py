"""The local mirror folders of object storage checkpoints (:mod:`._object_store`): made in the
temporary directory, each locked (``flock`` on ``<folder>.lock``) while its process lives, removed
when closed or at exit; a new mirror first removes those whose lock is free (their process ended
without its exit handlers: killed, or a fork that left with ``os._exit``)."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile

try:
    import fcntl
except ImportError:  # not POSIX: mirrors are removed at exit only
    fcntl = None  # type: ignore[assignment]

# mirror folder -> the descriptor of its lock file ("<folder>.lock"), locked while the process
# (or a child forked from it) lives: a mirror whose lock anyone can take belongs to a process
# that ended without its exit handlers (killed, or a fork that left with os._exit).
_created: dict[str, int | None] = {}
MIRROR = "sdadapt-mirror-"  # every mirror folder's name (and its lock's) starts so


def new_mirror(prefix: str) -> str:
    """A fresh mirror folder in the temporary directory, locked while this process lives, after
    removing the mirrors that processes which ended without their exit handlers left there."""
    if fcntl is None:
        root = tempfile.mkdtemp(prefix=prefix)
        _created[root] = None
        return root
    _remove_orphans()
    while True:
        fd, lock = tempfile.mkstemp(prefix=prefix, suffix=".lock")
        if _try_lock(fd):  # locked before its folder exists, so no sweep removes a live mirror
            break
        os.close(fd)  # another process's sweep took it between the two calls (it removes it): again
    root = lock[: -len(".lock")]
    os.mkdir(root, 0o700)
    _created[root] = fd
    return root


def _try_lock(fd: int) -> bool:
    """Take ``fd``'s exclusive lock without waiting; False where another process holds it or
    there is no ``flock``."""
    if fcntl is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def drop_mirror(root: str) -> None:
    shutil.rmtree(root, ignore_errors=True)
    fd = _created.pop(root, None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.unlink(f"{root}.lock")
        os.close(fd)


def _remove_orphans() -> None:
    """Remove the mirrors (and their locks) whose lock is free: their process has ended."""
    if fcntl is None:
        return
    try:
        with os.scandir(tempfile.gettempdir()) as entries:
            locks = [e.path for e in entries if e.name.startswith(MIRROR) and e.name.endswith(".lock")]
    except OSError:
        return
    for lock in locks:
        if lock[: -len(".lock")] in _created:
            continue
        try:
            fd = os.open(lock, os.O_RDWR)
        except OSError:
            continue
        if not _try_lock(fd):
            os.close(fd)
            continue
        shutil.rmtree(lock[: -len(".lock")], ignore_errors=True)
        with contextlib.suppress(OSError):
            os.unlink(lock)
        os.close(fd)


@atexit.register
def _remove_mirrors() -> None:
    for root in list(_created):
        drop_mirror(root)


__all__ = ["MIRROR", "drop_mirror", "new_mirror"]
