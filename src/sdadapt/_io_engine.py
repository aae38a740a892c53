"""The I/O engine behind :class:`~sdadapt._reader.AdaptedStorageReader`.

``dcp.load`` gives a rank its ``ReadItem``s (a target key, a box of it in global coordinates, a
destination shard). The engine turns all of them into file reads at once and runs those reads
on a thread pool:

1. **Routing.** Each recipe (:mod:`sdadapt._nodes`) is walked down to its leaves for the item's
   box: a concat gives each part its slice of the destination, a narrow shifts the box, a cast
   lets ``copy_`` convert, transpose/select/stack re-view the destination. The result is a list
   of *pieces*: "source tensor ``key``, region ``box``, goes into this view of the destination".
   Nodes the engine does not know (unit permutations, padding...) are computed with their own
   ``read`` and copied: correct for any node, just not zero-copy.
2. **Locating.** Where a source tensor is stored contiguously in a file (``Source.locate``:
   safetensors always; ``torch.save`` zip files when the storages line up with the zip
   records), a box becomes
   byte spans of that file: one span when the box covers whole rows (FSDP's dim-0 shards), one
   span per row otherwise (TP's column shards; rows shorter than 64 KiB are instead copied
   out of the source's mapping in one strided copy). A source stored in chunks offers
   ``locate_region(key, box)`` (DCP folders: the raw bytes of each stored chunk inside its
   ``torch.save`` record, see :mod:`sdadapt.sources._dcp_dir`); the box is then cut at the chunk
   boundaries and each part located in its chunk. Other sources are read through
   ``Source.read``.
3. **Tasks.** A CPU destination that is contiguous and of the source dtype is read *straight
   into* with ``os.preadv`` (no copy, no staging), in chunks so that several threads share a large
   tensor. Otherwise the bytes go into a staging buffer from a bounded pool (pinned when the
   destination is on a GPU), then ``copy_`` moves them (``non_blocking`` on a per-thread CUDA
   stream, so the next read overlaps the host-to-device copy). Small staged reads that are
   adjacent in one file are **coalesced** into one read.
4. **Threads.** A pool sized to the machine (CPUs of this process / ranks on this host, or
   ``SDADAPT_IO_THREADS``), started before planning: each task is queued as soon as it is made,
   so the first bytes are read while later jobs are still being routed. ``pread`` and ``copy_``
   release the GIL, so threads read in parallel; Python runs per task (a chunk of megabytes),
   never per element. Each thread cycles through ``depth`` (2) staging buffers of its own.

Errors name the target key, the source key and the file. Bytes read are counted exactly
(what was copied out of the checkpoint, including any gap a coalesced read spans).
"""

from __future__ import annotations

import ctypes
import functools
import gc
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _nodes as N
from ._nodes import Box, box_shape
from .errors import LoadError
from .sources._base import Source, TensorLocation

log = logging.getLogger(__name__)

MiB = 1 << 20


# --- configuration ----------------------------------------------------------------------


def default_threads() -> int:
    """Threads for one rank: ``SDADAPT_IO_THREADS``, else this process's CPUs divided by the
    ranks on this host (``LOCAL_WORLD_SIZE``), between 1 and 32; from 8 CPUs per rank on, a
    quarter of them is left to the rest of the process (its main thread, NCCL's and CUDA's
    threads): on 2 H200 ranks sharing 32 CPUs, 12 threads each read faster than 16 or 24
    (bench/RESULTS.md)."""
    env = os.environ.get("SDADAPT_IO_THREADS")
    if env:
        return max(1, int(env))
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    per_rank = max(1, cpus // local)
    if per_rank >= 8:
        per_rank = per_rank * 3 // 4
    return min(32, per_rank)


@dataclass
class EngineConfig:
    """Knobs of the engine; the defaults suit most machines.

    ``staging_bytes`` bounds the staging memory of one load on one rank (pinned when loading to
    a GPU); ``depth`` is how many staging buffers each thread cycles through (a read into one
    overlaps the host-to-device copies out of the others); ``chunk_bytes`` is the largest single
    read (default: staging / (depth x threads), 1 to 32 MiB); ``coalesce_gap`` is how many
    unwanted bytes a coalesced read may span between two wanted regions (counted as read);
    ``direct_min_bytes`` is the size from which a CPU destination is read into directly rather
    than through staging (and coalescing); a region made of several runs shorter than
    ``min_span_bytes`` each (a column slice) is copied out of the source's mapping in one
    strided copy instead of one read per run. Environment: ``SDADAPT_IO_THREADS``,
    ``SDADAPT_IO_STAGING_MB``, ``SDADAPT_IO_CHUNK_MB``, ``SDADAPT_IO_DEPTH``.
    """

    threads: int = field(default_factory=default_threads)
    staging_bytes: int = 256 * MiB
    chunk_bytes: int | None = None
    coalesce_gap: int = 0
    direct_min_bytes: int = 256 * 1024
    min_span_bytes: int = 64 * 1024
    depth: int = 2

    def __post_init__(self) -> None:
        if self.depth < 1:
            raise ValueError(f"EngineConfig.depth must be at least 1 (staging buffers per thread), got {self.depth}")

    def chunk(self) -> int:
        if self.chunk_bytes is not None:
            return max(4096, self.chunk_bytes)
        return max(MiB, min(32 * MiB, self.staging_bytes // (self.depth * max(1, self.threads))))

    @classmethod
    def from_env(cls) -> EngineConfig:
        cfg = cls()
        if os.environ.get("SDADAPT_IO_STAGING_MB"):
            cfg.staging_bytes = int(float(os.environ["SDADAPT_IO_STAGING_MB"]) * MiB)
        if os.environ.get("SDADAPT_IO_CHUNK_MB"):
            cfg.chunk_bytes = int(float(os.environ["SDADAPT_IO_CHUNK_MB"]) * MiB)
        if os.environ.get("SDADAPT_IO_DEPTH"):
            cfg.depth = max(1, int(os.environ["SDADAPT_IO_DEPTH"]))
        return cfg


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
    seconds: float = 0.0  # the whole run
    plan_seconds: float = 0.0  # of which turning jobs into tasks


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


_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_populate_ok = [sys.platform.startswith("linux")]


def _populate(mem: torch.Tensor) -> None:
    """Fault in the pages of a CPU destination in one ``madvise(MADV_POPULATE_WRITE)`` call
    before reading into it: fresh memory (a just-materialised model) otherwise takes one page
    fault per 4 KiB inside ``pread``, which costs more than the copy itself (0.30 -> 0.23 s for
    469 MiB on the 2-core VM). Exactly what the write would do anyway; skipped where the kernel
    does not know the flag."""
    if not _populate_ok[0]:
        return
    start = mem.data_ptr()
    lo, hi = -(-start // 4096) * 4096, (start + mem.numel()) // 4096 * 4096
    if hi - lo < (1 << 20):
        return
    libc = _libc()
    if libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_POPULATE_WRITE) != 0:
        _populate_ok[0] = False  # EINVAL before 5.14; never worth an error


@functools.cache
def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


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
            loc = self.source.locate(key)  # None: read through Source.read
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
    def plan(self, jobs: Sequence[Job], emit: Callable[[_Task], None] | None = None) -> list[_Task]:
        """Turn jobs into read tasks. With ``emit``, each task is handed to it as soon as it is
        made (so that reading starts while planning goes on) and the list returned is empty;
        staged pieces under half a chunk, coalesced across all jobs, come last."""
        cfg = self.config
        chunk = cfg.chunk()
        tasks: list[_Task] = []
        push = emit or tasks.append
        small: list[tuple[str, int, int, torch.Tensor, Box, _Where, torch.dtype]] = []  # single-span staged pieces
        for job in jobs:
            actions: list[Action] = []
            route(job.node, job.box, job.dest, actions)
            for act in actions:
                if isinstance(act, Fill):
                    push(_Task("fill", action=act, where=_Where(job.key, None, None, job.box)))
                    continue
                if isinstance(act, Compute):
                    files = sorted({self._file_of(k) for k in act.node.leaves()})
                    push(_Task("compute", action=act, where=_Where(job.key, None, ", ".join(files), act.box)))
                    continue
                for loc, box, dest, origin in self._parts(act):
                    where = _Where(job.key, act.key, loc.path if loc else self._file_of(act.key), act.box)
                    if loc is None:
                        # unknown storage: one read per piece (a sub-box read could cost the source a
                        # whole stored chunk each time, e.g. DCP files)
                        push(_Task("view", action=act, where=where))
                        continue
                    self._plan_located(loc, box, dest, origin, act.key, where, push, small)
        for t in self._coalesce(small, chunk):
            push(t)
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
        push: Callable[[_Task], None],
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
                push(_Task("view", action=Piece(key, glob, dest[sl]), where=where))
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
                push(_Task("direct", path=loc.path, segments=group, dest=mem[pos : pos + n], where=where))
                pos += n
            return
        for sub, sl in _split_box(box, itemsize, chunk):
            starts, run = box_spans(loc.shape, itemsize, sub)
            d = dest[sl]
            if len(starts) == 1 and run < chunk // 2:
                small.append((loc.path, loc.offset + starts[0], run, d, sub, where, loc.dtype))
            else:
                segs = [(loc.offset + s, run) for s in starts]
                push(
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
        """Plan and read ``jobs``; the threads start on the first tasks while planning goes on."""
        start = time.perf_counter()
        cfg = self.config
        chunk = cfg.chunk()
        cuda_devices = {j.dest.device for j in jobs if j.dest.device.type == "cuda"}
        device = next(iter(cuda_devices)) if cuda_devices and torch.cuda.is_available() else None
        threads = max(1, min(cfg.threads, _estimate_tasks(jobs, chunk)))
        pool = _Pool(max(1, cfg.staging_bytes // chunk), chunk, device is not None)  # buffers made on first use
        shared = _Shared(self.source, queue.SimpleQueue(), {}, pool, chunk, device)
        workers = [_Worker(shared, cfg.depth) for _ in range(threads)]
        pool_threads = [threading.Thread(target=w.run, name=f"sdadapt-io-{i}", daemon=True) for i, w in enumerate(workers)]
        for th in pool_threads:
            th.start()
        count = 0

        def push(task: _Task) -> None:
            nonlocal count
            if shared.failed.is_set():
                return  # a thread failed: the load fails, reading on is no use
            if task.path is not None and task.path not in shared.fds:
                shared.fds[task.path] = _open(task)  # opened before any thread sees the task
            shared.work.put(task)
            count += 1

        planned = start
        gc_was_on = gc.isenabled()
        gc.disable()  # a full collection would hold the GIL, and with it every thread, mid-read
        try:
            self.plan(jobs, push)
        except BaseException as e:  # noqa: BLE001 - stop the threads, then raise
            shared.errors.insert(0, e)
            shared.failed.set()
        finally:
            planned = time.perf_counter()
            for _ in pool_threads:
                shared.work.put(None)
            for th in pool_threads:
                th.join()
            if gc_was_on:
                gc.enable()
            for fd in shared.fds.values():
                os.close(fd)
        st = self.stats
        for w in workers:
            st.bytes_read += w.nbytes + w.counter.bytes_read
            st.syscalls += w.calls
            st.direct_bytes += w.direct
            st.staged_bytes += w.staged
            st.computed += w.computed
        st.tasks += count
        st.threads = threads
        st.staging_buffers = max(st.staging_buffers, pool.allocated)
        st.staging_bytes = max(st.staging_bytes, pool.allocated * pool.size)
        st.plan_seconds += planned - start
        st.seconds += time.perf_counter() - start
        if shared.errors:
            raise shared.errors[0]
        return st


def _estimate_tasks(jobs: Sequence[Job], chunk: int) -> int:
    """About how many tasks the jobs make (for sizing the thread pool before planning)."""
    return sum(max(1, -(-j.dest.numel() * j.dest.element_size() // chunk)) for j in jobs)


def _open(task: _Task) -> int:
    """A descriptor for the task's file; an unopenable file names its key."""
    try:
        return os.open(task.path, os.O_RDONLY)  # type: ignore[arg-type]
    except OSError as e:
        w = task.where
        raise LoadError(f"key {w.target!r} (from {task.path}): cannot open the file: {e.strerror or e}") from None  # type: ignore[union-attr]


@dataclass
class _Shared:
    """What the worker threads of one run share."""

    source: Source
    work: queue.SimpleQueue[_Task | None]  # None: no more tasks
    fds: dict[str, int]
    pool: _Pool
    chunk: int
    device: torch.device | None
    errors: list[BaseException] = field(default_factory=list)
    failed: threading.Event = field(default_factory=threading.Event)


class _Worker:
    """One I/O thread: takes tasks until none are left (or one failed anywhere).

    Staged reads cycle through a small ring of this thread's own staging buffers (taken from
    the shared bounded pool, given back at the end): a buffer is reused once the host-to-device
    copy out of it has finished (its event), so the next read overlaps the copy. On a GPU the
    thread's own stream is current for the whole run."""

    def __init__(self, shared: _Shared, depth: int = 2):
        self.shared = shared
        self.depth = depth  # staging buffers of this thread
        self.counter = _Counter(shared.source)
        self.nbytes = self.calls = self.direct = self.staged = self.computed = 0
        self.ring: list[list[Any]] = []  # [buffer, event or None]
        self.turn = 0
        self.stream: Any = None

    def run(self) -> None:
        sh = self.shared
        try:
            if sh.device is not None:
                with torch.cuda.device(sh.device):
                    self.stream = torch.cuda.Stream(sh.device)
                    self.stream.wait_stream(torch.cuda.current_stream(sh.device))  # destinations were made there
                    with torch.cuda.stream(self.stream):
                        self._loop()
                    self.stream.synchronize()
            else:
                self._loop()
        except BaseException as e:  # noqa: BLE001 - re-raised by IOEngine.run
            sh.errors.append(e)
            sh.failed.set()
        finally:
            for buf, _ in self.ring:
                sh.pool.put(buf)

    def _loop(self) -> None:
        sh = self.shared
        while True:
            task = sh.work.get()
            if task is None or sh.failed.is_set():
                return
            try:
                getattr(self, "_" + task.kind)(task)
            except Exception as e:  # noqa: BLE001 - named and re-raised by run()
                sh.errors.append(_named(task, e))
                sh.failed.set()

    def _buffer(self) -> torch.Tensor:
        """A staging buffer free to write: a new one while the ring is short, else the oldest
        once its copy has finished."""
        pool = self.shared.pool
        if len(self.ring) < self.depth:
            buf = pool.try_get() if self.ring else pool.get()
            if buf is not None:
                self.ring.append([buf, None])
                self.turn = len(self.ring) - 1
                return buf
        self.turn = (self.turn + 1) % len(self.ring)
        slot = self.ring[self.turn]
        if slot[1] is not None:
            slot[1].synchronize()
        return slot[0]

    def _copied(self) -> None:
        """Mark the current buffer in use until the copies just queued on the stream finish."""
        if self.stream is not None:
            slot = self.ring[self.turn]
            if slot[1] is None:
                slot[1] = torch.cuda.Event()
            slot[1].record(self.stream)

    def _read_into(self, task: _Task, mem: torch.Tensor) -> int:
        fd = self.shared.fds[task.path]  # type: ignore[index]
        pos = 0
        for off, n in task.segments:
            self.calls += _preadv_into(fd, mem, pos, off, n)
            pos += n
        self.nbytes += pos
        return pos

    def _direct(self, task: _Task) -> None:
        _populate(task.dest)  # type: ignore[arg-type]
        self.direct += self._read_into(task, task.dest)  # type: ignore[arg-type]

    def _staged(self, task: _Task) -> None:
        buf = self._buffer()
        self.staged += self._read_into(task, buf)
        non_blocking = self.stream is not None
        for dl in task.deliveries:
            dl.dest.copy_(buf[dl.offset : dl.offset + dl.nbytes].view(dl.dtype).view(dl.shape), non_blocking=non_blocking)
        self._copied()

    def _view(self, task: _Task) -> None:
        act = task.action
        value = self.counter.read(act.key, act.box)  # type: ignore[union-attr]
        self.computed += 1
        nb = value.numel() * value.element_size()
        if self.stream is not None and act.dest.device.type == "cuda" and nb <= self.shared.chunk:  # type: ignore[union-attr]
            stage = self._buffer()[:nb].view(value.dtype).view(value.shape)
            stage.copy_(value)
            act.dest.copy_(stage, non_blocking=True)  # type: ignore[union-attr]
            self._copied()
        else:
            act.dest.copy_(value)  # type: ignore[union-attr]

    def _compute(self, task: _Task) -> None:
        act = task.action
        value = act.node.read(act.box, self.counter)  # type: ignore[union-attr]
        self.computed += 1
        act.dest.copy_(value)  # type: ignore[union-attr]

    def _fill(self, task: _Task) -> None:
        task.action.dest.fill_(task.action.value)  # type: ignore[union-attr]


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
    "route",
]
