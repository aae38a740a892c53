"""Planning cost of a DeepSeek-V3-shaped FP8 release (~92k keys), without starting processes.

    python bench/plan_bench.py [--ranks 64] [--rank 0] [--adapter shipped|stack|rename]

Builds the source schema of a DeepSeek-V3-shaped HF checkpoint (61 layers, the first 3 dense,
256 routed experts of 3 FP8 weights each, each with its ``weight_scale_inv``; MLA attention,
norms, shared experts) and, as one rank of ``--ranks`` would, times:

1. ``build_plan`` (validation + recipes). ``--adapter shipped`` (the default): the native layout
   (torchtitan's DeepSeek-V3 names; bf16 target) through the shipped ``deepseek_v3`` adapter,
   given the release's options (its ``quantization_config``: FP8 128x128 blocks); ``--adapter
   stack``: the same target through an adapter written here with the few rules that mapping
   needs: ``dequant_rules``, the per-expert keys stacked into ``moe.experts.w1|w2|w3 [256, ...]``,
   renames. ``--adapter rename``: HF keys renamed only, FP8 kept (the planning floor);
2. the rank's ReadItems: FSDP-style dim-0 shards of every target tensor, computed here from the
   rank coordinates (what DCP would hand this rank);
3. the I/O engine's planning of those items (recipes to steps, routing, byte spans, chunking,
   coalescing) against a simulated file layout, with meta-device destinations: no data is read.

It prints each time and the peak RSS growth over the whole (the schemas are built before it is
measured from). The steps run with the cycle collector paused, as ``sdadapt.load`` runs them (a
full collection would otherwise land in one step or another by chance).
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import sdadapt  # noqa: E402
from sdadapt._base.gc import gc_paused  # noqa: E402
from sdadapt._base.schema import TensorInfo, TensorLocation  # noqa: E402
from sdadapt._engine import EngineConfig, IOEngine, Job  # noqa: E402
from sdadapt._plan.plan import build_plan
from sdadapt.rules._patterns import compile_pattern  # noqa: E402
from sdadapt.sources import Source  # noqa: E402

LAYERS, DENSE, EXPERTS = 61, 3, 256
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}


def deepseek_v3_schema() -> dict[str, TensorInfo]:
    """The HF keys of a DeepSeek-V3 release (scale_bench.py writes the same schema as headers)."""
    from scale_bench import release_schema  # bench/ is this script's folder

    return release_schema("dsv3")


# HF name -> native name, in the family of torchtitan's DeepSeek-V3 (MLA with q_lora_rank)
RENAMES = [
    ("model.embed_tokens.weight", "tok_embeddings.weight"),
    ("model.norm.weight", "norm.weight"),
    ("lm_head.weight", "output.weight"),
    ("model.layers.{i}.self_attn.q_a_proj.weight", "layers.{i}.attention.wq_a.weight"),
    ("model.layers.{i}.self_attn.q_a_layernorm.weight", "layers.{i}.attention.q_norm.weight"),
    ("model.layers.{i}.self_attn.q_b_proj.weight", "layers.{i}.attention.wq_b.weight"),
    ("model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight", "layers.{i}.attention.wkv_a.weight"),
    ("model.layers.{i}.self_attn.kv_a_layernorm.weight", "layers.{i}.attention.kv_norm.weight"),
    ("model.layers.{i}.self_attn.kv_b_proj.weight", "layers.{i}.attention.wkv_b.weight"),
    ("model.layers.{i}.self_attn.o_proj.weight", "layers.{i}.attention.wo.weight"),
    ("model.layers.{i}.input_layernorm.weight", "layers.{i}.attention_norm.weight"),
    ("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.ffn_norm.weight"),
    ("model.layers.{i}.mlp.gate.weight", "layers.{i}.moe.router.gate.weight"),
    ("model.layers.{i}.mlp.gate.e_score_correction_bias", "layers.{i}.moe.expert_bias"),
]
PROJ = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
RENAMES += [(f"model.layers.{{i}}.mlp.{hf}.weight", f"layers.{{i}}.feed_forward.{w}.weight") for hf, w in PROJ.items()]
RENAMES += [(f"model.layers.{{i}}.mlp.shared_experts.{hf}.weight", f"layers.{{i}}.moe.shared_experts.{w}.weight")
            for hf, w in PROJ.items()]


def shipped_adapter() -> sdadapt.Adapter:
    """``sdadapt.adapters.deepseek_v3`` with the release's options (what ``get_adapter`` reads
    from its ``config.json``)."""
    return sdadapt.get_adapter("deepseek_v3", q_lora=True, first_k_dense_replace=DENSE, n_experts=EXPERTS, n_layers=LAYERS,
                               quantization=QUANTIZATION_CONFIG)


def stacking_adapter() -> sdadapt.Adapter:
    """What a ``deepseek_v3`` adapter does to an FP8 release: dequantise (the rules come from
    the release's config), stack the routed experts, rename the rest."""
    rules: list = sdadapt.dequant_rules({"quantization_config": QUANTIZATION_CONFIG})
    rules += [sdadapt.stack(f"model.layers.{{i}}.mlp.experts.{{e}}.{hf}.weight", f"layers.{{i}}.moe.experts.{w}",
                            count=EXPERTS) for hf, w in PROJ.items()]
    rules += [sdadapt.rename(a, b) for a, b in RENAMES]
    return sdadapt.Adapter(rules, name="deepseek-v3-fp8-inline")


def native_target(src: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
    """The bf16 model's schema in native names: what a meta-initialised DeepSeek-V3 reports."""
    bf16 = torch.bfloat16
    out: dict[str, TensorInfo] = {}
    for k, info in src.items():
        if k.endswith("_scale_inv") or ".mlp.experts." in k:
            continue
        dtype = info.dtype if info.dtype == torch.float32 else bf16  # the router's bias stays float32
        for a, b in RENAMES:
            caps = compile_pattern(a).match(k)
            if caps is not None:
                out[compile_pattern(b).format(caps)] = TensorInfo(info.shape, dtype)
                break
        else:
            raise KeyError(k)
    for n in range(DENSE, LAYERS):
        for hf, w in PROJ.items():
            o, i = src[f"model.layers.{n}.mlp.experts.0.{hf}.weight"].shape
            out[f"layers.{n}.moe.experts.{w}"] = TensorInfo((EXPERTS, o, i), bf16)
    return out


def rename_adapter() -> sdadapt.Adapter:
    return sdadapt.Adapter(
        [sdadapt.rename(a, b) for a, b in [("model.embed_tokens.weight", "tok_embeddings.weight"),
                                           ("model.norm.weight", "norm.weight"), ("lm_head.weight", "output.weight")]]
        + [sdadapt.rename("model.layers.{i}.{rest:*}", "layers.{i}.{rest}")],
        name="dsv3-rename",
    )


def renamed_target(src: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
    def name(k: str) -> str:
        if k.startswith("model.embed_tokens."):
            return "tok_embeddings." + k.removeprefix("model.embed_tokens.")
        if k.startswith("model.layers."):
            return k.removeprefix("model.")
        return {"model.norm.weight": "norm.weight", "lm_head.weight": "output.weight"}[k]

    return {name(k): v for k, v in src.items()}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


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
    ap.add_argument("--adapter", choices=["shipped", "stack", "rename"], default="shipped")
    args = ap.parse_args()
    t = time.perf_counter()
    src_schema = deepseek_v3_schema()
    native = args.adapter != "rename"
    target = native_target(src_schema) if native else renamed_target(src_schema)
    adapter = {"shipped": shipped_adapter, "stack": stacking_adapter, "rename": rename_adapter}[args.adapter]()
    t_schema = time.perf_counter() - t
    rss0 = _rss()
    with gc_paused():  # as in sdadapt.load, which plans with the cycle collector paused
        clock = _Clock()
        plan = build_plan(src_schema, target, adapter)
        t_plan = clock.lap()
        assert plan.report.ok, plan.report.format()[:2000]
        # this rank's ReadItems: dim-0 FSDP shards (DTensor's even split, last shards may be short)
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
        t_items = clock.lap()
        tasks = IOEngine(FakeSource(src_schema), EngineConfig(threads=16)).plan(jobs)
        t_engine = clock.lap()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0
    total = sum(i.nbytes for i in src_schema.values())
    print(f"schema: {len(src_schema)} source keys, {total / 2**30:.0f} GiB; {len(target)} target keys "
          f"(schemas and adapter built in {t_schema:.2f} s)")
    print("times: wall s / CPU s of this process (on a shared machine the CPU time is what an idle one takes)")
    print(f"build_plan (validation + recipes, {adapter.name}, {len(adapter.rules)} rules): {_fmt(t_plan)}")
    print(f"rank {args.rank}/{args.ranks}: {len(jobs)} read items: {_fmt(t_items)}; "
          f"engine planning (steps, routes, spans, chunks, coalescing) -> {len(tasks)} tasks: {_fmt(t_engine)}")
    tot = (t_plan[0] + t_items[0] + t_engine[0], t_plan[1] + t_items[1] + t_engine[1])
    print(f"total per rank: {_fmt(tot)} (target: under 5 s); peak RSS growth {peak / 2**20:.0f} MiB")


class _Clock:
    """Wall and CPU time since the last lap."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def lap(self) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        out = (wall - self.wall, cpu - self.cpu)
        self.wall, self.cpu = wall, cpu
        return out


def _fmt(t: tuple[float, float]) -> str:
    return f"{t[0]:.2f} / {t[1]:.2f}"


if __name__ == "__main__":
    main()
