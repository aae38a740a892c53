"""The header of a GGUF file (llama.cpp's format), parsed from its first bytes: no tensor data.

A GGUF file is: the magic ``GGUF``, a version (2 or 3), the tensor and metadata counts, the
metadata (key, typed value), one record per tensor (name, dims innermost first, ggml type,
offset in the data area), then the data area at the next multiple of ``general.alignment``
(default 32). Everything is little-endian.

This parser is our own rather than the ``gguf`` package's ``GGUFReader``, which maps the whole
file with numpy and builds an array per tensor on open: ours reads only the header bytes (so a
header can be recorded once and broadcast, and fetched by ranged requests at an object storage
URL), bounds every count and length by the file's size before allocating, and says what is
wrong, naming the file and the tensor, for any input (``tests/sources/test_gguf.py`` fuzzes it
against ``gguf``'s writer). :func:`parse` asks for more bytes when the
header runs past the bytes it was given but not past the file (an ``EOFError`` whose argument
is the length needed: :func:`needed`).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Any

from ..errors import SourceError

MAGIC = b"GGUF"
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NESTING = 2  # arrays of arrays: deeper is refused

# ggml type id -> (name, values per block, bytes per block); llama.cpp's ggml.h / gguf's GGML_QUANT_SIZES
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
}  # fmt: skip

# metadata value type id -> struct format (scalars); 8 string, 9 array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def needed(e: EOFError) -> int:
    """The bytes :func:`parse` needs, from the ``EOFError`` it raised."""
    return int(e.args[0])


@dataclass(frozen=True)
class TensorRecord:
    """One tensor's record: its torch shape (outermost first), ggml type, offset in the data area."""

    name: str
    shape: tuple[int, ...]
    type_id: int
    offset: int

    @property
    def type_name(self) -> str:
        return GGML_TYPES[self.type_id][0]

    @property
    def nbytes(self) -> int:
        _, block, size = GGML_TYPES[self.type_id]
        return math.prod(self.shape[:-1]) * (self.shape[-1] // block) * size if self.shape else size


@dataclass
class Header:
    """What :func:`parse` reads: the version, the metadata, the tensors, where the data begins."""

    version: int
    metadata: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, TensorRecord] = field(default_factory=dict)
    data_start: int = 0
    header_end: int = 0


class _Reader:
    def __init__(self, buf: bytes, size: int, path: str):
        self.buf, self.size, self.path, self.pos = buf, size, path, 0

    def take(self, n: int, what: str) -> bytes:
        end = self.pos + n
        if end > self.size:
            raise SourceError(
                f"truncated GGUF file: {what} at byte {self.pos} needs {n} bytes, the file ends at {self.size}; "
                "download or convert it again",
                path=self.path,
            )
        if end > len(self.buf):
            raise EOFError(end)  # the header goes on past the bytes given: read more
        out = self.buf[self.pos : end]
        self.pos = end
        return out

    def unpack(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.unpack("<Q", what)
        raw = self.take(n, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise SourceError(f"corrupt GGUF header: {what} is not UTF-8", path=self.path) from None

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        fmt = _SCALARS.get(vtype)
        if fmt is not None:
            return self.unpack(fmt, what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY and depth < MAX_NESTING:
            etype = self.unpack("<I", what)
            count = self.unpack("<Q", what)
            if count > self.size - self.pos:  # every element takes at least one byte
                raise SourceError(f"corrupt GGUF header: {what} claims {count} elements, more than the file holds", path=self.path)
            efmt = _SCALARS.get(etype)
            if efmt is not None:  # a run of scalars in one unpack
                n = struct.calcsize(efmt)
                raw = self.take(n * count, what)
                return list(struct.unpack(f"<{count}{efmt[1]}", raw))
            return [self.value(etype, what, depth + 1) for _ in range(count)]
        raise SourceError(f"corrupt GGUF header: {what} has value type {vtype}, which GGUF does not define", path=self.path)


def parse(buf: bytes, size: int, path: str) -> Header:
    """The header of the GGUF file ``path`` (``size`` bytes long) from its first bytes ``buf``.

    Raises:
        EOFError: ``buf`` ends inside the header (read :func:`needed` bytes and call again).
        SourceError: the bytes are no GGUF header, or it disagrees with itself or the file's size.
    """
    r = _Reader(buf, size, path)
    magic = r.take(4, "the magic")
    if magic != MAGIC:
        raise SourceError(f"not a GGUF file (it starts with {magic!r}, not {MAGIC!r})", path=path)
    raw_version = r.take(4, "the version")
    version = struct.unpack("<I", raw_version)[0]
    if version not in (2, 3):
        if struct.unpack(">I", raw_version)[0] in (2, 3):
            raise SourceError("big-endian GGUF file: sdadapt reads little-endian GGUF only; convert it again", path=path)
        raise SourceError(f"GGUF version {version}: sdadapt reads versions 2 and 3; convert it again", path=path)
    n_tensors = r.unpack("<Q", "the tensor count")
    n_kv = r.unpack("<Q", "the metadata count")
    if n_tensors > size // 24 or n_kv > size // 12:  # the smallest record of each
        raise SourceError(
            f"truncated or corrupt GGUF file: {n_tensors} tensors and {n_kv} metadata entries cannot fit in its {size} bytes",
            path=path,
        )
    head = Header(version)
    for i in range(n_kv):
        key = r.string(f"metadata key {i}")
        vtype = r.unpack("<I", f"the type of metadata {key!r}")
        if key in head.metadata:
            raise SourceError(f"corrupt GGUF header: metadata key {key!r} appears twice", path=path)
        head.metadata[key] = r.value(vtype, f"metadata {key!r}")
    alignment = head.metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or alignment & (alignment - 1):
        raise SourceError(f"corrupt GGUF header: general.alignment is {alignment!r}, not a power of two", path=path)
    for i in range(n_tensors):
        head_i = f"tensor record {i}"
        name = r.string(head_i)
        n_dims = r.unpack("<I", f"the dims of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise _bad(path, name, f"{n_dims} dimensions (GGUF allows 1 to {MAX_DIMS})")
        dims = [r.unpack("<Q", f"the dims of tensor {name!r}") for _ in range(n_dims)]
        type_id = r.unpack("<I", f"the type of tensor {name!r}")
        offset = r.unpack("<Q", f"the offset of tensor {name!r}")
        if type_id not in GGML_TYPES:
            raise _bad(path, name, f"ggml type {type_id}, which sdadapt does not know (a newer llama.cpp type?)")
        if name in head.tensors:
            raise _bad(path, name, "a second record with this name")
        _, block, _ = GGML_TYPES[type_id]
        if dims[0] % block:
            raise _bad(path, name, f"rows of {dims[0]} values, not a multiple of {GGML_TYPES[type_id][0]}'s block of {block}")
        if offset % alignment:
            raise _bad(path, name, f"data offset {offset}, not a multiple of general.alignment {alignment}")
        head.tensors[name] = TensorRecord(name, tuple(reversed(dims)), type_id, offset)
    head.header_end = r.pos
    head.data_start = -(-r.pos // alignment) * alignment
    _check_data(head, size, path)
    return head


def _bad(path: str, name: str, what: str) -> SourceError:
    return SourceError(f"corrupt GGUF tensor record: {what}", path=path, key=name)


def _check_data(head: Header, size: int, path: str) -> None:
    """Every tensor's bytes lie inside the file, and no two overlap."""
    spans = []
    for t in head.tensors.values():
        start = head.data_start + t.offset
        if start + t.nbytes > size:
            raise SourceError(
                f"truncated GGUF file: tensor's {t.type_name} data ({t.nbytes} bytes at {start}) runs past the end of "
                f"the file ({size} bytes); download or convert it again",
                path=path,
                key=t.name,
            )
        spans.append((start, start + t.nbytes, t.name))
    spans.sort()
    for (_, e0, k0), (b1, _, k1) in zip(spans, spans[1:], strict=False):
        if b1 < e0:
            raise SourceError(f"corrupt GGUF header: tensors {k0!r} and {k1!r} overlap in the data area", path=path, key=k1)
