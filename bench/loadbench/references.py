"""The machine's own limits for what a loader does, measured in the same run as the loads:
reading byte ranges from the page cache with several threads, and (on GPU) reading them into
pinned buffers while copying those to the GPU."""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from .common import GiB, MiB


def run_threads(fn: Callable[[int], None], n: int) -> None:
    """``fn(i)`` on ``n`` threads at once; returns when all are done."""
    ts = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def parallel_read(ranges: list[tuple[str, int, int]], threads: int, block: int = 16 * MiB) -> int:
    """pread the byte ranges with ``threads`` threads into per-thread buffers; bytes read."""
    work: queue.SimpleQueue = queue.SimpleQueue()
    for path, off, n in ranges:
        for o in range(off, off + n, block):
            work.put((path, o, min(block, off + n - o)))
    done = [0] * threads

    def run(i: int) -> None:
        mv = memoryview(bytearray(block))
        fds: dict[str, int] = {}
        try:
            while True:
                try:
                    path, o, n = work.get_nowait()
                except queue.Empty:
                    return
                fd = fds.get(path)
                if fd is None:
                    fd = fds[path] = os.open(path, os.O_RDONLY)
                got = 0
                while got < n:
                    r = os.preadv(fd, [mv[got:n]], o + got)
                    if r <= 0:
                        break
                    got += r
                done[i] += got
        finally:
            for fd in fds.values():
                os.close(fd)

    run_threads(run, threads)
    return sum(done)


def pinned_pipeline(ranges: list[tuple[str, int, int]], threads: int, dev: Any, block: int = 8 * MiB) -> int:
    """The machine's limit for what the engine does on a GPU: ``threads`` threads ``pread`` the
    byte ranges into two pinned buffers each and copy every block to the GPU without waiting
    (one stream per thread), into one GPU buffer of the ranges' size. Bytes moved."""
    import ctypes

    import torch

    total = sum(n for _, _, n in ranges)
    dest = [torch.empty(total, dtype=torch.uint8, device=dev)]  # a list, so that it can be freed below
    work: queue.SimpleQueue = queue.SimpleQueue()
    pos = 0
    for path, off, n in ranges:
        for o in range(off, off + n, block):
            work.put((path, o, min(block, off + n - o), pos + o - off))
        pos += n

    def run(i: int) -> None:
        torch.cuda.set_device(dev)
        bufs = [torch.empty(block, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        events: list[Any] = [None, None]
        stream = torch.cuda.Stream(dev)
        fds: dict[str, int] = {}
        k = 0
        try:
            with torch.cuda.stream(stream):
                while True:
                    try:
                        path, o, n, at = work.get_nowait()
                    except queue.Empty:
                        break
                    fd = fds.get(path)
                    if fd is None:
                        fd = fds[path] = os.open(path, os.O_RDONLY)
                    if events[k] is not None:
                        events[k].synchronize()
                    buf = bufs[k]
                    got = 0
                    while got < n:
                        r = os.preadv(fd, [(ctypes.c_char * (n - got)).from_address(buf.data_ptr() + got)], o + got)
                        if r <= 0:
                            raise OSError(f"{path}: short read")
                        got += r
                    dest[0][at : at + n].copy_(buf[:n], non_blocking=True)
                    events[k] = torch.cuda.Event()
                    events[k].record(stream)
                    k ^= 1
            stream.synchronize()
        finally:
            for fd in fds.values():
                os.close(fd)

    run_threads(run, threads)
    dest.clear()  # the threads are done with it; give the memory back
    torch.cuda.empty_cache()
    return total


def best_rate(move: Callable[[], int], tries: int = 2) -> float:
    """GiB/s of ``move()`` (which returns the bytes it moved), all ranks starting together; the
    best of ``tries``: the first also pays for fresh memory."""
    import torch.distributed as dist

    best = 0.0
    for _ in range(tries):
        dist.barrier()
        t0 = time.perf_counter()
        nb = move()
        best = max(best, nb / GiB / (time.perf_counter() - t0))
    return best


def measure_references(files: dict[str, str], dev: Any, rank: int, world: int) -> dict[str, float]:
    """Each rank reads its 1/world of every safetensors file (and on GPU moves it to the GPU), all
    ranks at once, with the engine's default thread count; plus the pinned host-to-GPU rate."""
    import torch
    import torch.distributed as dist

    from sdadapt._engine import default_threads

    refs: dict[str, float] = {}
    if "safetensors" not in files:
        return refs
    folder = files["safetensors"]
    ranges = []
    for f in sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors")):
        n = os.path.getsize(f)
        lo, hi = n * rank // world, n * (rank + 1) // world
        ranges.append((f, lo, hi - lo))
    threads = default_threads()
    refs["page_cache_read_gibps"] = best_rate(lambda: parallel_read(ranges, threads))
    refs["page_cache_read_threads"] = threads
    if dev.type == "cuda":
        refs["pinned_pipeline_gibps"] = best_rate(lambda: pinned_pipeline(ranges, threads, dev))
        host = torch.empty(GiB, dtype=torch.uint8, pin_memory=True)
        gpu = torch.empty(GiB, dtype=torch.uint8, device=dev)
        gpu.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        dist.barrier()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(5):
            gpu.copy_(host, non_blocking=True)
        e1.record()
        torch.cuda.synchronize()
        refs["pinned_h2d_gibps"] = 5 / (e0.elapsed_time(e1) / 1000)
        del host, gpu
        torch.cuda.empty_cache()
    return refs
