"""A dry run's ranks on nodes of ``ranks_per_node`` ranks each, in rank order: whether a TP
group's rows are shared (``EngineConfig.share_rows="auto"``: where the group spans nodes), and
what the ranks of one node make storage deliver together. The ranks of a node share its page
cache, so storage delivers each page their reads touch once, however many of them read it."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from .._engine.syscalls import storage_bytes
from .._plan.layout import Layout, Mesh

Extents = Mapping[str, Sequence[tuple[int, int]]]  # file -> the (start, stop) ranges a rank's reads ask storage for


def rows_apart(grid: Mesh, layout: Layout, coord: tuple[int, ...], mesh_dim: int, per_node: int) -> bool:
    """Whether the members of the row group on ``layout``'s flattened mesh dim ``mesh_dim`` (the
    rank at ``coord`` among them) lie on more than one node."""
    dims = layout.groups[mesh_dim][0]
    nodes = set()
    for k in range(math.prod(grid.sizes[d] for d in dims)):
        at = list(coord)
        for d in reversed(dims):
            at[d], k = k % grid.sizes[d], k // grid.sizes[d]
        nodes.add(grid.rank_of(tuple(at)) // per_node)
    return len(nodes) > 1


def rows_said(share_rows: bool | str, shared: Iterable[int], per_node: int) -> str:
    """How the dry run shares TP rows, given each planned rank's bytes received from TP peers."""
    if share_rows != "auto":
        return "on" if share_rows else "off"
    on = any(shared)
    return f"auto ({'on: TP groups span' if on else 'off: every TP group within'} nodes of {per_node} ranks)"


def node_storage(ranks: Iterable[tuple[Extents, int]]) -> int:
    """What a node's ranks make a cold page cache they share read from storage: every page any
    of their ``preadv`` extents touches, once per file, and the pages of their mapped reads
    (``(extents, mapped_span)`` per rank)."""
    files: dict[str, list[tuple[int, int]]] = {}
    mapped = 0
    for extents, span in ranks:
        mapped += span
        for path, ext in extents.items():
            files.setdefault(path, []).extend(ext)
    return mapped + sum(storage_bytes(ext) for ext in files.values())
