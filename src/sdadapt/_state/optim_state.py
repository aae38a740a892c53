"""The optimizer part of :func:`sdadapt.load_state`: planning its state like the parameters,
and giving an optimizer that has taken no step the state tensors to restore into.

Every per-parameter state of one name (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``...) is
planned like the parameters, by applying the same adapter to ``{param fqn: state tensor}``, so
the ``exp_avg`` of a fused ``wqkv`` is fused the way the weight is; a rule that changes values
says what it does to each kind of state (``Adapter.for_optimizer_state``: an affine rule scales
moments as the gradient, never shifts them). Scalar state (Adam's 0-d
``step``) is carried as is, taken from the first source parameter of the target parameter's
recipe. Hyperparameters (``lr``, ``betas``...) come from the checkpoint's param groups, matched
by position.

A pipeline stage (``load_state(..., pipeline_stage=True)``) holds the optimizer of its own
parameters only: the checkpoint's state of other stages' parameters is set aside by the model's
:class:`~sdadapt._plan.plan.PipelineStage` (tensor state planned with it, as the parameters are) and,
for scalar state, by the source keys the model plan gave to other stages
(``Plan.other_stage_sources``), so a refactor's renames are followed there too.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any

import torch

from .._base.schema import TensorInfo
from .._plan.adapter import Adapter
from .._plan.plan import PipelineStage, Plan, build_plan
from .._plan.report import Mismatch, Report
from .._plan.target import schema_of
from .._recipes.nodes import Leaf, Node
from .._transaction.options import Options
from ..errors import StateError
from ..sources import DCPSource


class OptimPlan:
    """The optimizer part of a restore: one plan per state name, plus param-group values."""

    def __init__(self) -> None:
        self.plans: dict[str, Plan] = {}  # state name -> plan over param fqns
        self.objects: dict[tuple[str, str], str] = {}  # (fqn, name) -> stored key (non-tensor state)
        self.hyper: list[dict[str, Any]] = []  # per group: hyperparameters to set


def _under(keys: list[str], prefix: str) -> list[str]:
    return [k for k in keys if k.startswith(prefix)]


_TOKEN = re.compile(r"[A-Za-z0-9_.:/-]+")


def stored_names(m: Mismatch, fmt: str, leaves: Collection[str], key: bool = True) -> Mismatch:
    """Mismatch ``m`` with the checkpoint keys its recipe reads (those of ``leaves`` it names)
    written as stored (``fmt``: ``optim.state.{}.exp_avg``, ``model.{}``), and its key too
    when ``key``."""
    recipe = _TOKEN.sub(lambda x: fmt.format(x.group(0)) if x.group(0) in leaves else x.group(0), m.recipe)
    return m.model_copy(update={"key": fmt.format(m.key) if key else m.key, "recipe": recipe})


def _merge(into: Report, other: Report, fmt: str, leaves: Collection[str]) -> None:
    """Add ``other``'s problems to ``into`` with keys renamed by ``fmt`` (``optim.state.{}.exp_avg``)."""
    into.missing += [fmt.format(k) for k in other.missing]
    into.unexpected += [fmt.format(k) for k in other.unexpected]
    into.non_tensor += [fmt.format(k) for k in other.non_tensor]
    into.shape_mismatch += [stored_names(m, fmt, leaves) for m in other.shape_mismatch]
    into.dtype_mismatch += [stored_names(m, fmt, leaves) for m in other.dtype_mismatch]
    seen = {(i.index, i.key, i.message) for i in into.rule_issues}
    for it in other.rule_issues:
        if (it.index, it.key, it.message) not in seen:
            into.rule_issues.append(it.model_copy(update={"key": fmt.format(it.key) if it.key else None}))
    into.allowed_missing += [fmt.format(k) for k in other.allowed_missing]
    into.allowed_unexpected += [fmt.format(k) for k in other.allowed_unexpected]
    into.matched += other.matched
    into.target_keys += other.target_keys


def plan_optimizer(
    full: DCPSource,
    optim_key: str,
    optim_sd: dict[str, Any],
    model_plan: Plan,
    adapter: Adapter | None,
    report: Report,
    optimizer: torch.optim.Optimizer,
    options: Options,
    pipeline_stage: PipelineStage | None = None,
) -> OptimPlan:
    """Plan the optimizer's state from the checkpoint's entries under ``optim_key``, following
    ``model_plan``'s recipes; problems are added to ``report``. ``pipeline_stage``: the model is
    one pipeline stage, and the state of other stages' parameters is allowed and not read."""
    out = OptimPlan()
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
                    model, ckpt = f"{info.dtype} {list(info.shape)}", f"{got.dtype} {list(got.shape)}"
                    sub.dtype_mismatch.append(Mismatch(key=fqn, model=model, checkpoint=ckpt, recipe=first))
                    continue
                recipes[fqn] = Leaf(first, got.shape, got.dtype)
            unused = set(have_infos) - used
            elsewhere = sorted(unused & model_plan.other_stage_sources)  # empty unless a pipeline stage
            sub.allowed_unexpected += elsewhere
            sub.unexpected += sorted(unused - model_plan.other_stage_sources)
            sub.matched = len(recipes)
            sub.target_keys = len(want_infos)
            out.plans[name] = Plan(recipes=recipes, report=sub, target=want_infos, other_stages=elsewhere)
        else:
            plan = build_plan(
                have_infos,
                want_infos,
                adapter.for_optimizer_state(name) if adapter is not None else None,
                allow_missing=list(options.allow_missing),
                allow_unexpected=list(options.allow_unexpected),
                source_name=full.path,
                target_name=kind,
                pipeline_stage=pipeline_stage,
            )
            out.plans[name] = plan
        _merge(report, out.plans[name].report, fmt, have_infos.keys())
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


def init_state(optimizer: torch.optim.Optimizer) -> None:
    """Give an optimizer that has taken no step its per-parameter state (``exp_avg``,
    ``exp_avg_sq``, ``step``...), so that every moment the checkpoint holds has a tensor to be
    restored into. As torch's ``_init_optim_state`` (one ``step`` with zero gradients and
    ``lr=0``, which leaves the parameters as they are), but also when gradients already exist
    (torch then skips the step and the state stays empty): they are set aside and put back."""
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    grads = [p.grad for p in params]
    lrs = [g.get("lr") for g in optimizer.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p) if p.requires_grad else None
        for g, lr in zip(optimizer.param_groups, lrs, strict=True):
            if lr is not None:
                g["lr"] = torch.tensor(0.0) if isinstance(lr, torch.Tensor) else 0.0
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs, strict=True):
            if lr is not None:
                g["lr"] = lr
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
