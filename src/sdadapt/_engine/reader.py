"""A DCP ``StorageReader`` that presents the *target* schema and reads source regions.

``dcp.load`` hands each rank ``ReadItem``s in global target coordinates for its own shards
(DCP and DTensor compute the offsets, ``_StridedShard`` and uneven shards included). For each
item we ask the plan's recipe for exactly that box, which reads only the source regions it
needs, and copy the result into the destination shard.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, Metadata, StorageReader
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor
from torch.futures import Future

from .._base.distributed import is_distributed
from .._base.regions import box_shape
from .._plan.plan import Plan
from ..errors import LoadError
from ..sources import Source
from . import share
from .config import EngineConfig
from .engine import EngineStats, IOEngine
from .prefetch import prefetch
from .tasks import Job
from .workers import CountingIO

log = logging.getLogger(__name__)


class AdaptedLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` with its local plan memoised for repeated layouts.

    A model repeats a few (global shape, mesh, placements) combinations many times (every layer
    has the same q/k/v/o...), and against :class:`AdaptedStorageReader`'s metadata (one chunk per
    key, the whole tensor) the read items of a tensor depend on nothing else. So each
    combination's items are computed once, by DCP's own ``__create_chunk_list__`` and
    ``create_read_items_for_chunk_list``, and reused for every key that shares it with only the
    key replaced: the same plan ``DefaultLoadPlanner`` makes, without recomputing DTensor
    offsets for every key. Anything else (non-tensor values, other metadata) takes
    ``DefaultLoadPlanner``'s own path."""

    def create_local_plan(self) -> LoadPlan:
        md = self.metadata.state_dict_metadata if self.metadata is not None else {}
        sd = self.state_dict
        if not all(isinstance(v, torch.Tensor) and isinstance(md.get(k), TensorStorageMetadata) for k, v in sd.items()):
            return super().create_local_plan()
        memo: dict[Any, list[ReadItem]] = {}
        items: list[ReadItem] = []
        for fqn, obj in sd.items():
            tmd = md[fqn]
            if tmd.size != obj.size():
                raise ValueError(f"Size mismatch between saved {tmd.size} and current: {obj.size()} for {fqn}")
            if len(tmd.chunks) != 1 or any(tmd.chunks[0].offsets) or tmd.chunks[0].sizes != tmd.size:
                items += create_read_items_for_chunk_list(fqn, tmd, _chunks(obj))
                continue
            if isinstance(obj, DTensor):
                if obj.device_mesh.get_coordinate() is None:
                    continue
                sig: Any = (tuple(obj.shape), id(obj.device_mesh), tuple(obj.placements))
            else:
                sig = tuple(obj.shape)
            hit = memo.get(sig)
            if hit is None:
                memo[sig] = create_read_items_for_chunk_list(fqn, tmd, _chunks(obj))
                items += memo[sig]
            else:
                items += [_renamed(it, fqn) for it in hit]
        return LoadPlan(items)


def _chunks(obj: torch.Tensor) -> list[ChunkStorageMetadata]:
    if isinstance(obj, DTensor):
        return obj.__create_chunk_list__()
    return [ChunkStorageMetadata(offsets=torch.Size([0] * obj.dim()), sizes=obj.size())]


def _renamed(item: ReadItem, fqn: str) -> ReadItem:
    return dataclasses.replace(
        item,
        dest_index=dataclasses.replace(item.dest_index, fqn=fqn),
        storage_index=dataclasses.replace(item.storage_index, fqn=fqn),
    )


class AdaptedStorageReader(StorageReader):
    """Serves a :class:`~sdadapt._plan.plan.Plan` to ``dcp.load``.

    Reads go through :class:`~sdadapt._engine.IOEngine` (parallel, coalesced, straight into
    CPU shards or through bounded pinned staging to GPU shards). ``engine="simple"`` (or the
    environment variable ``SDADAPT_IO=simple``) reads item by item on one thread instead: the
    reference the engine is measured and tested against (it reads every item itself:
    ``share_reads`` applies to the engine only).
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
    ):
        super().__init__()
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
        self.shared_bytes = 0  # bytes this rank received from replicas instead of reading
        self.fetched = (0, 0)  # (bytes, requests) fetched from object storage before reading
        self.began_writing = False  # set once the fetch ahead succeeded, before the first write
        self.stats = EngineStats()
        self._metadata = Metadata(
            state_dict_metadata={
                key: TensorStorageMetadata(
                    properties=TensorProperties(dtype=node.dtype),
                    size=torch.Size(node.shape),
                    chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(node.shape)), sizes=torch.Size(node.shape))],
                )
                for key, node in plan.recipes.items()
            }
        )

    def reset(self, checkpoint_id: object = None) -> None:
        pass

    def read_metadata(self, *args: object, **kwargs: object) -> Metadata:
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: object, **kwargs: object) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self.engine == "engine":
            return self._read_engine(plan, planner)
        return self._read_simple(plan, planner)

    def _job(self, item: ReadItem, planner: LoadPlanner) -> Job:
        """The read item as a job: its recipe, its box in global target coordinates, its
        destination shard (checked to have the box's shape)."""
        if item.type != LoadItemType.TENSOR:
            raise LoadError(f"key {item.dest_index.fqn!r}: only tensors can be loaded, got {item.type}")
        key = item.storage_index.fqn
        box = tuple((o, o + n) for o, n in zip(item.storage_offsets, item.lengths, strict=True))
        dest = planner.resolve_tensor(item).detach()
        if tuple(dest.shape) != box_shape(box):
            raise LoadError(f"key {key!r}: destination shard {list(dest.shape)} != region {list(box)}")
        return Job(key, self.plan.recipes[key], box, dest)

    def _read_engine(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        start = time.perf_counter()
        jobs = [self._job(item, planner) for item in plan.items]
        to_read: list[Job] = jobs
        shares: list[share.Share] = []
        if self.share_reads and is_distributed():
            targets = [_target_of(planner, item) for item in plan.items]
            to_read, shares = share.split(jobs, targets)
        engine = IOEngine(self.source, self.config, on_done=self.on_done)
        failure: BaseException | None = None
        try:
            self._prefetch(to_read)
            engine.run(to_read)
        except BaseException as e:  # noqa: BLE001 - the replicas must still hear of it (no hang)
            failure = e
        finally:
            self.fetched = (self.fetched[0] + engine.stats.fetched_bytes, self.fetched[1] + engine.stats.requests)
            self.io.bytes_read += engine.stats.bytes_read
            self.io.reads += engine.stats.syscalls
            self.stats.add(engine.stats)
        if shares:
            share.exchange(shares, failed=failure is not None)
            received = sum(j.dest.numel() * j.dest.element_size() for j in jobs) - sum(
                j.dest.numel() * j.dest.element_size() for j in to_read
            )
            self.shared_bytes += received
            if self.on_done is not None:
                self.on_done(received)
        if failure is not None:
            raise failure
        for item, job in zip(plan.items, jobs, strict=True):
            planner.commit_tensor(item, job.dest)
            self.items_read += 1
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
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def fetch_ahead(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Before ``dcp.load`` (so that a failure changes nothing): fetch the source regions
        this rank's read items of ``state_dict`` need, where the source is at an object storage
        URL (see :meth:`~sdadapt.sources.Source.prefetch`); adds to :attr:`fetched`."""
        if self.source.remote_url() is None:
            return
        planner = AdaptedLoadPlanner()
        planner.set_up_planner(state_dict, self._metadata, True)
        jobs = []
        for item in planner.create_local_plan().items:
            if item.type == LoadItemType.TENSOR:
                key = item.storage_index.fqn
                box = tuple((o, o + n) for o, n in zip(item.storage_offsets, item.lengths, strict=True))
                node = self.plan.recipes[key]
                jobs.append(Job(key, node, box, torch.empty(box_shape(box), dtype=node.dtype, device="meta")))
        got = prefetch(self.source, jobs, engine=self.engine == "engine")
        self.fetched = (self.fetched[0] + got[0], self.fetched[1] + got[1])

    def _prefetch(self, jobs: list[Job]) -> None:
        """Fetch the jobs' source regions ahead (a source at an object storage URL): for the
        engine, only what it does not fetch itself (see :meth:`~sdadapt.sources.Source.prefetch`)."""
        got = prefetch(self.source, jobs, engine=self.engine == "engine")
        self.fetched = (self.fetched[0] + got[0], self.fetched[1] + got[1])
        self.began_writing = True

    def _read_simple(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        start = time.perf_counter()
        jobs = [self._job(item, planner) for item in plan.items]
        self._prefetch(jobs)
        for item, job in zip(plan.items, jobs, strict=True):
            try:
                value = job.node.read(job.box, self.io)
            except Exception as e:  # noqa: BLE001 - name the key and file, keep the cause
                files = sorted({self.source.file_of(k) for k in job.node.leaves()})
                raise LoadError(f"key {job.key!r} (from {', '.join(files)}): reading {list(job.box)} failed: {e}") from e
            job.dest.copy_(value)
            if self.on_done is not None:
                self.on_done(job.dest.numel() * job.dest.element_size())
            planner.commit_tensor(item, job.dest)
            self.items_read += 1
        self.seconds += time.perf_counter() - start
        log.debug("read %d items, %d bytes", self.items_read, self.io.bytes_read)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: object) -> bool:
        return False


def _target_of(planner: LoadPlanner, item: ReadItem) -> torch.Tensor | None:
    """The state-dict tensor (a DTensor, or not) that a read item's destination belongs to."""
    if not isinstance(planner, DefaultLoadPlanner):
        return None
    return planner.state_dict.get(item.dest_index.fqn)
