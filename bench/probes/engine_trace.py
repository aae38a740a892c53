"""A timeline of the I/O engine's threads during real loads, for finding where a load waits.

``overlay SRC OUT`` copies the sdadapt package under SRC (a ``src`` folder) to ``OUT/src`` and
makes it record, per engine run, when each thread ran each task, read (``preadv``), waited for
a staging or band buffer (and of that, for the copy out of it to finish; on a tree whose lane
waits for the copies, the lane's waits and checks), moved inputs to the device, ran a
dequantisation kernel (block FP8 and the scaled formats; on a tree with a device lane: the
lane thread's time per computation, per upload, per gathered piece and in all), and when a pool
pinned its slab; each run is written to
``$SDADAPT_TRACE/trace-PID-N.json``. Run it through load_bench's variants, then ``summary DIR``
prints, per run, the sums per thread, the slow slab allocations and the bytes read per 50 ms::

    python bench/engine_trace.py overlay src .base/trace
    python bench/load_bench.py --preset 8b ... --paths sdadapt,sdadapt-fp8 --no-verify \\
        --variant tr:src=.base/trace/src,SDADAPT_TRACE=$OUT/tr
    python bench/engine_trace.py summary $OUT/tr

The overlay wraps methods by name (``Worker._run``, ``Worker._read_into``, ...): a tree whose
engine has other names records less. Its cost is a list append per event (a few thousand per
load), yet timed figures from it are for diagnosis only.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: the loadbench package

from loadbench.overlay import overlay_main, write_overlay  # noqa: E402

PATCH = '''"""Timeline recorder written by bench/engine_trace.py (not part of the library)."""
import json, os, threading, time
from ._engine import engine as E, pinned as P, staging as S, workers as W
try:  # the layer packages; older trees kept these modules at the top
    from ._recipes import nodes as N, quant_nodes as QN
except ImportError:
    from . import _nodes as N, _quant_nodes as QN
try:  # the scaled formats (compressed-tensors, NVFP4, MXFP8, ModelOpt): trees that have them
    from ._recipes import quant_scaled_nodes as QSN
except ImportError:
    QSN = None

EVENTS = []  # (thread name, kind, start, end, detail)


def _wrap(cls, name, kind, detail=None):
    f = getattr(cls, name, None) if cls is not None else None
    if f is None:
        return
    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            what = kind(*a, **k) if callable(kind) else kind
            EVENTS.append((threading.current_thread().name, what, t, time.perf_counter(), detail(*a, **k) if detail else None))
    setattr(cls, name, g)


_wrap(W.Worker, "_run", "task", lambda self, task: type(task).__name__)
_wrap(W.Worker, "_read_into", "read", lambda self, path, segments, mem, pos=0: sum(n for _, n in segments))
_wrap(W.Worker, "_buffer", "wait_staging")  # trees before the device lane
_wrap(W.Worker, "band_buffer", "wait_band")
_wrap(W.Worker, "_take", lambda self, buffers: "wait_band" if buffers is self.bands else "wait_staging")
_wrap(W.Worker, "to_device", "to_device")
_wrap(W.Worker, "_upload", "upload")
_wrap(W.StagingIO, "read", "inputs_read")
if hasattr(W, "DeviceLane"):
    from ._engine import device as D
    _wrap(D.DeviceLane, "_kernel", "to_device")  # the lane's whole handling of a computation
    _wrap(D.DeviceLane, "_upload", "lane_upload")
    _wrap(D.DeviceLane, "_gathered", "lane_gather")  # a piece of a gather copied; the last one also launches its kernel
    _wrap(D.DeviceLane, "_do", "lane_busy")  # each item the lane ran; the rest of its time it waited for work
    _wrap(getattr(D, "Copied", None), "wait", "copy_wait")  # trees whose readers wait for the DMA out of their buffers
    _wrap(D.DeviceLane, "_hand_back", lambda self, wait: "copy_wait" if wait else "lane_reap")  # the lane waiting for (checking) copies
_wrap(S.StagingPool, "_new", "pool_new")
_wrap(P.SlabCache, "get", "slab_get", lambda self, nbytes: nbytes)
_wrap(N.Compute, "run", "compute")
_wrap(QN.DequantizedFP8, "_kernel", "kernel")
_wrap(getattr(QSN, "DequantizedScaled", None), "_kernel", "kernel")
_wrap(E.IOEngine, "plan", "plan")
_run = E.IOEngine.run
_count = [0]


def _traced_run(self, jobs):
    EVENTS.clear()
    t = time.perf_counter()
    try:
        return _run(self, jobs)
    finally:
        EVENTS.append((threading.current_thread().name, "engine", t, time.perf_counter(), len(jobs)))
        folder = os.environ.get("SDADAPT_TRACE")
        if folder:
            os.makedirs(folder, exist_ok=True)
            _count[0] += 1
            with open(os.path.join(folder, f"trace-{os.getpid()}-{_count[0]}.json"), "w") as out:
                json.dump(EVENTS, out)


E.IOEngine.run = _traced_run
'''


def overlay(src: str, out: str) -> None:
    dest = write_overlay(src, out, "_tracepatch", PATCH, "bench/engine_trace.py")
    print(f"traced copy of {src} in {dest}: pass src={dest},SDADAPT_TRACE=FOLDER as a load_bench variant")


def summary(folder: str) -> None:
    for path in sorted(glob.glob(os.path.join(folder, "trace-*.json")), key=os.path.getmtime):
        events = json.load(open(path))
        engine = next(e for e in events if e[1] == "engine")
        t0, t1 = engine[2], engine[3]
        print(f"== {os.path.basename(path)}: engine {t1 - t0:.3f} s, {len(events)} events")
        per = collections.defaultdict(lambda: collections.defaultdict(float))
        first: dict[str, float] = {}
        last: dict[str, float] = {}
        for thread, kind, a, b, _ in events:
            per[thread][kind] += b - a
            if thread.startswith(("sdadapt-io", "sdadapt-device")):
                first[thread] = min(first.get(thread, b), a)
                last[thread] = max(last.get(thread, a), b)
        totals = collections.Counter()
        for kinds in per.values():
            totals.update(kinds)
        print("  summed over threads (s):", {k: round(v, 3) for k, v in sorted(totals.items())})
        for thread in sorted(first, key=lambda s: int(s.rsplit("-", 1)[1]) if s[-1].isdigit() else -1):
            d = per[thread]
            print(f"  {thread}: +{first[thread] - t0:.3f}..+{last[thread] - t0:.3f} task {d['task']:.3f} read {d['read']:.3f} "
                  f"wait staging {d['wait_staging']:.3f} band {d['wait_band']:.3f} to_device {d['to_device']:.3f} kernel {d['kernel']:.3f}"
                  f" lane uploads {d['lane_upload']:.3f} lane busy {d['lane_busy']:.3f} copy wait {d['copy_wait']:.3f}"
                  f" lane gathers {d['lane_gather']:.3f} lane checks {d['lane_reap']:.3f}")
        for thread, kind, a, b, detail in events:
            if kind == "slab_get" and b - a > 0.002:
                print(f"  slab of {detail / 2**20:.0f} MiB pinned by {thread} at +{a - t0:.3f} in {b - a:.4f} s")
        read = collections.Counter()
        for _, kind, _start, b, detail in events:
            if kind == "read":
                read[int((b - t0) / 0.05)] += detail
        print("  GiB read per 50 ms:", [round(read[i] / 2**30, 2) for i in range(int((t1 - t0) / 0.05) + 1)])
        tasks = collections.defaultdict(list)
        for _, kind, a, b, detail in events:
            if kind == "task":
                tasks[detail].append(b - a)
        for name, times in sorted(tasks.items()):
            times.sort()
            print(f"  {name}: {len(times)} tasks, {sum(times):.3f} s, median {times[len(times) // 2] * 1e3:.2f} ms, "
                  f"max {times[-1] * 1e3:.2f} ms")


def main() -> None:
    overlay_main(__doc__, overlay, summary)


if __name__ == "__main__":
    main()
