"""``sdadapt.load``: validate on headers, materialise, then one ``dcp.load`` of the adapted view."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from pydantic import BaseModel
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException

from .adapter import Adapter
from .distributed import agree, rank_and_world
from .errors import LoadError, ModelError, PlanError, SdadaptError
from .materialize import InitFn, check_buffers, choose_device, materialize
from .plan import Plan, build_plan
from .reader import AdaptedStorageReader
from .report import Report
from .sources import Source, open_source
from .target import model_state_dict, schema_of

log = logging.getLogger("sdadapt")


class LoadReport(BaseModel):
    """What one rank did: keys and bytes it read, and how long each phase took."""

    rank: int
    world_size: int
    source: str
    keys_loaded: int
    items_read: int
    bytes_read: int
    local_bytes: int  # bytes of this rank's destination shards
    seconds: float
    plan_seconds: float
    read_seconds: float
    materialized: bool
    report: Report

    def format(self) -> str:
        return (
            f"rank {self.rank}/{self.world_size}: loaded {self.keys_loaded} keys ({self.items_read} shard "
            f"regions), read {self.bytes_read / 2**20:.1f} MiB for {self.local_bytes / 2**20:.1f} MiB of "
            f"local shards in {self.seconds:.2f} s (plan {self.plan_seconds:.2f} s, read {self.read_seconds:.2f} s)"
        )

    def __str__(self) -> str:
        return self.format()


def _describe(src: Any) -> str:
    return src.path if isinstance(src, Source) else os.fspath(src)


def plan_load(
    model: nn.Module,
    src: str | os.PathLike[str] | Source,
    adapter: Adapter | None = None,
    *,
    subtree: str | None = None,
    allow_missing: list[str] | None = None,
    allow_unexpected: list[str] | None = None,
) -> tuple[Source, Plan]:
    """Open the source and plan against the model (headers only; nothing is read or changed)."""
    source = open_source(src, subtree=subtree)
    target = schema_of(model_state_dict(model))
    plan = build_plan(
        source.schema,
        target,
        adapter,
        non_tensor=source.non_tensor,
        allow_missing=allow_missing,
        allow_unexpected=allow_unexpected,
        source_name=_describe(src),
        target_name=type(model).__name__,
    )
    return source, plan


def load(
    model: nn.Module,
    src: str | os.PathLike[str] | Source,
    adapter: Adapter | None = None,
    *,
    strict: bool = True,
    subtree: str | None = None,
    allow_missing: list[str] | None = None,
    allow_unexpected: list[str] | None = None,
    device: torch.device | str | None = None,
    init_buffers: InitFn | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> LoadReport:
    """Load checkpoint ``src`` into ``model`` through ``adapter``; every rank reads only its shards.

    Call on every rank (a collective when a process group is initialised). ``model`` may be on
    the meta device and parallelised (TP, FSDP2, HSDP); it is materialised on ``device`` (default:
    its mesh's device, else CPU) once the plan is valid. With ``strict=True`` any missing,
    unexpected or mismatched key raises :class:`~sdadapt.PlanError` on every rank before
    anything is read or changed; ``allow_missing``/``allow_unexpected`` take key patterns that
    are fine to leave out. ``subtree`` picks a nested dict of a ``torch.save`` file.
    """
    t0 = time.perf_counter()
    rank, world = rank_and_world(process_group)
    error: SdadaptError | None = None
    source = plan = None
    try:
        source, plan = plan_load(
            model, src, adapter, subtree=subtree, allow_missing=allow_missing, allow_unexpected=allow_unexpected
        )
        if not plan.report.ok:
            if strict:
                raise PlanError(plan.report)
            log.warning("loading with problems (strict=False):\n%s", plan.report.format())
        check_buffers(model, init_buffers)
    except SdadaptError as e:
        error = e
    agree(error, process_group)  # every rank raises if any failed; nothing was changed
    assert source is not None and plan is not None
    t_plan = time.perf_counter() - t0

    materialized, error = False, None
    try:  # a hook failing on one rank must stop the others before they enter dcp.load
        materialized = materialize(model, choose_device(model, device), init_buffers)
    except Exception as e:  # noqa: BLE001 - user hooks can raise anything; re-raised below
        error = e if isinstance(e, SdadaptError) else ModelError(f"materialising the model failed: {type(e).__name__}: {e}")
        error.__cause__ = e
    agree(error, process_group)
    state_dict = model_state_dict(model)
    wanted = {k: v for k, v in state_dict.items() if k in plan.recipes}
    reader = AdaptedStorageReader(plan, source)
    log.info("rank %d: reading %d keys from %s", rank, len(wanted), _describe(src))
    try:
        dcp.load(wanted, storage_reader=reader, planner=DefaultLoadPlanner(), process_group=process_group)
    except CheckpointException as e:  # a BaseException: turn it into ours
        raise LoadError(f"reading {_describe(src)} failed: {e}") from None
    finally:
        source.close()
    _copy_back_if_detached(model, wanted)

    from .target import local_nbytes

    rep = LoadReport(
        rank=rank,
        world_size=world,
        source=_describe(src),
        keys_loaded=len(wanted),
        items_read=reader.items_read,
        bytes_read=reader.io.bytes_read,
        local_bytes=sum(local_nbytes(t) for t in wanted.values()),
        seconds=time.perf_counter() - t0,
        plan_seconds=t_plan,
        read_seconds=reader.seconds,
        materialized=materialized,
        report=plan.report,
    )
    log.info("%s", rep.format())
    return rep


def _copy_back_if_detached(model: nn.Module, loaded: dict[str, torch.Tensor]) -> None:
    """DCP wrote into the state dict's tensors. They are the model's own (sharded) tensors for
    plain modules, TP and FSDP2; if some are copies (other wrappers), copy them back."""
    current = model_state_dict(model)
    detached = {k: v for k, v in loaded.items() if not _same_storage(current.get(k), v)}
    if detached:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        log.debug("copying %d detached tensors back into the model", len(detached))
        set_model_state_dict(model, detached, options=StateDictOptions(strict=False))


def _same_storage(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    if a is None:
        return False
    from torch.distributed.tensor import DTensor

    la = a._local_tensor if isinstance(a, DTensor) else a
    lb = b._local_tensor if isinstance(b, DTensor) else b
    return la.data_ptr() == lb.data_ptr() or la.numel() == 0
