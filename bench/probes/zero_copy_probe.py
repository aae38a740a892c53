"""Probe: how fast can one rank move a warm file's bytes to its GPU, by method?

Run with ``torchrun --nproc-per-node N bench/zero_copy_probe.py --gib 7.5`` on a GPU machine.
Each rank writes its own file (random bytes), reads it once to warm the page cache, then
times, all ranks at once (barrier before each, slowest rank reported):

- ``pread``: T threads ``preadv`` into their own pinned buffers (no GPU): the page-cache reference.
- ``pread-pageable``: the same into reused pageable buffers (is filling pinned memory slower?).
- ``pread+h2d``: the same, then a non-blocking host-to-device copy per chunk on each thread's
  stream (``--depths`` buffers per thread; ``--lags L``: a chunk's copy is queued only after
  L more chunks are read): what ``sdadapt.load``'s staged path does.
- ``register``: ``mmap`` the file read-only; per chunk ``cudaHostRegister`` (flags below) the
  mapped page-cache pages, copy them to the GPU with a DMA, ``cudaHostUnregister``: no CPU copy.
- ``register-file``: ``mmap`` the file read-only and register it once, in regions of
  ``--region-mb`` (each thread registers a region, then copies it to the GPU chunk by chunk, so
  that registering the next region overlaps the DMA of the last), unregistered at the end: what
  InstantTensor's MMAP backend does (it registers each whole mapped file,
  ``cudaHostRegisterReadOnly``). Registration and unregistration time are reported apart.
- ``pageable``: copy from the mapping to the GPU without registering (the driver stages).
- ``pread-huge`` / ``pread+h2d-huge``: the same with buffers of anonymous memory asked for
  transparent huge pages (registered with ``cudaHostRegister`` for the GPU copy).
- ``h2d``: no file at all: each thread copies its pinned buffers to the GPU over and over, as
  many bytes as the file has (the DMA ceiling with every rank copying at once).

``--bind gpu`` pins each rank (before it allocates anything) to the CPUs of its GPU's NUMA node
(``/sys/bus/pci/devices/<gpu>/local_cpulist``); rank 0 prints the machine's NUMA layout.

Every method's GPU result is compared with the file. Prints one JSON line per method and rank 0
a table. Nothing here is used by the library; it decides how the engine should move bytes.
bench/reports/staging-buffers-h200x2-2026-11-30.md gives the run of: ``--methods
pread,pread-pageable,pread-huge,pread+h2d,pread+h2d-huge,h2d --threads 12,16 --chunks-mb 2,8
--depths 2,4 --bind none``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import threading
import time
from functools import partial

import torch
import torch.distributed as dist

MiB = 1 << 20


def _cpulist(text: str) -> list[int]:
    out: list[int] = []
    for part in text.strip().split(","):
        if part:
            a, _, b = part.partition("-")
            out.extend(range(int(a), int(b or a) + 1))
    return out


def gpu_pci_dir(dev: int) -> str | None:
    """The sysfs folder of CUDA device ``dev`` (from its PCI address), if found."""
    props = torch.cuda.get_device_properties(dev)
    bus = getattr(props, "pci_bus_id", None)
    if bus is None:
        return None
    addr = f"{getattr(props, 'pci_domain_id', 0):04x}:{bus:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"
    d = f"/sys/bus/pci/devices/{addr}"
    return d if os.path.isdir(d) else None


def topology(dev: int) -> dict:
    """The GPU's NUMA node and local CPUs, and every node's CPUs."""
    info: dict = {"gpu": dev, "pci": gpu_pci_dir(dev)}
    if info["pci"]:
        for f in ("numa_node", "local_cpulist", "current_link_speed", "current_link_width"):
            try:
                info[f] = open(os.path.join(info["pci"], f)).read().strip()
            except OSError:
                pass
    nodes = {}
    base = "/sys/devices/system/node"
    if os.path.isdir(base):
        for n in sorted(os.listdir(base)):
            if n.startswith("node") and n[4:].isdigit():
                try:
                    nodes[n] = open(os.path.join(base, n, "cpulist")).read().strip()
                except OSError:
                    pass
    info["nodes"] = nodes
    info["affinity"] = len(os.sched_getaffinity(0))
    for f in ("enabled", "defrag"):
        try:
            info["thp_" + f] = open(f"/sys/kernel/mm/transparent_hugepage/{f}").read().strip()
        except OSError:
            pass
    return info


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

    def __iter__(self) -> _Work:
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


def _huge(nbytes: int, register: bool) -> tuple[mmap.mmap, torch.Tensor]:
    """Anonymous memory asked to be backed by transparent huge pages (``MADV_HUGEPAGE``), touched,
    and with ``register`` pinned by ``cudaHostRegister``."""
    import warnings

    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mm.madvise(getattr(mmap, "MADV_HUGEPAGE", 14))
    except OSError:
        pass
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = torch.frombuffer(mm, dtype=torch.uint8)
    t.fill_(0)
    if register:
        rc = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0))
        if rc != 0:
            raise RuntimeError(f"cudaHostRegister rc={rc}")
    return mm, t


def m_pread(path: str, nbytes: int, gpu: torch.Tensor | None, threads: int, chunk: int, depth: int = 2, pinned: bool = True,
            huge: bool = False, lag: int = 0) -> None:
    """``pread`` each chunk into one of ``depth`` buffers of the thread (pinned, or pageable and
    reused, or with ``huge`` huge-page memory, registered with CUDA when copying to the GPU),
    then (with ``gpu``) copy it to the GPU without waiting; with ``lag`` L, a chunk's copy is
    queued only after the thread has read L more chunks (so its lines have left the core's cache:
    does a DMA out of lines still dirty in the writer's L2 stall?)."""
    depth = max(depth, lag + 2)
    import ctypes

    work = _Work(nbytes, chunk)
    keep: list = []
    fd = os.open(path, os.O_RDONLY)

    def body(i: int) -> None:
        if huge:
            mem = _huge(chunk * depth, register=gpu is not None)
            keep.append(mem)
            bufs = [mem[1][k * chunk : (k + 1) * chunk] for k in range(depth)]
        else:
            bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=pinned) for _ in range(depth)]
        stream = torch.cuda.Stream() if gpu is not None else None
        evs: list = [None] * depth
        waiting: list[tuple[int, int, int]] = []  # (buffer, file offset, bytes) read, not yet copied

        def send(j: int, off: int, n: int) -> None:
            with torch.cuda.stream(stream):
                gpu[off : off + n].copy_(bufs[j][:n], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
                evs[j] = ev

        k = 0
        for off, n in work:
            j = k % depth
            b = bufs[j]
            if evs[j] is not None:
                evs[j].synchronize()
            done = 0
            while done < n:
                cb = (ctypes.c_char * (n - done)).from_address(b.data_ptr() + done)
                done += os.preadv(fd, [cb], off + done)
            if gpu is not None:
                waiting.append((j, off, n))
                if len(waiting) > lag:
                    send(*waiting.pop(0))
            k += 1
        for w in waiting:
            send(*w)
        if stream is not None:
            stream.synchronize()

    run_threads(threads, body)
    os.close(fd)
    for mm, t in keep:
        if gpu is not None:
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
        t = None  # the mapping cannot close while a tensor exports it
        mm.close()


def m_h2d(nbytes: int, gpu: torch.Tensor, threads: int, chunk: int, depth: int = 2) -> None:
    """Copy pinned buffers to the GPU, chunk after chunk, without reading anything."""
    work = _Work(nbytes, chunk)

    def body(i: int) -> None:
        bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(depth)]
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for k, (off, n) in enumerate(work):
                gpu[off : off + n].copy_(bufs[k % depth][:n], non_blocking=True)
        stream.synchronize()

    run_threads(threads, body)


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


def m_register_file(path: str, nbytes: int, gpu: torch.Tensor, threads: int, chunk: int, flags: int, region: int,
                    stats: dict) -> None:
    """The mapped file registered once, region by region, each region copied to the GPU by the
    thread that registered it; every region unregistered after the last copy."""
    cudart = torch.cuda.cudart()
    fd, mm, cpu = _mapped(path, nbytes)
    base = cpu.data_ptr()
    regions = _Work(nbytes, region)
    reg_s = [0.0] * threads
    registered: list[int] = []
    errs: list[str] = []

    def body(i: int) -> None:
        stream = torch.cuda.Stream()
        for off, n in regions:
            t0 = time.perf_counter()
            rc = int(cudart.cudaHostRegister(base + off, n, flags))
            reg_s[i] += time.perf_counter() - t0
            if rc != 0:
                errs.append(f"cudaHostRegister rc={rc} flags={flags}")
                return
            registered.append(off)
            with torch.cuda.stream(stream):
                for o, m in chunks(n, chunk):
                    gpu[off + o : off + o + m].copy_(cpu[off + o : off + o + m], non_blocking=True)
        stream.synchronize()

    try:
        run_threads(threads, body)
    finally:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for off in registered:
            cudart.cudaHostUnregister(base + off)
        stats["unregister_s"] = round(time.perf_counter() - t0, 3)
        cpu = None  # the mapping cannot close while a tensor exports it
        mm.close()
        os.close(fd)
    stats["register_thread_s"] = round(sum(reg_s), 3)
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
    ap.add_argument("--chunks-mb", default="8,64", help="chunk sizes in MiB, e.g. 1,2,4,8 (fractions allowed)")
    ap.add_argument("--flags", default="8,0,9")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--depths", default="2", help="staging buffers per thread for pread+h2d, e.g. 2,4")
    ap.add_argument("--methods", default="pread,pread+h2d,register,pageable",
                    help="which to time; also pread-pageable (pread into reused pageable buffers, no GPU) and h2d")
    ap.add_argument("--region-mb", default="1024", help="register-file: MiB registered at a time, e.g. 256,1024,7680")
    ap.add_argument("--lags", default="0", help="pread+h2d: queue a chunk's copy after reading this many more, e.g. 0,1")
    ap.add_argument("--bind", choices=["none", "gpu"], default="none",
                    help="gpu: run each rank on the CPUs of its GPU's NUMA node")
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    topo = topology(local)
    if a.bind == "gpu":
        cpus = _cpulist(topo.get("local_cpulist", ""))
        if cpus:
            os.sched_setaffinity(0, cpus)
        topo["bound_to"] = len(os.sched_getaffinity(0))
    topos: list = [None] * world
    dist.all_gather_object(topos, topo)
    if rank == 0:
        print("topology:", json.dumps(topos), flush=True)
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
            ok = err is None and (kw.get("nogpu") or not kw.get("check_file", True) or check(path, gpu, nbytes))
            got: list = [None] * world
            dist.all_gather_object(got, {"s": dt, "ok": ok, "err": err, **stats})
            if rank == 0:
                worst = max(g["s"] for g in got)
                row = {"method": name, "repeat": r, "slowest_s": round(worst, 3),
                       "gib_s_per_rank": round(nbytes / (1 << 30) / worst, 2), "ranks": got}
                rows.append(row)
                print(json.dumps(row), flush=True)
            if err:
                break

    methods = set(a.methods.split(","))
    for th in [int(x) for x in a.threads.split(",")]:
        for cm in [float(x) for x in a.chunks_mb.split(",")]:
            c = int(cm * MiB)
            if "pread" in methods:
                timed(f"pread T{th} C{cm:g}", partial(m_pread, path, nbytes, None, th, c), nogpu=True)
            if "pread-pageable" in methods:
                timed(f"pread-pageable T{th} C{cm:g}", partial(m_pread, path, nbytes, None, th, c, pinned=False), nogpu=True)
            if "pread-huge" in methods:
                timed(f"pread-huge T{th} C{cm:g}", partial(m_pread, path, nbytes, None, th, c, pinned=False, huge=True), nogpu=True)
            if "pread+h2d-huge" in methods:
                for dp in [int(x) for x in a.depths.split(",")]:
                    timed(f"pread+h2d-huge T{th} C{cm:g} D{dp}", partial(m_pread, path, nbytes, gpu, th, c, depth=dp, huge=True))
            if "pread+h2d" in methods:
                for lag in [int(x) for x in a.lags.split(",")]:
                    for dp in sorted({max(int(x), lag + 2) for x in a.depths.split(",")}):
                        timed(f"pread+h2d T{th} C{cm:g} D{dp} L{lag}", partial(m_pread, path, nbytes, gpu, th, c, depth=dp, lag=lag))
            if "h2d" in methods:
                timed(f"h2d T{th} C{cm:g}", partial(m_h2d, nbytes, gpu, th, c), check_file=False)
            if "register" in methods:
                for fl in [int(x) for x in a.flags.split(",")]:
                    timed(f"register f{fl} T{th} C{cm:g}", partial(m_register, path, nbytes, gpu, th, c, fl), stats=True)
            if "register-file" in methods:
                for fl in [int(x) for x in a.flags.split(",")]:
                    for rm in [float(x) for x in a.region_mb.split(",")]:
                        timed(f"register-file f{fl} T{th} C{cm:g} R{rm:g}",
                              partial(m_register_file, path, nbytes, gpu, th, c, fl, int(rm * MiB)), stats=True)
            if "pageable" in methods:
                timed(f"pageable T{th} C{cm:g}", partial(m_pageable, path, nbytes, gpu, th, c))
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
            with open(os.path.join(out, f"zero_copy_probe_{a.bind}.json"), "w") as f:
                json.dump(rows, f, indent=1)
    os.unlink(path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
