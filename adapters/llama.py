"""HF transformers Llama -> Meta reference Llama layout.

Checkpoint (``save_pretrained`` of ``LlamaForCausalLM``)::

    model.embed_tokens.weight, model.norm.weight, lm_head.weight (absent when tied)
    model.layers.{i}.self_attn.q_proj|k_proj|v_proj|o_proj.weight
    model.layers.{i}.mlp.gate_proj|up_proj|down_proj.weight
    model.layers.{i}.input_layernorm.weight, model.layers.{i}.post_attention_layernorm.weight

Model (Meta's ``model.py``)::

    tok_embeddings.weight, norm.weight, output.weight
    layers.{i}.attention.wq|wk|wv|wo.weight   (or wqkv with fused_qkv=True)
    layers.{i}.feed_forward.w1|w2|w3.weight   (or w13 + w2 with fused_w13=True)
    layers.{i}.attention_norm.weight, layers.{i}.ffn_norm.weight

HF stores q and k with the rotary rows of each head in "half" order (first halves, then
second halves); Meta's rotary rotates interleaved row pairs, so wq and wk are permuted inside
each head (with ``n_heads`` for q and ``n_kv_heads`` for k: GQA). A fused ``wqkv``/``w13``
is laid out per tensor-parallel rank (``[q_r; k_r; v_r]``), so that ``ColwiseParallel``
gives each rank the rows its attention code expects; the TP degree is read from the model's
placements unless ``tp=`` is given. ``adapter.inverse()`` exports back to the HF layout; with
fused targets, plan the export from the parallelised model's state dict (its placements give
the TP degree) or pass ``tp=``: a gathered full tensor still has the per-rank row order.
"""

from __future__ import annotations

from typing import Any

from sdadapt.adapters._common import (
    HF,
    META,
    Quantization,
    attention_options,
    attention_rules,
    checkpoint_schema,
    dequant_rules,
    head_counts,
    head_dim_of,
    mlp_rules,
    need,
    positive,
    quantization_options,
    read_config,
    top_level_rules,
)

import sdadapt
from sdadapt import Adapter
from sdadapt.sources import Source

SUMMARY = "HF transformers Llama -> Meta reference layout (wq/wk/wv/wo, w1/w2/w3; Meta rotary, GQA, tied, fused wqkv/w13)"

def build(
    *,
    n_heads: int,
    n_kv_heads: int | None = None,
    dim: int | None = None,
    head_dim: int | None = None,
    hidden_dim: int | None = None,
    tie_embeddings: bool = False,
    fused_qkv: bool = False,
    fused_w13: bool = False,
    tp: int | None = None,
    inv_freq: bool = False,
    quantization: Quantization = None,
    scale_dtype: str | None = None,
    dtype: str | None = None,
) -> Adapter:
    """The adapter from an HF Llama checkpoint to the Meta layout.

    ``n_heads`` (required) and ``n_kv_heads`` (default ``n_heads``) drive the rotary permutation.
    ``tie_embeddings``: the checkpoint has no ``lm_head.weight`` (tied); ``output.weight`` is
    filled from the embeddings. ``fused_qkv`` needs ``dim`` or ``head_dim``; ``fused_w13`` needs
    ``hidden_dim`` (the MLP width). ``inv_freq``: the checkpoint holds old
    ``rotary_emb.inv_freq`` buffers (dropped). ``quantization``: the checkpoint's
    ``quantization_config`` (``None``: plain weights): FP8 (block or per-tensor),
    compressed-tensors and ModelOpt releases are dequantised to the model's dtype (``dtype``
    pins one) by rules placed first (see ``_common.dequant_rules``). ``scale_dtype``: the dtype
    the release stores its e8m0 exponents in (``uint8`` or ``float8_e8m0fnu``; MXFP8 and UE8M0
    FP8), which loading requires and export writes back.
    """
    n_heads, n_kv_heads = head_counts(n_heads, n_kv_heads, "llama")
    rules: list[Any] = dequant_rules(quantization, "llama", scale_dtype=scale_dtype, dtype=dtype)
    if inv_freq:
        rules.append(sdadapt.drop(HF + "self_attn.rotary_emb.inv_freq"))
    rules += top_level_rules(tie_embeddings)
    rules += attention_rules(
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim_of(dim, n_heads, head_dim, "llama"),
        fused_qkv=fused_qkv,
        tp=tp,
        adapter="llama",
    )
    if fused_w13:
        h = positive("hidden_dim", need("hidden_dim", hidden_dim, "llama"), "llama")
        rules += [
            sdadapt.rename(HF + "mlp.down_proj.weight", META + "feed_forward.w2.weight"),
            sdadapt.fuse(
                [HF + "mlp.gate_proj.weight", HF + "mlp.up_proj.weight"], META + "feed_forward.w13.weight", sizes=[h, h]
            ),
            sdadapt.interleave(META + "feed_forward.w13.weight", sizes=[h, h], tp=tp),
        ]
    else:
        rules += mlp_rules()
    flags = [n for n, on in (("fused_qkv", fused_qkv), ("fused_w13", fused_w13)) if on]
    return Adapter(
        rules,
        name="llama",
        description=f"HF Llama -> Meta layout (n_heads={n_heads}, n_kv_heads={n_kv_heads}"
        + "".join(f", {f}" for f in flags)
        + ")",
    )


def options_from_config(folder: str, source: str | Source | None = None) -> dict[str, Any]:
    """Options from the checkpoint's ``config.json`` (HF) and its headers (key names; quantization)."""
    cfg = read_config(folder, ("config.json",))
    schema = checkpoint_schema(source or folder)
    keys = list(schema)
    quant = quantization_options(cfg, schema)
    mxfp8 = isinstance(quant.get("quantization"), dict) and quant["quantization"].get("quant_method") == "mxfp8"
    opts = attention_options(cfg, keys) | {k: v for k, v in quant.items() if k == "quantization" or (mxfp8 and k == "scale_dtype")}
    if "intermediate_size" in cfg:
        opts["hidden_dim"] = cfg["intermediate_size"]
    if any(k.endswith("rotary_emb.inv_freq") for k in keys):
        opts["inv_freq"] = True
    return opts
