"""A DCP ``StorageReader`` that presents the *target* schema and reads source regions.

``dcp.load`` hands each rank ``ReadItem``s in global target coordinates for its own shards
(DCP and DTensor compute the offsets, ``_StridedShard`` and uneven shards included). For each
item we ask the plan's recipe for exactly that box, which reads only the source regions it
needs, and copy the result into the destination shard. Loads into plain tensors and DTensors
make the same jobs without ``dcp.load`` (:mod:`sdadapt._engine.direct`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
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

from .._base.regions import box_shape
from .._plan.plan import Plan
from ..errors import LoadError
from ..sources import Source
from .direct import EngineReader
from .prefetch import prefetch
from .tasks import Job

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


class AdaptedStorageReader(EngineReader, StorageReader):
    """Serves a :class:`~sdadapt._plan.plan.Plan` to ``dcp.load``: DCP's read items become
    :class:`~sdadapt._engine.direct.EngineReader`'s jobs. A load into tensors that
    :func:`~sdadapt._engine.direct.direct_targets` accepts needs no ``dcp.load``
    (:meth:`EngineReader.load_into`); this serves the rest, and the torchtitan bridge.
    """

    def __init__(self, plan: Plan, source: Source, **options: Any):
        """``options``: :class:`~sdadapt._engine.direct.EngineReader`'s (``engine``, ``config``,
        ``share_reads``, ``on_done``)."""
        StorageReader.__init__(self)
        EngineReader.__init__(self, plan, source, **options)
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
        jobs = [self._job(item, planner) for item in plan.items]
        targets = [_target_of(planner, item) for item in plan.items] if self.share_reads else [None] * len(jobs)
        self.run(jobs, targets)
        for item, job in zip(plan.items, jobs, strict=True):
            planner.commit_tensor(item, job.dest)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

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

    def fetch_ahead(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Before ``dcp.load`` (so that a failure changes nothing): fetch the source regions
        this rank's read items of ``state_dict`` need, where the source is at an object storage
        URL (see :meth:`~sdadapt.sources.Source.prefetch`); adds to :attr:`fetched`."""
        if self.source.remote_url() is None:
            return
        planner = AdaptedLoadPlanner()
        planner.set_up_planner(dict(state_dict), self._metadata, True)
        jobs = []
        for item in planner.create_local_plan().items:
            if item.type == LoadItemType.TENSOR:
                key = item.storage_index.fqn
                box = tuple((o, o + n) for o, n in zip(item.storage_offsets, item.lengths, strict=True))
                node = self.plan.recipes[key]
                jobs.append(Job(key, node, box, torch.empty(box_shape(box), dtype=node.dtype, device="meta")))
        got = prefetch(self.source, jobs, engine=self.engine == "engine")
        self.fetched = (self.fetched[0] + got[0], self.fetched[1] + got[1])

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: object) -> bool:
        return False


def _target_of(planner: LoadPlanner, item: ReadItem) -> torch.Tensor | None:
    """The state-dict tensor (a DTensor, or not) that a read item's destination belongs to."""
    if not isinstance(planner, DefaultLoadPlanner):
        return None
    return planner.state_dict.get(item.dest_index.fqn)
