"""A plan's reads into this rank's own shards, run by the engine without ``dcp.load``.

A load into a model's tensors needs from DCP only the read items its planner makes against
the target schema (one chunk per key, the whole tensor): for a plain tensor the whole tensor,
for a DTensor the box of its local shard (``compute_local_shape_and_global_offset``, as DCP's
``_create_chunk_from_dtensor`` computes it; ``_StridedShard`` and uneven shards included).
:func:`local_jobs` makes exactly those, and :class:`EngineReader` runs them, so a plain load
never imports ``torch.distributed.checkpoint`` (importing any of it imports the whole package
and ``torch.distributed.elastic``). Targets DCP alone knows how to read (non-tensor values,
``Partial`` placements, a DTensor over another tensor subclass) go through
:class:`~sdadapt._engine.reader.AdaptedStorageReader` and ``dcp.load`` instead
(:func:`direct_targets` tells them apart).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from .._base.agreement import spans_hosts
from .._base.distributed import rank_and_world
from .._base.regions import Box, box_shape
from .._plan.plan import Plan
from ..errors import LoadError
from ..sources import Source
from .config import EngineConfig
from .engine import EngineStats, IOEngine
from .prefetch import prefetch
from .tasks import Job
from .workers import CountingIO

if TYPE_CHECKING:
    from . import share

log = logging.getLogger(__name__)


def _attempt(read: Callable[[], object]) -> BaseException | None:
    """``read()``'s error, or ``None`` (handed to the caller as :func:`.share.read_and_exchange` hands it)."""
    try:
        read()
    except BaseException as e:  # noqa: BLE001 - handed to the caller, who raises it after the exchanges
        return e
    return None


def rows_mode(share_rows: bool | str, one_host: bool | None, gap: int) -> tuple[int | None, bool]:
    """How ``share_reads`` treats TP peers' rows: the ``rows_gap`` for :func:`~sdadapt._engine.share.split`
    (``None``: not shared) and whether each row group asks if it spans hosts first.
    ``share_rows="auto"``: off where every rank of the load runs on one host (``one_host``, from
    the ranks' agreement: no collective more); else each group asks."""
    if share_rows == "auto":
        return (None, False) if one_host else (gap, True)
    return (gap if share_rows else None), False


def direct_targets(state_dict: Mapping[str, object]) -> bool:
    """Whether :func:`local_jobs` makes the read items DCP would for every value: plain tensors,
    and DTensors over a plain local tensor whose placements are shards or replicas."""
    for v in state_dict.values():
        if isinstance(v, DTensor):
            if type(v._local_tensor) not in (torch.Tensor, torch.nn.Parameter):
                return False
            if not all(isinstance(p, (Shard, _StridedShard, Replicate)) for p in v.placements):
                return False
        elif type(v) not in (torch.Tensor, torch.nn.Parameter):
            return False
    return True


def local_jobs(plan: Plan, state_dict: Mapping[str, torch.Tensor]) -> tuple[list[Job], list[torch.Tensor]]:
    """This rank's jobs for ``state_dict`` (every key a target of ``plan``) and the tensor each
    belongs to: the read items ``dcp.load``'s planner makes against the whole-tensor metadata of
    :class:`~sdadapt._engine.reader.AdaptedStorageReader`, in the same order (``dcp.load`` sorts
    the keys), with the same checks (a shape that differs from the plan's; no item for a rank outside a DTensor's mesh,
    nor for a shard that DCP's overlap test finds outside the tensor)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: PLC0415 - DTensor's own

    jobs: list[Job] = []
    targets: list[torch.Tensor] = []
    memo: dict[object, Box | None] = {}
    for key in sorted(state_dict):
        obj = state_dict[key]
        node = plan.recipes[key]
        if tuple(node.shape) != tuple(obj.shape):
            raise ValueError(f"Size mismatch between saved {torch.Size(node.shape)} and current: {obj.size()} for {key}")
        if isinstance(obj, DTensor):
            if obj.device_mesh.get_coordinate() is None:
                continue
            sig: object = (tuple(obj.shape), id(obj.device_mesh), tuple(obj.placements))
            if sig not in memo:
                sizes, offsets = compute_local_shape_and_global_offset(obj.shape, obj.device_mesh, obj.placements)
                memo[sig] = _overlap(tuple(obj.shape), tuple(offsets), tuple(sizes))
            box = memo[sig]
            dest = obj._local_tensor  # to_local()'s data, without its autograd step (a parameter needs grad)
        else:
            box = _overlap(tuple(obj.shape), (0,) * obj.dim(), tuple(obj.shape))
            dest = obj
        if box is None:
            continue
        dest = dest.detach()
        if tuple(dest.shape) != box_shape(box):
            raise LoadError(f"key {key!r}: destination shard {list(dest.shape)} != region {list(box)}")
        jobs.append(Job(key, node, box, dest))
        targets.append(obj)
    return jobs, targets


def _overlap(shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Box | None:
    """The local chunk as a box, or None where DCP's overlap test (``resharding``) finds it
    outside the stored chunk ``[0, shape)`` and makes no read item."""
    for n, o, s in zip(shape, offsets, sizes, strict=True):
        if o >= n or 0 >= o + s:
            return None
    return tuple((o, o + s) for o, s in zip(offsets, sizes, strict=True))


class EngineReader:
    """Reads a :class:`~sdadapt._plan.plan.Plan`'s jobs into this rank's shards.

    Reads go through :class:`~sdadapt._engine.IOEngine` (parallel, coalesced, straight into
    CPU shards or through bounded pinned staging to GPU shards). ``engine="simple"`` (or the
    environment variable ``SDADAPT_IO=simple``) reads job by job on one thread instead: the
    reference the engine is measured and tested against (it reads every job itself:
    ``share_reads`` applies to the engine only). ``one_host``: whether every rank of the load
    runs on one host, as the ranks agreed (``None``: not known), for
    ``EngineConfig.share_rows="auto"`` (:func:`rows_mode`).
    """

    def __init__(
        self,
        plan: Plan,
        source: Source,
        *,
        engine: str | None = None,
        config: EngineConfig | None = None,
        share_reads: bool = False,
        on_done: Callable[[int], None] | None = None,
        one_host: bool | None = None,
    ):
        self.on_done = on_done  # progress: called with the destination bytes of each finished read
        self.plan = plan
        self.source = source
        self.io = CountingIO(source)
        self.items_read = 0
        self.seconds = 0.0
        self.engine = engine or os.environ.get("SDADAPT_IO", "engine")
        if self.engine not in ("engine", "simple"):
            raise LoadError(f"unknown I/O engine {self.engine!r} (SDADAPT_IO); use 'engine' or 'simple'")
        self.config = config
        self.share_reads = share_reads
        self.one_host = one_host  # whether every rank runs on one host, as the ranks agreed (None: not known)
        self.shared_bytes = 0  # bytes this rank received from replicas instead of reading
        self.fetched = (0, 0)  # (bytes, requests) fetched from object storage before reading
        self.began_writing = False  # set once the fetch ahead succeeded, before the first write
        self.stats = EngineStats()

    def load_into(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Read every key of ``state_dict`` (tensors that :func:`direct_targets` accepts) into
        this rank's shards of it."""
        jobs, targets = local_jobs(self.plan, state_dict)
        self.run(jobs, targets)

    def run(self, jobs: list[Job], targets: Sequence[torch.Tensor | None]) -> None:
        """Fill every job's destination; ``targets``: the state-dict tensor of each job (a
        DTensor tells ``share_reads`` its replicas), or None."""
        if self.engine == "engine":
            self._run_engine(jobs, targets)
        else:
            self._run_simple(jobs)

    def _run_engine(self, jobs: list[Job], targets: Sequence[torch.Tensor | None]) -> None:
        start = time.perf_counter()
        to_read: list[Job] = jobs
        shares: list[share.Share] = []
        rows: list[share.RowShare] = []
        cfg = self.config or EngineConfig.from_env()
        # one process alone has no peer to share with (every mesh has one member): no split
        if self.share_reads and rank_and_world()[1] > 1:
            from . import share  # noqa: PLC0415 - share_reads=True only: a plain load never imports it

            rows_gap, ask = rows_mode(cfg.share_rows, self.one_host, cfg.gap_bytes)
            to_read, shares, rows = share.split(jobs, targets, rows_gap, spans_hosts if ask else None)
        engine = IOEngine(self.source, self.config, on_done=self.on_done)
        # the rows' own engine, only where there are rows: its reads are others' too (progress counts the shards filled)
        rows_engine = IOEngine(self.source, share.rows_config(cfg)) if rows else None
        failure: BaseException | None = None
        try:  # before any round is read: the rounds' regions are fetched here too
            self._prefetch(to_read + (share.read_jobs([u for r in share.rounds(rows, cfg.share_round_bytes) for u in r])
                                      if rows else []))
        except BaseException as e:  # noqa: BLE001 - the peers must still hear of it (no hang)
            failure = e
        if rows:  # the rows' rounds are read and exchanged beside this rank's other reads (no hang if either fails)
            assert rows_engine is not None
            own, error, received = share.read_and_exchange(
                None if failure is not None else lambda: engine.run(to_read), rows, rows_engine.run, cfg.share_round_bytes
            )
        else:  # this rank's reads alone: what read_and_exchange returns without rows
            own, error, received = (None if failure is not None else _attempt(lambda: engine.run(to_read))), None, 0
        failure = failure or own or error
        done = 0  # destination bytes filled by the exchanges, for progress
        if rows_engine is not None:
            engine.stats.add(rows_engine.stats)
            done += sum(r.job.dest.numel() * r.job.dest.element_size() for r in rows)
        self.fetched = (self.fetched[0] + engine.stats.fetched_bytes, self.fetched[1] + engine.stats.requests)
        self.io.bytes_read += engine.stats.bytes_read
        self.io.reads += engine.stats.syscalls
        self.stats.add(engine.stats)
        if shares:
            share.exchange(shares, failed=failure is not None)
            got = sum(sh.received() for sh in shares)
            received += got
            done += got
        self.shared_bytes += received
        if done and failure is None and self.on_done is not None:
            self.on_done(done)
        if failure is not None:
            raise failure
        self.items_read += len(jobs)
        self.seconds += time.perf_counter() - start
        log.debug(
            "read %d items, %d bytes (%d direct, %d staged, %d coalesced pieces, %d via Source.read) "
            "with %d threads in %.3f s",
            self.items_read,
            self.io.bytes_read,
            engine.stats.direct_bytes,
            engine.stats.staged_bytes,
            engine.stats.coalesced,
            engine.stats.computed,
            engine.stats.threads,
            engine.stats.seconds,
        )

    def _run_simple(self, jobs: list[Job]) -> None:
        start = time.perf_counter()
        self._prefetch(jobs)
        for job in jobs:
            try:
                value = job.node.read(job.box, self.io)
            except Exception as e:  # noqa: BLE001 - name the key and file, keep the cause
                files = sorted({self.source.file_of(k) for k in job.node.leaves()})
                raise LoadError(f"key {job.key!r} (from {', '.join(files)}): reading {list(job.box)} failed: {e}") from e
            job.dest.copy_(value)
            if self.on_done is not None:
                self.on_done(job.dest.numel() * job.dest.element_size())
            self.items_read += 1
        self.seconds += time.perf_counter() - start
        log.debug("read %d items, %d bytes", self.items_read, self.io.bytes_read)

    def fetch_ahead(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Before reading (so that a failure changes nothing): fetch the source regions this
        rank's jobs for ``state_dict`` need, where the source is at an object storage URL (see
        :meth:`~sdadapt.sources.Source.prefetch`); adds to :attr:`fetched`."""
        if self.source.remote_url() is None:
            return
        jobs, _ = local_jobs(self.plan, state_dict)
        meta = [Job(j.key, j.node, j.box, torch.empty(box_shape(j.box), dtype=j.node.dtype, device="meta")) for j in jobs]
        got = prefetch(self.source, meta, engine=self.engine == "engine")
        self.fetched = (self.fetched[0] + got[0], self.fetched[1] + got[1])

    def _prefetch(self, jobs: list[Job]) -> None:
        """Fetch the jobs' source regions ahead (a source at an object storage URL): for the
        engine, only what it does not fetch itself (see :meth:`~sdadapt.sources.Source.prefetch`)."""
        got = prefetch(self.source, jobs, engine=self.engine == "engine")
        self.fetched = (self.fetched[0] + got[0], self.fetched[1] + got[1])
        self.began_writing = True
