"""Training state: ``save_state`` / ``load_state`` of model + optimizer (+ user entries) with DCP.

``save_state(dst, model, optimizer, extra={"step": 7, "sched": scheduler})`` is ``dcp.save`` of
``{"model": model_sd, "optim": optim_sd, **extra}`` (from ``get_state_dict``; ``Stateful``
extras are saved through their ``state_dict()``), plus ``sdadapt.json`` beside it: the sdadapt
and torch versions, where model and optimizer live in the checkpoint, the extra names, and the
adapter the model had been loaded with (a record only: the DCP data are in the model's layout).

``load_state(src, model, optimizer, extra, adapter=None)`` restores all of it, on any mesh
(DCP's chunks are intersected with each rank's shards), and through ``adapter`` after a
refactor. Optimizer state follows its parameter: every per-parameter state of one name
(``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``...) is planned like the parameters, by
applying the same adapter to ``{param fqn: state tensor}``, so the ``exp_avg`` of a fused
``wqkv`` is fused the way the weight is. Scalar state (Adam's 0-d ``step``) is carried as is,
taken from the first source parameter of the target parameter's recipe. Hyperparameters
(``lr``, ``betas``...) come from the checkpoint's param groups, matched by position.

Everything is decided from the checkpoint's metadata, identically on every rank, before any
tensor is read: missing or unexpected keys, an optimizer of another kind, optimizer state for
parameters the model lacks, missing extras. On a problem every rank raises and the model and
optimizer are left as they were.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from pydantic import BaseModel
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from ._adapter import Adapter
from ._commit import copy_back_if_detached
from ._distributed import agree, is_distributed, rank_and_world
from ._materialize import InitFn, check_buffers, choose_device, has_meta, materialize
from ._nodes import Box, Leaf, Node, full_box
from ._plan import Plan, build_plan
from ._reader import AdaptedStorageReader
from ._report import Mismatch, Report
from ._safe_planner import SafeLoadPlanner
from ._target import model_state_dict, schema_of
from .errors import LoadError, PlanError, SdadaptError, SourceError, StateError
from .sources._base import Source, TensorInfo
from .sources._dcp_dir import SDADAPT_JSON, DCPSource

log = logging.getLogger(__name__)

STATE_FORMAT = 1
MODEL_KEY = "model"
OPTIM_KEY = "optim"


class StateLoadReport(BaseModel):
    """What :func:`load_state` restored on this rank."""

    rank: int
    world_size: int
    source: str
    model_keys: int
    optimizer_keys: int  # per-parameter optimizer state tensors restored
    optimizer_state_names: list[str]  # e.g. ["exp_avg", "exp_avg_sq", "step"]
    param_groups: int
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

    def __str__(self) -> str:
        return self.format()


# --------------------------------------------------------------------------------- save
def save_state(
    dst: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Stateful | Any] | None = None,
    adapter: Adapter | None = None,
    *,
    overwrite: bool = False,
    process_group: dist.ProcessGroup | None = None,
    checksums: bool = False,
) -> str:
    """Save model (+ optimizer, + ``extra`` entries) to the DCP folder ``dst``; every rank calls it.

    ``checksums=True`` also writes ``sdadapt.checksums.json`` (for ``load(..., verify=True)``):
    the ranks read the saved tensors back, each a share of the keys, so it costs one read of
    the checkpoint spread over the ranks.

    ``extra`` maps names to ``Stateful`` objects (LR scheduler, dataloader: saved through
    ``state_dict()``) or plain values (``{"step": 7}``). ``adapter``, the checkpoint->model
    adapter the model was first loaded with, is recorded in ``sdadapt.json``. An existing
    non-empty ``dst`` is an error unless ``overwrite=True``. Returns ``dst``.
    """
    dst = os.fspath(dst)
    rank, world = rank_and_world(process_group)
    extra = dict(extra or {})
    error: SdadaptError | None = None
    try:
        for name in extra:
            if not isinstance(name, str) or not name or "." in name or name in (MODEL_KEY, OPTIM_KEY):
                raise StateError(
                    f"extra entry name {name!r}: use a non-empty name without dots, other than "
                    f"{MODEL_KEY!r} and {OPTIM_KEY!r}"
                )
        if rank == 0 and os.path.isdir(dst) and os.listdir(dst) and not overwrite:
            raise StateError(f"{dst} exists and is not empty; pass overwrite=True or choose a new folder")
        if rank == 0 and os.path.exists(dst) and not os.path.isdir(dst):
            raise StateError(f"{dst} exists and is not a folder")
        if has_meta(model):
            raise StateError("the model still has tensors on the meta device; there is nothing to save")
    except SdadaptError as e:
        error = e
    agree(error, process_group)
    if optimizer is not None:
        model_sd, optim_sd = _get_state(model, optimizer)
        state: dict[str, Any] = {MODEL_KEY: model_sd, OPTIM_KEY: optim_sd}
    else:
        state = {MODEL_KEY: model_state_dict(model)}
    state.update(extra)
    if rank == 0 and overwrite and os.path.isfile(os.path.join(dst, ".metadata")):
        os.remove(os.path.join(dst, ".metadata"))  # a crash mid-save must not look complete
    if is_distributed():
        dist.barrier(group=process_group)
    try:
        dcp.save(state, checkpoint_id=dst, process_group=process_group, no_dist=not is_distributed())
    except CheckpointException as e:
        raise StateError(f"saving to {dst} failed: {e}") from None
    if rank == 0:
        record = {
            "format": STATE_FORMAT,
            "sdadapt_version": _version(),
            "torch_version": torch.__version__,
            "world_size": world,
            "model_key": MODEL_KEY,
            "optim_key": OPTIM_KEY if optimizer is not None else None,
            "optimizer": type(optimizer).__name__ if optimizer is not None else None,
            "extra": sorted(extra),
            "adapter": json.loads(adapter.to_json()) if adapter is not None else None,
        }
        tmp = os.path.join(dst, f".{SDADAPT_JSON}.{uuid.uuid4().hex[:8]}")
        with open(tmp, "w") as f:
            json.dump(record, f, indent=2)
        os.replace(tmp, os.path.join(dst, SDADAPT_JSON))
    if is_distributed():
        dist.barrier(group=process_group)
    if checksums:
        _write_checksums(dst, rank, world, process_group)
    log.info("rank %d: saved state to %s", rank, dst)
    return dst


def _write_checksums(dst: str, rank: int, world: int, group: dist.ProcessGroup | None) -> None:
    from . import _integrity as integrity

    error: SdadaptError | None = None
    mine: dict[str, Any] = {}
    try:
        mine = integrity.checksums_of_saved(dst, rank, world)
    except SdadaptError as e:
        error = e
    agree(error, group)
    parts: list[Any] = [mine]
    if is_distributed():
        parts = [None] * world
        dist.all_gather_object(parts, mine, group=group)
    if rank == 0:
        integrity.write_checksums_data(dst, {k: v for p in parts for k, v in p.items()})
    if is_distributed():
        dist.barrier(group=group)


def _get_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    try:
        return get_state_dict(model, optimizer)
    except (KeyError, ValueError, RuntimeError) as e:
        raise StateError(
            f"cannot take the state of {type(optimizer).__name__} with {type(model).__name__} "
            f"({type(e).__name__}: {e}); is the optimizer built on this model's parameters?"
        ) from e


def _version() -> str:
    from . import __version__

    return __version__


# --------------------------------------------------------------------------------- load
class _Namespace(Source):
    """A view of a DCP checkpoint where key ``k`` means the stored entry ``fmt.format(k)``."""

    def __init__(self, base: DCPSource, fmt: str):
        self.base = base
        self.fmt = fmt
        self.path = base.path
        self.schema = {}
        self.non_tensor = []

    def read(self, key: str, box: Box) -> torch.Tensor:
        return self.base.read(self.fmt.format(key), box)

    def file_of(self, key: str) -> str:
        return self.base.file_of(self.fmt.format(key))


class _OptimPlan:
    """The optimizer part of a restore: one plan per state name, plus param-group values."""

    def __init__(self) -> None:
        self.plans: dict[str, Plan] = {}  # state name -> plan over param fqns
        self.objects: dict[tuple[str, str], str] = {}  # (fqn, name) -> stored key (non-tensor state)
        self.hyper: list[dict[str, Any]] = []  # per group: hyperparameters to set


def _detect_keys(full: DCPSource) -> tuple[str, str | None]:
    rec = full.record or {}
    if "model_key" in rec:
        return rec.get("model_key") or "", rec.get("optim_key")
    keys = list(full.schema) + full.non_tensor
    model_key = MODEL_KEY if any(k.startswith(MODEL_KEY + ".") for k in keys) else ""
    optim_key = next((o for o in (OPTIM_KEY, "optimizer") if any(k.startswith(o + ".state.") for k in keys)), None)
    return model_key, optim_key


def _under(keys: list[str], prefix: str) -> list[str]:
    return [k for k in keys if k.startswith(prefix)]


def _merge(into: Report, other: Report, fmt: str) -> None:
    """Add ``other``'s problems to ``into`` with keys renamed by ``fmt`` (``optim.state.{}.exp_avg``)."""
    into.missing += [fmt.format(k) for k in other.missing]
    into.unexpected += [fmt.format(k) for k in other.unexpected]
    into.non_tensor += [fmt.format(k) for k in other.non_tensor]
    into.shape_mismatch += [m.model_copy(update={"key": fmt.format(m.key)}) for m in other.shape_mismatch]
    into.dtype_mismatch += [m.model_copy(update={"key": fmt.format(m.key)}) for m in other.dtype_mismatch]
    seen = {(i.index, i.key, i.message) for i in into.rule_issues}
    for it in other.rule_issues:
        if (it.index, it.key, it.message) not in seen:
            into.rule_issues.append(it.model_copy(update={"key": fmt.format(it.key) if it.key else None}))
    into.allowed_missing += [fmt.format(k) for k in other.allowed_missing]
    into.allowed_unexpected += [fmt.format(k) for k in other.allowed_unexpected]
    into.matched += other.matched
    into.target_keys += other.target_keys


def _plan_optimizer(
    full: DCPSource,
    optim_key: str,
    optim_sd: dict[str, Any],
    model_plan: Plan,
    adapter: Adapter | None,
    report: Report,
    optimizer: torch.optim.Optimizer,
    allow_missing: list[str] | None,
    allow_unexpected: list[str] | None,
) -> _OptimPlan:
    out = _OptimPlan()
    sprefix = f"{optim_key}.state."
    # what the checkpoint holds: state name -> {param fqn: info}; non-tensor state separately
    src: dict[str, dict[str, TensorInfo]] = {}
    src_obj: dict[str, set[str]] = {}
    for k in _under(list(full.schema), sprefix):
        fqn, name = k[len(sprefix) :].rsplit(".", 1)
        src.setdefault(name, {})[fqn] = full.schema[k]
    for k in _under(full.non_tensor, sprefix):
        fqn, name = k[len(sprefix) :].rsplit(".", 1)
        src_obj.setdefault(name, set()).add(fqn)
    # what the optimizer holds
    tgt: dict[str, dict[str, TensorInfo]] = {}
    tgt_obj: dict[str, set[str]] = {}
    for fqn, st in optim_sd["state"].items():
        for name, v in st.items():
            if isinstance(v, torch.Tensor):
                tgt.setdefault(name, {})[fqn] = schema_of({fqn: v})[fqn]
            else:
                tgt_obj.setdefault(name, set()).add(fqn)
    kind = type(optimizer).__name__
    have, want = sorted({*src, *src_obj}), sorted({*tgt, *tgt_obj})
    if have != want:
        raise StateError(
            f"{full.path}: the checkpoint's optimizer state holds {have or 'nothing'} per parameter, "
            f"but this {kind} holds {want or 'nothing'}: an optimizer of another kind (or other "
            "settings, e.g. momentum) than the one saved. Build the optimizer the checkpoint was "
            "saved with, or load the model alone (optimizer=None)"
        )
    # param groups: hyperparameters by position
    gprefix = f"{optim_key}.param_groups."
    saved_groups: dict[int, dict[str, str]] = {}
    for k in _under(full.non_tensor, gprefix) + _under(list(full.schema), gprefix):
        idx, name = k[len(gprefix) :].split(".", 1)
        if name != "params":
            saved_groups.setdefault(int(idx), {})[name] = k
    groups = optim_sd["param_groups"]
    if len(saved_groups) != len(groups):
        raise StateError(
            f"{full.path}: the checkpoint's optimizer has {len(saved_groups)} param group(s), this "
            f"{kind} has {len(groups)}; build the optimizer with the same groups"
        )
    for i, g in enumerate(groups):
        names = sorted(n for n in g if n != "params")
        saved = saved_groups.get(i, {})
        if sorted(saved) != names:
            only_ckpt = sorted(set(saved) - set(names))
            only_opt = sorted(set(names) - set(saved))
            raise StateError(
                f"{full.path}: param group {i}: the checkpoint has hyperparameters {only_ckpt} that this "
                f"{kind} lacks, and lacks {only_opt}: an optimizer of another kind than the one saved"
            )
        out.hyper.append({n: saved[n] for n in names})
    # per state name: tensors follow the parameters' rules; scalars follow the recipe's first leaf
    for name, want_infos in tgt.items():
        fmt = f"{sprefix}{{}}.{name}"
        have_infos = src.get(name, {})
        if want_infos and all(len(i.shape) == 0 for i in want_infos.values()):
            recipes: dict[str, Node] = {}
            used: set[str] = set()
            sub = Report(source=full.path, target=kind)
            for fqn, info in want_infos.items():
                node = model_plan.recipes.get(fqn)
                leaves = node.leaves() if node is not None else [fqn]
                first = next((leaf for leaf in leaves if leaf in have_infos), None)
                if first is None:
                    sub.missing.append(fqn)
                    continue
                used.update(leaf for leaf in leaves if leaf in have_infos)
                got = have_infos[first]
                if tuple(got.shape) != tuple(info.shape) or got.dtype != info.dtype:
                    sub.dtype_mismatch.append(
                        Mismatch(key=fqn, model=f"{info.dtype} {list(info.shape)}", checkpoint=f"{got.dtype} {list(got.shape)}", recipe=first)
                    )
                    continue
                recipes[fqn] = Leaf(first, got.shape, got.dtype)
            sub.unexpected += sorted(set(have_infos) - used)
            sub.matched = len(recipes)
            sub.target_keys = len(want_infos)
            out.plans[name] = Plan(recipes=recipes, report=sub, target=want_infos)
        else:
            plan = build_plan(
                have_infos,
                want_infos,
                adapter,
                allow_missing=allow_missing,
                allow_unexpected=allow_unexpected,
                source_name=full.path,
                target_name=kind,
            )
            out.plans[name] = plan
        _merge(report, out.plans[name].report, fmt)
        report.source_keys += len(have_infos)
    for name, fqns in tgt_obj.items():
        have_fqns = src_obj.get(name, set())
        for fqn in fqns:
            node = model_plan.recipes.get(fqn)
            leaves = node.leaves() if node is not None else [fqn]
            first = next((leaf for leaf in leaves if leaf in have_fqns), None)
            if first is None:
                report.missing.append(f"{sprefix}{fqn}.{name}")
            else:
                out.objects[(fqn, name)] = f"{sprefix}{first}.{name}"
    return out


def load_state(
    src: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Stateful | Any] | None = None,
    adapter: Adapter | None = None,
    *,
    allow_missing: list[str] | None = None,
    allow_unexpected: list[str] | None = None,
    device: torch.device | str | None = None,
    init_buffers: InitFn | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> StateLoadReport:
    """Restore model (+ optimizer, + ``extra``) from the DCP folder ``src``; every rank calls it.

    Works on any mesh (FSDP2, TP, HSDP, uneven shards), and through ``adapter`` (checkpoint
    layout -> model layout) after a refactor; optimizer state follows the parameters' rules.
    ``extra`` entries are restored in place: ``Stateful`` objects through ``load_state_dict``,
    plain values by replacing ``extra[name]``. Strict: any missing or unexpected key (model or
    optimizer), an optimizer of another kind, or a missing extra raises on every rank before
    anything changes; ``allow_missing``/``allow_unexpected`` take key patterns to tolerate. A
    meta-device model is materialised (only without an optimizer: build the optimizer on
    real parameters).
    """
    t0 = time.perf_counter()
    src = os.fspath(src)
    rank, world = rank_and_world(process_group)
    extra = extra if extra is not None else {}
    error: SdadaptError | None = None
    had_state = optimizer is not None and bool(optimizer.state)
    full = plan = oplan = report = None
    model_sd: dict[str, Any] = {}
    optim_sd: dict[str, Any] = {}
    model_key = ""
    try:
        if not os.path.isdir(src):
            raise SourceError("no such DCP checkpoint folder", path=src)
        full = DCPSource(src, subtree="")
        model_key, optim_key = _detect_keys(full)
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
            model_sd, optim_sd = _get_state(model, optimizer)
            model_sd = {k: v for k, v in model_sd.items() if isinstance(v, torch.Tensor)}
        else:
            model_sd = model_state_dict(model)
        plan = build_plan(
            mschema,
            schema_of(model_sd),
            adapter,
            non_tensor=mnon,
            allow_missing=allow_missing,
            allow_unexpected=allow_unexpected,
            source_name=src,
            target_name=type(model).__name__,
        )
        report = plan.report.model_copy(deep=True)
        if optimizer is not None:
            assert optim_key is not None
            oplan = _plan_optimizer(
                full, optim_key, optim_sd, plan, adapter, report, optimizer, allow_missing, allow_unexpected
            )
        for name in extra:
            stored = list(full.schema) + full.non_tensor
            if name not in stored and not any(k.startswith(name + ".") for k in stored):
                raise StateError(
                    f"{src}: the checkpoint has no entry {name!r} for extra state; it holds "
                    f"{sorted({k.split('.', 1)[0] for k in stored})}"
                )
        if not report.ok:
            raise PlanError(report)
        if optimizer is None:
            check_buffers(model, init_buffers)
    except SdadaptError as e:
        error = e
    try:
        agree(error, process_group)
    except SdadaptError:
        if optimizer is not None and not had_state:
            optimizer.state.clear()  # undo the lazy state get_state_dict created
        raise
    assert full is not None and plan is not None and report is not None

    if optimizer is None and materialize(model, choose_device(model, device), init_buffers):
        model_sd = model_state_dict(model)
    mfmt = f"{model_key}.{{}}" if model_key else "{}"
    n_model = _load_plan(plan, {k: model_sd[k] for k in plan.recipes}, _Namespace(full, mfmt), process_group)
    n_optim = 0
    if optimizer is not None:
        assert oplan is not None
        sprefix = f"{_detect_keys(full)[1]}.state."
        for name, p in oplan.plans.items():
            wanted = {fqn: optim_sd["state"][fqn][name] for fqn in p.recipes}
            n_optim += _load_plan(p, wanted, _Namespace(full, f"{sprefix}{{}}.{name}"), process_group)
        for (fqn, name), key in oplan.objects.items():
            optim_sd["state"][fqn][name] = full.read_object(key)
        for g, hyper in zip(optim_sd["param_groups"], oplan.hyper):
            for name, key in hyper.items():
                g[name] = full.read_object(key) if key in full.non_tensor else full.read(key, full_box(full.schema[key].shape))
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    else:
        copy_back_if_detached(model, model_sd)
    if extra:
        try:
            dcp.load(
                extra,
                storage_reader=FileSystemReader(src),
                planner=SafeLoadPlanner(allow_partial_load=True),
                process_group=process_group,
                no_dist=not is_distributed(),
            )
        except CheckpointException as e:
            raise LoadError(f"restoring extra state {sorted(extra)} from {src} failed: {e}") from None
    rep = StateLoadReport(
        rank=rank,
        world_size=world,
        source=src,
        model_keys=n_model,
        optimizer_keys=n_optim,
        optimizer_state_names=sorted(oplan.plans) if oplan is not None else [],
        param_groups=len(oplan.hyper) if oplan is not None else 0,
        extra=sorted(extra),
        saved_with=full.record,
        seconds=time.perf_counter() - t0,
        report=report,
    )
    log.info("%s", rep.format())
    return rep


def _load_plan(plan: Plan, wanted: dict[str, torch.Tensor], source: Source, group: dist.ProcessGroup | None) -> int:
    reader = AdaptedStorageReader(plan, source)
    try:
        dcp.load(wanted, storage_reader=reader, planner=DefaultLoadPlanner(), process_group=group, no_dist=not is_distributed())
    except CheckpointException as e:  # a BaseException: turn it into ours
        raise LoadError(f"reading {source.path} failed: {e}") from None
    return len(wanted)


__all__ = ["StateError", "StateLoadReport", "load_state", "save_state"]
