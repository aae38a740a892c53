"""The dry run's predictions against real loads on 2 to 32 gloo processes (CPU).

    python bench/scale_check.py [--worlds 2 4 8] [--dim 1024] [--layers 4] [--out DIR]

Writes a transformer-shaped checkpoint (torchtitan's names, float32, an HF sharded folder of 4
files), then for each world size launches that many gloo processes once; every process runs
the world's cases in turn (a mesh, ``share_reads`` on or off, the headers read once per job or
by every rank: ``SDADAPT_HEADERS``): the model built on meta and parallelised as torchtitan does
(TP, then FSDP2 or HSDP), a first ``sdadapt.load`` to warm imports and pools, then a measured
one into a fresh meta model. ``sdadapt.dry_run`` predicts each rank of each case from this one
process. Per rank, predicted and measured:

- bytes read (``LoadReport.bytes_read``) and opens of the checkpoint's files (``open`` and
  ``os.open`` counted during the load): equal, exactly;
- collective bytes: the header record the first rank broadcasts (the bytes received), the
  bytes received from replicas (``share_reads``), and what else the load's collectives carry
  (the agreement steps' ``all_reduce``), counted by wrapping torch's collectives;
- memory: the peak RSS during the load (sampled every millisecond) less the RSS before it,
  against the dry run's ``host_bytes``; time: the load's seconds, as a ratio between cases.

``--worlds 16 32`` runs the cases that need 16 and 32 processes (a 16-core machine); the gloo
sharing crossover is read from the pairs of cases that differ only in ``share_reads``. A
summary row per case is printed; every rank's figures go to ``DIR/ranks.json``.
"""

from __future__ import annotations

import argparse
import builtins
import faulthandler
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

import sdadapt  # noqa: E402

# (mesh, share_reads, headers) per world size
CASES: dict[int, list[tuple[str, bool, str]]] = {
    2: [("dp_shard=2", False, "once")],
    4: [("dp_shard=2,tp=2", False, "once")],
    8: [("dp_replicate=2,dp_shard=2,tp=2", False, "once"), ("dp_replicate=2,dp_shard=2,tp=2", True, "once")],
    16: [
        ("dp_replicate=2,dp_shard=4,tp=2", False, "every"),
        ("dp_replicate=2,dp_shard=4,tp=2", False, "once"),
        ("dp_replicate=2,dp_shard=4,tp=2", True, "once"),
        ("dp_replicate=8,dp_shard=2", False, "once"),
        ("dp_replicate=8,dp_shard=2", True, "once"),
    ],
    32: [
        ("dp_replicate=4,dp_shard=4,tp=2", False, "every"),
        ("dp_replicate=4,dp_shard=4,tp=2", False, "once"),
        ("dp_replicate=4,dp_shard=4,tp=2", True, "once"),
        ("dp_replicate=16,dp_shard=2", False, "once"),
        ("dp_replicate=16,dp_shard=2", True, "once"),
    ],
}


def build(dim: int, layers: int) -> nn.Module:
    ffn, vocab = dim * 11 // 4, 32000

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wq, self.wo = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)

    class FeedForward(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1, self.w2, self.w3 = (nn.Linear(dim, ffn, bias=False), nn.Linear(ffn, dim, bias=False), nn.Linear(dim, ffn, bias=False))

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention, self.feed_forward, self.attention_norm = Attention(), FeedForward(), nn.RMSNorm(dim)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok_embeddings = nn.Embedding(vocab, dim)
            self.layers = nn.ModuleDict({str(i): Layer() for i in range(layers)})
            self.norm, self.output = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)

    return Model()


def write(folder: Path, dim: int, layers: int) -> None:
    from safetensors.torch import save_file

    sd = build(dim, layers).state_dict()
    files: dict[str, dict[str, torch.Tensor]] = {}
    for i, k in enumerate(sorted(sd)):
        files.setdefault(f"model-{i % 4:05d}.safetensors", {})[k] = sd[k].detach().clone()
    for name, part in files.items():
        save_file(part, folder / name)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: n for n, p in files.items() for k in p}}))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


class _Collectives:
    """Bytes this rank receives in broadcasts (by the src's rank), in the header record, and
    carries in all_reduce, while active (torch's functions wrapped where the library calls them)."""

    NAMES = ("broadcast", "all_reduce", "all_gather", "all_gather_object", "broadcast_object_list", "gather", "scatter")

    def __enter__(self) -> _Collectives:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        self.me = dist.get_rank()
        self.received = self.all_reduce = self.header = 0
        self.calls: dict[str, int] = {}
        self.saved = {n: getattr(c10d, n) for n in self.NAMES}
        self.depth = 0

        def wrap(name: str, fn: Any) -> Any:
            def counted(*a: Any, **k: Any) -> Any:
                outer = self.depth == 0  # broadcast_object_list's own broadcasts are its payload
                self.depth += 1
                try:
                    out = fn(*a, **k)
                finally:
                    self.depth -= 1
                if outer:
                    self.calls[name] = self.calls.get(name, 0) + 1
                    t = a[0] if a and isinstance(a[0], torch.Tensor) else None
                    if name == "broadcast" and t is not None and k.get("src", a[1] if len(a) > 1 else None) != self.me:
                        self.received += t.numel() * t.element_size()
                    elif name == "all_reduce" and t is not None:
                        self.all_reduce += t.numel() * t.element_size()
                    elif name == "broadcast_object_list" and k.get("src", a[1] if len(a) > 1 else None) != self.me:
                        self.header += sum(len(o) for o in a[0] if isinstance(o, bytes))
                return out

            return counted

        for n, fn in self.saved.items():
            setattr(c10d, n, wrap(n, fn))
            setattr(dist, n, getattr(c10d, n))
        return self

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        for n, fn in self.saved.items():
            setattr(c10d, n, fn)
            setattr(dist, n, fn)


def worker(folder: str, cases: list[tuple[str, bool, str]], dim: int, layers: int, out: str, hang: float) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    faulthandler.dump_traceback_later(hang, exit=True)  # a hang shows where, then ends the rank
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = []
    world = dist.get_world_size()
    for mesh, share, headers in cases:
        os.environ["SDADAPT_HEADERS"] = headers
        spec = dict((n, int(s)) for n, s in (p.split("=") for p in mesh.split(",")))
        grid = init_device_mesh("cpu", tuple(spec.values()), mesh_dim_names=tuple(spec))
        sdadapt.load(_parallel(grid, spec, dim, layers), folder, share_reads=share)  # warm: imports, thread pools
        model = _parallel(grid, spec, dim, layers)
        dist.barrier()
        got = _measure(model, folder, share)
        results.append({"mesh": mesh, "share_reads": share, "headers": headers, **got})
        del model
        if rank == 0:
            print(f"{time.strftime('%H:%M:%S')} {world} ranks: {mesh} share_reads={share} headers={headers} done", flush=True)
    Path(out, f"{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def _measure(model: nn.Module, folder: str, share: bool) -> dict[str, Any]:
    """One load's figures: its report's bytes, the opens, the RSS's growth, the collectives."""
    opens: list[str] = []
    real_open, real_os_open = builtins.open, os.open

    def note(p: Any) -> None:
        if isinstance(p, (str, os.PathLike)) and os.fspath(p).startswith(folder):
            opens.append(os.fspath(p))

    builtins.open = lambda f, *a, **k: (note(f), real_open(f, *a, **k))[1]  # type: ignore[assignment]
    os.open = lambda p, *a, **k: (note(p), real_os_open(p, *a, **k))[1]  # type: ignore[assignment]
    before = _rss()
    peak = [before]
    done = threading.Event()

    def sample() -> None:  # the RSS's peak during the load (ru_maxrss keeps the warm-up's)
        while not done.wait(0.001):
            peak[0] = max(peak[0], _rss())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        with _Collectives() as coll:
            t = time.perf_counter()
            rep = sdadapt.load(model, folder, share_reads=share)
            wall = time.perf_counter() - t
    finally:
        done.set()
        sampler.join()
        builtins.open, os.open = real_open, real_os_open  # type: ignore[assignment]
    peak[0] = max(peak[0], _rss())
    return {
        "bytes_read": rep.bytes_read,
        "bytes_shared": rep.bytes_shared,
        "local_bytes": rep.local_bytes,
        "opens": len(opens),
        "rss_growth": peak[0] - before,
        "seconds": wall,
        "received": coll.received,
        "header_received": coll.header,
        "all_reduce_bytes": coll.all_reduce,
        "calls": coll.calls,
    }


def _parallel(grid: Any, spec: dict[str, int], dim: int, layers: int) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    with torch.device("meta"):
        model = build(dim, layers)
    if "tp" in spec:
        parallelize_module(model, grid["tp"], {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()), "output": ColwiseParallel()})
        for layer in model.layers.values():
            parallelize_module(
                layer,
                grid["tp"],
                {
                    "attention.wq": ColwiseParallel(),
                    "attention.wo": RowwiseParallel(),
                    "feed_forward.w1": ColwiseParallel(),
                    "feed_forward.w2": RowwiseParallel(),
                    "feed_forward.w3": ColwiseParallel(),
                },
            )
    dp = tuple(n for n in ("dp_replicate", "dp_shard") if n in spec)
    dp_mesh = grid[dp] if len(dp) > 1 else grid[dp[0]]
    for layer in model.layers.values():
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def launch(folder: Path, world: int, dim: int, layers: int, timeout: float) -> list[list[dict]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="sdadapt-scale-check-ranks-") as out:
        return _launch(folder, world, dim, layers, timeout, port, out)


def _launch(folder: Path, world: int, dim: int, layers: int, timeout: float, port: int, out: str) -> list[list[dict]]:
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            # glibc returns freed memory of 64 KiB and over to the system: the warm-up's and the
            # previous case's tensors leave no free heap for this load to reuse unseen
            MALLOC_MMAP_THRESHOLD_="65536",
            PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        )
        code = (
            f"import sys; sys.path.insert(0, {str(ROOT / 'bench')!r}); import scale_check as m; "
            f"m.worker({str(folder)!r}, {CASES[world]!r}, {dim}, {layers}, {out!r}, {max(10.0, timeout - 10)})"
        )
        procs.append(subprocess.Popen([sys.executable, "-X", "faulthandler", "-c", code], env=env))
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rc = None
        if rc != 0:
            for q in procs:
                q.kill()
            raise SystemExit(f"a rank failed or timed out at {world} ranks (exit {rc})")
    return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(world)]


def predicted_rank(report: Any, mesh: str, rank: int) -> Any:
    """The planned rank of ``rank``'s class (ranks of a class read and open the same)."""
    by_rank = {r.rank: r for r in report.ranks}
    if rank in by_rank:
        return by_rank[rank]
    names = [p.split("=")[0] for p in mesh.split(",")]
    sizes = [int(p.split("=")[1]) for p in mesh.split(",")]
    coord, r = [], rank
    for s in reversed(sizes):
        coord.append(r % s)
        r //= s
    coord = list(reversed(coord))
    varying = [n for n in names if len({p.coordinate[n] for p in report.ranks}) > 1]
    return next(p for p in report.ranks if all(p.coordinate[n] == coord[names.index(n)] for n in varying))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", nargs="+", type=int, default=[2, 4, 8])
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--out", type=Path, help="keep the checkpoint and ranks.json there (default: a temporary folder, removed)")
    ap.add_argument("--cases", nargs="+", help="MESH:on|off:once|every, replacing the cases of every --worlds")
    args = ap.parse_args()
    if args.out is None:
        with tempfile.TemporaryDirectory(prefix="sdadapt-scale-check-") as tmp:
            return run(args, Path(tmp))
    run(args, args.out)


def run(args: argparse.Namespace, out: Path) -> None:
    if args.cases:
        for world in args.worlds:
            CASES[world] = [(m, s == "on", h) for m, s, h in (c.split(":") for c in args.cases)]
    folder = out / "ckpt"
    folder.mkdir(parents=True, exist_ok=True)
    write(folder, args.dim, args.layers)
    size = sum(f.stat().st_size for f in folder.iterdir())
    print(f"checkpoint: {size / 2**20:.1f} MiB in {len(list(folder.iterdir()))} files; dim {args.dim}, {args.layers} layers", flush=True)
    with torch.device("meta"):
        schema = {k: sdadapt.sources.TensorInfo(tuple(v.shape), v.dtype) for k, v in build(args.dim, args.layers).state_dict().items()}
    print(
        "| ranks | mesh | share_reads | headers | bytes read = | opens = (rank 0, others) | header record = (bytes) "
        "| from replicas = (max MiB) | shards = | all_reduce bytes | memory growth / predicted (min-max) | load s (max) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    raw = []
    for world in args.worlds:
        t = time.perf_counter()
        real = launch(folder, world, args.dim, args.layers, args.timeout)
        print(f"<!-- {world} ranks: {time.perf_counter() - t:.0f} s for the launch -->", flush=True)
        for i, (mesh, share, headers) in enumerate(CASES[world]):
            report = sdadapt.dry_run(schema, str(folder), mesh=mesh, share_reads=share, headers=headers, max_ranks=64)
            rows = []
            for rank in range(world):
                got, pred = real[rank][i], predicted_rank(report, mesh, rank)
                # a rank of rank 0's class opens no headers when they are read once per job
                opens = pred.opens - (report.checkpoint_files if headers == "once" and rank != 0 and pred.rank == 0 else 0)
                header = 0 if rank == 0 or headers == "every" else report.collective_bytes_per_rank
                rows.append(
                    {
                        "rank": rank,
                        "mesh": mesh,
                        "share_reads": share,
                        "headers": headers,
                        "bytes_read": [pred.bytes_read, got["bytes_read"]],
                        "opens": [opens, got["opens"]],
                        "header_received": [header, got["header_received"]],
                        "shared": [pred.shared_bytes, got["bytes_shared"], got["received"]],
                        "local_bytes": [pred.local_bytes, got["local_bytes"]],
                        "memory": [pred.host_bytes, got["rss_growth"]],
                        "all_reduce_bytes": got["all_reduce_bytes"],
                        "calls": got["calls"],
                        "seconds": got["seconds"],
                    }
                )
            raw.extend(rows)

            def eq(k: str, rows: list[dict] = rows) -> str:
                return "yes" if all(r[k][0] == r[k][1] for r in rows) else "NO"

            shared_ok = all(r["shared"][0] == r["shared"][1] == r["shared"][2] for r in rows)
            ratios = [r["memory"][1] / r["memory"][0] for r in rows]
            ar = sorted({r["all_reduce_bytes"] for r in rows})
            print(
                f"| {world} | {mesh} | {'on' if share else 'off'} | {headers} | {eq('bytes_read')} | {eq('opens')} "
                f"({rows[0]['opens'][1]}, {max(r['opens'][1] for r in rows[1:])}) | {eq('header_received')} "
                f"({max(r['header_received'][1] for r in rows)}) | {'yes' if shared_ok else 'NO'} "
                f"({max(r['shared'][1] for r in rows) / 2**20:.1f}) | {eq('local_bytes')} | {', '.join(map(str, ar))} "
                f"| {min(ratios):.2f}-{max(ratios):.2f} | {max(r['seconds'] for r in rows):.3f} |",
                flush=True,
            )
    (out / "ranks.json").write_text(json.dumps(raw))


if __name__ == "__main__":
    main()
