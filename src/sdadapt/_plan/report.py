"""The Report: everything that does not line up between a checkpoint and a model.

Pydantic models, so a report serialises (``report.model_dump_json()``) and prints
(``str(report)``) with runs of keys compressed and nearest-name suggestions.
"""

from __future__ import annotations

import difflib
import re
from collections import Counter, defaultdict

from pydantic import BaseModel, computed_field

from .._base.keyruns import compress
from ..rules._base import RuleIssue

_INDEX = re.compile(r"\.\d+(?=[.,\])\[]|$)")  # ".3." in a recipe -> ".{i}."

CAST_FIX = 'sdadapt.cast("**", "model")'
"""The one rule that fixes any dtype-only mismatch: each tensor to the model's dtype for it."""

NOT_NUMBERS = (
    "note: this compares names, shapes and dtypes only, not values: a wrong row order inside "
    "heads, an interleaved fused tensor or a missing (1 + w) still lines up. Check the numbers "
    "with `sdadapt verify SRC --model M --adapter A` (logits against a reference)"
)
"""What a key mapping does not show, and where the numerical check is."""

VERDICT_UNCHECKED = "OK: checkpoint and model line up by names and shapes; values unchecked"
"""The verdict of a clean report when no numerical check ran: a line-up is not a right load."""


class Mismatch(BaseModel):
    key: str
    model: str  # what the model wants (shape or dtype)
    checkpoint: str  # what the checkpoint + adapter give
    recipe: str  # how the value is made, e.g. "cat([q, k, v], dim=0)"


class Report(BaseModel):
    """How a checkpoint lines up with a model under an adapter (from headers alone).

    ``missing`` / ``unexpected`` list target keys nothing produces and source keys nothing
    consumes; ``shape_mismatch`` / ``dtype_mismatch`` the keys that differ; ``rule_issues`` and
    ``unused_rules`` what the adapter's rules could not do or never matched. ``ok`` is true when
    none of these (``problems``) remain; ``format()`` prints it as ``sdadapt diff`` does.

    Attributes:
        source: the checkpoint, as named in messages.
        target: the model or target, as named in messages.
        adapter: the adapter's name.
        source_keys: how many keys the checkpoint holds.
        target_keys: how many keys the target holds.
        matched: how many target keys the plan produces.
        missing: target keys nothing produces.
        unexpected: checkpoint keys nothing consumes.
        shape_mismatch: keys produced with another shape.
        dtype_mismatch: keys produced with another dtype.
        rule_issues: what rules could not do.
        unused_rules: rules that matched nothing.
        non_tensor: checkpoint keys that hold no tensor.
        allowed_missing: missing keys an ``allow_missing`` pattern allowed.
        allowed_unexpected: unexpected keys allowed (patterns, other pipeline stages).
        dropped: checkpoint keys a ``drop`` rule took.
        widened: keys of a quantized release stored unquantized, widened to the model's dtype.
        values_checked: what numerical check ran on the values, if any.
        dequant_rules: the adapter's dequantising rules, for the quantized-source hint.
        suggestion: a shipped adapter for the checkpoint's family, when none was given
            (:func:`~sdadapt._plan.registry.shipped_hint`).

    Example::

        report = sdadapt.diff(model, "ckpt/", "llama")
        assert report.ok, report.format()
    """

    source: str
    target: str
    adapter: str | None = None
    source_keys: int = 0
    target_keys: int = 0
    matched: int = 0
    missing: list[str] = []
    unexpected: list[str] = []
    shape_mismatch: list[Mismatch] = []
    dtype_mismatch: list[Mismatch] = []
    rule_issues: list[RuleIssue] = []
    unused_rules: list[str] = []
    non_tensor: list[str] = []
    allowed_missing: list[str] = []
    allowed_unexpected: list[str] = []
    dropped: list[str] = []
    widened: list[str] = []  # keys of a quantized release stored unquantized, widened exactly to the model's dtype
    values_checked: str | None = None  # what numerical check ran on the values, if any (e.g. by draft)
    dequant_rules: list[str] = []  # "#i kind" of the adapter's dequantising rules (the quantized-source hint)
    suggestion: str | None = None  # a shipped adapter for the checkpoint's family, when none was given

    @computed_field  # type: ignore[prop-decorator]
    @property
    def problems(self) -> int:
        return (
            len(self.missing)
            + len(self.unexpected)
            + len(self.shape_mismatch)
            + len(self.dtype_mismatch)
            + len(self.rule_issues)
            + len(self.unused_rules)
            + len(self.non_tensor)
        )

    @computed_field  # type: ignore[prop-decorator]
    @property
    def ok(self) -> bool:
        return self.problems == 0

    @property
    def mostly_unmatched(self) -> bool:
        """Fewer than half of the model's keys matched: a wrong adapter or checkpoint, not typos."""
        return bool(self.target_keys) and 2 * self.matched < self.target_keys

    def suggestions(self) -> dict[str, str]:
        """Compressed missing key -> the closest compressed unexpected key, for near misses only
        (a misspelling); none when most keys are unmatched, where names are no guide."""
        if not self.missing or not self.unexpected or self.mostly_unmatched:
            return {}
        pool = compress(self.unexpected)
        out = {}
        for m in compress(self.missing):
            near = difflib.get_close_matches(m, pool, n=1, cutoff=0.75)
            if near:
                out[m] = near[0]
        return out

    def _prefix_cause(self) -> str | None:
        """A prefix that the checkpoint's keys carry and the model's lack (or the other way),
        if it explains at least half of the missing keys."""
        missing = set(self.missing)
        for extra, lacking, rule, whose in (
            (self.unexpected, missing, "strip_prefix", "checkpoint's"),
            (sorted(missing), set(self.unexpected), "add_prefix", "model's"),
        ):
            counts: Counter[str] = Counter()
            for key in extra:
                parts = key.split(".")
                for k in range(1, min(3, len(parts))):
                    prefix = ".".join(parts[:k]) + "."
                    if key[len(prefix) :] in lacking:
                        counts[prefix] += 1
            if counts:
                prefix, n = counts.most_common(1)[0]
                if 2 * n >= len(self.missing):
                    return (
                        f"{n} of the {whose} keys carry the prefix {prefix!r} that the other side lacks; "
                        f"add sdadapt.{rule}({prefix!r}) to the adapter"
                    )
        return None

    def root_cause(self) -> str | None:
        """One line naming the likeliest single cause of the problems, with its fix, if one
        explains them: a quantized checkpoint read without its dequant rule, dtypes only, a key
        prefix, or a wrong adapter or checkpoint."""
        quant = quant_hint(self)
        if quant:
            return quant.removeprefix("hint: ")
        if self.dtype_mismatch and self.problems == len(self.dtype_mismatch):
            pairs = Counter((m.checkpoint, m.model) for m in self.dtype_mismatch)
            what = ", ".join(f"{got} where the model holds {want} ({n} keys)" for (got, want), n in pairs.most_common(3))
            more = f" and {len(pairs) - 3} more pairs" if len(pairs) > 3 else ""
            return (
                f"only dtypes differ: the checkpoint gives {what}{more}; the one rule that fixes it: "
                f'{CAST_FIX} (or sdadapt.load(..., dtype="model"); sdadapt diff --dtype model)'
            )
        if self.missing and self.unexpected:
            cause = self._prefix_cause()
            if cause:
                return cause
        if self.mostly_unmatched and (self.unexpected or self.rule_issues):
            return (
                f"most model keys are unmatched ({self.matched} of {self.target_keys}); is this the right "
                "adapter for this checkpoint?"
            )
        return None

    def format(self, max_rows: int | None = 8) -> str:
        """The report as text: a root cause first when one explains the problems, then each
        kind of problem with at most ``max_rows`` rows (``None``: every row)."""
        lines = [f"source {self.source}", f"target {self.target}"]
        if self.adapter:
            lines.append(f"adapter {self.adapter}")
        lines.append(
            f"{self.matched} of {self.target_keys} model keys matched "
            f"({self.source_keys} checkpoint keys); {self.problems} problem(s)"
        )
        cause = self.root_cause()
        if cause:
            lines.append(f"root cause: {cause}")
        hint = self.suggestion
        if hint is None and self.adapter is None and not self.ok:
            from .registry import shipped_hint

            hint = shipped_hint(self.source)
        if hint:
            lines.append(f"hint: {hint}")

        def section(title: str, rows: list[str], count: int, note: str = "") -> None:
            if not rows:
                return
            lines.append(f"{title} ({count}){note}:")
            shown = rows if max_rows is None else rows[:max_rows]
            lines.extend(f"  {r}" for r in shown)
            if len(rows) > len(shown):
                lines.append(f"  ... and {len(rows) - len(shown)} more rows (--all lists every row)")

        hints = self.suggestions()
        section(
            "missing: the model has these, the checkpoint + adapter do not give them",
            [m + (f"    <- did you mean {hints[m]}?" if m in hints else "") for m in compress(self.missing)],
            len(self.missing),
        )
        section(
            "unexpected: the checkpoint has these, the model does not (drop them or map them)",
            compress(self.unexpected),
            len(self.unexpected),
        )
        section("not tensors (drop them, or pick a subtree)", compress(self.non_tensor), len(self.non_tensor))
        for title, items, note in (
            ("shape mismatch", self.shape_mismatch, ""),
            ("dtype mismatch", self.dtype_mismatch, "" if quant_hint(self) else f", all fixed by {CAST_FIX} if the conversion is intended"),
        ):
            groups: dict[tuple[str, str, str], list[Mismatch]] = defaultdict(list)
            for mm in items:  # one row per run of keys with the same numbers and the same recipe shape
                groups[(mm.model, mm.checkpoint, _INDEX.sub(".{i}", mm.recipe))].append(mm)
            rows = [
                f"{k}: model {want}, checkpoint gives {got} (from {recipe})"
                for (want, got, recipe), ms in groups.items()
                for k in compress([m.key for m in ms])
            ]
            section(title, rows, len(items), note)
        issue_groups: dict[tuple[int, str, str], list[str]] = defaultdict(list)
        for it in self.rule_issues:
            issue_groups[(it.index, it.rule, it.message)].append(it.key or "")
        section(
            "rule problems",
            [
                f"#{i} {rule}: " + (f"{', '.join(compress([k for k in ks if k]))}: " if any(ks) else "") + msg
                for (i, rule, msg), ks in issue_groups.items()
            ],
            len(self.rule_issues),
        )
        section("rules that matched nothing", self.unused_rules, len(self.unused_rules))
        if self.dropped:
            lines.append(f"dropped by rules: {len(self.dropped)} key(s)")
        if self.widened:
            lines.append(f"widened exactly to the model's dtype (stored unquantized in a quantized release): {len(self.widened)} key(s)")
        if self.allowed_missing or self.allowed_unexpected:
            lines.append(
                f"allowed: {len(self.allowed_missing)} missing and {len(self.allowed_unexpected)} unexpected key(s)"
            )
        if self.matched and not self.values_checked:
            lines.append(NOT_NUMBERS)
        if not self.ok:
            lines.append(f"NOT OK: {self.problems} problem(s)")
        elif self.values_checked:
            lines.append(f"OK: checkpoint and model line up; values checked: {self.values_checked}")
        else:
            lines.append(VERDICT_UNCHECKED)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


# --- the hint for quantized checkpoints read without their dequant rule ---

def quant_hint(report: Report) -> str | None:
    """A hint line when a report's problems look like a quantized checkpoint read without its
    dequant rule: unexpected scale/packed keys, or FP8/uint8 data where the model wants floats."""
    from .._recipes import quant as Q  # the quantized formats' module: only for a report being read

    scale_suffixes = (Q.FP8_SCALE_SUFFIX, "weight_scale", Q.MX_BLOCKS_SUFFIX, Q.MX_SCALES_SUFFIX, "weight_packed",
                      "weight_zero_point", "weight_global_scale", "weight_scale_2", "weight_shape", "input_scale")
    fp8 = [m for m in report.dtype_mismatch if m.checkpoint.startswith("float8")]
    packed = [k for k in report.unexpected if k.endswith(scale_suffixes)]
    packed += [m.key for m in report.dtype_mismatch if m.checkpoint in ("uint8", "int32", "int8")]
    own = [i for i in report.rule_issues if i.rule.startswith("dequant")]
    if own:  # the adapter has its dequant rule, which could not read these tensors: say what it said
        first = own[0]
        more = f" (and {len(own) - 1} more rule problem(s))" if len(own) > 1 else ""
        return f"hint: the dequant rule #{first.index} cannot read the quantized tensors: {first.key}: {first.message}{more}"
    if not fp8 and not packed:
        return None
    mx = [k for k in packed if k.endswith((Q.MX_BLOCKS_SUFFIX, Q.MX_SCALES_SUFFIX))]
    other = [m.key for m in fp8] + [k for k in packed if k not in mx]
    have = [r for r in report.dequant_rules if r.endswith(" dequant_mxfp4") == bool(mx and not other)]
    if have:  # the adapter has a rule of the format, yet quantized tensors are left: its keys miss them
        report_rules, left = have, sorted(set(mx) | set(other))
        return (
            f"hint: the adapter's dequant rule(s) {', '.join(report_rules)} left quantized tensors unread "
            f"({', '.join(left[:3])}{' ...' if len(left) > 3 else ''}); widen the rule's keys= or take them out of "
            "its exclude=[...] (a cast rule is not enough: the values would miss their scales)"
        )
    return (
        "hint: the checkpoint is quantized (FP8 scales, packed or MXFP4 blocks); put sdadapt.dequant_rules(config.json) "
        "first in the adapter, or sdadapt.dequant_fp8(keys=..., block=[128, 128]) / sdadapt.dequant_mxfp4(keys=...) / "
        "sdadapt.dequant_scaled(...); "
        "a cast rule is not enough (the values would miss their scales)"
    )
