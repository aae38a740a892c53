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

from sdadapt.adapters._vllm import ShardLayout, config_reader, divides

import sdadapt
from sdadapt import Adapter
from sdadapt.errors import AdapterError

SUMMARY = "HF transformers Llama -> vLLM's TP layout (qkv_proj, gate_up_proj per TP rank; vocab padded to 64); for refit"

HF = "model.layers.{i}."
VOCAB_PADDING = 64
"""vLLM's ``DEFAULT_VOCAB_PADDING_SIZE``: the vocabulary is padded to a multiple of it."""

SHARDED = (
    ("self_attn.qkv_proj.weight", 0),
    ("self_attn.qkv_proj.bias", 0),
    ("mlp.gate_up_proj.weight", 0),
    ("mlp.gate_up_proj.bias", 0),
    ("embed_tokens.weight", 0),
    ("lm_head.weight", 0),
    ("self_attn.o_proj.weight", 1),
    ("mlp.down_proj.weight", 1),
)


def attention_rules(n_heads: int, n_kv_heads: int, head_dim: int, tp: int, adapter: str, qkv_bias: bool = False) -> list[Any]:
    """q/k/v -> ``qkv_proj`` laid out per TP rank (``o_proj`` keeps its name); KV heads fewer
    than ``tp`` are shared by ``tp / n_kv_heads`` ranks each, as vLLM's ``QKVParallelLinear``
    does. ``qkv_bias``: the q/k/v biases fuse and are laid out as the weights (Qwen2's)."""
    divides("n_heads", n_heads, tp, adapter)
    rep = kv_replicas(n_kv_heads, tp, adapter)
    sizes = [n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim]
    kinds = ("weight", "bias") if qkv_bias else ("weight",)
    rules: list[Any] = [
        sdadapt.fuse([HF + f"self_attn.{p}_proj.{kind}" for p in "qkv"], HF + f"self_attn.qkv_proj.{kind}", sizes=sizes) for kind in kinds
    ]
    qkv = [HF + f"self_attn.qkv_proj.{kind}" for kind in kinds]
    rules.append(sdadapt.interleave(qkv if qkv_bias else qkv[0], sizes=sizes, tp=tp, replicas=[1, rep, rep] if rep > 1 else None))
    return rules


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
    qkv_bias: bool = False,
    mlp_bias: bool = False,
    o_bias: bool = False,
    qk_norm: bool = False,
) -> Adapter:
    """The adapter from an HF Llama state dict to vLLM's Llama parameters for ``tp`` ranks.

    ``n_heads``, ``n_kv_heads`` (default ``n_heads``) and ``head_dim`` (default ``dim //
    n_heads``) size the q/k/v parts; ``hidden_dim`` (``intermediate_size``) the gate/up parts.
    Each must divide by ``tp`` (KV heads may be fewer than ``tp``). ``tie_embeddings``: vLLM
    shares the embedding as its head (an ``lm_head.weight`` given anyway is dropped).
    ``qkv_bias``: q/k/v have biases (Qwen2; Llama's ``attention_bias``), fused into
    ``qkv_proj.bias`` as the weights; ``o_proj.bias`` (Llama's ``attention_bias``) keeps its
    name. ``mlp_bias``: gate/up biases fuse into ``gate_up_proj.bias``. ``o_bias`` (``o_proj``
    has a bias) and ``qk_norm`` (Qwen3's ``q_norm`` / ``k_norm``) need no rule, their tensors
    keep their names; they are taken so that :func:`config_shape`'s reading serves this and
    :func:`parameter_shapes` alike. :func:`from_config` reads all of these from the model's config.
    """
    n_kv_heads = n_kv_heads or n_heads
    if head_dim is None:
        if dim is None:
            raise sdadapt.errors.AdapterError("the vllm_llama adapter needs head_dim or dim")
        head_dim = dim // n_heads
    divides("hidden_dim", hidden_dim, tp, "vllm_llama")
    rules = attention_rules(n_heads, n_kv_heads, head_dim, tp, "vllm_llama", qkv_bias)
    rules += mlp_rules(hidden_dim, tp, mlp_bias)
    rules += vocab_rules(tie_embeddings, tp)
    return Adapter(rules, name="vllm_llama", description=f"HF Llama -> vLLM TP={tp} (n_heads={n_heads}, n_kv_heads={n_kv_heads})")


def mlp_rules(hidden_dim: int, tp: int, bias: bool = False) -> list[Any]:
    """gate/up -> ``gate_up_proj`` laid out per TP rank (and their biases with ``bias``)."""
    kinds = ("weight", "bias") if bias else ("weight",)
    sizes = [hidden_dim, hidden_dim]
    rules: list[Any] = [
        sdadapt.fuse([HF + f"mlp.gate_proj.{k}", HF + f"mlp.up_proj.{k}"], HF + f"mlp.gate_up_proj.{k}", sizes=sizes) for k in kinds
    ]
    fused = [HF + f"mlp.gate_up_proj.{k}" for k in kinds]
    rules.append(sdadapt.interleave(fused if bias else fused[0], sizes=sizes, tp=tp))
    return rules


def config_shape(config: Any) -> dict[str, Any]:
    """What :func:`build` and :func:`parameter_shapes` need, read from an HF config (a
    ``transformers`` config or its ``config.json`` as a dict) of a Llama-like decoder: Llama,
    Mistral, Qwen2 (q/k/v biases), Qwen3 (``q_norm`` / ``k_norm``, which keep their names)."""
    get = config_reader(config)
    n_heads = get("num_attention_heads")
    head_dim = get("head_dim") or get("hidden_size") // n_heads
    model_type = get("model_type", "")
    # vLLM's Llama: attention_bias (or Smaug's bias) gives q/k/v and o_proj biases, InternLM3's
    # qkv_bias overrides q/k/v's; Qwen2: q/k/v biases always, Qwen3: as attention_bias; neither an o_proj bias
    attention_bias = bool(get("attention_bias", False)) or (model_type not in ("qwen2", "qwen3") and bool(get("bias", False)))
    qkv_bias = get("qkv_bias")
    if qkv_bias is None:
        qkv_bias = model_type == "qwen2" or attention_bias
    o_bias = model_type not in ("qwen2", "qwen3") and attention_bias
    return dict(n_heads=n_heads, n_kv_heads=get("num_key_value_heads") or n_heads, head_dim=head_dim,
                hidden_dim=get("intermediate_size"), tie_embeddings=bool(get("tie_word_embeddings", False)),
                qkv_bias=bool(qkv_bias), mlp_bias=bool(get("mlp_bias", False)), o_bias=o_bias,
                qk_norm=model_type == "qwen3")  # fmt: skip


def from_config(config: Any, *, tp: int = 1) -> Adapter:
    """:func:`build` with the sizes, biases and tied embeddings of an HF config (Llama, Mistral,
    Qwen2, Qwen3, or a dict of their ``config.json``), for a vLLM engine of ``tp`` ranks.

    Example::

        adapter = vllm_llama.from_config(trainer.config, tp=2)
    """
    return build(tp=tp, **config_shape(config))


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
    qkv_bias: bool = False,
    mlp_bias: bool = False,
    o_bias: bool = False,
    qk_norm: bool = False,
) -> dict[str, tuple[int, ...]]:
    """The shape of each of vLLM's Llama parameters on one TP rank of ``tp``, as its layers
    create them (what ``named_parameters()`` lists): to build a stand-in engine, or to check a
    real worker's against. The arguments as :func:`build`'s; ``o_bias``: ``o_proj`` has a bias
    (Llama's ``attention_bias``; whole on every rank, as ``down_proj.bias`` with ``mlp_bias``);
    ``qk_norm``: each layer has Qwen3's ``q_norm`` / ``k_norm`` (``[head_dim]``, whole)."""
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
        qkv_rows = out[p + "self_attn.qkv_proj.weight"][0]
        if qkv_bias:
            out[p + "self_attn.qkv_proj.bias"] = (qkv_rows,)
        if o_bias:
            out[p + "self_attn.o_proj.bias"] = (dim,)
        if qk_norm:
            out |= {p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,)}
        if mlp_bias:
            out |= {p + "mlp.gate_up_proj.bias": (2 * hidden_dim // tp,), p + "mlp.down_proj.bias": (dim,)}
    out["model.norm.weight"] = (dim,)
    if not tie_embeddings:
        out["lm_head.weight"] = (vocab // tp, dim)
    return out
