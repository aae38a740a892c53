"""HF safetensors: one ``model.safetensors``, or size-bounded shards with an index.

Shapes and dtypes are known before any data, so each shard's header (with every offset) is
written first and the tensors follow one by one: nothing but the current tensor is held. The
same layout (:func:`plan_files`) lets several ranks write one folder, each the byte ranges of
the regions it holds (:mod:`sdadapt._export.spread`).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

from ..._base.schema import TensorInfo
from ..._base.tensor_bytes import tensor_bytes
from ...errors import SdadaptError
from ...sources import DTYPE_NAMES, INDEX_NAME
from .base import Pull, Writer, check_pulled, write_bytes


@dataclass(frozen=True)
class FileLayout:
    """One safetensors file of a planned folder: its name, its header (length prefix included),
    where each of its tensors' bytes start in the file, and its size."""

    name: str
    header: bytes
    starts: dict[str, int]
    size: int


def _shards(entries: dict[str, TensorInfo], max_shard_bytes: int) -> list[list[str]]:
    out: list[list[str]] = [[]]
    used = 0
    for key, info in entries.items():
        if out[-1] and used + info.nbytes > max_shard_bytes:
            out.append([])
            used = 0
        out[-1].append(key)
        used += info.nbytes
    return out


def check_dtypes(entries: dict[str, TensorInfo]) -> None:
    for key, info in entries.items():
        if info.dtype not in DTYPE_NAMES:
            raise SdadaptError(f"key {key!r}: safetensors cannot store {info.dtype}; export as torch or dcp")


def plan_files(entries: dict[str, TensorInfo], max_shard_bytes: int) -> list[FileLayout]:
    """The files of a folder holding ``entries`` (in order) in shards of at most
    ``max_shard_bytes`` of tensor data (a larger tensor gets a shard of its own): one file is
    ``model.safetensors``, several are ``model-0000i-of-0000n.safetensors``."""
    shards = _shards(entries, max_shard_bytes)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    out: list[FileLayout] = []
    for name, keys in zip(names, shards, strict=True):
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for key in keys:
            info = entries[key]
            header[key] = {"dtype": DTYPE_NAMES[info.dtype], "shape": list(info.shape), "data_offsets": [offset, offset + info.nbytes]}
            offset += info.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        raw = struct.pack("<Q", len(raw)) + raw
        starts = {key: len(raw) + header[key]["data_offsets"][0] for key in keys}  # type: ignore[index]
        out.append(FileLayout(name, raw, starts, len(raw) + offset))
    return out


def index_json(entries: dict[str, TensorInfo], files: list[FileLayout]) -> str:
    """``model.safetensors.index.json`` of a folder of several files."""
    weight_map = {key: f.name for f in files for key in f.starts}
    index = {"metadata": {"total_size": sum(i.nbytes for i in entries.values())}, "weight_map": weight_map}
    return json.dumps(index, indent=2)


class SafetensorsWriter(Writer):
    """``path`` is a folder; shards hold at most ``max_shard_bytes`` of tensor data (a larger
    tensor gets a shard of its own). One shard is written as ``model.safetensors``."""

    def __init__(self, path: str, max_shard_bytes: int = 5 * 10**9):
        super().__init__(path)
        self.max_shard_bytes = max_shard_bytes

    def write(self, entries: dict[str, TensorInfo], pull: Pull) -> None:
        check_dtypes(entries)
        os.makedirs(self.path)
        files = plan_files(entries, self.max_shard_bytes)
        for layout in files:
            with open(os.path.join(self.path, layout.name), "wb") as f:
                write_bytes(f, layout.header)
                for key in layout.starts:
                    t = pull(key)
                    check_pulled(key, t, entries[key])
                    write_bytes(f, tensor_bytes(t))
                    del t
        if len(files) > 1:  # the index last: a reader never sees an index over missing files
            with open(os.path.join(self.path, INDEX_NAME), "w") as f:
                f.write(index_json(entries, files))
