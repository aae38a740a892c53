"""What a rank's engine run would read, without reading: the real planning on meta destinations.

A dry run (:func:`sdadapt.dry_run`) hands :func:`predict` the jobs a rank's ``dcp.load`` would
give its engine, with destinations on the meta device, and the device the real ones would be
on. The engine's own :class:`~sdadapt._engine.planner.Planner` turns them into tasks exactly as
in a load (the same byte ranges, the same direct, staged and coalesced reads), and each task is
counted as its worker would count it (:mod:`sdadapt._engine.workers`): ``preadv`` bytes and
calls per file, reads through the source's mapping, the files the run opens. A computation's
inputs are counted the way a worker reads them (a declared stored region by ``preadv`` while it
fits the band buffer, else through the source); a host function is run on meta tensors to see
what it reads (:class:`MetaIO`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .._base.regions import Box, box_shape
from ..sources import Source
from .config import EngineConfig
from .engine import _estimate_tasks
from .geometry import box_spans, round_up
from .locate import file_runs
from .planner import Planner
from .syscalls import requested, storage_bytes
from .tasks import ComputeTask, DirectRead, FillTask, Job, SourceRead, StagedRead, Task, task_paths


@dataclass
class RunFigures:
    """What one engine run reads: bytes per file, system calls, the files it opens.

    ``file_bytes``: bytes read per file (``preadv`` and the mapping together); ``preadv_calls``:
    one per read call (runs with short gaps share one; a regular file returns it whole); ``mapped_reads``:
    regions copied out of the source's mapping (``Source.read``); ``opened``: files the run
    opens for ``preadv``; ``mapped``: files read through the mapping (opened once per source);
    ``staged_reads``: reads through a staging buffer; ``staging_bytes``: at most this much
    staging and band memory (the pools' limits for the run's threads); ``mapped_span``: the file
    pages the mapped reads touch (they count in the process's resident memory);
    ``staging_touched``: the staging memory the run writes into (buffers are allocated whole
    but only their written pages become resident); ``storage_bytes``: what a cold page cache
    reads from storage for the run, read-ahead off (every page the ``preadv`` calls touch, once
    per file, gaps read through included; the mapped reads' ``mapped_span``)."""

    bytes_read: int = 0
    file_bytes: dict[str, int] = field(default_factory=dict)
    preadv_calls: int = 0
    mapped_reads: int = 0
    opened: set[str] = field(default_factory=set)
    mapped: set[str] = field(default_factory=set)
    tasks: int = 0
    staged_reads: int = 0
    computations: int = 0
    staging_bytes: int = 0
    mapped_span: int = 0
    staging_touched: int = 0
    storage_bytes: int = 0
    extents: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # file -> what preadv asks of it

    def _preadv(self, path: str, segments: list[tuple[int, int]], gap: int) -> None:
        """Count reading ``segments`` of ``path`` as :func:`~sdadapt._engine.syscalls.read_runs` reads them."""
        self._read(path, sum(n for _, n in segments))
        ext = requested(segments, gap if len(segments) > 1 else 0)
        self.preadv_calls += len(ext)
        self.extents.setdefault(path, []).extend(ext)

    def finish(self) -> None:
        """Sum the storage the run's reads ask for (once every read is counted)."""
        self.storage_bytes = self.mapped_span + sum(storage_bytes(ext) for ext in self.extents.values())

    def add(self, other: RunFigures) -> None:
        """Count ``other`` (a later run of the same rank: a round of shared rows) in too; the
        staging limits are the larger run's, the storage of each run its own (its extents kept
        beside this run's)."""
        self.bytes_read += other.bytes_read
        for path, n in other.file_bytes.items():
            self.file_bytes[path] = self.file_bytes.get(path, 0) + n
        for name in ("preadv_calls", "mapped_reads", "tasks", "staged_reads", "computations", "mapped_span", "storage_bytes"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.opened |= other.opened
        self.mapped |= other.mapped
        for path, ext in other.extents.items():
            self.extents.setdefault(path, []).extend(ext)
        self.staging_bytes = max(self.staging_bytes, other.staging_bytes)
        self.staging_touched = max(self.staging_touched, other.staging_touched)

    def _read(self, path: str, nbytes: int) -> None:
        self.bytes_read += nbytes
        self.file_bytes[path] = self.file_bytes.get(path, 0) + nbytes


class MetaIO:
    """A ``SourceIO`` that reads nothing: each region comes back as a meta tensor of its stored
    dtype and shape, and its bytes and file are counted as :class:`~sdadapt._engine.workers.CountingIO`
    would count them."""

    def __init__(self, source: Source, figures: RunFigures, granule: int = 4096):
        self.source = source
        self.figures = figures
        self.granule = granule

    def read(self, key: str, box: Box) -> torch.Tensor:
        info = self.source.schema[key]
        shape = box_shape(box)
        path = self.source.file_of(key)
        nbytes = math.prod(shape) * info.dtype.itemsize
        self.figures._read(path, nbytes)
        self.figures.mapped_reads += 1
        self.figures.mapped.add(path)
        self.figures.mapped_span += _span(self.source, key, box, nbytes, self.granule)
        return torch.empty(shape, dtype=info.dtype, device="meta")


def _span(source: Source, key: str, box: Box, nbytes: int, granule: int = 4096) -> int:
    """The bytes of the file pages that reading region ``box`` of ``key`` through a mapping
    makes resident: from its first byte's ``granule`` to its last byte's (``nbytes`` where the
    source cannot locate it). A fault maps a whole page-cache folio where the kernel keeps
    large ones (:func:`mapping_granule`)."""
    loc = source.locate(key)
    if loc is None or not nbytes:
        return nbytes
    starts, run = box_spans(loc.shape, loc.dtype.itemsize, box)
    first, last = loc.offset + starts[0], loc.offset + starts[-1] + run
    return (last + granule - 1) // granule * granule - first // granule * granule


_PAGE = 4096
_MAX_GRANULE = 2 << 20


def mapping_granule(source: Source) -> int:
    """The resident bytes one fault on a mapping of ``source``'s largest file adds on this
    machine: 4 KiB pages, or up to 2 MiB where the kernel and filesystem keep large page-cache
    folios and map them whole. One page of the file is read to see it; 4096 where it cannot be
    measured (no ``/proc``, a file under 4 MiB, or not a local file)."""
    import mmap

    try:
        path = max(source.files(), key=lambda p: os.path.getsize(p) if os.path.isfile(p) else 0)
        size = os.path.getsize(path)
        if size < 2 * _MAX_GRANULE:
            return _PAGE
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            before = _rss_file()
            m[size // 2 // _MAX_GRANULE * _MAX_GRANULE + _MAX_GRANULE // 2]  # the middle of a 2 MiB-aligned block
            grown = _rss_file() - before
    except (OSError, ValueError):
        return _PAGE
    granule = _PAGE
    while granule * 2 <= min(grown, _MAX_GRANULE):
        granule *= 2
    return granule


def _rss_file() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024
    raise OSError("no RssFile in /proc/self/status")


def predict(source: Source, jobs: Sequence[Job], config: EngineConfig, device: torch.device, granule: int = _PAGE) -> RunFigures:
    """The figures of one engine run of ``jobs`` (meta destinations standing for ones on
    ``device``) over ``source``, from the engine's own planning; ``granule``: what one fault on
    a mapping makes resident (:func:`mapping_granule`)."""
    fig = RunFigures()
    gather_on = device if device.type == "cuda" else None
    tasks: list[Task] = []
    Planner(source, config, gather_on, dest_device=device).plan(jobs, tasks.append)
    chunk = config.chunk()
    threads = max(1, min(config.threads, _estimate_tasks(jobs, chunk))) if jobs else 0
    for task in tasks:
        fig.opened.update(task_paths(task))
    meta = MetaIO(source, fig, granule)
    band_size = config.band_buffer_bytes()
    largest = 0  # the largest staged read: how far into a buffer a thread writes
    for task in tasks:
        fig.tasks += 1
        if isinstance(task, (DirectRead, StagedRead)):
            n = sum(s for _, s in task.segments)
            fig._preadv(task.path, task.segments, config.gap_bytes)
            if isinstance(task, StagedRead):
                fig.staged_reads += 1
                largest = max(largest, n)
        elif isinstance(task, SourceRead):
            meta.read(task.piece.key, task.piece.box)
        elif isinstance(task, ComputeTask):
            fig.computations += 1
            _compute(task, source, config, fig, meta, band_size)
        else:
            assert isinstance(task, FillTask)
    if threads:
        fig.staging_bytes = min(config.staging_buffers(threads), fig.staged_reads) * chunk
        # on the host each thread copies out of its buffer before it reads again: a buffer per thread
        held = min(threads, fig.staged_reads) if device.type == "cpu" else min(config.staging_buffers(threads), fig.staged_reads)
        fig.staging_touched = fig.staging_bytes if device.type != "cpu" else held * -(-largest // _PAGE) * _PAGE
        if fig.computations:
            fig.staging_bytes += min(config.band_buffers(threads), fig.computations) * band_size
    fig.finish()
    return fig


def _compute(task: ComputeTask, source: Source, config: EngineConfig, fig: RunFigures, meta: MetaIO, band_size: int) -> None:
    """Count a computation's reads as :meth:`~sdadapt._engine.workers.Worker._compute` makes them."""
    step = task.step
    if not step.on_device:
        assert step.fn is not None
        step.fn(meta)
        return
    opened = set(task.files)
    pos, used = 0, False
    for inp in step.inputs:
        if inp.read is None:
            inp.value(meta)
            continue
        found = file_runs(source, inp.read.key, inp.read.box, config.min_span_bytes, opened.__contains__)
        if found is not None:
            path, segments, _ = found
            n = sum(s for _, s in segments)
            start = round_up(pos, 64) if used else 0
            if start + n <= band_size:
                used, pos = True, start + n
                fig._preadv(path, segments, config.gap_bytes)
                continue
        meta.read(inp.read.key, inp.read.box)
