"""The system calls the engine reads with: ``preadv`` into tensor memory (a region's runs joined
into one call where the gaps between them are short), ``madvise`` to fault pages in ahead of a
read, ``open`` with errors that name the key and read-ahead turned off, and the bytes a read asks
of storage."""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..errors import LoadError
from .geometry import round_up

_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_populate_ok = [sys.platform.startswith("linux")]
IOV_MAX = 1024  # iovecs one preadv takes (Linux's UIO_MAXIOV)
PAGE = 4096  # what the page cache reads from storage at least, per touched page


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
    libc.preadv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
    libc.preadv.restype = ctypes.c_ssize_t
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


def join_runs(segments: Sequence[tuple[int, int]], max_gap: int) -> list[tuple[int, int]]:
    """Where consecutive ``segments`` (file offset, nbytes; in order) become one read: the
    (first, stop) index ranges of the segments each ``preadv`` call takes. Segments join while
    the gap to the next is at most ``max_gap`` bytes (that gap is read too, into a scratch
    buffer: storage is asked for the span from the first byte to the last) and a call holds at
    most ``IOV_MAX`` iovecs (a segment and a gap each)."""
    groups: list[tuple[int, int]] = []
    first = 0
    n = len(segments)
    for i in range(1, n + 1):
        if i < n:
            off, size = segments[i - 1]
            gap = segments[i][0] - off - size
            if 0 <= gap <= max_gap and 2 * (i - first) + 1 <= IOV_MAX:
                continue
        groups.append((first, i))
        first = i
    return groups


def requested(segments: Sequence[tuple[int, int]], max_gap: int) -> list[tuple[int, int]]:
    """The file extents (start, stop) that reading ``segments`` with :func:`read_runs` asks
    storage for: one per ``preadv`` call, gaps included."""
    out = []
    for a, b in join_runs(segments, max_gap):
        start = segments[a][0]
        last_off, last_n = segments[b - 1]
        out.append((start, last_off + last_n))
    return out


def storage_bytes(extents: Iterable[tuple[int, int]], page: int = PAGE) -> int:
    """The bytes a cold page cache reads from storage for ``extents`` (start, stop) of one file,
    read-ahead off: every page any of them touches, once."""
    pages = sorted((a // page, -(-b // page)) for a, b in extents if b > a)
    total = 0
    lo = hi = -1
    for a, b in pages:
        if a > hi:
            total += hi - lo
            lo, hi = a, b
        else:
            hi = max(hi, b)
    total += hi - lo
    return total * page


def read_runs(
    fd: int, mem: torch.Tensor, pos: int, segments: Sequence[tuple[int, int]], max_gap: int, sink: torch.Tensor | None
) -> tuple[int, list[tuple[int, int]]]:
    """Read ``segments`` (file offset, nbytes) packed one after the other into the uint8 CPU
    tensor ``mem`` from byte ``pos`` on; segments whose gaps are at most ``max_gap`` (and fit
    ``sink``, a scratch buffer the gaps are read into) share one ``preadv`` call. Returns the
    number of calls it took and the file extents (start, stop) they asked storage for."""
    max_gap = min(max_gap, sink.numel()) if sink is not None else 0
    base = mem.data_ptr() + pos
    calls = 0
    at = 0  # bytes of mem placed so far
    extents = []
    for a, b in join_runs(segments, max_gap) if max_gap > 0 and len(segments) > 1 else ((i, i + 1) for i in range(len(segments))):
        if b - a == 1:
            off, n = segments[a]
            calls += preadv_into(fd, mem, pos + at, off, n)
            extents.append((off, off + n))
            at += n
            continue
        group = segments[a:b]
        assert sink is not None
        calls += _preadv_joined(fd, base + at, group, sink.data_ptr())
        extents.append((group[0][0], group[-1][0] + group[-1][1]))
        at += sum(n for _, n in group)
    return calls, extents


def _preadv_joined(fd: int, addr: int, group: Sequence[tuple[int, int]], sink: int) -> int:
    """One ``preadv`` of the span from ``group``'s first byte to its last: each segment into
    memory at ``addr`` (packed), each gap into ``sink``. A short read goes on where it stopped."""
    iov: list[tuple[int, int]] = []
    for i, (off, n) in enumerate(group):
        if i:
            prev_off, prev_n = group[i - 1]
            gap = off - prev_off - prev_n
            if gap:
                iov.append((sink, gap))
        iov.append((addr, n))
        addr += n
    offset = group[0][0]
    calls = 0
    libc = _libc()
    while iov:
        arr = (ctypes.c_uint64 * (2 * len(iov)))(*(v for pair in iov for v in pair))
        got = libc.preadv(fd, ctypes.addressof(arr), len(iov), offset)
        calls += 1
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        if got == 0:
            raise OSError(f"unexpected end of file at byte {offset} (wanted {sum(n for _, n in iov)} more bytes); the file is truncated")
        offset += got
        while iov and got >= iov[0][1]:
            got -= iov[0][1]
            iov.pop(0)
        if got:
            ptr, n = iov[0]
            iov[0] = (ptr + got, n - got)
    return calls


def no_readahead(fd: int) -> None:
    """Tell the kernel to read only the pages asked for from ``fd`` (``POSIX_FADV_RANDOM``): a
    rank reading a shard's rows would otherwise make storage deliver the next rank's rows too.
    The engine's reads are chunks of megabytes, each one request of its own size."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is not None:
        try:
            advise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        except OSError:  # a filesystem that takes no advice reads as it always does
            pass


def open_device_file(reads: Any, path: str, target: str) -> Any:
    """A kvikio handle for ``path`` from ``reads`` (a :class:`~sdadapt._engine.devread.DeviceReads`);
    a file that cannot be opened names target key ``target``."""
    try:
        return reads.open(path)
    except Exception as e:  # noqa: BLE001 - kvikio raises RuntimeError with the system's message
        raise LoadError(
            f"key {target!r} (from {path}): kvikio cannot open the file: {e} (SDADAPT_IO_KVIKIO=0 reads it through the staged path)"
        ) from None


def open_for(path: str, target: str, readahead: bool = True) -> int:
    """A read-only descriptor for ``path`` (``readahead=False``: :func:`no_readahead`); a file
    that cannot be opened names target key ``target``."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise LoadError(f"key {target!r} (from {path}): cannot open the file: {e.strerror or e}") from None
    if not readahead:
        no_readahead(fd)
    return fd
