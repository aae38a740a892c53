"""Tiny transformers Llama / Qwen2 / Qwen3 models written as GGUF files the way llama.cpp's
converter writes them (its names, its Q/K row permutation for Llama, its metadata keys), with
``gguf``'s writer; the oracle is transformers' own ``from_pretrained(dir, gguf_file=...)``.

Every tensor type issue 60 lists appears in each file: 2-d weights cycle through the quantized
and 16-bit types (a K-quant only where a row holds whole 256-value blocks), norms stay F32.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from support.gguf_files import write_gguf

HEADS, KV_HEADS, HIDDEN, FFN, VOCAB, LAYERS = 4, 2, 256, 512, 96, 2
QWEN3_HEAD_DIM = 128  # transformers' GGUF config reader leaves Qwen3's head_dim at its default, 128

_BLOCK = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
_TYPES = ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "F16", "BF16", "F32"]


def config(family: str) -> Any:
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, max_position_embeddings=64, tie_word_embeddings=False, rms_norm_eps=1e-5,
    )  # fmt: skip
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "qwen2":
        return transformers.Qwen2Config(**common)
    return transformers.Qwen3Config(head_dim=QWEN3_HEAD_DIM, **common)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's row order for a Llama q / k weight (rotary pairs per head)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_family(folder: str, family: str, seed: int = 0) -> str:
    """A random tiny ``family`` model as ``folder/model.gguf``; returns the file's path."""
    import transformers

    torch.manual_seed(seed)
    cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM}
    model = cls[family](config(family))
    tensors = {}
    n = 0
    for key, value in model.state_dict().items():
        a = value.float().numpy()
        if key in _TOP:
            name = _TOP[key]
        else:
            parts = key.split(".")
            inner = ".".join(parts[3:-1])
            name = f"blk.{parts[2]}.{_BLOCK[inner]}.{parts[-1]}"
            if family == "llama" and inner == "self_attn.q_proj":
                a = _permute(a, HEADS)
            if family == "llama" and inner == "self_attn.k_proj":
                a = _permute(a, KV_HEADS)
        if a.ndim == 1:
            qtype = "F32"
        else:
            qtype = _TYPES[n % len(_TYPES)]
            n += 1
            if qtype.endswith("_K") and a.shape[-1] % 256:
                qtype = "Q8_0"
        tensors[name] = (np.ascontiguousarray(a), qtype)
    arch = family
    meta = {
        f"{arch}.context_length": 64, f"{arch}.embedding_length": HIDDEN, f"{arch}.block_count": LAYERS,
        f"{arch}.feed_forward_length": FFN, f"{arch}.attention.head_count": HEADS,
        f"{arch}.attention.head_count_kv": KV_HEADS, f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        f"{arch}.rope.freq_base": 10000.0, f"{arch}.vocab_size": VOCAB,
    }  # fmt: skip
    if family == "llama":
        meta["llama.rope.dimension_count"] = HIDDEN // HEADS
    if family == "qwen3":
        meta["qwen3.attention.key_length"] = QWEN3_HEAD_DIM
        meta["qwen3.attention.value_length"] = QWEN3_HEAD_DIM
    os.makedirs(folder, exist_ok=True)
    return write_gguf(os.path.join(folder, "model.gguf"), tensors, meta, arch=arch)


def oracle_model(path: str, dtype: torch.dtype) -> Any:
    """transformers' own loading of the GGUF file (``from_pretrained(dir, gguf_file=name)``)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype
    ).eval()


def empty_like(oracle: Any, dtype: torch.dtype) -> Any:
    """A model of the oracle's class and config, on the meta device."""
    with torch.device("meta"):
        return type(oracle)(oracle.config).to(dtype)


def types_in(path: str) -> set[str]:
    from sdadapt.sources import open_source

    with open_source(path) as src:
        return set(src.types.values())  # type: ignore[attr-defined]
