"""HF safetensors: one ``model.safetensors``, or size-bounded shards with an index.

Shapes and dtypes are known before any data, so each shard's header (with every offset) is
written first and the tensors follow one by one: nothing but the current tensor is held.
"""

from __future__ import annotations

import json
import os
import struct

from ..._base.schema import TensorInfo
from ..._base.tensor_bytes import tensor_bytes
from ...errors import SdadaptError
from ...sources import DTYPE_NAMES, INDEX_NAME
from .base import Pull, Writer, check_pulled, write_bytes


class SafetensorsWriter(Writer):
    """``path`` is a folder; shards hold at most ``max_shard_bytes`` of tensor data (a larger
    tensor gets a shard of its own). One shard is written as ``model.safetensors``."""

    def __init__(self, path: str, max_shard_bytes: int = 5 * 10**9):
        super().__init__(path)
        self.max_shard_bytes = max_shard_bytes

    def shards(self, entries: dict[str, TensorInfo]) -> list[list[str]]:
        out: list[list[str]] = [[]]
        used = 0
        for key, info in entries.items():
            if out[-1] and used + info.nbytes > self.max_shard_bytes:
                out.append([])
                used = 0
            out[-1].append(key)
            used += info.nbytes
        return out

    def write(self, entries: dict[str, TensorInfo], pull: Pull) -> None:
        for key, info in entries.items():
            if info.dtype not in DTYPE_NAMES:
                raise SdadaptError(f"key {key!r}: safetensors cannot store {info.dtype}; export as torch or dcp")
        os.makedirs(self.path)
        shards = self.shards(entries)
        names = (
            ["model.safetensors"]
            if len(shards) == 1
            else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        )
        weight_map: dict[str, str] = {}
        for name, keys in zip(names, shards, strict=True):
            header: dict[str, object] = {"__metadata__": {"format": "pt"}}
            offset = 0
            for key in keys:
                info = entries[key]
                header[key] = {"dtype": DTYPE_NAMES[info.dtype], "shape": list(info.shape), "data_offsets": [offset, offset + info.nbytes]}
                offset += info.nbytes
                weight_map[key] = name
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)
            with open(os.path.join(self.path, name), "wb") as f:
                write_bytes(f, struct.pack("<Q", len(raw)) + raw)
                for key in keys:
                    t = pull(key)
                    check_pulled(key, t, entries[key])
                    write_bytes(f, tensor_bytes(t))
                    del t
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(i.nbytes for i in entries.values())}, "weight_map": weight_map}
            with open(os.path.join(self.path, INDEX_NAME), "w") as f:
                json.dump(index, f, indent=2)
