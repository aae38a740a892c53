"""The shared-memory staging between a vLLM worker and the trainer ranks on its host.

Each vLLM worker (one per TP rank) lays its raw parameters (vLLM's names, each with the shape and
dtype its layer created, before the post-processing that repacks or quantizes them) out in one
file of a folder in shared memory (``/dev/shm`` where there is one): ``rank<r>.bin``, described
by ``rank<r>.json`` (the manifest: the TP degree, and each parameter's name, dtype, shape and byte
offset). The trainer ranks map the same files and write the engine's shards straight into them
(``refit_plan`` with these tensors as the engine); the worker then loads each parameter from its
file through vLLM's own weight-loading path. Nothing here imports vLLM.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch

from ..errors import RefitError

ALIGN = 64
MANIFEST_VERSION = 1


@dataclass(frozen=True)
class Manifest:
    """One engine rank's staging file: ``params`` lists ``(name, dtype, shape, offset)``."""

    rank: int
    world: int
    params: tuple[tuple[str, str, tuple[int, ...], int], ...]
    nbytes: int

    def to_json(self) -> str:
        return json.dumps({"version": MANIFEST_VERSION, "rank": self.rank, "world": self.world, "nbytes": self.nbytes,
                           "params": [[n, d, list(s), o] for n, d, s, o in self.params]})  # fmt: skip

    @staticmethod
    def from_json(text: str, path: str) -> Manifest:
        data = json.loads(text)
        if data.get("version") != MANIFEST_VERSION:
            raise RefitError(f"{path}: staging manifest version {data.get('version')!r}, this sdadapt reads {MANIFEST_VERSION}; "
                             "install the same sdadapt in the trainer's and the engine's environments")  # fmt: skip
        params = tuple((str(n), str(d), tuple(int(x) for x in s), int(o)) for n, d, s, o in data["params"])
        return Manifest(int(data["rank"]), int(data["world"]), params, int(data["nbytes"]))


def layout_params(rank: int, world: int, params: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> Manifest:
    """A manifest placing ``params`` one after the other, each at an aligned offset."""
    out, offset = [], 0
    for name, dtype, shape in params:
        out.append((name, str(dtype).removeprefix("torch."), tuple(shape), offset))
        offset += -(-math.prod(shape) * dtype.itemsize // ALIGN) * ALIGN
    return Manifest(rank, world, tuple(out), offset)


def paths(folder: str, rank: int) -> tuple[str, str]:
    return os.path.join(folder, f"rank{rank}.bin"), os.path.join(folder, f"rank{rank}.json")


def create(folder: str, manifest: Manifest) -> dict[str, torch.Tensor]:
    """The engine side: make rank ``manifest.rank``'s file (its manifest written last, so a reader
    that sees it sees a whole file) and return its parameters' views."""
    os.makedirs(folder, exist_ok=True)
    data, meta = paths(folder, manifest.rank)
    with open(data, "wb") as f:
        f.truncate(max(manifest.nbytes, 1))
    views = _views(data, manifest)
    tmp = meta + ".tmp"
    with open(tmp, "w") as f:
        f.write(manifest.to_json())
    os.replace(tmp, meta)
    return views


def read(folder: str, rank: int) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """The trainer side: engine rank ``rank``'s manifest and its parameters' views (shared)."""
    data, meta = paths(folder, rank)
    try:
        with open(meta) as f:
            manifest = Manifest.from_json(f.read(), meta)
    except FileNotFoundError:
        raise RefitError(
            f"{meta} does not exist: the vLLM engine did not lay out its staging there. Start the engine with "
            "weight_transfer_config={'backend': 'sdadapt'} on the trainer's host (the staging is shared memory)"
        ) from None
    return manifest, _views(data, manifest)


def _views(path: str, manifest: Manifest) -> dict[str, torch.Tensor]:
    size = max(manifest.nbytes, 1)
    if os.path.getsize(path) != size:
        raise RefitError(f"{path} holds {os.path.getsize(path)} bytes, its manifest {size}: the staging changed; connect again")
    buf = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    out = {}
    for name, dtype, shape, offset in manifest.params:
        dt = getattr(torch, dtype)
        out[name] = buf[offset : offset + math.prod(shape) * dt.itemsize].view(dt).view(shape)
    return out


def remove(folder: str, rank: int) -> None:
    for p in paths(folder, rank):
        try:
            os.remove(p)
        except FileNotFoundError:
            pass
    try:
        os.rmdir(folder)
    except OSError:
        pass  # other ranks' files are still there


__all__ = ["Manifest", "create", "layout_params", "read", "remove"]
