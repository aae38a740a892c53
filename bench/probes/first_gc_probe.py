"""Where the cycle collector runs inside a process's first ``sdadapt.load``, and why it is due.

Each round is a fresh process that does what bench/load_bench.py's worker does for the row
``fsdp-sdadapt`` with ``--import-in-load``: imports torch and FSDP only, starts a one-rank gloo
group, ``gc.collect()``, builds and shards the model on meta (untimed), then times
``import sdadapt`` + the adapter + ``sdadapt.load`` (bench/loadbench/paths.py ``timed_load``,
which also reports ``gc`` and ``import_gc``). The model has the tensor count of Llama 8B
(32 layers, 291 tensors) with small widths: the collector's work depends on how many objects the
process holds, not on the bytes.

Every collection of the round is recorded (``gc.callbacks``) with its generation, its start and
length against the timed window, the thread it ran on and the innermost frames that made the
allocation that set it off; with the collector's counters (``gc.get_count()``) and the size of
the oldest generation at the window's start. A full collection is due when the oldest
generation's counter is over its threshold (11 collections of the middle one since the last
full one) and the objects moved into the oldest generation since the last full collection are
more than a quarter of those it held after it (CPython 3.11 and 3.12 alike). Whether a model
build alone crosses that quarter depends on the process's size: ``--ballast N`` keeps N more
small objects alive from before the model build (a larger process, as the device's CUDA stack
makes one), which moves the crossing from the build into the timed load.

    python bench/probes/first_gc_probe.py --rounds 3                     # this tree's sdadapt
    python bench/probes/first_gc_probe.py --rounds 3 --ballast 60000      # the build no longer crosses
    python bench/probes/first_gc_probe.py --src OTHER/src --ballast 60000 # another tree, to compare

``--after-build N``: N small objects made and kept after the model build (a user's other state),
which moves the collector's counters (with ``--ballast 40000 --after-build 4000`` on cpu2,
torch 2.13, the first load shows the device's pattern: a middle-generation collection in the
imports, then the full one). ``--collect-after-build``: a ``gc.collect()`` after the model build,
so that the window holds only what the loader itself makes due. After the window the caller
makes 3000 small objects: a full collection left due runs there (printed "after the call").
``--json FILE`` writes every round.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="fresh processes, one first load each")
    ap.add_argument("--ballast", type=int, default=0, help="small objects kept alive from before the model build")
    ap.add_argument("--after-build", type=int, default=0, help="small objects made and kept after the model build")
    ap.add_argument("--collect-after-build", action="store_true", help="gc.collect() after the model build (labelled)")
    ap.add_argument("--src", default=None, help="a folder holding the sdadapt package to import (default: installed)")
    ap.add_argument("--json", default=None, help="write every round here")
    ap.add_argument("--round", default=None, help=argparse.SUPPRESS)  # a child: its config
    args = ap.parse_args()
    if args.round:
        print(json.dumps(child(json.loads(args.round))))
        return 0
    sys.path.insert(0, str(BENCH))
    from loadbench.checkpoint import write_checkpoint
    from loadbench.shapes import Shape

    shape = Shape(layers=32, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=1024)
    folder = Path(tempfile.mkdtemp(prefix="sdadapt-gc-probe-"))
    rounds: list[dict[str, Any]] = []
    try:
        files = write_checkpoint(folder, shape, 5.0, ["safetensors"])
        cfg = {"files": files, "shape": shape.__dict__, "ballast": args.ballast, "after_build": args.after_build, "src": args.src,
               "collect_after_build": args.collect_after_build}
        for i in range(args.rounds):
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29600 + (os.getpid() + i) % 300)}
            out = subprocess.run([sys.executable, __file__, "--round", json.dumps(cfg)], capture_output=True, text=True,
                                 timeout=300, env=env)
            if out.returncode != 0:
                print(out.stderr[-3000:], file=sys.stderr)
                return 1
            r = json.loads(out.stdout.strip().splitlines()[-1])
            rounds.append(r)
            show(i, r)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    walls = [r["wall"] for r in rounds]
    fulls = [r["gc"]["full_seconds"] for r in rounds]
    print(f"median: first load {statistics.median(walls):.3f} s; full collections inside {statistics.median(fulls):.3f} s "
          f"({sum(1 for f in fulls if f)} of {len(rounds)} rounds had one)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rounds": rounds}, indent=1))
    return 0


def show(i: int, r: dict[str, Any]) -> None:
    print(f"round {i}: first load {r['wall']:.3f} s (imports {r['import_s']:.3f}); gc {r['gc']}; import_gc {r['import_gc']}")
    print(f"  counts after the build {r['counts_built']}, oldest generation {r['oldest_after_collect']} after the "
          f"collect -> {r['oldest_built']} after the build; build's collections {r['build_runs']}")
    for run in r["runs"]:
        if run["in_window"] or run["gen"] == 2:
            print(f"  gen{run['gen']} at +{run['at']:.3f} s for {run['seconds']:.4f} s on {run['thread']}"
                  f"{'' if run['in_window'] else ' (after the call)'}: " + " < ".join(run["where"]))


def child(cfg: dict[str, Any]) -> dict[str, Any]:
    """One fresh process's first load, as the bench's worker makes it (see the module's doc)."""
    if cfg["src"]:
        sys.path.insert(0, os.path.abspath(cfg["src"]))
    sys.path.insert(0, str(BENCH))
    import torch
    import torch.distributed as dist
    import torch.distributed.fsdp  # noqa: F401 - the bench's USER_LIBRARIES
    import torch.distributed.tensor.parallel  # noqa: F401
    from loadbench.memory import RssSampler
    from loadbench.paths import Job, prepare, timed_load
    from loadbench.shapes import Shape

    dist.init_process_group("gloo", rank=0, world_size=1)
    ballast = [[i] for i in range(cfg["ballast"])]  # noqa: F841 - the rest of a larger process, alive throughout
    runs: list[dict[str, Any]] = []
    started: dict[int, tuple[int, float, list[str], str]] = {}

    def note(phase: str, info: dict[str, int]) -> None:
        now = time.perf_counter()
        if phase == "start":
            frames = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-1]
                      if "first_gc_probe" not in f.filename]
            started[threading.get_ident()] = (info["generation"], now, frames[-6:][::-1], threading.current_thread().name)
        elif threading.get_ident() in started:
            gen, t, where, name = started.pop(threading.get_ident())
            runs.append({"gen": gen, "start": t, "seconds": now - t, "where": where, "thread": name})

    job, shape, dev = Job("fsdp", "sdadapt"), Shape(**cfg["shape"]), torch.device("cpu")
    gc.collect()
    oldest_after_collect = len(gc.get_objects(2))
    gc.callbacks.append(note)
    model = prepare(job, shape, dev)
    more = [[i] for i in range(cfg["after_build"])]  # noqa: F841 - a user's other state, made after the model
    build_runs = [sum(1 for r in runs if r["gen"] == g) for g in range(3)]
    if cfg["collect_after_build"]:
        gc.collect()
    counts_built, oldest_built = gc.get_count(), len(gc.get_objects(2))
    del runs[:]
    with RssSampler(0.003):
        w0 = time.perf_counter()
        facts = timed_load(model, job, cfg["files"], dev)
        w1 = w0 + facts["wall"]
    time.sleep(0.2)  # a background thread's collection just after the window shows as outside it
    later = [[i] for i in range(3000)]  # noqa: F841 - the caller's next allocations: what the load left due runs here
    gc.callbacks.remove(note)
    for r in runs:
        r["at"] = r.pop("start") - w0
        r["in_window"] = 0 <= r["at"] <= w1 - w0
    import sdadapt

    return {"wall": facts["wall"], "import_s": facts.get("import_s", 0.0), "gc": facts["gc"], "import_gc": facts.get("import_gc"),
            "phases": facts.get("phases"), "counts_built": list(counts_built), "oldest_after_collect": oldest_after_collect,
            "oldest_built": oldest_built, "build_runs": build_runs, "runs": runs, "sdadapt": sdadapt.__file__,
            "python": sys.version.split()[0], "torch": torch.__version__}


if __name__ == "__main__":
    raise SystemExit(main())
