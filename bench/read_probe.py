"""Is an FP8 load's reading slower than a plain load's because of the file, the machine, or
the dequantising path? Three ways of reading the same FP8 release (the file of
``bench/lane_probe.py``: ``--tensors`` e4m3 matrices with float32 128x128 scales), each
``--repeat`` times after a warm-up:

- ``raw``: ``--threads`` threads ``preadv`` the file's bytes in ``--chunks`` MiB pieces into
  buffers of one pinned slab (``sdadapt._engine.pinned.register_slab``), nothing else: what
  the machine's page cache gives that many threads (``--copy``: each piece also copied to the
  GPU, waited for before the buffer is read into again, two buffers per thread);
- ``plain``: ``IOEngine.run`` of the e4m3 matrices as they are into e4m3 tensors on the GPU
  (the staged reads and host-to-device copies of a bf16 load, with FP8 bytes);
- ``dequant``: ``IOEngine.run`` of the dequantisation into bf16 tensors on the GPU (the FP8
  load's path);
- ``no-kernel``: the same with the dequantisation kernel replaced by nothing (the inputs still
  cross to the GPU): what the kernels cost the run.

Each prints seconds and GiB/s over the bytes read, and for the engine's runs the threads'
busy, read and wait seconds. ``SDADAPT_IO_*`` variables apply to the engine's runs::

    python bench/read_probe.py --tensors 64 --threads 12 --chunks 10.667,21.333 --repeat 2

Its runs so far are in the git history of bench/RESULTS.md and bench/results/ (the FP8
load's tuning on one H200); bench/RESULTS.md keeps only current figures.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import tempfile
import threading
import time

import torch
from safetensors.torch import save_file

from sdadapt._base.regions import full_box
from sdadapt._engine import EngineConfig, IOEngine
from sdadapt._engine.pinned import register_slab
from sdadapt._engine.tasks import Job
from sdadapt._recipes import quant as Q
from sdadapt._recipes import quant_nodes as QN
from sdadapt._recipes.nodes import Leaf
from sdadapt.sources import open_source

BLOCK = (128, 128)
MiB = 1 << 20


def _file(tensors: int, rows: int, cols: int, where: str) -> str:
    """The FP8 release (the same name and contents as bench/lane_probe.py's), written once."""
    path = os.path.join(where, f"lane_probe_{tensors}x{rows}x{cols}.safetensors")
    if not os.path.exists(path):
        torch.manual_seed(0)
        sd = {}
        for i in range(tensors):
            w, s = Q.quantize_fp8(torch.randn(rows, cols, device="cuda"), BLOCK, "float32")
            sd[f"w{i}"], sd[f"w{i}_scale_inv"] = w.cpu(), s.cpu()
        save_file(sd, path)
    with open(path, "rb") as f:  # warm the page cache
        while f.read(64 << 20):
            pass
    return path


def raw(path: str, threads: int, chunk: int, copy: bool) -> tuple[float, int]:
    """Seconds for ``threads`` threads to preadv the whole file in ``chunk``-byte pieces (each
    thread a contiguous share), and the bytes read."""
    size = os.path.getsize(path)
    depth = 2 if copy else 1
    slab = register_slab(threads * depth * chunk)
    dev = torch.empty(threads * depth * chunk, dtype=torch.uint8, device="cuda") if copy else None
    share = -(-size // threads)
    fd = os.open(path, os.O_RDONLY)
    start_line = threading.Barrier(threads + 1)

    def body(i: int) -> None:
        bufs = [slab.tensor[(i * depth + k) * chunk : (i * depth + k + 1) * chunk] for k in range(depth)]
        events = [None] * depth
        stream = torch.cuda.Stream() if copy else None
        start_line.wait()
        at, end, k = i * share, min(size, (i + 1) * share), 0
        while at < end:
            n = min(chunk, end - at)
            if events[k] is not None:
                events[k].synchronize()
            os.preadv(fd, [(ctypes.c_char * n).from_address(bufs[k].data_ptr())], at)
            if copy:
                assert dev is not None and stream is not None
                with torch.cuda.stream(stream):
                    off = (i * depth + k) * chunk
                    dev[off : off + n].copy_(bufs[k][:n], non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(stream)
                    events[k] = ev
            at += n
            k = (k + 1) % depth
        if stream is not None:
            stream.synchronize()

    ths = [threading.Thread(target=body, args=(i,)) for i in range(threads)]
    for th in ths:
        th.start()
    start_line.wait()
    t = time.perf_counter()
    for th in ths:
        th.join()
    secs = time.perf_counter() - t
    os.close(fd)
    slab.release()
    return secs, size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tensors", type=int, default=24)
    p.add_argument("--shape", default="4096,14336", help="rows,cols of each matrix (multiples of 128)")
    p.add_argument("--threads", type=int, default=12)
    p.add_argument("--chunks", default="10.667,21.333", help="raw reads' piece sizes, MiB")
    p.add_argument("--copy", action="store_true", help="raw reads also copy each piece to the GPU")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--dir", default=tempfile.gettempdir())
    a = p.parse_args()
    rows, cols = (int(n) for n in a.shape.split(","))
    path = _file(a.tensors, rows, cols, a.dir)
    gib = 2**30
    for chunk in (int(float(c) * MiB) for c in a.chunks.split(",")):
        for r in range(a.repeat + 1):
            secs, n = raw(path, a.threads, chunk, a.copy)
            print(f"raw{' +copy' if a.copy else ''} {chunk / MiB:.1f} MiB x {a.threads} threads run {r}: "
                  f"{secs:.3f} s, {n / gib / secs:.1f} GiB/s" + (" (warm-up)" if r == 0 else ""), flush=True)
    with open_source(path) as src:
        w = {f"w{i}": Leaf(f"w{i}", (rows, cols), Q.FP8_DTYPE) for i in range(a.tensors)}
        nodes = {
            "plain": w,
            "dequant": {k: QN.DequantizedFP8(n, Leaf(f"{k}_scale_inv", (rows // BLOCK[0], cols // BLOCK[1]), torch.float32),
                                         BLOCK, "float32", torch.bfloat16) for k, n in w.items()},
        }
        nodes["no-kernel"] = nodes["dequant"]
        real_kernel = QN.DequantizedFP8._kernel
        for name, by_key in nodes.items():
            QN.DequantizedFP8._kernel = (lambda self, box, dest, w, s: None) if name == "no-kernel" else real_kernel  # type: ignore[method-assign]
            dests = {k: torch.empty(rows, cols, dtype=n.dtype, device="cuda") for k, n in by_key.items()}
            for r in range(a.repeat + 1):
                cfg = EngineConfig.from_env()
                cfg.threads = a.threads
                jobs = [Job(k, n, full_box(n.shape), dests[k]) for k, n in by_key.items()]
                torch.cuda.synchronize()
                t = time.perf_counter()
                st = IOEngine(src, cfg).run(jobs)
                torch.cuda.synchronize()
                secs = time.perf_counter() - t
                print(f"{name} engine, {a.threads} threads run {r}: {secs:.3f} s, {st.bytes_read / gib:.2f} GiB, "
                      f"{st.bytes_read / gib / secs:.1f} GiB/s; threads busy {st.busy_seconds:.3f} s, read "
                      f"{st.read_seconds:.3f} s, waited {st.wait_seconds:.3f} s" + (" (warm-up)" if r == 0 else ""),
                      flush=True)


if __name__ == "__main__":
    main()
