"""Compress runs of keys for humans: ``layers.0.wq``, ..., ``layers.31.wq`` -> ``layers.{0..31}.wq``."""

from __future__ import annotations

from collections import defaultdict


def _ranges(values: list[int]) -> str:
    values = sorted(set(values))
    out: list[str] = []
    start = prev = values[0]
    for v in values[1:]:
        if v == prev + 1:
            prev = v
            continue
        out.append(f"{start}..{prev}" if prev > start else str(start))
        start = prev = v
    out.append(f"{start}..{prev}" if prev > start else str(start))
    return "{" + ",".join(out) + "}"


def _is_index(seg: str) -> bool:
    """A segment that is a plain index: ASCII digits without leading zeros (so that distinct
    keys such as ``a.01`` and ``a.1`` never merge into one row)."""
    return seg.isascii() and seg.isdigit() and (seg == "0" or seg[0] != "0")


def compress(keys: list[str] | set[str]) -> list[str]:
    """Group keys that differ only in integer segments; returns sorted readable patterns."""
    rows = [tuple(k.split(".")) for k in keys]
    positions = sorted({i for r in rows for i, s in enumerate(r) if _is_index(s)}, reverse=True)
    for p in positions:
        groups: dict[tuple[object, ...], list[int]] = defaultdict(list)
        passthrough: list[tuple[str, ...]] = []
        for r in rows:
            if len(r) > p and _is_index(r[p]):
                groups[(len(r),) + r[:p] + r[p + 1 :]].append(int(r[p]))
            else:
                passthrough.append(r)
        rows = passthrough
        for g, vals in groups.items():
            rest = g[1:]
            seg = str(vals[0]) if len(set(vals)) == 1 else _ranges(vals)
            rows.append(tuple(rest[:p]) + (seg,) + tuple(rest[p:]))  # type: ignore[arg-type]
    return sorted(".".join(r) for r in rows)
