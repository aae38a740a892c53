"""A DCP ``StorageReader`` that presents the *target* schema and reads source regions.

``dcp.load`` hands each rank ``ReadItem``s in global target coordinates for its own shards
(DCP and DTensor compute the offsets, ``_StridedShard`` and uneven shards included). For each
item we ask the plan's recipe for exactly that box, which reads only the source regions it
needs, and copy the result into the destination shard.
"""

from __future__ import annotations

import logging
import time

import torch
from torch.distributed.checkpoint import Metadata, StorageReader
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from .errors import LoadError
from .nodes import Box, box_shape
from .plan import Plan
from .sources.base import Source

log = logging.getLogger(__name__)


class CountingIO:
    """Source reads with a byte count (what this rank copied out of the checkpoint)."""

    def __init__(self, source: Source):
        self.source = source
        self.bytes_read = 0
        self.reads = 0

    def read(self, key: str, box: Box) -> torch.Tensor:
        t = self.source.read(key, box)
        self.bytes_read += t.numel() * t.element_size()
        self.reads += 1
        return t


class AdaptedStorageReader(StorageReader):
    """Serves a :class:`~sdadapt.plan.Plan` to ``dcp.load``."""

    def __init__(self, plan: Plan, source: Source):
        super().__init__()
        self.plan = plan
        self.source = source
        self.io = CountingIO(source)
        self.items_read = 0
        self.seconds = 0.0
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
        start = time.perf_counter()
        for item in plan.items:
            if item.type != LoadItemType.TENSOR:
                raise LoadError(f"key {item.dest_index.fqn!r}: only tensors can be loaded, got {item.type}")
            key = item.storage_index.fqn
            box = tuple((o, o + n) for o, n in zip(item.storage_offsets, item.lengths))
            try:
                value = self.plan.recipes[key].read(box, self.io)
            except Exception as e:  # noqa: BLE001 - name the key and file, keep the cause
                files = sorted({self.source.file_of(k) for k in self.plan.recipes[key].leaves()})
                raise LoadError(f"key {key!r} (from {', '.join(files)}): reading {list(box)} failed: {e}") from e
            dest = planner.resolve_tensor(item).detach()
            if tuple(dest.shape) != box_shape(box):
                raise LoadError(f"key {key!r}: destination shard {list(dest.shape)} != region {list(box)}")
            dest.copy_(value)
            planner.commit_tensor(item, dest)
            self.items_read += 1
        self.seconds += time.perf_counter() - start
        log.debug("read %d items, %d bytes", self.items_read, self.io.bytes_read)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: object) -> bool:
        return False
