"""Planning cost for a DeepSeek-V3-sized schema (~100k keys), without starting processes.

    python bench/plan_bench.py [--ranks 64] [--rank 0]

Builds the source schema of a DeepSeek-V3-shaped HF checkpoint (61 layers, 256 routed experts
of 3 FP8 weights each, each with its ``weight_scale_inv``; attention, norms, shared experts) and
a target schema with torchtitan-style names, then times, as one rank of ``--ranks`` would:

1. ``build_plan`` (validation + recipes) with a rename adapter;
2. the rank's ReadItems: FSDP-style dim-0 shards of every tensor, computed here from the rank
   coordinates (what DCP would hand this rank);
3. the I/O engine's planning of those items (routing, byte spans, chunking, coalescing) against
   a simulated file layout, with meta-device destinations: no data is read.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import sdadapt  # noqa: E402
from sdadapt._engine import EngineConfig, IOEngine, Job  # noqa: E402
from sdadapt.sources._base import Source, TensorInfo, TensorLocation  # noqa: E402


def deepseek_v3_schema() -> dict[str, TensorInfo]:
    h, inter, moe, vocab, layers, experts = 7168, 18432, 2048, 129280, 61, 256
    fp8, bf16, f32 = torch.float8_e4m3fn, torch.bfloat16, torch.float32
    s: dict[str, TensorInfo] = {"model.embed_tokens.weight": TensorInfo((vocab, h), bf16)}

    def w(key: str, o: int, i: int) -> None:
        s[key + ".weight"] = TensorInfo((o, i), fp8)
        s[key + ".weight_scale_inv"] = TensorInfo((-(-o // 128), -(-i // 128)), f32)

    for n in range(layers):
        p = f"model.layers.{n}."
        w(p + "self_attn.q_a_proj", 1536, h)
        s[p + "self_attn.q_a_layernorm.weight"] = TensorInfo((1536,), bf16)
        w(p + "self_attn.q_b_proj", 128 * 192, 1536)
        w(p + "self_attn.kv_a_proj_with_mqa", 576, h)
        s[p + "self_attn.kv_a_layernorm.weight"] = TensorInfo((512,), bf16)
        w(p + "self_attn.kv_b_proj", 128 * 256, 512)
        w(p + "self_attn.o_proj", h, 128 * 128)
        s[p + "input_layernorm.weight"] = TensorInfo((h,), bf16)
        s[p + "post_attention_layernorm.weight"] = TensorInfo((h,), bf16)
        if n < 3:
            for m, (o, i) in {"gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}.items():
                w(p + f"mlp.{m}", o, i)
            continue
        s[p + "mlp.gate.weight"] = TensorInfo((experts, h), bf16)
        s[p + "mlp.gate.e_score_correction_bias"] = TensorInfo((experts,), f32)
        for e in range(experts):
            for m, (o, i) in {"gate_proj": (moe, h), "up_proj": (moe, h), "down_proj": (h, moe)}.items():
                w(p + f"mlp.experts.{e}.{m}", o, i)
        for m, (o, i) in {"gate_proj": (moe, h), "up_proj": (moe, h), "down_proj": (h, moe)}.items():
            w(p + f"mlp.shared_experts.{m}", o, i)
    s["model.norm.weight"] = TensorInfo((h,), bf16)
    s["lm_head.weight"] = TensorInfo((vocab, h), bf16)
    return s


def target_name(k: str) -> str:
    if k.startswith("model.embed_tokens."):
        return "tok_embeddings." + k.removeprefix("model.embed_tokens.")
    if k.startswith("model.layers."):
        return k.removeprefix("model.")
    return {"model.norm.weight": "norm.weight", "lm_head.weight": "output.weight"}[k]


class FakeSource(Source):
    """Headers only: tensors laid out back to back in 163 files of ~4.3 GB (no file is opened)."""

    def __init__(self, schema: dict[str, TensorInfo]):
        self.path = "/sim/deepseek-v3"
        self.schema = schema
        self.non_tensor = []
        self.loc = {}
        off, f = 0, 0
        for k, info in schema.items():
            if off > 4_300_000_000:
                off, f = 0, f + 1
            self.loc[k] = TensorLocation(f"/sim/model-{f:05d}.safetensors", off, info.shape, info.dtype)
            off += info.nbytes

    def locate(self, key: str) -> TensorLocation:
        return self.loc[key]

    def read(self, key, box):  # pragma: no cover - never called: planning only
        raise RuntimeError("planning only")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--rank", type=int, default=0)
    args = ap.parse_args()
    t = time.perf_counter()
    src_schema = deepseek_v3_schema()
    t_schema = time.perf_counter() - t
    target = {target_name(k): v for k, v in src_schema.items()}
    adapter = sdadapt.Adapter(
        [sdadapt.rename(a, b) for a, b in [("model.embed_tokens.weight", "tok_embeddings.weight"),
                                           ("model.norm.weight", "norm.weight"), ("lm_head.weight", "output.weight")]]
        + [sdadapt.rename("model.layers.{i}.{rest:*}", "layers.{i}.{rest}")],
        name="dsv3-rename",
    )
    t = time.perf_counter()
    plan = sdadapt.build_plan(src_schema, target, adapter)
    t_plan = time.perf_counter() - t
    assert plan.report.ok, plan.report.format()[:2000]
    # this rank's ReadItems: dim-0 FSDP shards (DTensor's even split, last shards may be short)
    t = time.perf_counter()
    jobs = []
    for k, info in target.items():
        n = info.shape[0] if info.shape else 1
        per = -(-n // args.ranks)
        lo, hi = min(n, args.rank * per), min(n, (args.rank + 1) * per)
        if lo >= hi:
            continue
        box = ((lo, hi),) + tuple((0, d) for d in info.shape[1:])
        dest = torch.empty((hi - lo,) + tuple(info.shape[1:]), dtype=info.dtype, device="meta")
        jobs.append(Job(k, plan.recipes[k], box, dest))
    t_items = time.perf_counter() - t
    t = time.perf_counter()
    tasks = IOEngine(FakeSource(src_schema), EngineConfig(threads=16)).plan(jobs)
    t_engine = time.perf_counter() - t
    total = sum(i.nbytes for i in src_schema.values())
    print(f"schema: {len(src_schema)} keys, {total / 2**30:.0f} GiB (built in {t_schema:.2f} s)")
    print(f"build_plan (validation + recipes, rename adapter): {t_plan:.2f} s")
    print(f"rank {args.rank}/{args.ranks}: {len(jobs)} read items computed in {t_items:.2f} s; "
          f"engine planning (routes, spans, chunks, coalescing) {t_engine:.2f} s -> {len(tasks)} read tasks")
    print(f"total per rank: {t_plan + t_items + t_engine:.2f} s (target: under 5 s)")


if __name__ == "__main__":
    main()
