"""HF sharded safetensors: a folder whose ``model.safetensors.index.json`` maps keys to files.

We follow the index, never a glob of the folder, and refuse entries that leave the folder.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

from .._base.regions import Box
from .._base.schema import TensorLocation
from ..errors import SourceError
from ._base import Format, Source, claims_by_name, flat_only, member_path
from ._json import INDEX_LIMIT, ShardIndex, read_json
from ._safetensors_file import SafetensorsFile

INDEX_NAME = "model.safetensors.index.json"
MAX_INDEX_BYTES = INDEX_LIMIT  # real indexes are KBs to a few MBs; refuse to parse more


def _safe_member(folder: str, name: object, index_path: str, key: str | None = None) -> str:
    full = member_path(folder, name, what="index names shard", path=index_path, key=key)
    if not os.path.isfile(os.path.realpath(full)):
        raise SourceError(
            f"index names shard {name!r}, which does not exist; the download is incomplete", path=index_path, key=key
        )
    return full


class HFShardedSource(Source):
    """A folder with ``model.safetensors.index.json`` (or another ``*.index.json``)."""

    def __init__(self, folder: str, index_path: str | None = None):
        self.path = folder
        index_path = index_path or os.path.join(folder, INDEX_NAME)
        self.index_path = index_path
        weight_map = read_json(index_path, ShardIndex, what="index", limit=MAX_INDEX_BYTES).weight_map
        self._files: dict[str, SafetensorsFile] = {}
        self._key_file: dict[str, SafetensorsFile] = {}
        for key, name in weight_map.items():
            sf = self._files.get(name)
            if sf is None:
                sf = self._files[name] = SafetensorsFile(_safe_member(folder, name, index_path, key))
            self._key_file[key] = sf
        self.schema = {}
        for key, sf in self._key_file.items():
            info = sf.schema.get(key)
            if info is None:
                raise SourceError(
                    "the index maps this key to this shard, but the shard has no such tensor; the index and "
                    "shards do not belong together (download them again)",
                    path=sf.path,
                    key=key,
                )
            self.schema[key] = info
        seen: dict[str, str] = {}
        for sf in self._files.values():
            for key in sf.schema:
                if key in seen and seen[key] != sf.path:
                    raise SourceError(
                        f"key {key!r} is stored in two shards ({seen[key]} and {sf.path}); the checkpoint is ambiguous",
                        path=index_path,
                    )
                seen[key] = sf.path
        self.non_tensor = []

    def read(self, key: str, box: Box) -> torch.Tensor:
        return self._key_file[key].read(key, box)

    def locate(self, key: str) -> TensorLocation | None:
        sf = self._key_file.get(key)
        return sf.locate(key) if sf is not None else None

    def files(self) -> list[str]:
        return [self.index_path, *sorted(sf.path for sf in self._files.values())]

    def file_of(self, key: str) -> str:
        sf = self._key_file.get(key)
        return sf.path if sf is not None else self.index_path

    def close(self) -> None:
        for sf in self._files.values():
            sf.close()


def _open(path: str, subtree: str | None) -> Source:
    if os.path.isdir(path):
        return HFShardedSource(flat_only(path, subtree))
    return HFShardedSource(os.path.dirname(flat_only(path, subtree)) or ".", index_path=path)


def _shards(index_path: str) -> list[str]:
    """The shard file names an index lists, each checked to be a plain name inside its folder."""
    names = sorted(set(read_json(index_path, ShardIndex, what=INDEX_NAME, limit=INDEX_LIMIT).weight_map.values()))
    for name in names:
        member_path(os.path.dirname(index_path), name, what="index names shard", path=index_path)
    return names


def _whole(path: str, size: int) -> Iterator[list[tuple[int, int]]]:
    """The index is read whole when opened."""
    yield [(0, size)]


FORMAT = Format(
    "hf_sharded", (".index.json",), claims_by_name(INDEX_NAME, ".index.json"), _open, _whole, recordable=True,
    folder_file=INDEX_NAME, members=_shards,
)
"""A folder with ``model.safetensors.index.json`` and the shards it names, or an ``*.index.json`` file."""
