"""What a steady ``sdadapt.load`` costs besides moving bytes: the calling thread's CPU time per
load and per phase, at the tensor count of Llama 8B (32 layers, 291 tensors) with small widths,
so that the bytes read are negligible and what is left is the per-tensor work (planning, the
agreement, materialising, DCP's steps, the engine's planning, the commit).

    python bench/probes/steady_overhead_probe.py --loads 9                 # CPU, one gloo rank
    python bench/probes/steady_overhead_probe.py --loads 9 --profile 30     # and cProfile's top 30
    python bench/probes/steady_overhead_probe.py --device cuda --loads 9   # the same into a GPU

One process, world 1, an FSDP2 model built on meta per load (untimed), the checkpoint written
once to a temp folder (removed at the end). The process's first load (imports, first use) is
left out. Printed: per load the wall time, the calling thread's CPU time (``time.thread_time``:
what the interpreter did on that thread, not charged for other processes on a shared machine)
and ``LoadReport.phase_seconds``; then the medians. ``--profile N`` runs one more load under
cProfile on the thread's CPU clock and prints the N functions with most own and most cumulative
time. ``--pieces`` times, on the same model (calling thread's CPU, best of 9), steps a load
repeats per tensor: materialising (``model._apply`` with sdadapt's ``_empty_like``, as
``to_empty`` does; the same work without ``Module._apply``: a new ``Parameter`` per tensor
swapped in; and sdadapt's own ``to_empty``, where the tree has it), ``model.state_dict()``,
``load_targets`` (where the tree has it), one walk over the parameters and ``has_meta``. ``--src FOLDER`` imports
sdadapt from another tree's ``src`` (to compare two trees on one machine, interleaved runs).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loads", type=int, default=9, help="timed steady loads (after one untimed first load)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--profile", type=int, default=0, help="one more load under cProfile: print its top N")
    ap.add_argument("--src", default=None, help="a folder holding the sdadapt package to import (default: installed)")
    ap.add_argument("--json", default=None, help="write the loads' figures here")
    ap.add_argument("--pieces", action="store_true", help="time the per-tensor steps of a load apart (see above)")
    args = ap.parse_args()
    if args.src:
        sys.path.insert(0, os.path.abspath(args.src))
    sys.path.insert(0, str(BENCH))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))

    import torch
    import torch.distributed as dist
    from loadbench.checkpoint import write_checkpoint
    from loadbench.models import build_model, parallelize
    from loadbench.paths import adapter_of, naming_of
    from loadbench.shapes import Shape

    import sdadapt

    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=0, world_size=1)
    if args.device == "cuda":
        torch.cuda.set_device(0)
    shape = Shape(layers=args.layers, hidden=args.hidden, intermediate=args.intermediate, heads=4, kv_heads=2, vocab=args.vocab)
    folder = Path(tempfile.mkdtemp(prefix="sdadapt-steady-probe-"))
    naming = naming_of("sdadapt")
    try:
        files = write_checkpoint(folder, shape, 5.0, ["safetensors"])
        adapter = adapter_of("sdadapt", files)

        def one(prof: cProfile.Profile | None = None) -> dict[str, object]:
            model, blocks = build_model(shape, naming)
            parallelize(model, blocks, naming, "fsdp", args.device)
            if args.device == "cuda":
                torch.cuda.synchronize()
            wall, cpu = time.perf_counter(), time.thread_time()
            if prof is not None:
                prof.enable()
            rep = sdadapt.load(model, files["safetensors"], adapter)
            if prof is not None:
                prof.disable()
            if args.device == "cuda":
                torch.cuda.synchronize()
            out = {"wall": time.perf_counter() - wall, "thread_cpu": time.thread_time() - cpu, "tensors": rep.keys_loaded}
            out.update(rep.phase_seconds)
            return out

        one()  # the process's first load: imports and first use, left out
        runs = [one() for _ in range(args.loads)]
        print(f"sdadapt {sdadapt.__file__}; torch {torch.__version__}; {args.device}; {runs[0]['tensors']} tensors")
        for r in runs:
            print("  " + " ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()))
        keys = [k for k, v in runs[0].items() if isinstance(v, float)]
        medians = {k: statistics.median(float(r[k]) for r in runs if k in r) for k in keys}  # type: ignore[arg-type]
        print("median: " + " ".join(f"{k} {v:.4f}" for k, v in medians.items()))
        if args.json:
            Path(args.json).write_text(json.dumps({"runs": runs, "median": medians}, indent=1))
        if args.pieces:
            pieces(shape, naming, torch.device(args.device), build_model, parallelize)
        if args.profile:
            prof = cProfile.Profile(time.thread_time)
            one(prof)
            stats = pstats.Stats(prof)
            stats.sort_stats("tottime").print_stats(args.profile)
            stats.sort_stats("cumulative").print_stats(args.profile)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        dist.destroy_process_group()
    return 0


def pieces(shape: object, naming: str, device: object, build_model: object, parallelize: object) -> None:
    """Print the calling thread's CPU time (best of 9, each on a fresh meta model) of the
    steps a load repeats per tensor."""
    import torch
    from torch import nn

    import sdadapt._plan.target as target
    import sdadapt._transaction.materialize as materialize
    from sdadapt._transaction.materialize import _empty_like, has_meta

    model_state_dict = target.model_state_dict

    def fresh() -> nn.Module:
        model, blocks = build_model(shape, naming)  # type: ignore[operator]
        parallelize(model, blocks, naming, "fsdp", device.type)  # type: ignore[attr-defined,operator]
        return model  # type: ignore[no-any-return]

    def swapped(model: nn.Module) -> None:
        for p in list(model.parameters()):
            torch.utils.swap_tensors(p, nn.Parameter(_empty_like(p, device), p.requires_grad))  # type: ignore[arg-type]

    steps = {
        "materialise: model._apply(_empty_like)": lambda m: m._apply(lambda t: _empty_like(t, device)),  # type: ignore[arg-type]
        "the same tensors made and swapped in, no Module._apply": swapped,
        "model.state_dict() (model_state_dict)": model_state_dict,
        "list(model.parameters())": lambda m: list(m.parameters()),
        "has_meta(model) (a load asks it three times)": has_meta,
    }
    if hasattr(materialize, "to_empty"):  # the tree measured has them (--src may name an older one)
        steps["materialise: sdadapt's to_empty (its own walk where exact)"] = lambda m: materialize.to_empty(m, device)
    if hasattr(target, "load_targets"):
        steps["load_targets(model) (a load's targets: state_dict(keep_vars=True))"] = target.load_targets
    for name, step in steps.items():
        best = float("inf")
        for _ in range(9):
            model = fresh()
            cpu = time.thread_time()
            step(model)
            best = min(best, time.thread_time() - cpu)
        print(f"piece: {name}: {best * 1e3:.2f} ms")


if __name__ == "__main__":
    raise SystemExit(main())
