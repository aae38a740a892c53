"""A torch.distributed.checkpoint (DCP) folder as a source: ``.metadata`` + ``*.distcp`` files.

The schema comes from the ``.metadata`` file alone (global shape and dtype of each tensor,
plus the chunks it was saved in). ``read(key, box)`` asks DCP's own
:class:`~torch.distributed.checkpoint.FileSystemReader` for exactly the stored chunks that
intersect the box: we build one ``ReadItem`` per intersection and hand them to
``read_data`` with a tiny :class:`~torch.distributed.checkpoint.planner.LoadPlanner` whose
``resolve_tensor`` returns views of the output tensor. DCP's file-format code does the
reading; we only plan it.

The ``.metadata`` pickle is read with a restricted unpickler (DCP's metadata classes, torch
dtypes and sizes, paths): a checkpoint cannot run code when its schema is read.

``subtree="model"`` keeps the entries under ``model.`` and strips that prefix (a folder
written by :func:`sdadapt.save_state` holds ``model.*``, ``optim.*`` and extra entries; when
its ``sdadapt.json`` is present the model subtree is chosen by default).
"""

from __future__ import annotations

import io
import json
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, Metadata
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from ..errors import SourceError
from ..nodes import Box, box_shape
from .base import Source, TensorInfo

METADATA_NAME = ".metadata"
SDADAPT_JSON = "sdadapt.json"

_PATH_CLASSES = {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"}


class _MetadataUnpickler(pickle.Unpickler):
    """Only what DCP metadata holds: DCP's metadata classes, torch dtypes/Size, layouts, paths."""

    def find_class(self, module: str, name: str) -> Any:
        if "." not in name:
            if module.startswith("torch.distributed.checkpoint."):
                obj = super().find_class(module, name)
                if isinstance(obj, type) or name == "_MEM_FORMAT_ENCODING":
                    return obj
            elif module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
                return super().find_class(module, name)
            elif (module, name) in {("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}:
                return super().find_class(module, name)
            elif module == "pathlib" and name in _PATH_CLASSES:
                return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP metadata")


def read_dcp_metadata(folder: str) -> Metadata:
    """Read and check a DCP folder's ``.metadata`` (restricted unpickling; no code runs)."""
    path = os.path.join(folder, METADATA_NAME)
    if not os.path.isfile(path):
        others = sorted(n for n in os.listdir(folder) if n.endswith(".distcp") or n.endswith(".metadata"))
        hint = (
            f" It holds {others[:4]}: the save was interrupted before rank 0 wrote .metadata; "
            "use an earlier checkpoint"
            if others
            else ""
        )
        raise SourceError(f"not a complete DCP checkpoint: no {METADATA_NAME} file.{hint}", path=folder)
    try:
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as e:
        raise SourceError(f"refusing to read DCP metadata: {e}", path=path) from None
    except (EOFError, ValueError, OSError, AttributeError, ImportError, IndexError, TypeError) as e:
        raise SourceError(f"corrupt or truncated DCP metadata ({type(e).__name__}: {e})", path=path) from None
    if not isinstance(md, Metadata) or md.storage_data is None:
        raise SourceError("not DCP metadata (no storage data); was it written by dcp.save?", path=path)
    _check_data_files(folder, md, path)
    missing = sorted({info.relative_path for info in md.storage_data.values()} - set(os.listdir(folder)))
    if missing:
        raise SourceError(
            f"DCP data file(s) {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} named by "
            f"{METADATA_NAME} are missing; the checkpoint was copied incompletely",
            path=folder,
        )
    return md


def _check_data_files(folder: str, md: Metadata, path: str) -> None:
    """Every data file named by ``.metadata`` is a plain name inside the folder (no ``..``, no
    absolute path, no symlink leading out), and every stored item lies inside its file: checked
    before anything is read, so a bad checkpoint fails at planning, on every rank."""
    real_folder = os.path.realpath(folder)
    sizes: dict[str, int] = {}
    for index, info in md.storage_data.items():
        name = getattr(info, "relative_path", None)
        if name not in sizes:
            if not isinstance(name, str) or not name or os.path.isabs(name) or "/" in name or "\\" in name or "\x00" in name or name in (".", ".."):
                raise SourceError(
                    f"{METADATA_NAME} names data file {name!r}, which is not a plain file name inside the "
                    "folder; refusing to read outside the checkpoint folder",
                    path=path,
                    key=getattr(index, "fqn", None),
                )
            full = os.path.join(folder, name)
            real = os.path.realpath(full)
            if os.path.commonpath([real, real_folder]) != real_folder:
                raise SourceError(
                    f"data file {name!r} resolves to {real} outside the checkpoint folder (a symlink?); "
                    "refusing to read it",
                    path=path,
                    key=getattr(index, "fqn", None),
                )
            sizes[name] = os.path.getsize(real) if os.path.isfile(real) else -1
        size = sizes[name]
        off, length = getattr(info, "offset", None), getattr(info, "length", None)
        if size < 0:
            continue  # reported as missing below
        if not isinstance(off, int) or not isinstance(length, int) or off < 0 or length < 0 or off + length > size:
            raise SourceError(
                f"{METADATA_NAME} places this entry at bytes [{off}, {off}+{length}) of {name}, which has "
                f"{size} bytes: the data file is corrupt or truncated, or does not belong to this .metadata; copy the "
                "checkpoint again",
                path=os.path.join(folder, name),
                key=getattr(index, "fqn", None),
            )


def read_sdadapt_json(folder: str) -> dict[str, Any] | None:
    """The record :func:`sdadapt.save_state` writes beside the checkpoint, if there is one."""
    path = os.path.join(folder, SDADAPT_JSON)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise SourceError(f"cannot read the sdadapt record: {e}", path=path) from None
    if not isinstance(data, dict):
        raise SourceError("the sdadapt record is not a JSON object", path=path)
    return data


class _IntoViews(LoadPlanner):
    """The minimal LoadPlanner ``FileSystemReader.read_data`` needs: tensors land in
    prepared views, bytes entries in a dict."""

    def __init__(self, views: dict[int, torch.Tensor]):
        self.views = views
        self.objects: dict[str, Any] = {}

    def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
        pass

    def create_local_plan(self) -> LoadPlan:
        raise NotImplementedError

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        raise NotImplementedError

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        raise NotImplementedError

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.objects[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return self.views[id(read_item)]

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


class DCPSource(Source):
    """A DCP checkpoint folder (``dcp.save`` with the default ``FileSystemWriter``)."""

    def __init__(self, folder: str, subtree: str | None = None):
        self.path = folder
        self.metadata = read_dcp_metadata(folder)
        self.record = read_sdadapt_json(folder)
        if subtree is None and self.record is not None:
            subtree = self.record.get("model_key") or None
        self.subtree = subtree
        prefix = f"{subtree}." if subtree else ""
        self._prefix = prefix
        self._entries: dict[str, TensorStorageMetadata] = {}
        self.schema = {}
        self.non_tensor = []
        for fqn, md in self.metadata.state_dict_metadata.items():
            if not fqn.startswith(prefix):
                continue
            key = fqn[len(prefix) :]
            if isinstance(md, TensorStorageMetadata):
                self._entries[key] = md
                self.schema[key] = TensorInfo(tuple(md.size), md.properties.dtype)
            else:
                self.non_tensor.append(key)
        if subtree and not self.schema and not self.non_tensor:
            tops = sorted({k.split(".", 1)[0] for k in self.metadata.state_dict_metadata})
            raise SourceError(f"subtree {subtree!r}: no entries under {prefix!r} (top-level names: {tops[:8]})", path=folder)
        self._reader = FileSystemReader(folder)
        self._reader.set_up_storage_reader(self.metadata, is_coordinator=True)

    def chunks_of(self, key: str) -> list[Box]:
        """The boxes the tensor ``key`` was saved in (one per saving shard)."""
        return [
            tuple((o, o + n) for o, n in zip(c.offsets, c.sizes)) for c in self._entries[key].chunks
        ]

    def read(self, key: str, box: Box) -> torch.Tensor:
        md = self._entries.get(key)
        if md is None:
            raise SourceError("no such tensor in the DCP checkpoint", path=self.path, key=key)
        out = torch.empty(box_shape(box), dtype=md.properties.dtype)
        if out.numel() == 0:
            return out
        fqn = self._prefix + key
        items: list[ReadItem] = []
        views: dict[int, torch.Tensor] = {}
        covered = 0
        for idx, chunk in enumerate(md.chunks):
            lo = [max(a, o) for (a, _), o in zip(box, chunk.offsets)]
            hi = [min(b, o + n) for (_, b), o, n in zip(box, chunk.offsets, chunk.sizes)]
            if any(x >= y for x, y in zip(lo, hi)) and box:
                continue
            lengths = [y - x for x, y in zip(lo, hi)]
            item = ReadItem(
                type=LoadItemType.TENSOR,
                dest_index=MetadataIndex(fqn, [a for a, _ in box]),
                dest_offsets=torch.Size([x - a for x, (a, _) in zip(lo, box)]),
                storage_index=MetadataIndex(fqn, chunk.offsets, idx),
                storage_offsets=torch.Size([x - o for x, o in zip(lo, chunk.offsets)]),
                lengths=torch.Size(lengths),
            )
            views[id(item)] = out[tuple(slice(x - a, y - a) for x, y, (a, _) in zip(lo, hi, box))]
            items.append(item)
            n = 1
            for v in lengths:
                n *= v
            covered += n
        if covered < out.numel():
            raise SourceError(
                f"the stored chunks cover {covered} of the {out.numel()} elements of region {list(box)}; "
                "the checkpoint is incomplete",
                path=self.path,
                key=key,
            )
        self._read(LoadPlan(items), _IntoViews(views), key)
        return out

    def read_object(self, key: str) -> Any:
        """A non-tensor entry (loaded with ``weights_only=True``)."""
        fqn = self._prefix + key
        md = self.metadata.state_dict_metadata.get(fqn)
        if not isinstance(md, BytesStorageMetadata):
            raise SourceError("no such non-tensor entry in the DCP checkpoint", path=self.path, key=key)
        idx = MetadataIndex(fqn)
        item = ReadItem(LoadItemType.BYTE_IO, idx, torch.Size([0]), idx, torch.Size([0]), torch.Size([0]))
        planner = _IntoViews({})
        self._read(LoadPlan([item]), planner, key)
        return planner.objects[fqn]

    def _read(self, plan: LoadPlan, planner: _IntoViews, key: str) -> None:
        try:
            self._reader.read_data(plan, planner).wait()
        except SourceError:
            raise
        except Exception as e:  # noqa: BLE001 - name the file and key, keep the cause
            files = sorted({self.metadata.storage_data[i.storage_index].relative_path for i in plan.items})
            raise SourceError(
                f"reading from {', '.join(files)} failed ({type(e).__name__}: {e}); the data file is corrupt "
                "or truncated",
                path=self.path,
                key=key,
            ) from e

    def file_of(self, key: str) -> str:
        md = self._entries.get(key)
        if md is None or not md.chunks:
            return self.path
        info = self.metadata.storage_data.get(MetadataIndex(self._prefix + key, md.chunks[0].offsets))
        return os.path.join(self.path, info.relative_path) if info is not None else self.path
