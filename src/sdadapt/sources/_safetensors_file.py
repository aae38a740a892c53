"""safetensors files, read through our own header parser and one read-only mmap.

The header is validated in full before any tensor is exposed: known dtypes, offsets inside
the data area, sizes that agree with shapes, no overlaps. Tensors are zero-copy views of
the mapping, so a region read touches only the pages it needs.
"""

from __future__ import annotations

import io
import itertools
import json
import mmap
import os
import struct
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from .._base.regions import Box
from .._base.schema import TensorInfo, TensorLocation, slices
from ..errors import SourceError
from . import _headers
from ._base import Format, Source, claims_by_name, flat_only, nonempty

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit
_FIELDS = frozenset(("dtype", "shape", "data_offsets"))  # an entry's fields, all three required
# JSON numbers parse to int (exactly: never a subclass but bool) or float: a type test excludes bools
_INT = frozenset((int,))

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,  # power-of-two scales (UE8M0), one exponent byte each
}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _attr):
        DTYPES[_name] = getattr(torch, _attr)
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def read_header(path: str) -> tuple[dict[str, tuple[TensorInfo, int, int]], dict[str, str], int]:
    """Parse and validate a safetensors header.

    Returns ``(entries, metadata, data_start)`` where entries map key -> (info, begin, end)
    with byte offsets relative to the data area.
    """
    given = _headers.recorded(path)  # read once for the job by another rank (sources._headers)
    try:
        if given is not None:
            data, size = given
            f: Any = io.BytesIO(data)
        else:
            size = os.path.getsize(path)
            f = open(path, "rb")  # noqa: SIM115 - closed below
        with f:
            head = f.read(8)
            if len(head) < 8:
                raise SourceError(
                    f"not a safetensors file: {size} bytes, shorter than the 8-byte header length",
                    path=path,
                )
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise SourceError(
                    f"corrupt or truncated safetensors file: header length {n} does not fit "
                    f"the file size {size} (limit {MAX_HEADER_BYTES})",
                    path=path,
                )
            raw = f.read(n)
    except OSError as e:
        raise SourceError(f"cannot read: {e.strerror or e}", path=path) from None
    if len(raw) < n:
        raise SourceError(f"corrupt or truncated safetensors file: header of {n} bytes, {len(raw)} read", path=path)
    if given is None:
        _headers.note(path, head + raw, size)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise SourceError(f"corrupt safetensors header (not valid JSON: {e})", path=path) from None
    if not isinstance(header, dict):
        raise SourceError("corrupt safetensors header: not a JSON object", path=path)
    data_start = 8 + n
    data_len = size - data_start
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise SourceError("corrupt safetensors header: __metadata__ is not an object", path=path)
    entries: dict[str, tuple[TensorInfo, int, int]] = {}
    spans = []
    for key, e in header.items():
        # each test runs at C level (a header has an entry per tensor: ~10^5 for a large MoE)
        if not isinstance(e, dict) or len(e) != 3 or not _FIELDS.issuperset(e):
            raise SourceError("corrupt safetensors header entry (needs dtype, shape, data_offsets)", path=path, key=key)
        dt, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
        if not isinstance(dt, str) or dt not in DTYPES:
            raise SourceError(f"unsupported dtype {dt!r}; known: {', '.join(DTYPES)}", path=path, key=key)
        if type(shape) is not list or (shape and (not _INT.issuperset(map(type, shape)) or min(shape) < 0)):
            raise SourceError(f"corrupt shape {shape!r}", path=path, key=key)
        if type(offs) is not list or len(offs) != 2 or not _INT.issuperset(map(type, offs)):
            raise SourceError(f"corrupt data_offsets {offs!r}", path=path, key=key)
        begin, end = offs
        info = TensorInfo(tuple(shape), DTYPES[dt])
        if not 0 <= begin <= end <= data_len:
            raise SourceError(
                f"data_offsets [{begin}, {end}] point outside the data area of {data_len} bytes "
                "(truncated or corrupt file; download it again)",
                path=path,
                key=key,
            )
        if end - begin != info.nbytes:
            raise SourceError(
                f"data_offsets span {end - begin} bytes but shape {list(shape)} of {dt} needs {info.nbytes}",
                path=path,
                key=key,
            )
        entries[key] = (info, begin, end)
        spans.append((begin, end, key))
    spans.sort()
    for (_, e0, k0), (b1, _, k1) in itertools.pairwise(spans):
        if b1 < e0:
            raise SourceError(f"tensors {k0!r} and {k1!r} overlap in the data area (corrupt header)", path=path)
    return entries, metadata, data_start


class SafetensorsFile(Source):
    """One ``.safetensors`` file."""

    def __init__(self, path: str):
        self.path = path
        self._entries, self.metadata, self._data_start = read_header(path)
        self.schema = {k: info for k, (info, _, _) in self._entries.items()}
        self.non_tensor = []
        self._buf: torch.Tensor | None = None
        self._mm: mmap.mmap | None = None
        self._views: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    def _buffer(self) -> torch.Tensor:
        if self._buf is not None:
            return self._buf
        with self._lock:  # the engine's threads share the source: one mapping, the file opened once
            return self._map()

    def _map(self) -> torch.Tensor:
        if self._buf is None:
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_size == 0:
                    return torch.empty(0, dtype=torch.uint8)
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # read-only buffer: we never write through it
                self._buf = torch.frombuffer(self._mm, dtype=torch.uint8)
        return self._buf

    def tensor(self, key: str) -> torch.Tensor:
        """The whole tensor as a zero-copy view of the mapped file."""
        t = self._views.get(key)
        if t is None:
            info, begin, end = self._entries[key]
            buf = self._buffer()
            if len(buf) < self._data_start + end:
                raise SourceError(
                    "file shrank since its header was read (being written?); try again when it is complete",
                    path=self.path,
                    key=key,
                )
            raw = buf[self._data_start + begin : self._data_start + end]
            if self._unaligned(key):
                raw = raw.clone()  # unaligned data cannot be viewed as the dtype: copy (whole tensor)
            t = raw.view(info.dtype).view(info.shape) if info.shape else raw.view(info.dtype).reshape(())
            self._views[key] = t
        return t

    def _unaligned(self, key: str) -> bool:
        info, begin, _ = self._entries[key]
        return info.dtype.itemsize > 1 and (self._data_start + begin) % info.dtype.itemsize != 0

    def locate(self, key: str) -> TensorLocation | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        info, begin, _ = entry
        return TensorLocation(self.path, self._data_start + begin, tuple(info.shape), info.dtype)

    def read(self, key: str, box: Box) -> torch.Tensor:
        if key in self._views or not self._unaligned(key) or not box:
            return self.tensor(key)[slices(box)]
        # Unaligned data (a writer that did not pad the header): copy only the rows the box
        # covers, not the whole tensor, then view them as the dtype.
        info, begin, _ = self._entries[key]
        (a, b), rest = box[0], box[1:]
        row = info.nbytes // info.shape[0] if info.shape[0] else 0
        start = self._data_start + begin + a * row
        buf = self._buffer()
        if len(buf) < start + (b - a) * row:
            raise SourceError(
                "file shrank since its header was read (being written?); try again when it is complete",
                path=self.path,
                key=key,
            )
        rows = buf[start : start + (b - a) * row].clone().view(info.dtype).view((b - a, *info.shape[1:]))
        return rows[(slice(None), *slices(rest))]

    def close(self) -> None:
        self._views.clear()
        self._buf = None
        self._mm = None  # closed by GC once no view refers to it


SINGLE_NAME = "model.safetensors"
"""The one weight file of a folder holding a single safetensors file."""


def _open(path: str, subtree: str | None) -> Source:
    if os.path.isdir(path):
        return SafetensorsFile(os.path.join(flat_only(path, subtree), SINGLE_NAME))
    return SafetensorsFile(flat_only(nonempty(path), subtree))


def header_ranges(path: str, size: int) -> Iterator[list[tuple[int, int]]]:
    """The 8-byte header length, then the header (:data:`sdadapt.sources._base.HeaderRanges`);
    a bad length is fetched as far as the file goes (the parser then says what is wrong)."""
    yield [(0, min(8, size))]
    if size >= 8:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
        yield [(8, min(size, 8 + length))]


FORMAT = Format(
    "safetensors", (".safetensors",), claims_by_name(SINGLE_NAME, ".safetensors"), _open, header_ranges, recordable=True,
    folder_file=SINGLE_NAME,
)
"""One ``.safetensors`` file, or a folder holding ``model.safetensors``."""
