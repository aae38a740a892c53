"""Do the engine's host copies in its worker threads run on torch's intra-op thread teams?

    python bench/probes/engine_copy_threads.py [--ranks 4] [--mib 256] [--repeat 3] [--team N] [--blocks]

Writes a bf16 safetensors checkpoint (``--mib`` of 2048 x 4096 tensors) in a temporary folder
(removed at the end), then starts ``--ranks`` gloo processes at once with ``OMP_NUM_THREADS``
unset, as a launcher other than ``torchrun`` leaves it (``--team N``: ``torch.set_num_threads(N)``
first, which the engine's threads take up, to give each copy the team a host of N cores would). Each loads the checkpoint into a float32
model (``dtype="model"``: every piece staged, then cast by the worker's copy out of the staging
buffer) ``--repeat`` times, with ``Tensor.copy_`` wrapped to record, for each call on a thread
other than the main one: its elements, its seconds and ``torch.get_num_threads()`` on that
thread. Prints, per rank, the load's seconds (median), the copies made by the workers, the
largest one, the intra-op team size the workers saw and the seconds in copies of at least
torch's grain size (32,768 elements: those torch may run on a team). For diagnosis: the wrapper
adds a list append per call. ``--blocks``: the workers' copies made as the row exchange makes
its own (``sdadapt._engine.share._copy``'s way: blocks of fewer than 32,768 elements, each on the
calling thread), to compare with torch's one call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / "src"))

ROWS, COLS = 2048, 4096
GRAIN = 32768  # torch's grain size: a copy of fewer elements runs on the calling thread


def _member(rank: int, world: int, folder: str, n: int, repeat: int, team: int | None, blocks: bool, out: object) -> None:
    import torch
    import torch.distributed as dist

    import sdadapt

    if team:
        torch.set_num_threads(team)

    dist.init_process_group("gloo", init_method=f"file://{folder}/init", rank=rank, world_size=world)
    calls: list[tuple[int, float, int]] = []
    real = torch.Tensor.copy_

    def counted(self: torch.Tensor, other: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        if threading.current_thread() is threading.main_thread():
            return real(self, other, non_blocking)
        t = time.perf_counter()
        if blocks and self.numel() >= GRAIN and self.shape == other.shape and self.dim():
            step = max(1, (GRAIN - 1) // max(1, self.numel() // self.shape[0]))
            for a, b in zip(self.split(step), other.split(step), strict=True):
                real(a, b, non_blocking)
            r = self
        else:
            r = real(self, other, non_blocking)
        calls.append((self.numel(), time.perf_counter() - t, torch.get_num_threads()))
        return r

    torch.Tensor.copy_ = counted  # type: ignore[method-assign]
    model = torch.nn.ParameterDict({f"w{i}": torch.nn.Parameter(torch.zeros(ROWS, COLS)) for i in range(n)})
    seconds = []
    for _ in range(repeat):
        dist.barrier()
        t = time.perf_counter()
        sdadapt.load(model, f"{folder}/ck.safetensors", dtype="model", progress=False, process_group=None)
        seconds.append(time.perf_counter() - t)
    big = [c for c in calls if c[0] >= GRAIN]
    out.put((rank, statistics.median(seconds), len(calls), max((c[0] for c in calls), default=0),  # type: ignore[attr-defined]
             sorted({c[2] for c in calls}), sum(c[1] for c in big) / repeat, torch.get_num_threads()))  # fmt: skip
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--team", type=int, help="torch.set_num_threads(N) in each process first (default: torch's)")
    p.add_argument("--blocks", action="store_true", help="the workers' copies in blocks on their own thread")
    args = p.parse_args(argv)
    os.environ.pop("OMP_NUM_THREADS", None)  # the children start without it
    import torch
    import torch.multiprocessing as mp
    from safetensors.torch import save_file

    n = max(1, args.mib * (1 << 20) // (ROWS * COLS * 2))
    with tempfile.TemporaryDirectory(prefix="sdadapt-copy-threads-") as folder:
        g = torch.Generator().manual_seed(0)
        save_file({f"w{i}": torch.randn(ROWS, COLS, generator=g).to(torch.bfloat16) for i in range(n)}, f"{folder}/ck.safetensors")
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        job = (args.ranks, folder, n, args.repeat, args.team, args.blocks, out)
        procs = [ctx.Process(target=_member, args=(r, *job)) for r in range(args.ranks)]
        for pr in procs:
            pr.start()
        rows = sorted(out.get(timeout=900) for _ in procs)
        for pr in procs:
            pr.join()
    team, how = args.team or "torch's default", "blocks" if args.blocks else "one call"
    print(f"{args.ranks} processes, {n} tensors {ROWS}x{COLS} bf16 -> float32, {os.cpu_count()} CPUs, team {team}, copies: {how}")
    print("rank | load s (median) | worker copies | largest (elements) | team size in workers | s in copies >= grain | main thread's team")
    for r in rows:
        print(" | ".join(str(round(x, 3)) if isinstance(x, float) else str(x) for x in r))


if __name__ == "__main__":
    main()
