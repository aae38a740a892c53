"""``sdadapt.load``: validate on headers, materialise, then one ``dcp.load`` of the adapted view."""

from __future__ import annotations

import logging
import os
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from pydantic import BaseModel
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from . import _commit as commit
from . import _integrity as integrity
from ._adapter import Adapter
from ._distributed import agree, rank_and_world
from ._materialize import InitFn, check_buffers, choose_device, has_meta, materialize
from ._plan import Plan, build_plan
from ._reader import AdaptedLoadPlanner, AdaptedStorageReader
from ._report import Report
from ._target import local_nbytes, model_state_dict, schema_of
from .errors import ModelError, PlanError, SdadaptError
from .sources import Source, open_source

log = logging.getLogger("sdadapt")


class LoadReport(BaseModel):
    """What one rank did: keys and bytes it read, and how long each phase took."""

    rank: int
    world_size: int
    source: str
    keys_loaded: int
    items_read: int
    bytes_read: int
    bytes_shared: int = 0  # received from replicas (share_reads=True) instead of read
    local_bytes: int  # bytes of this rank's destination shards
    seconds: float
    plan_seconds: float
    read_seconds: float
    phase_seconds: dict[str, float] = {}  # wall time of each step of the load, in order
    materialized: bool
    report: Report

    def format(self) -> str:
        return (
            f"rank {self.rank}/{self.world_size}: loaded {self.keys_loaded} keys ({self.items_read} shard "
            f"regions), read {self.bytes_read / 2**20:.1f} MiB for {self.local_bytes / 2**20:.1f} MiB of "
            f"local shards"
            + (f" (+{self.bytes_shared / 2**20:.1f} MiB from replicas)" if self.bytes_shared else "")
            + f" in {self.seconds:.2f} s (plan {self.plan_seconds:.2f} s, read {self.read_seconds:.2f} s)"
        )

    def __str__(self) -> str:
        return self.format()


class _Phases:
    """Wall time between consecutive marks (for ``LoadReport.phase_seconds``)."""

    def __init__(self, start: float):
        self.last = start
        self.seconds: dict[str, float] = {}

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = now - self.last
        self.last = now


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
    source, plan, _ = _plan_load(model, src, adapter, subtree, allow_missing, allow_unexpected)
    return source, plan


def _plan_load(
    model: nn.Module,
    src: str | os.PathLike[str] | Source,
    adapter: Adapter | None,
    subtree: str | None,
    allow_missing: list[str] | None,
    allow_unexpected: list[str] | None,
) -> tuple[Source, Plan, dict[str, torch.Tensor]]:
    """:func:`plan_load`, also returning the model's state dict it planned against."""
    source = open_source(src, subtree=subtree)
    state_dict = model_state_dict(model)
    try:
        plan = build_plan(
            source.schema,
            schema_of(state_dict),
            adapter,
            non_tensor=source.non_tensor,
            allow_missing=allow_missing,
            allow_unexpected=allow_unexpected,
            source_name=_describe(src),
            target_name=type(model).__name__,
        )
    except BaseException:
        source.close()
        raise
    return source, plan, state_dict


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
    verify: bool = False,
    check_finite: bool = False,
    stage: bool | None = None,
    share_reads: bool = False,
) -> LoadReport:
    """Load checkpoint ``src`` into ``model`` through ``adapter``; every rank reads only its shards.

    Call on every rank (a collective when a process group is initialised). ``model`` may be on
    the meta device and parallelised (TP, FSDP2, HSDP); it is materialised on ``device`` (default:
    its mesh's device, else CPU) once the plan is valid. With ``strict=True`` any missing,
    unexpected or mismatched key raises :class:`~sdadapt.PlanError` on every rank before
    anything is read or changed; ``allow_missing``/``allow_unexpected`` take key patterns that
    are fine to leave out. ``subtree`` picks a nested dict of a ``torch.save`` file.

    Never a half-loaded model: a failure while reading (on any rank) raises :class:`LoadError`
    on every rank, and the model is as it was: a model that was on the meta device is put back
    on meta; a model that already held values is loaded into staging shards first and only
    then committed (``stage=None``: stage exactly then; ``stage=False`` writes in place and saves
    the memory of one copy of this rank's shards, but a failure then leaves those parameters
    partly overwritten, which the error says). The checkpoint's files must not change while
    they are read (size, mtime and inode are checked before and after). ``verify=True`` checks
    every region read against ``sdadapt.checksums.json`` (see :mod:`sdadapt._integrity`);
    ``check_finite=True`` refuses NaN/Inf values, naming each key.

    ``share_reads=True``: ranks that hold the same shard (mesh dims where a parameter is
    ``Replicate``: HSDP's replicate dim, TP-replicated norms) each read a part of it and
    broadcast it to the others over the process group (:mod:`sdadapt._share`), instead of all
    reading all of it; for fast interconnects (NVLink) where the page cache, not the network,
    is the limit. ``LoadReport.bytes_shared`` is what this rank received that way.
    """
    t0 = time.perf_counter()
    rank, world = rank_and_world(process_group)
    error: SdadaptError | None = None
    source = plan = None
    planned: dict[str, torch.Tensor] = {}
    files: integrity.Fingerprint = {}
    try:
        source, plan, planned = _plan_load(model, src, adapter, subtree, allow_missing, allow_unexpected)
        files = integrity.fingerprint(source.files())
        if not plan.report.ok:
            if strict:
                raise PlanError(plan.report)
            log.warning("loading with problems (strict=False):\n%s", plan.report.format())
        check_buffers(model, init_buffers)
        if verify:
            sidecar, sums = integrity.read_checksums(source)
            leaves = sorted({k for node in plan.recipes.values() for k in node.leaves()})
            source = integrity.VerifyingSource(source, sidecar, sums, leaves)
    except SdadaptError as e:
        error = e
        if source is not None:
            source.close()
    agree(error, process_group)  # every rank raises if any failed; nothing was changed
    assert source is not None and plan is not None
    phases = _Phases(t0)
    phases.mark("plan")

    materialized, error = False, None
    was_meta = has_meta(model)  # a failed load puts such a model back on meta
    try:  # a hook failing on one rank must stop the others before they enter dcp.load
        materialized = materialize(model, choose_device(model, device), init_buffers)
    except Exception as e:  # noqa: BLE001 - user hooks can raise anything; re-raised below
        error = e if isinstance(e, SdadaptError) else ModelError(f"materialising the model failed: {type(e).__name__}: {e}")
        error.__cause__ = e
    # every rank's hook has run (a hook may touch the files) before any rank checks them
    commit.agree_or_roll_back(error, process_group, source, model, was_meta)
    phases.mark("materialize")
    # materialising gave the parameters new tensors; otherwise the planned state dict is current
    state_dict = model_state_dict(model) if materialized else planned
    del planned
    wanted = {k: v for k, v in state_dict.items() if k in plan.recipes}
    staged = commit.staging_like(wanted) if (stage if stage is not None else not was_meta) else None
    error = None
    try:  # files unchanged since planning: every rank checks before the first byte is written
        integrity.check_unchanged(files, "after planning, before reading")
    except SdadaptError as e:
        error = e
    commit.agree_or_roll_back(error, process_group, source, model, was_meta)
    reader = AdaptedStorageReader(plan, source, share_reads=share_reads)
    phases.mark("prepare")
    log.info("rank %d: reading %d keys from %s%s", rank, len(wanted), _describe(src), " (staged)" if staged else "")
    read_errors: list[str] = []
    target = staged if staged is not None else wanted
    try:  # each rank reads its own items: the read plan is local (our reader's metadata is the
        # target schema, every rank has it), so DCP's plan exchange is skipped (no_dist); the
        # outcome is agreed below, in the one collective of the checks after reading
        with warnings.catch_warnings():  # no_dist=True warns that it assumes one process: we mean it
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(target, storage_reader=reader, planner=AdaptedLoadPlanner(), process_group=process_group, no_dist=True)
    except CheckpointException as e:  # a BaseException: turn it into ours
        read_errors = commit.read_errors(e)
    except Exception as e:  # noqa: BLE001 - named and agreed on below
        read_errors = [f"{type(e).__name__}: {e}"]
    finally:
        source.close()
    phases.mark("dcp_load")
    # every rank: check (files unchanged, finite values), then agree: the same verdict everywhere
    failure = commit.after_read_checks(
        files, target, plan, source, check_finite, process_group, read_errors=read_errors, what=_describe(src)
    )
    phases.mark("check")
    if failure is not None:
        commit.roll_back(model, was_meta)
        if staged is None and not was_meta:
            failure.args = (failure.args[0] + "\nThe model's parameters were partly overwritten (stage=False); load again.",)
        raise failure
    if staged is not None:
        commit.commit_staged(staged, wanted)
        del staged, target
    commit.copy_back_if_detached(model, wanted)
    phases.mark("commit")
    timings = dict(phases.seconds)
    timings["engine"] = reader.stats.seconds  # inside dcp_load: first task to last byte
    timings["engine_plan"] = reader.stats.plan_seconds  # of which planning (reads start meanwhile)

    rep = LoadReport(
        rank=rank,
        world_size=world,
        source=_describe(src),
        keys_loaded=len(wanted),
        items_read=reader.items_read,
        bytes_read=reader.io.bytes_read,
        bytes_shared=reader.shared_bytes,
        local_bytes=sum(local_nbytes(t) for t in wanted.values()),
        seconds=time.perf_counter() - t0,
        plan_seconds=phases.seconds["plan"],
        read_seconds=reader.seconds,
        phase_seconds={k: round(v, 6) for k, v in timings.items()},
        materialized=materialized,
        report=plan.report,
    )
    log.info("%s", rep.format())
    return rep
