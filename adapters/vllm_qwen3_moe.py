"""HF transformers Qwen3-MoE -> vLLM's Qwen3-MoE (``Qwen3MoeForCausalLM`` of
``vllm/model_executor/models/qwen3_moe.py``), laid out for tensor (or expert) parallelism.

vLLM's parameters on each rank ``r`` of ``tp``: attention, embeddings and head as in
``vllm_llama`` (``qkv_proj`` per TP rank, ``o_proj`` by columns, the vocabulary padded to 64),
plus ``self_attn.q_norm.weight`` / ``k_norm.weight`` (whole), and in each MoE layer::

    model.layers.{i}.mlp.gate.weight               ReplicatedLinear router: [E, dim], whole
    model.layers.{i}.mlp.experts.routed_experts.w13_weight   FusedMoE: [E, 2 * I / tp, dim], per expert [gate_r; up_r]
    model.layers.{i}.mlp.experts.routed_experts.w2_weight    FusedMoE: [E, dim, I / tp] (columns of each expert's down)

(vLLM 0.32's names: its ``FusedMoE`` holds them in a ``routed_experts`` submodule; earlier
releases named them ``mlp.experts.w13_weight``.)

With ``expert_parallel=True`` (vLLM's ``enable_expert_parallel``) the experts are not cut: rank
``r`` holds experts ``[r * E / tp, (r + 1) * E / tp)`` whole (``w13_weight`` ``[E / tp, 2 * I,
dim]``, ``w2_weight`` ``[E / tp, dim, I]``). Dense layers (``mlp_only_layers``) keep
``mlp.gate_up_proj`` / ``mlp.down_proj`` as in Llama. KV heads fewer than ``tp`` are shared
as in ``vllm_llama`` (each rank one KV head).
"""

from __future__ import annotations

from typing import Any

from sdadapt.adapters._vllm import ShardLayout, config_reader, divides, stacks_experts
from sdadapt.adapters.vllm_llama import HF, attention_rules, vocab_rules

import sdadapt
from sdadapt import Adapter

SUMMARY = "HF transformers Qwen3-MoE -> vLLM's TP/EP layout (qkv_proj; FusedMoE w13_weight, w2_weight); for refit"

EXPERTS = HF + "mlp.experts."
FUSED = "mlp.experts.routed_experts."
"""Where vLLM 0.32's ``FusedMoE`` keeps its expert weights (its ``RoutedExperts`` submodule)."""


def expert_rules(moe_hidden_dim: int, n_experts: int | None, etp: int, stacked: bool = False) -> list[Any]:
    """HF per-expert ``mlp.experts.{e}.gate_proj|up_proj|down_proj.weight`` -> FusedMoE's
    ``w13_weight`` (per expert ``[gate; up]``, laid out per rank of ``etp``) and ``w2_weight``.
    ``stacked``: the experts as transformers 5 holds them in memory instead, ``mlp.experts.
    gate_up_proj`` ``[E, 2I, dim]`` (per expert ``[gate; up]``) and ``down_proj`` ``[E, dim, I]``."""
    i = moe_hidden_dim
    w13 = HF + FUSED + "w13_weight"
    if stacked:
        return [
            sdadapt.rename(EXPERTS + "gate_up_proj", w13),
            sdadapt.rename(EXPERTS + "down_proj", HF + FUSED + "w2_weight"),
            sdadapt.interleave(w13, sizes=[i, i], tp=etp, dim=1),
        ]
    return [
        sdadapt.stack(EXPERTS + "{e}.gate_proj.weight", EXPERTS + "w1_stacked", over="e", count=n_experts),
        sdadapt.stack(EXPERTS + "{e}.up_proj.weight", EXPERTS + "w3_stacked", over="e", count=n_experts),
        sdadapt.stack(EXPERTS + "{e}.down_proj.weight", HF + FUSED + "w2_weight", over="e", count=n_experts),
        sdadapt.fuse([EXPERTS + "w1_stacked", EXPERTS + "w3_stacked"], w13, dim=1, sizes=[i, i]),
        sdadapt.interleave(w13, sizes=[i, i], tp=etp, dim=1),
    ]


def experts_layout(expert_parallel: bool) -> tuple[tuple[str, int], ...]:
    """The FusedMoE weights' sharded dims: experts (EP) or the intermediate dim (TP)."""
    if expert_parallel:
        return (("experts.w13_weight", 0), ("experts.w2_weight", 0))
    return (("experts.w13_weight", 1), ("experts.w2_weight", 2))


def build(
    *,
    n_heads: int,
    n_kv_heads: int | None = None,
    head_dim: int,
    moe_hidden_dim: int,
    hidden_dim: int | None = None,
    n_experts: int | None = None,
    tp: int = 1,
    expert_parallel: bool = False,
    tie_embeddings: bool = False,
    stacked_experts: bool = False,
    qkv_bias: bool = False,
) -> Adapter:
    """The adapter from an HF Qwen3-MoE state dict to vLLM's parameters.

    ``moe_hidden_dim``: each expert's width ``I`` (``moe_intermediate_size``); ``hidden_dim``:
    the dense layers' (``intermediate_size``), needed only when some layers are dense;
    ``n_experts``: checked against the experts found. ``tp``: the TP degree; with
    ``expert_parallel`` the experts are spread over the ``tp`` ranks whole instead of cut.
    ``stacked_experts``: the trainer holds the experts as transformers 5 does in memory
    (``mlp.experts.gate_up_proj`` / ``down_proj``, 3-D), not per expert as the checkpoint files
    (and transformers 4) do. ``qkv_bias``: q/k/v have biases (``attention_bias``).
    """
    n_kv_heads = n_kv_heads or n_heads
    ep = tp if expert_parallel else 1
    etp = 1 if expert_parallel else tp
    if n_experts is not None:
        divides("n_experts", n_experts, ep, "vllm_qwen3_moe")
    divides("moe_hidden_dim", moe_hidden_dim, etp, "vllm_qwen3_moe")
    rules: list[Any] = attention_rules(n_heads, n_kv_heads, head_dim, tp, "vllm_qwen3_moe", qkv_bias)
    rules += expert_rules(moe_hidden_dim, n_experts, etp, stacked_experts)
    if hidden_dim is not None:
        divides("hidden_dim", hidden_dim, tp, "vllm_qwen3_moe")
        gate_up = HF + "mlp.gate_up_proj.weight"
        rules += [
            sdadapt.fuse([HF + "mlp.gate_proj.weight", HF + "mlp.up_proj.weight"], gate_up, sizes=[hidden_dim, hidden_dim]),
            sdadapt.interleave(gate_up, sizes=[hidden_dim, hidden_dim], tp=tp),
        ]
    rules += vocab_rules(tie_embeddings, tp)
    mode = "EP" if expert_parallel else "TP"
    return Adapter(rules, name="vllm_qwen3_moe", description=f"HF Qwen3-MoE -> vLLM {mode}={tp}")


def config_shape(config: Any, stacked_experts: bool | None = None) -> dict[str, Any]:
    """What :func:`build` needs, read from an HF Qwen3-MoE config (a ``transformers`` config or
    its ``config.json`` as a dict). ``stacked_experts`` ``None``: as the installed transformers
    holds a model's experts in memory (stacked from transformers 5 on)."""
    get = config_reader(config)
    stacked_experts = stacks_experts(stacked_experts)
    dense = bool(get("mlp_only_layers")) or (get("decoder_sparse_step") or 1) > 1
    n_heads = get("num_attention_heads")
    return dict(n_heads=n_heads, n_kv_heads=get("num_key_value_heads") or n_heads,
                head_dim=get("head_dim") or get("hidden_size") // n_heads, moe_hidden_dim=get("moe_intermediate_size"),
                hidden_dim=get("intermediate_size") if dense else None, n_experts=get("num_experts"),
                tie_embeddings=bool(get("tie_word_embeddings", False)), stacked_experts=stacked_experts,
                qkv_bias=bool(get("attention_bias", False)))  # fmt: skip


def from_config(config: Any, *, tp: int = 1, expert_parallel: bool = False, stacked_experts: bool | None = None) -> Adapter:
    """:func:`build` with the sizes of an HF Qwen3-MoE config, for a vLLM engine of ``tp`` ranks.

    Example::

        adapter = vllm_qwen3_moe.from_config(trainer.config, tp=2)
    """
    return build(tp=tp, expert_parallel=expert_parallel, **config_shape(config, stacked_experts))


def layout(tp: int, rank: int, expert_parallel: bool = False) -> ShardLayout:
    """Where rank ``rank`` of ``tp``'s vLLM Qwen3-MoE parameters lie in the whole tensors the
    adapter makes, for ``sdadapt.refit_plan(..., engine_layout=layout(tp, rank))``."""
    from sdadapt.adapters.vllm_llama import SHARDED

    return ShardLayout(experts_layout(expert_parallel) + SHARDED, tp, rank)


def parameter_shapes(
    *,
    n_layers: int,
    vocab_size: int,
    dim: int,
    n_heads: int,
    n_kv_heads: int | None = None,
    head_dim: int,
    moe_hidden_dim: int,
    n_experts: int,
    tp: int = 1,
    expert_parallel: bool = False,
    tie_embeddings: bool = False,
) -> dict[str, tuple[int, ...]]:
    """The shape of each of vLLM's Qwen3-MoE parameters on one rank of ``tp`` (every layer a
    MoE layer), as its layers create them: to build a stand-in engine, or to check a real
    worker's against."""
    from sdadapt.adapters.vllm_llama import parameter_shapes as llama_shapes

    base = llama_shapes(n_layers=n_layers, vocab_size=vocab_size, dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads,
                        head_dim=head_dim, hidden_dim=tp, tp=tp, tie_embeddings=tie_embeddings)  # fmt: skip
    e, i = (n_experts // tp, moe_hidden_dim) if expert_parallel else (n_experts, moe_hidden_dim // tp)
    out: dict[str, tuple[int, ...]] = {}
    for k, v in base.items():
        if k.endswith(("mlp.gate_up_proj.weight", "mlp.down_proj.weight")):
            continue
        out[k] = v
        if k.endswith("self_attn.o_proj.weight"):
            p = k.removesuffix("self_attn.o_proj.weight")
            out |= {
                p + "self_attn.q_norm.weight": (head_dim,),
                p + "self_attn.k_norm.weight": (head_dim,),
                p + "mlp.gate.weight": (n_experts, dim),
                p + FUSED + "w13_weight": (e, 2 * i, dim),
                p + FUSED + "w2_weight": (e, dim, i),
            }
    return out
