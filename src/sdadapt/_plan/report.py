"""The Report: everything that does not line up between a checkpoint and a model.

Pydantic models, so a report serialises (``report.model_dump_json()``) and prints
(``str(report)``) with runs of keys compressed and nearest-name suggestions.
"""

from __future__ import annotations

import difflib
import re
from collections import Counter, defaultdict

from pydantic import BaseModel, ConfigDict, computed_field

from .._base.keyruns import compress
from .._base.summary import Summarized
from ..rules import RuleIssue

_INDEX = re.compile(r"\.\d+(?=[.,\])\[]|$)")  # ".3." in a recipe -> ".{i}."

CAST_FIX = 'sdadapt.cast("**", "model")'
"""The one rule that fixes any dtype-only mismatch: each tensor to the model's dtype for it."""

NOT_NUMBERS = (
    "note: this compares names, shapes and dtypes only, not values: a wrong row order inside "
    "heads, an interleaved fused tensor or a missing (1 + w) still lines up. Check the numbers "
    "with {verify} (logits against a reference)"
)
"""What a key mapping does not show, and where the numerical check is (``{verify}``: the CLI's
or Python's spelling, :data:`VERIFY`)."""

VERIFY = {True: "`sdadapt verify SRC --model M --adapter A`", False: "sdadapt.verify(model, reference)"}

VERDICT_UNCHECKED = "OK: checkpoint and model line up by names and shapes; values unchecked"
"""The verdict of a clean report when no numerical check ran: a line-up is not a right load."""


class Mismatch(BaseModel):
    # built when a mismatch is first validated (Report's own schema holds it meanwhile)
    model_config = ConfigDict(defer_build=True)

    key: str
    model: str  # what the model wants (shape or dtype)
    checkpoint: str  # what the checkpoint + adapter give
    recipe: str  # how the value is made, e.g. "cat([q, k, v], dim=0)"


class Report(Summarized, BaseModel):
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
        resized: keys whose shape differs from the checkpoint's where ``allow_resized`` allows
            it: not read, given values as allowed missing keys are.
        dropped: checkpoint keys a ``drop`` rule took.
        widened: keys whose stored dtype widens exactly to the model's (bfloat16 -> float32),
            loaded so with no cast rule.
        looked_for: missing key -> the checkpoint key(s) the adapter would have made it from.
        values_checked: what numerical check ran on the values, if any.
        dequant_rules: the adapter's dequantising rules, for the quantized-source hint.
        suggestion: a shipped adapter for the checkpoint's family, when none was given
            (:func:`~sdadapt._plan.registry.shipped_hint`).

    Example::

        report = sdadapt.diff(model, "ckpt/", "llama")
        assert report.ok, report.format()
    """

    # built when a report is first validated or dumped: a plan makes its report with model_construct
    model_config = ConfigDict(defer_build=True)

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
    resized: list[Mismatch] = []  # shapes that differ where allow_resized allows it: not read
    dropped: list[str] = []
    widened: list[str] = []  # keys whose stored dtype widens exactly to the model's (bfloat16 -> float32)
    looked_for: dict[str, list[str]] = {}  # missing key -> the checkpoint key(s) the adapter looked for
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
    def found(self) -> int:
        """How many model keys the checkpoint + adapter give by name, whatever their shape and
        dtype: ``matched`` and the mismatched ones."""
        return self.matched + len(self.shape_mismatch) + len(self.dtype_mismatch) + len(self.resized)

    @property
    def mostly_unmatched(self) -> bool:
        """Fewer than half of the model's keys found by name: a wrong adapter or checkpoint, not
        typos (keys found with another shape are not unmatched: a model of another size)."""
        return bool(self.target_keys) and 2 * self.found < self.target_keys

    def suggestions(self) -> dict[str, str]:
        """Compressed missing key -> the closest compressed unexpected key, for near misses only
        (a misspelling); none when most keys are unmatched, where names are no guide."""
        if not self.missing or not self.unexpected or self.mostly_unmatched:
            return {}
        pool, missing = compress(self.unexpected), compress(self.missing)
        out = {}
        for m in missing:
            if _fuse_parts(m, pool, missing):
                continue  # several checkpoint keys make it: a fuse (see fuse_hints), not a misspelling
            near = difflib.get_close_matches(m, pool, n=1, cutoff=0.75)
            if near:
                out[m] = near[0]
        return out

    def fuse_hints(self) -> dict[str, str]:
        """Compressed missing key -> the unexpected keys beside it that a fuse would join: the
        model holds ``attn.qkv.weight`` where the checkpoint has ``attn.{q,k,v}_proj.weight``
        (same parent module, same leaf name), which no rename fixes."""
        if not self.missing or not self.unexpected or self.mostly_unmatched:
            return {}
        pool, missing = compress(self.unexpected), compress(self.missing)
        out = {}
        for m in missing:
            parts = _fuse_parts(m, pool, missing)
            if parts:
                module, _, leaf = m.rpartition(".")
                out[m] = f"{module.rpartition('.')[0]}.{{{','.join(parts)}}}.{leaf}"
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

    def root_cause(self, cli: bool = False) -> str | None:
        """One line naming the likeliest single cause of the problems, with its fix, if one
        explains them: a quantized checkpoint read without its dequant rule, dtypes only, a key
        prefix, or a wrong adapter or checkpoint. ``cli``: name the command line's options
        rather than Python's keywords."""
        quant = quant_hint(self)
        if quant:
            return quant.removeprefix("hint: ")
        if self.dtype_mismatch and self.problems == len(self.dtype_mismatch):
            pairs = Counter((m.checkpoint, m.model) for m in self.dtype_mismatch)
            what = ", ".join(f"{got} where the model holds {want} ({n} keys)" for (got, want), n in pairs.most_common(3))
            more = f" and {len(pairs) - 3} more pairs" if len(pairs) > 3 else ""
            return (
                f"only dtypes differ: the checkpoint gives {what}{more}; the one rule that fixes it: "
                f'{CAST_FIX} ' + ("(sdadapt diff --dtype model)" if cli else '(or sdadapt.load(..., dtype="model"))')
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

    def advice(self) -> str:
        """The closing line of a failed load: what to do about this kind of problem."""
        if quant_hint(self):
            return "Put the dequantising rule the hint names first in the adapter, then load again."
        kinds = {k for k, rows in (("missing", self.missing), ("unexpected", self.unexpected + self.non_tensor),
                                    ("shape", self.shape_mismatch), ("dtype", self.dtype_mismatch),
                                    ("rules", self.rule_issues + self.unused_rules)) if rows}
        if kinds == {"dtype"}:
            return (
                "Only dtypes differ, and these conversions lose values (narrower, or float <-> int; exact widenings "
                f'load as they are): convert on purpose with dtype="model" or {CAST_FIX}, or load into a model of the '
                "checkpoint's dtype."
            )
        if kinds == {"missing"}:
            return (
                "The checkpoint lacks these keys and has none left over: check that it is complete (every file of its "
                "index, every layer) and made for this model's size; if the model should initialise them itself, "
                "pass allow_missing=[patterns]."
            )
        if kinds == {"unexpected"}:
            return (
                "The model lacks these checkpoint keys: drop them in the adapter (sdadapt.drop(...)) or pass "
                "allow_unexpected=[patterns]; a checkpoint of a larger model (more layers) gives this too."
            )
        if kinds == {"shape"}:
            return (
                "Only shapes differ: build the model from the checkpoint's config (sizes, heads, vocabulary), or fix the "
                "adapter's rule for these keys; keys meant to differ (a head of another size, tokens added) can be "
                "named in allow_resized=[patterns], which initialises them as missing keys are."
            )
        return "Fix the adapter (sdadapt.diff gives this report without loading), or relax with allow_missing=/allow_unexpected= patterns."

    def _missing_rows(self) -> list[tuple[str, str]]:
        """The missing keys, compressed; where the adapter looked for checkpoint keys, a row per
        run of keys with the same index pattern on both sides: ``model key (checkpoint: key)``."""
        if not self.looked_for:
            return [(m, "") for m in compress(self.missing)]
        groups: dict[tuple[str, str], tuple[list[str], list[str]]] = defaultdict(lambda: ([], []))
        for key in self.missing:
            wanted = self.looked_for.get(key, [])
            g = groups[(_INDEX.sub(".{i}", key), _INDEX.sub(".{i}", ", ".join(wanted)))]
            g[0].append(key)
            g[1].extend(wanted)
        rows: list[tuple[str, str]] = []
        for keys, wanted in groups.values():
            looked = f" (the adapter looked for {', '.join(compress(wanted))})" if wanted else ""
            rows.extend((m, looked) for m in compress(keys))
        return sorted(rows)

    def resized_line(self) -> str:
        """One line for the keys ``allow_resized`` let differ in shape: each with the model's and
        the checkpoint's shapes (the first three), and that they were not read."""
        shown = ", ".join(f"{m.key} {m.model} (checkpoint {m.checkpoint})" for m in self.resized[:3])
        more = f" and {len(self.resized) - 3} more" if len(self.resized) > 3 else ""
        return f"resized (allow_resized, not read): {len(self.resized)} key(s): {shown}{more}"

    def counts(self) -> str:
        """The line of counts: model keys matched (and those found by name with another shape or
        dtype), checkpoint keys, problems."""
        other = [f"{n} with another {what}" for n, what in ((len(self.shape_mismatch), "shape"),
                                                            (len(self.dtype_mismatch), "dtype")) if n]
        other += [f"{len(self.resized)} resized"] if self.resized else []
        if other:
            head = f"{self.found} of {self.target_keys} model keys found by name ({', '.join(other)})"
        else:
            head = f"{self.matched} of {self.target_keys} model keys matched"
        return f"{head} ({self.source_keys} checkpoint keys); {self.problems} problem(s)"

    def format(self, max_rows: int | None = 8, cli: bool = False, held_as: str = "report") -> str:
        """The report as text: a root cause first when one explains the problems, then each
        kind of problem with at most ``max_rows`` rows (``None``: every row). ``cli``: for the
        command line, whose options it names (``--all``, ``--dtype``); else Python's spellings.
        ``held_as``: how the reader holds this report, for the line saying how to see every row
        (a :class:`~sdadapt.errors.PlanError` says ``err.report``)."""
        more = "--all lists every row" if cli else f"{held_as}.format(max_rows=None) lists every row"
        lines = [f"source {self.source}", f"target {self.target}"]
        if self.adapter:
            lines.append(f"adapter {self.adapter}")
        lines.append(self.counts())
        cause = self.root_cause(cli)
        if cause:
            lines.append(f"root cause: {cause}")
        hint = self.suggestion  # set by the caller once checked (a hint that finds fewer keys is never given)
        if hint:
            from .registry import spelled

            lines.append(f"hint: {spelled(hint, cli)}")

        def section(title: str, rows: list[str], count: int, note: str = "") -> None:
            if not rows:
                return
            lines.append(f"{title} ({count}){note}:")
            shown = rows if max_rows is None else rows[:max_rows]
            lines.extend(f"  {r}" for r in shown)
            if len(rows) > len(shown):
                lines.append(f"  ... and {len(rows) - len(shown)} more rows ({more})")

        hints = {m: f"did you mean {u}?" for m, u in self.suggestions().items()}
        hints.update({m: f"a fuse of {u}? (sdadapt.fuse, not a rename)" for m, u in self.fuse_hints().items()})
        section(
            "missing: the model has these, the checkpoint + adapter do not give them",
            [m + looked + (f"    <- {hints[m]}" if m in hints else "") for m, looked in self._missing_rows()],
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
            rows = compress(self.widened)
            shown = ", ".join(rows[:3]) + (f" and {len(rows) - 3} more" if len(rows) > 3 else "")
            lines.append(f"widened exactly to the model's dtype (no value changes): {len(self.widened)} key(s): {shown}")
        if self.resized:
            lines.append(self.resized_line())
        if self.allowed_missing or self.allowed_unexpected:
            lines.append(
                f"allowed: {len(self.allowed_missing)} missing and {len(self.allowed_unexpected)} unexpected key(s)"
            )
        if self.ok and self.matched and not self.values_checked:  # said once things line up, not with every error
            lines.append(NOT_NUMBERS.format(verify=VERIFY[cli]))
        if not self.ok:
            lines.append(f"NOT OK: {self.problems} problem(s)")
        elif self.values_checked:
            lines.append(f"OK: checkpoint and model line up; values checked: {self.values_checked}")
        else:
            lines.append(VERDICT_UNCHECKED)
        return "\n".join(lines)


# --- the hint for quantized checkpoints read without their dequant rule ---

def _fuse_parts(key: str, pool: list[str], missing: list[str]) -> list[str]:
    """The names of the modules beside ``key``'s in ``pool`` (compressed unexpected keys) that
    hold a tensor of its leaf name (``q_proj``, ``k_proj`` ... for ``attn.qkv.weight``), when
    there are at least two and ``key`` is the only one of ``missing`` there (several missing
    beside several unexpected, ``wq``/``wk`` against ``q_proj``/``k_proj``, are renames); else none."""

    def beside(keys: list[str], parent: str, leaf: str) -> list[str]:
        names = [k[len(parent) + 1 : -len(leaf) - 1] for k in keys if k.startswith(parent + ".") and k.endswith("." + leaf)]
        return [n for n in names if n and "." not in n]

    module, _, leaf = key.rpartition(".")
    parent = module.rpartition(".")[0]
    if not parent or len(beside(missing, parent, leaf)) > 1:
        return []
    names = beside(pool, parent, leaf)
    return names if len(names) >= 2 else []


def scale_keys(keys: list[str]) -> list[str]:
    """The keys named as a quantized format's scales, packed data or blocks (``*.weight_scale_inv``)."""
    from .._recipes import quant as Q  # the quantized formats' module: only for a report being read

    suffixes = (Q.FP8_SCALE_SUFFIX, "weight_scale", Q.MX_BLOCKS_SUFFIX, Q.MX_SCALES_SUFFIX, "weight_packed",
                "weight_zero_point", "weight_global_scale", "weight_scale_2", "weight_shape", "input_scale")
    return [k for k in keys if k.endswith(suffixes)]


def quant_hint(report: Report) -> str | None:
    """A hint line when a report's problems look like a quantized checkpoint read without its
    dequant rule: unexpected scale/packed keys, or FP8/uint8 data where the model wants floats."""
    from .._recipes import quant as Q  # the quantized formats' module: only for a report being read

    fp8 = [m for m in report.dtype_mismatch if m.checkpoint.startswith("float8")]
    packed = scale_keys(report.unexpected)
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
