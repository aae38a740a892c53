"""A checkpoint's inventory: its tensors grouped by shape and dtype, runs of keys compressed
(what ``sdadapt inspect`` prints)."""

from __future__ import annotations

import re
from collections import defaultdict

from pydantic import BaseModel

from .._base.keyruns import compress
from .._base.schema import dtype_name
from .._base.summary import Summarized


class InventoryRow(BaseModel):
    """Keys sharing one compressed pattern (``layers.{0..31}.wq.weight``), shape and dtype."""

    keys: str
    count: int
    shape: list[int]
    dtype: str
    bytes: int  # all ``count`` tensors together


class Inventory(Summarized, BaseModel):
    """What a checkpoint holds, from its headers."""

    source: str
    kind: str
    tensors: int
    bytes: int
    dtypes: dict[str, int]  # dtype -> bytes
    rows: list[InventoryRow]
    non_tensor: list[str] = []

    def format(self) -> str:
        lines = [f"{self.kind} {self.source}"]
        header = ("keys", "n", "shape", "dtype", "bytes")
        table = [(r.keys, str(r.count), "[" + ", ".join(map(str, r.shape)) + "]", r.dtype, human(r.bytes)) for r in self.rows]
        widths = [max(len(h), *(len(t[i]) for t in table)) if table else len(h) for i, h in enumerate(header)]
        fmt = "  ".join(f"{{:{align}{w}}}" for align, w in zip("<><<>", widths, strict=True))
        lines.append(fmt.format(*header).rstrip())
        lines += [fmt.format(*t).rstrip() for t in table]
        by_dtype = ", ".join(f"{d} {human(b)}" for d, b in sorted(self.dtypes.items()))
        total = f"total: {self.tensors} tensors in {len(self.rows)} rows, {human(self.bytes)}"
        lines.append(total + (f" ({by_dtype})" if by_dtype else ""))
        if self.non_tensor:
            lines.append(f"not tensors ({len(self.non_tensor)}): {', '.join(compress(self.non_tensor))}")
        return "\n".join(lines)


def human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"  # pragma: no cover


_BRACES = re.compile(r"\{([0-9.,]+)\}")


def _matcher(pattern: str) -> tuple[re.Pattern[str], list[set[int]]]:
    """A regex for a compressed pattern plus, per ``{...}`` group, the integers it stands for."""
    sets: list[set[int]] = []
    parts: list[str] = []
    pos = 0
    for m in _BRACES.finditer(pattern):
        parts.append(re.escape(pattern[pos : m.start()]))
        parts.append(r"(\d+)")
        values: set[int] = set()
        for item in m.group(1).split(","):
            a, _, b = item.partition("..")
            values.update(range(int(a), int(b or a) + 1))
        sets.append(values)
        pos = m.end()
    parts.append(re.escape(pattern[pos:]))
    return re.compile("".join(parts) + r"\Z"), sets


def _member(key: str, matcher: tuple[re.Pattern[str], list[set[int]]]) -> bool:
    regex, sets = matcher
    m = regex.match(key)
    return m is not None and all(int(g) in s for g, s in zip(m.groups(), sets, strict=True))


def inventory(schema: dict, *, source: str = "", kind: str = "", non_tensor: list[str] | None = None) -> Inventory:
    """Group a schema's keys by (shape, dtype), compress each group's runs; rows in key order."""
    order = {k: i for i, k in enumerate(schema)}
    groups: dict[tuple[tuple[int, ...], str], list[str]] = defaultdict(list)
    for key, info in schema.items():
        groups[(tuple(info.shape), dtype_name(info.dtype))].append(key)
    rows: list[tuple[int, InventoryRow]] = []
    dtypes: dict[str, int] = defaultdict(int)
    for (shape, dtype), keys in groups.items():
        remaining = list(keys)
        for pattern in compress(keys):
            matcher = _matcher(pattern)
            members = [k for k in remaining if _member(k, matcher)] if pattern not in order else [pattern]
            if not members:  # cannot happen for keyruns' patterns; keep every key visible anyway
                continue
            taken = set(members)
            remaining = [k for k in remaining if k not in taken]
            nbytes = sum(schema[k].nbytes for k in members)
            dtypes[dtype] += nbytes
            row = InventoryRow(keys=pattern, count=len(members), shape=list(shape), dtype=dtype, bytes=nbytes)
            rows.append((min(order[k] for k in members), row))
        for k in remaining:
            dtypes[dtype] += schema[k].nbytes
            rows.append((order[k], InventoryRow(keys=k, count=1, shape=list(shape), dtype=dtype, bytes=schema[k].nbytes)))
    rows.sort(key=lambda r: r[0])
    return Inventory(
        source=source,
        kind=kind,
        tensors=len(schema),
        bytes=sum(i.nbytes for i in schema.values()),
        dtypes=dict(dtypes),
        rows=[r for _, r in rows],
        non_tensor=list(non_tensor or []),
    )
