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

from . import integrity
from .adapter import Adapter
from .distributed import agree, rank_and_world
from .errors import LoadError, ModelError, PlanError, SdadaptError
from .materialize import InitFn, check_buffers, choose_device, has_meta, materialize
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
    verify: bool = False,
    check_finite: bool = False,
    stage: bool | None = None,
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
    every region read against ``sdadapt.checksums.json`` (see :mod:`sdadapt.integrity`);
    ``check_finite=True`` refuses NaN/Inf values, naming each key.
    """
    t0 = time.perf_counter()
    rank, world = rank_and_world(process_group)
    error: SdadaptError | None = None
    source = plan = None
    files: integrity.Fingerprint = {}
    try:
        source, plan = plan_load(
            model, src, adapter, subtree=subtree, allow_missing=allow_missing, allow_unexpected=allow_unexpected
        )
        files = integrity.fingerprint(integrity.source_files(source))
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
    t_plan = time.perf_counter() - t0

    materialized, error = False, None
    was_meta = has_meta(model)  # a failed load puts such a model back on meta
    try:  # a hook failing on one rank must stop the others before they enter dcp.load
        materialized = materialize(model, choose_device(model, device), init_buffers)
    except Exception as e:  # noqa: BLE001 - user hooks can raise anything; re-raised below
        error = e if isinstance(e, SdadaptError) else ModelError(f"materialising the model failed: {type(e).__name__}: {e}")
        error.__cause__ = e
    try:
        agree(error, process_group)
    except SdadaptError:
        source.close()
        _roll_back(model, was_meta)
        raise
    state_dict = model_state_dict(model)
    wanted = {k: v for k, v in state_dict.items() if k in plan.recipes}
    staged = _staging(wanted) if (stage if stage is not None else not was_meta) else None
    reader = AdaptedStorageReader(plan, source)
    log.info("rank %d: reading %d keys from %s%s", rank, len(wanted), _describe(src), " (staged)" if staged else "")
    error = None
    try:  # files unchanged since planning: every rank checks before the first byte is written
        integrity.check_unchanged(files, "after planning, before reading")
    except SdadaptError as e:
        error = e
    try:
        agree(error, process_group)
    except SdadaptError:
        source.close()
        _roll_back(model, was_meta)
        raise
    failure: LoadError | None = None
    try:
        dcp.load(staged if staged is not None else wanted, storage_reader=reader, planner=DefaultLoadPlanner(), process_group=process_group)
    except CheckpointException as e:  # a BaseException, raised on every rank: turn it into ours
        failure = _read_failure(e, _describe(src))
    finally:
        source.close()
    if failure is None:  # every rank got here without error: check, then agree (same error everywhere)
        failure = _after_read_checks(files, staged if staged is not None else wanted, plan, source, check_finite, process_group)
    if failure is not None:
        _roll_back(model, was_meta)
        if staged is None and not was_meta:
            failure.args = (failure.args[0] + "\nThe model's parameters were partly overwritten (stage=False); load again.",)
        raise failure
    if staged is not None:
        with torch.no_grad():
            for k, s in staged.items():
                _local(wanted[k]).copy_(_local(s))
        del staged
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


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def _staging(wanted: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Empty shards laid out like ``wanted`` (same DTensor mesh, placements, global shape)."""
    from torch.distributed.tensor import DTensor

    out: dict[str, torch.Tensor] = {}
    for k, v in wanted.items():
        if isinstance(v, DTensor):
            local = torch.empty_like(v._local_tensor)
            out[k] = DTensor.from_local(local, v.device_mesh, v.placements, run_check=False, shape=v.shape, stride=v.stride())
        else:
            out[k] = torch.empty_like(v.detach())
    return out


def _roll_back(model: nn.Module, materialized: bool) -> None:
    """A failed load leaves no half-loaded model: one this load materialised goes back to meta."""
    if materialized:
        model.to_empty(device="meta")
        log.info("load failed: the model is back on the meta device")


def _read_failure(e: CheckpointException, what: str) -> LoadError:
    """One message for every rank: which ranks failed and their own errors (file, key)."""
    failures = getattr(e, "failures", {}) or {}
    lines = []
    for r, pair in sorted(failures.items()):
        exc = pair[0] if isinstance(pair, tuple) else pair
        lines.append(f"  rank {r}: {type(exc).__name__}: {exc}")
    err = LoadError(
        f"reading {what} failed on rank(s) {', '.join(str(r) for r in sorted(failures)) or '?'}; nothing was "
        "kept from this load:\n" + ("\n".join(lines) if lines else str(e))
    )
    err.failures = {r: (pair[0] if isinstance(pair, tuple) else pair) for r, pair in failures.items()}  # type: ignore[attr-defined]
    return err


def _after_read_checks(
    files: integrity.Fingerprint,
    loaded: dict[str, torch.Tensor],
    plan: Plan,
    source: Source,
    check_finite: bool,
    group: dist.ProcessGroup | None,
) -> LoadError | None:
    """Files unchanged during the read, and (``check_finite``) no NaN/Inf; the same error on every rank."""
    from .distributed import is_distributed

    problems: list[str] = []
    try:
        integrity.check_unchanged(files, "while it was being read")
    except SdadaptError as e:
        problems.append(str(e))
    bad: dict[str, tuple[int, int]] = integrity.nonfinite_counts(loaded) if check_finite else {}
    gathered: list[Any] = [(problems, bad)]
    if is_distributed():
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (problems, bad), group=group)
    all_problems = [f"rank {r}: {p}" for r, (ps, _) in enumerate(gathered) for p in ps]
    counts: dict[str, list[int]] = {}
    for _, b in gathered:
        for k, (n, i) in b.items():
            c = counts.setdefault(k, [0, 0])
            c[0] += n
            c[1] += i
    if counts:
        rows = []
        for k in sorted(counts):
            files_of = sorted({source.file_of(leaf) for leaf in plan.recipes[k].leaves()})
            rows.append(f"  {k}: {counts[k][0]} NaN, {counts[k][1]} Inf (from {', '.join(files_of)})")
        all_problems.append(
            f"non-finite values (check_finite=True) in {len(counts)} key(s):\n" + "\n".join(rows)
            + "\nThe checkpoint holds NaN/Inf there; use another checkpoint, or load without check_finite"
        )
    if not all_problems:
        return None
    return LoadError("the load was refused; nothing was kept from it:\n" + "\n".join(all_problems))


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
