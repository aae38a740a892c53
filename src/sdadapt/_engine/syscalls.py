"""The system calls the engine reads with: ``preadv`` into tensor memory, ``madvise`` to fault
pages in ahead of a read, ``open`` with errors that name the key."""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from typing import Any

import torch

from ..errors import LoadError
from .geometry import round_up

_MADV_POPULATE_WRITE = 23  # Linux 5.14+
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


def open_device_file(reads: Any, path: str, target: str) -> Any:
    """A kvikio handle for ``path`` from ``reads`` (a :class:`~sdadapt._engine.devread.DeviceReads`);
    a file that cannot be opened names target key ``target``."""
    try:
        return reads.open(path)
    except Exception as e:  # noqa: BLE001 - kvikio raises RuntimeError with the system's message
        raise LoadError(
            f"key {target!r} (from {path}): kvikio cannot open the file: {e} (SDADAPT_IO_KVIKIO=0 reads it through the staged path)"
        ) from None


def open_for(path: str, target: str) -> int:
    """A read-only descriptor for ``path``; a file that cannot be opened names target key ``target``."""
    try:
        return os.open(path, os.O_RDONLY)
    except OSError as e:
        raise LoadError(f"key {target!r} (from {path}): cannot open the file: {e.strerror or e}") from None
