"""How fast host memory can be pinned on this machine, by each way the engine could pin its
staging memory; each measured on fresh memory in one fresh process, then the H2D copy speed out
of it."""

from __future__ import annotations

import argparse
import ctypes
import mmap
import threading
import time

import torch

MiB = 1 << 20


def now() -> float:
    return time.perf_counter()


def torch_pinned(size: int, count: int, threads: int) -> tuple[float, list[torch.Tensor]]:
    out: list[torch.Tensor] = []
    lock = threading.Lock()

    def one(n: int) -> None:
        got = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(n)]
        with lock:
            out.extend(got)

    t = now()
    ths = [threading.Thread(target=one, args=(count // threads + (i < count % threads),)) for i in range(threads)]
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    return now() - t, out


def registered(size: int, huge: bool, threads: int, populate: bool) -> tuple[float, float, torch.Tensor, mmap.mmap]:
    m = mmap.mmap(-1, size + (2 * MiB if huge else 0), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = torch.frombuffer(m, dtype=torch.uint8)
    if huge:
        ptr = base.data_ptr()
        skip = (-ptr) % (2 * MiB)
        base = base[skip : skip + size]
        libc = ctypes.CDLL(None)
        libc.madvise(ctypes.c_void_p(base.data_ptr()), ctypes.c_size_t(size), 14)  # MADV_HUGEPAGE
    t = now()
    if populate:
        base.zero_()
    t_pop = now() - t
    rt = torch.cuda.cudart()
    part = size // threads // (2 * MiB) * (2 * MiB)  # whole (huge) pages each

    def reg(i: int) -> None:
        piece = base[i * part : (i + 1) * part if i < threads - 1 else size]
        assert int(rt.cudaHostRegister(piece.data_ptr(), piece.numel(), 0)) == 0

    t = now()
    ths = [threading.Thread(target=reg, args=(i,)) for i in range(threads)]
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    return t_pop, now() - t, base, m


def h2d(buf: torch.Tensor) -> float:
    dev = torch.empty(buf.numel(), dtype=torch.uint8, device="cuda")
    dev.copy_(buf, non_blocking=True)
    torch.cuda.synchronize()
    t = now()
    for _ in range(5):
        dev.copy_(buf, non_blocking=True)
    torch.cuda.synchronize()
    return 5 * buf.numel() / (now() - t) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--mb", type=int, default=256)
    a = p.parse_args()
    torch.empty(1, device="cuda")
    size = a.mb * MiB
    thp = "/sys/kernel/mm/transparent_hugepage/"
    print("THP:", open(thp + "enabled").read().strip(), "| defrag:", open(thp + "defrag").read().strip())
    keep: list = []
    for threads in (1, 12):
        s, bufs = torch_pinned(size // 24, 24, threads)
        keep.append(bufs)
        print(f"torch pin_memory 24 x {size / 24 / MiB:.1f} MiB, {threads} threads: {s * 1e3:.1f} ms")
    s, bufs = torch_pinned(size, 1, 1)
    keep.append(bufs)
    print(f"torch pin_memory 1 x {a.mb} MiB: {s * 1e3:.1f} ms; H2D {h2d(bufs[0]):.1f} GB/s")
    for huge in (False, True):
        for populate in (False, True):
            for threads in (1, 12):
                pop, reg, base, m = registered(size, huge, threads, populate)
                keep.append((base, m))
                gbps = h2d(base[: size // threads // (2 * MiB) * (2 * MiB)])  # one registration
                kind = f"mmap{' THP' if huge else ''} {a.mb} MiB"
                print(f"{kind}: populate {pop * 1e3:.1f} ms, cudaHostRegister ({threads} threads) {reg * 1e3:.1f} ms; H2D {gbps:.1f} GB/s")


if __name__ == "__main__":
    main()
