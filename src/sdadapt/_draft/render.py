"""Write the drafted adapter as a readable Python module in the house style.

Rules are grouped (prefixes, drops, one section per pair of blocks, ties, casts), each preceded
by a comment with its evidence and confidence; ``UNCERTAIN`` marks weak evidence and
``DECIDE`` marks value-level choices left to the user as commented-out rules.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from .._base.rule_kinds import RULE_KINDS

_FUNCTIONS = frozenset(fn for _, _, fn in RULE_KINDS)
"""Kinds that :mod:`sdadapt` builds with a function of the kind's name; any other rule is written
as its class in :mod:`sdadapt.rules` (``sdadapt.rules.DequantGPTQ(...)``) with keyword fields."""

_POSITIONAL = {
    "rename": ("src", "dst"),
    "fuse": ("srcs", "dst"),
    "split": ("src", "dsts"),
    "drop": ("keys",),
    "tie": ("dst", "src"),
    "transpose": ("keys",),
    "stack": ("src", "dst"),
    "unstack": ("src", "dst"),
    "cast": ("keys", "dtype"),
    "strip_prefix": ("prefix",),
    "add_prefix": ("prefix",),
    "rotary": ("keys",),
    "affine": ("keys",),
}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "fuse": {"dim": 0, "sizes": None, "heads": None},
    "split": {"dim": 0, "sizes": None, "heads": None},
    "rotary": {"dim": 0, "heads": None, "head_dim": None, "rotary_dim": None},
    "affine": {"scale": 1.0, "shift": 0.0, "invert": False},
    "transpose": {"dim0": 0, "dim1": 1},
    "stack": {"over": "e", "dim": 0, "count": None},
    "unstack": {"over": "e", "dim": 0, "count": None},
    "cast": {"from_dtype": None},
    "strip_prefix": {"optional": False},
    "add_prefix": {"keys": "**"},
}


def _lit(v: Any) -> str:
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_lit(x) for x in v) + "]"
    return repr(v)


def rule_code(rule: BaseModel, width: int = 110, indent: str = "        ") -> str:
    """``sdadapt.rename("a.{i}.w", "b.{i}.w")``: the constructor call that builds ``rule``."""
    data = rule.model_dump()
    kind = data.pop("kind")
    if kind in _FUNCTIONS:
        call = f"sdadapt.{kind}"
        pos = _POSITIONAL.get(kind, ())
        args = [_lit(data.pop(k)) for k in pos]
        defaults = _DEFAULTS.get(kind, {})
        args += [f"{k}={_lit(v)}" for k, v in data.items() if k not in defaults or defaults[k] != v]
    else:
        call = f"sdadapt.rules.{type(rule).__name__}"
        args = [f"{k}={_lit(v)}" for k, v in rule.model_dump(exclude_defaults=True).items() if k != "kind"]
    one = f"{call}({', '.join(args)})"
    if len(indent) + len(one) + 1 <= width:
        return one
    inner = indent + "    "
    parts = []
    for a in args:
        if a.startswith("[") and len(inner) + len(a) + 1 > width:
            items = json.loads(a) if a.startswith('["') else None
            if items is not None:
                a = "[\n" + "".join(f"{inner}    {json.dumps(x)},\n" for x in items) + inner + "]"
        parts.append(a)
    return f"{call}(\n" + "".join(f"{inner}{p},\n" for p in parts) + indent + ")"


def comment(text: str, indent: str = "        ", width: int = 110) -> list[str]:
    words = text.split()
    lines: list[str] = []
    cur = ""
    for w in words:
        if cur and len(indent) + 2 + len(cur) + 1 + len(w) > width:
            lines.append(f"{indent}# {cur}")
            cur = w
        else:
            cur = f"{cur} {w}" if cur else w
    if cur:
        lines.append(f"{indent}# {cur}")
    return lines


def render_module(
    *,
    source: str,
    target: str,
    sections: list[tuple[str, list[tuple[list[str], list[str]]]]],
    remaining: str,
    related: bool,
    summary: list[str],
    stages: list[int] | None = None,
) -> str:
    """The module text. ``sections``: (title, [(comment lines, code lines)]); code lines that
    are comments (DECIDE notes, commented-out rules) are written as they are."""
    out = [
        '"""Adapter drafted by `sdadapt draft`; review it before use.',
        "",
        f"checkpoint: {source}",
        f"model:      {target}",
        "",
        "Each rule follows a comment with its evidence and confidence (0-1). UNCERTAIN marks rules",
        "proposed on weak evidence; DECIDE marks value-level choices shapes cannot show (a commented-out",
        "rule to enable or delete). Load it with `--adapter this_file.py:ADAPTER`.",
        '"""',
        "",
        "import sdadapt",
        "",
    ]
    if not related:
        out += ["# No adapter proposed:"] + [f"#   {s}" for s in summary] + [""]
    if not any(entries for _title, entries in sections):
        out += ["ADAPTER = sdadapt.Adapter([], name=\"draft\")", ""]
        out.append("# What `sdadapt diff` reports without an adapter:")
        out += [f"#   {line}" if line else "#" for line in remaining.splitlines()]
        return "\n".join(out) + "\n"
    out += ["ADAPTER = sdadapt.Adapter(", "    ["]
    for title, entries in sections:
        if not entries:
            continue
        out.append(f"        # --- {title} " + "-" * max(3, 96 - len(title)))
        for comments, code in entries:
            out += comments
            out += [c if c.lstrip().startswith("#") else f"        {c}," for c in code]
        out.append("")
    if out[-1] == "":
        out.pop()
    out += ["    ],", '    name="draft",']
    if stages:  # the rules from these indices on apply to the keys the earlier ones produced (a + b)
        out.append(f"    stages={stages!r},")
    out += [f"    description={json.dumps(f'drafted from {source} for {target}')},", ")", ""]
    out.append("# What `sdadapt diff` still reports with this adapter:")
    out += [f"#   {line}" if line else "#" for line in remaining.splitlines()]
    return "\n".join(out) + "\n"
