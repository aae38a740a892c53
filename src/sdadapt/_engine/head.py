"""A one-rank GPU load's head start (``EngineConfig.head_bytes``).

Between the plan and the engine's run, a load materialises the model, agrees on it and hands
DCP its state dict: tens of milliseconds in which no byte moves. A head start has kvikio read
the stored bytes of the load's first plain reads (whole source tensors, no computation) into
pinned host memory meanwhile; the run then copies each read those bytes cover from there
(:meth:`HeadStart.serve`, on a stream of its own) instead of reading it again, while kvikio
reads the rest straight into the GPU. kvikio's queue runs in order, so the head start's reads
end before the run's own begin. The pinned memory is one slab kept for the next load
(:data:`~sdadapt._engine.pinned.HEAD_SLABS`), pinned in the background as a process's first GPU
load ends (:func:`pin_later`); a load that finds none kept pins it so for the next one and
reads as it would without.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import logging
import math
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from . import devread
from .config import EngineConfig
from .pinned import HEAD_SLABS, SlabCache
from .tasks import DirectRead, Where

if TYPE_CHECKING:
    from .._recipes.nodes import Node
    from ..sources import Source

log = logging.getLogger(__name__)


_HEAD_SEGMENTS = 64  # a read cut into more segments than this keeps kvikio's path (one copy each)


@dataclass(frozen=True)
class _Piece:
    """A stored tensor the head start reads: ``nbytes`` at ``offset`` of ``path``, placed at
    ``at`` in its buffer."""

    path: str
    offset: int
    nbytes: int
    at: int


class HeadStart:
    """One load's head start (see the module): its pieces, the buffer they are read into, the
    reads, and the copies out of it."""

    def __init__(self, device: torch.device, pieces: list[_Piece], slab: Any, slabs: SlabCache):
        self.device = device
        self.pieces = pieces
        self.slab = slab
        self.slabs = slabs
        self.buffer: torch.Tensor = slab.tensor
        self.served = 0  # bytes copied to destinations from the buffer
        self._index: dict[str, list[_Piece]] = {}
        for piece in sorted(pieces, key=lambda p: (p.path, p.offset)):
            self._index.setdefault(piece.path, []).append(piece)
        self._starts = {path: [p.offset for p in ps] for path, ps in self._index.items()}
        self._pending = devread.Pending()
        self._reads: devread.DeviceReads | None = None
        self._handles: list[Any] = []
        self._complete = False  # every piece was handed to kvikio
        self._ok: bool | None = None  # known once the reads have been waited for
        self._stream: Any = None
        self._closed = False
        self._thread: threading.Thread | None = None

    def start(self, choose: Callable[[], devread.DeviceReads | None]) -> None:
        """Hand every piece to kvikio (``choose``: the run's kvikio) on a thread; returns at once."""
        self._thread = threading.Thread(target=self._submit, args=(choose,), name="sdadapt-head", daemon=True)
        self._thread.start()

    def _submit(self, choose: Callable[[], devread.DeviceReads | None]) -> None:
        try:
            reads = self._reads = choose()
            if reads is None:
                return
            handles: dict[str, Any] = {}
            for p in self.pieces:
                if p.path not in handles:
                    handles[p.path] = reads.open(p.path)
                    self._handles.append(handles[p.path])
                where = Where("(head start)", None, p.path, ())
                into = self.buffer[p.at : p.at + p.nbytes]
                into_host = into.numpy() if into.device.type == "cpu" else into  # kvikio reads a host buffer through its array interface
                reads.submit(handles[p.path], [(p.offset, p.nbytes)], into_host, where, self._pending)
            self._complete = True
        except Exception as e:  # noqa: BLE001 - the run reads these tensors itself
            log.debug("the head start's reads could not be queued: %s", e)

    def ready(self) -> bool:
        """Whether the buffer holds every piece: waits for the reads (once)."""
        if self._ok is None:
            if self._thread is not None:
                self._thread.join()
            errors = devread.DeviceReads.wait(self._pending)
            self._ok = self._complete and not errors
            if errors:
                log.debug("the head start's reads failed (the run reads those tensors itself): %s", errors[0])
        return self._ok

    def done(self) -> bool:
        """Whether every read ahead has ended (without waiting)."""
        if self._ok is not None:
            return True
        return self._submitted_all() and all(fut.done() for fut, *_ in self._pending.reads)

    def _submitted_all(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def covers(self, task: DirectRead) -> bool:
        """Whether the buffer is to hold all of ``task``'s bytes."""
        return self._spots(task) is not None

    def _spots(self, task: DirectRead) -> list[int] | None:
        """Where each of ``task``'s segments starts in the buffer; ``None`` unless all are in it."""
        pieces, starts = self._index.get(task.path), self._starts.get(task.path)
        if not pieces or starts is None or len(task.segments) > _HEAD_SEGMENTS:
            return None
        spots = []
        for off, n in task.segments:
            i = bisect.bisect_right(starts, off) - 1
            if i < 0 or off + n > pieces[i].offset + pieces[i].nbytes:
                return None
            spots.append(pieces[i].at + off - pieces[i].offset)
        return spots

    def serve(self, task: DirectRead) -> bool:
        """Copy ``task``'s bytes from the buffer into its destination, where the buffer holds
        them all; ``False`` (nothing done) otherwise."""
        spots = self._spots(task)
        if spots is None or not self.ready():
            return False
        if self.device.type == "cuda":
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
                self._stream.wait_stream(torch.cuda.current_stream(self.device))  # where the destinations were made
            context: Any = torch.cuda.stream(self._stream)
        else:
            context = contextlib.nullcontext()
        pos = 0
        with context:
            for (_, n), at in zip(task.segments, spots, strict=True):
                task.dest[pos : pos + n].copy_(self.buffer[at : at + n], non_blocking=True)
                pos += n
        self.served += pos
        return True

    def close(self) -> None:
        """Wait for every read and copy, close the files and keep the memory for the next load."""
        if self._closed:
            return
        self._closed = True
        self.ready()
        if self._stream is not None:
            self._stream.synchronize()
        for handle in self._handles:
            devread.DeviceReads.close(handle)
        self.slabs.put(self.slab)


_HEADS: dict[torch.device, HeadStart] = {}  # begun by a load, taken by its run


def plain_reads(source: Source, recipes: Mapping[str, Node], budget: int) -> list[_Piece]:
    """The whole stored tensors of ``recipes`` that are read as they are stored (a recipe
    without inputs: no computation), in the plan's order, as many as fit in ``budget`` bytes,
    each placed after the last in a buffer (at multiples of 64 bytes)."""
    pieces: list[_Piece] = []
    at = 0
    seen: set[str] = set()
    for node in recipes.values():
        keys = node.leaves()
        if node.children() or len(keys) != 1 or keys[0] in seen:
            continue
        seen.add(keys[0])
        loc = source.locate(keys[0])
        if loc is None or not os.path.isfile(loc.path):
            continue
        nbytes = math.prod(loc.shape) * loc.dtype.itemsize
        if nbytes == 0 or at + nbytes > budget:
            continue
        pieces.append(_Piece(loc.path, loc.offset, nbytes, at))
        at += -(-nbytes // 64) * 64
    return pieces


def begin_head(
    device: torch.device, source: Source, recipes: Mapping[str, Node], cfg: EngineConfig, slabs: SlabCache | None = None
) -> HeadStart | None:
    """Start a head start for the next run on ``device`` (see :class:`HeadStart`): the pieces
    :func:`plain_reads` picks, read by kvikio into a buffer kept from an earlier load
    (``slabs``, by default :data:`~sdadapt._engine.pinned.HEAD_SLABS`). Where none is kept,
    none is started: the buffer is pinned in the background for the next load instead
    (pinning it now would hold this load up). Returns the head start, also kept for
    :func:`take_head`."""
    slabs = slabs if slabs is not None else HEAD_SLABS
    pieces = plain_reads(source, recipes, cfg.head_bytes)
    if not pieces:
        return None
    nbytes = pieces[-1].at + pieces[-1].nbytes
    slab = slabs.take_kept(nbytes)
    if slab is None:
        slabs.prefetch(max(nbytes, cfg.head_bytes), device)
        return None
    head = HeadStart(device, pieces, slab, slabs)
    head.start(functools.partial(devread.select, device, cfg.kvikio, *cfg.kvikio_settings()))
    _HEADS[device] = head
    log.debug("head start: %d tensors, %d bytes read ahead into pinned memory", len(pieces), nbytes)
    return head


def pin_later(device: torch.device, cfg: EngineConfig) -> None:
    """After a process's first GPU run (which reads without kvikio, so without a head start):
    pin the head start's memory in the background where ``cfg.head_bytes`` asks for one and
    the process is one rank, so that the next load finds it kept."""
    several = torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
    if cfg.head_bytes > 0 and not several:
        HEAD_SLABS.prefetch(cfg.head_bytes, device)


def take_head(device: torch.device) -> HeadStart | None:
    """The head start begun for ``device``, handed to the run that reads through kvikio there
    (which closes it), or ``None``."""
    return _HEADS.pop(device, None)


def wants_head(device: torch.device | None, source: Source, cfg: EngineConfig, one_rank: bool) -> bool:
    """Whether a load gets a head start: ``cfg.head_bytes`` asks for one, and the load is one
    rank's into a GPU that reads local files through kvikio (not a process's first GPU load,
    which reads without it)."""
    return (
        device is not None and device.type == "cuda" and one_rank and cfg.head_bytes > 0 and cfg.kvikio is not False
        and source.remote_url() is None and not devread.deferred(cfg.kvikio, *cfg.kvikio_settings())
    )  # fmt: skip


@contextlib.contextmanager
def heading(
    device: torch.device | None, source: Source, recipes: Mapping[str, Node], cfg: EngineConfig | None, one_rank: bool
) -> Iterator[None]:
    """Around a load's materialising and run: a head start where :func:`wants_head`; one that
    no run took is closed at the end (its reads waited for, its memory kept)."""
    cfg = cfg or EngineConfig.from_env()
    if device is not None and wants_head(device, source, cfg, one_rank):
        if device.type == "cuda" and device.index is None:  # the run's destinations name their GPU: key the head start by it too
            device = torch.device(device.type, torch.cuda.current_device())
        begin_head(device, source, recipes, cfg)
    try:
        yield
    finally:
        if device is not None and (left := _HEADS.pop(device, None)) is not None:
            left.close()
