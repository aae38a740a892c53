"""Every rank writing an export, and saves in the background (issue 62, items 3 and 4).

    python bench/write_bench.py --world 8 --out bench/results/write.json

The fixture: the test suite's ``TinyTransformer`` at 4 layers, dim 512, ffn 1376, vocab 8192
(21.2M float32 parameters, 84.9 MB), on ``--world`` gloo processes of this host, as FSDP over
all ranks and as FSDP x TP 2. Per rank:

- **export**: ``sdadapt.export(model, dst)`` to safetensors (every rank writes its regions) and,
  for comparison, to ``format="torch"`` (each tensor gathered on every rank, rank 0 writes):
  bytes this rank wrote (``report.rank_bytes``) against checkpoint / world, seconds, and the
  peak resident memory the call added (``VmHWM`` after the call less ``VmRSS`` before it, the
  peak reset through ``/proc/self/clear_refs``) against this rank's shards.
- **async save** (FSDP mesh, Adam): a training step's seconds; ``save_state`` blocking; then
  ``save_state(..., async_=True)``: how long the call held training against its staging
  (``handle.staging_seconds``: taking the state dicts, then copying them into host memory;
  each part timed here too), the rest being the hand-off to the writing thread; the same on
  the caller's thread CPU clock, the call's own work apart from waiting for a CPU on a loaded
  host; of the hand-off, the part after the call woke the writing thread (``held`` less
  ``handle.held_seconds``: returning, while that thread may take the interpreter lock;
  ``--switch-interval`` sets how long Python lets one thread keep it); how long the
  background write took, and the training steps run while it wrote (their seconds against the
  steps before); ``--async-saves`` of them in a row (the first makes the
  background group, takes the state dicts in full and stages into fresh host memory; the later
  ones reuse all three).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "src"), os.path.join(ROOT, "tests")]

from support.models import TinyTransformer, parallelize  # noqa: E402
from support.training import train_steps  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import sdadapt  # noqa: E402
from sdadapt._state import background, saving  # noqa: E402

SIZE = {"layers": 4, "dim": 512, "heads": 8, "ffn": 1376, "vocab": 8192}


def proc_status(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _export_measured(model: torch.nn.Module, dst: str, fmt: str) -> tuple[sdadapt.reports.ExportReport, float, int]:
    """The export's report, seconds and the peak resident memory it added."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = proc_status("VmRSS")
    t0 = time.perf_counter()
    rep = sdadapt.export(model, dst, format=fmt, max_shard_size="20MB", progress=False)
    return rep, time.perf_counter() - t0, proc_status("VmHWM") - before


def _model(mesh_kind: str, world: int) -> torch.nn.Module:
    torch.manual_seed(0)
    if mesh_kind == "fsdp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    else:
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("fsdp", "tp"))
    return parallelize(TinyTransformer(**SIZE), mesh)


def _shard_bytes(model: torch.nn.Module) -> int:
    return sum((t._local_tensor if isinstance(t, DTensor) else t).nbytes for t in model.state_dict().values())


def worker(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval / 1000)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    rows: dict[str, object] = {}
    tmp = os.path.join(out, "dst")
    os.makedirs(tmp, exist_ok=True)
    if "export" in args.parts:
        warm = _model("fsdp", world)  # the first export imports what it uses: not measured
        sdadapt.export(warm, os.path.join(tmp, "warm"), progress=False)
        sdadapt.export(warm, os.path.join(tmp, "warm.pt"), format="torch", progress=False)
        del warm
    for mesh_kind in ("fsdp", "fsdp_tp2") if "export" in args.parts else ():
        model = _model(mesh_kind, world)
        shards = _shard_bytes(model)
        for fmt in ("safetensors", "torch"):
            dst = os.path.join(tmp, f"{mesh_kind}-{fmt}")
            dist.barrier()
            rep, secs, peak = _export_measured(model, dst, fmt)
            rows[f"export {mesh_kind} {fmt}"] = {"rank_bytes": rep.rank_bytes, "total": rep.bytes, "seconds": secs,
                                                 "peak_added": peak, "shards": shards, "files": len(rep.files)}  # fmt: skip
        del model

    model = _model("fsdp", world)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    train_steps(model, opt, 1)  # Adam's state exists
    steps = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        train_steps(model, opt, 1)
        steps.append(time.perf_counter() - t0)
    dist.barrier()
    t0 = time.perf_counter()
    sdadapt.save_state(model, os.path.join(tmp, "sync"), opt, extra={"step": 1})
    sync = time.perf_counter() - t0
    staging_cpu: list[float] = []  # the copy on this thread's CPU clock: the call's own work, apart from the box's load
    stage = background.stage

    def stage_timed(state: dict) -> dict:
        c0 = time.thread_time()
        try:
            return stage(state)
        finally:
            staging_cpu.append(time.thread_time() - c0)

    background.stage = stage_timed
    take_wall: list[float] = []
    take_cpu: list[float] = []  # the take of the state dicts, the staging's first part
    take = saving.take_state

    def take_timed(*a: object, **kw: object) -> object:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return take(*a, **kw)  # type: ignore[arg-type]
        finally:
            take_wall.append(time.perf_counter() - t0)
            take_cpu.append(time.thread_time() - c0)

    saving.take_state = take_timed  # type: ignore[assignment]
    for i in range(args.async_saves):  # the first stages into fresh memory, the later ones reuse it
        dist.barrier()
        t0, c0 = time.perf_counter(), time.thread_time()
        pending = sdadapt.save_state(model, os.path.join(tmp, f"async{i}"), opt, extra={"step": 2 + i}, async_=True)
        held = time.perf_counter() - t0  # what training waited for, as its loop sees it
        held_cpu = time.thread_time() - c0
        during = []
        while not pending.done():
            s0 = time.perf_counter()
            train_steps(model, opt, 1)
            during.append(time.perf_counter() - s0)
        write = time.perf_counter() - t0
        pending.wait()
        rows["async" if i == 0 else f"async{i + 1}"] = {
            "step": statistics.median(steps), "sync_save": sync, "held": held, "staging": pending.staging_seconds,
            "held_reported": pending.held_seconds, "held_cpu": held_cpu, "staging_cpu": staging_cpu[-1],
            "take": take_wall[-1], "take_cpu": take_cpu[-1],
            "write_done_after": write, "steps_during": len(during),
            "step_during": statistics.median(during) if during else None,
        }  # fmt: skip
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--steps", type=int, default=5, help="training steps timed before the saves")
    p.add_argument("--async-saves", type=int, default=3,
                   help="background saves in a row (the later ones reuse the staging memory and the state dicts taken)")
    p.add_argument("--parts", default="export,async", help="what to measure: export, async (comma-separated)")
    p.add_argument("--switch-interval", type=float, default=None,
                   help="sys.setswitchinterval in ms in every rank (Python's default: 5)")
    p.add_argument("--out", default=None, help="write every rank's figures here (JSON)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="sdadapt-write-bench-") as tmp:
        mp.spawn(worker, args=(args.world, os.path.join(tmp, "store"), args, tmp), nprocs=args.world, join=True)
        ranks = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(args.world)]
    mib = 2**20
    print(f"world {args.world}; per rank: MiB written (x checkpoint/world), peak MiB added, shards MiB, seconds")
    for key in ranks[0]:
        if not key.startswith("export"):
            continue
        total = ranks[0][key]["total"]
        share = total / args.world
        print(f"{key}: checkpoint {total / mib:.1f} MiB, {ranks[0][key]['files']} files")
        for r, rows in enumerate(ranks):
            x = rows[key]
            print(f"  rank {r}: {x['rank_bytes'] / mib:7.2f} MiB ({x['rank_bytes'] / share:4.2f}x)  peak +{x['peak_added'] / mib:6.1f}  "
                  f"shards {x['shards'] / mib:6.1f}  {x['seconds']:.2f} s")
    for i in range(args.async_saves):
        key = "async" if i == 0 else f"async{i + 1}"
        print(f"async save {i + 1} (FSDP, Adam): per rank seconds")
        for r, rows in enumerate(ranks):
            a = rows[key]
            staging_cpu = a["take_cpu"] + a["staging_cpu"]
            print(f"  rank {r}: step {a['step']:.3f}; sync save {a['sync_save']:.2f}; async call held {a['held']:.4f} "
                  f"(staging {a['staging']:.4f} = take {a['take']:.4f} + copy {a['staging'] - a['take']:.4f}; "
                  f"hand-off {a['held'] - a['staging']:.4f}; CPU: held {a['held_cpu']:.4f}, staging {staging_cpu:.4f} = "
                  f"take {a['take_cpu']:.4f} + copy {a['staging_cpu']:.4f}, hand-off {a['held_cpu'] - staging_cpu:.4f}; "
                  f"hand-off after waking the writer {a['held'] - a['held_reported']:.4f}); "
                  f"write done after {a['write_done_after']:.2f}, {a['steps_during']} steps meanwhile "
                  f"({a['step_during'] if a['step_during'] is None else round(a['step_during'], 3)} s each)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"world": args.world, "ranks": ranks}, f, indent=1)


if __name__ == "__main__":
    main()
