"""The bounded pool of staging buffers that reads go through when they cannot land in place."""

from __future__ import annotations

import queue
import threading

import torch


class StagingPool:
    """At most ``count`` staging buffers of ``size`` bytes (pinned for GPU destinations),
    allocated on first use and shared by the threads of one run."""

    def __init__(self, count: int, size: int, pin: bool):
        self.size = size
        self.pin = pin
        self._free: queue.LifoQueue[torch.Tensor] = queue.LifoQueue()
        self._left = count
        self._lock = threading.Lock()
        self.allocated = 0

    def try_get(self) -> torch.Tensor | None:
        """A free buffer, a new one while under the bound, else ``None``."""
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            if self._left > 0:
                self._left -= 1
                self.allocated += 1
                return torch.empty(self.size, dtype=torch.uint8, pin_memory=self.pin)
        return None

    def get(self) -> torch.Tensor:
        """A buffer, waiting for one to be given back when all are in use."""
        buf = self.try_get()
        return buf if buf is not None else self._free.get()

    def put(self, buf: torch.Tensor) -> None:
        self._free.put(buf)
