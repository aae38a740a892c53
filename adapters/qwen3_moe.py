"""HF transformers Qwen3-MoE -> torchtitan-style MoE layout with stacked experts.

Attention, norms, embeddings and output as in the ``qwen3`` adapter (HF rotary order kept,
``q_norm``/``k_norm``). MoE layers, checkpoint with ``experts="per_expert"`` (the Hub releases,
and what transformers 5.x ``save_pretrained`` writes)::

    model.layers.{i}.mlp.gate.weight                                [E, dim]
    model.layers.{i}.mlp.experts.{e}.gate_proj|up_proj.weight       [hidden, dim]
    model.layers.{i}.mlp.experts.{e}.down_proj.weight               [dim, hidden]

with ``experts="stacked"`` (the state dict of transformers 5.x ``Qwen3MoeForCausalLM``, e.g. saved
with ``safetensors.torch.save_file(model.state_dict())`` or ``torch.save``)::

    model.layers.{i}.mlp.gate.weight                                [E, dim]
    model.layers.{i}.mlp.experts.gate_up_proj                       [E, 2*hidden, dim]  (gate; up)
    model.layers.{i}.mlp.experts.down_proj                          [E, dim, hidden]

Model::

    layers.{i}.moe.router.gate.weight                               [E, dim]
    layers.{i}.moe.experts.w1|w3                                    [E, hidden, dim]  (gate, up)
    layers.{i}.moe.experts.w2                                       [E, dim, hidden]  (down)

Dense layers (``mlp_only_layers``, or every layer ``i`` with ``(i + 1) % decoder_sparse_step``
non-zero) keep ``model.layers.{i}.mlp.gate_proj|up_proj|down_proj.weight`` ->
``layers.{i}.feed_forward.w1|w3|w2.weight``; ``dense_layers`` lists them (from the checkpoint's
key names when it has them, else from ``config.json``), one rename per listed layer, so a
listed layer that has experts in the checkpoint is a planning error naming that layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from sdadapt.adapters._common import (
    Quantization,
    checkpoint_schema,
    dequant_rules,
    experts_layout,
    mlp_rules,
    moe_rules,
    quantization_options,
    read_config,
    top_level_rules,
)
from sdadapt.adapters.qwen3 import attention_rules, dense_options

from sdadapt import Adapter
from sdadapt.errors import AdapterError
from sdadapt.rules import ScaleFormat
from sdadapt.sources import Source

SUMMARY = (
    "HF transformers Qwen3-MoE (per-expert or stacked gate_up_proj) -> torchtitan-style MoE with stacked experts [E, ...]; "
    "dense mlp_only layers"
)

EXPERT_NAMES = ("gate_proj", "down_proj", "up_proj")
"""The per-expert weight names of the checkpoint, in the order of the model's w1, w2, w3."""


def build(
    *,
    experts: Literal["per_expert", "stacked"] = "per_expert",
    n_experts: int | None = None,
    dense_layers: Sequence[int] = (),
    tie_embeddings: bool = False,
    attention_bias: bool = False,
    quantization: Quantization = None,
    scale_format: ScaleFormat | None = None,
    scale_dtype: str | None = None,
    dtype: str | None = None,
) -> Adapter:
    """The adapter from an HF Qwen3-MoE checkpoint to the stacked-experts layout.

    ``experts`` says how the checkpoint stores the experts (see the module doc). ``n_experts``
    (the config's ``num_experts``): the checkpoint must hold exactly that many experts per
    per-expert layer. ``dense_layers``: indices of the layers with a dense MLP instead of
    experts. ``tie_embeddings``, ``attention_bias``, ``quantization``, ``scale_format``,
    ``scale_dtype`` and ``dtype`` as in ``qwen3`` (FP8 scales keep their stored dtype on
    export when the adapter is given the checkpoint; see the ``qwen3`` module doc).
    """
    dense = _layer_indices(dense_layers)
    rules: list[Any] = dequant_rules(quantization, "qwen3_moe", scale_format=scale_format, scale_dtype=scale_dtype, dtype=dtype)
    rules += top_level_rules(tie_embeddings)
    rules += attention_rules(attention_bias)
    rules += moe_rules(experts, block="mlp.", names=EXPERT_NAMES, n_experts=n_experts, adapter="qwen3_moe")
    for i in dense:
        rules += mlp_rules(f"model.layers.{i}.", f"layers.{i}.")
    return Adapter(
        rules,
        name="qwen3_moe",
        description=f"HF Qwen3-MoE ({experts} experts, dense layers {list(dense)}) -> torchtitan-style stacked experts",
    )


def _layer_indices(layers: Sequence[int]) -> tuple[int, ...]:
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
        raise AdapterError(f"the qwen3_moe adapter: dense_layers must be a list of layer indices, got {layers!r}")
    bad = [i for i in layers if not isinstance(i, int) or isinstance(i, bool) or i < 0]
    if bad:
        raise AdapterError(f"the qwen3_moe adapter: dense_layers must be non-negative integers, got {list(layers)!r}")
    return tuple(sorted(set(layers)))


def dense_layers_from(cfg: dict[str, Any], keys: list[str]) -> list[int] | None:
    """Indices of the dense (non-MoE) layers: the layers whose ``mlp.gate_proj.weight`` the
    checkpoint holds, when its key names are known; else transformers' rule on ``config.json``
    (``mlp_only_layers``, ``decoder_sparse_step``, ``num_experts``); ``None`` when neither says."""
    if keys:
        prefix, suffix = "model.layers.", ".mlp.gate_proj.weight"
        found = {k[len(prefix) : -len(suffix)] for k in keys if k.startswith(prefix) and k.endswith(suffix)}
        return sorted(int(i) for i in found if i.isdigit())
    if "num_hidden_layers" not in cfg:
        return None
    only = set(cfg.get("mlp_only_layers") or [])
    step = cfg.get("decoder_sparse_step") or 1
    n_experts = cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0
    return [i for i in range(cfg["num_hidden_layers"]) if i in only or not (n_experts > 0 and (i + 1) % step == 0)]


def options_from_config(folder: str, source: str | Source | None = None) -> dict[str, Any]:
    """Options from ``config.json`` and from the checkpoint's headers (key names; quantization)."""
    cfg = read_config(folder, ("config.json",))
    schema = checkpoint_schema(source or folder)
    keys = list(schema)
    opts = dense_options(cfg, keys) | quantization_options(cfg, schema)
    n_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if n_experts is not None:
        opts["n_experts"] = n_experts
    dense = dense_layers_from(cfg, keys)
    if dense is not None:
        opts["dense_layers"] = dense
    layout = experts_layout(keys)
    if layout is not None:
        opts["experts"] = layout
    return opts
