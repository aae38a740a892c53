"""Write tiny checkpoints in every format sdadapt reads (shared by the tests).

    write_torch_save(path, sd)                      # torch.save zip file (nested dicts allowed)
    write_safetensors(path, sd, metadata=None)       # one .safetensors file
    write_hf_sharded(folder, sd, max_shard_bytes)    # model-0000i-of-0000n.safetensors + index
    write_raw_safetensors(path, header, data)        # hand-made (possibly corrupt) header + bytes
    random_state_dict(spec, seed)                    # {key: (shape, dtype)} -> random tensors
    DictIO(tensors)                                  # in-memory SourceIO for nodes (counts bytes)

Writers use the reference implementations (``torch.save``, ``safetensors.torch``), never
sdadapt, so they are independent oracles. Each returns the path it wrote.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from typing import Any

import torch
from safetensors.torch import load_file, save_file

INDEX_NAME = "model.safetensors.index.json"


def _contiguous(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous() for k, v in sd.items()}


def write_torch_save(path: str | os.PathLike[str], sd: Mapping[str, Any], *, legacy: bool = False) -> str:
    """``torch.save(sd, path)`` (zip format; ``legacy=True`` writes the old non-zip format)."""
    path = os.fspath(path)
    torch.save(dict(sd), path, _use_new_zipfile_serialization=not legacy)
    return path


def write_safetensors(
    path: str | os.PathLike[str], sd: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> str:
    path = os.fspath(path)
    save_file(_contiguous(sd), path, metadata=metadata)
    return path


def write_hf_sharded(
    folder: str | os.PathLike[str],
    sd: Mapping[str, torch.Tensor],
    max_shard_bytes: int = 1 << 20,
    *,
    index_name: str = INDEX_NAME,
) -> str:
    """Split ``sd`` (in key order) into shards of at most ``max_shard_bytes`` (a tensor larger
    than that gets a shard of its own), named like HF's ``model-00001-of-00003.safetensors``,
    and write the index. Returns the folder."""
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    used = 0
    for k, v in _contiguous(sd).items():
        n = v.numel() * v.element_size()
        if shards[-1] and used + n > max_shard_bytes:
            shards.append({})
            used = 0
        shards[-1][k] = v
        used += n
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(folder, name), metadata={"format": "pt"})
        for k, v in shard.items():
            weight_map[k] = name
            total += v.numel() * v.element_size()
    with open(os.path.join(folder, index_name), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return folder


def write_raw_safetensors(path: str | os.PathLike[str], header: Any, data: bytes = b"", *, header_len: int | None = None) -> str:
    """A safetensors file with exactly this header (a dict/list is JSON-encoded; bytes are
    written as they are) and data area; ``header_len`` overrides the 8-byte length prefix."""
    path = os.fspath(path)
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if header_len is None else header_len
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", n) + raw + data)
    return path


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random values of any dtype (floats in [-4, 4), ints, bools, float8 via float32)."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return ((torch.rand(shape, generator=gen) - 0.5) * 8).to(dtype)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -1000), min(info.max, 1000)
    return torch.randint(lo, hi + 1, shape, generator=gen, dtype=torch.int64).to(dtype)


def random_state_dict(spec: Mapping[str, tuple[tuple[int, ...], torch.dtype]], seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: random_tensor(tuple(shape), dtype, gen) for k, (shape, dtype) in spec.items()}


class DictIO:
    """An in-memory ``SourceIO``: ``read(key, box)`` slices a dict of tensors and counts the
    bytes it hands out (what a lazy read would take from a file)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.tensors = dict(tensors)
        self.bytes_read = 0
        self.reads: list[tuple[str, tuple[tuple[int, int], ...]]] = []

    def read(self, key: str, box: tuple[tuple[int, int], ...]) -> torch.Tensor:
        t = self.tensors[key][tuple(slice(a, b) for a, b in box)]
        assert t.dim() == len(box), f"box {box} does not fit {key} of shape {list(self.tensors[key].shape)}"
        self.bytes_read += t.numel() * t.element_size()
        self.reads.append((key, box))
        return t

    def schema(self) -> dict[str, Any]:
        from sdadapt._base.schema import TensorInfo

        return {k: TensorInfo(tuple(v.shape), v.dtype) for k, v in self.tensors.items()}


def read_safetensors_folder(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of the ``.safetensors`` files in folder ``path`` (an HF release or an export)."""
    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out
