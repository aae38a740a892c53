"""HF transformers DeepSeek-V3 (and R1, V3.1, Kimi-K2 layouts) -> torchtitan-style MLA + MoE layout.

Checkpoint (the Hub releases, and what transformers 5.x ``save_pretrained`` writes)::

    model.embed_tokens.weight, model.norm.weight, lm_head.weight (absent when tied)
    model.layers.{i}.input_layernorm.weight, model.layers.{i}.post_attention_layernorm.weight
    model.layers.{i}.self_attn.q_proj.weight                        (q_lora_rank null)
    model.layers.{i}.self_attn.q_a_proj|q_a_layernorm|q_b_proj.weight   (q_lora_rank set)
    model.layers.{i}.self_attn.kv_a_proj_with_mqa|kv_a_layernorm|kv_b_proj|o_proj.weight
    dense layers i < first_k_dense_replace:
    model.layers.{i}.mlp.gate_proj|up_proj|down_proj.weight
    MoE layers:
    model.layers.{i}.mlp.gate.weight                                [E, dim]
    model.layers.{i}.mlp.gate.e_score_correction_bias               [E]
    model.layers.{i}.mlp.experts.{e}.gate_proj|up_proj|down_proj.weight    (experts="per_expert")
    model.layers.{i}.mlp.experts.gate_up_proj, .down_proj           (experts="stacked", transformers 5.x state dict)
    model.layers.{i}.mlp.shared_experts.gate_proj|up_proj|down_proj.weight
    MTP (multi-token prediction) layers, indices n_layers .. n_layers + mtp_layers - 1: a whole MoE
    block as above plus embed_tokens, enorm, hnorm, eh_proj, shared_head.norm, shared_head.head

Model::

    tok_embeddings.weight, norm.weight, output.weight
    layers.{i}.attention_norm.weight, layers.{i}.ffn_norm.weight
    layers.{i}.attention.wq.weight  or  layers.{i}.attention.wq_a|q_norm|wq_b.weight
    layers.{i}.attention.wkv_a|kv_norm|wkv_b|wo.weight
    layers.{i}.feed_forward.w1|w2|w3.weight                         (dense layers: gate, down, up)
    layers.{i}.moe.router.gate.weight [E, dim], layers.{i}.moe.expert_bias [E]
    layers.{i}.moe.experts.w1|w3 [E, hidden, dim], layers.{i}.moe.experts.w2 [E, dim, hidden]
    layers.{i}.moe.shared_experts.w1|w2|w3.weight
    with mtp="map": mtp.{j}.block.<the layers.{i}. names above>,
                    mtp.{j}.tok_embeddings|enorm|hnorm|eh_proj|norm|output.weight

Rotary layout: the model keeps DeepSeek's own *interleaved* rotary rows (each rotary pair is two
adjacent rows, rotated as one complex number), as torchtitan's DeepSeek-V3 does. The released
weights are stored that way (transformers reads them with ``rope_interleave: true``, its default),
so they load with no permutation. A checkpoint in HF's "half" order (``rope_interleave: false``)
has the rotary rows of each q head (the last ``qk_rope_head_dim`` rows of the head) and of
``wkv_a`` (its last ``qk_rope_head_dim`` rows) reordered to interleaved: each projection is split
into its per-head no-rope and rope row groups, the rope groups are permuted, and the groups are
fused back (so a TP shard of whole heads reads only its own heads' rows).

MTP layers: ``mtp="drop"`` (default) ignores them on purpose (they are reported as dropped);
``mtp="map"`` maps MTP layer ``j`` to ``mtp.{j}.`` (its decoder block under ``mtp.{j}.block.``,
apart from its own tensors, so that the two sets of names stay disjoint both ways). Either needs ``n_layers`` (the config's
``num_hidden_layers``) to tell the MTP layers from the model's own. ``adapter.inverse()`` exports
back to the HF layout (dropped MTP layers are not written).

FP8 releases (DeepSeek-V3/R1, V3.1 with UE8M0 scales: ``quantization_config`` with
``weight_block_size``, ``*_scale_inv`` keys) are dequantised while loading and re-quantized with
the same blocks by ``adapter.inverse()``: see ``_common.dequant_rules``. The MTP layer's FP8
weights are dequantised only when it is mapped (a dropped layer is never read). Given the
checkpoint (``sdadapt.get_adapter("deepseek_v3", source=...)``), the adapter reads how the
scales are stored from its headers: float32 powers of two (V3.1's ``scale_fmt: ue8m0`` with
``F32`` scales) are written back as float32 powers of two, exponent bytes in their stored
dtype (``scale_dtype``: ``F8_E8M0`` stays ``F8_E8M0``). Built without it
(``build(quantization=...)``), exponent-byte scales are written as ``uint8`` (the same bytes)
unless ``scale_dtype`` is passed, and V3.1's float32 scales need
``scale_format="ue8m0_float32"``.
"""

from __future__ import annotations

from typing import Any, Literal

from sdadapt.adapters._common import (
    HF,
    META,
    Quantization,
    checkpoint_schema,
    dequant_rules,
    experts_layout,
    mlp_rules,
    moe_rules,
    positive,
    quantization_options,
    read_config,
    tied_from,
    top_level_rules,
)

import sdadapt
from sdadapt import Adapter
from sdadapt.errors import AdapterError
from sdadapt.rules import ScaleFormat
from sdadapt.sources import Source

SUMMARY = (
    "HF transformers DeepSeek-V3 -> torchtitan-style MLA (wq or wq_a/q_norm/wq_b, wkv_a/kv_norm/wkv_b, wo; "
    "interleaved rotary rows) + MoE (router, expert_bias, stacked experts, shared experts); MTP dropped or mapped"
)

EXPERT_NAMES = ("gate_proj", "down_proj", "up_proj")
"""The per-expert weight names of the checkpoint, in the order of the model's w1, w2, w3."""

MTP_EXTRAS = {
    "embed_tokens.weight": "tok_embeddings.weight",
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "shared_head.norm.weight": "norm.weight",
    "shared_head.head.weight": "output.weight",
}
"""The tensors of an MTP layer besides its decoder block: checkpoint suffix -> model suffix."""


FP8_KEEP = ("**.eh_proj.weight",)
"""Weights the FP8 releases keep in bf16 beyond ``sdadapt.dequant_rules``' defaults (embeddings,
heads, routers): the MTP layer's ``eh_proj`` (vLLM's DeepSeek MTP layer reads it as a plain,
unquantized linear layer, with no scale)."""


def attention_rules(q_lora: bool, rope_interleave: bool) -> list[Any]:
    """MLA projections and the block's two norms, renamed (rows kept in the checkpoint's order).
    ``rope_interleave=False``: q (``wq``/``wq_b``) and ``wkv_a`` are left to
    :func:`rope_to_interleaved_rules`, which names them."""
    attn = [("kv_a_layernorm", "kv_norm"), ("kv_b_proj", "wkv_b"), ("o_proj", "wo")]
    attn += [("q_a_proj", "wq_a"), ("q_a_layernorm", "q_norm")] if q_lora else []
    if rope_interleave:
        attn += [("kv_a_proj_with_mqa", "wkv_a"), ("q_b_proj", "wq_b") if q_lora else ("q_proj", "wq")]
    rules: list[Any] = [
        sdadapt.rename(HF + "input_layernorm.weight", META + "attention_norm.weight"),
        sdadapt.rename(HF + "post_attention_layernorm.weight", META + "ffn_norm.weight"),
    ]
    for hf, meta in attn:
        rules.append(sdadapt.rename(HF + f"self_attn.{hf}.weight", META + f"attention.{meta}.weight"))
    return rules


def rope_to_interleaved_rules(*, q_lora: bool, n_heads: int, nope: int, rope: int, kv_lora_rank: int) -> list[Any]:
    """For a checkpoint in HF's "half" rotary order: the rope rows of every q head and of
    ``wkv_a`` become interleaved pairs. Each projection is split into its row groups
    (``nope, rope`` per head; ``kv_lora_rank, rope`` for ``wkv_a``), the rope groups permuted
    (one head each), and the groups fused into the model's key."""
    q = ("q_b_proj", "wq_b") if q_lora else ("q_proj", "wq")
    groups = [(q, [nope, rope] * n_heads), (("kv_a_proj_with_mqa", "wkv_a"), [kv_lora_rank, rope])]
    rules: list[Any] = []
    for (hf, meta), sizes in groups:
        key = HF + f"self_attn.{hf}.weight"
        parts = [f"{key}.rope_part{n}" if n % 2 else f"{key}.part{n}" for n in range(len(sizes))]
        rules += [
            sdadapt.split(key, parts, dim=0, sizes=sizes),
            sdadapt.rotary(key + ".rope_part{n:int}", heads=1, to="interleaved"),
            sdadapt.fuse(parts, META + f"attention.{meta}.weight", dim=0, sizes=sizes),
        ]
    return rules


def moe_block_rules(experts: Literal["per_expert", "stacked"], n_experts: int | None) -> list[Any]:
    """Router, experts (``_common.moe_rules``), the routing bias and the shared experts."""
    shared = [("gate_proj", "w1"), ("down_proj", "w2"), ("up_proj", "w3")]
    return [
        *moe_rules(experts, block="mlp.", names=EXPERT_NAMES, n_experts=n_experts, adapter="deepseek_v3"),
        sdadapt.rename(HF + "mlp.gate.e_score_correction_bias", META + "moe.expert_bias"),
        *(
            sdadapt.rename(HF + f"mlp.shared_experts.{hf}.weight", META + f"moe.shared_experts.{meta}.weight")
            for hf, meta in shared
        ),
    ]


def mtp_rules(mtp: Literal["drop", "map"], n_layers: int, mtp_layers: int) -> list[Any]:
    """MTP layers ``n_layers + j``: their decoder blocks were renamed to ``layers.{n_layers + j}.``
    by the block rules (which come first, so that every key is taken by one rule only); here
    they are dropped, or moved to ``mtp.{j}.block.``, with their extra tensors (to ``mtp.{j}.``)."""
    rules: list[Any] = []
    for j in range(mtp_layers):
        hf, block = f"model.layers.{n_layers + j}.", f"layers.{n_layers + j}."
        if mtp == "drop":  # the whole layer, whatever it holds (scales too): see mtp_drop_rules
            continue
        rules.append(sdadapt.rename(block + "{rest:*}", f"mtp.{j}.block.{{rest}}"))
        rules += [sdadapt.rename(hf + src, f"mtp.{j}.{dst}") for src, dst in MTP_EXTRAS.items()]
    return rules


def mtp_drop_rules(n_layers: int, mtp_layers: int) -> list[Any]:
    """``mtp="drop"``: every key under ``model.layers.{n}.`` for the MTP layers
    ``n_layers .. n_layers + mtp_layers - 1`` is dropped, whatever the layer holds (its decoder
    block, its FP8 scales, and the embedding and head that some releases strip from it). These
    rules come first, before the dequantisation and renaming rules, so no other rule sees an MTP
    key."""
    return [sdadapt.drop(f"model.layers.{n_layers + j}.**", shadows=True) for j in range(mtp_layers)]


def build(
    *,
    q_lora: bool = True,
    first_k_dense_replace: int = 0,
    experts: Literal["per_expert", "stacked"] = "per_expert",
    n_experts: int | None = None,
    n_layers: int | None = None,
    mtp_layers: int = 0,
    mtp: Literal["drop", "map"] = "drop",
    rope_interleave: bool = True,
    n_heads: int | None = None,
    qk_nope_head_dim: int | None = None,
    qk_rope_head_dim: int | None = None,
    kv_lora_rank: int | None = None,
    tie_embeddings: bool = False,
    quantization: Quantization = None,
    scale_format: ScaleFormat | None = None,
    scale_dtype: str | None = None,
    dtype: str | None = None,
) -> Adapter:
    """The adapter from an HF DeepSeek-V3 checkpoint to the torchtitan-style layout.

    ``q_lora``: q is low-rank (``q_lora_rank`` set: ``wq_a``/``q_norm``/``wq_b``), else one
    ``wq``. ``first_k_dense_replace``: layers ``0..k-1`` have a dense MLP. ``experts``: how the
    checkpoint stores the routed experts (see the module doc); ``n_experts``
    (``n_routed_experts``) is checked against per-expert keys. ``n_layers``
    (``num_hidden_layers``) and ``mtp_layers``: the checkpoint holds that many MTP layers after the
    model's layers; ``mtp`` drops or maps them. ``rope_interleave=False``: the checkpoint's rotary
    rows are in HF's "half" order and are permuted to interleaved, which needs ``n_heads``,
    ``qk_nope_head_dim``, ``qk_rope_head_dim`` and ``kv_lora_rank``. ``tie_embeddings``: the
    checkpoint has no ``lm_head.weight``. ``quantization``: the checkpoint's
    ``quantization_config`` (``None``: plain weights); an FP8 release is dequantised to the
    model's dtype (``dtype`` pins one), its scales read as ``scale_format`` (default: the config's ``scale_fmt``) and,
    when ``scale_dtype`` is given, required in that dtype, which export writes back.
    """
    k = first_k_dense_replace
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise AdapterError(f"the deepseek_v3 adapter: first_k_dense_replace must be a non-negative integer, got {k!r}")
    if mtp not in ("drop", "map"):
        raise AdapterError(f"the deepseek_v3 adapter: mtp must be 'drop' or 'map', got {mtp!r}")
    if mtp_layers and n_layers is None:
        raise AdapterError(
            "the deepseek_v3 adapter needs n_layers=... (num_hidden_layers) to tell the MTP layers from the model's; "
            "pass it, or give the checkpoint folder (its config.json supplies it)"
        )
    rules: list[Any] = []
    if mtp_layers and mtp == "drop":
        rules += mtp_drop_rules(positive("n_layers", n_layers, "deepseek_v3"), positive("mtp_layers", mtp_layers, "deepseek_v3"))
    rules += dequant_rules(
        quantization, "deepseek_v3", scale_format=scale_format, scale_dtype=scale_dtype, dtype=dtype, keep=FP8_KEEP
    )
    rules += top_level_rules(tie_embeddings)
    rules += attention_rules(q_lora, rope_interleave)
    if not rope_interleave:
        dims = dict(n_heads=n_heads, qk_nope_head_dim=qk_nope_head_dim, qk_rope_head_dim=qk_rope_head_dim,
                    kv_lora_rank=kv_lora_rank)  # fmt: skip
        missing = [name for name, v in dims.items() if v is None]
        if missing:
            raise AdapterError(
                f"the deepseek_v3 adapter with rope_interleave=False needs {', '.join(missing)}; pass them, "
                "or give the checkpoint folder (its config.json supplies them)"
            )
        n, nope, rope, kv = (positive(name, v, "deepseek_v3") for name, v in dims.items())
        rules += rope_to_interleaved_rules(q_lora=q_lora, n_heads=n, nope=nope, rope=rope, kv_lora_rank=kv)
    for i in range(k):
        rules += mlp_rules(f"model.layers.{i}.", f"layers.{i}.")
    rules += moe_block_rules(experts, n_experts)
    if mtp_layers:
        rules += mtp_rules(mtp, positive("n_layers", n_layers, "deepseek_v3"), positive("mtp_layers", mtp_layers, "deepseek_v3"))
    flags = [f"{k} dense", f"{experts} experts", "q_lora" if q_lora else "wq", f"{mtp_layers} MTP ({mtp})" if mtp_layers else ""]
    flags += ["rope half->interleaved" if not rope_interleave else "", "tied" if tie_embeddings else ""]
    return Adapter(rules, name="deepseek_v3", description="HF DeepSeek-V3 -> torchtitan-style layout, " + ", ".join(f for f in flags if f))


def _layer_index(key: str) -> int | None:
    parts = key.split(".")
    if len(parts) > 3 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        return int(parts[2])
    return None


def options_from(cfg: dict[str, Any], keys: list[str]) -> dict[str, Any]:
    """Options from an HF ``config.json`` and the checkpoint's key names (key names win where
    they tell: q_lora, dense layers, expert layout, MTP layers present, tying)."""
    opts: dict[str, Any] = {}
    for name, cfg_name in (("n_layers", "num_hidden_layers"), ("n_experts", "n_routed_experts"),
                           ("n_heads", "num_attention_heads"), ("qk_nope_head_dim", "qk_nope_head_dim"),
                           ("qk_rope_head_dim", "qk_rope_head_dim"), ("kv_lora_rank", "kv_lora_rank"),
                           ("rope_interleave", "rope_interleave")):  # fmt: skip
        if cfg.get(cfg_name) is not None:
            opts[name] = cfg[cfg_name]
    if keys:
        opts["q_lora"] = any(key.endswith("self_attn.q_a_proj.weight") for key in keys)
        dense = {_layer_index(key) for key in keys if key.endswith(".mlp.gate_proj.weight")}
        opts["first_k_dense_replace"] = max((i for i in dense if i is not None), default=-1) + 1
        if "n_layers" in opts:
            indices = {i for i in map(_layer_index, keys) if i is not None}
            opts["mtp_layers"] = len([i for i in indices if i >= opts["n_layers"]])
    else:
        if "q_lora_rank" in cfg:
            opts["q_lora"] = cfg["q_lora_rank"] is not None
        if cfg.get("first_k_dense_replace") is not None:
            opts["first_k_dense_replace"] = cfg["first_k_dense_replace"]
        if cfg.get("num_nextn_predict_layers") is not None:
            opts["mtp_layers"] = cfg["num_nextn_predict_layers"]
    tied = tied_from(cfg, keys)
    if tied is not None:
        opts["tie_embeddings"] = tied
    layout = experts_layout(keys)
    if layout is not None:
        opts["experts"] = layout
    return opts


def options_from_config(folder: str, source: str | Source | None = None) -> dict[str, Any]:
    """Options from the checkpoint's ``config.json`` (HF) and its headers: key names, and the
    quantization with the stored dtype of FP8 scales."""
    cfg, schema = read_config(folder, ("config.json",)), checkpoint_schema(source or folder)
    return options_from(cfg, list(schema)) | quantization_options(cfg, schema)
