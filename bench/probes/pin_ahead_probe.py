"""When a process's first GPU load gets its pinned staging slab, with and without pinning it
ahead (``SDADAPT_IO_PIN_AHEAD``, :mod:`sdadapt._engine.pin_ahead`).

    python bench/probes/pin_ahead_probe.py --runs 3                # one GPU
    python bench/probes/pin_ahead_probe.py --runs 3 --fake-cuda    # CPU: CUDA's state faked

Each run is one fresh child process per setting, interleaved (on, off, on, off, ...). A child
imports torch, initialises CUDA on device 0 and makes its context (a tiny tensor there), then,
timed from ``t0``: ``import sdadapt`` and the first lookup of ``sdadapt.load`` (the load's imports,
where pinning ahead starts), then a first load of a small synthetic bf16 safetensors checkpoint
(``--mib``) into a meta model materialised on ``cuda:0``. Recorded from ``t0``: each slab the cache
pins (its thread, start and end), each ``SlabCache.get`` of the staging pool (when the run asked,
how long it waited), the end of the imports, the load's wall time, phases and
``engine_first_task``. ``--fake-cuda`` (a box without CUDA): CUDA's state is faked, a slab is an
mmap'd, huge-page-advised and zeroed mapping without ``cudaHostRegister``, and no load runs: it
shows only whether the pinning runs beside the imports. Prints one line per child and the
medians per setting.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import contextlib, json, os, sys, threading, time
import torch
fake = sys.argv[1] == "fake"
if fake:
    torch.cuda.is_initialized = lambda: True
    torch.cuda.current_device = lambda: 0
    torch._C._cuda_hasPrimaryContext = lambda index: True
    torch.cuda.device = lambda device: contextlib.nullcontext()
else:
    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda")  # the context exists, as in a job that has used its GPU
    torch.cuda.synchronize()
import sdadapt._engine.pinned as P  # the package's face is lazy: this imports pinned alone
events = []
clock = time.perf_counter
if fake:
    import ctypes, mmap
    def allocate(n):
        m = mmap.mmap(-1, n + P.HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        whole = torch.frombuffer(m, dtype=torch.uint8)
        skip = -whole.data_ptr() % P.HUGE_PAGE
        t = whole[skip : skip + n]
        ctypes.CDLL(None).madvise(ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(n), 14)  # MADV_HUGEPAGE
        t.zero_()  # as register_slab does, without cudaHostRegister
        return P.Slab(t, m)
    P.Slab.release = lambda self: None
else:
    allocate = P.SLABS.allocate
def recorded(n):
    a = clock()
    try:
        return allocate(n)
    finally:
        events.append(["pinned", threading.current_thread().name, a, clock(), n])
P.SLABS.allocate = recorded
real_get = P.SlabCache.get
def get(self, n):
    a = clock()
    try:
        return real_get(self, n)
    finally:
        if self is P.SLABS:
            events.append(["get", threading.current_thread().name, a, clock(), n])
P.SlabCache.get = get
t0 = clock()
import sdadapt
sdadapt.load
imported = clock()
out = {"ahead": os.environ.get("SDADAPT_IO_PIN_AHEAD", ""), "imports": imported - t0}
if not fake:
    from safetensors import safe_open
    path = sys.argv[2]
    with safe_open(path, "pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    with torch.device("meta"):
        model = torch.nn.ParameterDict({k: torch.nn.Parameter(torch.empty(s, dtype=torch.bfloat16)) for k, s in shapes.items()})
    start = clock()
    rep = sdadapt.load(model, path, device="cuda:0")
    torch.cuda.synchronize()
    out.update(load=clock() - start, phases=rep.phase_seconds, bytes=rep.bytes_read)
else:
    for th in threading.enumerate():
        if th.name == "sdadapt-pin":
            th.join()
out["events"] = [[k, name, round(a - t0, 4), round(b - t0, 4), n] for k, name, a, b, n in events]
print(json.dumps(out))
sys.stdout.flush()
os._exit(0)  # the first load queued kvikio's start on a thread of its own: not waited for
"""


def _checkpoint(path: str, mib: int) -> None:
    """A bf16 safetensors file of 64 MiB tensors, ``mib`` MiB in all (written once)."""
    import torch
    from safetensors.torch import save_file

    if os.path.exists(path):
        return
    n = max(1, mib // 64)
    save_file({f"w{i}": torch.full((4096, 8192), i, dtype=torch.bfloat16) for i in range(n)}, path)


def _line(r: dict) -> str:
    pins = [e for e in r["events"] if e[0] == "pinned"]
    gets = [e for e in r["events"] if e[0] == "get"]
    text = f"ahead={r['ahead'] or 'unset'}: imports end {r['imports']:.3f}"
    text += "".join(f"; pinned by {e[1]} {e[2]:.3f}..{e[3]:.3f} ({e[4] >> 20} MiB)" for e in pins)
    text += "".join(f"; get by {e[1]} at {e[2]:.3f} waited {e[3] - e[2]:.4f}" for e in gets)
    if "load" in r:
        ph = r["phases"]
        text += f"; load {r['load']:.3f} (plan {ph.get('plan', 0):.3f} materialize {ph.get('materialize', 0):.3f}"
        text += f" dcp_load {ph.get('dcp_load', 0):.3f} engine_first_task {ph.get('engine_first_task', 0):.4f})"
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="children per setting, interleaved")
    ap.add_argument("--fake-cuda", action="store_true", help="no GPU: fake CUDA's state, pin plain zeroed mappings, load nothing")
    ap.add_argument("--mib", type=int, default=1024, help="the synthetic checkpoint's size")
    ap.add_argument("--ckpt", default=os.path.join(tempfile.gettempdir(), "pin_ahead_probe.safetensors"))
    ap.add_argument("--json", help="write every child's record here")
    args = ap.parse_args()
    if not args.fake_cuda:
        _checkpoint(args.ckpt, args.mib)
    results: list[dict] = []
    for _ in range(args.runs):
        for ahead in ("1", "0"):
            env = {**os.environ, "SDADAPT_IO_PIN_AHEAD": ahead}
            cmd = [sys.executable, "-c", CHILD, "fake" if args.fake_cuda else "gpu", args.ckpt]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
            if out.returncode != 0:
                print(f"child failed (ahead={ahead}):\n{out.stderr[-3000:]}", file=sys.stderr)
                sys.exit(1)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            results.append(r)
            print(_line(r), flush=True)
    for ahead in ("1", "0"):
        rs = [r for r in results if r["ahead"] == ahead]
        waits = [sum(e[3] - e[2] for e in r["events"] if e[0] == "get") for r in rs]
        text = f"median ahead={ahead}: imports {statistics.median(r['imports'] for r in rs):.3f} s"
        text += f", staging get waited {statistics.median(waits):.4f} s"
        if rs and "load" in rs[0]:
            text += f", first load {statistics.median(r['load'] for r in rs):.3f} s"
            text += f", engine_first_task {statistics.median(r['phases'].get('engine_first_task', 0) for r in rs):.4f} s"
        print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
