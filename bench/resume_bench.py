"""Resume benchmark: ``sdadapt.load_state`` of model + AdamW state, first load in a fresh process.

    python bench/resume_bench.py [--mib 256] [--nproc 2] [--repeat 3] [--workdir /tmp/sdadapt-resume-bench] [--keep]

Writes a ``save_state`` checkpoint once: a stack of float32 ``Linear(dim, dim)`` layers of about
``--mib`` MiB of parameters after one AdamW step (so the checkpoint holds three times that:
weights, ``exp_avg``, ``exp_avg_sq``), saved from FSDP2 over ``--nproc`` gloo ranks (one process
and no process group when 1). Then ``--repeat`` times, in new processes: build the model with
other values, shard it the same way, build its AdamW, and time ``load_state`` (the first load of
the process, and apart its read phase: reading, checking, committing, after planning and the
optimizer's state initialisation), then a second load in the same processes (steady state). Each first load is
checked bit-exactly against the saved weights. The page cache is warm (the files were just
written). The ``sdadapt`` imported is the one on ``PYTHONPATH`` first: point it at another
checkout's ``src`` to compare two versions on the same checkpoint. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time

import torch
from torch import nn

MiB = 2**20


def build(layers: int, dim: int, seed: int) -> nn.Module:
    """``layers`` float32 ``Linear(dim, dim)``; weight ``i`` drawn from generator ``seed + i``."""
    model = nn.Sequential(*(nn.Linear(dim, dim) for _ in range(layers)))
    with torch.no_grad():
        for i, layer in enumerate(model):
            g = torch.Generator().manual_seed(seed + i)
            layer.weight.copy_(torch.randn(dim, dim, generator=g))
            layer.bias.copy_(torch.randn(dim, generator=g))
    return model


def shard(model: nn.Module) -> nn.Module:
    """FSDP2 over every rank (each layer, then the root) when a process group is up."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def save(args: argparse.Namespace) -> dict:
    import sdadapt

    model = shard(build(args.layers, args.dim, seed=0))
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)  # fills the moments, leaves the weights as drawn (checked)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    sdadapt.save_state(model, args.ckpt, opt, extra={"step": 1})
    return {}


def timed_reads(spent: list[float]) -> None:
    """Append to ``spent`` the seconds of each load transaction's read phase (``Transaction.run``:
    read every part, check, commit), the part of ``load_state`` after planning and the
    optimizer's state initialisation."""
    from sdadapt._transaction import transaction as _transaction

    run = _transaction.Transaction.run

    def timed(self: _transaction.Transaction, *a: object, **kw: object) -> None:
        t0 = time.perf_counter()
        try:
            run(self, *a, **kw)  # type: ignore[arg-type]
        finally:
            spent.append(time.perf_counter() - t0)

    _transaction.Transaction.run = timed  # type: ignore[method-assign]


def load(args: argparse.Namespace) -> dict:
    import sdadapt

    model = shard(build(args.layers, args.dim, seed=100))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times: list[float] = []
    reads: list[float] = []
    timed_reads(reads)
    for _ in range(2):
        barrier()
        t0 = time.perf_counter()
        sdadapt.load_state(model, args.ckpt, opt, {"step": 0})
        times.append(time.perf_counter() - t0)
    want = build(args.layers, args.dim, seed=0)
    bad = [k for k, v in model.state_dict().items() if not torch.equal(_full(v), want.state_dict()[k])]
    return {"times": times, "reads": reads, "bad": bad, "sdadapt": sdadapt.__file__}


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    if args.nproc > 1:
        dist.init_process_group("gloo")
    try:
        out = {"save": save, "load": load}[args.worker](args)
        rank = dist.get_rank() if dist.is_initialized() else 0
        with open(f"{args.out}.{rank}.json", "w") as f:
            json.dump(out, f)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    os._exit(0)  # see DESIGN.md: gloo workers can abort at interpreter exit


def launch(args: argparse.Namespace, mode: str, out: str) -> list[dict]:
    """Run ``mode`` on ``--nproc`` fresh processes; their JSON results by rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, __file__, "--worker", mode, "--out", out, "--ckpt", args.ckpt]
    cmd += ["--nproc", str(args.nproc), "--layers", str(args.layers), "--dim", str(args.dim)]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(args.nproc))
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(args.nproc)]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"resume_bench: {mode} workers exited with {codes}")
    results = []
    for r in range(args.nproc):
        with open(f"{out}.{r}.json") as f:
            results.append(json.load(f))
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=float, default=256.0, help="MiB of float32 parameters (the checkpoint holds 3x)")
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", default="/tmp/sdadapt-resume-bench")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--worker", choices=["save", "load"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    args.layers = max(1, round(args.mib * MiB / ((args.dim + 1) * args.dim * 4)))
    args.ckpt = os.path.join(args.workdir, "ckpt")
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    try:
        run(args)
    finally:
        if not args.keep:
            shutil.rmtree(args.workdir, ignore_errors=True)


def run(args: argparse.Namespace) -> None:
    launch(args, "save", os.path.join(args.workdir, "save"))
    size = sum(os.path.getsize(os.path.join(args.ckpt, n)) for n in os.listdir(args.ckpt))
    rows: list[list[float]] = []  # per repeat: first load, its read phase, second load, its read phase
    for i in range(args.repeat):
        res = launch(args, "load", os.path.join(args.workdir, f"load{i}"))
        bad = sorted({k for r in res for k in r["bad"]})
        if bad:
            raise SystemExit(f"resume_bench: load {i} restored wrong values for {bad[:4]}")
        rows.append([max(r[what][n] for r in res) for n in (0, 1) for what in ("times", "reads")])
    print(f"sdadapt from {os.path.dirname(res[0]['sdadapt'])}; checkpoint {size / MiB:.0f} MiB "
          f"({args.layers} x Linear({args.dim}, {args.dim}) float32 + AdamW), {args.nproc} rank(s), warm page cache, "
          "slowest rank\n")  # fmt: skip
    print("| seconds | median | runs |\n|---|---|---|")
    names = ["load_state, first in a fresh process", "  of which reading (Transaction.run)",
             "load_state, second in the same process", "  of which reading (Transaction.run)"]  # fmt: skip
    for j, name in enumerate(names):
        col = [row[j] for row in rows]
        print(f"| {name} | {statistics.median(col):.3f} | {', '.join(f'{t:.3f}' for t in col)} |")


if __name__ == "__main__":
    main()
