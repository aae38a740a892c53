"""GGUF (llama.cpp) Llama and Qwen files -> HF transformers names, or -> our documented layout.

Checkpoint (a ``.gguf`` file, llama.cpp's converter's names)::

    token_embd.weight, output_norm.weight, output.weight (absent when tied), rope_freqs.weight (some Llama 3)
    blk.{i}.attn_norm.weight, blk.{i}.ffn_norm.weight
    blk.{i}.attn_q|attn_k|attn_v|attn_output.weight (+ attn_q|k|v.bias: Qwen2)
    blk.{i}.attn_q_norm|attn_k_norm.weight (Qwen3)
    blk.{i}.ffn_gate|ffn_up|ffn_down.weight

``to="hf"`` (default): transformers' checkpoint names (``model.layers.{i}.self_attn.q_proj.weight``
...), what ``from_pretrained(dir, gguf_file=...)`` builds. llama.cpp's converter permutes the
rows of each Llama q and k head into rotary pairs (Meta's order); transformers undoes it
(``reverse_permute_weights``) and so does this adapter (:func:`sdadapt.rotary` ``to="half"``, with
the kv head count for k). Qwen2 and Qwen3 files are not permuted (their rotary is NeoX's halves).

``to="native"``: our documented layout (``tok_embeddings``, ``layers.{i}.attention.wq`` ...,
``feed_forward.w1|w2|w3``, ``norm``, ``output``), which keeps Meta's rotary pairs for Llama
(llama.cpp's order already) and HF's halves for Qwen: no row permutation.

Options come from the file's own metadata (``general.architecture``,
``{arch}.attention.head_count`` and ``head_count_kv``); ``sdadapt.load(transformers_model,
"model.gguf")`` uses this adapter (``to="hf"``) without being asked, as ``from_pretrained`` needs
no adapter for a GGUF file.
"""

from __future__ import annotations

import os
from typing import Any, Literal

import sdadapt
from sdadapt import Adapter
from sdadapt.errors import AdapterError
from sdadapt.sources import Source, open_source

SUMMARY = "GGUF (llama.cpp) Llama / Qwen2 / Qwen3 names -> transformers names (Llama q/k rows un-permuted) or our layout"

FAMILIES = ("llama", "qwen2", "qwen3")
"""``general.architecture`` values this adapter maps (Mistral's files say ``llama``)."""

_TOP = {  # llama.cpp name -> (transformers name, our layout's name)
    "token_embd.weight": ("model.embed_tokens.weight", "tok_embeddings.weight"),
    "output_norm.weight": ("model.norm.weight", "norm.weight"),
    "output.weight": ("lm_head.weight", "output.weight"),
}
_BLOCK = {  # blk.{i}.<name> -> (model.layers.{i}.<name>, layers.{i}.<name>)
    "attn_norm": ("input_layernorm", "attention_norm"),
    "ffn_norm": ("post_attention_layernorm", "ffn_norm"),
    "attn_q": ("self_attn.q_proj", "attention.wq"),
    "attn_k": ("self_attn.k_proj", "attention.wk"),
    "attn_v": ("self_attn.v_proj", "attention.wv"),
    "attn_output": ("self_attn.o_proj", "attention.wo"),
    "attn_q_norm": ("self_attn.q_norm", "attention.q_norm"),
    "attn_k_norm": ("self_attn.k_norm", "attention.k_norm"),
    "ffn_gate": ("mlp.gate_proj", "feed_forward.w1"),
    "ffn_down": ("mlp.down_proj", "feed_forward.w2"),
    "ffn_up": ("mlp.up_proj", "feed_forward.w3"),
}


_FAMILY_BLOCKS = {
    "llama": [*_BLOCK.keys() - {"attn_q_norm", "attn_k_norm"}],
    "qwen2": [*_BLOCK.keys() - {"attn_q_norm", "attn_k_norm"}],
    "qwen3": list(_BLOCK),
}
_BIASES = {"qwen2": ("attn_q", "attn_k", "attn_v")}


def build(
    *,
    arch: str,
    n_heads: int | None = None,
    n_kv_heads: int | None = None,
    to: Literal["hf", "native"] = "hf",
    tied: bool = False,
    rope_freqs: bool = False,
) -> Adapter:
    """The adapter from a GGUF file of family ``arch`` to transformers' names (``to="hf"``) or
    our layout (``to="native"``). ``n_heads`` / ``n_kv_heads`` (default ``n_heads``) drive the
    un-permutation of Llama's q / k rows for ``to="hf"``. ``tied``: the file has no
    ``output.weight`` (the model ties it to the embeddings). ``rope_freqs``: the file holds
    llama.cpp's ``rope_freqs.weight`` (Llama 3's scaled rotary frequencies; a model computes
    its own), which is dropped."""
    if arch not in FAMILIES:
        raise AdapterError(
            f"the gguf adapter maps the families {', '.join(FAMILIES)}; this file's general.architecture is {arch!r}: "
            "write an adapter with sdadapt.draft(model, 'file.gguf')"
        )
    if to not in ("hf", "native"):
        raise AdapterError(f"the gguf adapter: to={to!r}; use 'hf' (transformers' names) or 'native' (our layout)")
    side = 0 if to == "hf" else 1
    prefix = "model.layers.{i}." if to == "hf" else "layers.{i}."
    rules: list[Any] = [sdadapt.drop("rope_freqs.weight")] if rope_freqs else []
    for name, pair in _TOP.items():
        if not (tied and name == "output.weight"):
            rules.append(sdadapt.rename(name, pair[side]))
    for name in sorted(_FAMILY_BLOCKS[arch]):
        pair = _BLOCK[name]
        rules.append(sdadapt.rename(f"blk.{{i}}.{name}.weight", f"{prefix}{pair[side]}.weight"))
        if name in _BIASES.get(arch, ()):
            rules.append(sdadapt.rename(f"blk.{{i}}.{name}.bias", f"{prefix}{pair[side]}.bias"))
    if arch == "llama" and to == "hf":
        if n_heads is None:
            raise AdapterError("the gguf adapter needs n_heads for a Llama file (llama.attention.head_count)")
        kv = n_heads if n_kv_heads is None else n_kv_heads
        rules += [
            sdadapt.rotary(prefix + "self_attn.q_proj.weight", heads=n_heads, to="half"),
            sdadapt.rotary(prefix + "self_attn.k_proj.weight", heads=kv, to="half"),
        ]
    where = "transformers names" if to == "hf" else "our layout"
    return Adapter(rules, name="gguf", description=f"GGUF {arch} -> {where} (n_heads={n_heads}, n_kv_heads={n_kv_heads})")


def options_from_config(folder: str, source: str | Source | None = None) -> dict[str, Any]:
    """``arch``, ``n_heads`` and ``n_kv_heads`` from the GGUF file's metadata."""
    if source is None or (isinstance(source, (str, os.PathLike)) and not os.fspath(source).endswith(".gguf")):
        raise AdapterError(f"the gguf adapter reads its options from a .gguf file; pass the file, not the folder {folder}")
    if isinstance(source, Source):
        meta, keys = getattr(source, "metadata", None), set(source.schema)
    else:
        with open_source(source) as src:
            meta, keys = getattr(src, "metadata", None), set(src.schema)
    if not isinstance(meta, dict) or not isinstance(meta.get("general.architecture"), str):
        raise AdapterError("the gguf adapter needs a GGUF file with general.architecture in its metadata")
    arch = meta["general.architecture"]
    out: dict[str, Any] = {"arch": arch, "tied": "output.weight" not in keys, "rope_freqs": "rope_freqs.weight" in keys}
    for option, key in (("n_heads", "attention.head_count"), ("n_kv_heads", "attention.head_count_kv")):
        value = meta.get(f"{arch}.{key}")
        if isinstance(value, int) and not isinstance(value, bool):
            out[option] = value
    return out
