"""A tiny adapter for registry tests: ``model.{i}.q`` -> ``{i}.wq`` with Meta rotary rows."""

from __future__ import annotations

import json
import os

import sdadapt
from sdadapt.errors import AdapterError

SUMMARY = "tiny test adapter: model.{i}.q -> {i}.wq (rotary)"


def options_from_config(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        cfg = json.load(f)
    return {"heads": cfg["num_attention_heads"], "dim": cfg["hidden_size"], "vocab": cfg.get("vocab_size")}


def build(heads: int, dim: int, tied: bool = False) -> sdadapt.Adapter:
    if dim % heads:
        raise AdapterError(f"tiny: dim={dim} does not divide by heads={heads}")
    rules = [sdadapt.rename("model.{i}.q", "{i}.wq"), sdadapt.rotary("{i}.wq", heads)]
    if tied:
        rules.append(sdadapt.tie("out", "emb"))
    return sdadapt.Adapter(rules, name="tiny")
