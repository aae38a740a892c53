"""``export(..., format="safetensors")`` from every rank: each rank writes the byte ranges of the
regions it holds into the files of one HF folder; the index, side files and checksums come last,
from rank 0, once every rank succeeded.

Why byte ranges of one file rather than files of one's own: the folder is the ordinary HF layout
(whole tensors, each in one file, ``model.safetensors.index.json`` naming them), so transformers'
``from_pretrained``, ``safetensors`` and our sources read it unchanged, while no rank holds a
tensor it does not own. A safetensors header holds only shapes, dtypes and offsets, all known
before any value, so rank 0 writes every header and sizes every file first; then each rank
writes, with ``pwrite``, the runs of bytes its regions cover (a row shard is one run, a column
shard one run per row). Which rank owns which region is :mod:`.export_local`'s rule (replicas:
the copy at coordinate 0). An output whose recipe computes across shards (a rotary permutation
of rows split mid-head, for instance) cannot be cut so: it is gathered whole on every rank, as
the one-writer path does, and written by one rank (the outputs dealt round the ranks).

Atomicity: the folder is written beside ``dst`` and renamed into place by rank 0 only after
every rank's writes returned and ``fsync``'d (agreed), the index written; on any failure the
temporary folder is removed and every rank raises. The folder must be on a filesystem every
rank sees (rank 0 creates it; a rank that cannot see it fails the export on every rank).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .._base.distributed import agree, collective_device
from .._base.regions import Box, box_shape, full_box
from .._base.schema import TensorInfo
from .._base.tensor_bytes import tensor_bytes
from .._recipes.nodes import Node
from ..errors import ExportError, SdadaptError
from ..sources import INDEX_NAME, write_checksums_shared
from .export_local import _Reads, first_copies, owned_shard, regions
from .writers import parse_size
from .writers.base import write_at
from .writers.safetensors_writer import FileLayout, check_dtypes, index_json, plan_files
from .writing import commit, describe_failure, remove, shared_temp, unseen

log = logging.getLogger(__name__)


def byte_runs(shape: tuple[int, ...], itemsize: int, box: Box) -> Iterator[tuple[int, int]]:
    """``(offset, length)`` in a C-ordered tensor's bytes of the contiguous runs region ``box``
    covers, in the order of the region's own C-ordered bytes."""
    if any(b <= a for a, b in box):
        return
    k = len(shape)
    while k > 0 and box[k - 1] == (0, shape[k - 1]):  # trailing whole dims join one run
        k -= 1
    if k == 0:
        yield 0, math.prod(shape) * itemsize
        return
    inner = math.prod(shape[k:]) * itemsize
    stride = [math.prod(shape[d + 1 :]) * itemsize for d in range(k - 1)]
    run = (box[k - 1][1] - box[k - 1][0]) * inner
    first = box[k - 1][0] * inner
    for idx in itertools.product(*(range(a, b) for a, b in box[: k - 1])):
        yield first + sum(i * s for i, s in zip(idx, stride, strict=True)), run


@dataclass
class SpreadPlan:
    """Who writes what: every file's layout, the outputs gathered whole (dealt round the ranks),
    and this rank's regions of the others."""

    files: list[FileLayout]
    start: dict[str, tuple[str, int]]  # output -> (file name, offset of its first byte)
    gathered: list[str]
    mine: dict[str, list[Box]] = field(default_factory=dict)

    def my_bytes(self, outputs: dict[str, Node], rank: int, world: int) -> int:
        """The bytes this rank will write."""
        n = sum(math.prod(box_shape(b)) * outputs[k].dtype.itemsize for k, boxes in self.mine.items() for b in boxes)
        return n + sum(math.prod(outputs[k].shape) * outputs[k].dtype.itemsize for i, k in enumerate(self.gathered) if i % world == rank)


def plan_spread(
    state: dict[str, torch.Tensor], outputs: dict[str, Node], max_shard_size: int | str, rank: int, group: dist.ProcessGroup | None
) -> tuple[SpreadPlan, dict[str, tuple[Box, torch.Tensor]]]:
    """Collective: the folder's layout, and this rank's part; returns the plan and the owned
    shards its regions are read from (views of the model's shards, not copies)."""
    entries = {k: TensorInfo(tuple(n.shape), n.dtype) for k, n in outputs.items()}
    check_dtypes(entries)
    files = plan_files(entries, parse_size(max_shard_size))
    start = {k: (f.name, s) for f in files for k, s in f.starts.items()}
    leaves = sorted({leaf for node in outputs.values() for leaf in node.leaves()})
    counted = first_copies(state, leaves, group)
    shards: dict[str, tuple[Box, torch.Tensor]] = {}
    unplaced: set[str] = set()  # placements whose boxes we cannot name: the outputs reading them are gathered
    for k in counted:
        t = state[k]
        try:
            got = owned_shard(t, rank, k, copy=False) if isinstance(t, DTensor) else (full_box(tuple(t.shape)), t.detach())
        except ExportError:
            unplaced.add(k)
            continue
        if got is not None:
            shards[k] = got
    owned = {k: box for k, (box, _) in shards.items()}
    dtypes = {k: t.dtype for k, t in state.items()}
    mine: dict[str, list[Box]] = {}
    whole = []
    for name, node in outputs.items():
        if unplaced.intersection(node.leaves()):
            whole.append(name)
            continue
        try:
            mine[name] = list(regions(node, full_box(tuple(node.shape)), owned, dtypes, rank, name))
        except ExportError:  # computed across shards: gathered
            whole.append(name)
            mine.pop(name, None)
    flags = torch.tensor([1 if k in whole else 0 for k in outputs], dtype=torch.int64, device=collective_device(group))
    if dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    gathered = [k for k, f in zip(outputs, flags.tolist(), strict=True) if f]
    if gathered:
        log.info("export: %d output(s) are computed across shards and gathered whole: %s", len(gathered), ", ".join(gathered[:8]))
    for k in gathered:
        mine.pop(k, None)
    return SpreadPlan(files, start, gathered, {k: b for k, b in mine.items() if b}), shards


class _Files:
    """The folder's files opened for writing at offsets, one descriptor each, on first use."""

    def __init__(self, folder: str):
        self.folder = folder
        self.fds: dict[str, int] = {}

    def write(self, name: str, offset: int, data: memoryview) -> None:
        fd = self.fds.get(name)
        if fd is None:
            fd = self.fds[name] = os.open(os.path.join(self.folder, name), os.O_WRONLY)
        write_at(fd, data, offset)

    def close(self, sync: bool) -> None:
        try:
            if sync:
                for fd in self.fds.values():
                    os.fsync(fd)
        finally:
            for fd in self.fds.values():
                os.close(fd)
            self.fds.clear()


def _write_piece(files: _Files, where: tuple[str, int], node: Node, piece: torch.Tensor, box: Box) -> int:
    name, base = where
    data = tensor_bytes(piece)
    pos = 0
    for off, n in byte_runs(tuple(node.shape), node.dtype.itemsize, box):
        files.write(name, base + off, data[pos : pos + n])
        pos += n
    return pos


def _prepare_folder(tmp: str, files: list[FileLayout]) -> None:
    """Rank 0: the temporary folder with every file's header written and its size set."""
    os.makedirs(tmp)
    for f in files:
        with open(os.path.join(tmp, f.name), "wb") as out:
            out.write(f.header)
            out.truncate(f.size)


@dataclass(frozen=True)
class SpreadJob:
    """One export written by every rank, built once by :func:`sdadapt.export` and handed to
    :func:`write_spread` or :func:`.spread_remote.write_spread_remote` as it is.

    ``pull(key)`` gathers an output whole (collective: called for the gathered outputs in the
    same order on every rank, then ``after_gather()``); ``finish(folder)`` (rank 0) adds the side
    files; ``progress(bytes this rank writes)`` returns the function called with each piece's
    bytes. The other fields are :func:`sdadapt.export`'s arguments of the same names."""

    dst: str
    outputs: dict[str, Node]
    state: dict[str, torch.Tensor]
    pull: Callable[[str], torch.Tensor]
    rank: int
    world: int
    group: dist.ProcessGroup | None
    max_shard_size: int | str
    overwrite: bool
    checksums: bool
    finish: Callable[[str], None]
    progress: Callable[[int], Callable[[int], None]]
    after_gather: Callable[[], None]


def write_spread(job: SpreadJob) -> tuple[list[str], int]:
    """Collective: write the HF folder ``job.dst`` from every rank; ``finish`` runs before the
    rename. Returns the files and the bytes this rank wrote."""
    dst, outputs, rank, world, group = job.dst, job.outputs, job.rank, job.world, job.group
    error: SdadaptError | None = None
    plan: SpreadPlan | None = None
    shards: dict[str, tuple[Box, torch.Tensor]] = {}
    try:
        plan, shards = plan_spread(job.state, outputs, job.max_shard_size, rank, group)
    except SdadaptError as e:
        error = e
    agree(error, group)
    assert plan is not None
    on_written = job.progress(plan.my_bytes(outputs, rank, world))
    folder = shared_temp(dst, group)
    try:
        if rank == 0:
            try:
                _prepare_folder(folder, plan.files)
            except OSError as e:
                error = ExportError(describe_failure(dst, e))
        agree(error, group)
        agree(unseen(folder, dst, "export"), group)
        written = _write_mine(job, folder, plan, shards, on_written)
        if isinstance(written, SdadaptError):
            error = written
        agree(error, group)  # every rank's bytes are written and synced: the index may go in
        assert isinstance(written, int)
        if rank == 0 and len(plan.files) > 1:
            try:
                with open(os.path.join(folder, INDEX_NAME), "w") as f:
                    f.write(index_json({k: TensorInfo(tuple(n.shape), n.dtype) for k, n in outputs.items()}, plan.files))
            except OSError as e:
                error = ExportError(describe_failure(dst, e))
        agree(error, group)  # the index is written before any rank reads the folder back (checksums)
        if job.checksums:
            write_checksums_shared(folder, rank, world, group)
        if rank == 0:
            try:
                job.finish(folder)
                commit(folder, dst, job.overwrite)
            except SdadaptError as e:
                error = e
            except OSError as e:
                error = ExportError(describe_failure(dst, e))
        agree(error, group)
    except BaseException:
        if rank == 0:
            remove(folder)
        raise
    names = sorted(os.listdir(dst)) if os.path.isdir(dst) else [os.path.basename(dst)]
    return names, written


def _write_mine(
    job: SpreadJob, folder: str, plan: SpreadPlan, shards: dict[str, tuple[Box, torch.Tensor]], on_written: Callable[[int], None],
) -> int | SdadaptError:  # fmt: skip
    """This rank's writes: its turns of the gathered outputs (every rank takes part in each
    gather, even after a failure of its own, so that none hangs), then its regions. Returns the
    bytes written, or the error that stopped it."""
    dst, outputs, rank, world = job.dst, job.outputs, job.rank, job.world
    files = _Files(folder)
    error: SdadaptError | None = None
    n = 0
    try:
        for i, key in enumerate(plan.gathered):
            t = job.pull(key)
            if i % world == rank and error is None:
                try:
                    n += _write_piece(files, plan.start[key], outputs[key], t, full_box(tuple(t.shape)))
                    on_written(t.numel() * t.element_size())
                except OSError as e:
                    error = ExportError(describe_failure(dst, e) + f" (rank {rank}, key {key!r})")
            del t
        job.after_gather()
        io = _Reads({k: t.dtype for k, (_, t) in shards.items()}, shards)
        for key, boxes in plan.mine.items():
            if error is not None:
                break
            node = outputs[key]
            for box in boxes:
                piece = node.read(box, io)
                try:
                    k = _write_piece(files, plan.start[key], node, piece, box)
                except OSError as e:
                    error = ExportError(describe_failure(dst, e) + f" (rank {rank}, key {key!r})")
                    break
                n += k
                on_written(k)
                del piece
        try:
            files.close(sync=error is None)
        except OSError as e:
            error = error or ExportError(describe_failure(dst, e) + f" (rank {rank})")
    except SdadaptError as e:
        error = e
    return error if error is not None else n


__all__ = ["SpreadJob", "SpreadPlan", "byte_runs", "plan_spread", "write_spread"]
