"""Time `sdadapt.draft` on ~100k-key schemas (headers only; no tensors are made).

    python bench/draft_bench.py [--repeat 3]

Cases (schemas built as ``{key: TensorInfo}``, so the figure is the drafting itself):

1. dense: HF Llama names -> Meta names, 11,111 layers x 9 tensors (~100k keys each side);
2. moe: HF Mixtral per-expert -> stacked experts, 64 layers x 512 experts x 3 (~98k checkpoint
   keys, ~700 model keys);
3. flux: BFL -> diffusers names, 2,000 double + 4,000 single blocks (~100k keys each side).

Each run drafts, renders the module and checks it with the planner (as `sdadapt diff` would).
Prints a Markdown table for a report in bench/reports/: keys, rules proposed, whether the drafted adapter
lines everything up, and the best wall time of ``--repeat`` runs.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

import sdadapt
from sdadapt.sources import TensorInfo

F32 = torch.float32


def t(*shape: int) -> TensorInfo:
    return TensorInfo(tuple(shape), F32)


def dense(layers: int = 11_111, d: int = 64, kv: int = 32, f: int = 96, v: int = 100):
    src = {"model.embed_tokens.weight": t(v, d), "model.norm.weight": t(d), "lm_head.weight": t(v, d)}
    tgt = {"tok_embeddings.weight": t(v, d), "norm.weight": t(d), "output.weight": t(v, d)}
    for i in range(layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        src.update({a + "q_proj.weight": t(d, d), a + "k_proj.weight": t(kv, d), a + "v_proj.weight": t(kv, d),
                    a + "o_proj.weight": t(d, d), m + "gate_proj.weight": t(f, d), m + "up_proj.weight": t(f, d),
                    m + "down_proj.weight": t(d, f), f"model.layers.{i}.input_layernorm.weight": t(d),
                    f"model.layers.{i}.post_attention_layernorm.weight": t(d)})  # fmt: skip
        a, m = f"layers.{i}.attention.", f"layers.{i}.feed_forward."
        tgt.update({a + "wq.weight": t(d, d), a + "wk.weight": t(kv, d), a + "wv.weight": t(kv, d),
                    a + "wo.weight": t(d, d), m + "w1.weight": t(f, d), m + "w3.weight": t(f, d),
                    m + "w2.weight": t(d, f), f"layers.{i}.attention_norm.weight": t(d),
                    f"layers.{i}.ffn_norm.weight": t(d)})  # fmt: skip
    return src, tgt


def moe(layers: int = 64, experts: int = 512, d: int = 64, kv: int = 32, f: int = 96, v: int = 100):
    src = {"model.embed_tokens.weight": t(v, d), "model.norm.weight": t(d), "lm_head.weight": t(v, d)}
    tgt = {"tok_embeddings.weight": t(v, d), "norm.weight": t(d), "output.weight": t(v, d)}
    for i in range(layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.block_sparse_moe."
        src.update({a + "q_proj.weight": t(d, d), a + "k_proj.weight": t(kv, d), a + "v_proj.weight": t(kv, d),
                    a + "o_proj.weight": t(d, d), m + "gate.weight": t(experts, d),
                    f"model.layers.{i}.input_layernorm.weight": t(d),
                    f"model.layers.{i}.post_attention_layernorm.weight": t(d)})  # fmt: skip
        for e in range(experts):
            src.update({m + f"experts.{e}.w1.weight": t(f, d), m + f"experts.{e}.w2.weight": t(d, f),
                        m + f"experts.{e}.w3.weight": t(f, d)})  # fmt: skip
        a, m = f"layers.{i}.attention.", f"layers.{i}.moe."
        tgt.update({a + "wq.weight": t(d, d), a + "wk.weight": t(kv, d), a + "wv.weight": t(kv, d),
                    a + "wo.weight": t(d, d), m + "router.gate.weight": t(experts, d),
                    m + "experts.w1": t(experts, f, d), m + "experts.w2": t(experts, d, f),
                    m + "experts.w3": t(experts, f, d), f"layers.{i}.attention_norm.weight": t(d),
                    f"layers.{i}.ffn_norm.weight": t(d)})  # fmt: skip
    return src, tgt


def flux(double: int = 2_000, single: int = 4_000, h: int = 16, hd: int = 8, m: int = 64):
    src: dict[str, TensorInfo] = {}
    tgt: dict[str, TensorInfo] = {}
    for p in ("weight", "bias"):
        def w(*shape: int, p: str = p) -> TensorInfo:
            return t(*shape) if p == "weight" else t(shape[0])

        src.update({f"img_in.{p}": w(h, 4), f"txt_in.{p}": w(h, 12), f"time_in.in_layer.{p}": w(h, 256),
                    f"time_in.out_layer.{p}": w(h, h), f"vector_in.in_layer.{p}": w(h, 10),
                    f"vector_in.out_layer.{p}": w(h, h), f"final_layer.linear.{p}": w(4, h),
                    f"final_layer.adaLN_modulation.1.{p}": w(2 * h, h)})  # fmt: skip
        tgt.update({f"x_embedder.{p}": w(h, 4), f"context_embedder.{p}": w(h, 12),
                    f"time_text_embed.timestep_embedder.linear_1.{p}": w(h, 256),
                    f"time_text_embed.timestep_embedder.linear_2.{p}": w(h, h),
                    f"time_text_embed.text_embedder.linear_1.{p}": w(h, 10),
                    f"time_text_embed.text_embedder.linear_2.{p}": w(h, h), f"proj_out.{p}": w(4, h),
                    f"norm_out.linear.{p}": w(2 * h, h)})  # fmt: skip
        for i in range(double):
            s, d = f"double_blocks.{i}.", f"transformer_blocks.{i}."
            for x, y, z in (("img", "", "to_out.0"), ("txt", "_context", "to_add_out")):
                src.update({s + f"{x}_mod.lin.{p}": w(6 * h, h), s + f"{x}_attn.qkv.{p}": w(3 * h, h),
                            s + f"{x}_attn.proj.{p}": w(h, h), s + f"{x}_mlp.0.{p}": w(m, h),
                            s + f"{x}_mlp.2.{p}": w(h, m)})  # fmt: skip
                tgt.update({d + f"norm1{y}.linear.{p}": w(6 * h, h), d + f"attn.{z}.{p}": w(h, h),
                            d + f"ff{y}.net.0.proj.{p}": w(m, h), d + f"ff{y}.net.2.{p}": w(h, m)})  # fmt: skip
            for q in "qkv":
                tgt.update({d + f"attn.to_{q}.{p}": w(h, h), d + f"attn.add_{q}_proj.{p}": w(h, h)})
        for i in range(single):
            s, d = f"single_blocks.{i}.", f"single_transformer_blocks.{i}."
            src.update({s + f"linear1.{p}": w(3 * h + m, h), s + f"linear2.{p}": w(h, h + m),
                        s + f"modulation.lin.{p}": w(3 * h, h)})  # fmt: skip
            tgt.update({d + f"proj_mlp.{p}": w(m, h), d + f"proj_out.{p}": w(h, h + m),
                        d + f"norm.linear.{p}": w(3 * h, h)})  # fmt: skip
            for q in "qkv":
                tgt[d + f"attn.to_{q}.{p}"] = w(h, h)
    for i in range(double):
        s, d = f"double_blocks.{i}.", f"transformer_blocks.{i}."
        for x, y in (("img", ""), ("txt", "_added")):
            src.update({s + f"{x}_attn.norm.query_norm.scale": t(hd), s + f"{x}_attn.norm.key_norm.scale": t(hd)})
            tgt.update({d + f"attn.norm{y}_q.weight": t(hd), d + f"attn.norm{y}_k.weight": t(hd)})
    for i in range(single):
        s, d = f"single_blocks.{i}.", f"single_transformer_blocks.{i}."
        src.update({s + "norm.query_norm.scale": t(hd), s + "norm.key_norm.scale": t(hd)})
        tgt.update({d + "attn.norm_q.weight": t(hd), d + "attn.norm_k.weight": t(hd)})
    return src, tgt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for name, make in (("dense Llama, HF -> Meta", dense), ("MoE per-expert -> stacked", moe), ("Flux BFL -> diffusers", flux)):
        src, tgt = make()
        best = float("inf")
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            d = sdadapt.draft(tgt, src)
            best = min(best, time.perf_counter() - t0)
        rows.append(f"| {name} | {len(src):,} | {len(tgt):,} | {len(d.adapter.rules)} | "
                    f"{'yes' if d.report.ok else 'no'} | {best:.2f} |")
        print(f"{name}: {len(src)} -> {len(tgt)} keys, {len(d.adapter.rules)} rules, ok={d.report.ok}, {best:.2f} s",
              file=sys.stderr)
    print(f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}; "
          f"best of {args.repeat}.\n")
    print("| case | checkpoint keys | model keys | rules | lines up | draft wall (s) |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
