"""A stand-in for kvikio's ``CuFile`` on the host (the CPU lane's runs in tests): ``pread`` into
a CPU tensor on a small pool of threads, returning a future with kvikio's ``get()``."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class HostFuture:
    """kvikio's ``IOFuture``: ``get()`` waits and returns the bytes read."""

    def __init__(self, fut: Future[int]):
        self.fut = fut

    def get(self) -> int:
        return self.fut.result()

    def done(self) -> bool:
        return self.fut.done()


class HostCuFile:
    """kvikio's ``CuFile`` on the host: ``pread`` into a CPU tensor (or a numpy array) on a small pool; ``short``
    files read one byte less than asked (a truncated file); ``reading`` counts the reads queued
    and not yet ended, ``offsets`` every (path, offset) asked for."""

    pool: ThreadPoolExecutor | None = None
    short: set[str] = set()
    reading = 0
    offsets: list[tuple[str, int]] = []
    lock = threading.Lock()

    def __init__(self, path: str, mode: str):
        if HostCuFile.pool is None:
            HostCuFile.pool = ThreadPoolExecutor(3)
        self.path, self.fd = path, os.open(path, os.O_RDONLY)

    def _read(self, buf: Any, size: int, offset: int) -> int:
        time.sleep(0.001)
        try:
            host = buf.numpy() if hasattr(buf, "numpy") else buf  # a CPU tensor, or a numpy array as kvikio takes host memory
            got = os.preadv(self.fd, [memoryview(host)[:size]], offset)
            return got - 1 if self.path in HostCuFile.short else got
        finally:
            with HostCuFile.lock:
                HostCuFile.reading -= 1

    def pread(self, buf: Any, size: int, offset: int) -> HostFuture:
        with HostCuFile.lock:
            HostCuFile.reading += 1
            HostCuFile.offsets.append((self.path, offset))
        assert self.pool is not None
        return HostFuture(self.pool.submit(self._read, buf, size, offset))

    def close(self) -> None:
        os.close(self.fd)
