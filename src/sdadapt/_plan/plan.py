"""Adapter + source schema + target schema -> Plan (target key -> recipe) + Report.

Planning reads headers only. It is deterministic, so every rank builds the same plan and
reaches the same verdict without talking to the others.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypedDict

import torch
from torch import nn

from .._base.schema import TensorInfo, dtype_name
from .._recipes.nodes import Converted, Leaf, Node
from ..rules import PlanContext, matches_any, unwrap_key
from .adapter import Adapter
from .report import Mismatch, Report, scale_keys

if TYPE_CHECKING:
    from typing import Unpack  # Python 3.11; annotations only, the package runs on 3.10


def index_pattern(key: str) -> str:
    """``"layers.12.moe.experts.w1"`` -> ``"layers.{i}.moe.experts.w1"``: every all-digit
    segment (a layer or block index) replaced by ``{i}``."""
    return ".".join("{i}" if p.isdigit() else p for p in key.split("."))


def vacant_modules(model: nn.Module) -> list[str]:
    """Module paths that ``model`` registers as ``None`` (``model.norm = None``): the slots a
    pipeline split leaves where another stage holds the module. Wrapper segments are removed,
    as the state dict's keys have them removed."""
    return sorted(
        unwrap_key(f"{name}.{child}" if name else child)
        for name, mod in model.named_modules()
        for child, sub in mod._modules.items()
        if sub is None
    )


@dataclass(frozen=True)
class PipelineStage:
    """The keys of a model that is one pipeline stage (a subset of a whole model's layers), and
    which of the checkpoint's keys belong to the other stages.

    A key the adapter produced that the stage does not hold belongs to another stage when
    (1) it has an index segment and its :func:`index_pattern` is the pattern of some key the
    stage does hold (``layers.5.attention.wq.weight`` while the stage holds ``layers.2.`` and
    ``layers.3.``), or (2) it lies under a module slot the stage leaves ``None``
    (``tok_embeddings.weight`` where ``model.tok_embeddings = None``), as torch's manual
    pipeline split and torchtitan's leave them. Any other key the stage lacks stays unexpected,
    and keys of the stage's own layers that the checkpoint lacks stay missing."""

    patterns: frozenset[str]
    vacant: tuple[str, ...] = ()

    @classmethod
    def of(cls, target_keys: Iterable[str], vacant: Iterable[str] = ()) -> PipelineStage:
        """The stage that holds ``target_keys``, with module slots ``vacant`` left ``None``."""
        return cls(frozenset(index_pattern(k) for k in target_keys if index_pattern(k) != k), tuple(vacant))

    def elsewhere(self, key: str) -> bool:
        """``key`` (absent from the stage) belongs to another pipeline stage."""
        if any(key.startswith(v + ".") for v in self.vacant):
            return True
        pattern = index_pattern(key)
        return pattern != key and pattern in self.patterns


@dataclass(eq=False)
class Plan:
    """What to load: ``recipes[target_key]`` makes that tensor from source regions.

    Attributes:
        recipes: ``target key -> node`` that makes it.
        report: the :class:`Report` of the plan.
        target: ``key -> TensorInfo`` of the target.
        skipped: allowed-missing target keys, left as they are.
        other_stages: keys of other pipeline stages (not read).
        other_stage_sources: the source keys those are made from.

    Example::

        source, plan = sdadapt.plan_load(model, "ckpt/", "llama")
        with source:
            text = plan.recipes["layers.0.attention.wqkv.weight"].describe()
    """

    recipes: dict[str, Node]
    report: Report
    target: dict[str, TensorInfo]
    skipped: list[str] = field(default_factory=list)  # allowed-missing target keys (left as they are)
    other_stages: list[str] = field(default_factory=list)  # keys of other pipeline stages (not read)
    other_stage_sources: set[str] = field(default_factory=set)  # the source keys those are made from


class KeyPatterns(TypedDict, total=False):
    """The key patterns whose mismatches a plan tolerates, typed once: the keywords
    ``allow_missing=`` / ``allow_unexpected=`` of the public functions that hand them on to
    planning as they are (:func:`sdadapt.plan_load`, :func:`sdadapt.diff`,
    :func:`sdadapt.dry_run`, :func:`sdadapt.vllm.connect`), written there as
    ``**patterns: Unpack[KeyPatterns]``. Type checkers check those keywords as if they were
    spelled in each signature, and every call that passed them by keyword works as before; a
    keyword that is neither is a ``TypeError`` naming the function, as Python's own.
    :func:`sdadapt.load`, :func:`sdadapt.load_state` and :func:`sdadapt.refit_plan` spell them
    in their signatures (the functions a user reads first, each saying what the patterns are
    matched against).

    Attributes:
        allow_missing: key patterns of the target (the model, the engine) that the checkpoint
            (the trainer) may lack: ``["lm_head.weight"]``, ``["layers.{i}.attn.bias"]``, ``["**"]``.
        allow_unexpected: key patterns of the checkpoint that the target may lack.

    Example::

        patterns: sdadapt.KeyPatterns = {"allow_missing": ["lm_head.weight"]}
        report = sdadapt.diff(model, "ckpt/", "llama", **patterns)
    """

    allow_missing: list[str] | None
    allow_unexpected: list[str] | None


def key_patterns(where: str, given: Mapping[str, object]) -> KeyPatterns:
    """A call's ``**patterns``, checked: any keyword other than :class:`KeyPatterns`' is a
    ``TypeError`` naming the call ``where``, as Python's own."""
    unknown = sorted(set(given) - KeyPatterns.__optional_keys__)
    if unknown:
        raise TypeError(f"{where}() got an unexpected keyword argument {unknown[0]!r}")
    return KeyPatterns(given)  # type: ignore[misc]


def build_plan(
    source: dict[str, TensorInfo],
    target: dict[str, TensorInfo],
    adapter: Adapter | None = None,
    *,
    non_tensor: list[str] | None = None,
    source_name: str = "checkpoint",
    target_name: str = "model",
    pipeline_stage: PipelineStage | None = None,
    allow_resized: list[str] | None = None,
    **patterns: Unpack[KeyPatterns],
) -> Plan:
    """Apply ``adapter``'s rules to the ``source`` schema and line the result up with ``target``
    (both ``key -> TensorInfo``, headers only): a recipe per target key that matches, and a
    :class:`Report` of every key that does not. Deterministic, so every rank gets the same plan.
    ``patterns``: key patterns whose mismatches are tolerated (:class:`KeyPatterns`).
    ``pipeline_stage``: the target is one pipeline stage; the adapted keys that belong to other
    stages (:meth:`PipelineStage.elsewhere`) are listed in ``Plan.other_stages`` and in the
    report's ``allowed_unexpected``, and are not read; the source keys they are made from are
    ``Plan.other_stage_sources``. ``allow_resized``: key patterns of the target whose shape may
    differ from what the checkpoint gives (same number of dims): such a key is not read, it is
    listed in the report's ``resized`` and in ``Plan.skipped`` (its values come from where an
    allowed missing key's come from)."""
    adapter = adapter or Adapter([], name="identity")
    ctx = PlanContext(source, non_tensor or [], target, adapter.rules, adapter.stage_of)
    collisions = ctx.unwrap_keys()
    for i, rule in enumerate(adapter.rules):
        rule.apply(ctx, i)
    ctx.check_ambiguity()
    unwrap_issues = ctx.collision_issues(collisions)

    allow_missing = key_patterns("build_plan", patterns).get("allow_missing") or []
    allow_unexpected = patterns.get("allow_unexpected") or []
    # the plan's own values, of the fields' types: not validated (a load builds no validator of its own)
    report = Report.model_construct(
        source=source_name,
        target=target_name,
        adapter=adapter.name if adapter.rules else None,
        source_keys=len(source) + len(non_tensor or []),
        target_keys=len(target),
        rule_issues=unwrap_issues + ctx.issues,
        unused_rules=[f"#{i} {r.label()}" for i, r in enumerate(adapter.rules) if ctx.matches[i] == 0],
        dropped=sorted(ctx.dropped),
        dequant_rules=[f"#{i} {k}" for i, r in enumerate(adapter.rules) if (k := str(getattr(r, "kind", ""))).startswith("dequant")],
    )
    recipes: dict[str, Node] = {}
    skipped: list[str] = []
    for key, want in target.items():
        node = ctx.env.get(key)
        if node is None:
            if matches_any(allow_missing, key):
                report.allowed_missing.append(key)
                skipped.append(key)
            else:
                report.missing.append(key)
            continue
        if tuple(node.shape) != tuple(want.shape) and len(node.shape) == len(want.shape) and matches_any(allow_resized or [], key):
            report.resized.append(
                Mismatch(key=key, model=str(list(want.shape)), checkpoint=str(list(node.shape)), recipe=node.describe())
            )
            skipped.append(key)
        elif tuple(node.shape) != tuple(want.shape):
            report.shape_mismatch.append(
                Mismatch(key=key, model=str(list(want.shape)), checkpoint=str(list(node.shape)), recipe=node.describe())
            )
        elif node.dtype != want.dtype and (adopted := _in_target_dtype(node, want)) is not None:
            recipes[key] = adopted
        elif node.dtype != want.dtype and widens_exactly(node.dtype, want.dtype) and _as_stored(node):
            recipes[key] = Converted(node, want.dtype)
            report.widened.append(key)
        elif node.dtype != want.dtype:
            report.dtype_mismatch.append(
                Mismatch(key=key, model=dtype_name(want.dtype), checkpoint=dtype_name(node.dtype), recipe=node.describe())
            )
        else:
            recipes[key] = node
    other_stages: list[str] = []
    other_stage_sources: set[str] = set()
    for key in ctx.env:
        if key in target:
            continue
        if pipeline_stage is not None and pipeline_stage.elsewhere(key):
            other_stages.append(key)
            other_stage_sources.update(ctx.env[key].leaves())
            report.allowed_unexpected.append(key)
        else:
            (report.allowed_unexpected if matches_any(allow_unexpected, key) else report.unexpected).append(key)
    for key in sorted(ctx.non_tensor):
        (report.allowed_unexpected if matches_any(allow_unexpected, key) else report.non_tensor).append(key)
    if report.widened and scale_keys(report.unexpected + report.non_tensor):  # a plain load imports no format
        _unwiden_scaled(report, recipes)
    report.matched = len(recipes)
    if report.missing and adapter.rules:
        report.looked_for = looked_for(adapter, source, target, report.missing)
    return Plan(recipes, report, target, skipped=skipped, other_stages=other_stages, other_stage_sources=other_stage_sources)


def _unwiden_scaled(report: Report, recipes: dict[str, Node]) -> None:
    """Beside unconsumed scales, a float8 tensor is a quantized weight read without its dequant
    rule, not a value to widen: its widening is taken back and it is a dtype mismatch (which the
    report's quantization hint explains)."""
    for key in [k for k in report.widened if _fp8_widened(recipes[k])]:
        node = recipes.pop(key)
        assert isinstance(node, Converted)
        report.widened.remove(key)
        report.dtype_mismatch.append(
            Mismatch(key=key, model=dtype_name(node.dtype), checkpoint=dtype_name(node.child.dtype), recipe=node.child.describe())
        )


def _fp8_widened(node: Node) -> bool:
    return isinstance(node, Converted) and node.child.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def looked_for(adapter: Adapter, source: dict[str, TensorInfo], target: dict[str, TensorInfo], missing: list[str]) -> dict[str, list[str]]:
    """Missing target key -> the checkpoint key(s) ``adapter`` would have made it from: the keys
    its inverse gives from the target schema whose recipes read the missing key. Empty for an
    adapter whose inverse cannot be built or applied (a message then names the model's key only)."""
    wanted = set(missing)
    try:
        inv = adapter.inverse()
        ctx = PlanContext(target, [], source, inv.rules, inv.stage_of)
        for i, rule in enumerate(inv.rules):
            rule.apply(ctx, i)
    except Exception:  # noqa: BLE001 - only a hint for the report: a rule without an inverse gives none
        return {}
    out: dict[str, list[str]] = {}
    for key, node in ctx.env.items():
        for leaf in node.leaves():
            if leaf in wanted and leaf != key:
                out.setdefault(leaf, []).append(key)
    return {k: sorted(v) for k, v in sorted(out.items())}


_FLOATS = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float16, torch.bfloat16, torch.float32, torch.float64)
# (stored, wanted): every value of the stored dtype is a value of the wanted one. float8 e4m3fn
# (3 mantissa bits, |x| <= 448, subnormals down to 2**-9) and e5m2 (2 bits, <= 57344, 2**-16)
# fit in float16 (10 bits, <= 65504, 2**-24) and bfloat16 (7 bits, float32's range); float16 and
# bfloat16 in float32; everything in float64. float16 <-> bfloat16 loses either way.
_EXACT_WIDENINGS = {
    (torch.float8_e4m3fn, torch.float16), (torch.float8_e4m3fn, torch.bfloat16),
    (torch.float8_e5m2, torch.float16), (torch.float8_e5m2, torch.bfloat16),
    *((a, torch.float32) for a in _FLOATS[:4]),
    *((a, torch.float64) for a in _FLOATS[:5]),
}


def widens_exactly(stored: torch.dtype, want: torch.dtype) -> bool:
    """Whether every value of ``stored`` is a value of ``want`` (bfloat16 or float16 into float32,
    float8 into any wider float). Such a key loads with no cast rule and is listed in the report's
    ``widened``: a bfloat16 release into a float32 model (FSDP2's master weights) is the usual case.
    A narrowing, float <-> int, and the result of an explicit cast rule stay problems."""
    return (stored, want) in _EXACT_WIDENINGS


def _as_stored(node: Node) -> bool:
    """Whether ``node``'s values are stored tensors in their stored dtype, rearranged at most (no
    cast, no computation such as a dequantisation given a dtype)."""
    if isinstance(node, Leaf):
        return True
    kids = node.children()
    return not isinstance(node, Converted) and bool(kids) and all(k.dtype == node.dtype and _as_stored(k) for k in kids)


def _in_target_dtype(node: Node, want: TensorInfo) -> Node | None:
    """``node`` producing the target's dtype itself, where its values have no dtype of their
    own (a dequantisation given no ``dtype=``, :meth:`Node.follows_target_dtype`), else ``None``."""
    if not node.follows_target_dtype() or not want.dtype.is_floating_point:
        return None
    return node.as_dtype(want.dtype)


def adapted_schema(
    source: dict[str, TensorInfo], adapter: Adapter | None = None, non_tensor: list[str] | None = None
) -> dict[str, TensorInfo]:
    """The keys ``adapter``'s rules give from the ``source`` schema, with their shapes and
    dtypes: the target a checkpoint's own layout asks for (a dry run without a model)."""
    adapter = adapter or Adapter([], name="identity")
    ctx = PlanContext(source, non_tensor or [], {}, adapter.rules, adapter.stage_of)
    ctx.unwrap_keys()
    for i, rule in enumerate(adapter.rules):
        rule.apply(ctx, i)
    return {k: TensorInfo(tuple(node.shape), node.dtype) for k, node in ctx.env.items()}
