"""Peak RSS of `sdadapt convert` on a >= 2 GiB checkpoint: bounded by the largest tensor, not the model.

    python bench/convert_bench.py [--gib 2.25] [--workdir /tmp/sdadapt-convert-bench] [--keep]

Writes a torch.save checkpoint of ``--gib`` GiB (float32; 6 layers of split q/k/v/o of
96 MiB each plus a 384 MiB embedding), then runs, each in a fresh process
``python -m sdadapt convert``:

1. torch.save -> HF safetensors shards (2GB), fusing q/k/v into qkv (a 288 MiB output built by concatenation);
2. torch.save -> torch.save, no adapter, with --read-back (every tensor read back and compared);
3. torch.save -> DCP, no adapter.

For each, the child's peak RSS (``ru_maxrss``) is compared with the largest tensor (input or
output) and with the RSS of a process that only imports sdadapt and torch (the constant).
Prints a Markdown table for a report in bench/reports/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys

import torch

MiB = 2**20


def build_checkpoint(path: str, gib: float) -> tuple[dict[str, tuple[int, ...]], int]:
    """A dict of float32 tensors of about ``gib`` GiB; returns shapes and the largest tensor's bytes."""
    dim = 4096
    rows = 96 * MiB // (dim * 4)  # 96 MiB per projection
    sd: dict[str, torch.Tensor] = {"embed.weight": torch.randn(4 * rows, dim)}
    total = sd["embed.weight"].numel() * 4
    i = 0
    while total < gib * 2**30:
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[f"layers.{i}.attn.{name}.weight"] = torch.randn(rows, dim)
            total += rows * dim * 4
        i += 1
    shapes = {k: tuple(v.shape) for k, v in sd.items()}
    torch.save(sd, path)
    largest_in = max(v.numel() * 4 for v in sd.values())
    del sd
    return shapes, max(largest_in, 3 * rows * dim * 4)  # the fused qkv output is 3 projections


def run_child(cmd: list[str]) -> tuple[int, float, str]:
    """Peak RSS of one child, measured inside a wrapper process so maxima do not mix."""
    wrapper = (
        "import resource, subprocess, sys, json, time\n"
        "t = time.perf_counter()\n"
        "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "u = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
        "print(json.dumps({'rc': p.returncode, 'rss': u.ru_maxrss * 1024, 's': time.perf_counter() - t, "
        "'out': p.stdout[-2000:], 'err': p.stderr[-2000:]}))\n"
    )
    res = subprocess.run([sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True, check=True)
    data = json.loads(res.stdout)
    if data["rc"] != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({data['rc']}):\n{data['out']}\n{data['err']}")
    return data["rss"], data["s"], (data["out"].strip().splitlines() or [""])[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=2.25)
    ap.add_argument("--workdir", default="/tmp/sdadapt-convert-bench")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    try:
        src = os.path.join(args.workdir, "ck.pt")
        shapes, largest = build_checkpoint(src, args.gib)
        layers = sum(1 for k in shapes if k.endswith("q_proj.weight"))
        adapter = {
            "name": "fuse-qkv",
            "rules": [
                {
                    "kind": "fuse",
                    "srcs": [f"layers.{{i}}.attn.{n}_proj.weight" for n in "qkv"],
                    "dst": "layers.{i}.attn.qkv.weight",
                }
            ],
        }
        adapter_path = os.path.join(args.workdir, "fuse.json")
        with open(adapter_path, "w") as f:
            json.dump(adapter, f)
        base_rss, _, _ = run_child([sys.executable, "-c", "import torch, sdadapt, sdadapt.export"])
        py = [sys.executable, "-m", "sdadapt", "convert", "--no-progress"]
        cases = [
            ("safetensors, fuse q/k/v (2GB shards)",
             [src, os.path.join(args.workdir, "hf"), "--to", "safetensors", "--adapter", adapter_path]),
            ("torch, --read-back", [src, os.path.join(args.workdir, "out.pt"), "--to", "torch", "--read-back"]),
            ("dcp", [src, os.path.join(args.workdir, "dcp"), "--to", "dcp"]),
        ]
        size = os.path.getsize(src)
        print(f"checkpoint: {size / 2**30:.2f} GiB torch.save, {len(shapes)} tensors ({layers} layers), "
              f"largest tensor (in or out) {largest / MiB:.0f} MiB; import-only RSS {base_rss / MiB:.0f} MiB")
        print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}")
        print()
        print("| case | wall s | peak RSS MiB | (peak - import) / largest tensor |")
        print("|---|---|---|---|")
        for name, argv in cases:
            rss, secs, _ = run_child(py + argv)
            print(f"| {name} | {secs:.1f} | {rss / MiB:.0f} | {(rss - base_rss) / largest:.2f} |")
    finally:
        if not args.keep:
            shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
