"""Where the fixed phases of a load go (everything but the engine's reads): each path's first
load in a fresh process, then more in the same process, each into a newly built model (``--loads``:
how many in all, default 2), with the main thread's time in the steps of planning, materialising
and DCP's own work summed by step. One rank, the load_bench model (FSDP2 over one rank) and
checkpoint, any of load_bench's sdadapt paths (its quantized twins are written as the paths need
them)::

    python bench/phase_probe.py --preset 8b --dir /tmp/ck --paths sdadapt,sdadapt-fp8
    python bench/phase_probe.py ... --profile 30   # also the first load's 30 costliest calls, by cumulative and own time (cProfile)
    SDADAPT_IO_THREADS=8 python bench/phase_probe.py --preset 8b --dir /tmp/ck --paths sdadapt-nvfp4 --loads 3

The ``SDADAPT_IO_*`` settings of the environment reach every child process (an engine knob
tried on the first load and on later ones).

The steps are wrapped by name where the library looks them up; a step inside another is
counted in both. Figures from it are for diagnosis: the wrappers cost microseconds a call,
cProfile a good deal more.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import json
import os
import pathlib
import pstats
import subprocess
import sys
import time
from collections import defaultdict
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: the loadbench package

# (module, attribute) of each step timed; a function is replaced wherever sdadapt holds it
STEPS = [
    ("sdadapt._transaction.steps", "plan_model"),
    ("sdadapt.sources", "open_source"),
    ("sdadapt._plan.target", "model_state_dict"),
    ("sdadapt._plan.plan", "build_plan"),
    ("sdadapt._load.loading", "_prepare_device"),
    ("sdadapt._transaction.materialize", "_reserve"),
    ("sdadapt._transaction.materialize", "has_meta"),
    ("sdadapt._transaction.materialize", "materialize"),
    ("sdadapt._transaction.transaction", "Transaction.check_files"),
    ("sdadapt._transaction.transaction", "Transaction._read"),
    ("torch.distributed.checkpoint.state_dict_loader", "_load_state_dict"),
    ("sdadapt._engine.reader", "AdaptedStorageReader.read_metadata"),
    ("sdadapt._engine.reader", "AdaptedStorageReader.prepare_local_plan"),
    ("sdadapt._engine.reader", "AdaptedStorageReader.read_data"),
    ("sdadapt._engine.direct", "local_jobs"),  # a load into tensors and DTensors: no dcp.load
    ("sdadapt._engine.direct", "EngineReader.run"),
    ("sdadapt._engine.engine", "IOEngine.run"),
    ("sdadapt._transaction.transaction", "after_read_checks"),
    ("sdadapt._transaction.transaction", "Transaction._commit"),
]

TOTALS: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])


def _timed(name: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def inner(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            rec = TOTALS[name]
            rec[0] += time.perf_counter() - t
            rec[1] += 1

    return inner


def install() -> None:
    """Wrap every step of :data:`STEPS` that exists in this tree (others are skipped)."""
    import importlib

    for mod_name, attr in STEPS:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        owner: Any = mod
        *path, last = attr.split(".")
        for p in path:
            owner = getattr(owner, p, None)
        fn = getattr(owner, last, None) if owner is not None else None
        if fn is None:
            continue
        wrapped = _timed(attr, fn)
        setattr(owner, last, wrapped)
        if not path:  # a module function: also where other modules imported it by name
            for name, m in list(sys.modules.items()):
                if name.startswith("sdadapt") and m is not None and getattr(m, last, None) is fn:
                    setattr(m, last, wrapped)


_LOADS = ("first", "second")


def child(args: argparse.Namespace) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29600 + os.getpid() % 300))
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint  # noqa: F401 - imported before timing, as a job has it
    from loadbench.checkpoint import checkpoint_paths
    from loadbench.models import build_model, parallelize
    from loadbench.paths import adapter_of, source_format
    from loadbench.shapes import PRESETS

    import sdadapt

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1, **({"device_id": dev} if cuda else {}))
    install()
    shape = PRESETS[args.preset]
    files = checkpoint_paths(pathlib.Path(args.dir))
    src = files[source_format(args.path)]
    adapter = adapter_of(args.path, files)
    out = []
    for n in range(args.loads):
        model, blocks = build_model(shape, "titan")
        parallelize(model, blocks, "titan", "fsdp", dev.type)
        TOTALS.clear()
        prof = cProfile.Profile() if args.profile and n == 0 else None
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        if prof is not None:
            prof.enable()
        rep = sdadapt.load(model, src, adapter)
        if prof is not None:
            prof.disable()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
        row = {"path": args.path, "load": _LOADS[n] if n < len(_LOADS) else f"#{n + 1}", "wall": round(wall, 4),
               "phases": rep.phase_seconds, "steps": {k: [round(v[0], 4), v[1]] for k, v in TOTALS.items()}}
        if prof is not None:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(args.profile)
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.profile)
            row["profile"] = s.getvalue()
        out.append(row)
        del model, blocks
    print("PHASES " + json.dumps(out))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="8b")
    p.add_argument("--dir", required=True, help="load_bench's checkpoint folder (written here when missing)")
    p.add_argument("--paths", default="sdadapt,sdadapt-fp8")
    p.add_argument("--rounds", type=int, default=1, help="fresh processes per path, interleaved")
    p.add_argument("--profile", type=int, default=0, help="print the first load's N costliest calls")
    p.add_argument("--loads", type=int, default=2, help="loads per process, each into a newly built model (default 2)")
    p.add_argument("--path", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.path:
        child(args)
        return
    from loadbench.checkpoint import checkpoint_paths, warm_cache, write_checkpoint
    from loadbench.paths import source_format
    from loadbench.shapes import PRESETS

    folder = pathlib.Path(args.dir)
    paths = args.paths.split(",")
    where = checkpoint_paths(folder)
    missing = sorted({f for f in map(source_format, paths) if not os.path.exists(where[f])})
    if missing:  # the same values in every format (one seed), so a format is written only once
        folder.mkdir(parents=True, exist_ok=True)
        write_checkpoint(folder, PRESETS[args.preset], 5.0, missing)
    for r in range(args.rounds):
        for path in paths:
            rate = warm_cache([where[source_format(path)]])
            cmd = [sys.executable, os.path.abspath(__file__), "--preset", args.preset, "--dir", args.dir, "--path", path]
            cmd += ["--profile", str(args.profile), "--loads", str(args.loads)]
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            rows = [json.loads(line[7:]) for line in res.stdout.splitlines() if line.startswith("PHASES ")]
            if res.returncode or not rows:
                print(f"{path}: failed (rc {res.returncode})\n{res.stderr[-3000:]}")
                continue
            for row in rows[0]:
                ph = row["phases"]
                print(f"round {r} {row['path']:<12} {row['load']:<6} wall {row['wall']:.3f}  "
                      + " ".join(f"{k} {v:.4f}" for k, v in ph.items() if not k.startswith("engine_")) + f"  (cache {rate:.1f} GiB/s)")
                for k, (s, c) in sorted(row["steps"].items(), key=lambda kv: -kv[1][0]):
                    print(f"      {k:<45} {s:.4f} s  x{c}")
                if "profile" in row:
                    print(row["profile"])


if __name__ == "__main__":
    main()
