"""Pinned host memory for the staging pools: one slab per pool, kept for the next load.

``torch.empty(..., pin_memory=True)`` asks CUDA for each buffer separately (``cudaHostAlloc``,
rounded up to a power of two), and the driver pins it 4 KiB page by page: on a first load that
costs more than reading a gigabyte. A slab is instead one anonymous mapping, aligned to 2 MiB
and advised for transparent huge pages, filled once (which faults it in as huge pages where the
kernel grants them), then registered with ``cudaHostRegister``: the same pinned memory, with a
twentieth of the page work. Slabs given back are kept (at most :data:`KEEP`) and handed out
again, as torch keeps its freed pinned blocks, so later loads in the process pin nothing.

Where any of that is unavailable (not Linux, no ``madvise``, a registration error) the slab is
a plain ``pin_memory=True`` tensor: the same memory, allocated the slower way.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import logging
import mmap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .geometry import round_up

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
KEEP = 4  # slabs kept for reuse after their loads, process-wide
_MADV_HUGEPAGE = 14  # <linux/mman.h>


@dataclass(eq=False)  # compared by identity (kept in lists), never by contents
class Slab:
    """``tensor`` (uint8, pinned) and what keeps its memory alive and registered."""

    tensor: torch.Tensor
    mapping: mmap.mmap | None = None  # None: torch allocated it

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    def release(self) -> None:
        """Unpin and free the memory (the tensor must no longer be used)."""
        if self.mapping is not None:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            del self.tensor
            try:
                self.mapping.close()
            except BufferError:  # a view of it is still alive somewhere: freed with it
                pass


def _advise_huge(ptr: int, nbytes: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise(ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes), _MADV_HUGEPAGE)  # advice only: failure is harmless


def register_slab(nbytes: int) -> Slab:
    """``nbytes`` of pinned memory as one registered huge-page mapping; the torch allocation
    where registration is not possible."""
    try:
        mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        whole = torch.frombuffer(mapping, dtype=torch.uint8)
        skip = -whole.data_ptr() % HUGE_PAGE
        tensor = whole[skip : skip + nbytes]
        del whole
        _advise_huge(tensor.data_ptr(), nbytes)
        tensor.zero_()  # faults every page in now (huge pages where granted), not in the driver one by one
        err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister returned {err}")
        return Slab(tensor, mapping)
    except Exception as e:  # noqa: BLE001 - any failure: pin the usual way instead
        log.debug("pinning %d bytes through torch instead of a registered mapping: %s", nbytes, e)
        return Slab(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))


class SlabCache:
    """Slabs handed out by :meth:`get` and kept by :meth:`put` for the next :meth:`get` (the
    smallest kept one that is large enough), at most ``keep`` of them; thread-safe.
    :meth:`prefetch` pins a slab in the background ahead of the :meth:`get` that will want it."""

    def __init__(self, allocate: Callable[[int], Slab] = register_slab, keep: int = KEEP):
        self.allocate = allocate
        self.keep = keep
        self._kept: list[Slab] = []
        self._pending: list[tuple[int, threading.Event]] = []  # (bytes, set once kept) being pinned
        self._queued: collections.deque[tuple[tuple[int, threading.Event], torch.device]] = collections.deque()  # not started, in order
        self._pinning = False  # a thread is pinning the queued prefetches
        self._lock = threading.Lock()

    def get(self, nbytes: int) -> Slab:
        """The smallest kept slab of at least ``nbytes``; else, once the smallest such slab
        being prefetched is pinned, that one; else a new slab."""
        while True:
            with self._lock:
                slab = self._pop_fit(nbytes)
                if slab is not None:
                    return slab
                coming = [p for p in self._pending if p[0] >= nbytes]
                if not coming:
                    break
                done = min(coming, key=lambda p: p[0])[1]
            done.wait()
        return self.allocate(round_up(nbytes, HUGE_PAGE))

    def take_kept(self, nbytes: int) -> Slab | None:
        """The smallest kept slab of at least ``nbytes``, or ``None`` without waiting or pinning."""
        with self._lock:
            return self._pop_fit(nbytes)

    def _pop_fit(self, nbytes: int) -> Slab | None:
        """Remove and return the smallest kept slab of at least ``nbytes`` (the lock held)."""
        fits = [s for s in self._kept if s.nbytes >= nbytes]
        if not fits:
            return None
        slab = min(fits, key=lambda s: s.nbytes)
        self._kept.remove(slab)
        return slab

    def prefetch(self, nbytes: int, device: torch.device) -> None:
        """Start pinning a slab of ``nbytes`` (registered with ``device``'s context) on a
        background thread, to be kept for the next :meth:`get`; nothing when a large enough
        slab is kept or already on its way. For a load to start pinning its staging while it
        still plans and materialises the model. Prefetches are pinned one at a time, in the
        order asked for: the first one a load asks for (its staging) is ready soonest, rather
        than sharing the memory bandwidth and the driver with the next."""
        nbytes = round_up(nbytes, HUGE_PAGE)
        with self._lock:
            if any(s.nbytes >= nbytes for s in self._kept) or any(n >= nbytes for n, _ in self._pending):
                return
            entry = (nbytes, threading.Event())
            self._pending.append(entry)
            self._queued.append((entry, device))
            if self._pinning:
                return
            self._pinning = True
        # not a daemon: a process that ends while a slab is being pinned waits for it (tens of
        # milliseconds) rather than tear CUDA down under a cudaHostRegister still running
        threading.Thread(target=self._pin_queued, name="sdadapt-pin", daemon=False).start()

    def _pin_queued(self) -> None:
        """Pin the queued prefetches in order, until none is left."""
        while True:
            with self._lock:
                if not self._queued:
                    self._pinning = False
                    return
                entry, device = self._queued.popleft()
            self._pin(entry, device)

    def _pin(self, entry: tuple[int, threading.Event], device: torch.device) -> None:
        """Pin the slab of ``entry`` and keep it; a failure is only logged (the get that wanted
        it then allocates, and raises, itself)."""
        slab: Slab | None = None
        start = time.perf_counter()
        try:
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                slab = self.allocate(entry[0])
            log.debug("prefetched %d bytes of pinned memory in %.3f s", entry[0], time.perf_counter() - start)
        except Exception as e:  # noqa: BLE001 - see the docstring
            log.debug("prefetching %d bytes of pinned memory failed: %s", entry[0], e)
        finally:
            with self._lock:
                self._pending.remove(entry)
                evicted = self._keep(slab) if slab is not None else None
            entry[1].set()
            if evicted is not None:
                evicted.release()

    def put(self, slab: Slab) -> None:
        """Keep ``slab`` (no copy out of it may still be pending); over the bound, the smallest
        kept slab is freed."""
        with self._lock:
            evicted = self._keep(slab)
        if evicted is not None:
            evicted.release()

    def _keep(self, slab: Slab) -> Slab | None:
        """Keep ``slab`` (the lock held); the smallest kept slab, to free, when over the bound."""
        self._kept.append(slab)
        if len(self._kept) <= self.keep:
            return None
        smallest = min(self._kept, key=lambda s: s.nbytes)
        self._kept.remove(smallest)
        return smallest

    def clear(self) -> int:
        """Free every kept slab, and a slab being prefetched once it is pinned (prefetches not
        started yet are dropped); the bytes freed."""
        with self._lock:
            for entry, _ in self._queued:
                self._pending.remove(entry)
                entry[1].set()  # a get waiting for it allocates its own
            self._queued.clear()
            pinning = [done for _, done in self._pending]
        for done in pinning:
            done.wait()
        with self._lock:
            kept, self._kept = self._kept, []
        freed = sum(slab.nbytes for slab in kept)
        for slab in kept:
            slab.release()
        return freed


SLABS = SlabCache()
# the head start's memory (EngineConfig.head_bytes), kept apart so that a staging pool never takes it
HEAD_SLABS = SlabCache(keep=1)


def release_pinned_memory() -> int:
    """Unpin and free the staging memory that loads to a GPU keep for the next load of this
    process (at most :data:`KEEP` slabs, about ``2 x EngineConfig.staging_bytes`` per load
    configuration, and the head start's ``EngineConfig.head_bytes``; a slab still being pinned
    in the background is waited for); returns the bytes freed. A later GPU load pins its
    staging afresh (tens of milliseconds). Call it between loads, never during one.

    Returns:
        The bytes freed.

    Example::

        sdadapt.load(model, "ckpt/", device="cuda")
        sdadapt.release_pinned_memory()
    """
    freed = SLABS.clear() + HEAD_SLABS.clear()
    log.debug("released %d bytes of pinned staging memory", freed)
    return freed
