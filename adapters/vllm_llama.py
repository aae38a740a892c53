"""HF transformers Llama -> vLLM's Llama (``LlamaForCausalLM`` of ``vllm/model_executor/models/llama.py``),
laid out for tensor parallelism over ``tp`` ranks.

vLLM's parameters (``named_parameters()`` of its model on each TP rank ``r``)::

    model.embed_tokens.weight                      VocabParallelEmbedding: rows of the vocabulary padded to a
    lm_head.weight                                 multiple of 64 (zero rows), [V_pad / tp, dim] per rank
    model.layers.{i}.self_attn.qkv_proj.weight     QKVParallelLinear: [q_r; k_r; v_r], [(H + 2 KV) * hd / tp, dim]
                                                   (KV < tp: [q_r; k_h; v_h], h = r // (tp / KV), (H / tp + 2) * hd rows)
    model.layers.{i}.self_attn.o_proj.weight       RowParallelLinear: columns, [dim, H * hd / tp]
    model.layers.{i}.mlp.gate_up_proj.weight       MergedColumnParallelLinear: [gate_r; up_r], [2 * hidden / tp, dim]
    model.layers.{i}.mlp.down_proj.weight          RowParallelLinear: columns, [dim, hidden / tp]
    model.layers.{i}.input_layernorm.weight, model.layers.{i}.post_attention_layernorm.weight, model.norm.weight: whole

The adapter (:func:`build`) makes the whole tensors whose row blocks of rank ``r`` are rank
``r``'s shards (fused parts interleaved per rank, :func:`sdadapt.interleave`); :func:`layout`
says which block each rank holds, for :func:`sdadapt.refit_plan`. The rotary rows stay in HF
order (vLLM's ``neox``-style rotary reads them so). Tied embeddings: vLLM's ``lm_head`` is the
embedding itself, so no ``lm_head.weight`` is listed. KV heads fewer than ``tp``: vLLM gives
each rank one KV head, head ``h`` shared by ranks ``[h * tp / KV, (h + 1) * tp / KV)`` (``tp``
must be a multiple of ``KV``); the whole tensor the adapter makes then holds each KV head
``tp / KV`` times, once per rank holding it.
"""

from __future__ import annotations

from typing import Any

from sdadapt.adapters._vllm import ShardLayout, divides

import sdadapt
from sdadapt import Adapter
from sdadapt.errors import AdapterError

SUMMARY = "HF transformers Llama -> vLLM's TP layout (qkv_proj, gate_up_proj per TP rank; vocab padded to 64); for refit"

HF = "model.layers.{i}."
VOCAB_PADDING = 64
"""vLLM's ``DEFAULT_VOCAB_PADDING_SIZE``: the vocabulary is padded to a multiple of it."""

SHARDED = (
    ("self_attn.qkv_proj.weight", 0),
    ("mlp.gate_up_proj.weight", 0),
    ("embed_tokens.weight", 0),
    ("lm_head.weight", 0),
    ("self_attn.o_proj.weight", 1),
    ("mlp.down_proj.weight", 1),
)


def attention_rules(n_heads: int, n_kv_heads: int, head_dim: int, tp: int, adapter: str) -> list[Any]:
    """q/k/v -> ``qkv_proj`` laid out per TP rank (``o_proj`` keeps its name); KV heads fewer
    than ``tp`` are shared by ``tp / n_kv_heads`` ranks each, as vLLM's ``QKVParallelLinear``
    does."""
    divides("n_heads", n_heads, tp, adapter)
    rep = kv_replicas(n_kv_heads, tp, adapter)
    sizes = [n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim]
    qkv = HF + "self_attn.qkv_proj.weight"
    return [
        sdadapt.fuse([HF + f"self_attn.{p}_proj.weight" for p in "qkv"], qkv, sizes=sizes),
        sdadapt.interleave(qkv, sizes=sizes, tp=tp, replicas=[1, rep, rep] if rep > 1 else None),
    ]


def kv_replicas(n_kv_heads: int, tp: int, adapter: str) -> int:
    """How many TP ranks share each KV head: 1 where ``n_kv_heads`` divides by ``tp``, else
    ``tp / n_kv_heads`` (vLLM's ``num_kv_head_replicas``)."""
    if n_kv_heads >= tp:
        divides("n_kv_heads", n_kv_heads, tp, adapter)
        return 1
    if n_kv_heads < 1 or tp % n_kv_heads:
        raise AdapterError(
            f"the {adapter} adapter: TP degree {tp} is not a multiple of n_kv_heads {n_kv_heads}; vLLM shares each KV head "
            "over tp / n_kv_heads ranks and needs that to be whole"
        )
    return tp // n_kv_heads


def vocab_rules(tie_embeddings: bool, tp: int) -> list[Any]:
    """The embedding (and head) padded to vLLM's padded vocabulary; tied: no ``lm_head``."""
    keys = ["model.embed_tokens.weight"] + ([] if tie_embeddings else ["lm_head.weight"])
    rules: list[Any] = [sdadapt.pad(k, dim=0, multiple_of=VOCAB_PADDING) for k in keys]
    if tie_embeddings:
        rules.insert(0, sdadapt.drop("lm_head.weight"))
    return rules


def build(
    *,
    n_heads: int,
    n_kv_heads: int | None = None,
    head_dim: int | None = None,
    dim: int | None = None,
    hidden_dim: int,
    tp: int = 1,
    tie_embeddings: bool = False,
) -> Adapter:
    """The adapter from an HF Llama state dict to vLLM's Llama parameters for ``tp`` ranks.

    ``n_heads``, ``n_kv_heads`` (default ``n_heads``) and ``head_dim`` (default ``dim //
    n_heads``) size the q/k/v parts; ``hidden_dim`` (``intermediate_size``) the gate/up parts.
    Each must divide by ``tp``. ``tie_embeddings``: vLLM shares the embedding as its head (an
    ``lm_head.weight`` given anyway is dropped).
    """
    n_kv_heads = n_kv_heads or n_heads
    if head_dim is None:
        if dim is None:
            raise sdadapt.errors.AdapterError("the vllm_llama adapter needs head_dim or dim")
        head_dim = dim // n_heads
    divides("hidden_dim", hidden_dim, tp, "vllm_llama")
    gate_up = HF + "mlp.gate_up_proj.weight"
    rules = attention_rules(n_heads, n_kv_heads, head_dim, tp, "vllm_llama")
    rules += [
        sdadapt.fuse([HF + "mlp.gate_proj.weight", HF + "mlp.up_proj.weight"], gate_up, sizes=[hidden_dim, hidden_dim]),
        sdadapt.interleave(gate_up, sizes=[hidden_dim, hidden_dim], tp=tp),
        *vocab_rules(tie_embeddings, tp),
    ]
    return Adapter(rules, name="vllm_llama", description=f"HF Llama -> vLLM TP={tp} (n_heads={n_heads}, n_kv_heads={n_kv_heads})")


def layout(tp: int, rank: int) -> ShardLayout:
    """Where TP rank ``rank`` of ``tp``'s vLLM Llama parameters lie in the whole tensors the
    adapter makes: ``layout(key, tensor) -> (global shape, box)``, for ``sdadapt.refit_plan(...,
    engine_layout=layout(tp, rank))``."""
    return ShardLayout(SHARDED, tp, rank)


def parameter_shapes(
    *,
    n_layers: int,
    vocab_size: int,
    dim: int,
    n_heads: int,
    n_kv_heads: int | None = None,
    head_dim: int | None = None,
    hidden_dim: int,
    tp: int = 1,
    tie_embeddings: bool = False,
) -> dict[str, tuple[int, ...]]:
    """The shape of each of vLLM's Llama parameters on one TP rank of ``tp``, as its layers
    create them (what ``named_parameters()`` lists): to build a stand-in engine, or to check a
    real worker's against."""
    n_kv_heads = n_kv_heads or n_heads
    head_dim = head_dim or dim // n_heads
    vocab = -(-vocab_size // VOCAB_PADDING) * VOCAB_PADDING
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab // tp, dim)}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": (dim,),
            p + "self_attn.qkv_proj.weight": ((n_heads // tp + 2 * max(1, n_kv_heads // tp)) * head_dim, dim),
            p + "self_attn.o_proj.weight": (dim, n_heads * head_dim // tp),
            p + "post_attention_layernorm.weight": (dim,),
            p + "mlp.gate_up_proj.weight": (2 * hidden_dim // tp, dim),
            p + "mlp.down_proj.weight": (dim, hidden_dim // tp),
        }
    out["model.norm.weight"] = (dim,)
    if not tie_embeddings:
        out["lm_head.weight"] = (vocab // tp, dim)
    return out
