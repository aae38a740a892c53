"""The synthetic Llama shape the benchmark writes, its presets, and the adapters it loads with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Shape:
    """A Llama-shaped dense model: sizes and dtype, and the HF keys and shapes it has."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    dtype: str = "bfloat16"

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def hf_keys(self) -> list[tuple[str, tuple[int, ...]]]:
        """(HF key, shape) of every tensor of the checkpoint, in writing order."""
        h, i, kv = self.hidden, self.intermediate, self.kv_heads * self.head_dim
        out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (self.vocab, h))]
        for n in range(self.layers):
            p = f"model.layers.{n}."
            out += [
                (p + "self_attn.q_proj.weight", (h, h)),
                (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, h)),
                (p + "mlp.gate_proj.weight", (i, h)),
                (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i)),
                (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,)),
            ]
        out += [("model.norm.weight", (h,)), ("lm_head.weight", (self.vocab, h))]
        return out

    def fp8_keys(self) -> list[str]:
        """The keys the FP8 twin stores as e4m3 + ``weight_scale_inv``: the layers' matrices
        (embeddings, the output head and norms stay bf16, as in real FP8 releases)."""
        return [k for k, s in self.hf_keys() if k.startswith("model.layers.") and len(s) == 2]

    def itemsize(self) -> int:
        return {"bfloat16": 2, "float16": 2, "float32": 4}[self.dtype]

    def nbytes(self) -> int:
        """Size of the checkpoint's tensors in bytes."""
        total = 0
        for _, s in self.hf_keys():
            n = 1
            for d in s:
                n *= d
            total += n
        return total * self.itemsize()


PRESETS = {
    # Llama-3-8B: 14.96 GiB in bf16
    "8b": Shape(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256),
    # 2.09 GiB in bf16 (the CPU figure of earlier rounds: a checkpoint of at least 2 GiB)
    "2g": Shape(layers=22, hidden=2048, intermediate=5632, heads=16, kv_heads=4, vocab=32000),
    # 1.92 GiB in bf16: the "2g" shape with 20 layers, the CPU case of issue 12
    "1.9g": Shape(layers=20, hidden=2048, intermediate=5632, heads=16, kv_heads=4, vocab=32000),
    # tiny: the smoke test
    "tiny": Shape(layers=2, hidden=64, intermediate=160, heads=4, kv_heads=2, vocab=96),
}

# the FP8 twin's block scaling, as DeepSeek-V3 and Qwen3-FP8 releases ship it
FP8_QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}


def _ct_config(fmt: str, weights: dict, inputs: dict | None) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"], "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs}}}


# the compressed-tensors twins, as llm-compressor's FP8_DYNAMIC and NVFP4 presets write them
CT_QUANTIZATION_CONFIGS = {
    "fp8ch": _ct_config("float-quantized", {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False},
                        {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}),
    "nvfp4": _ct_config("nvfp4-pack-quantized", {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group",
                                                 "group_size": 16, "dynamic": False, "scale_dtype": "torch.float8_e4m3fn"}, None),
}

# HF name -> torchtitan-style name (the rename-only adapter's job)
RENAMES = [
    ("model.embed_tokens.weight", "tok_embeddings.weight"),
    ("model.layers.{i}.self_attn.q_proj.weight", "layers.{i}.attention.wq.weight"),
    ("model.layers.{i}.self_attn.k_proj.weight", "layers.{i}.attention.wk.weight"),
    ("model.layers.{i}.self_attn.v_proj.weight", "layers.{i}.attention.wv.weight"),
    ("model.layers.{i}.self_attn.o_proj.weight", "layers.{i}.attention.wo.weight"),
    ("model.layers.{i}.mlp.gate_proj.weight", "layers.{i}.feed_forward.w1.weight"),
    ("model.layers.{i}.mlp.up_proj.weight", "layers.{i}.feed_forward.w3.weight"),
    ("model.layers.{i}.mlp.down_proj.weight", "layers.{i}.feed_forward.w2.weight"),
    ("model.layers.{i}.input_layernorm.weight", "layers.{i}.attention_norm.weight"),
    ("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.ffn_norm.weight"),
    ("model.norm.weight", "norm.weight"),
    ("lm_head.weight", "output.weight"),
]

_FUSED_SOURCES = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


def adapter_for(naming: str, release: str | None = None, checkpoint: str | None = None) -> Any:
    """The adapter from the HF checkpoint to a model named ``naming``: ``hf`` (none: names 1:1),
    ``titan`` (rename only) or ``fused`` (q/k/v -> ``wqkv``, gate/up -> ``w13``, the rest renamed).
    ``release``: the folder of a quantized release, whose ``config.json`` gives the dequant rules
    put first (``sdadapt.dequant_rules``). ``checkpoint``: the HF folder, needed for ``fused``: the
    fused parts' row counts (GQA's q, k and v differ) are read from its headers."""
    import sdadapt

    if release is not None:
        inner = adapter_for(naming)
        rules = sdadapt.dequant_rules(release) + (list(inner.rules) if inner is not None else [])
        return sdadapt.Adapter(rules, name=f"fp8-{inner.name if inner is not None else 'hf'}")
    if naming == "hf":
        return None
    if naming == "titan":
        return sdadapt.Adapter([sdadapt.rename(s, d) for s, d in RENAMES], name="llama-hf-to-titan")
    if naming != "fused":
        raise ValueError(f"unknown model naming {naming!r}")
    if checkpoint is None:
        raise ValueError("the fused naming needs checkpoint= (the fused parts' sizes come from its headers)")
    schema = sdadapt.sources.open_source(checkpoint).schema
    qkv = [f"model.layers.{{i}}.self_attn.{p}_proj.weight" for p in "qkv"]
    gate_up = ["model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"]

    def rows(parts: list[str]) -> list[int]:
        return [schema[p.format(i=0)].shape[0] for p in parts]

    rules = [
        sdadapt.fuse(qkv, "layers.{i}.attention.wqkv.weight", sizes=rows(qkv)),
        sdadapt.fuse(gate_up, "layers.{i}.feed_forward.w13.weight", sizes=rows(gate_up)),
    ]
    rules += [sdadapt.rename(s, d) for s, d in RENAMES if not any(f in s for f in _FUSED_SOURCES)]
    return sdadapt.Adapter(rules, name="llama-hf-to-titan-fused")
