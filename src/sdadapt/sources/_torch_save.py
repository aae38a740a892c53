"""One ``torch.save`` file (zip format), mapped with ``torch.load(mmap=True, weights_only=True)``.

Mapping reads the pickle (the header) and no tensor bytes; a region read touches only its
pages. Nested dicts are flattened with dots (``{"model": {"w": t}}`` -> ``model.w``);
``subtree="model"`` keeps one branch and strips its prefix.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import struct
import zipfile
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from .._base.regions import Box
from .._base.schema import TensorInfo, TensorLocation, slices
from ..errors import SourceError
from ._base import Format, Source, nonempty

log = logging.getLogger(__name__)

_SHARDED_HINT = (
    "it holds sharded pieces ({what}) rather than full tensors: it was saved from a "
    "parallelised model. Save full tensors instead (get_model_state_dict(model, "
    "options=StateDictOptions(full_state_dict=True, cpu_offload=True)) on rank 0), or save "
    "with torch.distributed.checkpoint and load that folder."
)


def _load_mapped(path: str) -> Any:
    if not zipfile.is_zipfile(path):
        with open(path, "rb") as f:
            head = f.read(4)
        if head[:1] == b"\x80":
            raise SourceError(
                "legacy (non-zip) torch.save format, which cannot be memory-mapped; re-save it "
                "once with a current torch: torch.save(torch.load(path, weights_only=True), new_path)",
                path=path,
            )
        if head == b"PK\x03\x04":
            raise SourceError(
                "corrupt or truncated torch.save file: it starts like a zip archive but its directory "
                "at the end is missing or damaged (interrupted save or download?); save or download it again",
                path=path,
            )
        raise SourceError("not a torch.save (zip) file, a safetensors file, or a checkpoint folder", path=path)
    try:
        return torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        text = str(e)
        if "DTensor" in text or "ShardedTensor" in text or "_StridedShard" in text or "DeviceMesh" in text:
            raise SourceError(_SHARDED_HINT.format(what="DTensor/ShardedTensor"), path=path) from None
        found = re.search(r"GLOBAL ([\w.]+)", text)
        what = f"it pickles {found.group(1)}" if found else (text.strip().splitlines() or ["unpickling failed"])[0]
        raise SourceError(
            f"refusing to unpickle objects other than tensors and plain containers ({what}); sdadapt "
            "never runs code from a checkpoint (weights_only=True). Save a dict of tensors instead",
            path=path,
        ) from None
    except Exception as e:  # noqa: BLE001 - a damaged pickle raises all sorts (IndexError, struct.error...)
        raise SourceError(f"corrupt or truncated torch.save file ({type(e).__name__}: {e})", path=path) from None


def _flatten(obj: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            _flatten(v, f"{prefix}{k}.", out) if isinstance(v, Mapping) else out.__setitem__(f"{prefix}{k}", v)
    else:
        out[prefix.rstrip(".")] = obj


def _data_records(path: str) -> list[tuple[int, int]]:
    """(file offset, size) of each tensor data record (``<archive>/data/<key>``) of the zip,
    from the zip directory and the 30-byte local headers: no tensor bytes are read."""
    out = []
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        for info in z.infolist():
            parts = info.filename.split("/")
            if len(parts) != 3 or parts[1] != "data" or info.file_size == 0:
                continue
            f.seek(info.header_offset)
            local = f.read(30)
            if len(local) < 30 or local[:4] != b"PK\x03\x04":
                raise SourceError(f"corrupt zip record {info.filename!r}", path=path)
            n, m = int.from_bytes(local[26:28], "little"), int.from_bytes(local[28:30], "little")
            out.append((info.header_offset + 30 + n + m, info.file_size))
    return sorted(out)


def _check_records(path: str, tensors: dict[str, torch.Tensor]) -> None:
    """Every mapped storage must lie inside its own zip record. ``torch.load(mmap=True)`` slices
    the mapped file by the sizes the pickle states without checking them against the record, so
    a damaged file would otherwise give other records' bytes (or zip headers) as tensor values."""
    storages: dict[int, tuple[int, str]] = {}
    for key, t in tensors.items():
        st = t.untyped_storage()
        if st.nbytes():
            storages.setdefault(st.data_ptr(), (st.nbytes(), key))
    if not storages:
        return
    try:
        records = _data_records(path)
    except (OSError, zipfile.BadZipFile) as e:
        raise SourceError(f"corrupt or truncated torch.save file ({type(e).__name__}: {e})", path=path) from None
    by_offset = dict(records)
    lowest = min(storages)
    # All storages are slices of one mapping of the file: find its base address, i.e. the record
    # the lowest storage starts at (the lowest record in any file torch.save wrote).
    for first, _ in records:
        base = lowest - first
        if all(by_offset.get(ptr - base, -1) >= n for ptr, (n, _) in storages.items()):
            return
    base = lowest - records[0][0] if records else lowest
    misfits = [key for ptr, (n, key) in sorted(storages.items()) if by_offset.get(ptr - base, -1) < n]
    bad = misfits[0] if misfits else storages[lowest][1]
    raise SourceError(
        "corrupt torch.save file: the tensor's data record in the zip is shorter than the tensor "
        "(damaged or hand-edited archive); save or download it again",
        path=path,
        key=bad,
    )


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
        _check_records(path, self._tensors)
        self.schema = {k: TensorInfo(tuple(t.shape), t.dtype) for k, t in self._tensors.items()}
        self._locations: dict[str, TensorLocation] | None = None

    def locate(self, key: str) -> TensorLocation | None:
        """File offsets of the tensors' bytes (see :func:`file_offsets`), found on first use."""
        if self._locations is None:
            try:
                self._locations = file_offsets(self.path, self._tensors)
            except Exception as e:  # noqa: BLE001 - an optimisation only: fall back to mapped reads
                log.debug("%s: no file offsets for direct reads (%s); using the mapping", self.path, e)
                self._locations = {}
        return self._locations.get(key)

    def read(self, key: str, box: Box) -> torch.Tensor:
        return self._tensors[key][slices(box)]

    def close(self) -> None:
        self._tensors.clear()


def file_offsets(path: str, tensors: dict[str, torch.Tensor]) -> dict[str, TensorLocation]:
    """File offsets of a mapped ``torch.save`` zip file's tensors.

    ``torch.load(mmap=True)`` maps the whole file once and makes each storage a slice of that
    mapping at its zip record's offset. So ``storage pointer - record offset`` is one constant
    (the mapping's base) for every storage; we find it, check that every storage agrees, and
    check a few tensors' first bytes against the file. If anything disagrees we return ``{}``
    and the source is read through its mapping instead."""
    reader = torch._C.PyTorchFileReader(path)
    offsets = sorted(
        reader.get_record_offset(name) for name in reader.get_all_records() if "/data/" in f"/{name}" and not name.endswith(".pkl")
    )
    if not offsets or not tensors:
        return {}
    offset_set = set(offsets)
    ptrs = {k: t.untyped_storage().data_ptr() for k, t in tensors.items() if t.untyped_storage().nbytes() > 0}
    if not ptrs:
        return {}
    lowest = min(ptrs.values())
    base = None
    for cand in offsets:  # the lowest storage sits at one of the record offsets
        b = lowest - cand
        if all((p - b) in offset_set for p in ptrs.values()):
            base = b
            break
    if base is None:
        return {}
    out = {}
    for k, t in tensors.items():
        if k not in ptrs or not t.is_contiguous():
            continue
        out[k] = TensorLocation(path, ptrs[k] - base + t.storage_offset() * t.element_size(), tuple(t.shape), t.dtype)
    # spot-check bytes against the file itself
    with open(path, "rb") as f:
        for k in list(out)[:: max(1, len(out) // 8)]:
            loc, t = out[k], tensors[k]
            n = min(16, t.numel() * t.element_size())
            if n == 0:
                continue
            f.seek(loc.offset)
            want = bytes(t.reshape(-1)[: max(1, n // t.element_size())].view(torch.uint8).tolist())[:n]
            if f.read(len(want)) != want:
                return {}
    return out


_ZIP_TAIL = 22 + 65535  # the end-of-directory record and the longest zip comment
_LOCAL_HEAD = 30 + 1024  # a zip record's fixed header, its name and torch's alignment padding
_LEGACY_WHOLE = 64 << 20  # a legacy pickle up to this size is fetched whole (the source then says what it is)


def header_ranges(path: str, size: int) -> Iterator[list[tuple[int, int]]]:
    """What mapping a ``torch.save`` zip reads (:data:`sdadapt.sources._base.HeaderRanges`): its
    first bytes and the end-of-directory record, the central directory, each record's local
    header, and every record that is not tensor data (``data.pkl``, ``version``...)."""
    yield [(max(0, size - _ZIP_TAIL), size), (0, min(4, size))]
    with open(path, "rb") as f:
        f.seek(max(0, size - _ZIP_TAIL))
        tail = f.read()
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or len(tail) - at < 22:
        if size <= _LEGACY_WHOLE:
            yield [(0, size)]
        return
    cd_size, cd_offset = struct.unpack("<II", tail[at + 12 : at + 20])
    eocd = size - len(tail) + at
    if cd_offset == 0xFFFFFFFF or cd_size == 0xFFFFFFFF:  # zip64: the locator points at the larger record
        loc = tail[at - 20 : at]
        if len(loc) == 20 and loc[:4] == b"PK\x06\x07":
            (rec,) = struct.unpack("<Q", loc[8:16])
            yield [(rec, min(size, rec + 56))]
            with open(path, "rb") as f:
                f.seek(rec)
                z64 = f.read(56)
            cd_size, cd_offset = struct.unpack("<QQ", z64[40:56])
    yield [(min(cd_offset, eocd), min(eocd, cd_offset + cd_size))]
    try:
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
    except (zipfile.BadZipFile, OSError, ValueError):
        return  # the source reports the damage when opened
    yield [(i.header_offset, min(size, i.header_offset + _LOCAL_HEAD + len(i.filename))) for i in infos]
    rest = []
    with open(path, "rb") as f:
        for i in infos:
            parts = i.filename.split("/")
            if not (len(parts) == 3 and parts[1] == "data"):
                f.seek(i.header_offset + 26)
                n, m = struct.unpack("<HH", f.read(4))
                start = i.header_offset + 30 + n + m
                rest.append((start, min(size, start + i.compress_size)))
    yield rest


FORMAT = Format(
    "torch_save", (".bin", ".pt", ".pth", ".ckpt"), os.path.isfile,
    lambda path, subtree: TorchSaveFile(nonempty(path), subtree=subtree), header_ranges, any_file=True,
)
"""A ``torch.save`` zip file: any file no other format claims (the last entry of the table)."""
