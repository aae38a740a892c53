"""HF transformers DeepSeek-V3 -> vLLM's DeepSeek-V3 (``DeepseekV3ForCausalLM`` of
``vllm/model_executor/models/deepseek_v2.py``), laid out for tensor (or expert) parallelism.

vLLM's parameters on each rank ``r`` of ``tp`` (MLA with a query LoRA rank, as V3 has)::

    model.layers.{i}.self_attn.fused_qkv_a_proj.weight   [q_lora + kv_lora + rope, dim], whole
                                                         (q_a_proj rows, then kv_a_proj_with_mqa's)
    model.layers.{i}.self_attn.q_a_layernorm.weight, kv_a_layernorm.weight: whole
    model.layers.{i}.self_attn.q_b_proj.weight           ColumnParallelLinear: rows of H / tp heads
    model.layers.{i}.self_attn.kv_b_proj.weight          ColumnParallelLinear: rows of H / tp heads
    model.layers.{i}.self_attn.o_proj.weight             RowParallelLinear: columns
    model.layers.{i}.mlp.gate.weight: whole (the router)
    model.layers.{i}.mlp.gate.e_score_correction_bias   float32, whole; only with ``topk_method: noaux_tc``
                                                         (DeepSeek-V3's routing), else vLLM has none
    model.layers.{i}.mlp.experts.routed_experts.w13_weight / w2_weight  FusedMoE, as in ``vllm_qwen3_moe``
    model.layers.{i}.mlp.shared_experts.gate_up_proj.weight / down_proj.weight: as a dense MLP
    model.layers.{i}.mlp.gate_up_proj.weight / down_proj.weight: the first dense layers

embeddings, norms and head as in ``vllm_llama`` (the vocabulary padded to 64).
"""

from __future__ import annotations

from typing import Any

from sdadapt.adapters._vllm import ShardLayout, config_reader, divides, stacks_experts
from sdadapt.adapters.vllm_llama import HF, SHARDED, vocab_rules
from sdadapt.adapters.vllm_qwen3_moe import FUSED, expert_rules, experts_layout

import sdadapt
from sdadapt import Adapter

SUMMARY = "HF transformers DeepSeek-V3 -> vLLM's TP/EP layout (fused_qkv_a_proj, MLA q_b/kv_b per rank; FusedMoE); for refit"

ATTN = HF + "self_attn."
BIAS = HF + "mlp.gate.e_score_correction_bias"


def _mlp(prefix: str, hidden: int, tp: int) -> list[Any]:
    gate_up = prefix + "gate_up_proj.weight"
    return [
        sdadapt.fuse([prefix + "gate_proj.weight", prefix + "up_proj.weight"], gate_up, sizes=[hidden, hidden]),
        sdadapt.interleave(gate_up, sizes=[hidden, hidden], tp=tp),
    ]


def build(
    *,
    n_heads: int,
    q_lora_rank: int,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    moe_hidden_dim: int,
    hidden_dim: int | None = None,
    n_shared_experts: int = 1,
    n_experts: int | None = None,
    tp: int = 1,
    expert_parallel: bool = False,
    tie_embeddings: bool = False,
    correction_bias: bool = True,
    stacked_experts: bool = False,
) -> Adapter:
    """The adapter from an HF DeepSeek-V3 state dict (unquantized) to vLLM's parameters for
    ``tp`` ranks.

    ``q_lora_rank``, ``kv_lora_rank``, ``qk_rope_head_dim`` size ``fused_qkv_a_proj``;
    ``moe_hidden_dim``: each expert's width; ``n_shared_experts``: the shared experts' width is
    ``n_shared_experts * moe_hidden_dim``; ``hidden_dim``: the dense layers' width (needed when
    some layers are dense). ``expert_parallel``: the experts spread whole over the ``tp`` ranks.
    ``correction_bias``: the engine routes with ``topk_method: noaux_tc`` (DeepSeek-V3's), so it
    holds each router's ``e_score_correction_bias``; ``False``: vLLM has none, and the trainer's
    (transformers always holds one) is dropped. ``stacked_experts``: the trainer holds the routed
    experts as transformers 5 does in memory (``mlp.experts.gate_up_proj`` / ``down_proj``), not
    per expert as the checkpoint files do. :func:`from_config` reads all of these from the
    model's config.
    """
    divides("n_heads", n_heads, tp, "vllm_deepseek_v3")
    if n_experts is not None and expert_parallel:
        divides("n_experts", n_experts, tp, "vllm_deepseek_v3")
    etp = 1 if expert_parallel else tp
    divides("moe_hidden_dim", moe_hidden_dim, etp, "vllm_deepseek_v3")
    rules: list[Any] = [
        sdadapt.fuse([ATTN + "q_a_proj.weight", ATTN + "kv_a_proj_with_mqa.weight"], ATTN + "fused_qkv_a_proj.weight",
                     sizes=[q_lora_rank, kv_lora_rank + qk_rope_head_dim]),  # fmt: skip
        *expert_rules(moe_hidden_dim, n_experts, etp, stacked_experts),
        *_mlp(HF + "mlp.shared_experts.", n_shared_experts * moe_hidden_dim, tp),
    ]
    if hidden_dim is not None:
        divides("hidden_dim", hidden_dim, tp, "vllm_deepseek_v3")
        rules += _mlp(HF + "mlp.", hidden_dim, tp)
    rules += vocab_rules(tie_embeddings, tp)
    if not correction_bias:
        rules.append(sdadapt.drop(BIAS))
    mode = "EP" if expert_parallel else "TP"
    return Adapter(rules, name="vllm_deepseek_v3", description=f"HF DeepSeek-V3 -> vLLM {mode}={tp}")


def config_shape(config: Any, stacked_experts: bool | None = None) -> dict[str, Any]:
    """What :func:`build` needs, read from an HF DeepSeek-V3 config (a ``transformers`` config or
    its ``config.json`` as a dict): ``hidden_dim`` only where the first layers are dense
    (``first_k_dense_replace``), ``correction_bias`` where vLLM routes with ``noaux_tc``.
    ``stacked_experts`` ``None``: as the installed transformers holds a model's experts."""
    get = config_reader(config)
    return dict(n_heads=get("num_attention_heads"), q_lora_rank=get("q_lora_rank"), kv_lora_rank=get("kv_lora_rank"),
                qk_rope_head_dim=get("qk_rope_head_dim"), moe_hidden_dim=get("moe_intermediate_size"),
                hidden_dim=get("intermediate_size") if get("first_k_dense_replace", 0) else None,
                n_shared_experts=get("n_shared_experts") or 0, n_experts=get("n_routed_experts"),
                tie_embeddings=bool(get("tie_word_embeddings", False)), correction_bias=get("topk_method") == "noaux_tc",
                stacked_experts=stacks_experts(stacked_experts))  # fmt: skip


def from_config(config: Any, *, tp: int = 1, expert_parallel: bool = False, stacked_experts: bool | None = None) -> Adapter:
    """:func:`build` with the sizes of an HF DeepSeek-V3 config, for a vLLM engine of ``tp`` ranks.

    Example::

        adapter = vllm_deepseek_v3.from_config(trainer.config, tp=2)
    """
    return build(tp=tp, expert_parallel=expert_parallel, **config_shape(config, stacked_experts))


def layout(tp: int, rank: int, expert_parallel: bool = False) -> ShardLayout:
    """Where rank ``rank`` of ``tp``'s vLLM DeepSeek-V3 parameters lie in the whole tensors the
    adapter makes, for ``sdadapt.refit_plan(..., engine_layout=layout(tp, rank))``."""
    mla = (("self_attn.q_b_proj.weight", 0), ("self_attn.kv_b_proj.weight", 0),
           ("shared_experts.gate_up_proj.weight", 0), ("shared_experts.down_proj.weight", 1))  # fmt: skip
    return ShardLayout(experts_layout(expert_parallel) + mla + SHARDED, tp, rank)


def parameter_shapes(
    *,
    n_layers: int,
    n_dense_layers: int = 0,
    vocab_size: int,
    dim: int,
    n_heads: int,
    q_lora_rank: int,
    kv_lora_rank: int,
    qk_nope_head_dim: int,
    qk_rope_head_dim: int,
    v_head_dim: int,
    moe_hidden_dim: int,
    hidden_dim: int | None = None,
    n_shared_experts: int = 1,
    n_experts: int,
    tp: int = 1,
    expert_parallel: bool = False,
    tie_embeddings: bool = False,
    correction_bias: bool = True,
) -> dict[str, tuple[int, ...]]:
    """The shape of each of vLLM's DeepSeek-V3 parameters on one rank of ``tp`` (the first
    ``n_dense_layers`` dense), as its layers create them; ``correction_bias`` as for
    :func:`build`."""
    vocab = -(-vocab_size // 64) * 64
    h = n_heads // tp
    e, i = (n_experts // tp, moe_hidden_dim) if expert_parallel else (n_experts, moe_hidden_dim // tp)
    shared = n_shared_experts * moe_hidden_dim // tp
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab // tp, dim)}
    for layer in range(n_layers):
        p = f"model.layers.{layer}."
        out |= {
            p + "input_layernorm.weight": (dim,),
            p + "self_attn.fused_qkv_a_proj.weight": (q_lora_rank + kv_lora_rank + qk_rope_head_dim, dim),
            p + "self_attn.q_a_layernorm.weight": (q_lora_rank,),
            p + "self_attn.q_b_proj.weight": (h * (qk_nope_head_dim + qk_rope_head_dim), q_lora_rank),
            p + "self_attn.kv_a_layernorm.weight": (kv_lora_rank,),
            p + "self_attn.kv_b_proj.weight": (h * (qk_nope_head_dim + v_head_dim), kv_lora_rank),
            p + "self_attn.o_proj.weight": (dim, h * v_head_dim),
            p + "post_attention_layernorm.weight": (dim,),
        }
        if layer < n_dense_layers:
            assert hidden_dim is not None, "dense layers need hidden_dim"
            out |= {p + "mlp.gate_up_proj.weight": (2 * hidden_dim // tp, dim), p + "mlp.down_proj.weight": (dim, hidden_dim // tp)}
        else:
            out |= {
                p + "mlp.gate.weight": (n_experts, dim),
                **({p + "mlp.gate.e_score_correction_bias": (n_experts,)} if correction_bias else {}),
                p + FUSED + "w13_weight": (e, 2 * i, dim),
                p + FUSED + "w2_weight": (e, dim, i),
                p + "mlp.shared_experts.gate_up_proj.weight": (2 * shared, dim),
                p + "mlp.shared_experts.down_proj.weight": (dim, shared),
            }
    out["model.norm.weight"] = (dim,)
    if not tie_embeddings:
        out["lm_head.weight"] = (vocab // tp, dim)
    return out
