"""The dry run's predictions against real loads on 2, 4 and 8 gloo ranks (CPU).

    python bench/scale_check.py [--dim 1024] [--layers 4] [--out DIR]

Writes a transformer-shaped checkpoint (torchtitan's names, float32, an HF sharded folder of 4
files), then for each mesh runs ``sdadapt.dry_run`` here and a real ``sdadapt.load`` on that
many gloo processes (the model built on meta and parallelised as torchtitan does: TP, then
FSDP2 or HSDP), and prints per rank: bytes read, opens of the checkpoint's files, bytes
received from replicas, destination bytes, each predicted and measured, and the rank's memory
growth over a second load into a fresh meta model (the first warms imports and pools; the peak
RSS sampled every millisecond during the load, less the RSS before it) against the dry run's
``host_bytes`` (the shards, the staging written, the file pages the mapped reads touch).
"""

from __future__ import annotations

import argparse
import builtins
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

import sdadapt  # noqa: E402

MESHES = [("dp_shard=2", False), ("dp_shard=2,tp=2", False), ("dp_replicate=2,dp_shard=2,tp=2", False),
          ("dp_replicate=2,dp_shard=2,tp=2", True)]


def build(dim: int, layers: int) -> nn.Module:
    ffn, vocab = dim * 11 // 4, 32000

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wq, self.wo = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)

    class FeedForward(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1, self.w2, self.w3 = (nn.Linear(dim, ffn, bias=False), nn.Linear(ffn, dim, bias=False),
                                         nn.Linear(dim, ffn, bias=False))

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


def worker(folder: str, mesh: str, share: bool, dim: int, layers: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    spec = dict((n, int(s)) for n, s in (p.split("=") for p in mesh.split(",")))
    grid = init_device_mesh("cpu", tuple(spec.values()), mesh_dim_names=tuple(spec))
    sdadapt.load(_parallel(grid, spec, dim, layers), folder, share_reads=share)  # warm: imports, thread pools
    model = _parallel(grid, spec, dim, layers)
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
    rep = sdadapt.load(model, folder, share_reads=share)
    done.set()
    sampler.join()
    peak[0] = max(peak[0], _rss())
    builtins.open, os.open = real_open, real_os_open  # type: ignore[assignment]
    Path(out, f"{dist.get_rank()}.json").write_text(json.dumps({
        "bytes_read": rep.bytes_read, "bytes_shared": rep.bytes_shared, "local_bytes": rep.local_bytes,
        "opens": len(opens), "rss_growth": peak[0] - before, "seconds": rep.seconds}))
    dist.destroy_process_group()


def _parallel(grid: Any, spec: dict[str, int], dim: int, layers: int) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    with torch.device("meta"):
        model = build(dim, layers)
    if "tp" in spec:
        parallelize_module(model, grid["tp"], {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()), "output": ColwiseParallel()})
        for layer in model.layers.values():
            parallelize_module(layer, grid["tp"], {
                "attention.wq": ColwiseParallel(), "attention.wo": RowwiseParallel(), "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(), "feed_forward.w3": ColwiseParallel()})
    dp = tuple(n for n in ("dp_replicate", "dp_shard") if n in spec)
    dp_mesh = grid[dp] if len(dp) > 1 else grid[dp[0]]
    for layer in model.layers.values():
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def launch(folder: Path, mesh: str, share: bool, dim: int, layers: int) -> list[dict]:
    world = 1
    for p in mesh.split(","):
        world *= int(p.split("=")[1])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mkdtemp()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
        code = f"import sys; sys.path.insert(0, {str(ROOT / 'bench')!r}); import scale_check as m; " \
               f"m.worker({str(folder)!r}, {mesh!r}, {share!r}, {dim}, {layers}, {out!r})"
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env))
    for p in procs:
        if p.wait(timeout=1200) != 0:
            raise SystemExit(f"a rank failed ({mesh})")
    return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(world)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp()))
    args = ap.parse_args()
    folder = args.out / "ckpt"
    folder.mkdir(parents=True, exist_ok=True)
    write(folder, args.dim, args.layers)
    with torch.device("meta"):
        schema = {k: sdadapt.sources.TensorInfo(tuple(v.shape), v.dtype) for k, v in build(args.dim, args.layers).state_dict().items()}
    print("| mesh | share_reads | rank | read: predicted, real | opens: predicted, real | from replicas: predicted, real "
          "| shards: predicted, real | memory growth: predicted, real (ratio) |")
    print("|---|---|---|---|---|---|---|---|")
    for mesh, share in MESHES:
        report = sdadapt.dry_run(schema, str(folder), mesh=mesh, share_reads=share, max_ranks=64)
        by_rank = {r.rank: r for r in report.ranks}
        grid_names = [p.split("=")[0] for p in mesh.split(",")]
        real = launch(folder, mesh, share, args.dim, args.layers)
        for rank, got in enumerate(real):
            pred = by_rank.get(rank) or _class_member(report, grid_names, mesh, rank)
            # a rank of rank 0's class opens no headers (the first rank reads them for the job)
            opens = pred.opens if rank == pred.rank or pred.rank != 0 else pred.opens - report.checkpoint_files
            memory = pred.host_bytes
            print(f"| {mesh} | {share} | {rank} | {pred.bytes_read}, {got['bytes_read']} | {opens}, {got['opens']} | "
                  f"{pred.shared_bytes}, {got['bytes_shared']} | {pred.local_bytes}, {got['local_bytes']} | "
                  f"{memory / 2**20:.1f}, {got['rss_growth'] / 2**20:.1f} MiB ({got['rss_growth'] / memory:.2f}) |", flush=True)


def _class_member(report: Any, names: list[str], mesh: str, rank: int) -> Any:
    sizes = [int(p.split("=")[1]) for p in mesh.split(",")]
    coord, r = [], rank
    for s in reversed(sizes):
        coord.append(r % s)
        r //= s
    coord = list(reversed(coord))
    varying = [n for n in names if len({p.coordinate[n] for p in report.ranks}) > 1]
    return next(p for p in report.ranks if all(p.coordinate[n] == coord[names.index(n)] for n in varying))


if __name__ == "__main__":
    main()
