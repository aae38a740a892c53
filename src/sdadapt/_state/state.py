"""Training state: ``save_state`` / ``load_state`` of model + optimizer (+ user entries) with DCP.

``save_state(model, dst, optimizer, extra={"step": 7, "sched": scheduler})`` is ``dcp.save`` of
``{"model": model_sd, "optim": optim_sd, **extra}`` (from ``get_state_dict``; ``Stateful``
extras are saved through their ``state_dict()``), plus ``sdadapt.json`` beside it: the sdadapt
and torch versions, where model and optimizer live in the checkpoint, the extra names, and the
adapter the model had been loaded with (a record only: the DCP data are in the model's layout).

The save side (and its background saves) lives in :mod:`.saving`. ``load_state(model, src,
optimizer, extra, adapter=None)`` restores all of it, on any mesh,
through ``adapter`` after a refactor; optimizer state follows its parameter (``optim_state``).
Everything is decided from the checkpoint's metadata, identically on every rank (and agreed:
the same adapter, plan and versions), before any tensor is read: missing or unexpected keys, an
optimizer of another kind, state for parameters the model lacks, missing extras. On a problem
every rank raises; model and optimizer are left as they were (one load transaction).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from pydantic import BaseModel
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from .._base.distributed import is_distributed, rank_and_world
from .._base.gc import without_gc
from .._base.progress import TransferBar
from .._base.regions import full_box
from .._base.summary import Summarized
from .._engine import EngineConfig
from .._engine.safe_planner import SafeLoadPlanner
from .._plan.adapter import Adapter
from .._plan.intent import intent
from .._plan.plan import PipelineStage, Plan, build_plan, vacant_modules
from .._plan.report import Report
from .._plan.target import local_nbytes, model_state_dict, schema_of
from .._transaction.args import check_model_and_path, renamed_keywords
from .._transaction.materialize import InitFn, check_buffers, has_meta, missing_values
from .._transaction.options import Options
from .._transaction.steps import derive_adapter
from .._transaction.tidy import call_started, public, single_process_quiet
from .._transaction.transaction import ATOMIC_WHY, Part, Transaction
from ..errors import LoadError, PlanError, SdadaptError, SourceError, StateError
from ..sources import DCPSource, NamespacedSource, attach, fetch_dcp_entries, is_hub_id, local_path
from .optim_state import OptimPlan, init_state, plan_optimizer, stored_names

log = logging.getLogger(__name__)

STATE_FORMAT = 1
MODEL_KEY = "model"
OPTIM_KEY = "optim"


class StateLoadReport(Summarized, BaseModel):
    """What :func:`load_state` restored on this rank.

    Attributes:
        rank: this rank.
        world_size: the ranks that loaded.
        source: the DCP folder.
        model_keys: model keys restored.
        optimizer_keys: parameters whose optimizer state was restored.
        optimizer_state_names: the optimizer's state names (``exp_avg``, ``step`` ...).
        param_groups: param groups restored.
        bytes_read: bytes read on this rank.
        extra: the extra entries restored.
        saved_with: what ``sdadapt.json`` says saved it.
        seconds: the whole call.
        report: the model plan's :class:`Report`.

    Example::

        report = sdadapt.load_state(model, "ckpt/step_100", optimizer)
        summary = str(report)
    """

    rank: int
    world_size: int
    source: str
    model_keys: int
    optimizer_keys: int  # per-parameter optimizer state tensors restored
    optimizer_state_names: list[str]  # e.g. ["exp_avg", "exp_avg_sq", "step"]
    param_groups: int
    bytes_read: int  # from the checkpoint's files, model and optimizer tensors together
    extra: list[str]
    saved_with: dict[str, Any] | None  # the checkpoint's sdadapt.json, if any
    seconds: float
    report: Report  # the model and optimizer plans, merged (optimizer keys prefixed)

    def format(self) -> str:
        return (
            f"rank {self.rank}/{self.world_size}: restored {self.model_keys} model tensors, "
            f"{self.optimizer_keys} optimizer tensors ({', '.join(self.optimizer_state_names) or 'none'}), "
            f"{self.param_groups} param group(s), extras {self.extra} in {self.seconds:.2f} s"
        )


def _get_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    try:
        return get_state_dict(model, optimizer)
    except (KeyError, ValueError, RuntimeError) as e:
        raise StateError(
            f"cannot take the state of {type(optimizer).__name__} with {type(model).__name__} "
            f"({type(e).__name__}: {e}); is the optimizer built on this model's parameters?"
        ) from e


# --------------------------------------------------------------------------------- load
def _detect_keys(full: DCPSource) -> tuple[str, str | None]:
    rec = full.record or {}
    if "model_key" in rec:
        return rec.get("model_key") or "", rec.get("optim_key")
    keys = list(full.schema) + full.non_tensor
    model_key = MODEL_KEY if any(k.startswith(MODEL_KEY + ".") for k in keys) else ""
    optim_key = next((o for o in (OPTIM_KEY, "optimizer") if any(k.startswith(o + ".state.") for k in keys)), None)
    return model_key, optim_key


@public
@renamed_keywords("sdadapt.load_state", {"stage": ("atomic", ATOMIC_WHY)})
@without_gc  # no full collection stalls the load: see sdadapt._base.gc
def load_state(
    model: nn.Module,
    src: str | os.PathLike[str],
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Stateful | Any] | None = None,
    adapter: Adapter | str | None = None,
    *,
    allow_missing: list[str] | None = None,
    allow_unexpected: list[str] | None = None,
    device: torch.device | str | None = None,
    init_buffers: InitFn | None = None,
    process_group: dist.ProcessGroup | None = None,
    atomic: bool = False,
    pipeline_stage: bool = False,
    engine: EngineConfig | None = None,
    progress: bool = True,
) -> StateLoadReport:
    """Restore model (+ optimizer, + ``extra``) from the DCP folder ``src``; every rank calls it.

    Works on any mesh (FSDP2, TP, HSDP, uneven shards) and through ``adapter`` after a refactor
    (optimizer state follows the parameters' rules); ``extra`` entries are restored in place.
    Strict: a missing or unexpected key, an optimizer of another kind or a missing extra raises
    on every rank before anything changes. One load transaction, as :func:`sdadapt.load`: a
    failure while reading or committing is a :class:`~sdadapt.errors.LoadError` on every rank
    (``atomic=True``: model and optimizer then keep their values bit for bit).
    docs/resume-and-export.md ("What load_state does") tells the whole of it: the extras, a
    meta model, the optimizer's state, failures, pipeline stages.

    Args:
        model: the model to restore (meta only without an optimizer).
        src: the DCP folder :func:`save_state` wrote.
        optimizer: its optimizer, restored too.
        extra: ``name -> Stateful or value`` entries saved beside them.
        adapter: the adapter from the checkpoint's layout to the model's (after a refactor).
        allow_missing: key patterns the checkpoint may lack.
        allow_unexpected: key patterns the model may lack.
        device: where a meta model is materialised.
        init_buffers: ``fn(model)`` that fills non-persistent buffers after materialising.
        process_group: the group the ranks agree over.
        atomic: read into staging copies; a failure leaves model and optimizer as they were.
        pipeline_stage: ``model`` is one pipeline stage and ``optimizer`` holds its parameters.
        engine: the I/O engine's settings for this call (:class:`~sdadapt.EngineConfig`);
            ``None``: the defaults and the ``SDADAPT_IO_*`` environment variables.
        progress: a bar of the bytes read (and the tensor count) on rank 0's stderr, drawn only
            on a terminal with sdadapt's logging on; ``False``: never.

    Returns:
        This rank's :class:`~sdadapt.reports.StateLoadReport`.

    Example::

        sdadapt.save_state(model, "ckpt/step_100", optimizer, extra={"step": 100})
        extra = {"step": 0}
        sdadapt.load_state(model, "ckpt/step_100", optimizer, extra=extra)
    """
    t0 = call_started()
    check_model_and_path("sdadapt.load_state(model, src, optimizer=None, extra=None, ...)", model, src)
    src = os.fspath(src)
    rank, world = rank_and_world(process_group)
    extra = extra if extra is not None else {}
    txn = Transaction(model, process_group, src)
    txn.engine = engine
    if optimizer is not None:
        txn.add_optimizer(optimizer, was_empty=not optimizer.state)
    options = Options.of(src, adapter=adapter, allow_missing=allow_missing, allow_unexpected=allow_unexpected,
                         pipeline_stage=pipeline_stage, init_buffers=init_buffers)  # fmt: skip
    r = txn.prepare(lambda: _prepare_state(txn, src, model, optimizer, extra, options), lambda r: intent(
        r.adapter, None if pipeline_stage or r.plan is None else r.plan.recipes, optimizer=optimizer is not None, extra=sorted(extra)))
    loaded_extra = _read_extras(txn, src, extra, process_group)
    if optimizer is None and txn.materialize(device, init_buffers, then=r.fill):
        r.model_sd = model_state_dict(model)
    parts = _state_parts(r)
    finish = _finish_steps(r, model, optimizer, extra, loaded_extra)
    total = sum(local_nbytes(t) for p in parts for t in p.targets.values())
    with TransferBar(total, "sdadapt.load_state", tensors=sum(len(p.targets) for p in parts), rank=rank, enabled=progress) as bar:
        txn.on_done = bar.update if bar.on else None
        txn.run(parts, atomic=atomic, finish=finish)  # **run**: the optimizer's parts first, then the model's
    assert r.plan is not None and r.report is not None  # set by _prepare_state, which returned
    rep = StateLoadReport(
        rank=rank, world_size=world, source=src, model_keys=len(r.plan.recipes),
        optimizer_keys=sum(len(p.targets) for p in parts if not p.of_model),
        optimizer_state_names=sorted(r.oplan.plans) if r.oplan is not None else [],
        param_groups=len(r.oplan.hyper) if r.oplan is not None else 0,
        bytes_read=sum(p.reader.io.bytes_read for p in parts if p.reader is not None),
        extra=sorted(extra), saved_with=r.full.record, seconds=time.perf_counter() - t0, report=r.report,
    )  # fmt: skip
    log.info("%s", rep.format())
    return rep


def _open_state(src: str) -> DCPSource:
    """**open**: the DCP folder ``src``, all its entries (a URL: its mirror, bytes fetched when read)."""
    if is_hub_id(src):
        raise SourceError("load_state reads a DCP folder that save_state wrote, not a Hub id", path=src)
    folder = local_path(src)  # an object storage URL: its local mirror
    if not os.path.isdir(folder):
        raise SourceError("no such DCP checkpoint folder", path=src)
    full = DCPSource(folder, subtree="")
    attach(full, folder)  # in place: the same object, fetching its bytes when read
    return full


def _prepare_state(txn: Transaction, src: str, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                   extra: dict[str, Any], options: Options) -> _Restore:  # fmt: skip
    """:func:`load_state`'s agreed step, headers only: **open** the folder (once), derive the
    **adapter** from it, **plan** the model and the optimizer's state, judge the plan, then read
    the small values (the optimizer's non-tensor state) before any tensor is written."""
    full = _open_state(src)
    txn.add_source(full)
    r = _Restore(full)
    model_key, optim_key = _detect_keys(full)
    r.model_fmt = f"{model_key}.{{}}" if model_key else "{}"
    # the model's keys as a shipped adapter reads them, from the folder opened once
    r.adapter = adapter = derive_adapter(options.adapter, NamespacedSource(full, r.model_fmt) if model_key else full)
    _plan_state(r, model, optimizer, adapter, model_key, optim_key, extra, src, options)
    stored = list(full.schema) + full.non_tensor
    for name in extra:
        if name not in stored and not any(k.startswith(name + ".") for k in stored):
            held = sorted({k.split(".", 1)[0] for k in stored})
            raise StateError(f"{src}: the checkpoint has no entry {name!r} for extra state; it holds {held}")
    assert r.plan is not None and r.report is not None
    if not r.report.ok:
        raise PlanError(r.report)
    if optimizer is None:
        check_buffers(model, options.init_buffers)
        r.fill = missing_values(model, r.plan.skipped, options.init_buffers, None)[1]
    if r.oplan is not None:  # small values, read before any tensor is written
        r.objects = {fk: full.read_object(key) for fk, key in r.oplan.objects.items()}
        r.hyper = [
            {n: full.read_object(k) if k in full.non_tensor else full.read(k, full_box(full.schema[k].shape)) for n, k in h.items()}
            for h in r.oplan.hyper
        ]
    return r


def _plan_state(r: _Restore, model: nn.Module, optimizer: torch.optim.Optimizer | None, adapter: Adapter | None, model_key: str,
                optim_key: str | None, extra: dict[str, Any], src: str, options: Options) -> None:  # fmt: skip
    """**plan**: the model's entries of the folder against ``model`` through ``adapter``, and the
    optimizer's state like its parameters (``r.plan``, ``r.report``, ``r.oplan``)."""
    full = r.full
    mprefix = f"{model_key}." if model_key else ""
    reserved = [p + "." for p in (optim_key, *extra) if p]
    if model_key:
        mschema = {k[len(mprefix) :]: i for k, i in full.schema.items() if k.startswith(mprefix)}
        mnon = [k[len(mprefix) :] for k in full.non_tensor if k.startswith(mprefix)]
    else:
        mschema = {k: i for k, i in full.schema.items() if not any(k.startswith(r) for r in reserved)}
        mnon = [k for k in full.non_tensor if not any(k.startswith(r) for r in reserved) and k not in extra]
    if optimizer is not None and has_meta(model):
        raise StateError("the model is on the meta device: materialise it and build the optimizer on its parameters first")
    if optimizer is not None:
        if optim_key is None:
            raise StateError(f"{src}: the checkpoint holds no optimizer state; pass optimizer=None to load the model")
        r.optim_prefix = f"{optim_key}.state."
        init_state(optimizer)
        model_sd, r.optim_sd = _get_state(model, optimizer)
        r.model_sd = {k: v for k, v in model_sd.items() if isinstance(v, torch.Tensor)}
    else:
        r.model_sd = model_state_dict(model)
    pstage = PipelineStage.of(r.model_sd, vacant_modules(model)) if options.pipeline_stage else None
    r.plan = build_plan(mschema, schema_of(r.model_sd), adapter, non_tensor=mnon, allow_missing=list(options.allow_missing),
                        allow_unexpected=list(options.allow_unexpected), source_name=src, target_name=type(model).__name__,
                        pipeline_stage=pstage)  # fmt: skip
    r.report = r.plan.report.model_copy(deep=True)
    if model_key:  # the checkpoint keys a mismatched value is made from, as the folder stores them
        r.report.shape_mismatch = [stored_names(m, r.model_fmt, mschema, key=False) for m in r.report.shape_mismatch]
        r.report.dtype_mismatch = [stored_names(m, r.model_fmt, mschema, key=False) for m in r.report.dtype_mismatch]
    if optimizer is not None:
        assert optim_key is not None
        r.oplan = plan_optimizer(full, optim_key, r.optim_sd, r.plan, adapter, r.report, optimizer, options, pstage)  # fmt: skip


def _state_parts(r: _Restore) -> list[Part]:
    """What the transaction reads: each optimizer state name's part first (a failure there leaves
    the model untouched), then the model's."""
    assert r.plan is not None
    parts: list[Part] = []
    if r.oplan is not None:
        for name, p in r.oplan.plans.items():
            wanted = {fqn: r.optim_sd["state"][fqn][name] for fqn in p.recipes}
            parts.append(Part(f"optimizer {name}", p, NamespacedSource(r.full, f"{r.optim_prefix}{{}}.{name}"), wanted, of_model=False))
    parts.append(Part("model", r.plan, NamespacedSource(r.full, r.model_fmt), {k: r.model_sd[k] for k in r.plan.recipes}))
    return parts


def _finish_steps(r: _Restore, model: nn.Module, optimizer: torch.optim.Optimizer | None, extra: dict[str, Any],
                  loaded_extra: dict[str, Any]) -> list[tuple[str, Callable[[], None]]]:  # fmt: skip
    """The commit's finishing steps, named for the :class:`LoadError` should one fail: the
    optimizer's state set, then each extra restored in place."""

    def set_optimizer_state() -> None:
        assert optimizer is not None
        for (fqn, name), value in r.objects.items():
            r.optim_sd["state"][fqn][name] = value
        for g, hyper in zip(r.optim_sd["param_groups"], r.hyper, strict=True):
            g.update(hyper)
        set_state_dict(model, optimizer, model_state_dict=r.model_sd, optim_state_dict=r.optim_sd)

    def restore_extra(name: str) -> Callable[[], None]:
        def restore() -> None:
            if isinstance(extra[name], Stateful):
                extra[name].load_state_dict(loaded_extra[name])
            else:
                extra[name] = loaded_extra[name]

        return restore

    finish = [("setting the optimizer state", set_optimizer_state)] if optimizer is not None else []
    return finish + [(f"restoring extra state {name!r}", restore_extra(name)) for name in loaded_extra]


class _Restore:
    """What :func:`load_state` planned, and the values it read before writing any tensor."""

    def __init__(self, full: DCPSource):
        self.full = full
        self.model_fmt = "{}"
        self.optim_prefix = ""
        self.model_sd: dict[str, Any] = {}
        self.optim_sd: dict[str, Any] = {}
        self.plan: Plan | None = None
        self.adapter: Adapter | None = None
        self.oplan: OptimPlan | None = None
        self.report: Report | None = None
        self.objects: dict[tuple[str, str], Any] = {}
        self.hyper: list[dict[str, Any]] = []
        self.fill: InitFn | None = None  # the allowed-missing keys' values on a meta model (materialize.missing_values)


def _read_extras(txn: Transaction, src: str, extra: dict[str, Any], group: dist.ProcessGroup | None) -> dict[str, Any]:
    """Collective: the ``extra`` entries as stored, read before anything is changed; they are
    handed to the user's objects only when the whole restore commits."""
    if not extra:
        return {}
    loaded = {name: (v.state_dict() if isinstance(v, Stateful) else v) for name, v in extra.items()}
    error: SdadaptError | None = None
    folder = src
    try:
        folder = local_path(src)  # an object storage URL: its mirror, the entries fetched
        fetch_dcp_entries(folder, sorted(extra))
    except SdadaptError as e:
        error = e
    txn.agree(error)
    try:
        with single_process_quiet():
            dcp.load(loaded, storage_reader=FileSystemReader(folder), planner=SafeLoadPlanner(allow_partial_load=True),
                     process_group=group, no_dist=not is_distributed())  # fmt: skip
    except CheckpointException as e:
        error = LoadError(f"restoring extra state {sorted(extra)} from {src} failed: {e}")
    txn.agree(error)
    return loaded


__all__ = ["StateError", "StateLoadReport", "load_state"]
