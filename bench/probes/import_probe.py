"""The import tax of a first local-file ``sdadapt.load``: ``import sdadapt`` and every module the
load pulls in, by ``python -X importtime``, in fresh processes.

    python bench/probes/import_probe.py --runs 7            # this machine, sdadapt from this tree
    python bench/probes/import_probe.py --runs 7 --top 20 --out imports.json

Each child does what a training job has done before its checkpoint load (imports torch,
``torch.distributed``, FSDP and TP; builds a small model), then, between two markers on stderr:
``import sdadapt``, an adapter (one rename) and ``sdadapt.load`` of a one-tensor safetensors file.
The self times of the ``-X importtime`` lines between the markers are summed: the import time
the load pays (with ``-X importtime``'s own overhead). Printed: the median of the runs' sums, the
module count, and the packages that cost most (median self time summed per package). sdadapt's
sources are compiled first into a private bytecode cache (as installing a wheel does); ``--source``
leaves them uncompiled (each process compiles what it imports, as an editable install under
``PYTHONDONTWRITEBYTECODE=1`` does). ``--preimport MODULE`` imports MODULE before the markers, as
a trainer that checkpoints has (``torch.distributed.checkpoint``). ``--profile N``: one more child
runs the same region under cProfile (no ``-X importtime``), and the N functions with the most own
time and the N with the most cumulative time are printed: what the importtime lines do not show
(module bodies imported through ``importlib``, pydantic's plugin scan, the load itself).
``--src FOLDER`` imports sdadapt from another tree's ``src`` (two trees compared on one machine).
``--classes N``: N more children time the classes made in the region (no ``-X importtime``;
pydantic and ``dataclasses`` imported before it, so that their class makers can be timed):
each pydantic model's class (its schema and validator built, unless deferred) and each
dataclass, summed per module; printed: the medians, the models whose validators were built, and
the N modules whose dataclasses cost most.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from first_call_probe import _import_lines  # noqa: E402 - its -X importtime parse, between its markers (CHILD writes them)

CHILD = """
import gc, importlib, json, os, sys, time
import torch, torch.distributed, torch.distributed.fsdp, torch.distributed.tensor.parallel
from torch import nn

for name in sys.argv[2:]:
    importlib.import_module(name)
model = nn.Sequential(nn.Linear(4, 3))
if os.environ.get("PROBE_COLLECT") == "1":
    gc.collect()  # as load_bench's worker does before each load: the collector's counts start afresh
runs = []
gc.callbacks.append(lambda phase, info: runs.append((info["generation"], time.perf_counter())))
before = set(sys.modules)
sys.stderr.write("@@sdadapt-first-call-start\\n")
t0, c0 = time.perf_counter(), time.process_time()
import sdadapt

report = sdadapt.load(model, sys.argv[1], sdadapt.Adapter([sdadapt.rename("layer.{p}", "0.{p}")]))
t1, c1 = time.perf_counter(), time.process_time()
sys.stderr.write("@@sdadapt-first-call-end\\n")
assert report.keys_loaded == 2
done = [(g, b - a) for (g, a), (_, b) in zip(runs[::2], runs[1::2]) if a < t1]
print(json.dumps({"wall_s": t1 - t0, "cpu_s": c1 - c0, "modules": sorted(set(sys.modules) - before),
                  "gc_s": sum(d for _, d in done), "gc_full": sum(1 for g, _ in done if g == 2)}))
"""


def _package(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:3] if parts[0] == "torch" else parts[:2] if parts[0] == "sdadapt" else parts[:1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--source", action="store_true", help="leave sdadapt's sources uncompiled")
    ap.add_argument("--preimport", action="append", default=[], metavar="MODULE")
    ap.add_argument("--out", default=None, help="write every run as JSON here")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="also print a cProfile of the region: N rows each")
    ap.add_argument("--src", default=str(SRC), help="the folder holding the sdadapt package to import (another tree's src/)")
    ap.add_argument("--classes", type=int, default=0, metavar="N",
                    help="N more children time the pydantic models and dataclasses the region makes")
    ap.add_argument("--collect", action="store_true",
                    help="gc.collect() in each child before the region, as load_bench's worker does before a load")
    args = ap.parse_args()
    import torch
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory(prefix="sdadapt-import-probe-") as tmp:
        path = str(Path(tmp) / "model.safetensors")
        save_file({"layer.weight": torch.ones(3, 4), "layer.bias": torch.zeros(3)}, path)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([args.src, os.environ.get("PYTHONPATH", "")]),
               "PROBE_COLLECT": "1" if args.collect else "0"}
        if not args.source:
            cache = str(Path(tmp) / "pycache")
            env.update(PYTHONPYCACHEPREFIX=cache)
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            subprocess.run([sys.executable, "-m", "compileall", "-q", args.src], env=env, check=True,
                           stdout=subprocess.DEVNULL)
            # torch and the rest keep their own bytecode: a first run writes theirs into the cache
            subprocess.run([sys.executable, "-c", CHILD, path, *args.preimport], env=env, check=True,
                           capture_output=True)
        runs = []
        for _ in range(args.runs):
            r = subprocess.run([sys.executable, "-X", "importtime", "-c", CHILD, path, *args.preimport],
                               env=env, capture_output=True, text=True, timeout=600)
            if r.returncode != 0:
                sys.exit(f"child failed:\n{r.stderr[-4000:]}")
            res = json.loads(r.stdout.strip().splitlines()[-1])
            res["imports"] = [(us, name) for us, _, _, name in _import_lines(r.stderr)]
            runs.append(res)
        classes = []
        for _ in range(args.classes):
            r = subprocess.run([sys.executable, "-c", _classes_child(), path, *args.preimport],
                               env=env, capture_output=True, text=True, timeout=600)
            if r.returncode != 0:
                sys.exit(f"classes child failed:\n{r.stderr[-4000:]}")
            classes.append(json.loads(r.stdout.strip().splitlines()[-1]))
        profiled = ""
        if args.profile:
            r = subprocess.run([sys.executable, "-c", _profiled_child(args.profile), path, *args.preimport],
                               env=env, capture_output=True, text=True, timeout=600)
            if r.returncode != 0:
                sys.exit(f"profiled child failed:\n{r.stderr[-4000:]}")
            profiled = "cProfile of the region (one more child; times inflated by the profiler):\n" + \
                "\n".join(line for line in r.stderr.splitlines() if "@@sdadapt-first-call" not in line)
    sums = [sum(us for us, _ in r["imports"]) / 1e6 for r in runs]
    counts = [len(r["imports"]) for r in runs]
    by_pkg: dict[str, list[float]] = {}
    for r in runs:
        acc: dict[str, float] = {}
        for us, name in r["imports"]:
            acc[_package(name)] = acc.get(_package(name), 0.0) + us / 1e6
        for k, v in acc.items():
            by_pkg.setdefault(k, []).append(v)
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, bytecode: {'no' if args.source else 'yes'}, "
          f"preimported: {args.preimport or 'nothing'}, {args.runs} runs")
    print(f"imports between the markers (-X importtime self times summed): median {statistics.median(sums):.3f} s "
          f"(runs {', '.join(f'{s:.3f}' for s in sums)}), modules {statistics.median(counts):.0f}")
    gc_s = ", ".join(f"{r['gc_s']:.3f}" for r in runs)
    gc_full = ", ".join(str(r["gc_full"]) for r in runs)
    print(f"import + load, wall median {statistics.median(r['wall_s'] for r in runs):.3f} s, "
          f"process CPU median {statistics.median(r['cpu_s'] for r in runs):.3f} s; the cycle collector in the region: "
          f"{gc_s} s, full collections {gc_full}{' (gc.collect() before it)' if args.collect else ''}")
    print("packages (median self time summed, s):")
    for k, v in sorted(by_pkg.items(), key=lambda kv: -statistics.median(kv[1]))[: args.top]:
        print(f"  {statistics.median(v):.4f}  {k}")
    if classes:
        _print_classes(classes)
    if args.out:
        Path(args.out).write_text(json.dumps({"sums": sums, "runs": runs, "classes": classes}, indent=1))
    if args.profile:
        print(profiled)


_CLASSES_ON = """
import dataclasses
import pydantic._internal._model_construction as _mc
_made = {"models": [], "dataclasses": []}
def _timed(kind, make):
    def run(*a, **k):
        t = time.perf_counter()
        cls = make(*a, **k)
        _made[kind].append((time.perf_counter() - t, getattr(cls, "__module__", "?"), getattr(cls, "__qualname__", "?"),
                            bool(getattr(cls, "__pydantic_complete__", False))))
        return cls
    return run
_mc.ModelMetaclass.__new__ = _timed("models", _mc.ModelMetaclass.__new__)
dataclasses._process_class = _timed("dataclasses", dataclasses._process_class)
"""


def _classes_child() -> str:
    """:data:`CHILD` with the classes the region makes timed (pydantic's model class maker and
    ``dataclasses._process_class`` wrapped before it); their list printed as JSON instead."""
    start = "sys.stderr.write(\"@@sdadapt-first-call-start\\n\")\n"
    end = "print(json.dumps({\"wall_s\""
    if start not in CHILD or end not in CHILD:
        raise SystemExit("import_probe: CHILD's markers changed; --classes cannot find its region")
    head, tail = CHILD.split(end, 1)
    return head.replace(start, _CLASSES_ON + start) + "print(json.dumps(_made))\n"


def _print_classes(children: list[dict]) -> None:
    """The medians over ``children`` of what the region spent making classes."""
    def med(kind: str, pick=lambda row: True) -> float:
        return statistics.median(sum(t for t, *rest in c[kind] if pick(rest)) for c in children)
    ours = lambda row: row[0].split(".")[0] == "sdadapt"  # noqa: E731
    first = children[0]
    built = [f"{m}.{n}" for _, m, n, complete in first["models"] if complete and m.startswith("sdadapt")]
    print(f"classes made in the region ({len(children)} children, median ms): pydantic models "
          f"{len(first['models'])}: {med('models') * 1e3:.2f} (sdadapt's {med('models', ours) * 1e3:.2f}); "
          f"dataclasses {len(first['dataclasses'])}: {med('dataclasses') * 1e3:.2f} "
          f"(sdadapt's {med('dataclasses', ours) * 1e3:.2f})")
    print(f"  sdadapt's models built (schema and validator): {len(built)}: {', '.join(built)}")
    per: dict[str, list[float]] = {}
    for c in children:
        acc: dict[str, float] = {}
        for t, module, _, _ in c["dataclasses"]:
            acc[module] = acc.get(module, 0.0) + t
        for k, v in acc.items():
            per.setdefault(k, []).append(v)
    print("  dataclasses per module (median ms): " + ", ".join(
        f"{k} {statistics.median(v) * 1e3:.2f}" for k, v in sorted(per.items(), key=lambda kv: -statistics.median(kv[1]))[:12]))


def _profiled_child(rows: int) -> str:
    """:data:`CHILD` with the region between its markers run under cProfile; the table on stderr."""
    start = "t0, c0 = time.perf_counter(), time.process_time()\n"
    end = "t1, c1 = time.perf_counter(), time.process_time()\n"
    if start not in CHILD or end not in CHILD:
        raise SystemExit("import_probe: CHILD's timing lines changed; --profile cannot find its region")
    on = "import cProfile, io, pstats\n_pr = cProfile.Profile()\n_pr.enable()\n"
    off = (f"_pr.disable()\n_s = io.StringIO()\nfor _key in ('tottime', 'cumulative'):\n"
           f"    pstats.Stats(_pr, stream=_s).sort_stats(_key).print_stats({rows})\nsys.stderr.write(_s.getvalue())\n")
    return CHILD.replace(start, start + on).replace(end, off + end)


if __name__ == "__main__":
    main()
