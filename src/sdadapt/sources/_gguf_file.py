"""One GGUF file (llama.cpp's format) as a source: llama.cpp's tensor names, lazily dequantized rows.

Opening reads the header only (:mod:`._gguf_header`; recorded and broadcast like a safetensors
header, fetched by ranged requests at an object storage URL). The schema keeps llama.cpp's
names (``blk.0.attn_q.weight``, ``token_embd.weight``...) and torch's dim order (outermost
first); the shipped adapter ``gguf`` maps them to a model's names. ``F32``, ``F16`` and ``BF16``
tensors keep their dtype and are read by byte location like safetensors; every quantized type
is presented as ``float32`` (a load casts it to the model's dtype) and a region read reads only
the blocks of the rows (and columns) it covers, then dequantizes them.

The block arithmetic is the ``gguf`` package's own (``gguf.quants.dequantize``, the code
llama.cpp's Python tools and transformers' GGUF loading run; ``pip install 'sdadapt[gguf]'``):
a second copy of each type's formulas here would have to be kept bit-equal to it, and the
package dequantizes every type it knows, K-quants and IQ types included. It is imported when
a file holding a quantized tensor is opened; a type the installed package cannot dequantize is
refused then, by name, before anything is read.
"""

from __future__ import annotations

import math
import os
import re
import threading
from collections.abc import Iterator
from typing import Any

import torch

from .._base.regions import Box
from .._base.schema import TensorInfo, TensorLocation
from ..errors import SourceError
from . import _headers
from ._base import Format, Source, flat_only, nonempty
from ._gguf_header import GGML_TYPES, Header, TensorRecord, needed, parse

EXTRA = "pip install 'sdadapt[gguf]'"
FIRST_READ = 1 << 20  # the header's first read; most headers (tokenizer included) take a few MB
MAX_HEADER_BYTES = 1 << 30

_PLAIN = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16, 24: torch.int8, 25: torch.int16, 26: torch.int32,
          27: torch.int64, 28: torch.float64}  # fmt: skip
"""ggml types stored as plain row-major values: read by location, no dequantization."""

_BLK = re.compile(r"blk\.(\d+)\.")


def read_header(path: str) -> Header:
    """The parsed header of the GGUF file ``path`` (its bytes recorded or replayed: :mod:`._headers`)."""
    given = _headers.recorded(path)
    if given is not None:
        data, size = given
        try:
            return parse(data, size, path)
        except EOFError:
            raise SourceError("the GGUF header received from the first rank is cut short", path=path) from None
    size = os.path.getsize(path)
    want = min(size, FIRST_READ)
    with open(path, "rb") as f:
        data = f.read(want)
        while True:
            try:
                head = parse(data, size, path)
                break
            except EOFError as more:
                if needed(more) > MAX_HEADER_BYTES:
                    raise SourceError(f"GGUF header larger than {MAX_HEADER_BYTES} bytes; refusing to read it", path=path) from None
                f.seek(len(data))
                data += f.read(min(size, max(needed(more), 2 * len(data))) - len(data))
    _headers.note(path, data[: head.header_end], size)
    return head


def header_ranges(path: str, size: int) -> Iterator[list[tuple[int, int]]]:
    """The first MiB, then more until the header parses (:data:`sdadapt.sources._base.HeaderRanges`)."""
    have = min(size, FIRST_READ)
    yield [(0, have)]
    while True:
        with open(path, "rb") as f:
            data = f.read(have)
        try:
            parse(data, size, path)
            return
        except EOFError as more:
            if needed(more) > MAX_HEADER_BYTES:
                return  # the source says so when opened
            nxt = min(size, max(needed(more), 2 * have))
            yield [(have, nxt)]
            have = nxt
        except SourceError:
            return  # the source says what is wrong when opened


def _dequantizer(path: str, records: list[TensorRecord]) -> Any:
    """``gguf.quants.dequantize`` and the type enum, after checking that it dequantizes every
    quantized type ``records`` use; a :class:`SourceError` naming the first tensor it cannot."""
    quantized = [t for t in records if t.type_id not in _PLAIN]
    if not quantized:
        return None
    try:
        from gguf import quants  # noqa: PLC0415 - optional: only for quantized GGUF files
        from gguf.constants import GGMLQuantizationType  # noqa: PLC0415
    except ImportError:
        t = quantized[0]
        raise SourceError(
            f"tensor is {t.type_name}-quantized; dequantizing GGUF types needs the gguf package: {EXTRA}",
            path=path,
            key=t.name,
        ) from None
    known = getattr(quants, "_type_traits", {})
    for t in quantized:
        qtype = GGMLQuantizationType(t.type_id) if t.type_id in GGMLQuantizationType._value2member_map_ else None
        if qtype is None or qtype not in known or "dequantize_blocks" not in vars(known[qtype]):
            raise SourceError(
                f"tensor is {t.type_name}-quantized, which the installed gguf package cannot dequantize; convert it to "
                "another type (F16, BF16, Q8_0, Q4_K ...)",
                path=path,
                key=t.name,
            )
    return quants.dequantize, GGMLQuantizationType


def check_metadata(path: str, head: Header) -> None:
    """The model metadata agrees with the tensors: ``{arch}.block_count`` blocks, and the
    embedding width ``{arch}.embedding_length`` of ``token_embd.weight``."""
    arch = head.metadata.get("general.architecture")
    if not isinstance(arch, str):
        return
    blocks = head.metadata.get(f"{arch}.block_count")
    found = {int(m.group(1)) for name in head.tensors if (m := _BLK.match(name))}
    if isinstance(blocks, int) and found and (max(found) + 1 != blocks or len(found) != blocks):
        raise SourceError(
            f"the metadata says {arch}.block_count={blocks}, the tensors hold blocks {min(found)}..{max(found)} "
            f"({len(found)} of them); the file is inconsistent: convert it again",
            path=path,
            key=f"blk.{max(found)}" if max(found) >= blocks else None,
        )
    width = head.metadata.get(f"{arch}.embedding_length")
    emb = head.tensors.get("token_embd.weight")
    if isinstance(width, int) and emb is not None and emb.shape[-1] != width:
        raise SourceError(
            f"the metadata says {arch}.embedding_length={width}, the tensor's rows are {emb.shape[-1]} wide; the file "
            "is inconsistent: convert it again",
            path=path,
            key=emb.name,
        )


def _runs_of(shape: tuple[int, ...], itemsize: int, box: Box) -> list[tuple[int, int]]:
    """Region ``box`` of a row-major array of ``shape`` as (byte offset, length) runs in
    row-major order, adjacent runs merged (whole rows read as one run)."""
    if any(b <= a for a, b in box):
        return []
    strides = [itemsize] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    (c0, c1) = box[-1]
    run = (c1 - c0) * itemsize
    starts = [c0 * itemsize]
    for (a, b), stride in zip(box[:-1], strides[:-1], strict=True):
        starts = [p + i * stride for p in starts for i in range(a, b)]
    out: list[tuple[int, int]] = []
    for p in starts:
        if out and out[-1][0] + out[-1][1] == p:
            out[-1] = (out[-1][0], out[-1][1] + run)
        else:
            out.append((p, run))
    return out


_CONFIG_KEYS = {  # {arch}.<key> -> config.json field (transformers' GGUF config reader's names)
    "context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size", "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps", "rope.freq_base": "rope_theta", "vocab_size": "vocab_size",
    "attention.key_length": "head_dim", "expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
}  # fmt: skip


def hf_config(metadata: dict[str, Any], schema: dict[str, TensorInfo]) -> dict[str, Any] | None:
    """The ``config.json`` fields a GGUF file's metadata gives (``model_type`` from
    ``general.architecture``, head counts, sizes), for what reads a release's config (the
    draft); ``None`` without ``general.architecture``."""
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        return None
    cfg: dict[str, Any] = {"model_type": arch}
    for key, field in _CONFIG_KEYS.items():
        value = metadata.get(f"{arch}.{key}")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            cfg[field] = value
    emb = schema.get("token_embd.weight")
    if "vocab_size" not in cfg and emb is not None:
        cfg["vocab_size"] = emb.shape[0]
    cfg["tie_word_embeddings"] = "output.weight" not in schema
    return cfg


class GGUFFile(Source):
    """One ``.gguf`` file: llama.cpp's names, quantized tensors dequantized per region read.

    Attributes:
        metadata: the file's metadata (``general.architecture``, ``llama.block_count`` ...).
        config: the ``config.json`` fields the metadata gives (:func:`hf_config`), or ``None``.
        types: ``key -> ggml type name`` (``"Q4_K"``) of every tensor.
    """

    def __init__(self, path: str):
        self.path = path
        head = read_header(path)
        check_metadata(path, head)
        self.metadata = head.metadata
        self._records = head.tensors
        self._data_start = head.data_start
        self._dequant = _dequantizer(path, list(head.tensors.values()))
        self.types = {k: t.type_name for k, t in head.tensors.items()}
        self.schema = {k: TensorInfo(t.shape, _PLAIN.get(t.type_id, torch.float32)) for k, t in head.tensors.items()}
        self.config = hf_config(self.metadata, self.schema)
        self.non_tensor = []
        self._fd: int | None = None
        self._lock = threading.Lock()

    @property
    def kind(self) -> str:
        return "GGUFFile"

    def locate(self, key: str) -> TensorLocation | None:
        t = self._records.get(key)
        if t is None or t.type_id not in _PLAIN:
            return None
        return TensorLocation(self.path, self._data_start + t.offset, t.shape, _PLAIN[t.type_id])

    def region_bytes(self, key: str, box: Box) -> list[tuple[str, int, int]] | None:
        start, runs = self._runs(key, box)[:2]
        return [(self.path, start + a, start + a + n) for a, n in runs]

    def _runs(self, key: str, box: Box) -> tuple[int, list[tuple[int, int]], Box, tuple[int, ...]]:
        """The byte runs (offset in the tensor, length) holding region ``box`` of ``key``: whole
        blocks of the rows it covers; with the block box and the stored shape they are cut from."""
        t = self._records[key]
        _, block, size = GGML_TYPES[t.type_id]
        start = self._data_start + t.offset
        if not t.shape:
            return start, [(0, size)], (), ()
        (c0, c1) = box[-1]
        bbox = (*box[:-1], (c0 // block, -(-c1 // block)))
        bshape = (*t.shape[:-1], t.shape[-1] // block)
        return start, _runs_of(bshape, size, bbox), bbox, bshape

    def read(self, key: str, box: Box) -> torch.Tensor:
        t = self._records.get(key)
        if t is None:
            raise SourceError("no such tensor in the GGUF file", path=self.path, key=key)
        out_shape = tuple(b - a for a, b in box)
        if math.prod(out_shape) == 0:
            return torch.empty(out_shape, dtype=self.schema[key].dtype)
        start, runs, bbox, _ = self._runs(key, box)
        raw = bytearray()
        fd = self._open()
        for a, n in runs:
            chunk = os.pread(fd, n, start + a)
            if len(chunk) != n:
                raise SourceError("file shrank since its header was read (being written?)", path=self.path, key=key)
            raw += chunk
        _, block, size = GGML_TYPES[t.type_id]
        nb = bbox[-1][1] - bbox[-1][0] if bbox else 1
        lead = tuple(b - a for a, b in bbox[:-1])
        if t.type_id in _PLAIN:
            full = torch.frombuffer(raw, dtype=torch.uint8).view(_PLAIN[t.type_id]).reshape(*lead, nb)
        else:
            dequantize, qtype = self._dequant  # gguf's arithmetic works on numpy arrays: torch hands them over
            blocks = torch.frombuffer(raw, dtype=torch.uint8).reshape(*lead, nb * size).numpy()
            full = torch.as_tensor(dequantize(blocks, qtype(t.type_id))).to(torch.float32).contiguous()
        if not box:
            return full.reshape(())
        c0 = box[-1][0] - bbox[-1][0] * block
        return full[..., c0 : c0 + out_shape[-1]].clone()

    def _open(self) -> int:
        with self._lock:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            return self._fd

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def config_of(path: str) -> dict[str, Any] | None:
    """The ``config.json`` fields the GGUF file ``path``'s metadata gives (its header only)."""
    head = read_header(path)
    schema = {k: TensorInfo(t.shape, torch.float32) for k, t in head.tensors.items()}
    return hf_config(head.metadata, schema)


FORMAT = Format(
    "gguf",
    (".gguf",),
    lambda path: path.endswith(".gguf"),
    lambda path, subtree: GGUFFile(flat_only(nonempty(path), subtree)),
    header_ranges,
    recordable=True,
    config=config_of,
)
"""A ``.gguf`` file (llama.cpp's format)."""
