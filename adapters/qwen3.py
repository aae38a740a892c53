"""HF transformers Qwen3 -> torchtitan-style layout (the Llama family's names plus q/k norms).

Checkpoint (``save_pretrained`` of ``Qwen3ForCausalLM``, the Hub releases)::

    model.embed_tokens.weight, model.norm.weight, lm_head.weight (absent when tied)
    model.layers.{i}.self_attn.q_proj|k_proj|v_proj|o_proj.weight   (.bias with attention_bias)
    model.layers.{i}.self_attn.q_norm|k_norm.weight                 [head_dim]
    model.layers.{i}.mlp.gate_proj|up_proj|down_proj.weight
    model.layers.{i}.input_layernorm.weight, model.layers.{i}.post_attention_layernorm.weight

Model::

    tok_embeddings.weight, norm.weight, output.weight
    layers.{i}.attention.wq|wk|wv|wo.weight                         (.bias with attention_bias)
    layers.{i}.attention.q_norm|k_norm.weight
    layers.{i}.feed_forward.w1|w2|w3.weight                         (gate, down, up)
    layers.{i}.attention_norm.weight, layers.{i}.ffn_norm.weight

Unlike the ``llama`` adapter there is no rotary row permutation: Qwen3 models (torchtitan's
included) apply rotary in HF's "half" order, so q and k keep their rows, and the per-head
``q_norm``/``k_norm`` need no reordering either. Every rule is a rename (or the tie of
``output.weight``), so any TP/FSDP sharding loads without widening reads.
``adapter.inverse()`` exports back to the HF layout.

FP8 releases (Qwen3-*-FP8: ``quantization_config`` in ``config.json`` with
``weight_block_size``, ``*_scale_inv`` keys beside the weights) are dequantised while loading,
and re-quantized with the same blocks by ``adapter.inverse()``: see ``_common.dequant_rules``.
Given the checkpoint (``sdadapt.get_adapter("qwen3", source=...)``), the adapter reads how the
scales are stored from its headers (``scale_format``, and ``scale_dtype`` for exponent bytes),
so the export writes the release's scale dtype (``F8_E8M0`` stays ``F8_E8M0``); built without
it (``build(quantization=...)``), exponent-byte scales are written as ``uint8`` (the same
bytes) unless ``scale_dtype`` is passed.
"""

from __future__ import annotations

from typing import Any

from sdadapt.adapters._common import (
    HF,
    META,
    Quantization,
    block_rules,
    checkpoint_schema,
    dequant_rules,
    mlp_rules,
    quantization_options,
    read_config,
    tied_from,
    top_level_rules,
)

import sdadapt
from sdadapt import Adapter
from sdadapt.rules import ScaleFormat
from sdadapt.sources import Source

SUMMARY = "HF transformers Qwen3 -> torchtitan-style layout (wq/wk/wv/wo + q_norm/k_norm, w1/w2/w3; HF rotary order kept; tied)"


def attention_rules(attention_bias: bool) -> list[Any]:
    """Qwen3 attention and block norms: the Llama family's renames (rows in HF order) plus the
    per-head ``q_norm``/``k_norm``; ``attention_bias``: q/k/v/o carry biases."""
    return [
        *block_rules(bias=attention_bias),
        sdadapt.rename(HF + "self_attn.q_norm.weight", META + "attention.q_norm.weight"),
        sdadapt.rename(HF + "self_attn.k_norm.weight", META + "attention.k_norm.weight"),
    ]


def build(
    *,
    tie_embeddings: bool = False,
    attention_bias: bool = False,
    quantization: Quantization = None,
    scale_format: ScaleFormat | None = None,
    scale_dtype: str | None = None,
    dtype: str | None = None,
) -> Adapter:
    """The adapter from an HF Qwen3 checkpoint to the torchtitan-style layout.

    ``tie_embeddings``: the checkpoint has no ``lm_head.weight`` (``tie_word_embeddings``);
    ``output.weight`` is filled from the embeddings. ``attention_bias``: the checkpoint's q/k/v/o
    projections have biases (``attention_bias`` of the config). ``quantization``: the
    checkpoint's ``quantization_config`` (``None``: plain weights); an FP8 release is
    dequantised to the model's dtype (``dtype`` pins one), its scales read as ``scale_format`` (default: the config's
    ``scale_fmt``) and, when ``scale_dtype`` is given, required in that dtype, which export
    writes back. See ``_common.dequant_rules``.
    """
    rules: list[Any] = dequant_rules(quantization, "qwen3", scale_format=scale_format, scale_dtype=scale_dtype, dtype=dtype)
    rules += top_level_rules(tie_embeddings)
    rules += attention_rules(attention_bias)
    rules += mlp_rules()
    flags = [n for n, on in (("tied", tie_embeddings), ("attention_bias", attention_bias)) if on]
    return Adapter(rules, name="qwen3", description="HF Qwen3 -> torchtitan-style layout" + "".join(f", {f}" for f in flags))


def dense_options(cfg: dict[str, Any], keys: list[str]) -> dict[str, Any]:
    """The options every Qwen3-family adapter reads from ``config.json`` and the checkpoint's key
    names: ``tie_embeddings`` and ``attention_bias`` (key names win when known)."""
    opts: dict[str, Any] = {}
    tied = tied_from(cfg, keys)
    if tied is not None:
        opts["tie_embeddings"] = tied
    if keys:
        opts["attention_bias"] = any(k.endswith("self_attn.q_proj.bias") for k in keys)
    elif "attention_bias" in cfg:
        opts["attention_bias"] = bool(cfg["attention_bias"])
    return opts


def options_from_config(folder: str, source: str | Source | None = None) -> dict[str, Any]:
    """Options from the checkpoint's ``config.json`` (HF) and its headers: key names, and the
    quantization with the stored dtype of FP8 scales."""
    cfg, schema = read_config(folder, ("config.json",)), checkpoint_schema(source or folder)
    return dense_options(cfg, list(schema)) | quantization_options(cfg, schema)
