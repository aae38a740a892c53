"""What the GPU does during real loads: ``torch.profiler`` (CPU and CUDA activity) around the
first two engine runs of each process, for finding whether a load waits on the device (copies,
kernels) or on the thread that feeds it.

``overlay SRC OUT`` copies the sdadapt package under SRC (a ``src`` folder) to ``OUT/src`` and
makes it start the profiler when sdadapt is imported, mark each of a process's first two
``IOEngine.run`` calls ``ENGINE_RUN`` and write each profile, once its run has finished, to
``$SDADAPT_GPU_TIMELINE/timeline-PID-N.json`` (Chrome trace format). Run it through
load_bench's variants, then ``summary DIR`` prints, per engine run: the GPU work by kernel and
copy kind, how long the device was busy (copies, kernels, either), when its first work started,
the share of each 20 ms the copies ran, the CUDA runtime calls, and the queue delay of each
copy and kernel (from the end of the call that queued it to its start on the device)::

    python bench/gpu_timeline.py overlay src /tmp/tl
    python bench/load_bench.py --preset 8b --vocab 32000 ... --paths sdadapt,sdadapt-nvfp4 --no-verify \\
        --repeat 1 --variant tl:src=/tmp/tl/src,SDADAPT_GPU_TIMELINE=$OUT/tl
    python bench/gpu_timeline.py summary $OUT/tl

The profiler itself costs time on every CUDA call (and its start, which here falls inside the
first load's imports), so timed figures of the profiled rows are for diagnosis only.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: the loadbench package

from loadbench.overlay import overlay_main, write_overlay  # noqa: E402

PATCH = '''"""GPU timeline recorder written by bench/gpu_timeline.py (not part of the library)."""
import itertools, os
import torch
from torch.profiler import ProfilerActivity, profile, record_function
from ._engine import engine as _E

_ACTIVITIES = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
_run = _E.IOEngine.run
_count = itertools.count()
_prof = profile(activities=_ACTIVITIES)
_prof.__enter__()


def _synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _profiled_run(self, jobs):
    global _prof
    n = next(_count)
    if n > 1:
        return _run(self, jobs)
    if _prof is None:
        _prof = profile(activities=_ACTIVITIES)
        _prof.__enter__()
    _synchronize()
    try:
        with record_function("ENGINE_RUN"):
            return _run(self, jobs)
    finally:
        _synchronize()
        done, _prof = _prof, None
        done.__exit__(None, None, None)
        folder = os.environ.get("SDADAPT_GPU_TIMELINE")
        if folder:
            os.makedirs(folder, exist_ok=True)
            done.export_chrome_trace(os.path.join(folder, "timeline-%d-%d.json" % (os.getpid(), n)))


_E.IOEngine.run = _profiled_run
'''


def overlay(src: str, out: str) -> None:
    dest = write_overlay(src, out, "_gpu_timeline", PATCH, "bench/gpu_timeline.py")
    print(f"profiled copy of {src} in {dest}: pass src={dest},SDADAPT_GPU_TIMELINE=FOLDER as a load_bench variant")


def _union(spans: list[tuple[float, float]]) -> float:
    """The time covered by ``spans`` (overlaps counted once)."""
    total, cur = 0.0, None
    for a, b in sorted(spans):
        if cur is None or a > cur[1]:
            if cur is not None:
                total += cur[1] - cur[0]
            cur = [a, b]
        else:
            cur[1] = max(cur[1], b)
    return total + (cur[1] - cur[0] if cur is not None else 0.0)


def _sums(events: list[dict[str, Any]]) -> str:
    by: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        by[e["name"][:70]][0] += 1
        by[e["name"][:70]][1] += e["dur"]
    top = sorted(by.items(), key=lambda kv: -kv[1][1])[:8]
    return ", ".join(f"{name} {int(n)}x {d / 1e6:.3f} s" for name, (n, d) in top)


def summarize(path: str) -> list[str]:
    """The summary lines of one timeline file."""
    data = json.load(open(path))
    events = [e for e in (data["traceEvents"] if isinstance(data, dict) else data) if e.get("ph") == "X"]
    runs = [e for e in events if e.get("name") == "ENGINE_RUN"]
    if not runs:
        return [f"== {os.path.basename(path)}: no ENGINE_RUN"]
    t0 = runs[0]["ts"]
    t1 = t0 + runs[0]["dur"]
    inside = [e for e in events if t0 <= e["ts"] <= t1]
    gpu = [e for e in inside if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    copies = [(e["ts"], e["ts"] + e["dur"]) for e in gpu if e["cat"] == "gpu_memcpy"]
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in gpu if e["cat"] == "kernel"]
    lines = [f"== {os.path.basename(path)}: engine {(t1 - t0) / 1e6:.3f} s"]
    lines.append(f"  GPU work: {_sums(gpu) or 'none'}")
    busy, copying, computing = (_union(spans) / 1e6 for spans in (copies + kernels, copies, kernels))
    lines.append(f"  GPU busy {busy:.3f} s: copies {copying:.3f} s, kernels {computing:.3f} s")
    if gpu:
        lines.append(f"  first GPU work at +{(min(e['ts'] for e in gpu) - t0) / 1e3:.1f} ms, "
                     f"last ends at +{(max(e['ts'] + e['dur'] for e in gpu) - t0) / 1e3:.1f} ms")
    bins: collections.Counter[int] = collections.Counter()
    for a, b in copies:
        x = a
        while x < b:
            i = int((x - t0) // 20000)
            end = min(b, t0 + (i + 1) * 20000)
            bins[i] += end - x
            x = end
    lines.append("  copies' share of each 20 ms, %: " + str([round(100 * bins[i] / 20000) for i in range(int((t1 - t0) // 20000) + 1)]))
    runtime = [e for e in inside if e.get("cat") == "cuda_runtime"]
    lines.append(f"  CUDA runtime calls: {_sums(runtime) or 'none'}")
    calls = {e.get("args", {}).get("correlation"): e for e in runtime}
    for cat in ("gpu_memcpy", "kernel"):
        delays = sorted(e["ts"] - (c["ts"] + c["dur"]) for e in gpu if e["cat"] == cat
                        and (c := calls.get(e.get("args", {}).get("correlation"))) is not None)
        if delays:
            lines.append(f"  {cat} queue delay, us: median {delays[len(delays) // 2]:.0f}, "
                         f"90th percentile {delays[int(0.9 * len(delays))]:.0f}, max {delays[-1]:.0f} ({len(delays)})")
    return lines


def summary(folder: str) -> None:
    for path in sorted(glob.glob(os.path.join(folder, "timeline-*.json")), key=os.path.getmtime):
        print("\n".join(summarize(path)))


def main() -> None:
    overlay_main(__doc__, overlay, summary)


if __name__ == "__main__":
    main()
