"""The bounded pool of staging buffers that reads go through when they cannot land in place."""

from __future__ import annotations

import queue
import threading
from typing import TYPE_CHECKING

import torch

from .geometry import round_up
from .pinned import SLABS, Slab, SlabCache

if TYPE_CHECKING:
    from .config import EngineConfig

_ALIGN = 4096  # each buffer of a slab starts on a page (any dtype's alignment)


class StagingPool:
    """At most ``count`` staging buffers of ``size`` bytes, shared by the threads of one run.

    For GPU destinations (``pin``) the buffers are slices of one pinned slab, taken from
    ``slabs`` on first use and given back by :meth:`close`; otherwise each buffer is allocated
    on first use."""

    def __init__(self, count: int, size: int, pin: bool, slabs: SlabCache = SLABS):
        self.size = size
        self.pin = pin
        self._free: queue.LifoQueue[torch.Tensor] = queue.LifoQueue()
        self._count = self._left = count
        self._lock = threading.Lock()
        self._slabs = slabs
        self._slab: Slab | None = None
        self.allocated = 0

    @staticmethod
    def slab_bytes(count: int, size: int) -> int:
        """The pinned slab that ``count`` buffers of ``size`` bytes are cut from."""
        return count * round_up(size, _ALIGN)

    @classmethod
    def for_run(cls, config: EngineConfig, threads: int, pin: bool, slabs: SlabCache = SLABS) -> StagingPool:
        """The staging pool of an engine run of ``config`` with ``threads`` threads: as many
        buffers as ``config`` allows them, each of its chunk size."""
        return cls(*_run_buffers(config, threads), pin, slabs)

    @classmethod
    def run_slab_bytes(cls, config: EngineConfig, threads: int) -> int:
        """The pinned slab that :meth:`for_run`'s pool takes on its first buffer (what a GPU run
        asks :data:`~sdadapt._engine.pinned.SLABS` for, and what is pinned ahead for it)."""
        return cls.slab_bytes(*_run_buffers(config, threads))

    def _new(self) -> torch.Tensor:
        if not self.pin:
            return torch.empty(self.size, dtype=torch.uint8)
        stride = round_up(self.size, _ALIGN)
        if self._slab is None:
            self._slab = self._slabs.get(self.slab_bytes(self._count, self.size))
        at = (self._count - self._left) * stride
        return self._slab.tensor[at : at + self.size]

    def try_get(self) -> torch.Tensor | None:
        """A free buffer, a new one while under the bound, else ``None``."""
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            if self._left > 0:
                buf = self._new()  # counted once made: a failed allocation leaves the bound as it was
                self._left -= 1
                self.allocated += 1
                return buf
        return None

    def get(self) -> torch.Tensor:
        """A buffer, waiting for one to be given back when all are in use."""
        buf = self.try_get()
        return buf if buf is not None else self._free.get()

    def put(self, buf: torch.Tensor) -> None:
        self._free.put(buf)

    def close(self) -> None:
        """The run is over and every copy out of the buffers has finished: the slab goes back
        to ``slabs`` for the next run."""
        with self._lock:
            slab, self._slab = self._slab, None
            self._left = 0
            self._free = queue.LifoQueue()  # views of the slab: no longer handed out
        if slab is not None:
            self._slabs.put(slab)


def _run_buffers(config: EngineConfig, threads: int) -> tuple[int, int]:
    """``(count, size)`` of the staging buffers of a run of ``config`` with ``threads`` threads."""
    return config.staging_buffers(threads), config.chunk()
