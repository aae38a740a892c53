"""A Llama-shaped GPTQ release (written by auto-gptq's own packing) into a bf16 transformers model:
sdadapt on W gloo ranks (FSDP2), and transformers' own ``from_pretrained`` where it loads it.

    $(python scripts/quant_venv.py) bench/gptq_bench.py write --out /tmp/gptq-bench --gib 1.0
    torchrun --nproc-per-node 2 bench/gptq_bench.py load --out /tmp/gptq-bench
    $(python scripts/gptqmodel_venv.py) bench/gptq_bench.py transformers --out /tmp/gptq-bench

``write`` runs in the quant venv (auto-gptq 0.7.1): hidden 2048, FFN 5632 (TinyLlama's widths),
16 heads / 8 kv heads, vocab 32000, and as many layers as reach ``--gib``; every decoder linear
packed by ``QuantLinear.pack`` (4 bits, group 128, act-order ``g_idx``, asymmetric zero points
drawn at random, calibration-free), embeddings and head float16. ``load`` prints, per rank, the
seconds of ``sdadapt.load`` into a meta ``LlamaForCausalLM`` in bfloat16 sharded with
``fully_shard`` and the bytes it read; ``transformers`` times ``from_pretrained(dir,
dtype=bfloat16)`` or prints why it cannot load the release: transformers 5 loads GPTQ only
through optimum and GPTQModel, which ``scripts/gptqmodel_venv.py`` installs (GPTQModel 6.0.3, its
CPU torch kernels, transformers 5.5.4). One JSON line per process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
VARIANT = dict(method="gptq", bits=4, group=128, sym=False, act_order=True)
HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 2048, 5632, 16, 8, 32000


def sizes_for(gib: float) -> dict[str, int]:
    """The LlamaConfig fields of a model whose 4-bit release is about ``gib``."""
    kv = HIDDEN * KV_HEADS // HEADS
    linear = 2 * HIDDEN * HIDDEN + 2 * HIDDEN * kv + 3 * HIDDEN * FFN
    per_layer = linear // 2 + linear // 128 * 2 + (4 * HIDDEN + 2 * FFN) * 4  # codes, scales, g_idx
    top = 2 * VOCAB * HIDDEN * 2
    layers = max(1, int((gib * 2**30 - top) // per_layer))
    return dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=layers,
                num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=2048)  # fmt: skip


def write(out: str, gib: float) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from support.quant_oracle import write_large

    start = time.perf_counter()
    params = write_large(out, VARIANT, sizes_for(gib))
    size = os.path.getsize(os.path.join(out, "model.safetensors"))
    print(json.dumps({"written": out, "bytes": size, "gib": round(size / 2**30, 3), "params": params,
                      "seconds": round(time.perf_counter() - start, 1), **sizes_for(gib)}))  # fmt: skip


def load(out: str) -> None:
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import sdadapt

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    cfg = transformers.AutoConfig.from_pretrained(out)
    cfg.quantization_config = None  # the model holds plain weights; the release's config is read by sdadapt
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    dist.barrier()
    start = time.perf_counter()
    rep = sdadapt.load(model, out)
    seconds = time.perf_counter() - start
    size = os.path.getsize(os.path.join(out, "model.safetensors"))
    print(json.dumps({"tool": "sdadapt", "rank": dist.get_rank(), "world": dist.get_world_size(), "seconds": round(seconds, 2),
                      "bytes_read": rep.bytes_read, "file_bytes": size, "fraction": round(rep.bytes_read / size, 4)}))  # fmt: skip
    dist.destroy_process_group()


def hf(out: str) -> None:
    import importlib.util

    import transformers

    versions = {"transformers": transformers.__version__}
    if importlib.util.find_spec("gptqmodel"):  # imported here, not first inside transformers' meta-device init
        import gptqmodel

        versions["gptqmodel"] = gptqmodel.__version__
    start = time.perf_counter()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16, device_map="cpu")
    except Exception as e:  # noqa: BLE001 - the bench reports why transformers cannot load it here
        print(json.dumps({"tool": "transformers", **versions, "error": f"{type(e).__name__}: {e}"[:400]}))
        return
    seconds = time.perf_counter() - start
    kind = type(model.model.layers[0].mlp.down_proj).__name__
    print(json.dumps({"tool": "transformers", **versions, "seconds": round(seconds, 2), "down_proj": kind,
                      "params": sum(p.numel() for p in model.parameters())}))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["write", "load", "transformers"])
    ap.add_argument("--out", default="/tmp/gptq-bench")
    ap.add_argument("--gib", type=float, default=1.0)
    a = ap.parse_args()
    {"write": lambda: write(a.out, a.gib), "load": lambda: load(a.out), "transformers": lambda: hf(a.out)}[a.what]()


if __name__ == "__main__":
    main()
