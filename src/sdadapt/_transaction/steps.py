"""The named steps the public operations compose, in the order a call takes them.

1. **resolve**: a Hub id becomes its local snapshot folder, agreed on every rank
   (:meth:`~sdadapt._transaction.transaction.Transaction.resolve`);
2. **open**: the checkpoint is opened once for the whole call (:func:`open_checkpoint`); in a
   distributed load the group's first rank keeps the source it opened to record the headers,
   and the other ranks open theirs from that record (:mod:`sdadapt._transaction.headers`);
3. **adapter**: the ``adapter`` argument becomes an :class:`~sdadapt.Adapter`
   (:func:`derive_adapter`; :func:`plan_model` derives it itself) from that open source: a
   shipped name reads its options from the source's folder (config files) and the source's
   schema (key names, stored dtypes), a transformers model's adapter is derived from the
   source's schema;
4. **plan**: the source's schema, the target's and the adapter give the plan
   (:func:`plan_model`, :func:`plan_schema`), then :func:`judge` refuses it or warns; a load
   whose plan would equal the last load's reuses it (:class:`LastPlan`, below);
5. **run**: the transaction reads, checks and commits
   (:meth:`~sdadapt._transaction.transaction.Transaction.run`).

No step after **open** opens the checkpoint again: each takes the open
:class:`~sdadapt.sources.Source`, so its headers are read once per call (once per job in a
distributed load). ``load``, ``plan_load``, ``diff``, ``convert`` and ``load_state`` are
compositions of these steps.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from .._plan.adapter import Adapter, with_dtype
from .._plan.plan import PipelineStage, Plan, build_plan, vacant_modules
from .._plan.report import Report
from .._plan.target import load_targets, renames_nothing, schema_of
from ..errors import PlanError, SdadaptError
from ..sources import Fingerprint, HeaderRecord, Source, TensorInfo, fingerprint, open_source, replaying_headers
from .options import Options

log = logging.getLogger("sdadapt")


def open_checkpoint(src: str | os.PathLike[str] | Source, subtree: str | None = None, record: HeaderRecord | None = None) -> Source:
    """**open**: the checkpoint ``src`` as a :class:`Source`, opened once for the call (headers
    only); an open source is returned as it is. ``record``: headers another rank read for the
    job, parsed here instead of reading the files (:mod:`sdadapt.sources._headers`)."""
    with replaying_headers(record):
        return open_source(src, subtree=subtree)


def _adapter_or_none(spec: Adapter | str | os.PathLike[str] | None, source: Source, model: nn.Module | None) -> Adapter | None:
    """:func:`sdadapt._plan.resolve.adapter_or_none`, whose module (the resolving of names, files
    and modules) only an adapter not given as an :class:`Adapter` imports."""
    if isinstance(spec, Adapter):
        return spec
    from .._plan.resolve import adapter_or_none  # noqa: PLC0415 - see the docstring

    return adapter_or_none(spec, source, model)


def derive_adapter(spec: Adapter | str | os.PathLike[str] | None, source: Source, model: nn.Module | None = None) -> Adapter | None:
    """**adapter**: ``spec`` (``load``'s ``adapter`` argument) as an :class:`Adapter`, from the
    open ``source``: a shipped name's options from the config files of the source's folder and
    from its schema, :func:`sdadapt.hf_adapter` (no ``spec``, a transformers ``model``) from its
    schema; nothing here opens the checkpoint again. ``None`` stays ``None`` otherwise. A
    failure closes ``source`` (a step between **open** and **plan** leaves no file open)."""
    try:
        return _adapter_or_none(spec, source, model)
    except BaseException:
        source.close()
        raise


@dataclass
class Planned:
    """What :func:`plan_model` hands on.

    Attributes:
        source: the open source the plan reads (a LoRA's tensors joined to it, ``options.lora``).
        plan: the plan.
        targets: the model's state dict it planned against, the model's own tensors
            (:func:`~sdadapt._plan.target.load_targets`).
        adapter: the adapter, as derived from the open source.
        plain: whether ``targets`` is the model's ``state_dict()`` as it is
            (:func:`~sdadapt._plan.target.renames_nothing`): materialising changes no module, so
            a load reads the targets again after it without asking.
        files: the fingerprints of ``source``'s files where they were taken for the plan's key
            (:func:`plan_key`), so that the transaction checks those (``None``: not taken).

    Example::

        planned = plan_model(model, open_checkpoint("ckpt/"), options)
        with planned.source:
            assert planned.plan.report.ok
    """

    source: Source
    plan: Plan
    targets: dict[str, torch.Tensor]
    adapter: Adapter | None
    plain: bool
    files: Fingerprint | None = None


def plan_model(model: nn.Module, source: Source, options: Options, reuse: LastPlan | None = None,
               modules: list[nn.Module] | None = None) -> Planned:  # fmt: skip
    """**adapter** and **plan** against a model (:class:`Planned`). The adapter is
    ``options.adapter`` derived from the open ``source`` (:func:`derive_adapter`); the plan is
    as :func:`plan_schema` plans. ``reuse``: the process's last plan, returned instead where this
    one's key equals its own, else replaced by this one (:class:`LastPlan`). ``modules``:
    ``list(model.modules())``, where the caller has it. On failure ``source`` is closed."""
    try:
        adapter = _adapter_or_none(options.adapter, source, model)
        plain = renames_nothing(model, modules)
        state_dict = load_targets(model, plain)
        stage = PipelineStage.of(state_dict, vacant_modules(model)) if options.pipeline_stage else None
        target, name = schema_of(state_dict), type(model).__name__
        key, files = None, None
        if reuse is not None and not source.remote_url() and reusable(options):  # object storage's files are local mirrors
            files = fingerprint(source.files())
            key = plan_key(type(source).__qualname__, files, adapter, target, name, options)
        plan = reuse.get(key) if reuse is not None else None
        if plan is None:
            source, plan = plan_schema(target, source, adapter, options, target_name=name, stage=stage)
            if reuse is not None:
                reuse.keep(key, plan)
    except BaseException:
        source.close()
        raise
    return Planned(source, plan, state_dict, adapter, plain, files)


def plan_schema(
    target: dict[str, TensorInfo], source: Source, adapter: Adapter | None, options: Options, *, target_name: str,
    stage: PipelineStage | None = None,
) -> tuple[Source, Plan]:  # fmt: skip
    """**plan** against a schema (a model's, a checkpoint's or one ``diff`` is given):
    ``(source, plan)``, the plan of the open ``source`` through ``adapter``. A shipped adapter
    is aimed at the target's names (torchtitan's current ones, :mod:`sdadapt._plan.titan_names`).
    With ``options.lora``, the PEFT adapter's tensors join the source (the source returned is the
    joined one, closed again if planning fails) and its merge rule goes first
    (:mod:`sdadapt.rules._lora`)."""
    # the training state nothing fills is allowed missing
    planned, state = adapter, list[str]()
    if options.shipped and adapter is not None:
        from .._plan.titan_names import for_plan  # noqa: PLC0415 - a shipped adapter's only: aimed at the model's names

        planned, state = for_plan(adapter, True, source.schema, source.non_tensor, target)
    planned, name = with_dtype(planned, options.dtype), options.name
    if options.lora is not None:
        from ..rules import open_peft_lora  # imported only by a load that merges a LoRA

        peft = open_peft_lora(options.lora)
        source, name = peft.join(source), f"{name} + LoRA {os.fspath(options.lora)}"
        planned = Adapter([peft.rule, *(planned.rules if planned else [])], name=planned.name if planned else "lora",
                          stages=[s + 1 for s in planned.stages] if planned else [])  # fmt: skip
    try:
        return source, build_plan(source.schema, target, planned, non_tensor=source.non_tensor, source_name=name, target_name=target_name,
                                  pipeline_stage=stage, allow_missing=[*options.allow_missing, *state],
                                  allow_unexpected=list(options.allow_unexpected), allow_resized=list(options.allow_resized))  # fmt: skip
    except BaseException:
        if options.lora is not None:
            source.close()
        raise


def judge(plan: Plan, strict: bool, hint: Callable[[], str | None] | None = None) -> None:
    """After **plan**: a plan with problems raises :class:`~sdadapt.errors.PlanError` when
    ``strict``, else is logged (the load goes on with what lines up). ``hint``: the report's
    suggestion line (:func:`family_hint`), asked for only when the plan has problems."""
    if plan.report.ok:
        return
    suggestion = hint() if hint is not None else None
    report = plan.report.model_copy(update={"suggestion": suggestion}) if suggestion else plan.report
    if strict:
        raise PlanError(report)
    log.warning("loading with problems (strict=False):\n%s", report.format())


def family_hint(report: Report, source: Source, target: dict[str, TensorInfo], options: Options,
                model: nn.Module | None = None) -> str | None:  # fmt: skip
    """The line naming the shipped adapter of the family the checkpoint's ``config.json`` names,
    for a ``report`` with problems made with no adapter given; checked before it is offered: a
    plan with that adapter must find more of the target's keys by name than ``report`` did (a
    hint that finds fewer makes things worse). Never for a transformers ``model``, whose adapter
    comes from transformers' own mapping (a shipped one aims at another layout), nor with a
    LoRA. ``None`` when no hint passes."""
    if report.ok or options.adapter is not None or options.lora is not None:
        return None
    from .._plan.hf_models import is_hf_model  # the transformers side, off a plain load's import path

    if model is not None and is_hf_model(model):
        return None
    from .._plan.registry import family_adapter, shipped_hint  # noqa: PLC0415 - a report with problems only

    family = family_adapter(source.path) if isinstance(source.path, str) else None
    if family is None:
        return None
    name = family[0]
    try:
        theirs = plan_schema(target, source, _adapter_or_none(name, source, model), replace(options, adapter=name),
                             target_name=report.target)[1].report  # fmt: skip
    except SdadaptError as e:  # its options cannot be read from the folder, or it does not apply
        log.debug("the shipped adapter %s does not plan for %s: %s", name, options.name, e)
        return None
    if theirs.found <= report.found:
        log.debug("the shipped adapter %s finds %d keys, no more than %d: not suggested", name, theirs.found, report.found)
        return None
    return shipped_hint(source.path, theirs.ok)


# ---------------------------------------------------------------------------- the last plan, reused
@dataclass(frozen=True)
class PlanKey:
    """Everything a load's plan is made from (see :class:`LastPlan`); equal keys, equal plans."""

    source: tuple[str, str | None, tuple[tuple[str, tuple[int, ...]], ...]]  # kind, subtree, each file's fingerprint
    target: tuple[tuple[str, TensorInfo], ...]
    target_name: str
    adapter: Any
    options: tuple[Any, ...]


def plan_options(options: Options) -> tuple[Any, ...]:
    """The options of ``options`` that change a plan (the init hooks do not: checked every load)."""
    o = options
    return (o.name, o.shipped, o.allow_missing, o.allow_unexpected, o.allow_resized, str(o.dtype), o.strict, o.checksums)


def reusable(options: Options) -> bool:
    """Whether a load with ``options`` may reuse a plan: not with a LoRA, nor into a pipeline
    stage (their plans depend on more than :class:`PlanKey` holds)."""
    return options.lora is None and not options.pipeline_stage


def plan_key(kind: str, files: Fingerprint, adapter: Adapter | None, target: Mapping[str, TensorInfo], target_name: str,
             options: Options) -> PlanKey | None:  # fmt: skip
    """The key of a load's plan from a source of type ``kind`` whose ``files`` have these
    fingerprints, or ``None`` where it is never reused (see :class:`LastPlan`)."""
    if not reusable(options) or not files:
        return None
    try:
        rules = adapter.model_dump(mode="json") if adapter is not None else None
    except Exception:  # noqa: BLE001 - a rule JSON cannot hold (a function): never reused
        return None
    return PlanKey((kind, options.subtree, tuple(files.items())), tuple(target.items()), target_name, rules, plan_options(options))


class LastPlan:
    """The plan (and its agreement's parts) of the last load of this process, under its key,
    handed to the next load of the same process that would plan the same.

    A process that loads one checkpoint into models of one layout again and again (a benchmark's
    repeats, a model rebuilt after a failure, an evaluation loop) makes the same plan every time.
    It keeps the plan of the process's last load (one plan: memory stays bounded)
    and gives it back only when everything the plan is made from is equal (:class:`PlanKey`):

    - the source: its kind, the subtree read, and every file's identity (path, size, mtime_ns,
      inode, device: what the load checks again right before reading);
    - the model's layout: the target schema, in order (every key's global shape, dtype, placements
      and mesh dims) and the model's class name (the report names it);
    - the adapter as resolved from the open source, compared as its JSON (an adapter holding
      something JSON cannot (a rule of one's own with a function) is never reused), and the
      options that change a plan (:func:`plan_options`).

    A reused plan is the validated plan of an equal load: its keys were checked strictly then (only
    plans whose report has no problem are kept). Every other step still runs on every load: the
    headers are read and the files fingerprinted, the model's tensors walked, the buffer and
    missing-key checks made, and every rank takes part in the plan's agreement with the reused
    plan's parts. Planning runs no collective, so ranks that differ in hit or miss still meet at
    the same agreement, and disagree exactly where fresh plans would.

    Not kept: loads of an open :class:`~sdadapt.sources.Source` object, of object storage, with a
    LoRA, or into a pipeline stage (their plans depend on more than the key holds).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: PlanKey | None = None
        self._plan: Plan | None = None
        self._parts: Mapping[str, Any] | None = None
        self.hits = 0  # loads that reused the kept plan (for tests and probes)

    def get(self, key: PlanKey | None) -> Plan | None:
        """The kept plan where ``key`` equals its key, else ``None``."""
        if key is None:
            return None
        with self._lock:
            if self._plan is None or self._key != key:
                return None
            self.hits += 1
            return self._plan

    def keep(self, key: PlanKey | None, plan: Plan) -> None:
        """Keep ``plan``, made for ``key``, in place of the last one where its report has no
        problem; else (or ``key`` ``None``) forget the last one."""
        with self._lock:
            ok = key is not None and plan.report.ok
            self._key, self._plan, self._parts = (key, plan, None) if ok else (None, None, None)

    def parts(self, plan: Plan, make: Callable[[], Mapping[str, Any]]) -> Mapping[str, Any]:
        """The agreement's parts of ``plan``: ``make()``, kept with the plan where it is the kept
        one (equal keys give equal parts: the adapter, the plan and the options are the key's)."""
        with self._lock:
            if plan is self._plan and self._parts is not None:
                return self._parts
        parts = make()
        with self._lock:
            if plan is self._plan:
                self._parts = parts
        return parts

    def clear(self) -> None:
        """Forget the kept plan."""
        with self._lock:
            self._key, self._plan, self._parts = None, None, None


LAST_PLAN = LastPlan()
