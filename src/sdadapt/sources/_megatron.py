"""What Megatron-Core's ``dist_checkpointing`` writes beside a ``torch_dist`` DCP folder.

A ``torch_dist`` checkpoint is a DCP folder (``.metadata``, ``__*_*.distcp``: opened by
:class:`~sdadapt.sources._dcp_dir.DCPSource`, each tensor under its global key with the global
shape, whatever TP / PP / EP degree wrote it) plus two files of Megatron's own:

- ``metadata.json``: the backends and their versions
  (``{"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
  "common_backend_version": 1}``);
- ``common.pt``: a ``torch.save`` of the state that is not sharded: Megatron-LM's ``args`` (an
  ``argparse.Namespace`` holding the model's options), ``checkpoint_version``, ``iteration``, and
  the ``content_metadata`` the save was given (``singleton_local_shards``...).

``common.pt`` is read with a restricted unpickler that builds nothing of what it names: an
``argparse.Namespace`` becomes a dict, torch dtypes stay dtypes, any other class or function
(an enum of Megatron's, a tensor) becomes an inert :class:`Opaque` record of its name and
arguments, and no tensor data is read. A checkpoint cannot run code when its options are read.
"""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..errors import SourceError
from ._json import read_json

METADATA_JSON = "metadata.json"
COMMON_PT = "common.pt"
_COMMON_LIMIT = 64 << 20  # bytes of common.pt's pickle (real ones: KBs)


class Opaque:
    """A class or function ``common.pt`` named that sdadapt does not build: its dotted name, the
    arguments it was called with and the state it was given, kept as data."""

    origin = "?"

    def __init__(self, *args: Any, **kwargs: Any):
        self.args, self.kwargs, self.state = args, kwargs, None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{self.origin}{self.args!r}>"


class _Namespace(dict):
    """``argparse.Namespace`` as a dict of its attributes."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.update(state)


_opaque_classes: dict[str, type] = {}


def _opaque(module: str, name: str) -> type:
    origin = f"{module}.{name}"
    cls = _opaque_classes.get(origin)
    if cls is None:
        cls = _opaque_classes[origin] = type(name, (Opaque,), {"origin": origin})
    return cls


class _CommonUnpickler(pickle.Unpickler):
    BUILDS: ClassVar[dict[tuple[str, str], Any]] = {
        ("argparse", "Namespace"): _Namespace, ("collections", "OrderedDict"): dict, ("torch", "Size"): tuple,
        **{("builtins", c.__name__): c for c in (set, frozenset, slice, complex)},
    }  # fmt: skip
    """What each name the pickle may ask for becomes; besides these, torch's dtypes, and any other
    name an :class:`Opaque` record of it."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.BUILDS:
            return self.BUILDS[module, name]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        return _opaque(module, name)

    def persistent_load(self, pid: Any) -> Any:
        return _opaque("torch", "storage")(*(pid if isinstance(pid, tuple) else (pid,)))


@dataclass
class MegatronCommon:
    """What ``metadata.json`` and ``common.pt`` say about a ``torch_dist`` checkpoint."""

    backends: tuple[Any, Any, Any, Any]
    args: dict[str, Any] | None
    checkpoint_version: Any = None
    iteration: Any = None
    content_metadata: dict[str, Any] = field(default_factory=dict)


def read_common(folder: str) -> MegatronCommon:
    """Read ``metadata.json`` and ``common.pt`` of a Megatron-Core checkpoint (no code runs).

    Args:
        folder: the checkpoint folder (a local folder, or the mirror of an object storage URL:
            ``common.pt``'s records other than tensor data are fetched when it is opened).

    Returns:
        The backends, Megatron-LM's ``args`` as a dict (``None`` when the save held none),
        ``checkpoint_version``, ``iteration`` and the content metadata.

    Raises:
        SourceError: naming the file: no ``metadata.json``, or it or ``common.pt`` is unreadable.
    """
    path = os.path.join(folder, METADATA_JSON)
    if not os.path.isfile(path):
        raise SourceError(
            "not a Megatron-Core dist_checkpointing folder: no metadata.json (a torch_dist save writes it last; "
            "the save did not finish, or this is a plain DCP folder: load it without the megatron_gpt adapter)",
            path=folder,
        )
    meta = read_json(path, None, what=METADATA_JSON)
    if not isinstance(meta, dict):
        raise SourceError("metadata.json is not a JSON object", path=path)
    backends = (meta.get("sharded_backend"), meta.get("sharded_backend_version"), meta.get("common_backend"),
                meta.get("common_backend_version"))
    common = _read_common_pt(os.path.join(folder, COMMON_PT))
    args = common.get("args")
    return MegatronCommon(
        backends=backends,
        args=dict(args) if isinstance(args, dict) else None,
        checkpoint_version=common.get("checkpoint_version"),
        iteration=common.get("iteration"),
        content_metadata=dict(common.get("content_metadata") or {}) if isinstance(common.get("content_metadata"), dict) else {},
    )


def _read_common_pt(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    try:
        with zipfile.ZipFile(path) as zf:
            pkls = [i for i in zf.infolist() if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1]
            if len(pkls) != 1 or pkls[0].file_size > _COMMON_LIMIT:
                raise SourceError("common.pt is not one torch.save record of a usual size", path=path)
            data = _CommonUnpickler(io.BytesIO(zf.read(pkls[0]))).load()
    except SourceError:
        raise
    except (zipfile.BadZipFile, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError,
            KeyError, OSError) as e:
        raise SourceError(f"cannot read Megatron's common state ({type(e).__name__}: {e}); the file is corrupt or "
                          "was not written by Megatron-Core's dist_checkpointing.save", path=path) from None
    if not isinstance(data, dict):
        raise SourceError(f"common.pt holds a {type(data).__name__}, not Megatron's common state dict", path=path)
    return data
