"""Checkpoint sources: open a path, get its schema from headers, read regions lazily.

Besides the public names (``__all__``), this module is the package's face for the layers above:
what they use of the private modules (the formats, checksums, side files, the header record,
object storage) they import from here, never from those modules (``tests/project/test_layers.py``
checks that); those names are not public API.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .._base.schema import TensorInfo, dtype_name
from ..errors import SdadaptError, SourceError
from . import _headers
from ._assets import copy_side_files as copy_side_files
from ._assets import loaded_from as loaded_from
from ._assets import model_config as model_config
from ._assets import remember_source as remember_source
from ._assets import transformers_config as transformers_config
from ._assets import write_config as write_config
from ._base import HUB_PREFIX, Source, is_hub_id, is_url
from ._checks import CHECKSUMS_WHY as CHECKSUMS_WHY
from ._checks import Fingerprint as Fingerprint
from ._checks import check_unchanged as check_unchanged
from ._checks import fingerprint as fingerprint
from ._checks import nonfinite_counts as nonfinite_counts
from ._formats import FILE_SUFFIXES as FILE_SUFFIXES
from ._formats import FOREIGN_SUFFIXES, open_local
from ._formats import WEIGHT_SUFFIXES as WEIGHT_SUFFIXES
from ._formats import embedded_config as embedded_config
from ._formats import format_of as format_of
from ._formats import recordable as recordable
from ._headers import HeaderRecord as HeaderRecord
from ._hf_sharded import INDEX_NAME
from ._hf_sharded import HFShardedSource as HFShardedSource
from ._json import INDEX_LIMIT as INDEX_LIMIT
from ._json import ShardIndex as ShardIndex
from ._json import read_json as read_json
from ._json import read_json_dict
from ._json import validate as validate
from ._peft import CONFIG_NAME as CONFIG_NAME
from ._peft import LoraMerged as LoraMerged
from ._peft import open_peft_weights as open_peft_weights
from ._peft import read_peft_config as read_peft_config
from ._safetensors_file import DTYPE_NAMES as DTYPE_NAMES
from ._safetensors_file import SafetensorsFile as SafetensorsFile

# a rank's header reads, recorded and replayed (:mod:`._headers`), under names that say so here
recording_headers = _headers.recording
replaying_headers = _headers.replaying
encode_headers = _headers.encode
decode_headers = _headers.decode

if TYPE_CHECKING:
    from ._configs import HFConfig as HFConfig
    from ._configs import PeftConfig as PeftConfig
    from ._configs import QuantConfigFile as QuantConfigFile
    from ._dcp_dir import SDADAPT_JSON as SDADAPT_JSON
    from ._dcp_dir import DCPSource as DCPSource
    from ._fetching import Fetching as Fetching
    from ._fetching import ObjectFile as ObjectFile
    from ._hub import hub_folder as hub_folder
    from ._integrity import CHECKSUMS_NAME as CHECKSUMS_NAME
    from ._integrity import ChecksummedSource as ChecksummedSource
    from ._integrity import StreamedChecksums as StreamedChecksums
    from ._integrity import checksums_of_saved as checksums_of_saved
    from ._integrity import read_checksums as read_checksums
    from ._integrity import tensor_checksums as tensor_checksums
    from ._integrity import write_checksums_data as write_checksums_data
    from ._integrity import write_checksums_shared as write_checksums_shared
    from ._inventory import human as human
    from ._inventory import inventory as inventory
    from ._joined import JoinedSource as JoinedSource
    from ._namespaced import NamespacedSource as NamespacedSource
    from ._object_store import COMMIT_NAMES as COMMIT_NAMES
    from ._object_store import Uploader as Uploader
    from ._object_store import check_writable as check_writable
    from ._object_store import upload as upload
    from ._object_writer import ObjectWriter as ObjectWriter
    from ._remote import fetch_all as fetch_all
    from ._remote import fetch_dcp_entries as fetch_dcp_entries
    from ._torch_save import TorchSaveFile as TorchSaveFile

_LAZY = {
    "DCPSource": "._dcp_dir", "SDADAPT_JSON": "._dcp_dir", "hub_folder": "._hub", "human": "._inventory",
    "inventory": "._inventory", "JoinedSource": "._joined", "Fetching": "._fetching", "ObjectFile": "._fetching",
    "ObjectWriter": "._object_writer", "NamespacedSource": "._namespaced", "COMMIT_NAMES": "._object_store",
    "Uploader": "._object_store", "check_writable": "._object_store", "upload": "._object_store",
    "fetch_all": "._remote", "fetch_dcp_entries": "._remote", "TorchSaveFile": "._torch_save",
    "HFConfig": "._configs", "PeftConfig": "._configs", "QuantConfigFile": "._configs",
    **dict.fromkeys(("CHECKSUMS_NAME", "ChecksummedSource", "StreamedChecksums", "checksums_of_saved", "read_checksums", "tensor_checksums",
                     "write_checksums_data", "write_checksums_shared"), "._integrity"),
}  # fmt: skip
"""Names of modules imported on first use, which a plain load does not import: the DCP source
(it imports ``torch.distributed.checkpoint``), the Hub, the inventory, the joined (LoRA) source,
the fetching of object storage ranges into memory, the writer of objects in parts (exports), a
training state's model as a source, object storage and its local mirrors (a URL's source), the
``torch.save`` reader, the config files' models, the checksums (``checksums=True`` and their writers)."""

__all__ = ["Source", "TensorInfo", "dtype_name", "open_source", "read_config_file", "read_megatron_common"]
"""The public names. ``SafetensorsFile``, ``HFShardedSource`` and ``TorchSaveFile`` (what
:func:`open_source` returns), ``local_path`` and the names imported above for the layers above
stay importable from here for sdadapt's own modules; users open checkpoints with
:func:`open_source` and use the :class:`Source` protocol."""


def __getattr__(name: str) -> Any:
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib  # noqa: PLC0415 - only for the lazy names

    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value
    return value


def _remote_module() -> Any:
    """:mod:`._remote` where a URL was opened in this process, else ``None``: the mirrors of object
    storage are registered there, so a process that never imported it has none (a local load
    then never imports object storage's modules)."""
    return sys.modules.get(f"{__name__}._remote")


def attach(source: Source, path: str) -> Source:
    """``source`` (opened on ``path``) as a remote source when ``path`` lies in a URL's mirror."""
    remote = _remote_module()
    return source if remote is None else remote.attach(source, path)


def in_urls(error: SdadaptError) -> SdadaptError:
    """``error`` with every mirror path in its message written as its URL."""
    remote = _remote_module()
    return error if remote is None else remote.in_urls(error)


def object_file(path: str) -> ObjectFile | None:
    """The object a mirror file stands for, read by the engine straight into memory; ``None``
    for a local file."""
    remote = _remote_module()
    return None if remote is None else remote.object_file(path)


def fetching_for(source: Source, share: int, request_bytes: int | None = None, concurrency: int | None = None) -> Fetching | None:
    """How the engine fetches ``share`` bytes of ``source``; ``None`` for a source of local files
    (see :func:`._remote.fetching_for`)."""
    if source.remote_url() is None:
        return None
    from ._remote import fetching_for as fetching  # noqa: PLC0415 - object storage loads only

    return fetching(source, share, request_bytes, concurrency)


def open_source(
    path: str | os.PathLike[str] | Source,
    *,
    subtree: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Source:
    """Open a checkpoint by path and read its schema (headers only; no tensor is read).

    Args:
        path: what to open:

            - a ``.safetensors`` file; a folder with ``model.safetensors.index.json`` (HF
              sharded) or a single ``model.safetensors``; an ``*.index.json`` file;
            - a DCP folder (``.metadata`` and ``*.distcp`` files);
            - a GGUF file (``.gguf``, llama.cpp's format; quantized tensors need ``sdadapt[gguf]``);
            - a ``torch.save`` zip file (any other file);
            - a Hugging Face Hub id ``hf://org/name[@revision]``: the files a load needs, from
              the Hub cache (downloaded if missing; needs ``sdadapt[hub]``);
            - an object storage URL ``s3://bucket/prefix`` or ``gs://bucket/prefix`` naming any of
              the above: headers fetched now, tensor bytes when read (needs ``sdadapt[s3]`` or
              ``sdadapt[gcs]``; see docs/object-storage.md);
            - a :class:`Source`, returned as it is.
        subtree: the nested dict of a ``torch.save`` file or DCP folder to read
            (``"model"``); safetensors keys are flat and refuse it.
        storage_options: for a URL, the object store client's settings beyond the standard
            environment variables (``{"endpoint": ..., "region": ...}``; obstore's keys, plus
            ``client_options`` and ``retry_config`` dicts). Pass the opened source to
            ``load``, ``diff``... to use them there.

    Returns:
        The open :class:`Source`: ``source.schema`` maps each key to its :class:`TensorInfo`;
        use it as a context manager (or call ``close()``) to release its files.

    Raises:
        SourceError: the path does not exist, holds no checkpoint sdadapt knows (the message
            says what to pass instead), or its headers are broken.

    Example::

        with sdadapt.sources.open_source("ckpt/model.safetensors") as src:
            shapes = {key: (info.shape, info.dtype) for key, info in src.schema.items()}
    """
    if isinstance(path, Source):
        return path
    p = local_path(path, storage_options)
    try:
        source = _open_local(p, subtree)
    except SdadaptError as e:
        raise in_urls(e) from None  # a URL's mirror file named as the URL
    return attach(source, p)  # a URL's mirror: fetch tensor bytes when read


def checkpoint_schema(src: str | os.PathLike[str] | Source, subtree: str | None = None) -> dict[str, TensorInfo]:
    """The tensors of ``src``: an open source's, or those of the checkpoint at that path (opened
    for its headers, then closed)."""
    if isinstance(src, Source):
        return dict(src.schema)
    with open_source(src, subtree=subtree) as source:
        return dict(source.schema)


def _open_local(p: str, subtree: str | None) -> Source:
    if not os.path.exists(p):
        if _looks_like_hub_id(p):
            raise SourceError(
                "looks like a Hugging Face Hub id, not a local path (none exists here); to read it from the "
                f"Hub write {HUB_PREFIX}{p} (needs `pip install 'sdadapt[hub]'`), or pass a local folder",
                path=p,
            )
        raise SourceError("no such file or folder", path=p)
    latest = os.path.join(p, "latest_checkpointed_iteration.txt")
    if os.path.isfile(latest) and not os.path.isfile(os.path.join(p, ".metadata")):
        raise SourceError(_megatron_root(p, latest), path=p)
    source = open_local(p, subtree)
    if source is None:
        raise SourceError(_no_checkpoint_in(p), path=p)
    return source


def _megatron_root(folder: str, latest: str) -> str:
    """What to pass instead of the root of Megatron-LM's checkpoint folders."""
    with open(latest, encoding="utf-8", errors="replace") as f:
        text = f.read(64).strip()
    found = sorted(n for n in os.listdir(folder) if n.startswith("iter_"))
    pick = f"iter_{int(text):07d}" if text.isdigit() else (found[-1] if found else "iter_<N>")
    return (
        "this is the root of Megatron-LM's checkpoints (latest_checkpointed_iteration.txt says "
        f"{text!r}); pass one checkpoint folder, such as {os.path.join(folder, pick)}"
    )


def _no_checkpoint_in(folder: str) -> str:
    """Why ``folder`` is no checkpoint sdadapt opens, and what to pass instead. Several weight
    files without an index are shards: one of them alone would load only a part of the model."""
    names = sorted(os.listdir(folder))
    known = f"no checkpoint sdadapt knows (no {INDEX_NAME}, model.safetensors or DCP .metadata)"
    indexes = [n for n in names if n.endswith(".index.json")]
    if indexes:
        return (
            f"folder holds {known}, but it has the index {indexes[0]}: pass that file "
            f"({os.path.join(folder, indexes[0])}) to read the shards it lists"
        )
    weights = [n for n in names if n.endswith(WEIGHT_SUFFIXES) and not n.endswith(FOREIGN_SUFFIXES)]
    if len(weights) > 1:
        shown = ", ".join(weights[:4]) + (f", ... ({len(weights)} files)" if len(weights) > 4 else "")
        return (
            f"folder holds {known}; its {len(weights)} weight files ({shown}) look like the shards of one "
            f"checkpoint, and {INDEX_NAME} (which says which shard holds each key) is missing. Loading one "
            f"shard would load only a part of the model: copy {INDEX_NAME} from the release the shards "
            "came with into this folder (or, for a single-file checkpoint, pass that file itself)"
        )
    if weights:
        return f"folder holds {known}; pass the checkpoint file itself: {os.path.join(folder, weights[0])}"
    return f"folder holds {known}; it has {names[:8]}"


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a release's JSON config file (``config.json``, Meta's ``params.json``, ModelOpt's
    ``hf_quant_config.json``) as a dict, with the fields adapters use type-checked.

    The file is size- and depth-limited before it is parsed; the fields adapters read (head
    counts, sizes, ``quantization_config``; ``quantization`` for ``hf_quant_config.json``)
    must have their types, the others are returned unchecked.

    Args:
        path: the file.

    Returns:
        The file's JSON object, every field included.

    Raises:
        SourceError: naming the file and the field: too large, not JSON, not an object, or a
            field of the wrong type (``num_attention_heads: "32"``).

    Example::

        cfg = sdadapt.sources.read_config_file("release/config.json")
        heads = cfg.get("num_attention_heads")
    """
    p = os.fspath(path)
    name = os.path.basename(p)
    from ._configs import HFConfig, QuantConfigFile  # noqa: PLC0415 - where a config file is read

    model = QuantConfigFile if name == "hf_quant_config.json" else HFConfig
    return read_json_dict(p, model, what=name)


def read_megatron_common(path: str | os.PathLike[str] | Source) -> dict[str, Any]:
    """Read what Megatron-Core's ``dist_checkpointing.save`` wrote beside a ``torch_dist``
    checkpoint's tensors: ``metadata.json`` (the backends) and ``common.pt`` (Megatron-LM's
    ``args``, ``checkpoint_version``, ``iteration``, the content metadata), without running any
    of its code: ``common.pt`` is read with a restricted unpickler that builds no class it names
    (``argparse.Namespace`` becomes a dict; other objects inert records) and reads no tensor data.

    Args:
        path: the checkpoint folder (an ``iter_0000100`` folder of Megatron-LM), its object
            storage URL, or the open :class:`Source` of one.

    Returns:
        ``{"backends": (sharded backend, version, common backend, version), "args": dict or None,
        "checkpoint_version": ..., "iteration": ..., "content_metadata": dict}``.

    Raises:
        SourceError: naming the file: no ``metadata.json`` (not a Megatron-Core checkpoint), or
            it or ``common.pt`` cannot be read.

    Example::

        common = sdadapt.sources.read_megatron_common("checkpoints/iter_0000100")
        layers = common["args"]["num_layers"]
    """
    from dataclasses import asdict  # noqa: PLC0415 - only here

    from ._megatron import read_common  # noqa: PLC0415 - Megatron checkpoints only

    folder = path.path if isinstance(path, Source) else local_path(path)
    try:
        return asdict(read_common(folder))
    except SdadaptError as e:
        raise in_urls(e) from None


def local_path(path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> str:
    """``path`` as a string; for a Hub id (``hf://org/name[@revision]``), the local snapshot
    folder holding the files a load needs (fetched into the Hub cache if missing); for an object
    storage URL, its local mirror (headers fetched; see :mod:`._remote`)."""
    p = os.fspath(path)
    if is_url(p):
        from ._remote import remote_root  # noqa: PLC0415 - only for a URL

        return remote_root(p, storage_options)
    if not is_hub_id(p):
        return p
    from ._hub import hub_folder  # imported only for a Hub id

    return hub_folder(p)


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def _looks_like_hub_id(p: str) -> bool:
    """``org/name`` (one slash, Hub-legal characters), not a file name, under no existing folder."""
    return (
        _HUB_ID.fullmatch(p) is not None
        and not p.lower().endswith(FILE_SUFFIXES)
        and not os.path.isdir(p.split("/")[0])
    )

