"""Adapter + source schema + target schema -> Plan (target key -> recipe) + Report.

Planning reads headers only. It is deterministic, so every rank builds the same plan and
reaches the same verdict without talking to the others.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from .._recipes.nodes import Cast as CastNode
from .._recipes.nodes import Leaf, Node
from ..rules._patterns import compile_pattern, matches_any, union
from ..sources._base import TensorInfo, dtype_name
from .adapter import Adapter
from .report import Mismatch, Report, RuleIssue

WRAPPER_SEGMENTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
"""Key segments that module wrappers add (torch.compile, activation checkpointing, FSDP1) and
that ``get_model_state_dict`` leaves out: :func:`build_plan` removes them from every source key,
wherever they appear, before the adapter's rules run."""


_MAY_WRAP = re.compile("|".join(WRAPPER_SEGMENTS))


def unwrap_key(key: str) -> str:
    """``"_orig_mod.layers.0._checkpoint_wrapped_module.w"`` -> ``"layers.0.w"``."""
    if _MAY_WRAP.search(key) is None:  # the common case, in one C-level scan
        return key
    parts = key.split(".")
    kept = [p for p in parts if p not in WRAPPER_SEGMENTS]
    return ".".join(kept) if kept and len(kept) != len(parts) else key


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


class PlanContext:
    """The working set rules act on: current key -> Node, plus bookkeeping for the report."""

    def __init__(
        self,
        schema: dict[str, TensorInfo],
        non_tensor: list[str],
        target: dict[str, TensorInfo] | None,
        adapter: Adapter,
    ):
        self.env: dict[str, Node] = {k: Leaf(k, i.shape, i.dtype) for k, i in schema.items()}
        self.source = schema  # the source's TensorInfo by original key (leaves keep that key)
        self.non_tensor: set[str] = set(non_tensor)
        self.target = target
        self.adapter = adapter
        self.born: dict[str, int] = dict.fromkeys(self.env, -1)
        self.taken: dict[str, Node] = {}
        self.consumed: list[tuple[str, int]] = []  # (key, index of the rule that took it)
        self.matches = [0] * len(adapter.rules)
        self.issues: list[RuleIssue] = []
        self.dropped: list[str] = []

    # --- used by rules -------------------------------------------------------------
    def keys(self, include_non_tensor: bool = False) -> list[str]:
        ks = list(self.env)
        return ks + sorted(self.non_tensor) if include_non_tensor else ks

    def has(self, key: str) -> bool:
        return key in self.env

    def get(self, key: str) -> Node:
        return self.env[key]

    def mark(self, index: int) -> None:
        self.matches[index] += 1

    def take(self, key: str, index: int) -> Node:
        node = self.env.pop(key)
        self.taken[key] = node
        self.consumed.append((key, index))
        self.mark(index)
        return node

    def absorb(self, key: str, index: int) -> Node:
        """Remove ``key``, folded into another key's recipe by value rule ``index`` (a
        quantization scale). Not a move: later rules may match its name without ambiguity."""
        self.mark(index)
        return self.env.pop(key)

    def put(self, key: str, node: Node, index: int, origin: str | list[str]) -> None:
        if key in self.env:
            self.issue(index, key, f"would overwrite {key!r}, which already exists; the rules collide")
            return
        self.env[key] = node
        self.born[key] = index

    def replace(self, key: str, node: Node) -> None:
        self.env[key] = node

    def drop(self, key: str, index: int) -> None:
        if key in self.non_tensor:
            self.non_tensor.discard(key)
        else:
            self.env.pop(key)
        self.dropped.append(key)
        self.consumed.append((key, index))
        self.mark(index)

    def issue(self, index: int, key: str | None, message: str) -> None:
        self.issues.append(
            RuleIssue(rule=self.adapter.rules[index].label(), index=index, key=key, message=message)
        )
        self.mark(index)

    def unwrap_keys(self) -> list[tuple[str, str, str]]:
        """Remove wrapper segments (:data:`WRAPPER_SEGMENTS`) from every key, before any rule.

        Leaves keep reading their original key. When two keys become one, the key that was
        already clean (else the first) takes the name and the other keeps its original name;
        returns those collisions as ``(kept_key, winner_key, clean_name)``. A rule may then
        drop or rename the kept key; if none does, the plan reports the collision."""
        winner: dict[str, str] = {}
        keys = [*self.env, *sorted(self.non_tensor)]
        clean = {key: unwrap_key(key) for key in keys}
        for key, new in clean.items():
            if new not in winner or key == new:
                winner[new] = key
        renamed: dict[str, str] = {}
        collisions: list[tuple[str, str, str]] = []
        for key, new in clean.items():
            if winner[new] == key:
                renamed[key] = new
            else:
                renamed[key] = key
                collisions.append((key, winner[new], new))
        self.env = {renamed[k]: v for k, v in self.env.items()}
        self.born = dict.fromkeys(self.env, -1)
        self.non_tensor = {renamed[k] for k in self.non_tensor}
        return collisions

    def collision_issues(self, collisions: list[tuple[str, str, str]]) -> list[RuleIssue]:
        return [
            RuleIssue(
                rule="auto-unwrap",
                index=-1,
                key=key,
                message=f"{key!r} and {other!r} both become {new!r} once the wrapper segments "
                f"{', '.join(WRAPPER_SEGMENTS)} are removed; drop or rename {key!r}",
            )
            for key, other, new in collisions
            if key in self.env or key in self.non_tensor
        ]

    # --- after all rules -------------------------------------------------------------
    def check_ambiguity(self) -> None:
        """A key taken by rule i must not also match a later key-moving rule j of the same
        composed part (``a + b``: ``b`` sees ``a``'s outputs, not the keys ``a`` took).

        Each key is first tried against one regex for all the rules after its own (one C-level
        match instead of one Python call per rule: a MoE checkpoint has ~10^5 keys); only a key
        that matches is tried rule by rule, to name the rule."""
        rules = self.adapter.rules
        stage = self.adapter.stage_of
        later = [(j, [compile_pattern(p) for p in r.input_patterns()]) for j, r in enumerate(rules) if r.moves_keys]
        after: dict[int, re.Pattern[str]] = {}
        for key, i in self.consumed:
            if getattr(rules[i], "shadows", False):
                continue  # taken first on purpose (Drop(shadows=True))
            screen = after.get(i)
            if screen is None:  # later rules of the same composed part: the next part sees only the outputs
                screen = after[i] = union([p for j, pats in later if j > i and stage(j) == stage(i) for p in pats])
            if screen.match(key) is None:
                continue
            for j, pats in later:
                if j > i and stage(j) == stage(i) and any(p.match(key) is not None for p in pats):
                    self.issue(
                        j,
                        key,
                        f"also matches this key, which rule #{i} {rules[i].label()} took first; "
                        "make the patterns disjoint",
                    )


@dataclass
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
            print(plan.recipes["layers.0.attention.wqkv.weight"].describe())
    """

    recipes: dict[str, Node]
    report: Report
    target: dict[str, TensorInfo]
    skipped: list[str] = field(default_factory=list)  # allowed-missing target keys (left as they are)
    other_stages: list[str] = field(default_factory=list)  # keys of other pipeline stages (not read)
    other_stage_sources: set[str] = field(default_factory=set)  # the source keys those are made from


def build_plan(
    source: dict[str, TensorInfo],
    target: dict[str, TensorInfo],
    adapter: Adapter | None = None,
    *,
    non_tensor: list[str] | None = None,
    allow_missing: list[str] | None = None,
    allow_unexpected: list[str] | None = None,
    source_name: str = "checkpoint",
    target_name: str = "model",
    pipeline_stage: PipelineStage | None = None,
) -> Plan:
    """Apply ``adapter``'s rules to the ``source`` schema and line the result up with ``target``
    (both ``key -> TensorInfo``, headers only): a recipe per target key that matches, and a
    :class:`Report` of every key that does not. Deterministic, so every rank gets the same plan.
    ``allow_missing`` / ``allow_unexpected`` are key patterns whose mismatches are tolerated.
    ``pipeline_stage``: the target is one pipeline stage; the adapted keys that belong to other
    stages (:meth:`PipelineStage.elsewhere`) are listed in ``Plan.other_stages`` and in the
    report's ``allowed_unexpected``, and are not read; the source keys they are made from are
    ``Plan.other_stage_sources``."""
    adapter = adapter or Adapter([], name="identity")
    ctx = PlanContext(source, non_tensor or [], target, adapter)
    collisions = ctx.unwrap_keys()
    for i, rule in enumerate(adapter.rules):
        rule.apply(ctx, i)
    ctx.check_ambiguity()
    unwrap_issues = ctx.collision_issues(collisions)

    allow_missing = allow_missing or []
    allow_unexpected = allow_unexpected or []
    report = Report(
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
        if tuple(node.shape) != tuple(want.shape):
            report.shape_mismatch.append(
                Mismatch(key=key, model=str(list(want.shape)), checkpoint=str(list(node.shape)), recipe=node.describe())
            )
        elif node.dtype != want.dtype and (adopted := _in_target_dtype(node, want)) is not None:
            recipes[key] = adopted
        elif node.dtype != want.dtype and report.dequant_rules and widens_exactly(node.dtype, want.dtype) and _as_stored(node):
            recipes[key] = CastNode(node, want.dtype)
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
    report.matched = len(recipes)
    return Plan(recipes, report, target, skipped=skipped, other_stages=other_stages, other_stage_sources=other_stage_sources)


_EXACT_WIDENINGS = {
    (torch.bfloat16, torch.float32), (torch.float16, torch.float32),
    (torch.bfloat16, torch.float64), (torch.float16, torch.float64), (torch.float32, torch.float64),
}


def widens_exactly(stored: torch.dtype, want: torch.dtype) -> bool:
    """Whether every value of ``stored`` is a value of ``want`` (bfloat16 or float16 into float32).
    In a quantized release, the tensors stored unquantized (embeddings, norms, head) are widened so
    into a float32 model (FSDP2's master weights) beside the dequantised ones, which take the
    model's dtype: the release then loads with no ``dtype`` option. A narrowing, and the result of
    an explicit cast rule, stay problems."""
    return (stored, want) in _EXACT_WIDENINGS


def _as_stored(node: Node) -> bool:
    """Whether ``node``'s values are stored tensors in their stored dtype, rearranged at most (no
    cast, no computation such as a dequantisation given a dtype)."""
    if isinstance(node, Leaf):
        return True
    kids = node.children()
    return not isinstance(node, CastNode) and bool(kids) and all(k.dtype == node.dtype and _as_stored(k) for k in kids)


def _in_target_dtype(node: Node, want: TensorInfo) -> Node | None:
    """``node`` producing the target's dtype itself, where its values have no dtype of their
    own (a dequantisation given no ``dtype=``, :meth:`Node.follows_target_dtype`), else ``None``."""
    if not node.follows_target_dtype() or not want.dtype.is_floating_point:
        return None
    return node.as_dtype(want.dtype)
