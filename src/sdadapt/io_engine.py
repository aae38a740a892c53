"""The I/O engine behind :class:`~sdadapt.reader.AdaptedStorageReader`.

``dcp.load`` gives a rank its ``ReadItem``s (a target key, a box of it in global coordinates, a
destination shard). The engine turns all of them into file reads at once and runs those reads
on a thread pool:

1. **Routing.** Each recipe (:mod:`sdadapt.nodes`) is walked down to its leaves for the item's
   box: a concat gives each part its slice of the destination, a narrow shifts the box, a cast
   lets ``copy_`` convert, transpose/select/stack re-view the destination. The result is a list
   of *pieces*: "source tensor ``key``, region ``box``, goes into this view of the destination".
   Nodes the engine does not know (unit permutations, padding...) are computed with their own
   ``read`` and copied: correct for any node, just not zero-copy.
2. **Locating.** Where a source tensor is stored contiguously in a file (safetensors always;
   ``torch.save`` zip files when the storages line up with the zip records), a box becomes
   byte spans of that file: one span when the box covers whole rows (FSDP's dim-0 shards), one
   span per row otherwise (TP's column shards; rows shorter than 64 KiB are instead copied
   out of the source's mapping in one strided copy). A source stored in chunks offers
   ``locate_region(key, box)`` (DCP folders: the raw bytes of each stored chunk inside its
   ``torch.save`` record, see :mod:`sdadapt.sources.dcp_dir`); the box is then cut at the chunk
   boundaries and each part located in its chunk. Other sources are read through
   ``Source.read``.
3. **Tasks.** A CPU destination that is contiguous and of the source dtype is read *straight
   into* with ``os.preadv`` (no copy, no staging), in chunks so that several threads share a large
   tensor. Otherwise the bytes go into a staging buffer from a bounded pool (pinned when the
   destination is on a GPU), then ``copy_`` moves them (``non_blocking`` on a per-thread CUDA
   stream, so the next read overlaps the host-to-device copy). Small staged reads that are
   adjacent in one file are **coalesced** into one read.
4. **Threads.** A pool sized to the machine (CPUs of this process / ranks on this host, or
   ``SDADAPT_IO_THREADS``). ``pread`` and ``copy_`` release the GIL, so threads read in parallel;
   Python runs per task (a chunk of megabytes), never per element.

Errors name the target key, the source key and the file. Bytes read are counted exactly
(what was copied out of the checkpoint, including any gap a coalesced read spans).
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import nodes as N
from .errors import LoadError
from .nodes import Box, box_shape
from .sources.base import Source

log = logging.getLogger(__name__)

MiB = 1 << 20


# --- configuration ----------------------------------------------------------------------


def default_threads() -> int:
    """Threads for one rank: ``SDADAPT_IO_THREADS``, else this process's CPUs divided by the
    ranks on this host (``LOCAL_WORLD_SIZE``), between 1 and 32."""
    env = os.environ.get("SDADAPT_IO_THREADS")
    if env:
        return max(1, int(env))
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(1, min(32, cpus // local))


@dataclass
class EngineConfig:
    """Knobs of the engine; the defaults suit most machines.

    ``staging_bytes`` bounds the staging memory of one load on one rank (pinned when loading to
    a GPU); ``chunk_bytes`` is the largest single read (default: staging / (2 x threads), 1 to
    32 MiB); ``coalesce_gap`` is how many unwanted bytes a coalesced read may span between two
    wanted regions (counted as read); ``direct_min_bytes`` is the size from which a CPU
    destination is read into directly rather than through staging (and coalescing);
    a region made of several runs shorter than ``min_span_bytes`` each (a column slice) is
    copied out of the source's mapping in one strided copy instead of one read per run.
    """

    threads: int = field(default_factory=default_threads)
    staging_bytes: int = 256 * MiB
    chunk_bytes: int | None = None
    coalesce_gap: int = 0
    direct_min_bytes: int = 256 * 1024
    min_span_bytes: int = 64 * 1024

    def chunk(self) -> int:
        if self.chunk_bytes is not None:
            return max(4096, self.chunk_bytes)
        return max(MiB, min(32 * MiB, self.staging_bytes // (2 * max(1, self.threads))))

    @classmethod
    def from_env(cls) -> "EngineConfig":
        cfg = cls()
        if os.environ.get("SDADAPT_IO_STAGING_MB"):
            cfg.staging_bytes = int(float(os.environ["SDADAPT_IO_STAGING_MB"]) * MiB)
        if os.environ.get("SDADAPT_IO_CHUNK_MB"):
            cfg.chunk_bytes = int(float(os.environ["SDADAPT_IO_CHUNK_MB"]) * MiB)
        return cfg


# --- where a source tensor's bytes are ----------------------------------------------------


@dataclass(frozen=True)
class TensorLocation:
    """A source tensor stored contiguously (row-major) at byte ``offset`` of file ``path``."""

    path: str
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def locate(source: Source, key: str) -> TensorLocation | None:
    """Where ``key``'s bytes are, if the source stores it contiguously in one file.

    A source may offer ``locate(key)`` itself; the built-in safetensors sources are handled
    here; others (and ``torch.save`` files whose layout we cannot prove) return ``None`` and are
    read through ``Source.read``."""
    own = getattr(source, "locate", None)
    if callable(own):
        return own(key)
    from .sources.hf_sharded import HFShardedSource
    from .sources.safetensors_file import SafetensorsFile
    from .sources.torch_save import TorchSaveFile

    if isinstance(source, HFShardedSource):
        sf = source._key_file.get(key)
        return locate(sf, key) if sf is not None else None
    if isinstance(source, SafetensorsFile):
        entry = source._entries.get(key)
        if entry is None:
            return None
        info, begin, _ = entry
        return TensorLocation(source.path, source._data_start + begin, tuple(info.shape), info.dtype)
    if isinstance(source, TorchSaveFile):
        return _torch_save_locations(source).get(key)
    return None


def _torch_save_locations(source: Any) -> dict[str, TensorLocation]:
    """File offsets of a mapped ``torch.save`` zip file's tensors.

    ``torch.load(mmap=True)`` maps the whole file once and makes each storage a slice of that
    mapping at its zip record's offset. So ``storage pointer - record offset`` is one constant
    (the mapping's base) for every storage; we find it, check that every storage agrees, and
    check a few tensors' first bytes against the file. If anything disagrees we return ``{}``
    and the source is read through its mapping instead."""
    cached = getattr(source, "_sdadapt_locations", None)
    if cached is not None:
        return cached
    out: dict[str, TensorLocation] = {}
    try:
        out = _compute_torch_save_locations(source.path, source._tensors)
    except Exception as e:  # noqa: BLE001 - an optimisation only: fall back to mapped reads
        log.debug("%s: no file offsets for direct reads (%s); using the mapping", source.path, e)
        out = {}
    try:
        source._sdadapt_locations = out
    except AttributeError:
        pass
    return out


def _compute_torch_save_locations(path: str, tensors: dict[str, torch.Tensor]) -> dict[str, TensorLocation]:
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
        out[k] = TensorLocation(
            path, ptrs[k] - base + t.storage_offset() * t.element_size(), tuple(t.shape), t.dtype
        )
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


# --- routing recipes to pieces ----------------------------------------------------------------


@dataclass
class Piece:
    """Region ``box`` of source tensor ``key`` goes into ``dest`` (same shape; dtype may differ:
    ``copy_`` converts, which is what a cast rule means)."""

    key: str
    box: Box
    dest: torch.Tensor


@dataclass
class Fill:
    dest: torch.Tensor
    value: float


@dataclass
class Compute:
    """A node the engine cannot route: ``node.read(box)`` then copy into ``dest``."""

    node: N.Node
    box: Box
    dest: torch.Tensor


Action = Piece | Fill | Compute


def _node_class(name: str) -> type | None:
    return getattr(N, name, None)


def route(node: N.Node, box: Box, dest: torch.Tensor, out: list[Action]) -> None:
    """Append the actions that fill ``dest`` (shape ``box_shape(box)``) with ``node[box]``."""
    if any(a >= b for a, b in box):
        return  # empty region
    t = type(node)
    if t is N.Leaf:
        out.append(Piece(node.key, box, dest))
    elif t is N.Cast:
        route(node.child, box, dest, out)  # type: ignore[attr-defined]
    elif t is N.Narrow:
        d, s = node.dim, node.start  # type: ignore[attr-defined]
        a, b = box[d]
        route(node.child, box[:d] + ((a + s, b + s),) + box[d + 1 :], dest, out)  # type: ignore[attr-defined]
    elif t is N.Concat:
        d = node.dim  # type: ignore[attr-defined]
        lo, hi = box[d]
        offset = 0
        for part in node.parts:  # type: ignore[attr-defined]
            n = part.shape[d]
            a, b = max(lo, offset), min(hi, offset + n)
            if a < b:
                sub = box[:d] + ((a - offset, b - offset),) + box[d + 1 :]
                route(part, sub, dest.narrow(d, a - lo, b - a), out)
            offset += n
    elif t is _node_class("Transpose"):
        d0, d1 = node.dim0, node.dim1  # type: ignore[attr-defined]
        b = list(box)
        b[d0], b[d1] = b[d1], b[d0]
        route(node.child, tuple(b), dest.transpose(d0, d1), out)  # type: ignore[attr-defined]
    elif t is _node_class("Select"):
        d, i = node.dim, node.index  # type: ignore[attr-defined]
        route(node.child, box[:d] + ((i, i + 1),) + box[d:], dest.unsqueeze(d), out)  # type: ignore[attr-defined]
    elif t is _node_class("Stack"):
        d = node.dim  # type: ignore[attr-defined]
        a, b = box[d]
        inner = box[:d] + box[d + 1 :]
        for e in range(a, b):
            route(node.parts[e], inner, dest.select(d, e - a), out)  # type: ignore[attr-defined]
    else:
        out.append(Compute(node, box, dest))


# --- byte spans of a box --------------------------------------------------------------------


def box_spans(shape: Sequence[int], itemsize: int, box: Box) -> tuple[list[int], int]:
    """Byte offsets (relative to the tensor's start) of the contiguous runs of ``box`` in a
    row-major tensor of ``shape``, in box order, and the length of each run in bytes."""
    nd = len(shape)
    if nd == 0:
        return [0], itemsize
    strides = [1] * nd
    for i in range(nd - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    # k: the outermost dim such that every dim after it is covered whole
    k = nd - 1
    while k > 0 and box[k] == (0, shape[k]):
        k -= 1
    run = (box[k][1] - box[k][0]) * strides[k] * itemsize
    start = box[k][0] * strides[k]
    if k == 0:
        return [start * itemsize], run
    # offsets of every index combination of dims 0..k-1
    offs = torch.zeros((), dtype=torch.int64)
    for d in range(k):
        a, b = box[d]
        idx = torch.arange(a, b, dtype=torch.int64) * strides[d]
        offs = (offs.unsqueeze(-1) + idx).reshape(-1)
    return ((offs + start) * itemsize).tolist(), run


# --- tasks --------------------------------------------------------------------------------


@dataclass
class _Where:
    """What a task is about, for error messages."""

    target: str
    source_key: str | None
    path: str | None
    box: Box


@dataclass
class _Delivery:
    """``staging[offset : offset + nbytes]`` viewed as ``dtype``/``shape`` goes into ``dest``."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    dest: torch.Tensor
    where: _Where


@dataclass
class _Task:
    kind: str  # "direct" | "staged" | "view" | "compute" | "fill"
    path: str | None = None
    segments: list[tuple[int, int]] = field(default_factory=list)  # (file offset, nbytes), packed in order
    dest: torch.Tensor | None = None  # direct: the contiguous destination bytes (uint8 view)
    deliveries: list[_Delivery] = field(default_factory=list)
    action: Action | None = None
    where: _Where | None = None

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.segments)


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 tensor (same memory)."""
    flat = t.reshape(-1)
    return flat.view(torch.uint8) if t.dtype != torch.uint8 else flat


def _split_segments(segments: list[tuple[int, int]], chunk: int) -> list[list[tuple[int, int]]]:
    """Cut a packed list of segments into groups of at most ``chunk`` bytes (splitting spans)."""
    groups: list[list[tuple[int, int]]] = []
    cur: list[tuple[int, int]] = []
    size = 0
    for off, n in segments:
        while n > 0:
            take = min(n, chunk - size)
            cur.append((off, take))
            size += take
            off += take
            n -= take
            if size == chunk:
                groups.append(cur)
                cur, size = [], 0
    if cur:
        groups.append(cur)
    return groups


def _split_box(box: Box, itemsize: int, chunk: int) -> list[tuple[Box, tuple[slice, ...]]]:
    """Sub-boxes of ``box`` of at most ``chunk`` bytes (where one element row allows), with the
    slices of the box-shaped destination that each fills."""
    shape = box_shape(box)
    nd = len(shape)
    total = itemsize
    for s in shape:
        total *= s
    if total <= chunk or nd == 0:
        return [(box, tuple(slice(None) for _ in shape))]
    # slab[d] = bytes of one index of dim d (all later dims whole)
    slab = [itemsize] * nd
    for d in range(nd - 2, -1, -1):
        slab[d] = slab[d + 1] * shape[d + 1]
    d = 0
    while d < nd - 1 and slab[d] > chunk:
        d += 1
    per = max(1, chunk // slab[d])
    out = []

    def rec(prefix: tuple[int, ...]) -> None:
        i = len(prefix)
        if i == d:
            for s in range(0, shape[d], per):
                e = min(shape[d], s + per)
                sub = tuple((box[j][0] + prefix[j], box[j][0] + prefix[j] + 1) for j in range(d))
                sub += ((box[d][0] + s, box[d][0] + e),) + box[d + 1 :]
                sl = tuple(slice(p, p + 1) for p in prefix) + (slice(s, e),)
                out.append((sub, sl))
            return
        for p in range(shape[i]):
            rec(prefix + (p,))

    rec(())
    return out


class _Pool:
    """A bounded set of staging buffers (pinned for GPU destinations), allocated on demand."""

    def __init__(self, count: int, size: int, pin: bool):
        self.size = size
        self.pin = pin
        self._free: queue.LifoQueue[torch.Tensor] = queue.LifoQueue()
        self._left = count
        self._lock = threading.Lock()
        self.allocated = 0

    def try_get(self) -> torch.Tensor | None:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            if self._left > 0:
                self._left -= 1
                self.allocated += 1
                return torch.empty(self.size, dtype=torch.uint8, pin_memory=self.pin)
        return None

    def get(self) -> torch.Tensor:
        buf = self.try_get()
        return buf if buf is not None else self._free.get()

    def put(self, buf: torch.Tensor) -> None:
        self._free.put(buf)


@dataclass
class EngineStats:
    bytes_read: int = 0
    syscalls: int = 0
    tasks: int = 0
    direct_bytes: int = 0
    staged_bytes: int = 0
    coalesced: int = 0  # staged pieces that shared a read with another
    computed: int = 0  # pieces read through Source.read / node.read
    staging_buffers: int = 0
    staging_bytes: int = 0
    threads: int = 0
    seconds: float = 0.0


class _Counter:
    """Per-thread ``SourceIO`` with a byte count (no shared counter, no lock)."""

    def __init__(self, source: Source):
        self.source = source
        self.bytes_read = 0

    def read(self, key: str, box: Box) -> torch.Tensor:
        t = self.source.read(key, box)
        self.bytes_read += t.numel() * t.element_size()
        return t


@dataclass
class Job:
    """One ReadItem: fill ``dest`` with region ``box`` of target ``key`` made by ``node``."""

    key: str
    node: N.Node
    box: Box
    dest: torch.Tensor


def _preadv_into(fd: int, mem: torch.Tensor, pos: int, offset: int, nbytes: int) -> int:
    """Read ``nbytes`` at file ``offset`` into the uint8 CPU tensor ``mem`` at ``pos``."""
    addr = mem.data_ptr() + pos
    done = 0
    calls = 0
    while done < nbytes:
        buf = (ctypes.c_char * (nbytes - done)).from_address(addr + done)
        n = os.preadv(fd, [buf], offset + done)
        calls += 1
        if n <= 0:
            raise OSError(f"unexpected end of file at byte {offset + done} (wanted {nbytes - done} more bytes); the file is truncated")
        done += n
    return calls


class IOEngine:
    """Runs a rank's reads for one ``dcp.load``; see the module docstring."""

    def __init__(self, source: Source, config: EngineConfig | None = None):
        self.source = source
        self.config = config or EngineConfig.from_env()
        self.stats = EngineStats()
        self._locations: dict[str, TensorLocation | None] = {}
        self._files: dict[str, bool] = {}

    def _locate(self, key: str) -> TensorLocation | None:
        if key not in self._locations:
            loc = locate(self.source, key)
            if loc is not None and not os.path.isfile(loc.path):
                loc = None
            self._locations[key] = loc
        return self._locations[key]

    def _is_file(self, path: str) -> bool:
        ok = self._files.get(path)
        if ok is None:
            ok = self._files[path] = os.path.isfile(path)
        return ok

    def _file_of(self, key: str) -> str:
        try:
            return self.source.file_of(key)
        except Exception:  # noqa: BLE001
            return self.source.path

    # -- planning -------------------------------------------------------------------------
    def plan(self, jobs: Sequence[Job]) -> list[_Task]:
        cfg = self.config
        chunk = cfg.chunk()
        tasks: list[_Task] = []
        small: list[tuple[str, int, int, torch.Tensor, Box, _Where, torch.dtype]] = []  # single-span staged pieces
        for job in jobs:
            actions: list[Action] = []
            route(job.node, job.box, job.dest, actions)
            for act in actions:
                if isinstance(act, Fill):
                    tasks.append(_Task("fill", action=act, where=_Where(job.key, None, None, job.box)))
                    continue
                if isinstance(act, Compute):
                    files = sorted({self._file_of(k) for k in act.node.leaves()})
                    tasks.append(_Task("compute", action=act, where=_Where(job.key, None, ", ".join(files), act.box)))
                    continue
                for loc, box, dest, origin in self._parts(act):
                    where = _Where(job.key, act.key, loc.path if loc else self._file_of(act.key), act.box)
                    if loc is None:
                        # unknown storage: one read per piece (a sub-box read could cost the source a
                        # whole stored chunk each time, e.g. DCP files)
                        tasks.append(_Task("view", action=act, where=where))
                        continue
                    self._plan_located(loc, box, dest, origin, act.key, where, tasks, small)
        tasks.extend(self._coalesce(small, chunk))
        return tasks

    def _parts(self, act: Piece) -> list[tuple[TensorLocation | None, Box, torch.Tensor, tuple[int, ...]]]:
        """Where the piece's bytes are: (location, box in the located tensor's coordinates,
        destination view, the located tensor's origin in the source tensor). A source stored in
        chunks (DCP) gives one part per stored chunk the box intersects."""
        region = getattr(self.source, "locate_region", None)
        if callable(region):
            chunks = region(act.key, act.box)
            if chunks is not None and all(self._is_file(loc.path) for _, loc in chunks):
                parts = []
                for cb, loc in chunks:
                    lo = [max(a, o) for (a, _), (o, _) in zip(act.box, cb)]
                    hi = [min(b, e) for (_, b), (_, e) in zip(act.box, cb)]
                    if any(x >= y for x, y in zip(lo, hi)):
                        continue
                    dest = act.dest[tuple(slice(x - a, y - a) for x, y, (a, _) in zip(lo, hi, act.box))]
                    box = tuple((x - o, y - o) for x, y, (o, _) in zip(lo, hi, cb))
                    parts.append((loc, box, dest, tuple(o for o, _ in cb)))
                return parts
            return [(None, act.box, act.dest, ())]
        return [(self._locate(act.key), act.box, act.dest, ())]

    def _plan_located(
        self,
        loc: TensorLocation,
        box: Box,
        dest: torch.Tensor,
        origin: tuple[int, ...],
        key: str,
        where: _Where,
        tasks: list[_Task],
        small: list[tuple[str, int, int, torch.Tensor, Box, _Where, torch.dtype]],
    ) -> None:
        cfg = self.config
        chunk = cfg.chunk()
        itemsize = loc.dtype.itemsize
        starts, run = box_spans(loc.shape, itemsize, box)
        if len(starts) > 1 and run < cfg.min_span_bytes:
            # many short rows (a column slice): one strided copy out of the mapped file
            # beats a read call per row (Source.read takes global coordinates)
            for sub, sl in _split_box(box, itemsize, chunk):
                glob = tuple((a + o, b + o) for (a, b), o in zip(sub, origin)) if origin else sub
                tasks.append(_Task("view", action=Piece(key, glob, dest[sl]), where=where))
            return
        direct = (
            dest.device.type == "cpu"
            and dest.dtype == loc.dtype
            and dest.is_contiguous()
            and dest.numel() * itemsize >= cfg.direct_min_bytes
        )
        if direct:
            segs = [(loc.offset + s, run) for s in starts]
            mem = _bytes_view(dest)
            pos = 0
            for group in _split_segments(segs, chunk):
                n = sum(g[1] for g in group)
                tasks.append(_Task("direct", path=loc.path, segments=group, dest=mem[pos : pos + n], where=where))
                pos += n
            return
        for sub, sl in _split_box(box, itemsize, chunk):
            starts, run = box_spans(loc.shape, itemsize, sub)
            d = dest[sl]
            if len(starts) == 1:
                small.append((loc.path, loc.offset + starts[0], run, d, sub, where, loc.dtype))
            else:
                segs = [(loc.offset + s, run) for s in starts]
                tasks.append(
                    _Task(
                        "staged",
                        path=loc.path,
                        segments=segs,
                        deliveries=[_Delivery(0, len(segs) * run, loc.dtype, box_shape(sub), d, where)],
                        where=where,
                    )
                )

    def _coalesce(self, small: list[tuple[str, int, int, torch.Tensor, Box, _Where, torch.dtype]], chunk: int) -> list[_Task]:
        """Merge single-span staged pieces that are adjacent in one file into shared reads."""
        gap = self.config.coalesce_gap
        out: list[_Task] = []
        small.sort(key=lambda s: (s[0], s[1]))
        cur: _Task | None = None
        cur_end = 0
        for path, off, n, dest, box, where, src_dtype in small:
            if cur is not None and cur.path == path and 0 <= off - cur_end <= gap and (off + n - cur.segments[0][0]) <= chunk:
                start = cur.segments[0][0]
                cur.segments = [(start, off + n - start)]
                cur.deliveries.append(_Delivery(off - start, n, src_dtype, box_shape(box), dest, where))
                cur_end = off + n
                continue
            cur = _Task("staged", path=path, segments=[(off, n)], deliveries=[_Delivery(0, n, src_dtype, box_shape(box), dest, where)], where=where)
            cur_end = off + n
            out.append(cur)
        for t in out:
            if len(t.deliveries) > 1:
                self.stats.coalesced += len(t.deliveries)
        return out

    # -- running --------------------------------------------------------------------------
    def run(self, jobs: Sequence[Job]) -> EngineStats:
        start = time.perf_counter()
        tasks = self.plan(jobs)
        cfg = self.config
        chunk = cfg.chunk()
        cuda_devices = {j.dest.device for j in jobs if j.dest.device.type == "cuda"}
        staged = [t for t in tasks if t.kind == "staged" or (t.kind == "view" and t.action.dest.device.type == "cuda")]  # type: ignore[union-attr]
        threads = max(1, min(cfg.threads, len(tasks)))
        count = max(1, min(cfg.staging_bytes // chunk, 2 * threads, len(staged)))
        pin = bool(cuda_devices) and torch.cuda.is_available()
        pool = _Pool(count, chunk, pin) if staged else None
        fds: dict[str, int] = {}
        for t in tasks:
            if t.path is not None and t.path not in fds:
                try:
                    fds[t.path] = os.open(t.path, os.O_RDONLY)
                except OSError as e:
                    for fd in fds.values():
                        os.close(fd)
                    w = t.where
                    raise LoadError(f"key {w.target!r} (from {t.path}): cannot open the file: {e.strerror or e}") from None
        # big reads first across files, in file order inside each task list: keeps threads busy
        tasks.sort(key=lambda t: -(t.nbytes if t.segments else 0))
        work: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        for t in tasks:
            work.put(t)
        errors: list[BaseException] = []
        failed = threading.Event()
        results: list[tuple[int, int, int, int, int]] = []
        results_lock = threading.Lock()
        device = next(iter(cuda_devices)) if cuda_devices else None
        main_stream = torch.cuda.current_stream(device) if device is not None else None

        def worker() -> None:
            counter = _Counter(self.source)
            nbytes = calls = direct = staged_b = computed = 0
            stream = None
            if device is not None:
                torch.cuda.set_device(device)
                stream = torch.cuda.Stream(device)
                stream.wait_stream(main_stream)  # destinations were allocated/initialised there
            pending: deque[tuple[Any, torch.Tensor]] = deque()

            def release_oldest() -> None:
                ev, buf = pending.popleft()
                ev.synchronize()
                pool.put(buf)  # type: ignore[union-attr]

            def acquire() -> torch.Tensor:
                buf = pool.try_get()  # type: ignore[union-attr]
                if buf is None:
                    while pending:  # never wait for a buffer while holding one of ours
                        release_oldest()
                    buf = pool.get()  # type: ignore[union-attr]
                return buf

            def hand_over(buf: torch.Tensor) -> None:
                if stream is not None:
                    ev = torch.cuda.Event()
                    ev.record(stream)
                    pending.append((ev, buf))
                    if len(pending) >= 2:
                        release_oldest()
                else:
                    pool.put(buf)  # type: ignore[union-attr]

            try:
                while not failed.is_set():
                    try:
                        task = work.get_nowait()
                    except queue.Empty:
                        break
                    try:
                        if task.kind == "direct":
                            fd = fds[task.path]  # type: ignore[index]
                            pos = 0
                            for off, n in task.segments:
                                calls += _preadv_into(fd, task.dest, pos, off, n)  # type: ignore[arg-type]
                                pos += n
                            nbytes += pos
                            direct += pos
                        elif task.kind == "staged":
                            fd = fds[task.path]  # type: ignore[index]
                            buf = acquire()
                            try:
                                pos = 0
                                for off, n in task.segments:
                                    calls += _preadv_into(fd, buf, pos, off, n)
                                    pos += n
                                nbytes += pos
                                staged_b += pos
                                with _on(stream):
                                    for dl in task.deliveries:
                                        src = buf[dl.offset : dl.offset + dl.nbytes].view(dl.dtype).view(dl.shape)
                                        dl.dest.copy_(src, non_blocking=stream is not None)
                            except BaseException:
                                pool.put(buf)  # type: ignore[union-attr]
                                raise
                            hand_over(buf)
                        elif task.kind == "view":
                            act = task.action
                            value = counter.read(act.key, act.box)  # type: ignore[union-attr]
                            computed += 1
                            nb = value.numel() * value.element_size()
                            if stream is not None and act.dest.device.type == "cuda" and nb <= chunk:  # type: ignore[union-attr]
                                buf = acquire()
                                stage = buf[:nb].view(value.dtype).view(value.shape)
                                stage.copy_(value)
                                with _on(stream):
                                    act.dest.copy_(stage, non_blocking=True)  # type: ignore[union-attr]
                                hand_over(buf)
                            else:
                                act.dest.copy_(value)  # type: ignore[union-attr]
                        elif task.kind == "compute":
                            act = task.action
                            value = act.node.read(act.box, counter)  # type: ignore[union-attr]
                            computed += 1
                            with _on(stream):
                                act.dest.copy_(value)  # type: ignore[union-attr]
                        elif task.kind == "fill":
                            with _on(stream):
                                task.action.dest.fill_(task.action.value)  # type: ignore[union-attr]
                    except Exception as e:  # noqa: BLE001 - named and re-raised by run()
                        errors.append(_named(task, e))
                        failed.set()
                while pending:
                    release_oldest()
                if stream is not None:
                    stream.synchronize()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                failed.set()
            finally:
                with results_lock:
                    results.append((nbytes + counter.bytes_read, calls, direct, staged_b, computed))

        pool_threads = [threading.Thread(target=worker, name=f"sdadapt-io-{i}", daemon=True) for i in range(threads)]
        try:
            if threads == 1:
                worker()
            else:
                for th in pool_threads:
                    th.start()
                for th in pool_threads:
                    th.join()
        finally:
            for fd in fds.values():
                os.close(fd)
        st = self.stats
        for nb, calls, direct, staged_b, computed in results:
            st.bytes_read += nb
            st.syscalls += calls
            st.direct_bytes += direct
            st.staged_bytes += staged_b
            st.computed += computed
        st.tasks += len(tasks)
        st.threads = threads
        if pool is not None:
            st.staging_buffers = max(st.staging_buffers, pool.allocated)
            st.staging_bytes = max(st.staging_bytes, pool.allocated * pool.size)
        st.seconds += time.perf_counter() - start
        if errors:
            raise errors[0]
        return st


def _itemsize(t: torch.Tensor) -> int:
    return t.element_size()


class _on:
    """``torch.cuda.stream(s)`` when ``s`` is a stream, else nothing."""

    def __init__(self, stream: Any):
        self.ctx = torch.cuda.stream(stream) if stream is not None else None

    def __enter__(self) -> None:
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self.ctx is not None:
            self.ctx.__exit__(*exc)


def _named(task: _Task, e: Exception) -> LoadError:
    w = task.where
    if isinstance(e, LoadError) or w is None:
        return e if isinstance(e, LoadError) else LoadError(str(e))
    src = f"source key {w.source_key!r} in {w.path}" if w.source_key else f"from {w.path}"
    err = LoadError(f"key {w.target!r} ({src}): reading {list(w.box)} failed: {type(e).__name__}: {e}")
    err.__cause__ = e
    return err


__all__: list[str] = [
    "EngineConfig",
    "EngineStats",
    "IOEngine",
    "Job",
    "TensorLocation",
    "box_spans",
    "default_threads",
    "locate",
    "route",
]
