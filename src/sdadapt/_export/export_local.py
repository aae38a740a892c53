"""``export_iter(..., local=True)``: the regions of each output this rank can make from its own
shards, with their global boxes; nothing is gathered, no rank talks to another.

Each rank owns its shard of a tensor, except where the tensor is replicated: of the ranks holding
the same shard (the same coordinates on the mesh dims that shard it), the one at coordinate 0 of
the others owns it; of copies on meshes that do not cover the group (and of a plain tensor's),
the one on the mesh with the lowest rank counts. An output's box is the rank's when every
region of a source tensor its recipe reads lies in a shard the rank owns; a box whose reads lie
partly elsewhere is cut in two along its longest dim until each part is the rank's or another's.
Owned shards do not overlap and cover each tensor, so the ranks' regions cover each output once.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .._base.distributed import collective_device, is_distributed
from .._base.regions import Box, box_inside, box_shape, dtensor_box, full_box, intersect
from .._recipes.nodes import Compute, Node, Piece
from ..errors import ExportError


def owned_shard(t: torch.Tensor, rank: int, key: str, copy: bool = True) -> tuple[Box, torch.Tensor] | None:
    """The box of ``t`` this rank owns and its local tensor (on the CPU; ``copy=False``: where
    it is), or ``None``."""
    if not isinstance(t, DTensor):
        return (full_box(tuple(t.shape)), t.detach().cpu() if copy else t.detach()) if rank == 0 else None
    from torch.distributed.tensor import Replicate

    box = dtensor_box(t)
    if box is None:
        raise ExportError(
            f"export_iter(local=True): {key!r} has placements {t.placements}; local pieces need Shard and Replicate "
            "placements, or FSDP over a TP-sharded dim (use local=False, which gathers)"
        )
    coord = t.device_mesh.get_coordinate()
    if coord is None or any(c != 0 for c, p in zip(coord, t.placements, strict=True) if isinstance(p, Replicate)):
        return None
    return box, t._local_tensor.detach().cpu() if copy else t._local_tensor.detach()


class _Reads:
    """Notes the regions a recipe reads (values: zeros); serves them from owned shards when
    ``shards`` is given."""

    def __init__(self, dtypes: dict[str, torch.dtype], shards: dict[str, tuple[Box, torch.Tensor]] | None = None):
        self.dtypes, self.shards = dtypes, shards
        self.asked: list[tuple[str, Box]] = []

    def read(self, key: str, box: Box) -> torch.Tensor:
        if self.shards is None:
            self.asked.append((key, box))
            return torch.zeros(box_shape(box), dtype=self.dtypes[key])
        origin, local = self.shards[key]
        return local[tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(box, origin, strict=True))]


def reads_of(node: Node, box: Box, dtypes: dict[str, torch.dtype]) -> list[tuple[str, Box]]:
    """The regions of source tensors that region ``box`` of ``node`` is made from: its steps'
    pieces, and the inputs a computation declares followed down to their pieces (nothing is
    computed; a computation that declares no inputs is run on zeros)."""
    rec = _Reads(dtypes)
    _follow(node, box, rec)
    out: list[tuple[str, Box]] = []
    for a in rec.asked:
        if a not in out:
            out.append(a)
    return out


def _follow(node: Node, box: Box, rec: _Reads) -> None:
    for s in node.steps(box, torch.empty(box_shape(box), dtype=node.dtype, device="meta")):
        if isinstance(s, Piece):
            rec.asked.append((s.key, s.box))
        elif isinstance(s, Compute):
            if s.inputs:
                for i in s.inputs:
                    _follow(i.node, i.box, rec)
            else:
                assert s.fn is not None
                s.fn(rec)


def regions(node: Node, box: Box, owned: dict[str, Box], dtypes: dict[str, torch.dtype], rank: int, name: str) -> Iterator[Box]:
    """The parts of ``box`` of ``node`` this rank makes from the shards it owns (``owned``): a
    box split in halves until each half is made from owned shards or from none. Each split
    halves the outermost dimension whose halving settles a half (all owned or none), else the
    longest, so that a row shard comes out as whole rows (contiguous bytes, one run in a file,
    one piece to send) rather than as column blocks."""
    reads = reads_of(node, box, dtypes)
    if not reads:  # filled, read from nowhere: rank 0's
        if rank == 0:
            yield box
        return
    mine = _owned(reads, owned)
    if mine == "all":
        yield box
        return
    if mine == "none":
        return
    longest = max(range(len(box)), key=lambda i: box[i][1] - box[i][0], default=-1)  # -1: a 0-d output
    d = next((i for i in range(len(box)) if _settles(node, box, i, owned, dtypes)), longest)
    a, b = box[d] if d >= 0 else (0, 1)
    if b - a <= 1:
        raise ExportError(
            f"export_iter(local=True): element {[s for s, _ in box]} of {name!r} is made from values that several ranks "
            "hold (a computed recipe across shards); use local=False, which gathers"
        )
    mid = (a + b) // 2
    for half in ((a, mid), (mid, b)):
        yield from regions(node, box[:d] + (half,) + box[d + 1 :], owned, dtypes, rank, name)


def _owned(reads: list[tuple[str, Box]], owned: dict[str, Box]) -> str:
    """Whether ``reads`` are ``"all"`` inside the owned shards, ``"none"`` of them touches one, or ``"some"``."""
    if all(k in owned and box_inside(b, owned[k]) for k, b in reads):
        return "all"
    if not any(k in owned and intersect(b, owned[k]) is not None for k, b in reads):
        return "none"
    return "some"


def _settles(node: Node, box: Box, d: int, owned: dict[str, Box], dtypes: dict[str, torch.dtype]) -> bool:
    """Whether halving ``box`` along ``d`` leaves a half made all from owned shards or from none."""
    a, b = box[d]
    if b - a <= 1:
        return False
    mid = (a + b) // 2
    return any(_owned(reads_of(node, box[:d] + (h,) + box[d + 1 :], dtypes), owned) != "some" for h in ((a, mid), (mid, b)))


def first_copies(state: dict[str, torch.Tensor], keys: list[str], group: dist.ProcessGroup | None) -> set[str]:
    """Collective (``keys`` the same list on every rank): the keys of which this rank holds the
    copy that counts. A tensor on a mesh that does not cover the group (FSDP over the data-parallel
    ranks of one TP coordinate: a 2-D job's parameter left out of the TP plan) has one copy per
    such mesh, and a plain tensor one per rank: of them, the copy whose mesh has the lowest rank
    counts. One all-reduce of one int64 per key."""
    if not is_distributed():
        return set(keys)
    me = dist.get_rank()
    mine = [_NOBODY if k not in state else int(t.device_mesh.mesh.min()) if isinstance(t := state[k], DTensor) else me for k in keys]
    lowest = torch.tensor(mine, dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN, group=group)
    return {k for k, m, low in zip(keys, mine, lowest.tolist(), strict=True) if m == low}


_NOBODY = 1 << 62


def local_pieces(state: dict[str, torch.Tensor], outputs: dict[str, Node], rank: int,
                 group: dist.ProcessGroup | None = None) -> Iterator[tuple[str, torch.Tensor, Box]]:  # fmt: skip
    """``(output key, region, its global box)`` for every region of every output this rank owns
    (collective first: which copies count, :func:`first_copies`)."""
    leaves = sorted({leaf for node in outputs.values() for leaf in node.leaves()})
    counted = first_copies(state, leaves, group)
    shards: dict[str, tuple[Box, torch.Tensor]] = {}
    for k in counted:
        t = state[k]
        got = owned_shard(t, rank, k) if isinstance(t, DTensor) else (full_box(tuple(t.shape)), t.detach().cpu())
        if got is not None:
            shards[k] = got
    owned = {k: box for k, (box, _) in shards.items()}
    dtypes = {k: t.dtype for k, t in state.items()}
    io = _Reads(dtypes, shards)
    for name, node in outputs.items():
        for box in regions(node, full_box(tuple(node.shape)), owned, dtypes, rank, name):
            yield name, node.read(box, io), box


__all__ = ["local_pieces", "owned_shard", "reads_of"]
