"""Probe: how fast can one rank move a warm file's bytes to its GPU, by method?

Run with ``torchrun --nproc-per-node N bench/zero_copy_probe.py --gib 7.5`` on a GPU machine.
Each rank writes its own file (random bytes), reads it once to warm the page cache, then
times, all ranks at once (barrier before each, slowest rank reported):

- ``pread``: T threads ``preadv`` into their own pinned buffers (no GPU): the page-cache reference.
- ``pread-pageable``: the same into reused pageable buffers (is filling pinned memory slower?).
- ``pread+h2d``: the same, then a non-blocking host-to-device copy per chunk on each thread's
  stream (``--depths`` buffers per thread): what ``sdadapt.load``'s staged path does.
- ``register``: ``mmap`` the file read-only; per chunk ``cudaHostRegister`` (flags below) the
  mapped page-cache pages, copy them to the GPU with a DMA, ``cudaHostUnregister``: no CPU copy.
- ``pageable``: copy from the mapping to the GPU without registering (the driver stages).

Every method's GPU result is compared with the file. Prints one JSON line per method and rank 0
a table. Nothing here is used by the library; it decides how the engine should move bytes.
For the open question of round 3 (pinned pipeline slower than pageable reads), e.g.:
``--methods pread,pread-pageable,pread+h2d --threads 12,16 --chunks-mb 1,2,8 --depths 2,4``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import threading
import time

import torch
import torch.distributed as dist

MiB = 1 << 20


def write_file(path: str, nbytes: int) -> None:
    block = torch.randint(0, 256, (64 * MiB,), dtype=torch.uint8).numpy().tobytes()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            n = min(left, len(block))
            f.write(block[:n])
            left -= n


def warm(path: str) -> None:
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(64 * MiB)
        while f.readinto(buf):
            pass


def chunks(nbytes: int, chunk: int) -> list[tuple[int, int]]:
    return [(o, min(chunk, nbytes - o)) for o in range(0, nbytes, chunk)]


class _Work:
    """The file's chunks, handed to the threads one at a time (``for off, n in work``)."""

    def __init__(self, nbytes: int, chunk: int):
        self._it = iter(chunks(nbytes, chunk))
        self._lock = threading.Lock()

    def __iter__(self) -> "_Work":
        return self

    def __next__(self) -> tuple[int, int]:
        with self._lock:
            return next(self._it)


def run_threads(n: int, fn) -> None:
    ths = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()


def m_pread(path: str, nbytes: int, gpu: torch.Tensor | None, threads: int, chunk: int, depth: int = 2, pinned: bool = True) -> None:
    """``pread`` each chunk into one of ``depth`` buffers of the thread (pinned, or pageable and
    reused), then (with ``gpu``) copy it to the GPU without waiting."""
    import ctypes

    work = _Work(nbytes, chunk)
    fd = os.open(path, os.O_RDONLY)

    def body(i: int) -> None:
        bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=pinned) for _ in range(depth)]
        stream = torch.cuda.Stream() if gpu is not None else None
        evs: list = [None] * depth
        k = 0
        for off, n in work:
            b = bufs[k % depth]
            if evs[k % depth] is not None:
                evs[k % depth].synchronize()
            done = 0
            while done < n:
                cb = (ctypes.c_char * (n - done)).from_address(b.data_ptr() + done)
                done += os.preadv(fd, [cb], off + done)
            if gpu is not None:
                with torch.cuda.stream(stream):
                    gpu[off : off + n].copy_(b[:n], non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(stream)
                    evs[k % depth] = ev
            k += 1
        if stream is not None:
            stream.synchronize()

    run_threads(threads, body)
    os.close(fd)


def _mapped(path: str, nbytes: int) -> tuple[int, mmap.mmap, torch.Tensor]:
    """The file mapped read-only (shared) and a uint8 tensor over the mapping."""
    import warnings

    fd = os.open(path, os.O_RDONLY)
    mm = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only buffer: we never write through it
        cpu = torch.frombuffer(mm, dtype=torch.uint8)
    return fd, mm, cpu


def m_register(path: str, nbytes: int, gpu: torch.Tensor, threads: int, chunk: int, flags: int, stats: dict) -> None:
    cudart = torch.cuda.cudart()
    fd, mm, cpu = _mapped(path, nbytes)
    base = cpu.data_ptr()
    work = _Work(nbytes, chunk)
    reg_s = [0.0] * threads
    unreg_s = [0.0] * threads
    errs: list[str] = []

    def body(i: int) -> None:
        stream = torch.cuda.Stream()
        pending: list = []
        for off, n in work:
            t0 = time.perf_counter()
            rc = int(cudart.cudaHostRegister(base + off, n, flags))
            reg_s[i] += time.perf_counter() - t0
            if rc != 0:
                errs.append(f"cudaHostRegister rc={rc} flags={flags}")
                return
            with torch.cuda.stream(stream):
                gpu[off : off + n].copy_(cpu[off : off + n], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
            pending.append((ev, off))
            if len(pending) > 2:
                e, o = pending.pop(0)
                e.synchronize()
                t0 = time.perf_counter()
                cudart.cudaHostUnregister(base + o)
                unreg_s[i] += time.perf_counter() - t0
        for e, o in pending:
            e.synchronize()
            t0 = time.perf_counter()
            cudart.cudaHostUnregister(base + o)
            unreg_s[i] += time.perf_counter() - t0

    run_threads(threads, body)
    cpu = None  # the mapping cannot close while a tensor exports it
    mm.close()
    os.close(fd)
    stats["register_thread_s"] = round(sum(reg_s), 3)
    stats["unregister_thread_s"] = round(sum(unreg_s), 3)
    if errs:
        raise RuntimeError(errs[0])


def m_pageable(path: str, nbytes: int, gpu: torch.Tensor, threads: int, chunk: int) -> None:
    fd, mm, cpu = _mapped(path, nbytes)
    work = _Work(nbytes, chunk)

    def body(i: int) -> None:
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for off, n in work:
                gpu[off : off + n].copy_(cpu[off : off + n], non_blocking=True)
        stream.synchronize()

    run_threads(threads, body)
    cpu = None  # the mapping cannot close while a tensor exports it
    mm.close()
    os.close(fd)


def check(path: str, gpu: torch.Tensor, nbytes: int) -> bool:
    with open(path, "rb") as f:
        for off in (0, nbytes // 3, nbytes - 4 * MiB):
            f.seek(off)
            want = torch.frombuffer(bytearray(f.read(4 * MiB)), dtype=torch.uint8)
            if not torch.equal(gpu[off : off + len(want)].cpu(), want):
                return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=7.5)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--threads", default="16")
    ap.add_argument("--chunks-mb", default="8,64")
    ap.add_argument("--flags", default="8,0,9")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--depths", default="2", help="staging buffers per thread for pread+h2d, e.g. 2,4")
    ap.add_argument("--methods", default="pread,pread+h2d,register,pageable",
                    help="which to time; also pread-pageable (pread into reused pageable buffers, no GPU)")
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    nbytes = int(a.gib * (1 << 30)) // MiB * MiB
    path = os.path.join(a.dir, f"zc_probe_{rank}.bin")
    t0 = time.perf_counter()
    write_file(path, nbytes)
    warm(path)
    dist.barrier()
    if rank == 0:
        print(f"wrote and warmed {world} x {nbytes / (1 << 30):.2f} GiB in {time.perf_counter() - t0:.1f} s", flush=True)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    # warm-up of CUDA, pinned allocator
    torch.empty(8 * MiB, dtype=torch.uint8, pin_memory=True)
    rows = []

    def timed(name: str, fn, **kw) -> None:
        for r in range(a.repeat):
            gpu.zero_()
            torch.cuda.synchronize()
            dist.barrier()
            stats: dict = {}
            err = None
            t = time.perf_counter()
            try:
                fn(stats) if kw.get("stats") else fn()
            except Exception as e:  # noqa: BLE001
                err = f"{type(e).__name__}: {e}"
            torch.cuda.synchronize()
            dt = time.perf_counter() - t
            ok = err is None and (kw.get("nogpu") or check(path, gpu, nbytes))
            got: list = [None] * world
            dist.all_gather_object(got, {"s": dt, "ok": ok, "err": err, **stats})
            if rank == 0:
                worst = max(g["s"] for g in got)
                row = {"method": name, "repeat": r, "slowest_s": round(worst, 3), "gib_s_per_rank": round(nbytes / (1 << 30) / worst, 2), "ranks": got}
                rows.append(row)
                print(json.dumps(row), flush=True)
            if err:
                break

    methods = set(a.methods.split(","))
    for th in [int(x) for x in a.threads.split(",")]:
        for cm in [int(x) for x in a.chunks_mb.split(",")]:
            c = cm * MiB
            if "pread" in methods:
                timed(f"pread T{th} C{cm}", lambda: m_pread(path, nbytes, None, th, c), nogpu=True)
            if "pread-pageable" in methods:
                timed(f"pread-pageable T{th} C{cm}", lambda: m_pread(path, nbytes, None, th, c, pinned=False), nogpu=True)
            if "pread+h2d" in methods:
                for dp in [int(x) for x in a.depths.split(",")]:
                    timed(f"pread+h2d T{th} C{cm} D{dp}", lambda dp=dp: m_pread(path, nbytes, gpu, th, c, depth=dp))
            if "register" in methods:
                for fl in [int(x) for x in a.flags.split(",")]:
                    timed(f"register f{fl} T{th} C{cm}", lambda st, fl=fl: m_register(path, nbytes, gpu, th, c, fl, st), stats=True)
            if "pageable" in methods:
                timed(f"pageable T{th} C{cm}", lambda: m_pageable(path, nbytes, gpu, th, c))
    if rank == 0:
        print("\n| method | best slowest-rank s | GiB/s per rank |\n|---|---|---|")
        best: dict = {}
        for r in rows:
            if all(g["ok"] for g in r["ranks"]):
                if r["method"] not in best or r["slowest_s"] < best[r["method"]]:
                    best[r["method"]] = r["slowest_s"]
            else:
                best.setdefault(r["method"], None)
        for m, s in best.items():
            print(f"| {m} | {s if s is not None else 'failed'} | {round(nbytes / (1 << 30) / s, 2) if s else '-'} |")
        out = os.environ.get("OUT")
        if out:
            with open(os.path.join(out, "zero_copy_probe.json"), "w") as f:
                json.dump(rows, f, indent=1)
    os.unlink(path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
