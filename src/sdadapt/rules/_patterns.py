"""Whole-key patterns with captures, e.g. ``model.layers.{i}.self_attn.q_proj.weight``.

Syntax (anchored on the whole key):

- ``{name}``: one dotted segment (``[^.]+``), captured as ``name``;
- ``{name:int}``: one segment of digits; ``{name:*}``: any text, dots included;
- ``*``: one segment, not captured; ``**``: any text, dots included, not captured;
- everything else is literal.

An output pattern uses the same ``{name}`` placeholders, filled from the captures.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

from ..errors import AdapterError

_TOKEN = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(?::(int|\*))?\}|\*\*|\*")


class KeyPattern:
    """A compiled pattern; ``match(key)`` returns the captures or ``None``."""

    __slots__ = ("text", "names", "regex", "is_literal")

    def __init__(self, text: str):
        if not isinstance(text, str) or not text:
            raise AdapterError(f"a key pattern must be a non-empty string, got {text!r}")
        parts: list[str] = []
        names: list[str] = []
        pos = 0
        for m in _TOKEN.finditer(text):
            _check_literal(text, text[pos : m.start()])
            parts.append(re.escape(text[pos : m.start()]))
            tok = m.group(0)
            if tok == "**":
                parts.append(r".*")
            elif tok == "*":
                parts.append(r"[^.]+")
            else:
                name, kind = m.group(1), m.group(2)
                if name in names:
                    raise AdapterError(f"pattern {text!r} captures {{{name}}} twice; use another name")
                names.append(name)
                body = {None: r"[^.]+", "int": r"\d+", "*": r".+"}[kind]
                parts.append(f"(?P<{name}>{body})")
            pos = m.end()
        rest = text[pos:]
        _check_literal(text, rest)
        parts.append(re.escape(rest))
        self.text = text
        self.names = tuple(names)
        self.regex = re.compile("".join(parts) + r"\Z")
        self.is_literal = not names and "*" not in text

    def match(self, key: str) -> dict[str, str] | None:
        m = self.regex.match(key)
        return None if m is None else m.groupdict()

    def format(self, captures: dict[str, str]) -> str:
        """Fill this pattern's placeholders from ``captures`` (output side)."""
        try:
            return _fill(self.text, captures)
        except KeyError as e:
            raise AdapterError(
                f"output pattern {self.text!r} uses {{{e.args[0]}}}, which the input pattern does not capture"
            ) from None

    def __repr__(self) -> str:
        return f"KeyPattern({self.text!r})"


def _check_literal(text: str, literal: str) -> None:
    if "{" in literal or "}" in literal:
        raise AdapterError(
            f"pattern {text!r}: unbalanced or invalid braces; captures look like {{name}}, {{name:int}} or {{name:*}}"
        )


def _fill(text: str, captures: dict[str, str]) -> str:
    def sub(m: re.Match[str]) -> str:
        if m.group(1) is None:
            raise AdapterError(f"output pattern {text!r} may not contain '*' or '**'; name the capture instead")
        return captures[m.group(1)]

    return _TOKEN.sub(sub, text)


@functools.lru_cache(maxsize=4096)
def compile_pattern(text: str) -> KeyPattern:
    """Parse once, cache: patterns are plain data, compiled lazily (einops-style)."""
    return KeyPattern(text)


def check_output_pattern(inp: str | list[str], out: str) -> None:
    """Raise AdapterError if ``out`` needs a capture no input pattern provides."""
    ins = [inp] if isinstance(inp, str) else inp
    have: set[str] = set()
    for p in ins:
        have.update(compile_pattern(p).names)
    outp = compile_pattern(out)
    for m in _TOKEN.finditer(out):
        if m.group(1) is None:
            raise AdapterError(f"output pattern {out!r} may not contain '*' or '**'; name the capture instead")
    missing = [n for n in outp.names if n not in have]
    if missing:
        raise AdapterError(
            f"output pattern {out!r} uses {', '.join('{'+n+'}' for n in missing)}, "
            f"which the input pattern(s) {ins} do not capture"
        )


_NAMED_GROUP = re.compile(r"\(\?P<[A-Za-z_][A-Za-z0-9_]*>")


def _anonymous(pattern: KeyPattern) -> str:
    """``pattern``'s regex with its captures made anonymous (two patterns may capture one name)."""
    return _NAMED_GROUP.sub("(?:", pattern.regex.pattern)


def union(patterns: list[KeyPattern]) -> re.Pattern[str]:
    """One regex that matches a key whenever one of ``patterns`` does (their captures made
    anonymous, so that two patterns may capture the same name); none matches nothing. One
    C-level match instead of a Python call per pattern: a MoE checkpoint has ~10^5 keys."""
    if not patterns:
        return re.compile(r"(?!)")
    return re.compile("|".join(f"(?:{_anonymous(p)})" for p in patterns))


def latest_match(indexed: list[tuple[int, list[KeyPattern]]]) -> Callable[[str], int]:
    """``f(key)``: the largest index whose patterns match ``key`` (``-1``: none does), for
    ``indexed`` = ``(index, patterns)``. One regex, the largest index's patterns first: its first
    alternative to match names the index. One C-level match per key, and one compile for all
    the indices (a union per index would compile each pattern once per smaller index)."""
    owner: dict[str, int] = {}
    parts: list[str] = []
    for j, pats in sorted(indexed, key=lambda ip: -ip[0]):
        for p in pats:
            name = f"_{len(parts)}"
            owner[name] = j
            parts.append(f"(?P<{name}>{_anonymous(p)})")
    regex = re.compile("|".join(parts) if parts else r"(?!)")

    def latest(key: str) -> int:
        m = regex.match(key)
        return -1 if m is None or m.lastgroup is None else owner[m.lastgroup]

    return latest


@functools.lru_cache(maxsize=1024)
def union_of(texts: tuple[str, ...]) -> re.Pattern[str]:
    """:func:`union` of the key patterns written as ``texts``, compiled once per tuple."""
    return union([compile_pattern(t) for t in texts])


def matches_any(patterns: list[str], key: str) -> bool:
    """``key`` matches one of ``patterns``."""
    return union_of(tuple(patterns)).match(key) is not None


def capture_kinds(patterns: str | list[str]) -> dict[str, str]:
    """``{name: kind}`` for typed captures (``{rest:*}``, ``{i:int}``) of the given patterns."""
    out: dict[str, str] = {}
    for p in [patterns] if isinstance(patterns, str) else patterns:
        for m in _TOKEN.finditer(p):
            if m.group(1) is not None and m.group(2) is not None:
                out[m.group(1)] = m.group(2)
    return out


def typed_like(out: str, inputs: str | list[str]) -> str:
    """``out`` with each bare ``{name}`` given the type its input capture had, so that an
    output pattern can serve as the input of an inverse rule: ``typed_like("t.{rest}",
    "{rest:*}") == "t.{rest:*}"``."""
    kinds = capture_kinds(inputs)

    def sub(m: re.Match[str]) -> str:
        name = m.group(1)
        if name is None or m.group(2) is not None or name not in kinds:
            return m.group(0)
        return f"{{{name}:{kinds[name]}}}"

    return _TOKEN.sub(sub, out)
