"""A torch.distributed.checkpoint (DCP) folder as a source: ``.metadata`` + ``*.distcp`` files.

The schema comes from the ``.metadata`` file alone (global shape and dtype of each tensor,
plus the chunks it was saved in). ``read(key, box)`` asks DCP's own
:class:`~torch.distributed.checkpoint.FileSystemReader` for exactly the stored chunks that
intersect the box: we build one ``ReadItem`` per intersection and hand them to
``read_data`` with a tiny :class:`~torch.distributed.checkpoint.planner.LoadPlanner` whose
``resolve_tensor`` returns views of the output tensor. DCP's file-format code does the
reading; we only plan it.

Fast path: ``FileSystemWriter`` stores each tensor chunk with ``torch.save`` into its byte range
of a ``.distcp`` file (an embedded zip archive whose one storage record holds the raw bytes,
uncompressed). :meth:`DCPSource.locate_region` finds those bytes from the zip's own structures
(central directory, local header, and the pickled tensor record, read with a restricted
unpickler) and checks them: one storage record, stored uncompressed, the dtype and shape
of ``.metadata`` (a typed storage, or for the dtypes without one, such as the float8 kinds and
``float8_e8m0fnu``, a byte storage with the dtype in the tensor record), contiguous strides, the
data inside the item's byte range. Chunks that pass
are read by the I/O engine with ``preadv`` (and by :meth:`DCPSource.read` from a mapping of
the file); any other chunk (a transform extension, a non-contiguous save, a format we do not
recognise) goes through ``FileSystemReader``.

The ``.metadata`` pickle is read with a restricted unpickler (DCP's metadata classes, torch
dtypes and sizes, paths): a checkpoint cannot run code when its schema is read.

``subtree="model"`` keeps the entries under ``model.`` and strips that prefix (a folder
written by :func:`sdadapt.save_state` holds ``model.*``, ``optim.*`` and extra entries; when
its ``sdadapt.json`` is present the model subtree is chosen by default).
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
import struct
import threading
import warnings
import zipfile
from typing import Any, ClassVar

import torch
from torch.distributed.checkpoint import FileSystemReader, Metadata
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from .._base.regions import Box, box_shape
from .._base.schema import TensorInfo, TensorLocation, slices
from ..errors import SourceError
from ._base import Source, member_path
from ._json import read_json

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
    sizes: dict[str, int] = {}
    for index, info in md.storage_data.items():
        name = getattr(info, "relative_path", None)
        if name not in sizes:
            full = member_path(
                folder, name, what=f"{METADATA_NAME} names data file", path=path, key=getattr(index, "fqn", None), subdirs=False
            )
            real = os.path.realpath(full)
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
    data = read_json(path, None, what="the sdadapt record")
    if not isinstance(data, dict):
        raise SourceError("the sdadapt record is not a JSON object", path=path)
    return data


# --- locating raw chunk bytes inside the torch.save zips of a .distcp file -----------------------

_ZIP_LOCAL = b"PK\x03\x04"
_MAX_PICKLE = 1 << 16


class _FileView(io.RawIOBase):
    """Bytes ``[start, start + length)`` of an open file, as a seekable read-only stream."""

    def __init__(self, fd: int, start: int, length: int):
        self.fd, self.start, self.length, self.pos = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.length}[whence]
        self.pos = max(0, min(self.length, base + pos))
        return self.pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        data = os.pread(self.fd, n, self.start + self.pos) if n else b""
        b[: len(data)] = data
        self.pos += len(data)
        return len(data)


class _Rebuild:
    """The arguments of ``_rebuild_tensor_v2``: (storage, storage_offset, size, stride, ...),
    the storage typed with the tensor's dtype."""

    def __init__(self, *args: Any):
        self.args = args


class _RebuildV3(_Rebuild):
    """The arguments of ``_rebuild_tensor_v3``, which ``torch.save`` writes for the dtypes that
    have no typed storage class (float8 kinds, ``float8_e8m0fnu``, uint16/32/64): an untyped
    (byte) storage, and the tensor's dtype as the seventh argument."""


_UNTYPED = "untyped"
"""The storage dtype of a ``torch.storage.UntypedStorage`` record: its numel counts bytes."""


class _TensorRecordUnpickler(pickle.Unpickler):
    """Reads a ``torch.save`` data.pkl of one plain tensor without building it: returns the
    arguments of ``_rebuild_tensor_v2`` / ``_v3`` and the storage's (dtype, record key, numel)."""

    BUILDS: ClassVar[dict[tuple[str, str], Any]] = {
        ("torch._utils", "_rebuild_tensor_v2"): _Rebuild, ("torch._utils", "_rebuild_tensor_v3"): _RebuildV3,
        ("torch.storage", "UntypedStorage"): _UNTYPED, ("collections", "OrderedDict"): dict,
    }  # fmt: skip
    """What each name the pickle may ask for becomes; besides these, torch's dtypes and typed storages."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.BUILDS:
            return self.BUILDS[module, name]
        if module == "torch" and "." not in name:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                found = getattr(torch, name, None)
                dtype = found if isinstance(found, torch.dtype) else getattr(found, "dtype", None)
            if isinstance(dtype, torch.dtype) and (found is dtype or name.endswith("Storage")):
                return dtype
        raise pickle.UnpicklingError(f"{module}.{name}: not a plain tensor record")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError("unexpected persistent id")
        _, dtype, key, _location, numel = pid
        if not isinstance(dtype, torch.dtype) and dtype != _UNTYPED:
            raise pickle.UnpicklingError("unexpected storage record")
        if not isinstance(key, str) or not isinstance(numel, int):
            raise pickle.UnpicklingError("unexpected storage record")
        return ("storage", dtype, key, numel)


def _storage_bytes(rec: _Rebuild, dtype: torch.dtype) -> int:
    """Size in bytes of the storage of a tensor record of ``dtype``; ``ValueError`` unless the
    record holds ``dtype`` (a v2 storage typed so, or a v3 untyped storage with that dtype)."""
    _, sdtype, _, snumel = rec.args[0]
    if isinstance(rec, _RebuildV3):
        if len(rec.args) < 7 or rec.args[6] != dtype or sdtype != _UNTYPED or any(rec.args[7:8]):
            raise ValueError("record does not match .metadata")
        return snumel
    if sdtype != dtype:
        raise ValueError("record does not match .metadata")
    return snumel * dtype.itemsize


def locate_item(fd: int, offset: int, length: int, dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """File offset of the raw bytes of a tensor chunk that ``torch.save`` wrote into bytes
    ``[offset, offset + length)`` of the file ``fd``; raises ``ValueError`` unless every check
    passes (one uncompressed storage record of exactly the chunk's dtype and shape, contiguous,
    inside the item's range)."""
    view = _FileView(fd, offset, length)
    with zipfile.ZipFile(io.BufferedReader(view, 1 << 16)) as zf:
        infos = zf.infolist()
        pkls = [i for i in infos if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1]
        if len(pkls) != 1:
            raise ValueError("not one data.pkl record")
        root = pkls[0].filename[: -len("data.pkl")]
        data = [i for i in infos if i.filename.startswith(root + "data/")]
        if len(data) != 1 or pkls[0].file_size > _MAX_PICKLE:
            raise ValueError("not one storage record")
        rec = _TensorRecordUnpickler(io.BytesIO(zf.read(pkls[0]))).load()
    info = data[0]
    if not isinstance(rec, _Rebuild) or len(rec.args) < 4:
        raise ValueError("not a plain tensor")
    storage, storage_offset, size, stride = rec.args[:4]
    if not (isinstance(storage, tuple) and storage[0] == "storage"):
        raise ValueError("no storage")
    skey = storage[2]
    nbytes = _storage_bytes(rec, dtype)
    numel = 1
    for n in shape:
        numel *= n
    expect_stride, acc = [], 1
    for n in reversed(shape):
        expect_stride.append(acc)
        acc *= n
    expect_stride.reverse()
    if (
        tuple(size) != tuple(shape)
        or info.filename != f"{root}data/{skey}"
        or info.compress_type != zipfile.ZIP_STORED
        or info.file_size != info.compress_size
        or info.file_size != nbytes
        or not isinstance(storage_offset, int)
        or storage_offset < 0
        or (storage_offset + numel) * dtype.itemsize > nbytes
        or any(s != e for s, e, n in zip(stride, expect_stride, shape, strict=False) if n > 1)
        or len(stride) != len(shape)
    ):
        raise ValueError("record does not match .metadata")
    head = os.pread(fd, 30, offset + info.header_offset)
    if len(head) != 30 or head[:4] != _ZIP_LOCAL:
        raise ValueError("bad local header")
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    if os.pread(fd, name_len, offset + info.header_offset + 30) != info.filename.encode():
        raise ValueError("local header names another record")
    start = info.header_offset + 30 + name_len + extra_len
    if start + info.file_size > length:
        raise ValueError("storage outside the item")
    return offset + start + storage_offset * dtype.itemsize


# what locating a chunk's raw bytes may raise on a record we do not recognise (then: read it
# through DCP's reader)
_UNLOCATABLE = (ValueError, OSError, pickle.UnpicklingError, zipfile.BadZipFile, EOFError, struct.error, TypeError, IndexError, KeyError)


def logger_debug(path: str, key: str, idx: int, e: BaseException) -> None:
    import logging

    logging.getLogger(__name__).debug("%s: chunk %d of %r is read through FileSystemReader (%s)", path, idx, key, e)


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
        self._lock = threading.Lock()
        self._fds: dict[str, int] = {}
        self._maps: dict[str, torch.Tensor] = {}
        self._mms: list[mmap.mmap] = []
        self._located: dict[tuple[str, int], TensorLocation | None] = {}  # (key, chunk index) -> location

    # -- raw chunk locations (see the module docstring) -------------------------------------
    def _fd(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is None:
            fd = self._fds[name] = os.open(os.path.join(self.path, name), os.O_RDONLY)
        return fd

    def _locate_chunk(self, key: str, idx: int) -> TensorLocation | None:
        k = (key, idx)
        if k in self._located:
            return self._located[k]
        md = self._entries[key]
        chunk = md.chunks[idx]
        dtype = md.properties.dtype
        shape = tuple(chunk.sizes)
        loc = None
        info = self.metadata.storage_data.get(MetadataIndex(self._prefix + key, chunk.offsets, idx))
        try:
            if info is None or getattr(info, "transform_descriptors", None):
                raise ValueError("no plain storage entry")
            with self._lock:
                fd = self._fd(info.relative_path)
            offset = locate_item(fd, info.offset, info.length, dtype, shape)
            loc = TensorLocation(os.path.join(self.path, info.relative_path), offset, shape, dtype)
        except _UNLOCATABLE as e:
            logger_debug(self.path, key, idx, e)
        self._located[k] = loc
        return loc

    def _intersecting(self, key: str, box: Box) -> list[tuple[int, Box]]:
        """(chunk index, chunk box) of the stored chunks that intersect ``box``."""
        out = []
        for idx, c in enumerate(self._entries[key].chunks):
            cb = tuple((o, o + n) for o, n in zip(c.offsets, c.sizes, strict=True))
            if not box or all(max(a, o) < min(b, e) for (a, b), (o, e) in zip(box, cb, strict=True)):
                out.append((idx, cb))
        return out

    def locate_region(self, key: str, box: Box) -> list[tuple[Box, TensorLocation]] | None:
        """The stored chunks of ``key`` that intersect ``box``, each as (chunk box in global
        coordinates, :class:`~sdadapt._base.schema.TensorLocation` of its raw bytes), for the I/O
        engine's direct reads; ``None`` when any of them cannot be located (read through
        :meth:`read` then)."""
        if key not in self._entries:
            return None
        out = []
        for idx, cb in self._intersecting(key, box):
            loc = self._locate_chunk(key, idx)
            if loc is None:
                return None
            out.append((cb, loc))
        return out

    def _mapped(self, loc: TensorLocation, box: Box) -> torch.Tensor:
        """Region ``box`` (chunk coordinates) of a located chunk, out of a read-only mapping of
        its file: a view when the chunk's bytes are aligned for its dtype, else a copy of the
        rows the box spans (items are packed back to back, so many are unaligned)."""
        with self._lock:
            buf = self._maps.get(loc.path)
            if buf is None:
                with open(loc.path, "rb") as f:
                    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # read-only buffer: we never write through it
                    buf = self._maps[loc.path] = torch.frombuffer(mm, dtype=torch.uint8)
                self._mms.append(mm)
        n = loc.dtype.itemsize
        for s in loc.shape:
            n *= s
        if loc.offset + n > len(buf):
            raise SourceError("data file shrank since it was opened (being written?)", path=loc.path)
        if loc.offset % loc.dtype.itemsize == 0 or not box:
            raw = buf[loc.offset : loc.offset + n]
            if loc.offset % loc.dtype.itemsize:
                raw = raw.clone()
            return raw.view(loc.dtype).view(loc.shape)[slices(box)]
        (a, b), rest = box[0], box[1:]
        row = n // loc.shape[0] if loc.shape[0] else 0
        rows = buf[loc.offset + a * row : loc.offset + b * row].clone().view(loc.dtype).view((b - a, *loc.shape[1:]))
        return rows[(slice(None), *slices(rest))]

    def chunks_of(self, key: str) -> list[Box]:
        """The boxes the tensor ``key`` was saved in (one per saving shard); an adapter checks with
        them that every element was saved (``adapters/megatron_gpt.py``)."""
        return [
            tuple((o, o + n) for o, n in zip(c.offsets, c.sizes, strict=True)) for c in self._entries[key].chunks
        ]

    def read(self, key: str, box: Box) -> torch.Tensor:
        md = self._entries.get(key)
        if md is None:
            raise SourceError("no such tensor in the DCP checkpoint", path=self.path, key=key)
        out = torch.empty(box_shape(box), dtype=md.properties.dtype)
        if out.numel() == 0:
            return out
        located = self.locate_region(key, box)
        if located is not None:
            covered = 0
            for cb, loc in located:
                lo = [max(a, o) for (a, _), (o, _) in zip(box, cb, strict=True)]
                hi = [min(b, e) for (_, b), (_, e) in zip(box, cb, strict=True)]
                src = self._mapped(loc, tuple((x - o, y - o) for x, y, (o, _) in zip(lo, hi, cb, strict=True)))
                if len(located) == 1 and tuple(src.shape) == tuple(out.shape):
                    return src  # inside one chunk: the mapping's view (or rows copied once)
                out[tuple(slice(x - a, y - a) for x, y, (a, _) in zip(lo, hi, box, strict=True))].copy_(src)
                covered += src.numel()
            if covered >= out.numel():
                return out
        fqn = self._prefix + key
        items: list[ReadItem] = []
        views: dict[int, torch.Tensor] = {}
        covered = 0
        for idx, chunk in enumerate(md.chunks):
            lo = [max(a, o) for (a, _), o in zip(box, chunk.offsets, strict=True)]
            hi = [min(b, o + n) for (_, b), o, n in zip(box, chunk.offsets, chunk.sizes, strict=True)]
            if any(x >= y for x, y in zip(lo, hi, strict=True)) and box:
                continue
            lengths = [y - x for x, y in zip(lo, hi, strict=True)]
            item = ReadItem(
                type=LoadItemType.TENSOR,
                dest_index=MetadataIndex(fqn, [a for a, _ in box]),
                dest_offsets=torch.Size([x - a for x, (a, _) in zip(lo, box, strict=True)]),
                storage_index=MetadataIndex(fqn, chunk.offsets, idx),
                storage_offsets=torch.Size([x - o for x, o in zip(lo, chunk.offsets, strict=True)]),
                lengths=torch.Size(lengths),
            )
            views[id(item)] = out[tuple(slice(x - a, y - a) for x, y, (a, _) in zip(lo, hi, box, strict=True))]
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

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            self._maps.clear()
            self._mms.clear()  # unmapped once no view refers to them

    def files(self) -> list[str]:
        names = sorted({info.relative_path for info in self.metadata.storage_data.values()})
        return [os.path.join(self.path, METADATA_NAME), *(os.path.join(self.path, n) for n in names)]

    def stored_key(self, key: str) -> str:
        return self._prefix + key

    def file_of(self, key: str) -> str:
        md = self._entries.get(key)
        if md is None or not md.chunks:
            return self.path
        info = self.metadata.storage_data.get(MetadataIndex(self._prefix + key, md.chunks[0].offsets))
        return os.path.join(self.path, info.relative_path) if info is not None else self.path
