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
   (:func:`plan_model`, :func:`plan_schema`), then :func:`judge` refuses it or warns;
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
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from .._plan.adapter import Adapter, with_dtype
from .._plan.plan import PipelineStage, Plan, build_plan, vacant_modules
from .._plan.report import Report
from .._plan.target import model_state_dict, schema_of
from ..errors import PlanError, SdadaptError
from ..sources import HeaderRecord, Source, TensorInfo, open_source, replaying_headers
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


def plan_model(model: nn.Module, source: Source, options: Options) -> tuple[Source, Plan, dict[str, torch.Tensor], Adapter | None]:
    """**adapter** and **plan** against a model: ``(source, plan, the model's state dict it
    planned against, the adapter)``. The adapter is ``options.adapter`` derived from the open
    ``source`` (:func:`derive_adapter`); the plan is as :func:`plan_schema` plans. On failure
    ``source`` is closed."""
    try:
        adapter = _adapter_or_none(options.adapter, source, model)
        state_dict = model_state_dict(model)
        stage = PipelineStage.of(state_dict, vacant_modules(model)) if options.pipeline_stage else None
        source, plan = plan_schema(schema_of(state_dict), source, adapter, options, target_name=type(model).__name__, stage=stage)
    except BaseException:
        source.close()
        raise
    return source, plan, state_dict, adapter


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
