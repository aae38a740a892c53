"""One ``torch.save`` file (zip format), mapped with ``torch.load(mmap=True, weights_only=True)``.

Mapping reads the pickle (the header) and no tensor bytes; a region read touches only its
pages. Nested dicts are flattened with dots (``{"model": {"w": t}}`` -> ``model.w``);
``subtree="model"`` keeps one branch and strips its prefix.
"""

from __future__ import annotations

import pickle
import zipfile
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import SourceError
from ..nodes import Box
from .base import Source, TensorInfo, slices

_SHARDED_HINT = (
    "it holds sharded pieces ({what}) rather than full tensors: it was saved from a "
    "parallelised model. Save full tensors instead (get_model_state_dict(model, "
    "options=StateDictOptions(full_state_dict=True, cpu_offload=True)) on rank 0), or save "
    "with torch.distributed.checkpoint and load that folder."
)


def _load_mapped(path: str) -> Any:
    if not zipfile.is_zipfile(path):
        with open(path, "rb") as f:
            head = f.read(2)
        if head[:1] == b"\x80":
            raise SourceError(
                "legacy (non-zip) torch.save format, which cannot be memory-mapped; re-save it "
                "once with a current torch: torch.save(torch.load(path, weights_only=True), new_path)",
                path=path,
            )
        raise SourceError("not a torch.save (zip) file, a safetensors file, or a checkpoint folder", path=path)
    try:
        return torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        text = str(e)
        if "DTensor" in text or "ShardedTensor" in text or "_StridedShard" in text or "DeviceMesh" in text:
            raise SourceError(_SHARDED_HINT.format(what="DTensor/ShardedTensor"), path=path) from None
        first = text.strip().splitlines()[0] if text.strip() else "unpickling failed"
        raise SourceError(
            f"refusing to unpickle non-tensor objects (weights_only=True): {first}. sdadapt never runs "
            "code from a checkpoint; save plain tensors and dicts instead",
            path=path,
        ) from None
    except (RuntimeError, EOFError, ValueError, zipfile.BadZipFile, KeyError, OSError) as e:
        raise SourceError(f"corrupt or truncated torch.save file ({type(e).__name__}: {e})", path=path) from None


def _flatten(obj: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            _flatten(v, f"{prefix}{k}.", out) if isinstance(v, Mapping) else out.__setitem__(f"{prefix}{k}", v)
    else:
        out[prefix.rstrip(".")] = obj


class TorchSaveFile(Source):
    def __init__(self, path: str, subtree: str | None = None):
        self.path = path
        obj = _load_mapped(path)
        if subtree:
            for part in subtree.split("."):
                if not isinstance(obj, Mapping) or part not in obj:
                    have = sorted(map(str, obj)) if isinstance(obj, Mapping) else type(obj).__name__
                    raise SourceError(f"subtree {subtree!r}: no entry {part!r} (have {have})", path=path)
                obj = obj[part]
        if isinstance(obj, torch.Tensor):
            raise SourceError("the file holds a single tensor, not a state dict", path=path)
        if not isinstance(obj, Mapping):
            raise SourceError(f"expected a dict of tensors, found {type(obj).__name__}", path=path)
        flat: dict[str, Any] = {}
        _flatten(obj, "", flat)
        self._tensors: dict[str, torch.Tensor] = {}
        self.non_tensor = []
        for key, v in flat.items():
            if isinstance(v, torch.Tensor):
                if type(v) is not torch.Tensor and not isinstance(v, torch.nn.Parameter):
                    raise SourceError(_SHARDED_HINT.format(what=type(v).__name__), path=path, key=key)
                self._tensors[key] = v
            else:
                self.non_tensor.append(key)
        self.schema = {k: TensorInfo(tuple(t.shape), t.dtype) for k, t in self._tensors.items()}

    def read(self, key: str, box: Box) -> torch.Tensor:
        return self._tensors[key][slices(box)]

    def close(self) -> None:
        self._tensors.clear()
