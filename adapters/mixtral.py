"""HF transformers Mixtral -> Meta-style MoE layout with stacked experts.

Checkpoint, ``experts="per_expert"`` (released Mixtral checkpoints, and what transformers 5.x
``save_pretrained`` still writes)::

    model.layers.{i}.block_sparse_moe.gate.weight                  [E, dim]
    model.layers.{i}.block_sparse_moe.experts.{e}.w1|w3.weight     [hidden, dim]
    model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight        [dim, hidden]

Checkpoint, ``experts="stacked"`` (the in-memory state dict of transformers 5.x
``MixtralForCausalLM``, e.g. a ``torch.save(model.state_dict())``)::

    model.layers.{i}.mlp.gate.weight                               [E, dim]
    model.layers.{i}.mlp.experts.gate_up_proj                      [E, 2*hidden, dim]  ([w1; w3])
    model.layers.{i}.mlp.experts.down_proj                         [E, dim, hidden]

Model (torchtitan-style)::

    layers.{i}.moe.router.gate.weight                              [E, dim]
    layers.{i}.moe.experts.w1|w3                                   [E, hidden, dim]
    layers.{i}.moe.experts.w2                                      [E, dim, hidden]

plus the attention, norms, embeddings and output of the ``llama`` adapter (Meta rotary order).
An expert count that differs is found while planning: the stack rule names the key and both
counts when ``n_experts`` is known (``num_local_experts`` of ``config.json``), else the stacked
key shows as a shape mismatch.
"""

from __future__ import annotations

from typing import Any, Literal

from sdadapt.adapters._common import (
    attention_options,
    attention_rules,
    checkpoint_keys,
    experts_layout,
    head_counts,
    head_dim_of,
    moe_rules,
    read_config,
    top_level_rules,
)

from sdadapt import Adapter
from sdadapt.sources import Source

SUMMARY = "HF transformers Mixtral (per-expert or stacked gate_up_proj) -> Meta-style MoE with stacked experts [E, ...]"


def build(
    *,
    n_heads: int,
    n_kv_heads: int | None = None,
    dim: int | None = None,
    head_dim: int | None = None,
    experts: Literal["per_expert", "stacked"] = "per_expert",
    n_experts: int | None = None,
    tie_embeddings: bool = False,
    fused_qkv: bool = False,
    tp: int | None = None,
) -> Adapter:
    """The adapter from an HF Mixtral checkpoint to the stacked-experts Meta-style layout.

    ``experts`` says how the checkpoint stores the experts (see the module doc). ``n_heads``
    is required, ``n_kv_heads`` defaults to it; ``fused_qkv`` needs ``dim`` or ``head_dim``.
    ``n_experts`` (the config's ``num_local_experts``): the checkpoint must hold exactly that
    many experts per layer, else planning reports the stack rule, the key and both counts.
    """
    n_heads, n_kv_heads = head_counts(n_heads, n_kv_heads, "mixtral")
    head_dim = head_dim_of(dim, n_heads, head_dim, "mixtral")
    rules: list[Any] = top_level_rules(tie_embeddings)
    rules += attention_rules(
        n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, fused_qkv=fused_qkv, tp=tp, adapter="mixtral"
    )
    rules += moe_rules(
        experts, block="block_sparse_moe.", names=("w1", "w2", "w3"), n_experts=n_experts, adapter="mixtral"
    )
    return Adapter(
        rules,
        name="mixtral",
        description=f"HF Mixtral ({experts} experts) -> Meta-style stacked experts (n_heads={n_heads}, n_kv_heads={n_kv_heads})",
    )


def options_from_config(folder: str, source: str | Source | None = None) -> dict[str, Any]:
    """Options from ``config.json`` and from the checkpoint's key names (headers only)."""
    cfg = read_config(folder, ("config.json",))
    keys = checkpoint_keys(source or folder)
    opts = attention_options(cfg, keys)
    if "num_local_experts" in cfg:
        opts["n_experts"] = cfg["num_local_experts"]
    layout = experts_layout(keys)
    if layout is not None:
        opts["experts"] = layout
    return opts
