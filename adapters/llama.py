"""HF transformers Llama -> Meta reference Llama layout.

Checkpoint (``save_pretrained`` of ``LlamaForCausalLM``)::

    model.embed_tokens.weight, model.norm.weight, lm_head.weight (absent when tied)
    model.layers.{i}.self_attn.q_proj|k_proj|v_proj|o_proj.weight
    model.layers.{i}.mlp.gate_proj|up_proj|down_proj.weight
    model.layers.{i}.input_layernorm.weight, model.layers.{i}.post_attention_layernorm.weight

Model (Meta's ``model.py``)::

    tok_embeddings.weight, norm.weight, output.weight
    layers.{i}.attention.wq|wk|wv|wo.weight   (or wqkv with fused_qkv=True)
    layers.{i}.feed_forward.w1|w2|w3.weight   (or w13 + w2 with fused_w13=True)
    layers.{i}.attention_norm.weight, layers.{i}.ffn_norm.weight

HF stores q and k with the rotary rows of each head in "half" order (first halves, then
second halves); Meta's rotary rotates interleaved row pairs, so wq and wk are permuted inside
each head (with ``n_heads`` for q and ``n_kv_heads`` for k: GQA). A fused ``wqkv``/``w13``
is laid out per tensor-parallel rank (``[q_r; k_r; v_r]``), so that ``ColwiseParallel``
gives each rank the rows its attention code expects; the TP degree is read from the model's
placements unless ``tp=`` is given. ``adapter.inverse()`` exports back to the HF layout; with
fused targets, plan the export from the parallelised model's state dict (its placements give
the TP degree) or pass ``tp=``: a gathered full tensor still has the per-rank row order.
"""

from __future__ import annotations

import json
import os
from typing import Any

import sdadapt
from sdadapt import Adapter
from sdadapt.errors import AdapterError

SUMMARY = "HF transformers Llama -> Meta reference layout (wq/wk/wv/wo, w1/w2/w3; Meta rotary, GQA, tied, fused wqkv/w13)"

HF = "model.layers.{i}."
META = "layers.{i}."


# --- shared with the other adapters -------------------------------------------------------------
def read_config(path: str, names: tuple[str, ...] = ("config.json", "params.json")) -> dict[str, Any]:
    """The first of ``names`` found in ``path`` (a folder, or the folder of a file); ``{}`` if none."""
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    for name in names:
        p = os.path.join(folder, name)
        if os.path.isfile(p):
            try:
                with open(p) as f:
                    data = json.load(f)
            except (OSError, json.JSONDecodeError) as e:
                raise AdapterError(f"cannot read {p}: {e}; fix the file or pass the options as keyword arguments") from None
            if not isinstance(data, dict):
                raise AdapterError(f"{p} is not a JSON object; pass the options as keyword arguments")
            return data
    return {}


def checkpoint_keys(path: str) -> list[str]:
    """Key names of the checkpoint at ``path`` (headers only), or ``[]`` when there is none.

    ``path`` may be a checkpoint file, a folder sdadapt opens as one checkpoint, or a folder
    holding exactly one checkpoint file (``.safetensors``, ``.pt``, ``.pth``, ``.bin``, ``.ckpt``)."""
    candidates = [path]
    if os.path.isdir(path):
        files = sorted(f for f in os.listdir(path) if f.endswith((".safetensors", ".pt", ".pth", ".bin", ".ckpt")))
        if len(files) == 1:
            candidates.append(os.path.join(path, files[0]))
    for candidate in candidates:
        try:
            with sdadapt.open_source(candidate) as src:
                return list(src.schema) + list(src.non_tensor)
        except sdadapt.SdadaptError:
            continue
    return []


def need(name: str, value: Any, adapter: str) -> Any:
    if value is None:
        raise AdapterError(
            f"the {adapter} adapter needs {name}=...; pass it as a keyword argument, or give the "
            "checkpoint folder (its config.json supplies it)"
        )
    return value


def positive(name: str, value: int, adapter: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise AdapterError(f"the {adapter} adapter: {name} must be a positive integer, got {value!r}")
    return value


def attention_rules(
    *, n_heads: int, n_kv_heads: int, head_dim: int | None, fused_qkv: bool, tp: int | None, adapter: str
) -> list[Any]:
    """HF Llama-family attention + norms -> Meta names, Meta rotary order, optional fused wqkv."""
    rules: list[Any] = [
        sdadapt.rename(HF + "input_layernorm.weight", META + "attention_norm.weight"),
        sdadapt.rename(HF + "post_attention_layernorm.weight", META + "ffn_norm.weight"),
        sdadapt.rename(HF + "self_attn.o_proj.weight", META + "attention.wo.weight"),
        sdadapt.rename(HF + "self_attn.q_proj.weight", META + "attention.wq.weight"),
        sdadapt.rename(HF + "self_attn.k_proj.weight", META + "attention.wk.weight"),
        sdadapt.rename(HF + "self_attn.v_proj.weight", META + "attention.wv.weight"),
        sdadapt.rotary(META + "attention.wq.weight", heads=n_heads, to="interleaved"),
        sdadapt.rotary(META + "attention.wk.weight", heads=n_kv_heads, to="interleaved"),
    ]
    if fused_qkv:
        hd = need("head_dim (or dim)", head_dim, adapter)
        sizes = [n_heads * hd, n_kv_heads * hd, n_kv_heads * hd]
        rules += [
            sdadapt.fuse(
                [META + "attention.wq.weight", META + "attention.wk.weight", META + "attention.wv.weight"],
                META + "attention.wqkv.weight",
                sizes=sizes,
            ),
            sdadapt.interleave(META + "attention.wqkv.weight", sizes=sizes, tp=tp),
        ]
    return rules


def top_level_rules(tie: bool) -> list[Any]:
    """Embeddings, final norm and output; ``tie``: the checkpoint has no ``lm_head.weight`` and
    ``output.weight`` is filled from the embeddings."""
    rules: list[Any] = [
        sdadapt.rename("model.embed_tokens.weight", "tok_embeddings.weight"),
        sdadapt.rename("model.norm.weight", "norm.weight"),
    ]
    if tie:
        rules.append(sdadapt.tie("output.weight", "tok_embeddings.weight"))
    else:
        rules.append(sdadapt.rename("lm_head.weight", "output.weight"))
    return rules


def tied_from(cfg: dict[str, Any], keys: list[str]) -> bool | None:
    """Whether ``output.weight`` must come from the embeddings: the checkpoint's key names say
    so when known (no ``lm_head.weight``), else ``tie_word_embeddings`` of the config."""
    if keys:
        return "lm_head.weight" not in keys
    if "tie_word_embeddings" in cfg:
        return bool(cfg["tie_word_embeddings"])
    return None


def head_counts(n_heads: int, n_kv_heads: int | None, adapter: str) -> tuple[int, int]:
    """``n_heads`` and ``n_kv_heads`` (default ``n_heads``), checked: positive, GQA groups whole."""
    n_heads = positive("n_heads", n_heads, adapter)
    n_kv_heads = positive("n_kv_heads", n_heads if n_kv_heads is None else n_kv_heads, adapter)
    if n_heads % n_kv_heads:
        raise AdapterError(f"the {adapter} adapter: n_heads {n_heads} is not a multiple of n_kv_heads {n_kv_heads}")
    return n_heads, n_kv_heads


def head_dim_of(dim: int | None, n_heads: int, head_dim: int | None, adapter: str) -> int | None:
    """``head_dim`` if given, else ``dim // n_heads`` (``dim`` must divide), else ``None``."""
    if head_dim is not None:
        return head_dim
    if dim is None:
        return None
    if dim % n_heads:
        raise AdapterError(f"the {adapter} adapter: dim {dim} is not divisible by n_heads {n_heads}; pass head_dim=...")
    return dim // n_heads


def attention_options(cfg: dict[str, Any], keys: list[str]) -> dict[str, Any]:
    """Options shared by the Llama-family adapters, from an HF ``config.json`` and the
    checkpoint's key names: head counts, ``dim``, ``head_dim``, ``tie_embeddings``."""
    opts: dict[str, Any] = {}
    if "num_attention_heads" in cfg:
        opts["n_heads"] = cfg["num_attention_heads"]
        opts["n_kv_heads"] = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    if "hidden_size" in cfg:
        opts["dim"] = cfg["hidden_size"]
    if cfg.get("head_dim"):
        opts["head_dim"] = cfg["head_dim"]
    tied = tied_from(cfg, keys)
    if tied is not None:
        opts["tie_embeddings"] = tied
    return opts


# --- this adapter -------------------------------------------------------------------------------
def build(
    *,
    n_heads: int,
    n_kv_heads: int | None = None,
    dim: int | None = None,
    head_dim: int | None = None,
    hidden_dim: int | None = None,
    tie_embeddings: bool = False,
    fused_qkv: bool = False,
    fused_w13: bool = False,
    tp: int | None = None,
    inv_freq: bool = False,
) -> Adapter:
    """The adapter from an HF Llama checkpoint to the Meta layout.

    ``n_heads`` (required) and ``n_kv_heads`` (default ``n_heads``) drive the rotary permutation.
    ``tie_embeddings``: the checkpoint has no ``lm_head.weight`` (tied); ``output.weight`` is
    filled from the embeddings. ``fused_qkv`` needs ``dim`` or ``head_dim``; ``fused_w13`` needs
    ``hidden_dim`` (the MLP width). ``inv_freq``: the checkpoint holds old
    ``rotary_emb.inv_freq`` buffers (dropped).
    """
    n_heads, n_kv_heads = head_counts(n_heads, n_kv_heads, "llama")
    rules: list[Any] = []
    if inv_freq:
        rules.append(sdadapt.drop(HF + "self_attn.rotary_emb.inv_freq"))
    rules += top_level_rules(tie_embeddings)
    rules += attention_rules(
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim_of(dim, n_heads, head_dim, "llama"),
        fused_qkv=fused_qkv,
        tp=tp,
        adapter="llama",
    )
    rules.append(sdadapt.rename(HF + "mlp.down_proj.weight", META + "feed_forward.w2.weight"))
    if fused_w13:
        h = positive("hidden_dim", need("hidden_dim", hidden_dim, "llama"), "llama")
        rules += [
            sdadapt.fuse(
                [HF + "mlp.gate_proj.weight", HF + "mlp.up_proj.weight"], META + "feed_forward.w13.weight", sizes=[h, h]
            ),
            sdadapt.interleave(META + "feed_forward.w13.weight", sizes=[h, h], tp=tp),
        ]
    else:
        rules += [
            sdadapt.rename(HF + "mlp.gate_proj.weight", META + "feed_forward.w1.weight"),
            sdadapt.rename(HF + "mlp.up_proj.weight", META + "feed_forward.w3.weight"),
        ]
    flags = [n for n, on in (("fused_qkv", fused_qkv), ("fused_w13", fused_w13)) if on]
    return Adapter(
        rules,
        name="llama",
        description=f"HF Llama -> Meta layout (n_heads={n_heads}, n_kv_heads={n_kv_heads}"
        + "".join(f", {f}" for f in flags)
        + ")",
    )


def options_from_config(folder: str, source: str | None = None) -> dict[str, Any]:
    """Options from the checkpoint's ``config.json`` (HF) and its key names (headers only)."""
    cfg = read_config(folder, ("config.json",))
    keys = checkpoint_keys(source or folder)
    opts = attention_options(cfg, keys)
    if "intermediate_size" in cfg:
        opts["hidden_dim"] = cfg["intermediate_size"]
    if any(k.endswith("rotary_emb.inv_freq") for k in keys):
        opts["inv_freq"] = True
    return opts
