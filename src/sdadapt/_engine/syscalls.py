"""The system calls the engine reads with: ``preadv`` into tensor memory, or a copy out of the
file's read-only mapping (``mmap``); ``madvise`` to fault pages in ahead of a read; ``open``
with errors that name the key (:class:`OpenFile`: one file of a run, read either way)."""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from typing import Any

import torch

from ..errors import LoadError
from .geometry import round_up

_MADV_POPULATE_READ = 22  # Linux 5.14+
_MADV_POPULATE_WRITE = 23
_PROT_READ, _MAP_SHARED = 1, 1
_MAP_FAILED = ctypes.c_void_p(-1).value
_populate_ok = [sys.platform.startswith("linux")]


def populate(mem: torch.Tensor) -> None:
    """Fault in the pages of a CPU destination in one ``madvise(MADV_POPULATE_WRITE)`` call
    before reading into it: fresh memory (a just-materialised model) otherwise takes one page
    fault per 4 KiB inside ``pread``, each a trip into the kernel. Exactly what the write would
    do anyway; skipped below 1 MiB and where the kernel does not know the flag."""
    if not _populate_ok[0]:
        return
    start = mem.data_ptr()
    lo, hi = round_up(start, 4096), (start + mem.numel()) // 4096 * 4096
    if hi - lo < (1 << 20):
        return
    libc = _libc()
    if libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_POPULATE_WRITE) != 0:
        _populate_ok[0] = False  # EINVAL before 5.14; never worth an error


@functools.cache
def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mmap.restype = ctypes.c_void_p
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def preadv_into(fd: int, mem: torch.Tensor, pos: int, offset: int, nbytes: int) -> int:
    """Read ``nbytes`` at file ``offset`` into the uint8 CPU tensor ``mem`` at ``pos``; returns
    the number of calls it took. A short file is an :class:`OSError` saying it is truncated."""
    addr = mem.data_ptr() + pos
    done = 0
    calls = 0
    while done < nbytes:
        buf = (ctypes.c_char * (nbytes - done)).from_address(addr + done)
        n = os.preadv(fd, [buf], offset + done)
        calls += 1
        if n <= 0:
            raise OSError(f"unexpected end of file at byte {offset + done} (wanted {nbytes - done} more bytes); the file is truncated")
        done += n
    return calls


def copy_mapped(base: int, size: int, mem: torch.Tensor, pos: int, offset: int, nbytes: int, populate_first: bool) -> int:
    """Copy ``nbytes`` at byte ``offset`` of a file mapped read-only at address ``base`` (``size``
    bytes long) into the uint8 CPU tensor ``mem`` at ``pos``; returns 1 (one copy).
    ``ctypes.memmove`` releases the GIL, so threads copy in parallel; ``populate_first`` maps
    the region's pages in one ``madvise(MADV_POPULATE_READ)`` call before the copy instead of
    one fault per few pages inside it. A region past the file's end is an :class:`OSError`."""
    if offset + nbytes > size:
        raise OSError(f"unexpected end of file at byte {size} (wanted {offset + nbytes - size} more bytes); the file is truncated")
    if nbytes <= 0:
        return 0
    if populate_first:
        lo = (base + offset) // 4096 * 4096
        _libc().madvise(ctypes.c_void_p(lo), ctypes.c_size_t(base + offset + nbytes - lo), _MADV_POPULATE_READ)
    ctypes.memmove(mem.data_ptr() + pos, base + offset, nbytes)
    return 1


class OpenFile:
    """One file a run reads: its descriptor and, when the run copies out of mappings
    (``EngineConfig.read_with``), its read-only shared mapping. A mapped file that another
    process shortens while the run copies out of it ends the process (``SIGBUS``); ``preadv``
    reports an error there instead, which is why it stays the choice where files may change.

    Args:
        path: the file.
        target: the target key it is opened for (named by the error when it cannot be).
        mode: ``"pread"``, ``"mmap"`` or ``"mmap-populate"`` (see ``EngineConfig.read_with``).

    Raises:
        LoadError: the file cannot be opened or mapped.
    """

    def __init__(self, path: str, target: str, mode: str = "pread"):
        self.path = path
        self.base = 0
        self.size = 0
        self.populate = mode == "mmap-populate"
        try:
            self.fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise LoadError(f"key {target!r} (from {path}): cannot open the file: {e.strerror or e}") from None
        if mode != "pread":
            self._map(target)

    def _map(self, target: str) -> None:
        size = os.fstat(self.fd).st_size
        if size == 0:
            return
        addr = _libc().mmap(None, size, _PROT_READ, _MAP_SHARED, self.fd, 0)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            os.close(self.fd)
            raise LoadError(f"key {target!r} (from {self.path}): cannot map the file: {os.strerror(err)}")
        self.base, self.size = addr, size

    @property
    def mapped(self) -> bool:
        """Whether reads copy out of the file's mapping."""
        return self.base != 0

    def read_into(self, mem: torch.Tensor, pos: int, offset: int, nbytes: int) -> int:
        """Read ``nbytes`` at file ``offset`` into the uint8 CPU tensor ``mem`` at ``pos``;
        returns the number of calls it took."""
        if self.base:
            return copy_mapped(self.base, self.size, mem, pos, offset, nbytes, self.populate)
        return preadv_into(self.fd, mem, pos, offset, nbytes)

    def close(self) -> None:
        """Unmap and close the file."""
        if self.base:
            _libc().munmap(ctypes.c_void_p(self.base), ctypes.c_size_t(self.size))
            self.base = 0
        os.close(self.fd)
