"""Planning: jobs -> steps (from each recipe's ``produce``) -> located byte ranges -> tasks.

A piece of a source tensor whose bytes the source can locate in a file (``locate_region``) is
cut into reads: straight into a contiguous destination of the source dtype (large enough) on the
CPU, or on the GPU where the run reads through kvikio (:mod:`.devread`),
else through staging; small staged reads adjacent in one file are coalesced at the end. A column
slice's runs are read like any others, with ``preadv``: a worker joins runs whose gaps are short
into one call (:func:`~sdadapt._engine.syscalls.read_runs`), so storage is asked for the bytes
read and never faults whole pages of a mapping (``min_span_bytes`` > 0 brings back the strided
copy out of the mapping for runs shorter than it). Pieces of storage without locations and fills become one task each; a computation
becomes one task per band its declared :class:`~sdadapt._recipes.nodes.Bands` cut it into (:func:`bands_of`),
or, on the device of a run's device lane, staged reads of its declared inputs gathered there
(:meth:`Planner._gather`; where the run reads through kvikio, one read of them all straight
into the gather's device buffer).
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .._base.regions import Box, box_shape
from .._base.schema import TensorLocation
from .._recipes.nodes import Compute, Piece, Step, emit
from ..sources import Source
from .config import EngineConfig
from .geometry import band_boxes, box_spans, round_up, split_box, split_segments
from .locate import file_runs
from .tasks import ComputeTask, Delivery, DirectRead, FillTask, Gather, GatherRead, Job, SourceRead, StagedRead, Task, Where


# internal records: no generated __eq__ / __repr__ (unused; each costs the import an exec)
@dataclass(eq=False, repr=False)
class _Small:
    """A single-span staged read under half a chunk, waiting to be coalesced."""

    path: str
    offset: int
    nbytes: int
    dest: torch.Tensor
    box: Box
    where: Where
    dtype: torch.dtype


@dataclass(eq=False, repr=False)
class _Part:
    """A piece's share of one located tensor (or stored chunk): ``box`` in the located
    tensor's coordinates, its destination view, the located tensor's origin in the source
    tensor (``()`` for storage without locations, ``loc`` then ``None``)."""

    loc: TensorLocation | None
    box: Box
    dest: torch.Tensor
    origin: tuple[int, ...]


_WHOLE = 1 << 62  # no cut: one direct read per contiguous destination
_GATHER_ALIGN = 64  # each input of a gather starts on a multiple of this in its device buffer
_KVIKIO_MIN_RUN = 64 * 1024  # shorter runs (a column slice) reach a GPU through staging, joined reads


def bands_of(step: Compute, max_bytes: int) -> list[Box]:
    """The bands of ``step``'s region for inputs of at most about ``max_bytes`` each, as its
    :class:`~sdadapt._recipes.nodes.Bands` allows (``[step.box]`` for a computation that declares
    none)."""
    if step.bands is None:
        return [step.box]
    return band_boxes(step.box, step.bands.value_bytes, max_bytes, dict(step.bands.align))


def _gather_reads(gather: Gather, runs: list[tuple[str, list[tuple[int, int]], int]], chunk: int, where: Where) -> list[StagedRead]:
    """Staged reads of at most ``chunk`` bytes each for the ``runs`` of a gather's inputs
    ((file, its (offset, nbytes) runs, offset in the gather's buffer) per input, in order):
    consecutive runs of one file share reads (:func:`split_segments`), and the bytes of a read
    that are contiguous in the gather's buffer too are one delivery."""
    out: list[StagedRead] = []
    for path, inputs in itertools.groupby(runs, key=lambda r: r[0]):
        spans = []  # (file offset, nbytes, offset in the gather's buffer), in order
        for _, segments, at in inputs:
            for off, n in segments:
                spans.append((off, n, at))
                at += n
        i = done = 0  # the span the next piece starts in, and its bytes already placed
        for piece in split_segments([(off, n) for off, n, _ in spans], chunk):
            dls: list[Delivery] = []
            pos = 0
            for _, n in piece:
                at = spans[i][2] + done
                last = dls[-1] if dls else None
                if last is not None and last.into is not None and last.into[1] + last.nbytes == at:
                    last.nbytes += n
                    last.shape = (last.nbytes,)
                else:
                    dls.append(Delivery(pos, n, torch.uint8, (n,), gather.step.dest, where, into=(gather, at)))
                pos += n
                done += n
                if done == spans[i][1]:
                    i, done = i + 1, 0
            out.append(StagedRead(path, piece, dls, where))
    return out


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 tensor (same memory)."""
    flat = t.reshape(-1)
    return flat.view(torch.uint8) if t.dtype != torch.uint8 else flat


class Planner:
    """Turns jobs into tasks for one run; counts coalesced pieces in ``coalesced``. With
    ``gather_on`` (the device of the run's device lane), computations on that device gather
    their inputs there where they can (:meth:`_gather`). ``dest_device``: plan every destination
    as if it were on this device (a dry run plans meta destinations as the CPU or GPU ones of a
    real load would be: :mod:`sdadapt._engine.predict`); ``None``: where it is."""

    def __init__(
        self,
        source: Source,
        config: EngineConfig,
        gather_on: torch.device | None = None,
        direct_on: torch.device | None = None,
        dest_device: torch.device | None = None,
    ):
        self.source = source
        self.config = config
        self.gather_on = gather_on if config.gather_inputs else None
        self.direct_on = direct_on  # a GPU read into directly (kvikio), or None
        self.dest_device = dest_device
        self.coalesced = 0
        self.gathered = 0  # computations planned as gathers
        self._files: dict[str, bool] = {}
        self._whole: dict[str, TensorLocation] = {}  # keys stored whole in one located tensor

    def _is_file(self, path: str) -> bool:
        ok = self._files.get(path)
        if ok is None:
            ok = self._files[path] = os.path.isfile(path)
        return ok

    def _file_of(self, key: str) -> str:
        try:
            return self.source.file_of(key)
        except Exception:  # noqa: BLE001 - only for a message
            return self.source.path

    def plan(self, jobs: Sequence[Job], push: Callable[[Task], None]) -> None:
        """Hand every task to ``push`` as soon as it is made; staged pieces under half a chunk,
        coalesced across all jobs, come last."""
        small: list[_Small] = []
        for job in jobs:
            for step in job.node.steps(job.box, job.dest):
                if isinstance(step, Piece):
                    self._plan_piece(job.key, step, push, small)
                elif isinstance(step, Compute):
                    files = sorted({self._file_of(k) for k in step.node.leaves()})
                    opened = tuple(f for f in files if self._is_file(f))
                    names = ", ".join(files)
                    gathers = step.on_device and (self.dest_device or step.dest.device) == self.gather_on
                    for part in self._bands(step, self.config.gather_band()) if gathers else [step]:
                        if gathers and self._gather(part, Where(job.key, None, names, part.box), push):
                            continue
                        for band in self._bands(part, self.config.band()):
                            push(ComputeTask(band, Where(job.key, None, names, band.box), opened))
                else:
                    push(FillTask(step, Where(job.key, None, None, job.box)))
        for task in self._coalesce(small):
            push(task)

    def _bands(self, step: Compute, max_bytes: int) -> list[Compute]:
        """``step`` cut into bands for inputs of at most ``max_bytes`` (:func:`bands_of`; so
        that the threads share a large computation, and each band's input fits a band buffer,
        ``band()``, or the device buffer of a gather, ``gather_band()``)."""
        boxes = bands_of(step, max_bytes)
        if len(boxes) <= 1:
            return [step]
        out: list[Step] = []
        for sub in boxes:
            sl = tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(sub, step.box, strict=True))
            emit(step.node, sub, step.dest[sl], out)
        if not all(isinstance(s, Compute) for s in out):
            raise TypeError(f"{step.node.describe()}: a band must be produced as computations, got {out}")
        return [s for s in out if isinstance(s, Compute)]

    def _gather(self, step: Compute, where: Where, push: Callable[[Task], None]) -> bool:
        """Plan ``step`` as a :class:`~sdadapt._engine.tasks.Gather`: its inputs read as staged
        reads of at most a chunk each (from the shared staging pool, as a plain load's reads),
        delivered one after the other into one buffer on the destination's device, where the
        lane runs the kernel once the last has crossed. So a reader hands on each piece as it
        would a plain read's and never waits for a computation's buffer. On the GPU read into
        through kvikio (``direct_on``) with ``kvikio_gathers`` on it is one :class:`~sdadapt._engine.tasks.GatherRead`
        instead: kvikio reads every input straight into the device buffer. Only where every input
        the step declares is a stored region (:attr:`~sdadapt._recipes.nodes.Input.read`) that
        lies in one opened file in runs of at least ``min_span_bytes``;
        returns ``False``, planning nothing, otherwise."""
        runs = []
        layout: list[tuple[int, torch.dtype, tuple[int, ...]]] = []
        at = 0
        for read in (i.read for i in step.inputs):
            if read is None:
                return False
            found = file_runs(self.source, read.key, read.box, self.config.min_span_bytes, self._is_file)
            if found is None:
                return False
            at = round_up(at, _GATHER_ALIGN)
            runs.append((found[0], found[1], at))
            layout.append((at, read.dtype, read.shape))
            at += math.prod(box_shape(read.box)) * read.dtype.itemsize
        if at == 0:
            return False  # nothing to read: no piece would ever run the kernel
        gather = Gather(step, at, layout)
        self.gathered += 1
        if self.config.kvikio_gathers and self.direct_on is not None and (self.dest_device or step.dest.device) == self.direct_on:
            gather.pieces = 1
            push(GatherRead(gather, runs, where))
            return True
        tasks = _gather_reads(gather, runs, self.config.chunk(), where)
        gather.pieces = len(tasks)
        for task in tasks:
            push(task)
        return True

    def _parts(self, piece: Piece) -> list[_Part]:
        """Where the piece's bytes are: one part per located tensor or stored chunk the box
        intersects, or one unlocated part when the source cannot locate all of them in files."""
        whole = self._whole.get(piece.key)
        if whole is not None:
            return [_Part(whole, piece.box, piece.dest, ())]
        located = self.source.locate_region(piece.key, piece.box)
        if located is None or not all(self._is_file(loc.path) for _, loc in located):
            return [_Part(None, piece.box, piece.dest, ())]
        info = self.source.schema.get(piece.key)
        if len(located) == 1 and info is not None and located[0][1].shape == info.shape:
            whole = self._whole[piece.key] = located[0][1]  # the whole tensor in one place: any box lies in it
            return [_Part(whole, piece.box, piece.dest, ())]
        parts = []
        for cb, loc in located:
            lo = [max(a, o) for (a, _), (o, _) in zip(piece.box, cb, strict=True)]
            hi = [min(b, e) for (_, b), (_, e) in zip(piece.box, cb, strict=True)]
            if any(x >= y for x, y in zip(lo, hi, strict=True)):
                continue
            inside = all(x == a and y == b for x, y, (a, b) in zip(lo, hi, piece.box, strict=True))
            dest = piece.dest if inside else piece.dest[tuple(slice(x - a, y - a) for x, y, (a, _) in zip(lo, hi, piece.box, strict=True))]
            origin = tuple(o for o, _ in cb)
            box = tuple((x - o, y - o) for x, y, o in zip(lo, hi, origin, strict=True))
            parts.append(_Part(loc, box, dest, origin))
        return parts

    def _plan_piece(self, target: str, piece: Piece, push: Callable[[Task], None], small: list[_Small]) -> None:
        for part in self._parts(piece):
            where = Where(target, piece.key, part.loc.path if part.loc else self._file_of(piece.key), piece.box)
            if part.loc is None:
                # unknown storage: one read per piece (a sub-box read could cost the source a
                # whole stored chunk each time, e.g. DCP files)
                push(SourceRead(piece, where))
            else:
                self._plan_located(part, part.loc, piece.key, where, push, small)

    def _plan_located(
        self,
        part: _Part,
        loc: TensorLocation,
        key: str,
        where: Where,
        push: Callable[[Task], None],
        small: list[_Small],
    ) -> None:
        cfg = self.config
        chunk = cfg.chunk()
        itemsize = loc.dtype.itemsize
        box, dest, origin = part.box, part.dest, part.origin
        starts, run = box_spans(loc.shape, itemsize, box)
        if len(starts) > 1 and run < cfg.min_span_bytes:
            # asked for (min_span_bytes > 0): many short rows (a column slice) as one strided
            # copy out of the mapped file (Source.read takes global coordinates)
            shifted = any(origin)
            for sub, sl in split_box(box, itemsize, chunk):
                glob = tuple((a + o, b + o) for (a, b), o in zip(sub, origin, strict=True)) if shifted else sub
                push(SourceRead(Piece(key, glob, dest[sl]), where))
            return
        device = self.dest_device or dest.device
        on_gpu = device.type != "cpu"
        direct = (
            (not on_gpu or (device == self.direct_on and (len(starts) == 1 or run >= _KVIKIO_MIN_RUN)))
            and dest.dtype == loc.dtype
            and dest.is_contiguous()
            and dest.numel() * itemsize >= cfg.direct_min_bytes
        )
        if direct:
            segs = [(loc.offset + s, run) for s in starts]
            mem = _bytes_view(dest)
            pos = 0
            for group in split_segments(segs, _WHOLE if on_gpu else chunk):  # kvikio cuts its reads into tasks itself
                n = sum(g[1] for g in group)
                push(DirectRead(loc.path, group, mem[pos : pos + n], where))
                pos += n
            return
        for sub, sl in split_box(box, itemsize, chunk):
            starts, run = box_spans(loc.shape, itemsize, sub)
            d = dest[sl]
            if len(starts) == 1 and run < chunk // 2:
                small.append(_Small(loc.path, loc.offset + starts[0], run, d, sub, where, loc.dtype))
            else:
                segs = [(loc.offset + s, run) for s in starts]
                push(StagedRead(loc.path, segs, [Delivery(0, len(segs) * run, loc.dtype, box_shape(sub), d, where)], where))

    def _coalesce(self, small: list[_Small]) -> list[StagedRead]:
        """Merge single-span staged pieces that are adjacent in one file into shared reads."""
        gap = self.config.coalesce_gap
        chunk = self.config.chunk()
        out: list[StagedRead] = []
        small.sort(key=lambda s: (s.path, s.offset))
        cur: StagedRead | None = None
        cur_end = 0
        for s in small:
            end = s.offset + s.nbytes
            if cur is not None and cur.path == s.path and 0 <= s.offset - cur_end <= gap and end - cur.segments[0][0] <= chunk:
                start = cur.segments[0][0]
                cur.segments = [(start, end - start)]
                cur.deliveries.append(Delivery(s.offset - start, s.nbytes, s.dtype, box_shape(s.box), s.dest, s.where))
                cur_end = end
                continue
            cur = StagedRead(s.path, [(s.offset, s.nbytes)], [Delivery(0, s.nbytes, s.dtype, box_shape(s.box), s.dest, s.where)], s.where)
            cur_end = end
            out.append(cur)
        self.coalesced += sum(len(t.deliveries) for t in out if len(t.deliveries) > 1)
        return out
