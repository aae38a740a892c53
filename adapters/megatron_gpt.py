"""Megatron-Core ``GPTModel`` checkpoints (``torch_dist``) -> HF transformers names.

A ``torch_dist`` checkpoint is a DCP folder whose keys are Megatron's global names, whatever TP /
PP / EP degree wrote it (``sdadapt.sources.read_megatron_common`` reads its ``common.pt``). By
default (``layers="stacked"``) every decoder layer's tensor is stacked under one key with a
leading layer axis; a save with ``singleton_local_shards`` (``layers="per_layer"``) keeps one
key per layer and per expert::

    embedding.word_embeddings.weight                         -> model.embed_tokens.weight
    decoder.final_layernorm.weight                           -> model.norm.weight
    output_layer.weight (absent when tied)                   -> lm_head.weight
    decoder.layers.self_attention.linear_qkv.weight [L, (nh + 2 ng) hd, H]
        rows per query group g: [q heads of g; k_g; v_g]     -> self_attn.q_proj / k_proj / v_proj
    ....linear_qkv.layer_norm_weight [L, H]                  -> input_layernorm.weight
    ....q_layernorm.weight / k_layernorm.weight [L, hd]      -> self_attn.q_norm / k_norm.weight
    ....linear_proj.weight                                   -> self_attn.o_proj.weight
    decoder.layers.mlp.linear_fc1.layer_norm_weight          -> post_attention_layernorm.weight
    decoder.layers.mlp.linear_fc1.weight [L, 2 F, H] (gate; up; or weight_w / weight_v)
                                                             -> mlp.gate_proj / up_proj.weight
    decoder.layers.mlp.linear_fc2.weight                     -> mlp.down_proj.weight
    decoder.layers.mlp.router.weight [L, E, H]               -> mlp.gate.weight
    decoder.layers.mlp.router.expert_bias [L, E]             -> mlp.gate.e_score_correction_bias
    decoder.layers.mlp.experts.experts.linear_fc1.weight [L, E, 2 F, H]   (experts="stacked")
    decoder.layers.{i}.mlp.experts.experts.{e}.linear_fc1.weight_w|_v     (experts="per_expert")
    decoder.layers.mlp.experts.experts.linear_fc2.weight [L, E, H, F]
        -> mlp.experts.{e}.gate_proj|up_proj|down_proj.weight (experts_to="per_expert", the Hub's layout)
        or mlp.experts.gate_up_proj [E, 2 F, H], mlp.experts.down_proj [E, H, F] (experts_to="stacked":
           transformers 5's Qwen3-MoE / Mixtral modules)

Megatron's rotary is HF's (rotate-half) unless ``rotary_interleaved``: no row permutation. The
``_extra_state`` entries (Transformer Engine's FP8 scaling state; empty for a model without FP8)
have no place in an HF model: :func:`options_from_config` reads each one first and refuses a
checkpoint where one holds state or cannot be read (``extra_state="drop"`` drops them anyway).
``to="titan"`` continues with the shipped ``llama`` / ``qwen3`` / ``qwen3_moe`` adapter onto the
torchtitan-style layout. ``adapter.inverse()`` writes Megatron's names back (``sdadapt.export``).
"""

from __future__ import annotations

import io
import os
import re
from typing import Any, Literal

import torch

import sdadapt
from sdadapt import Adapter
from sdadapt.errors import AdapterError
from sdadapt.sources import Source, read_megatron_common

SUMMARY = (
    "Megatron-Core GPTModel torch_dist checkpoints (GQA query groups, SwiGLU, RMSNorm, rotary, tied; MoE experts stacked "
    "or per expert, router and expert bias) -> HF transformers names"
)

FORMAT = "torch_dist"
"""What ``sdadapt.export(model, dst, "megatron_gpt")`` writes when no ``format`` is given."""
D = "decoder.layers.{i}."
H = "model.layers.{i}."
ATTN = "self_attention."
SEEN_BACKENDS = {("torch_dist", 1, "torch", 1)}
"""(sharded backend, version, common backend, version) of the checkpoints this adapter has seen."""
SEEN_CHECKPOINT_VERSIONS = (3.0,)
"""Megatron-LM's ``checkpoint_version`` values whose layout this adapter has seen (megatron-core 0.16)."""

_PER_LAYER_NAMES = (
    "self_attention.linear_qkv.weight", "self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_proj.weight",
    "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight", "mlp.linear_fc1.layer_norm_weight",
    "mlp.linear_fc1.weight", "mlp.linear_fc1.weight_w", "mlp.linear_fc1.weight_v", "mlp.linear_fc2.weight",
    "mlp.router.weight", "mlp.router.expert_bias", "mlp.experts.experts.linear_fc1.weight",
    "mlp.experts.experts.linear_fc2.weight", "mlp.experts.experts.{e}.linear_fc1.weight",
    "mlp.experts.experts.{e}.linear_fc1.weight_w", "mlp.experts.experts.{e}.linear_fc1.weight_v",
    "mlp.experts.experts.{e}.linear_fc2.weight",
)  # fmt: skip
"""The per-layer tensors this adapter knows (after ``decoder.layers.`` or ``decoder.layers.{i}.``)."""
_TOP = ("embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight")
_TE_GROUPED = re.compile(r"mlp\.experts\.linear_fc[12]\.(weight|bias)\d+$")
"""Transformer Engine's grouped experts by module name (``TEGroupedMLP``'s ``weight0..N``)."""
_EXTRA = re.compile(r"^(.*)\._extra_state(/shard_[0-9._]+)?$")


def build(
    *,
    n_heads: int,
    n_query_groups: int | None = None,
    head_dim: int | None = None,
    layers: Literal["stacked", "per_layer"] = "stacked",
    fc1: Literal["fused", "split"] = "fused",
    experts: Literal["stacked", "per_expert"] | None = None,
    experts_to: Literal["per_expert", "stacked"] = "per_expert",
    n_experts: int | None = None,
    tie_embeddings: bool = False,
    extra_state: str = "check",
    to: Literal["hf", "titan"] = "hf",
    qk_layernorm: bool = False,
    expert_bias: bool = False,
) -> Adapter:
    """The adapter from a Megatron-Core GPT checkpoint to HF transformers names.

    ``n_heads`` (attention heads), ``n_query_groups`` (default ``n_heads``: no GQA) and
    ``head_dim`` split the fused QKV rows per query group. ``layers``: the checkpoint stacks each
    layer's tensor under one key (``"stacked"``, Megatron's default) or keeps a key per layer
    (``"per_layer"``, a save with ``singleton_local_shards``). ``fc1``: ``linear_fc1.weight`` holds
    gate and up (``"fused"``) or ``weight_w`` / ``weight_v`` hold them (``"split"``). ``experts``:
    ``None`` for a dense model, else how the checkpoint holds them (one ``[E, ...]`` tensor per layer,
    or a key per expert); ``experts_to``: the HF layout written (``"per_expert"``: the Hub's keys;
    ``"stacked"``: transformers 5's fused ``gate_up_proj`` / ``down_proj``); ``n_experts`` is checked
    against the checkpoint. ``tie_embeddings``: no ``output_layer.weight``; ``lm_head.weight`` is
    the embeddings. ``qk_layernorm``: the layers hold ``q_layernorm`` / ``k_layernorm`` (Qwen3's
    ``q_norm`` / ``k_norm``); ``expert_bias``: the routers hold ``expert_bias``.
    ``extra_state="none"``: the checkpoint holds no ``_extra_state`` entries; ``"drop"`` drops
    them without the check of :func:`options_from_config` (which passes any other value: its
    refusal, raised here unless ``extra_state="drop"`` overrides it). ``to="titan"``: continue with the shipped ``llama``, ``qwen3``
    (``qk_layernorm``) or ``qwen3_moe`` adapter onto the torchtitan-style names.
    """
    nh = _positive("n_heads", n_heads)
    ng = _positive("n_query_groups", n_query_groups if n_query_groups is not None else nh)
    if nh % ng:
        raise AdapterError(
            f"the megatron_gpt adapter: n_heads={nh} is not a multiple of n_query_groups={ng}: each query group holds "
            "n_heads / n_query_groups query heads; pass the model's num_query_groups"
        )
    hd = _positive("head_dim", head_dim) if head_dim is not None else None
    if n_experts is not None:
        _positive("n_experts", n_experts)
    for name, value, allowed in (
        ("layers", layers, ("stacked", "per_layer")), ("fc1", fc1, ("fused", "split")),
        ("experts", experts, ("stacked", "per_expert", None)), ("experts_to", experts_to, ("per_expert", "stacked")),
        ("to", to, ("hf", "titan")),
    ):  # fmt: skip
        if value not in allowed:
            raise AdapterError(f"the megatron_gpt adapter: {name} must be one of {allowed}, got {value!r}")
    if extra_state not in ("check", "drop", "none"):
        raise AdapterError(extra_state)
    if hd is None:
        raise AdapterError(
            "the megatron_gpt adapter needs head_dim (Megatron's kv_channels) to split the fused QKV rows; pass "
            "head_dim=..., or the checkpoint folder whose common.pt records it"
        )
    names = _layer_names(fc1, experts, qk_layernorm, expert_bias)
    rules: list[Any] = [] if extra_state == "none" else [sdadapt.drop("**._extra_state{s:*}")]
    if layers == "stacked":
        rules += [sdadapt.unstack("decoder.layers." + n, D + n, over="i") for n in names]
    rules += [
        sdadapt.rename("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
        sdadapt.rename("decoder.final_layernorm.weight", "model.norm.weight"),
        sdadapt.tie("lm_head.weight", "model.embed_tokens.weight")
        if tie_embeddings
        else sdadapt.rename("output_layer.weight", "lm_head.weight"),
        sdadapt.rename(D + ATTN + "linear_qkv.layer_norm_weight", H + "input_layernorm.weight"),
        sdadapt.rename(D + ATTN + "linear_proj.weight", H + "self_attn.o_proj.weight"),
        sdadapt.rename(D + "mlp.linear_fc1.layer_norm_weight", H + "post_attention_layernorm.weight"),
    ]
    if qk_layernorm:
        rules += [
            sdadapt.rename(D + ATTN + "q_layernorm.weight", H + "self_attn.q_norm.weight"),
            sdadapt.rename(D + ATTN + "k_layernorm.weight", H + "self_attn.k_norm.weight"),
        ]
    sizes = [nh * hd, ng * hd, ng * hd]
    qkv = D + ATTN + "linear_qkv.weight"
    rules += [
        sdadapt.deinterleave(qkv, sizes=sizes, tp=ng),
        sdadapt.split(qkv, [H + "self_attn.q_proj.weight", H + "self_attn.k_proj.weight", H + "self_attn.v_proj.weight"],
                      sizes=sizes),
    ]
    if experts is None:
        rules += _mlp_rules(D + "mlp.", H + "mlp.", fc1)
    else:
        rules.append(sdadapt.rename(D + "mlp.router.weight", H + "mlp.gate.weight"))
        if expert_bias:
            rules.append(sdadapt.rename(D + "mlp.router.expert_bias", H + "mlp.gate.e_score_correction_bias"))
        rules += _expert_rules(experts, experts_to, fc1 if experts == "per_expert" else "fused", n_experts)
    adapter = Adapter(
        rules,
        name="megatron_gpt",
        description=f"Megatron-Core GPT ({layers} layers, n_heads={nh}, n_query_groups={ng}, head_dim={hd}"
        + (f", {experts} experts -> {experts_to}" if experts else "")
        + (", tied" if tie_embeddings else "")
        + ") -> HF names",
    )
    if to == "titan":
        adapter = adapter + _titan(experts, n_experts, tie_embeddings, nh, ng, qk_layernorm)
    return adapter


def _positive(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise AdapterError(f"the megatron_gpt adapter: {name} must be a positive integer, got {value!r}")
    return value


def _layer_names(fc1: str, experts: str | None, qk_layernorm: bool, expert_bias: bool) -> list[str]:
    """The tensors of one decoder layer the options say the checkpoint holds."""
    attn = ["linear_qkv.weight", "linear_qkv.layer_norm_weight", "linear_proj.weight"]
    attn += ["q_layernorm.weight", "k_layernorm.weight"] if qk_layernorm else []
    fc1_names = ["linear_fc1.weight"] if fc1 == "fused" else ["linear_fc1.weight_w", "linear_fc1.weight_v"]
    mlp = ["linear_fc1.layer_norm_weight"]
    if experts is None:
        mlp += [*fc1_names, "linear_fc2.weight"]
    else:
        mlp += ["router.weight"] + (["router.expert_bias"] if expert_bias else [])
        each = "experts.experts." if experts == "stacked" else "experts.experts.{e}."
        mlp += [each + n for n in (["linear_fc1.weight"] if experts == "stacked" else fc1_names)] + [each + "linear_fc2.weight"]
    return [ATTN + n for n in attn] + ["mlp." + n for n in mlp]


def _mlp_rules(src: str, dst: str, fc1: str) -> list[Any]:
    gate, up = dst + "gate_proj.weight", dst + "up_proj.weight"
    rules: list[Any] = [sdadapt.rename(src + "linear_fc2.weight", dst + "down_proj.weight")]
    if fc1 == "fused":
        return [*rules, sdadapt.split(src + "linear_fc1.weight", [gate, up])]
    return [*rules, sdadapt.rename(src + "linear_fc1.weight_w", gate), sdadapt.rename(src + "linear_fc1.weight_v", up)]


def _expert_rules(experts: str, experts_to: str, fc1: str, n_experts: int | None) -> list[Any]:
    src, dst = D + "mlp.experts.experts.", H + "mlp.experts."
    if experts == "stacked" and experts_to == "stacked":
        return [
            sdadapt.rename(src + "linear_fc1.weight", dst + "gate_up_proj"),
            sdadapt.rename(src + "linear_fc2.weight", dst + "down_proj"),
        ]
    rules: list[Any] = []
    if experts == "stacked":  # one key per expert first, then as from a per-expert checkpoint
        rules += [
            sdadapt.unstack(src + "linear_fc1.weight", src + "{e}.linear_fc1.weight", over="e", count=n_experts),
            sdadapt.unstack(src + "linear_fc2.weight", src + "{e}.linear_fc2.weight", over="e", count=n_experts),
        ]
    if experts_to == "per_expert":
        return rules + _mlp_rules(src + "{e}.", dst + "{e}.", fc1)
    per = H + "mlp.megatron_experts.{e}."
    rules += _mlp_rules(src + "{e}.", per, fc1)
    return rules + [
        sdadapt.fuse([per + "gate_proj.weight", per + "up_proj.weight"], per + "gate_up_proj.weight"),
        sdadapt.stack(per + "gate_up_proj.weight", dst + "gate_up_proj", over="e", count=n_experts),
        sdadapt.stack(per + "down_proj.weight", dst + "down_proj", over="e", count=n_experts),
    ]


def _titan(experts: str | None, n_experts: int | None, tied: bool, nh: int, ng: int, qk_layernorm: bool) -> Adapter:
    """The shipped adapter from the HF names onward to the torchtitan-style layout."""
    if experts is not None:
        from sdadapt.adapters.qwen3_moe import build as qwen3_moe

        return qwen3_moe(experts="per_expert", n_experts=n_experts, tie_embeddings=tied)
    if qk_layernorm:
        from sdadapt.adapters.qwen3 import build as qwen3

        return qwen3(tie_embeddings=tied)
    from sdadapt.adapters.llama import build as llama

    return llama(n_heads=nh, n_kv_heads=ng, tie_embeddings=tied)


# --- options and checks from the checkpoint ------------------------------------------------------
def options_from_config(folder: str, source: str | Source | None = None) -> dict[str, Any]:
    """Options from the checkpoint: Megatron-LM's ``args`` in ``common.pt`` (heads, query groups,
    ``kv_channels``, experts, tied embeddings) and the key names (stacked or per-layer layout,
    fused or split ``linear_fc1``, experts stacked or per expert); the shapes where ``args`` is
    absent. Checked before anything is read into a model: the backends and checkpoint version are
    ones seen; every tensor key is one this adapter knows; every expert is there; the query groups
    divide the heads and the QKV rows; every stored tensor is covered by its chunks; every
    ``_extra_state`` is readable and empty. Each refusal names the key and the fix.
    """
    if not isinstance(source, Source) and not os.path.isfile(os.path.join(folder, "metadata.json")):
        return _options_from_hf_config(folder)
    common = read_megatron_common(source if isinstance(source, Source) else folder)
    _check_versions(common, folder)
    args = common.get("args") or {}
    if isinstance(source, Source):
        schema, non_tensor, src = dict(source.schema), list(source.non_tensor), source
    else:
        with sdadapt.sources.open_source(folder) as opened:
            schema, non_tensor = dict(opened.schema), list(opened.non_tensor)
            _check_chunks(opened, schema)
        src = None
    stacked = "decoder.layers.self_attention.linear_qkv.weight" in schema
    layer = "decoder.layers." if stacked else "decoder.layers.0."
    _check_known(schema, stacked)
    opts: dict[str, Any] = {"layers": "stacked" if stacked else "per_layer"}
    opts["fc1"] = "split" if any(k.endswith("linear_fc1.weight_w") for k in schema) else "fused"
    opts["tie_embeddings"] = "output_layer.weight" not in schema
    opts["qk_layernorm"] = any(k.endswith("q_layernorm.weight") for k in schema)
    opts["expert_bias"] = any(k.endswith("router.expert_bias") for k in schema)
    qkv = schema.get(layer + "self_attention.linear_qkv.weight")
    nh, ng, hd = args.get("num_attention_heads"), args.get("num_query_groups"), args.get("kv_channels")
    if not args.get("group_query_attention", ng is not None):
        ng = None
    if hd is None and nh and args.get("hidden_size"):
        hd = args["hidden_size"] // nh
    if hd is None:  # no args: the q/k norms' width is the head size
        norm = schema.get(layer + "self_attention.q_layernorm.weight")
        hd = norm.shape[-1] if norm is not None else None
    if nh is not None:
        opts["n_heads"] = nh
    if ng is not None:
        opts["n_query_groups"] = ng
    if hd is not None:
        opts["head_dim"] = hd
    if qkv is not None and nh is not None and hd is not None:
        _check_qkv(layer + "self_attention.linear_qkv.weight", tuple(qkv.shape)[-2], nh, ng or nh, hd)
    experts = _experts_layout(schema)
    if experts is not None:
        opts["experts"] = experts
        found = _expert_count(schema, experts)
        want = args.get("num_experts")
        opts["n_experts"] = want if isinstance(want, int) else found
    if src is not None:
        _check_chunks(src, schema)
    if not any(_EXTRA.match(k) for k in non_tensor):
        opts["extra_state"] = "none"
    refusal = _extra_state_refusal(source if isinstance(source, Source) else None, folder, non_tensor)
    if refusal:
        opts["extra_state"] = refusal
    return opts


def _options_from_hf_config(folder: str) -> dict[str, Any]:
    """Options for writing a Megatron checkpoint from a model with an HF ``config.json`` (an export
    of a model that was not loaded from Megatron): Megatron's default layout (stacked layers,
    fused fc1, stacked experts)."""
    cfg = sdadapt.sources.read_config_file(os.path.join(folder, "config.json"))
    nh = cfg.get("num_attention_heads")
    opts: dict[str, Any] = {"layers": "stacked", "fc1": "fused", "extra_state": "none",
                            "tie_embeddings": bool(cfg.get("tie_word_embeddings", False))}
    if nh is not None:
        opts["n_heads"] = nh
        opts["n_query_groups"] = cfg.get("num_key_value_heads") or nh
        hd = cfg.get("head_dim") or (cfg["hidden_size"] // nh if cfg.get("hidden_size") else None)
        if hd is not None:
            opts["head_dim"] = hd
    opts["qk_layernorm"] = str(cfg.get("model_type", "")).startswith("qwen3")
    n_experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if n_experts:
        opts["experts"], opts["n_experts"] = "stacked", n_experts
    return opts


def _check_versions(common: dict[str, Any], folder: str) -> None:
    backends = tuple(common.get("backends") or ())
    if backends not in SEEN_BACKENDS:
        raise AdapterError(
            f"{folder}/metadata.json: the megatron_gpt adapter reads torch_dist checkpoints (backends "
            f"{sorted(SEEN_BACKENDS)}), this one has {backends}; re-save it with Megatron-Core's "
            "dist_checkpointing.save(..., sharded_strategy=('torch_dist', 1)) (Megatron-LM: --ckpt-format torch_dist)"
        )
    version = common.get("checkpoint_version")
    if version is not None and version not in SEEN_CHECKPOINT_VERSIONS:
        raise AdapterError(
            f"{folder}/common.pt: checkpoint_version {version!r} is a Megatron layout this adapter has not seen "
            f"(it knows {list(SEEN_CHECKPOINT_VERSIONS)}, written by megatron-core 0.16); its key names or row orders may "
            "differ: convert it with that Megatron release first, or build an adapter with sdadapt.draft"
        )


def _check_known(schema: dict[str, Any], stacked: bool) -> None:
    pats = [re.escape(n).replace(r"\{e\}", r"\d+") for n in _PER_LAYER_NAMES]
    per_layer = re.compile(r"^decoder\.layers\." + ("" if stacked else r"\d+\.") + "(" + "|".join(pats) + ")$")
    for key in schema:
        if key in _TOP or per_layer.match(key):
            continue
        if _TE_GROUPED.search(key):
            raise AdapterError(
                f"key {key!r}: Transformer Engine's TEGroupedMLP parameter by its module name (weight0..N, one per "
                "expert), which Megatron-Core's dist_checkpointing.save never writes: it stores these experts under "
                "SequentialMLP's keys (mlp.experts.experts.linear_fc1.weight with an expert axis), which this adapter "
                "reads. This checkpoint holds a module's state_dict(): load it into Megatron-Core's GPTModel and save it "
                "with dist_checkpointing.save (Megatron-LM: --ckpt-format torch_dist), then load that folder"
            )
        raise AdapterError(
            f"key {key!r}: a Megatron-Core tensor the megatron_gpt adapter has not seen (it knows the GPTModel of "
            "megatron-core 0.16 with the local or Transformer Engine layer spec: GQA, SwiGLU, RMSNorm, rotary, MoE); "
            "compose an adapter of your own after it (sdadapt.draft proposes one) or drop the key with "
            "sdadapt.drop(...)"
        )


def _check_qkv(key: str, rows: int, nh: int, ng: int, hd: int) -> None:
    if nh % ng:
        raise AdapterError(
            f"key {key!r}: num_attention_heads={nh} is not a multiple of num_query_groups={ng} (from common.pt's args), "
            "so the fused QKV rows cannot be split per query group; pass the right n_query_groups=... to the adapter"
        )
    if rows != (nh + 2 * ng) * hd:
        raise AdapterError(
            f"key {key!r}: {rows} fused QKV rows, but n_heads={nh}, n_query_groups={ng} and head_dim={hd} make "
            f"{(nh + 2 * ng) * hd}; pass the model's n_heads, n_query_groups and head_dim to the adapter"
        )


def _experts_layout(schema: dict[str, Any]) -> str | None:
    if any(".mlp.experts.experts.linear_fc1." in k or k.startswith("decoder.layers.mlp.experts.experts.linear_fc1.")
           for k in schema):
        return "stacked"
    if any(re.search(r"mlp\.experts\.experts\.\d+\.", k) for k in schema):
        return "per_expert"
    return None


def _expert_count(schema: dict[str, Any], layout: str) -> int:
    """The number of experts; every layer must hold each of 0..E-1 with each of its tensors."""
    if layout == "stacked":
        key = next(k for k in schema if k.endswith("mlp.experts.experts.linear_fc1.weight"))
        stacked_layers = key.startswith("decoder.layers.mlp")
        return int(schema[key].shape[1 if stacked_layers else 0])
    found: dict[tuple[str, str], set[int]] = {}
    for key in schema:
        m = re.match(r"^(decoder\.layers\.(?:\d+\.)?mlp\.experts\.experts\.)(\d+)\.(.+)$", key)
        if m:
            found.setdefault((m.group(1), m.group(3)), set()).add(int(m.group(2)))
    count = max(max(v) for v in found.values()) + 1
    for (prefix, name), have in sorted(found.items()):
        missing = sorted(set(range(count)) - have)
        if missing:
            raise AdapterError(
                f"key {prefix}{missing[0]}.{name!s}: expert {missing[0]} of {count} is missing from the checkpoint (other "
                "experts of that layer are there); the save was incomplete or the files were copied partly: copy the "
                "checkpoint again, or re-save it"
            )
    return count


def _check_chunks(source: Any, schema: dict[str, Any]) -> None:
    """Every element of every tensor lies in a stored chunk (a missing expert of a stacked tensor,
    a rank's file not written)."""
    chunks_of = getattr(source, "chunks_of", None)
    if chunks_of is None:
        return
    for key, info in schema.items():
        total = 1
        for n in info.shape:
            total *= n
        covered = 0
        for box in chunks_of(key):
            size = 1
            for a, b in box:
                size *= b - a
            covered += size
        if covered < total:
            raise AdapterError(
                f"key {key!r}: its stored chunks cover {covered} of its {total} elements (a rank's part, such as an "
                "expert, was not saved); re-save the checkpoint with every rank, or copy it again"
            )


def _empty(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, io.BytesIO):
        return value.getbuffer().nbytes == 0
    if isinstance(value, torch.Tensor):
        return value.numel() == 0
    if isinstance(value, (list, tuple)):  # DCP keeps a ShardedObject's value in a list
        return all(_empty(v) for v in value)
    if isinstance(value, (bytes, bytearray, dict)):
        return len(value) == 0
    return False


def _extra_state_refusal(source: Source | None, folder: str, non_tensor: list[str]) -> str | None:
    """Why the ``_extra_state`` entries cannot be dropped silently, or ``None``: each is read (DCP's
    ``weights_only`` loading) and must be empty."""
    if source is None:
        with sdadapt.sources.open_source(folder) as opened:
            return _extra_state_refusal(opened, folder, non_tensor)
    read_object = getattr(source, "read_object", None)
    for key in non_tensor:
        if not _EXTRA.match(key):
            continue
        try:
            value = read_object(key) if read_object is not None else None
        except sdadapt.SdadaptError as e:
            return (
                f"key {key!r}: this _extra_state cannot be read safely ({e}); if the model kept no FP8 state, build the "
                "adapter with extra_state='drop' to leave it out: sdadapt.get_adapter('megatron_gpt', ckpt, "
                "extra_state='drop')"
            )
        if not _empty(value):
            return (
                f"key {key!r}: this _extra_state holds {type(value).__name__} state (Transformer Engine's FP8 scaling "
                "factors), which an HF model has no place for; to load the weights without it, build the adapter with "
                "extra_state='drop': sdadapt.get_adapter('megatron_gpt', ckpt, extra_state='drop')"
            )
    return None
