"""HF transformers GPT-OSS (bf16 or the MXFP4 release) -> torchtitan-style MoE layout with
de-interleaved stacked experts.

Checkpoint, every release::

    model.embed_tokens.weight, model.norm.weight, lm_head.weight (absent when tied)
    model.layers.{i}.self_attn.q_proj|k_proj|v_proj|o_proj.weight|bias
    model.layers.{i}.self_attn.sinks                                [H]
    model.layers.{i}.input_layernorm.weight, model.layers.{i}.post_attention_layernorm.weight
    model.layers.{i}.mlp.router.weight|bias                         [E, dim], [E]
    model.layers.{i}.mlp.experts.gate_up_proj_bias                  [E, 2F]  (gate, up alternating)
    model.layers.{i}.mlp.experts.down_proj_bias                     [E, dim]

Experts, ``quantization=None`` (a bf16 release, or what transformers writes for
``GptOssForCausalLM``: the module's ``[E, in, out]`` parameters)::

    model.layers.{i}.mlp.experts.gate_up_proj                       [E, dim, 2F]  (gate, up alternating)
    model.layers.{i}.mlp.experts.down_proj                          [E, F, dim]

Experts, ``quantization="mxfp4"`` (the released checkpoints: ``[E, out, in]`` rows, the input
dim packed, 32 e2m1 values per block of 16 bytes, one e8m0 scale per block)::

    model.layers.{i}.mlp.experts.gate_up_proj_blocks|_scales        [E, 2F, dim/32, 16], [E, 2F, dim/32]
    model.layers.{i}.mlp.experts.down_proj_blocks|_scales           [E, dim, F/32, 16], [E, dim, F/32]

Model::

    tok_embeddings.weight, norm.weight, output.weight
    layers.{i}.attention.wq|wk|wv|wo.weight|bias, layers.{i}.attention.sinks
    layers.{i}.attention_norm.weight, layers.{i}.ffn_norm.weight
    layers.{i}.moe.router.gate.weight|bias                          [E, dim], [E]
    layers.{i}.moe.experts.w1|w3                                    [E, F, dim]  (gate, up)
    layers.{i}.moe.experts.w2                                       [E, dim, F]  (down)
    layers.{i}.moe.experts.b1|b3                                    [E, F]
    layers.{i}.moe.experts.b2                                       [E, dim]

Gate and up rows alternate in every release (gate rows even, up rows odd, as transformers'
``gate_up[..., ::2]`` / ``[..., 1::2]`` reads them); ``deinterleave(sizes=[F, F], tp=F)`` puts
them in two contiguous halves, which a split cuts into ``w1`` and ``w3`` (``b1``/``b3``), so
that TP can shard gate and up alike. The orientation of the expert matrices comes from the
format, never from their shapes (the down projection is square in the released models): the
bf16 layout is transposed, the MXFP4 layout already has the model's ``[E, out, in]`` rows.
Rotary stays in HF's "half" order (no row permutation). ``adapter.inverse()`` exports back:
interleaved again, transposed again (bf16) or re-quantized with the same block geometry (MXFP4).
"""

from __future__ import annotations

from typing import Any

from sdadapt.adapters._common import (
    HF,
    META,
    block_rules,
    checkpoint_keys,
    positive,
    quantization_of,
    read_config,
    tied_from,
    top_level_rules,
)

import sdadapt
from sdadapt import Adapter
from sdadapt.errors import AdapterError
from sdadapt.sources import Source

SUMMARY = (
    "HF transformers GPT-OSS (bf16 or MXFP4 experts) -> torchtitan-style MoE: attention biases + sinks, router bias, "
    "gate/up de-interleaved into stacked w1/w3 [E, F, D], w2 [E, D, F], biases b1/b2/b3"
)

EXPERTS = HF + "mlp.experts."
"""Where the checkpoint keeps a layer's experts."""


def _method(quantization: str | dict[str, Any] | None) -> str | None:
    """The quantization method named by the ``quantization`` option (a method name, or a
    ``quantization_config`` dict as ``config.json`` holds it)."""
    if isinstance(quantization, dict):
        quantization = quantization.get("quant_method")
    if quantization is None or quantization == "mxfp4":
        return quantization
    raise AdapterError(
        f"the gpt_oss adapter reads bf16 releases and MXFP4 ones (quant_method 'mxfp4'), not quant_method {quantization!r}"
    )


def expert_rules(intermediate_size: int, quantization: str | dict[str, Any] | None, dtype: str | None) -> list[Any]:
    """A layer's experts: MXFP4 dequantised (the model's dtype, or ``dtype``) or bf16 transposed to ``[E, out, in]``,
    then gate/up de-interleaved and split, the down projection and the biases renamed."""
    f = positive("intermediate_size", intermediate_size, "gpt_oss")
    moe = META + "moe.experts."
    gate_up, down = EXPERTS + "gate_up_proj", EXPERTS + "down_proj"
    if _method(quantization) == "mxfp4":
        # the packed rows are de-interleaved before dequantising (rows are independent in
        # MXFP4), so that dequantisation still runs on the destination's device
        rules: list[Any] = [sdadapt.deinterleave([gate_up + "_blocks", gate_up + "_scales"], [f, f], tp=f, dim=1)]
        rules += [sdadapt.dequant_mxfp4(EXPERTS + "{proj}_proj", dtype=dtype)]
    else:
        rules = [sdadapt.transpose(gate_up, 1, 2), sdadapt.transpose(down, 1, 2)]
        rules += [sdadapt.deinterleave(gate_up, [f, f], tp=f, dim=1)]
    rules += [
        sdadapt.split(gate_up, [moe + "w1", moe + "w3"], dim=1),
        sdadapt.deinterleave(gate_up + "_bias", [f, f], tp=f, dim=1),
        sdadapt.split(gate_up + "_bias", [moe + "b1", moe + "b3"], dim=1),
    ]
    return rules + [sdadapt.rename(down, moe + "w2"), sdadapt.rename(down + "_bias", moe + "b2")]


def build(
    *,
    intermediate_size: int,
    quantization: str | dict[str, Any] | None = None,
    tie_embeddings: bool = False,
    attention_bias: bool = True,
    dtype: str | None = None,
) -> Adapter:
    """The adapter from an HF GPT-OSS checkpoint to the stacked-experts layout.

    ``intermediate_size`` (the config's; ``F``): the gate and up rows each expert holds.
    ``quantization``: ``None`` for a bf16/fp32 release, ``"mxfp4"`` (or its
    ``quantization_config``) for the MXFP4 experts of the released checkpoints, dequantised to the
    model's dtype (``dtype`` pins one). ``tie_embeddings``: the checkpoint has no ``lm_head.weight``.
    ``attention_bias``: q/k/v/o carry biases (every released GPT-OSS does).
    """
    rules: list[Any] = top_level_rules(tie_embeddings)
    rules += block_rules(bias=attention_bias)
    rules += [
        sdadapt.rename(HF + "self_attn.sinks", META + "attention.sinks"),
        sdadapt.rename(HF + "mlp.router.weight", META + "moe.router.gate.weight"),
        sdadapt.rename(HF + "mlp.router.bias", META + "moe.router.gate.bias"),
    ]
    rules = expert_rules(intermediate_size, quantization, dtype) + rules
    fmt = _method(quantization) or "plain"
    return Adapter(
        rules, name="gpt_oss", description=f"HF GPT-OSS ({fmt} experts, F={intermediate_size}) -> torchtitan-style stacked experts"
    )


def options_from_config(folder: str, source: str | Source | None = None) -> dict[str, Any]:
    """Options from ``config.json`` (``intermediate_size``, ``attention_bias``,
    ``quantization_config``) and from the checkpoint's key names (``lm_head.weight``, MXFP4
    ``*_blocks``), headers only."""
    cfg = read_config(folder, ("config.json",))
    keys = checkpoint_keys(source or folder)
    opts: dict[str, Any] = {}
    if "intermediate_size" in cfg:
        opts["intermediate_size"] = cfg["intermediate_size"]
    if "attention_bias" in cfg:
        opts["attention_bias"] = bool(cfg["attention_bias"])
    tied = tied_from(cfg, keys)
    if tied is not None:
        opts["tie_embeddings"] = tied
    method = _method(quantization_of(cfg, keys))
    if method is not None:
        opts["quantization"] = method
    return opts

