"""HF GPT-2 (``Conv1D`` weights) -> nanoGPT layout (``nn.Linear`` weights).

Checkpoint: HF ``Conv1D`` stores ``weight`` as ``[in, out]``::

    [transformer.]h.{i}.attn.c_attn.weight   [C, 3C]    [transformer.]h.{i}.mlp.c_fc.weight    [C, 4C]
    [transformer.]h.{i}.attn.c_proj.weight   [C, C]     [transformer.]h.{i}.mlp.c_proj.weight  [4C, C]
    [transformer.]wte.weight, wpe.weight, ln_f.*, h.{i}.ln_1.*, h.{i}.ln_2.*, biases
    [transformer.]h.{i}.attn.bias / attn.masked_bias   (causal-mask buffers in older files)

``save_pretrained`` of ``GPT2LMHeadModel`` writes the ``transformer.`` prefix and no
``lm_head.weight`` (tied); the released ``gpt2`` files (``GPT2Model``) have no prefix and hold
the mask buffers. Model: nanoGPT's ``transformer.h.{i}.attn.c_attn.weight`` ``[3C, C]`` (or
``q_proj``/``k_proj``/``v_proj`` with ``split_qkv=True``), ``lm_head.weight`` filled from
``transformer.wte.weight``.
"""

from __future__ import annotations

from typing import Any

from sdadapt.adapters._common import checkpoint_keys, read_config

import sdadapt
from sdadapt import Adapter
from sdadapt.errors import AdapterError
from sdadapt.sources import Source

SUMMARY = "HF GPT-2 (Conv1D [in, out]) -> nanoGPT nn.Linear layout; c_attn optionally split into q/k/v; tied lm_head"

T = "transformer."
BLOCK = T + "h.{i}."


def build(*, prefix: str = "transformer.", split_qkv: bool = False, buffers: bool = False) -> Adapter:
    """``prefix``: ``"transformer."`` (``GPT2LMHeadModel.save_pretrained``) or ``""`` (``GPT2Model``
    files such as the released ``gpt2``). ``split_qkv``: the model has ``attn.q_proj|k_proj|v_proj``
    instead of ``attn.c_attn``. ``buffers``: the checkpoint holds ``attn.bias``/``attn.masked_bias``
    mask buffers (dropped)."""
    if prefix not in ("", T):
        raise AdapterError(f"the gpt2 adapter: prefix must be 'transformer.' or '', got {prefix!r}")
    rules: list[Any] = []
    if prefix == "":
        rules.append(sdadapt.add_prefix(T))  # GPT2Model keys (h.{i}..., wte, wpe, ln_f) -> transformer.*
    if buffers:
        rules.append(sdadapt.drop(BLOCK + "attn.{buffer}"))  # attn.bias, attn.masked_bias (one segment)
    if split_qkv:
        qkv = [BLOCK + f"attn.{n}_proj" for n in ("q", "k", "v")]
        rules += [
            # Conv1D [C, 3C]: q, k, v are column blocks; cut them, then turn each into [C, C]
            sdadapt.split(BLOCK + "attn.c_attn.weight", [q + ".weight" for q in qkv], dim=1),
            sdadapt.split(BLOCK + "attn.c_attn.bias", [q + ".bias" for q in qkv], dim=0),
            *(sdadapt.transpose(q + ".weight") for q in qkv),
        ]
    else:
        rules.append(sdadapt.transpose(BLOCK + "attn.c_attn.weight"))
    rules += [
        sdadapt.transpose(BLOCK + "attn.c_proj.weight"),
        sdadapt.transpose(BLOCK + "mlp.c_fc.weight"),
        sdadapt.transpose(BLOCK + "mlp.c_proj.weight"),
        sdadapt.tie("lm_head.weight", T + "wte.weight"),
    ]
    return Adapter(
        rules,
        name="gpt2",
        description="HF GPT-2 (Conv1D) -> nanoGPT (nn.Linear)" + (", q/k/v split" if split_qkv else ""),
    )


def options_from_config(folder: str, source: str | Source | None = None) -> dict[str, Any]:
    """``prefix`` and ``buffers`` from the checkpoint's key names (headers only)."""
    read_config(folder, ("config.json",))  # a broken config.json is reported, not ignored
    keys = checkpoint_keys(source or folder)
    opts: dict[str, Any] = {}
    if keys:
        opts["prefix"] = T if any(k.startswith(T + "h.") for k in keys) else ""
        opts["buffers"] = any(k.endswith((".attn.bias", ".attn.masked_bias")) for k in keys)
    return opts
