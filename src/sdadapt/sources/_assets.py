"""What a checkpoint folder holds beside its weights, and what a model says about itself.

- The side files (``config.json``, tokenizer and generation files) that ``export`` and
  ``convert`` copy, so that the folder they write opens in transformers and with
  ``--adapter NAME``;
- the checkpoint folder a model was last loaded from by :func:`sdadapt.load`, so that a later
  ``export`` / ``export_iter`` / ``save_state`` with an adapter name reads the same options
  (``n_heads`` ...) and copies the same files;
- a model's configuration as an HF ``config.json`` would hold it (a transformers model's own
  ``config``; torchtitan's ``Decoder.Config`` translated), from which a shipped adapter takes
  its options when no checkpoint folder is known.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import weakref
from typing import Any

from torch import nn

from ._formats import WEIGHT_SUFFIXES

log = logging.getLogger(__name__)

__all__ = [
    "WEIGHT_SUFFIXES", "copy_side_files", "loaded_from", "model_config", "remember_source", "transformers_config", "write_config",
]


_NOT_COPIED = ("model.safetensors.index.json", ".metadata", "sdadapt.checksums.json")

_sources: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


def remember_source(model: nn.Module, src: object) -> None:
    """Record the folder of checkpoint ``src`` (a path) as the one ``model`` was loaded from."""
    if isinstance(src, (str, os.PathLike)):
        path = os.fspath(src)
        folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path)) if os.path.isfile(path) else None
        if folder is not None:
            _sources[model] = folder


def loaded_from(model: nn.Module) -> str | None:
    """The checkpoint folder ``model`` was last loaded from by :func:`sdadapt.load`, if it still exists."""
    folder = _sources.get(model)
    return folder if folder is not None and os.path.isdir(folder) else None


def copy_side_files(folder: str, dst: str, *, config: bool = True) -> list[str]:
    """Copy ``folder``'s plain files other than weights and indexes into the folder ``dst``
    (``config.json``, ``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``,
    ``special_tokens_map.json``, ``tokenizer.model``, chat templates, README ...); ``config=False``
    leaves ``config.json`` out (the caller writes its own). Returns the names copied."""
    copied = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name in _NOT_COPIED or name.endswith(WEIGHT_SUFFIXES) or name.endswith(".index.json"):
            continue
        if (name == "config.json" and not config) or not os.path.isfile(path) or os.path.exists(os.path.join(dst, name)):
            continue
        shutil.copy2(path, os.path.join(dst, name))
        copied.append(name)
    if copied:
        log.info("copied %s from %s", ", ".join(copied), folder)
    return copied


def write_config(dst: str, config: dict[str, Any]) -> None:
    """Write ``config`` as ``dst/config.json``."""
    with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def model_config(model: nn.Module) -> dict[str, Any] | None:
    """``model``'s configuration with HF ``config.json`` keys, or ``None`` when it has none we know:
    a transformers model's ``config.to_dict()``; for torchtitan's decoders (``model.config`` with
    ``dim`` and ``layers[0].attention``), the keys the shipped adapters read (heads, sizes, tying)."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None
    titan = _titan_config(cfg)
    return titan if titan is not None else transformers_config(model)


def transformers_config(model: nn.Module) -> dict[str, Any] | None:
    """A transformers model's own ``config.json`` content (``model.config.to_dict()``: a config
    with a ``model_type``), or ``None``."""
    cfg = getattr(model, "config", None)
    to_dict = getattr(cfg, "to_dict", None)
    if not callable(to_dict) or not isinstance(getattr(cfg, "model_type", None), str):
        return None
    try:
        data = to_dict()
    except Exception as e:  # noqa: BLE001 - a foreign config object: no options from it
        log.info("model.config.to_dict() failed (%s): no options from the model's config", e)
        return None
    return data if isinstance(data, dict) else None


def _titan_config(cfg: Any) -> dict[str, Any] | None:
    layers = getattr(cfg, "layers", None)
    dim = getattr(cfg, "dim", None)
    if not isinstance(dim, int) or not layers:
        return None
    attn = getattr(layers[0], "attention", None)
    n_heads = getattr(attn, "n_heads", None)
    if not isinstance(n_heads, int):
        return None
    out: dict[str, Any] = {"hidden_size": dim, "num_attention_heads": n_heads, "num_hidden_layers": len(layers)}
    n_kv = getattr(attn, "n_kv_heads", None)
    out["num_key_value_heads"] = n_kv if isinstance(n_kv, int) else n_heads
    head_dim = getattr(attn, "head_dim", None)
    if isinstance(head_dim, int):
        out["head_dim"] = head_dim
    if isinstance(getattr(cfg, "vocab_size", None), int):
        out["vocab_size"] = cfg.vocab_size
    if isinstance(getattr(cfg, "enable_weight_tying", None), bool):
        out["tie_word_embeddings"] = cfg.enable_weight_tying
    return out
