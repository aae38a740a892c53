"""A PEFT LoRA folder as ``PeftModel.save_pretrained`` writes it: ``adapter_config.json`` and
``adapter_model.safetensors``; and :class:`LoraMerged`, what merging one changed (a load
report's ``lora``). What the config means (the merge rule) is in :mod:`sdadapt.rules._lora`."""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict

from .._base.summary import Summarized
from ..errors import AdapterError, SourceError
from ._json import read_json
from ._safetensors_file import SafetensorsFile

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
_CONFIG_LIMIT = 16 << 20


def read_peft_config(path: str | os.PathLike[str]) -> tuple[str, dict[str, Any]]:
    """``(config path, config dict)`` of the PEFT folder ``path``; an :class:`AdapterError` when
    ``path`` is not such a folder."""
    folder = os.fspath(path)
    if not os.path.isdir(folder):
        raise AdapterError(f"lora={folder!r}: not a folder; pass the folder PeftModel.save_pretrained wrote "
                           f"({CONFIG_NAME} + {WEIGHTS_NAME})")  # fmt: skip
    config_path = os.path.join(folder, CONFIG_NAME)
    if not os.path.isfile(config_path):
        raise AdapterError(f"lora={folder!r}: no {CONFIG_NAME} in the folder")
    config = read_json(config_path, None, what="PEFT adapter config", limit=_CONFIG_LIMIT)
    if not isinstance(config, dict):
        raise AdapterError(f"{config_path}: not a JSON object")
    return config_path, config


def open_peft_weights(path: str | os.PathLike[str]) -> SafetensorsFile:
    """The adapter's tensors (headers read, nothing else); a pair of rank 0 is a
    :class:`SourceError` naming its key."""
    folder = os.fspath(path)
    weights = os.path.join(folder, WEIGHTS_NAME)
    if not os.path.isfile(weights):
        hint = " (it holds adapter_model.bin: re-save it with safe_serialization=True)" if os.path.isfile(
            os.path.join(folder, "adapter_model.bin")) else ""  # fmt: skip
        raise AdapterError(f"lora={folder!r}: no {WEIGHTS_NAME}{hint}")
    source = SafetensorsFile(weights)
    empty = sorted(k for k, info in source.schema.items() if k.endswith(".lora_A.weight") and info.shape[:1] == (0,))
    if empty:
        source.close()
        raise SourceError(
            f"the LoRA pair has rank 0 (lora_A has no rows), so it changes nothing and has no scale (alpha / r); "
            f"{len(empty)} such pair(s). Re-save the adapter",
            path=weights,
            key=empty[0],
        )
    return source


class LoraMerged(Summarized, BaseModel):
    """A PEFT LoRA merged by a load: its folder, the ranks of its pairs, how many weights it changed."""

    model_config = ConfigDict(defer_build=True)  # built when a load first merges a LoRA

    folder: str
    keys: int  # model keys whose values include a LoRA delta
    pairs: int  # lora_A / lora_B pairs merged
    ranks: list[int]  # the distinct ranks r of those pairs

    def format(self) -> str:
        ranks = ", ".join(map(str, self.ranks)) or "-"
        return f"merged LoRA {self.folder} (r={ranks}: {self.pairs} pairs) into {self.keys} model keys"
