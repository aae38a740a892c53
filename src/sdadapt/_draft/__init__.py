"""``sdadapt.draft``: infer a first adapter from a checkpoint and a model (headers, then numbers).

    d = sdadapt.draft(model, "ckpt_dir")       # or a checkpoint path / schema as the target
    summary = d.format()                        # proposals, questions, what is still unmatched
    open("my_adapter.py", "w").write(d.module)  # a readable adapter module, ADAPTER = ...

How: both schemas are cut into segments, numeric segments become index captures
(:mod:`.segments`); blocks are paired by count and parameter count, and tensors inside paired
blocks by shape and name evidence (:mod:`.match`); matches become rules with their evidence
(:mod:`.proposals`), written as a module (:mod:`.render`). The checkpoint's ``config.json``
(:mod:`.config`) gives head counts, the family and quantization to the value-level questions
(:mod:`.questions`). The draft is then checked with the same planner as ``sdadapt diff`` and
what is still unmatched is reported. When the checkpoint's ``config.json`` names a class the
installed transformers has and the target is a model, the open choices are then settled by
experiment (:mod:`.numeric`) unless ``reference=None``. Nothing is guessed silently: weak evidence, and
same-shaped tensors whose mapping the evidence cannot settle, are marked uncertain with the
alternative; what shapes cannot show (rotary row order of weights, biases and per-head norms,
norm offsets, FP8 scales, the per-rank layout of fused tensors) is asked as a question with
the rules to enable.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict
from torch import nn

from .._base.summary import Summarized
from .._export import plan_outputs
from .._plan.adapter import Adapter
from .._plan.hf_quant import config_path, release_dequant
from .._plan.plan import build_plan
from .._plan.report import Report
from .._plan.resolve import adapter_or_none
from .._tools import Target, target_schema
from .._transaction import check_not_a_model
from ..rules import StripPrefix
from ..sources import Source, TensorInfo, open_source
from .buffers import Check
from .config import FP8_SCALE_SUFFIX, NO_CONFIG, read_facts
from .match import match_trees
from .proposals import Proposals, build_proposals
from .render import comment, render_module, rule_code
from .segments import build_tree

log = logging.getLogger(__name__)

UNCERTAIN_BELOW = 0.6
RELATED_FRACTION = 0.5

__all__ = ["Draft", "Proposal", "Question", "draft"]


class Proposal(BaseModel):
    """One proposed step: its rules (as code), the keys involved, and why."""

    kind: str  # rename | split | fuse | stack | unstack | transpose | drop | tie | cast | strip_prefix
    sources: list[str]
    targets: list[str]
    code: list[str]
    confidence: float
    uncertain: bool
    evidence: list[str]
    section: str
    keys: int


class Question(BaseModel):
    """A choice shapes cannot show; ``suggestion`` holds rules to add if the answer is yes."""

    about: list[str]
    question: str
    suggestion: list[str]


class Draft(Summarized, BaseModel):
    """The result of :func:`draft`: proposals, questions, the adapter module and the remaining diff.

    Attributes:
        source: the checkpoint.
        target: the target.
        related: whether the two share enough to propose a mapping.
        summary: lines that sum the draft up.
        proposals: the proposed rules, each with its evidence (``uncertain`` ones flagged).
        questions: what the headers cannot settle, with suggested rules.
        adapter: the drafted :class:`~sdadapt.Adapter`.
        module: the source of a Python module defining it (``ADAPTER``), to edit and keep.
        report: the :class:`Report` of the drafted adapter.

    Example::

        d = sdadapt.draft(model, "ckpt/model.safetensors")
        summary = str(d)
        assert d.report.ok or d.questions
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    source: str
    target: str
    related: bool
    summary: list[str]
    proposals: list[Proposal]
    questions: list[Question]
    adapter: Adapter
    module: str
    report: Report

    @property
    def uncertain(self) -> list[Proposal]:
        return [p for p in self.proposals if p.uncertain]

    def format(self, max_rows: int = 12) -> str:
        lines = [f"draft: {self.source} -> {self.target}"]
        lines += [f"  {s}" for s in self.summary]
        if self.related:
            kinds: dict[str, int] = {}
            for p in self.proposals:
                kinds[p.kind] = kinds.get(p.kind, 0) + 1
            lines.append(
                f"proposed {len(self.adapter.rules)} rules ("
                + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
                + f"); {len(self.uncertain)} uncertain, {len(self.questions)} question(s)"
            )
            for p in self.uncertain[:max_rows]:
                lines.append(f"  UNCERTAIN {p.kind} {', '.join(p.sources) or '-'} -> {', '.join(p.targets) or '-'}: "
                             f"{'; '.join(p.evidence)}")
            for q in self.questions:
                lines.append(f"  DECIDE {', '.join(q.about[:4])}: {q.question}")
        if not self.related:
            r = self.report
            lines.append(f"without an adapter: {r.matched} of {r.target_keys} model keys line up, "
                         f"{len(r.missing)} missing, {len(r.unexpected)} unexpected")
            return "\n".join(lines)
        lines.append("remaining diff with the drafted adapter:")
        lines += ["  " + line for line in self.report.format(max_rows=max_rows).splitlines()]
        return "\n".join(lines)


def _common_prefix(keys: list[str]) -> str:
    if not keys:
        return ""
    segs = keys[0].split(".")[:-1]
    n = len(segs)
    for k in keys[1:]:
        other = k.split(".")
        i = 0
        while i < n and i < len(other) - 1 and other[i] == segs[i]:
            i += 1
        n = i
        if n == 0:
            return ""
    return ".".join(segs[:n]) + "." if n else ""


def _source_schema(src: Any, subtree: str | None) -> tuple[dict[str, TensorInfo], list[str], str]:
    if isinstance(src, dict):
        return dict(src), [], "schema"
    source = open_source(src, subtree=subtree)
    try:
        return dict(source.schema), list(source.non_tensor), source.path
    finally:
        if not isinstance(src, Source):
            source.close()


def draft(
    target: Target,
    src: str | os.PathLike[str] | Source | dict[str, TensorInfo],
    adapter: Adapter | str | None = None,
    *,
    subtree: str | None = None,
    reference: str | Callable[[dict[str, Any]], nn.Module] | None = "auto",
    layers: int = 2,
    init_buffers: Callable[[nn.Module], None] | None = None,
) -> Draft:
    """Propose an adapter from checkpoint ``src`` to ``target`` (a model, a checkpoint path or a
    schema) from headers; then, by default, settle what headers cannot show by a numerical check
    on a small copy of the model against the checkpoint's own transformers class (``reference``).
    See :class:`Draft`.

    ``adapter`` (an :class:`Adapter`, or a name, ``file.py:ATTR``, ``module:ATTR`` or ``.json``
    resolved like the CLI's ``--adapter``) is a start: the checkpoint is taken as that
    adapter maps it (rules that need the model, such as ``pad`` to the model's size, cannot be
    applied here), the proposals cover what remains, and the drafted adapter runs its rules first.

    Args:
        target: a model, a checkpoint path, or a schema (``{key: TensorInfo}``).
        src: the checkpoint path, :class:`~sdadapt.sources.Source` or schema.
        adapter: an adapter (or spec string) to start from.
        subtree: the nested dict of a ``torch.save`` file or DCP folder to read.
        reference: settles the draft's open questions numerically, on a model of ``layers``
            layers built from the checkpoint's ``config.json`` (the target must be a model):
            ``"auto"`` (the default: ``"config"`` when the checkpoint has a ``config.json`` whose
            class the installed transformers has and the target is a model, else no check, the
            summary saying why), ``"config"`` (transformers builds the checkpoint's own class;
            a failure to run is an error), ``module:ATTR`` / a callable taking the config dict
            and returning that model, or ``None`` / ``"none"`` (headers only).
        layers: how many layers the numeric check builds.
        init_buffers: ``fn(model)`` that fills the non-persistent buffers of the numeric check's
            copy of a meta-device model; without it the model's own ``init_weights()`` /
            ``init_buffers()`` / ``reset_parameters()`` (or its modules') fill them, and a buffer
            left without values stops the check.

    Returns:
        The :class:`~sdadapt.reports.Draft`: proposals, questions, the adapter, its module's source.

    Example::

        d = sdadapt.draft(model, "ckpt/model.safetensors")
        summary = str(d)
        open("my_adapter.py", "w").write(d.module)
    """
    return run_draft(target, src, adapter, subtree, Check(reference, layers, init_buffers))


def run_draft(target: Target, src: str | os.PathLike[str] | Source | dict[str, TensorInfo], adapter: Adapter | str | None,
              subtree: str | None, check: Check) -> Draft:  # fmt: skip
    """:func:`draft` with its check's options as one object (the CLI's carries ``rebuild``)."""
    check_not_a_model("sdadapt.draft(target, src, adapter=None, ...)", src, other=target)
    tschema, tname = target_schema(target)
    sschema, non_tensor, sname = _source_schema(src, subtree)
    given = adapter_or_none(adapter, None if isinstance(src, dict) else src)
    release = None if given is not None or isinstance(src, dict) else release_dequant(src, sschema, list(tschema))
    given = given or release  # a GPTQ / AWQ release is matched as what its packed tensors dequantise to
    original, original_non_tensor = sschema, non_tensor
    if given is not None:
        outputs, non_tensor = plan_outputs(sschema, given, non_tensor=non_tensor, what=f"draft from {sname}")
        sschema = {k: TensorInfo(tuple(n.shape), n.dtype) for k, n in outputs.items()}
    facts = NO_CONFIG if isinstance(src, dict) else read_facts(sname, list(sschema))
    scales = {k for k in sschema if k.endswith(FP8_SCALE_SUFFIX) and k[: -len(FP8_SCALE_SUFFIX)] in sschema}
    if scales:  # FP8 block scales belong to their weights (a dequantisation reads them), not to the mapping
        sschema = {k: v for k, v in sschema.items() if k not in scales}
    rules_before: list[Any] = []
    strip = _common_prefix(list(sschema))
    if strip.count(".") >= 2 and not any(k.startswith(strip) for k in tschema):  # model.diffusion_model.
        rules_before.append(StripPrefix(prefix=strip))
        sschema_m = {k[len(strip):]: v for k, v in sschema.items()}
    else:
        strip = ""
        sschema_m = sschema
    stree, ttree = build_tree(sschema_m), build_tree(tschema)
    result = match_trees(stree, ttree)
    props = build_proposals(result, stree, ttree, strip or None, facts)
    frac = props.matched_target_keys / max(1, props.target_keys)
    related = frac >= RELATED_FRACTION and props.target_keys > 0
    summary = _summary(result, props, frac, related)
    summary.insert(0, f"config: {facts.describe()}")
    proposals: list[Proposal] = []
    sections: list[tuple[str, list[tuple[list[str], list[str]]]]] = []
    rules: list[Any] = []
    experiment_lines: list[str] = []
    values_checked: str | None = None
    ran = False
    reference = check.reference
    explicit = reference not in ("auto", None, "none")
    if related:
        reference, skipped = _which_reference(target, facts, reference)
        if skipped:
            experiment_lines.append(skipped)
    if related and reference is not None:
        ran = True
        values_checked, more = _experiment(target, _unquantized(facts) if release else facts, props, reference, check,
                                           strip, None if release else given, explicit, casts=release is None)
        experiment_lines += more
    if related and values_checked is None:
        from .numeric import choices_of

        if not ran:
            experiment_lines.append("values unproven: no numerical check ran (the questions below are open; "
                                    "check values with sdadapt.verify)")
        for c in choices_of(props, facts):  # what names and shapes could have got wrong, said per rule
            alternatives = (f"{len(c.options) - 1} other order(s)" if c.renames else "; ".join(c.options[1:]))
            experiment_lines.append(f"  unproven: {c.label} (as drafted: {c.options[0]}; alternatives: {alternatives})")
            for p in [*c.renames, *([c.split] if c.split else [])]:
                p.evidence.append(f"unproven: {c.label}; a numerical check would settle it")
    summary += experiment_lines
    if related:
        if strip:
            sp = StripPrefix(prefix=strip)
            proposals.append(Proposal(kind="strip_prefix", sources=[strip + "**"], targets=["**"], code=[rule_code(sp)],
                                      confidence=0.95, uncertain=False, section="prefixes",
                                      evidence=[f"every checkpoint key starts with {strip!r}, no model key does"],
                                      keys=len(sschema)))
            sections.append(("prefixes", [(comment(f"every checkpoint key starts with {strip!r}, no model key does"),
                                           [rule_code(sp)])]))
            rules.append(sp)
        grouped = _grouped(props)
        section_names = list(grouped)
        pair_evidence = {f"{q.src.label()} -> {q.tgt.label()}": q.evidence for q in result.pairs}
        for name in section_names:
            entries = []
            for p in grouped.get(name, []):
                uncertain = p.confidence < UNCERTAIN_BELOW
                code = [rule_code(r) for r in p.rules]
                tag = "UNCERTAIN " if uncertain else ""
                text = f"{tag}{p.kind} ({p.confidence:.2f}): " + "; ".join(p.evidence)
                before: list[str] = []
                after: list[str] = []
                for q in p.questions:
                    lines = comment("DECIDE: " + q.question) + [f"        # {x}" for x in q.suggestion]
                    (before if q.before else after).extend(lines)
                entries.append((comment(text), before + code + after))
                rules += p.rules
                proposals.append(Proposal(kind=p.kind, sources=p.sources, targets=p.targets, code=code,
                                          confidence=p.confidence, uncertain=uncertain, evidence=p.evidence,
                                          section=name, keys=p.keys))
            title = name
            if name in pair_evidence:
                title = f"{name} ({pair_evidence[name]})"
            elif name.startswith("(top level)"):
                title = "top level"
            sections.append((title, entries))
    if given is not None:
        note = comment(f"the adapter given to draft ({given.name}); the proposals below come after it")
        code = [rule_code(r) for r in given.rules]
        if release is not None:
            note = comment(f"{release.description}: the proposals below match what these rules give")
            code = [f"*sdadapt.dequant_rules({json.dumps(config_path(src))})"]
        sections.insert(0, (f"given: {given.name}" if release is None else "dequant", [(note, code)]))
    adapter = Adapter(rules, name="draft", description=f"drafted from {sname} for {tname}")
    if given is not None:  # the proposals apply to the keys the given adapter produces
        adapter = Adapter.composed([*given.parts(), list(rules)], name="draft", description=adapter.description)
    report = build_plan(original, tschema, adapter, non_tensor=original_non_tensor, source_name=sname,
                        target_name=tname).report
    if values_checked and report.ok:
        report = report.model_copy(update={"values_checked": values_checked})
    if (given is None or release is not None) and not isinstance(src, dict):
        hint = _shipped_suggestion(target, src, subtree, report)
        if hint:
            summary.insert(1, f"hint: {hint}")
    questions = [Question(about=q.about, question=q.question, suggestion=q.suggestion) for q in props.questions] if related else []
    module = render_module(
        source=sname, target=tname, sections=sections,
        remaining=report.format(), related=related, summary=summary, stages=adapter.stages,
    )
    return Draft(source=sname, target=tname, related=related, summary=summary, proposals=proposals,
                 questions=questions, adapter=adapter, module=module, report=report)


def _unquantized(facts: Any) -> Any:
    """``facts`` without ``quantization_config``: the numerical check's reference is the plain
    model, its checkpoint unquantized (the release's dequant rules stay out of its candidates)."""
    if facts.config is None:
        return facts
    return dataclasses.replace(facts, config={k: v for k, v in facts.config.items() if k != "quantization_config"})


def _grouped(props: Proposals) -> dict[str, list[Any]]:
    """The proposals by section, in the drafted adapter's order."""
    grouped: dict[str, list[Any]] = {}
    for p in props.items:
        grouped.setdefault(p.section, []).append(p)
    first, last = ["drops", "dequant"], ["ties", "casts"]
    names = first + sorted(s for s in grouped if s not in first + last) + last
    return {n: grouped[n] for n in names if n in grouped}


def _shipped_suggestion(target: Any, src: Any, subtree: str | None, report: Report) -> str | None:
    """The shipped adapter for the family the checkpoint's ``config.json`` names, when it fits
    the target or the draft leaves problems (:func:`.._tools.diffing.family_suggestion`)."""
    from .._tools import diff, family_suggestion

    fitted: dict[str, bool] = {}

    def fits(name: str) -> bool:
        fitted[name] = diff(target, src, name, subtree=subtree).ok
        return fitted[name]

    hint = family_suggestion(src, fits)
    if hint is None or not (report.problems or any(fitted.values())):
        return None
    return hint


def _which_reference(target: Any, facts: Any, reference: Any) -> tuple[Any, str | None]:
    """The reference the numerical check runs with (``None``: none) and, when none runs, the
    summary line saying why. ``"auto"`` becomes ``"config"`` when the target is a model and
    ``config.json`` names a class the installed transformers has."""
    if reference is None or reference == "none":
        return None, "numerical check skipped (reference=None)"
    if reference != "auto":
        return reference, None
    why = None
    if not isinstance(target, nn.Module):
        why = "the target is not a model"
    elif facts.config is None:
        why = "no config.json beside the checkpoint"
    else:
        names = facts.config.get("architectures") or []
        try:
            import transformers
        except ImportError:
            why = "transformers is not installed (pip install 'sdadapt[models]')"
        else:
            if not names or not isinstance(names[0], str):
                why = "config.json names no model class ('architectures')"
            elif getattr(transformers, names[0], None) is None:
                why = f"transformers {transformers.__version__} has no class {names[0]!r}"
    if why:
        return None, (f"numerical check not run: {why} (by default it runs with the transformers class config.json "
                      "names; a reference function of your own settles the questions as well)")
    return "config", None


def _experiment(target: Any, facts: Any, props: Proposals, reference: Any, check: Check, strip: str, given: Adapter | None,
                explicit: bool = True, casts: bool = True) -> tuple[str | None, list[str]]:
    """Run :mod:`.numeric` on the draft's open choices; returns (what was checked, summary lines).
    A model copy whose buffers get no values raises when the reference was asked for
    (``explicit``), else the check is left out, said why. ``casts=False``: the candidates leave
    the cast proposals out (the reference's float32 checkpoint stands for a quantized release's
    dequantised values, which need none)."""
    from .._plan.resolve import load_object
    from ..errors import ModelError
    from .numeric import MAX_COMBINATIONS, MAX_COMBINATIONS_BY_DEFAULT, Experiment, apply_outcome, choices_of, search

    if not isinstance(target, nn.Module):
        return None, ["values unproven: the numerical check needs the model itself as the target"]
    if facts.config is None:
        return None, ["values unproven: no config.json beside the checkpoint to build the reference from"]
    ref = None if reference in ("config", "auto", True) else reference
    if isinstance(ref, str):
        ref = load_object(ref)
    items = [p for ps in _grouped(props).values() for p in ps if casts or p.kind != "cast"]

    def base(replaced: dict[int, list[Any]], before: list[Any], after: list[Any]) -> Adapter:
        rules: list[Any] = [StripPrefix(prefix=strip)] if strip else []
        rules += before
        for p in items:
            rules += replaced.get(id(p), p.rules)
        rules += after
        mine = Adapter(rules, name="draft-candidate")
        return mine if given is None else Adapter.composed([*given.parts(), list(mine.rules)], name="draft-candidate")

    try:
        exp = Experiment(target, facts, ref, check, 0)
    except ModelError as e:  # the copy's buffers: never run the check on garbage
        if explicit:
            raise
        log.info("draft: the numerical check did not run: %s", e)
        return None, [f"values unproven: the numerical check did not run: {e}"]
    except Exception as e:  # noqa: BLE001 - any failure to build the copies leaves the draft unproven, said why
        log.warning("draft: the numerical check could not run: %s", e)
        return None, [f"values unproven: the numerical check could not run ({type(e).__name__}: {str(e).splitlines()[0]})"]
    try:
        choices = choices_of(props, facts)
        bound = MAX_COMBINATIONS if explicit else MAX_COMBINATIONS_BY_DEFAULT
        out = search(exp, base, choices, bound)
    finally:
        exp.close()
    how = " (run by default; reference='none' skips it)" if not explicit else ""
    lines = [f"numerical check against {type(exp.reference).__name__}{how}: {check.layers} layer(s), float32, random "
             f"weights; {len(choices)} open choice(s), {exp.runs} load(s)"
             + (f"; the copy's non-persistent buffers filled by {exp.buffers}" if exp.buffers else "")]
    if not out.ok:
        lines.append(f"values unproven: no candidate agreed with the reference ({out.detail}); the questions stay open "
                     "(the reference computes what no candidate does: a rule the draft does not propose, another "
                     "configuration, or buffers of other values)")
        combos = math.prod(len(c.options) for c in choices)
        if bound < combos <= MAX_COMBINATIONS:
            lines.append(f"  the {combos} combinations of the choices were not all tried, as they are with "
                         "reference='config'")
        return None, lines
    lines += apply_outcome(props, out)
    return out.detail, lines


def _summary(result: Any, props: Proposals, frac: float, related: bool) -> list[str]:
    lines = []
    for p in result.pairs:
        lines.append(f"blocks {p.src.label()} ~ {p.tgt.label()}: {p.evidence}")
    matched = {id(i) for m in result.matches for i in m.srcs + m.tgts}
    stacked = {id(i.stacked) for i in result.src_items + result.tgt_items if i.stacked is not None and id(i) in matched}
    for side, scopes in (("checkpoint", result.unpaired_src), ("model", result.unpaired_tgt)):
        for s in scopes:
            if id(s) not in stacked:
                lines.append(f"{side} blocks {s.label()} ({s.count} x {int(s.per_instance_numel)} parameters) pair "
                             "with no blocks of the other side (counts or parameter counts differ)")
    lines.append(f"{props.matched_target_keys} of {props.target_keys} model tensors have a counterpart "
                 f"({frac:.0%})" + (f"; {props.unchanged} already line up" if props.unchanged else ""))
    if not related:
        lines.append("checkpoint and model look unrelated: no adapter proposed (the evidence above is all there is)")
    return lines
