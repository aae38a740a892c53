"""Integrity: files unchanged while we read them, per-block checksums, NaN/Inf checks.

Three independent checks, run by the load transaction (:mod:`sdadapt._transaction.transaction`);
this module holds the checksums, imported by the loads and writes that use them; the
fingerprints and the finite-value counts every load may run are in :mod:`._checks`:

- **Fingerprints** (always on). The size, mtime and inode of every file a source reads from are
  taken when it is opened, and compared again right before the first byte of tensor data is
  read (every rank, agreed) and once more after the read. A checkpoint that is being written,
  replaced or truncated while we load it is refused (before writing: the model is untouched;
  after: as the transaction's roll-back policy says).
- **Checksums** (``load(..., checksums=True)``). A sidecar file ``sdadapt.checksums.json`` (written
  by :func:`write_checksums`, by ``export`` and by ``save_state``) records, for each tensor, a
  BLAKE2b-128 digest of every *block* of its bytes. A block is a run of whole rows along dim 0
  (``rows_per_block`` rows, about ``DEFAULT_BLOCK_BYTES``; a 0-d tensor is one block). Why
  blocks of rows and not one digest per tensor: a rank reads only its own region; FSDP shards
  are row ranges, so with row blocks a rank checks what it reads at the cost of at most two
  partial blocks per tensor, instead of reading every tensor whole. (A column shard (TP) spans
  every row, so checking it reads the whole tensor: the check costs I/O, which is why it
  is optional.) Each block is checked once per load, on the bytes as stored in the checkpoint
  (before any cast or permutation), and the data handed to the load is read after its blocks
  were checked, from the same open file, whose fingerprint is checked after the read too.
- **Finite values** (``load(..., check_finite=True)``). Every rank checks its loaded shards for
  NaN/Inf before they are committed; keys with any are reported with counts, from all ranks.

Digests are in the tensor's dtype, C order, little-endian (what safetensors, torch.save and
DCP store on the little-endian machines torch supports).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._base.regions import Box
from .._base.schema import TensorInfo, dtype_name
from .._base.tensor_bytes import tensor_bytes
from ..errors import SdadaptError, SourceError
from ._base import Source, read_json_file

log = logging.getLogger(__name__)

CHECKSUMS_NAME = "sdadapt.checksums.json"
FORMAT = 1
ALGORITHM = "blake2b-128"
DEFAULT_BLOCK_BYTES = 4 << 20
# why load calls it ``checksums`` (shown when the old keyword ``verify`` is passed)
MAX_CHECKSUMS_BYTES = 256 << 20  # refuse larger sidecars: a header must not make us allocate without bound


# --- checksums ------------------------------------------------------------------------------


def rows_per_block(info: TensorInfo, block_bytes: int = DEFAULT_BLOCK_BYTES) -> int:
    if not info.shape:
        return 1
    row = info.nbytes // info.shape[0] if info.shape[0] else 0
    return max(1, block_bytes // row) if row else max(1, info.shape[0])


def _digest(t: torch.Tensor) -> str:
    t = t.detach().contiguous().reshape(-1)
    if t.numel() == 0:
        return hashlib.blake2b(b"", digest_size=16).hexdigest()
    return hashlib.blake2b(tensor_bytes(t), digest_size=16).hexdigest()


def _row_box(info: TensorInfo, lo: int, hi: int) -> Box:
    return ((lo, hi), *((0, s) for s in info.shape[1:]))


def tensor_checksums(info: TensorInfo, read: Any, block_bytes: int = DEFAULT_BLOCK_BYTES) -> dict[str, Any]:
    """Checksum entry of one tensor; ``read(box)`` returns that region (CPU)."""
    k = rows_per_block(info, block_bytes)
    if not info.shape:
        blocks = [_digest(read(()))]
    else:
        rows = info.shape[0]
        blocks = [_digest(read(_row_box(info, lo, min(rows, lo + k)))) for lo in range(0, max(rows, 1), k)] if rows else []
    return {"dtype": dtype_name(info.dtype), "shape": list(info.shape), "rows_per_block": k, "blocks": blocks}


class StreamedChecksums:
    """:func:`tensor_checksums` of tensors laid out in one byte stream (a safetensors file: each
    tensor's bytes from ``starts[key]``, row-major), computed from the stream's bytes as they pass
    in order (:meth:`feed`), a block's digest once its last byte passed: the same entries as
    reading each block back, without holding more than the bytes fed."""

    def __init__(self, infos: Mapping[str, TensorInfo], starts: Mapping[str, int], block_bytes: int = DEFAULT_BLOCK_BYTES):
        self.entries: dict[str, dict[str, Any]] = {}
        self.blocks: list[tuple[int, int, str]] = []  # (start, stop, key) in stream order
        for key, start in sorted(starts.items(), key=lambda kv: kv[1]):
            info = infos[key]
            k = rows_per_block(info, block_bytes)
            self.entries[key] = {"dtype": dtype_name(info.dtype), "shape": list(info.shape), "rows_per_block": k, "blocks": []}
            if not info.shape:
                self.blocks.append((start, start + info.nbytes, key))
                continue
            rows = info.shape[0]
            row = info.nbytes // rows if rows else 0
            self.blocks += [(start + lo * row, start + min(rows, lo + k) * row, key) for lo in range(0, rows, k)]
        self.at = 0  # the next block
        self.hasher = hashlib.blake2b(digest_size=16)

    def feed(self, pos: int, data: memoryview) -> None:
        """The stream's bytes ``[pos, pos + len(data))``, following the ones fed before."""
        end = pos + len(data)
        while self.at < len(self.blocks):
            a, b, key = self.blocks[self.at]
            lo, hi = max(a, pos), min(b, end)
            if hi > lo:
                self.hasher.update(data[lo - pos : hi - pos])
            if b > end:
                return
            self.entries[key]["blocks"].append(self.hasher.hexdigest())
            self.hasher = hashlib.blake2b(digest_size=16)
            self.at += 1

    def done(self) -> dict[str, dict[str, Any]]:
        """Every tensor's entry, once the whole stream was fed."""
        if self.at != len(self.blocks):
            raise SdadaptError(f"checksums: the stream ended before block {self.at} of {len(self.blocks)} (a bug; please report it)")
        return self.entries


def compute_checksums(source: Source, keys: Iterable[str] | None = None, block_bytes: int = DEFAULT_BLOCK_BYTES) -> dict[str, Any]:
    """Checksums of ``keys`` (default: every tensor) of an open source, read block by block."""
    tensors = {}
    for key in sorted(source.schema) if keys is None else keys:
        info = source.schema[key]
        tensors[key] = tensor_checksums(info, lambda box, key=key: source.read(key, box).cpu(), block_bytes)
    return {"format": FORMAT, "algorithm": ALGORITHM, "tensors": tensors}


def checksums_path(path: str) -> str:
    """Where the checksums of checkpoint ``path`` live: ``<folder>/sdadapt.checksums.json`` for a
    folder, ``<file>.sdadapt.checksums.json`` beside a single file."""
    return os.path.join(path, CHECKSUMS_NAME) if os.path.isdir(path) else f"{path}.{CHECKSUMS_NAME}"


def write_checksums(path: str | os.PathLike[str], *, block_bytes: int = DEFAULT_BLOCK_BYTES, subtree: str | None = None) -> str:
    """Compute the checksums of checkpoint ``path`` (any format sdadapt reads) and write the
    sidecar. Run it once where the checkpoint was written (or right after downloading it from a
    source you trust); ``load(..., checksums=True)`` then checks every region it reads.
    Returns the sidecar's path. DCP folders are keyed by their full names (``model.w``).

    Args:
        path: the checkpoint (file or folder).
        block_bytes: the size of the blocks each checksum covers.
        subtree: the nested dict of a ``torch.save`` file or DCP folder.

    Returns:
        The sidecar's path.

    Example::

        sdadapt.write_checksums("ckpt/")
        sdadapt.load(model, "ckpt/", checksums=True)
    """
    from . import open_source

    p = os.fspath(path)
    source = open_source(p, subtree=subtree)
    try:
        data = compute_checksums(source, block_bytes=block_bytes)
    finally:
        source.close()
    data["tensors"] = {source.stored_key(k): v for k, v in data["tensors"].items()}
    out = checksums_path(p)
    if os.path.isdir(p) and not os.path.isdir(os.path.dirname(out) or "."):
        raise SourceError("cannot write checksums: folder missing", path=p)
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, separators=(",", ":"))
    os.replace(tmp, out)
    log.info("wrote checksums of %d tensors to %s", len(data["tensors"]), out)
    return out


def _find_sidecar(source: Source) -> str | None:
    p = source.path
    candidates = [checksums_path(p)]
    if not os.path.isdir(p):
        candidates.append(os.path.join(os.path.dirname(p) or ".", CHECKSUMS_NAME))
    return next((c for c in candidates if os.path.isfile(c)), None)


def read_checksums(source: Source) -> tuple[str, dict[str, dict[str, Any]]]:
    """The sidecar of ``source`` (validated): (its path, source key -> entry)."""
    path = _find_sidecar(source)
    if path is None:
        raise SourceError(
            f"checksums=True, but there is no {CHECKSUMS_NAME} beside the checkpoint. Write one where the "
            "checkpoint was made (sdadapt.write_checksums(path); export and save_state write it with "
            "checksums=True), or load without checksums=True",
            path=source.path,
        )
    data = read_json_file(path, MAX_CHECKSUMS_BYTES, "checksums file")
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("algorithm") != ALGORITHM:
        raise SourceError(f"not an sdadapt checksums file (format {FORMAT}, {ALGORITHM})", path=path)
    tensors = data.get("tensors")
    if not isinstance(tensors, dict):
        raise SourceError("checksums file has no 'tensors' object", path=path)
    out = {}
    for key in source.schema:
        entry = tensors.get(source.stored_key(key))
        if entry is not None:
            out[key] = entry
    return path, out


@dataclass
class _Expect:
    rows_per_block: int
    blocks: list[str]


class ChecksummedSource(Source):
    """Wraps a source: before a region is handed out, every block (run of rows) it touches is
    read whole and checked against the recorded digest, once per load.

    It delegates the inner source's files, key names and messages, but declares no byte
    locations: the I/O engine's direct file reads would hand out bytes this wrapper never
    checked, so every read goes through :meth:`read` (the checksum check is a slower, careful mode)."""

    def __init__(self, inner: Source, sidecar: str, entries: Mapping[str, Mapping[str, Any]], keys: Iterable[str]):
        self.inner = inner
        self.path = inner.path
        self.schema = inner.schema
        self.non_tensor = inner.non_tensor
        self.sidecar = sidecar
        self._expect: dict[str, _Expect] = {}
        self._checked: dict[str, set[int]] = {}
        for key in keys:
            info = inner.schema[key]
            entry = entries.get(key)
            if entry is None:
                raise SourceError(
                    f"checksums=True, but {sidecar} records no checksum for this tensor (written for another "
                    "checkpoint?); write the checksums again where the checkpoint was made",
                    path=inner.file_of(key),
                    key=key,
                )
            self._expect[key] = self._check_entry(key, info, entry)
            self._checked[key] = set()

    def _check_entry(self, key: str, info: TensorInfo, entry: Mapping[str, Any]) -> _Expect:
        bad = SourceError(
            f"the checksums file records {entry.get('dtype')!r} {entry.get('shape')!r} for this tensor, "
            f"but the checkpoint holds {dtype_name(info.dtype)} {list(info.shape)}: the checkpoint or its "
            "checksums were changed",
            path=self.inner.file_of(key),
            key=key,
        )
        k, blocks = entry.get("rows_per_block"), entry.get("blocks")
        if (
            entry.get("dtype") != dtype_name(info.dtype)
            or entry.get("shape") != list(info.shape)
            or not isinstance(k, int)
            or isinstance(k, bool)
            or k < 1
            or not isinstance(blocks, list)
            or not all(isinstance(b, str) for b in blocks)
        ):
            raise bad
        want = 1 if not info.shape else math.ceil(info.shape[0] / k)
        if len(blocks) != want:
            raise bad
        return _Expect(k, blocks)

    def locate(self, key: str) -> None:
        """No byte locations (see the class docstring): every region is read and checked."""
        return None

    def locate_region(self, key: str, box: Box) -> None:
        """No byte locations, whatever the inner source stores (see the class docstring)."""
        return None

    def region_bytes(self, key: str, box: Box) -> list[tuple[str, int, int]] | None:
        return self.inner.region_bytes(key, box)

    def files(self) -> list[str]:
        return self.inner.files()

    def stored_key(self, key: str) -> str:
        return self.inner.stored_key(key)

    def remote_url(self) -> str | None:
        return self.inner.remote_url()

    def prefetch(self, regions: Sequence[tuple[str, Box | None]], *, engine: bool = False) -> tuple[int, int]:
        """The inner source's prefetch, each region widened to the whole blocks it touches."""
        out: list[tuple[str, Box | None]] = []
        for key, box in regions:
            exp, info = self._expect.get(key), self.inner.schema.get(key)
            if box is None or exp is None or info is None or not info.shape:
                out.append((key, None if box is None or exp is not None else box))
                continue
            k = exp.rows_per_block
            rows = (box[0][0] // k * k, min(info.shape[0], -(-box[0][1] // k) * k))
            out.append((key, (rows, *((0, n) for n in info.shape[1:]))))
        return self.inner.prefetch(out, engine=engine)

    def _check(self, key: str, box: Box) -> None:
        exp = self._expect.get(key)
        if exp is None:
            return
        info = self.inner.schema[key]
        done = self._checked[key]
        if not info.shape:
            todo = [0] if 0 not in done else []
        else:
            r0, r1 = box[0]
            if r1 <= r0:
                return
            todo = [b for b in range(r0 // exp.rows_per_block, (r1 - 1) // exp.rows_per_block + 1) if b not in done]
        for b in todo:
            if info.shape:
                lo, hi = b * exp.rows_per_block, min(info.shape[0], (b + 1) * exp.rows_per_block)
                region = _row_box(info, lo, hi)
                where = f"rows [{lo}, {hi})"
            else:
                region, where = (), "the scalar"
            got = _digest(self.inner.read(key, region).cpu())
            if got != exp.blocks[b]:
                raise SourceError(
                    f"checksum mismatch in {where} (block {b}): the bytes on disk differ from what was "
                    f"recorded in {self.sidecar}. The file is corrupt; copy or download it again",
                    path=self.inner.file_of(key),
                    key=key,
                )
            done.add(b)

    def read(self, key: str, box: Box) -> torch.Tensor:
        self._check(key, box)
        return self.inner.read(key, box)

    def file_of(self, key: str) -> str:
        return self.inner.file_of(key)

    def close(self) -> None:
        self.inner.close()


def write_checksums_data(path: str, tensors: Mapping[str, Any]) -> str:
    """Write already computed per-tensor entries (:func:`tensor_checksums`) as the sidecar of ``path``."""
    out = checksums_path(path)
    tmp = f"{out}.tmp"
    with open(tmp, "w") as f:
        json.dump({"format": FORMAT, "algorithm": ALGORITHM, "tensors": dict(sorted(tensors.items()))}, f, separators=(",", ":"))
    os.replace(tmp, out)
    return out


def write_checksums_shared(path: str, rank: int, world: int, group: Any = None) -> None:
    """Collective over ``group`` (a ``torch.distributed`` group; ``None`` outside one): the
    sidecar of the checkpoint just written at ``path``, each rank reading back its share of the
    keys, rank 0 writing it; one rank's failure is every rank's error."""
    import torch.distributed as dist

    from .._base.distributed import gather_agreed, is_distributed

    error: SdadaptError | None = None
    mine: dict[str, Any] = {}
    try:
        mine = checksums_of_saved(path, rank, world)
    except SdadaptError as e:
        error = e
    parts = gather_agreed(mine, error, group)
    if rank == 0:
        write_checksums_data(path, {k: v for p in parts for k, v in p.items()})
    if is_distributed():
        dist.barrier(group=group)


def checksums_of_saved(path: str, rank: int = 0, world: int = 1) -> dict[str, Any]:
    """This rank's share (every ``world``-th key) of the checksums of a saved checkpoint, read back."""
    from . import open_source

    source = open_source(path, subtree="")
    try:
        keys = sorted(source.schema)[rank::world]
        return compute_checksums(source, keys)["tensors"]
    finally:
        source.close()
