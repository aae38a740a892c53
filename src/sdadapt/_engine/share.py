"""Reading once for replicas (``sdadapt.load(..., share_reads=True)``).

Ranks along a mesh dim where a DTensor is ``Replicate`` (HSDP's replicate dim, a TP-replicated
norm) hold the same local shard, and by default each of them reads all of it. With shared
reads, each of the R ranks of that dim reads one row block of the shard (dim 0 cut in R nearly
equal parts) and, once every rank has read, each block is broadcast within the dim's process
group: every rank reads 1/R of those bytes and receives the rest over the interconnect (NVLink
with NCCL, the network or loopback with gloo).

The order of collectives is the order of the load's items, the same on every member of a group
(they have the same keys and placements). Before broadcasting, the members agree on whether all
of them read their parts; if one failed, nobody broadcasts (no hang) and the load fails as any
read failure does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .._base.distributed import any_rank
from .tasks import Job


@dataclass
class Share:
    """One job's destination, cut along dim 0 among the members of ``group``."""

    group: dist.ProcessGroup
    ranks: list[int]  # global rank of each member, in group order
    dest: torch.Tensor
    parts: list[tuple[int, int]]  # [start, stop) of each member's block along dim 0


def replica_dim(t: torch.Tensor) -> int | None:
    """The mesh dim over which ``t`` is replicated on more than one rank (the largest such dim,
    the first of equals), or ``None``."""
    if not isinstance(t, DTensor):
        return None
    best = None
    for i, p in enumerate(t.placements):
        n = t.device_mesh.size(i)
        if p.is_replicate() and n > 1 and (best is None or n > t.device_mesh.size(best)):
            best = i
    return best


def split(jobs: Sequence[Job], targets: Sequence[torch.Tensor | None]) -> tuple[list[Job], list[Share]]:
    """The jobs this rank reads (replicated ones cut to its block) and what to broadcast after.

    ``targets[i]`` is the DTensor (or ``None``) whose local shard ``jobs[i].dest`` is part of."""
    mine: list[Job] = []
    shares: list[Share] = []
    groups: dict[tuple[int, int], tuple[dist.ProcessGroup, list[int], int]] = {}
    for job, target in zip(jobs, targets, strict=True):
        dim = replica_dim(target) if target is not None else None
        if dim is None or not job.box or not job.dest.is_contiguous():
            mine.append(job)
            continue
        mesh = target.device_mesh  # type: ignore[union-attr]
        key = (id(mesh), dim)
        if key not in groups:
            group = mesh.get_group(dim)
            groups[key] = (group, dist.get_process_group_ranks(group), dist.get_group_rank(group, dist.get_rank()))
        group, ranks, me = groups[key]
        a, b = job.box[0]
        n, r = b - a, len(ranks)
        parts = [(j * n // r, (j + 1) * n // r) for j in range(r)]
        s, e = parts[me]
        if e > s:
            mine.append(Job(job.key, job.node, ((a + s, a + e),) + tuple(job.box[1:]), job.dest.narrow(0, s, e - s)))
        shares.append(Share(group, ranks, job.dest, parts))
    return mine, shares


def exchange(shares: Sequence[Share], failed: bool) -> None:
    """Collective over each share's group: agree that every member read its blocks, then
    broadcast every block from its reader. A group in which a member failed broadcasts nothing
    (its members all skip it, so nobody waits; the load then fails as any read failure does)."""
    groups = list({id(sh.group): sh.group for sh in shares}.values())  # first-seen order, same on every member
    ok = {id(g) for g in groups if not any_rank(failed, g)}
    works = [
        dist.broadcast(sh.dest.narrow(0, s, e - s), src=src, group=sh.group, async_op=True)
        for sh in shares
        if id(sh.group) in ok
        for (s, e), src in zip(sh.parts, sh.ranks, strict=True)
        if e > s
    ]
    for w in works:
        w.wait()
