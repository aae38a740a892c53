"""``sdadapt.diff``: the report of a plan, without loading anything."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from .._plan.adapter import Adapter
from .._plan.plan import KeyPatterns, PipelineStage, key_patterns, vacant_modules
from .._plan.registry import family_adapter, shipped_hint
from .._plan.report import Report
from .._plan.target import model_state_dict, schema_of
from .._transaction.args import check_not_a_model
from .._transaction.options import Options
from .._transaction.steps import derive_adapter, family_hint, open_checkpoint, plan_schema
from ..errors import SdadaptError
from ..sources import Source, TensorInfo, open_source

if TYPE_CHECKING:
    from typing import Unpack  # Python 3.11; annotations only, the package runs on 3.10

log = logging.getLogger(__name__)

Target = nn.Module | str | os.PathLike[str] | Source | dict[str, TensorInfo]


def target_schema(target: Target, *, subtree: str | None = None) -> tuple[dict[str, TensorInfo], str]:
    """Schema and display name of a model, a checkpoint path/source, or a ready schema."""
    if isinstance(target, nn.Module):
        return schema_of(model_state_dict(target)), type(target).__name__
    if isinstance(target, dict):
        return target, "schema"
    with open_source(target, subtree=subtree) as s:
        return dict(s.schema), s.remote_url() or s.path


def diff(
    target: Target,
    src: str | os.PathLike[str] | Source,
    adapter: Adapter | str | None = None,
    *,
    subtree: str | None = None,
    pipeline_stage: bool = False,
    dtype: str | torch.dtype | None = None,
    **patterns: Unpack[KeyPatterns],
) -> Report:
    """Compare checkpoint ``src`` (through ``adapter``) with ``target``; reads headers only.
    ``pipeline_stage=True``: ``target`` is one pipeline stage, and the checkpoint keys of the
    other stages are allowed (see :func:`sdadapt.load`; a schema or checkpoint target has no
    ``None`` module slots, so only the index rule applies to it). ``dtype``: as in
    :func:`sdadapt.load` (``"model"``: every tensor converted to the target's dtype).

    ``adapter`` is an :class:`Adapter` or a string resolved like the CLI's ``--adapter``
    (a shipped name with options read from ``src``'s folder, ``file.py:ATTR``, ``module:ATTR``,
    ``.json``).

    Args:
        target: what to compare with: a model, a checkpoint path, or a schema
            (``{key: TensorInfo}``).
        src: the checkpoint path, Hub id or :class:`~sdadapt.sources.Source`.
        adapter: an :class:`Adapter` or a spec string, as in :func:`sdadapt.load`.
        subtree: the nested dict of a ``torch.save`` file or DCP folder to read.
        pipeline_stage: ``target`` is one pipeline stage.
        dtype: ``"model"`` or a dtype to convert every tensor to.
        **patterns: ``allow_missing=`` / ``allow_unexpected=``: key patterns of the target that the
            checkpoint may lack / of the checkpoint that the target may lack (:class:`KeyPatterns`).

    Returns:
        The plan's :class:`~sdadapt.reports.Report`: missing, unexpected and mismatched keys
        (``report.ok`` when everything lines up; ``str(report)`` is its text).

    Example::

        report = sdadapt.diff(model, "ckpt/model.safetensors", "llama")
        assert report.ok, report.format()
    """
    check_not_a_model("sdadapt.diff(target, src, adapter=None, ...)", src, other=target)
    model = target if isinstance(target, nn.Module) else None
    options = Options.of(src, adapter=adapter, subtree=subtree, pipeline_stage=pipeline_stage, dtype=dtype,
                         **key_patterns("sdadapt.diff", patterns))  # fmt: skip
    with open_checkpoint(src, subtree) as source:  # **open**, once for the call
        resolved = derive_adapter(adapter, source, model)  # **adapter**
        schema, name = target_schema(target)
        stage = PipelineStage.of(schema, vacant_modules(model) if model is not None else ()) if pipeline_stage else None
        # **plan**, aimed at the target's names
        report = plan_schema(schema, source, resolved, options, target_name=name, stage=stage)[1].report
        if resolved is None and not report.ok:  # the family's shipped adapter, if it finds more keys
            report = report.model_copy(update={"suggestion": family_hint(report, source, schema, options, model)})
    return report


def family_suggestion(src: object, fits: Callable[[str], bool]) -> str | None:
    """The shipped adapter for the family the checkpoint's ``config.json`` names, as a hint line
    (:func:`~sdadapt._plan.registry.shipped_hint`), with whether ``fits(name)`` (a plan with it
    lines everything up); ``None`` when no shipped adapter is for that family."""
    path = getattr(src, "path", src)
    if not isinstance(path, (str, os.PathLike)):
        return None
    found = family_adapter(path)
    if found is None:
        return None
    try:
        ok: bool | None = fits(found[0])
    except SdadaptError as e:  # its options cannot be read from the folder, or it does not apply
        log.debug("the shipped adapter %s does not plan for %s: %s", found[0], path, e)
        ok = False
    return shipped_hint(path, ok)
