"""A DCP folder written by ``dcp.save`` in one process, tensor by tensor.

The state dict handed to ``dcp.save`` holds fake tensors (shapes and dtypes only); our save
planner's ``resolve_data`` pulls each real tensor when DCP's ``FileSystemWriter`` asks for
it, and DCP writes it. The folder is an ordinary DCP checkpoint (``.metadata`` + ``.distcp``).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from ..._base.schema import TensorInfo
from .base import Pull, Writer, check_pulled


class _LazyPlanner(DefaultSavePlanner):
    def __init__(self, entries: dict[str, TensorInfo], pull: Pull):
        super().__init__(flatten_state_dict=False)
        self.entries = entries
        self.pull = pull

    def resolve_data(self, write_item: WriteItem) -> Any:
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        key = write_item.index.fqn
        t = self.pull(key)
        check_pulled(key, t, self.entries[key])
        return t


def fake_state(entries: dict[str, TensorInfo]) -> dict[str, object]:
    """A state dict of fake tensors (shapes and dtypes only) for ``entries``."""
    with FakeTensorMode():
        return {k: torch.empty(i.shape, dtype=i.dtype) for k, i in entries.items()}


def save_lazy(path: str, state: dict[str, object], entries: dict[str, TensorInfo], pull: Pull) -> None:
    """``dcp.save`` of ``state`` (fake tensors for ``entries``, other objects as they are) into
    the folder ``path`` in this process, each tensor pulled when DCP writes it: the save step
    of every writer of a DCP folder."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        dcp.save(
            state,
            storage_writer=FileSystemWriter(path, thread_count=1, sync_files=True),
            planner=_LazyPlanner(entries, pull),
            no_dist=True,
        )


class DCPWriter(Writer):
    """``path`` is the folder to write (one ``.distcp`` file plus ``.metadata``)."""

    def write(self, entries: dict[str, TensorInfo], pull: Pull) -> None:
        save_lazy(self.path, fake_state(entries), entries, pull)
