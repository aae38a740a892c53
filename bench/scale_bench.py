"""``sdadapt plan`` on DeepSeek-V3- and Kimi-K2-shaped releases at 64 to 16384 ranks, on one core.

    python bench/scale_bench.py --out /tmp/releases [--models dsv3 kimi_k2] [--worlds 64 1024 16384]

Writes each release as it is published (an HF sharded folder: ``model.safetensors.index.json``
and shard files of about 4.3 GB, FP8 weights with their 128x128 ``weight_scale_inv``), headers
only: every shard file is its real header followed by a hole (a sparse file of the real size;
no data is allocated or written). Then runs ``sdadapt plan SRC --json`` in a fresh process per
case (one thread: its CPU seconds are the time on one core, the figure on a shared machine), for each mesh family at each world size:

- ``fsdp``: ``dp_shard=W``;
- ``hsdp``: ``dp_replicate=8, dp_shard=W/64, tp=8``;
- ``ep``: ``dp_shard=W/64, ep=64``;
- ``pp``: ``pp=16, dp_shard=W/128, tp=8`` (``pp=8, tp=8`` at 64 ranks);

each twice: as a load did before (every rank reads the headers, every replica its bytes:
``--headers every --no-share-reads``) and as it does now on GPUs (``--device cuda``: headers
once, replicated bytes once per replica group). It prints one table row per case: the process's
wall time and peak RSS, the classes planned, per-rank bytes read (the most and the least of the
planned ranks), opens per rank, total opens, header bytes read in total, and the read
amplification; the raw reports go to ``--json-out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from sdadapt.sources import TensorInfo  # noqa: E402

NAMES = {torch.float8_e4m3fn: "F8_E4M3", torch.bfloat16: "BF16", torch.float32: "F32"}
SHARD_BYTES = 4_300_000_000


def release_schema(model: str) -> dict[str, TensorInfo]:
    """The HF keys of a DeepSeek-V3 (671B, 256 experts) or Kimi-K2 (1T, 384 experts) release."""
    if model == "dsv3":
        layers, dense, experts, heads, vocab = 61, 3, 256, 128, 129280
    else:
        layers, dense, experts, heads, vocab = 61, 1, 384, 64, 163840
    h, inter, moe = 7168, 18432, 2048
    fp8, bf16, f32 = torch.float8_e4m3fn, torch.bfloat16, torch.float32
    s: dict[str, TensorInfo] = {"model.embed_tokens.weight": TensorInfo((vocab, h), bf16)}

    def w(key: str, o: int, i: int) -> None:
        s[key + ".weight"] = TensorInfo((o, i), fp8)
        s[key + ".weight_scale_inv"] = TensorInfo((-(-o // 128), -(-i // 128)), f32)

    for n in range(layers):
        p = f"model.layers.{n}."
        w(p + "self_attn.q_a_proj", 1536, h)
        s[p + "self_attn.q_a_layernorm.weight"] = TensorInfo((1536,), bf16)
        w(p + "self_attn.q_b_proj", heads * 192, 1536)
        w(p + "self_attn.kv_a_proj_with_mqa", 576, h)
        s[p + "self_attn.kv_a_layernorm.weight"] = TensorInfo((512,), bf16)
        w(p + "self_attn.kv_b_proj", heads * 256, 512)
        w(p + "self_attn.o_proj", h, heads * 128)
        s[p + "input_layernorm.weight"] = TensorInfo((h,), bf16)
        s[p + "post_attention_layernorm.weight"] = TensorInfo((h,), bf16)
        mlps = {"gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}
        if n < dense:
            for m, (o, i) in mlps.items():
                w(p + f"mlp.{m}", o, i)
            continue
        s[p + "mlp.gate.weight"] = TensorInfo((experts, h), bf16)
        s[p + "mlp.gate.e_score_correction_bias"] = TensorInfo((experts,), f32)
        small = {"gate_proj": (moe, h), "up_proj": (moe, h), "down_proj": (h, moe)}
        for e in range(experts):
            for m, (o, i) in small.items():
                w(p + f"mlp.experts.{e}.{m}", o, i)
        for m, (o, i) in small.items():
            w(p + f"mlp.shared_experts.{m}", o, i)
    s["model.norm.weight"] = TensorInfo((h,), bf16)
    s["lm_head.weight"] = TensorInfo((vocab, h), bf16)
    return s


def write_release(folder: Path, schema: dict[str, TensorInfo]) -> tuple[int, int]:
    """The release as headers followed by holes; returns (files, tensor bytes)."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    groups: list[list[str]] = [[]]
    size = 0
    for k, info in schema.items():
        if size > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(k)
        size += info.nbytes
    weight_map = {}
    for n, keys in enumerate(groups):
        name = f"model-{n + 1:05d}-of-{len(groups):06d}.safetensors"
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        off = 0
        for k in keys:
            info = schema[k]
            header[k] = {"dtype": NAMES[info.dtype], "shape": list(info.shape), "data_offsets": [off, off + info.nbytes]}
            off += info.nbytes
            weight_map[k] = name
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(folder / name, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + off)  # a hole: no data written or allocated
    total = sum(i.nbytes for i in schema.values())
    with open(folder / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return len(groups), total


def meshes(world: int) -> dict[str, list[str]]:
    out = {"fsdp": ["--mesh", f"dp_shard={world}"]}
    if world >= 64:
        out["hsdp"] = ["--mesh", f"dp_replicate=8,dp_shard={world // 64},tp=8"]
        out["ep"] = ["--mesh", f"dp_shard={world // 64}", "--ep", "64"]
    out["pp"] = ["--mesh", f"dp_shard={world // 128},tp=8", "--pp", "16"] if world >= 128 else ["--mesh", "tp=8", "--pp", "8"]
    return out


def run_case(src: Path, args: list[str], max_ranks: int) -> tuple[dict, float, float, int]:
    cmd = [sys.executable, "-m", "sdadapt", "plan", str(src), *args, "--json", "--max-ranks", str(max_ranks)]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1", SDADAPT_IO_THREADS="8")
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)  # the child's own peak RSS
        wall = time.perf_counter() - t
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{err.read().decode()[-3000:]}")
        return json.loads(out.read()), wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("/tmp/sdadapt-releases"))
    ap.add_argument("--models", nargs="+", default=["dsv3", "kimi_k2"])
    ap.add_argument("--worlds", nargs="+", type=int, default=[64, 1024, 16384])
    ap.add_argument("--families", nargs="+", default=["fsdp", "hsdp", "ep", "pp"])
    ap.add_argument("--max-ranks", type=int, default=4)
    ap.add_argument("--labels", nargs="+", default=["before", "now"])
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    raw = []
    print("| release | ranks | mesh | load | CPU s (wall s), 1 core | peak RSS | classes planned | read/rank max, min "
          "| opens/rank (rank 0, others) | total opens | headers read | amplification |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model in args.models:
        src = args.out / model
        files, total = write_release(src, release_schema(model))
        print(f"<!-- {model}: {files} files, {total / 1e9:.1f} GB of tensors, {len(release_schema(model))} keys -->")
        for world in args.worlds:
            for family, mesh in meshes(world).items():
                if family not in args.families:
                    continue
                for label, extra in (("before", ["--headers", "every", "--no-share-reads", "--device", "cuda"]),
                                     ("now", ["--device", "cuda"])):
                    if label not in args.labels:
                        continue
                    rep, wall, cpu, rss = run_case(src, mesh + extra, args.max_ranks)
                    ranks = rep["ranks"]
                    reads = [r["bytes_read"] for r in ranks]
                    opens0 = ranks[0]["opens"]
                    opens1 = max((r["opens"] for r in ranks[1:]), default=opens0)
                    planned = f"{len(ranks)} of {rep['classes']}" + ("" if rep["exact"] else " (sample)")
                    print(f"| {model} | {world} | {rep['mesh']} | {label} | {cpu:.1f} ({wall:.0f}) | {rss / 2**20:.0f} MiB | {planned} | "
                          f"{max(reads) / 2**30:.2f}, {min(reads) / 2**30:.2f} GiB | {opens0}, {opens1} | {rep['total_opens']} | "
                          f"{rep['total_header_bytes'] / 2**20:.0f} MiB | {rep['amplification']:.2f} |", flush=True)
                    raw.append({"model": model, "world": world, "family": family, "label": label, "wall_s": wall, "cpu_s": cpu,
                                "max_rss": rss, "report": {k: v for k, v in rep.items() if k != "report"}})
    if args.json_out:
        args.json_out.write_text(json.dumps(raw))


if __name__ == "__main__":
    main()
