"""A Llama-shaped Q4_K GGUF file into a bf16 transformers model: sdadapt on W gloo ranks (FSDP2)
against transformers' own ``from_pretrained(dir, gguf_file=...)`` on one process.

    python bench/gguf_bench.py write --out /tmp/gguf-bench --gib 1.0
    torchrun --nproc-per-node 2 bench/gguf_bench.py load --out /tmp/gguf-bench
    python bench/gguf_bench.py transformers --out /tmp/gguf-bench

``write`` makes ``model.gguf`` with ``gguf``'s writer: every 2-d weight Q4_K (random blocks with
finite scales: ``gguf`` cannot quantize K-quants), norms F32, llama.cpp's metadata. ``load``
prints, per rank, the seconds of ``sdadapt.load`` into a meta ``LlamaForCausalLM`` sharded with
``fully_shard`` and the bytes it read from the file; ``transformers`` prints the seconds of
``from_pretrained`` in bfloat16. Both print one JSON line per process.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

HEADS, KV_HEADS, VOCAB = 16, 8, 32000


def shape_for(gib: float) -> dict[str, int]:
    """Hidden 2048, FFN 5632 (TinyLlama's widths) and as many layers as reach ``gib`` of Q4_K."""
    hidden, ffn = 2048, 5632
    per_layer = (2 * hidden * hidden + 2 * hidden * hidden * KV_HEADS // HEADS + 3 * hidden * ffn) * 144 // 256
    top = 2 * VOCAB * hidden * 144 // 256
    layers = max(1, int((gib * 2**30 - top) // per_layer))
    return {"hidden": hidden, "ffn": ffn, "layers": layers}


def _q4k(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    nb = cols // 256
    raw = rng.integers(0, 256, size=(rows, nb, 144), dtype=np.uint8)
    scales = (rng.random((rows, nb, 2)) * 0.01 + 0.001).astype(np.float16)
    raw[..., 0:4] = scales.view(np.uint8).reshape(rows, nb, 4)
    return raw.reshape(rows, nb * 144)


def write(out: str, gib: float) -> None:
    import gguf

    s = shape_for(gib)
    h, f, n = s["hidden"], s["ffn"], s["layers"]
    kv = h * KV_HEADS // HEADS
    rng = np.random.default_rng(0)
    os.makedirs(out, exist_ok=True)
    w = gguf.GGUFWriter(os.path.join(out, "model.gguf"), arch="llama", use_temp_file=True)
    for key, value in {"context_length": 2048, "embedding_length": h, "block_count": n, "feed_forward_length": f,
                       "attention.head_count": HEADS, "attention.head_count_kv": KV_HEADS,
                       "rope.dimension_count": h // HEADS, "vocab_size": VOCAB}.items():  # fmt: skip
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32("llama.rope.freq_base", 10000.0)
    q = gguf.GGMLQuantizationType.Q4_K
    w.add_tensor("token_embd.weight", _q4k(VOCAB, h, rng), raw_dtype=q)
    for i in range(n):
        for name, rows, cols in (("attn_q", h, h), ("attn_k", kv, h), ("attn_v", kv, h), ("attn_output", h, h),
                                 ("ffn_gate", f, h), ("ffn_up", f, h), ("ffn_down", h, f)):  # fmt: skip
            w.add_tensor(f"blk.{i}.{name}.weight", _q4k(rows, cols, rng), raw_dtype=q)
        for name in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{name}.weight", np.ones(h, dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    w.add_tensor("output.weight", _q4k(VOCAB, h, rng), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    size = os.path.getsize(os.path.join(out, "model.gguf"))
    print(json.dumps({"written": os.path.join(out, "model.gguf"), "bytes": size, "gib": size / 2**30, **s}))


def _config(out: str):  # type: ignore[no-untyped-def]
    import transformers

    from sdadapt.sources import embedded_config

    cfg = embedded_config(os.path.join(out, "model.gguf"))
    assert cfg is not None
    cfg.pop("model_type")
    return transformers.LlamaConfig(**cfg)


def load(out: str) -> None:
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import sdadapt

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(_config(out)).to(torch.bfloat16)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    dist.barrier()
    start = time.perf_counter()
    rep = sdadapt.load(model, os.path.join(out, "model.gguf"))
    seconds = time.perf_counter() - start
    size = os.path.getsize(os.path.join(out, "model.gguf"))
    print(json.dumps({"tool": "sdadapt", "rank": dist.get_rank(), "world": dist.get_world_size(), "seconds": round(seconds, 2),
                      "bytes_read": rep.bytes_read, "file_bytes": size, "fraction": round(rep.bytes_read / size, 4)}))  # fmt: skip
    dist.destroy_process_group()


def hf(out: str) -> None:
    import transformers

    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(out, gguf_file="model.gguf", dtype=torch.bfloat16)
    seconds = time.perf_counter() - start
    print(json.dumps({"tool": "transformers", "seconds": round(seconds, 2), "params": sum(p.numel() for p in model.parameters())}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["write", "load", "transformers"])
    ap.add_argument("--out", default="/tmp/gguf-bench")
    ap.add_argument("--gib", type=float, default=1.0)
    a = ap.parse_args()
    {"write": lambda: write(a.out, a.gib), "load": lambda: load(a.out), "transformers": lambda: hf(a.out)}[a.what]()


if __name__ == "__main__":
    main()
