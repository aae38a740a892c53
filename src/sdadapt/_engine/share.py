"""Reading once per group of ranks (``sdadapt.load(..., share_reads=True)``).

**Replicas.** Ranks along a mesh dim where a DTensor is ``Replicate`` (HSDP's replicate dim, a
TP-replicated norm) hold the same local shard, and by default each of them reads all of it.
With shared reads, each of the R ranks of that dim reads one row block of the shard (dim 0 cut
in R nearly equal parts; a shard too small for that is read whole by one of them,
:func:`replica_parts`) and, once every rank has read, each block is broadcast within the
dim's process group: every rank reads 1/R of those bytes and receives the rest over the
interconnect (NVLink with NCCL, the network or loopback with gloo).

**Rows.** Ranks along a mesh dim where a DTensor is ``Shard(d)`` with ``d >= 1`` (a TP
row-parallel weight: ``o_proj``, ``down_proj``, every expert's ``down_proj``) hold column
slices of the same rows. Each rank's part of a row is a short run, so reading it alone makes
storage deliver every page of the row (the gaps are read through, or page rounding costs as
much): a TP-8 rank reads about 8 times its bytes of those tensors from a cold disk. With shared
reads the R ranks of that dim split the rows (dim 0) among them instead: each reads a
contiguous range of whole rows of the R slices together, once, and the slices are exchanged,
one ``all_to_all`` per round within the group (:func:`exchange_rows`). The rounds run on a
thread of their own beside the engine's run over the rank's other reads
(:func:`read_and_exchange`), each round read while the previous one is exchanged. A round holds about
``EngineConfig.share_round_bytes`` of reads per rank, so a rank's extra memory is bounded: three
buffers (the rows it reads, what it sends, what it receives: about three times that), made once
and reused by every round (:func:`rounds_memory`); a tensor larger than a round is cut into
blocks of rows. A block too small to split well (each member
would read under :data:`MIN_SPLIT`, a few pages at 1024 ranks, where page rounding would cost
more than the bytes) is read whole by one member, the least loaded so far, so that each reads
long runs and about its share. A tensor is shared this way where the rank's own runs would
make storage deliver more than 1.1 times their bytes (:func:`row_cut`).

Both kinds compose: a replica's row block of a row-parallel weight is split again among its
TP peers, whose exchange comes first, then the replicas' broadcast.

The order of collectives is the order of the load's items, the same on every member of a group
(they have the same keys and placements). Every member runs every round's exchange, even after
a read of its own failed (it then reads no more and sends what its buffers hold), so no round
waits for an agreement and nobody hangs; the load then fails on every rank where the ranks
agree on its outcome after reading. Before broadcasting, the replicas agree on whether all of
them read their blocks; if one failed, nobody broadcasts.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Shard, _StridedShard

from .._base.distributed import any_rank
from .._base.regions import Box, box_shape, shard_box
from .blockcopy import copy_in_blocks as _copy
from .config import EngineConfig
from .tasks import Job

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

PAGE = 4096
ALIGN = 16  # each piece of a round's flat buffers starts on a multiple of this (any dtype's views)
ROW_GAIN = 1.1  # share a tensor's rows where reading its own runs would cost more than this
MIN_SPLIT = 1 << 20  # a block whose members would read less than this each (or half a round) is read whole by one of them


@dataclass
class Share:
    """One job's destination, cut along dim 0 among the members of ``group``."""

    group: dist.ProcessGroup
    ranks: list[int]  # global rank of each member, in group order
    dest: torch.Tensor
    parts: list[tuple[int, int]]  # [start, stop) of each member's block along dim 0
    me: int  # this rank's member index

    def received(self) -> int:
        """The bytes of the destination this rank receives from the other members."""
        s, e = self.parts[self.me]
        rows = self.dest.shape[0] if self.dest.dim() else 1
        return (self.dest.numel() * self.dest.element_size()) * (rows - (e - s)) // max(1, rows)


@dataclass(frozen=True)
class RowCut:
    """How the members of one mesh dim share the rows of a tensor they hold column slices of.

    ``mesh_dim``: the (flattened) mesh dim of the group; ``dim``: the tensor dim it cuts;
    ``cols``: each member's ``[start, stop)`` along ``dim`` (member ``k``: coordinate ``k`` on
    ``mesh_dim``), contiguous and in order; ``me``: this rank's member index."""

    mesh_dim: int
    dim: int
    cols: tuple[tuple[int, int], ...]
    me: int

    @property
    def span(self) -> tuple[int, int]:
        return self.cols[0][0], self.cols[-1][1]


@dataclass
class RowShare:
    """One job whose rows the members of ``group`` share (:class:`RowCut`)."""

    group: dist.ProcessGroup | None  # None in a dry run
    job: Job
    cut: RowCut


@dataclass(frozen=True)
class Unit:
    """A block of rows ``[start, stop)`` (global, along dim 0) of a row-shared job: each member
    reads its part of them across every member's columns."""

    share: RowShare
    start: int
    stop: int
    owner: int | None = None  # the one member that reads the whole block (a small one), or None

    def rows(self, k: int) -> tuple[int, int]:
        """Member ``k``'s rows of the block (global): all of them for its owner; else a share
        as large as its share of the columns, so that each member reads about its own shard's
        bytes."""
        if self.owner is not None:
            return (self.start, self.stop) if k == self.owner else (self.start, self.start)
        cols, n = self.share.cut.cols, self.stop - self.start
        first, width = cols[0][0], cols[-1][1] - cols[0][0]
        return self.start + n * (cols[k][0] - first) // width, self.start + n * (cols[k][1] - first) // width

    def read_box(self) -> Box:
        """The box this rank reads: its rows, every member's columns."""
        box, cut = self.share.job.box, self.share.cut
        out = list(box)
        out[0] = self.rows(cut.me)
        out[cut.dim] = cut.span
        return tuple(out)

    def piece_shape(self, j: int, k: int) -> tuple[int, ...]:
        """The shape of what member ``j`` sends member ``k``: ``j``'s rows, ``k``'s columns."""
        cut = self.share.cut
        shape = list(box_shape(self.share.job.box))
        a, b = self.rows(j)
        shape[0] = b - a
        shape[cut.dim] = cut.cols[k][1] - cut.cols[k][0]
        return tuple(shape)

    def piece_bytes(self, j: int, k: int) -> int:
        return math.prod(self.piece_shape(j, k)) * self.share.job.dest.element_size()

    def nbytes(self) -> int:
        """The block's bytes: its rows across every member's columns."""
        cut = self.share.cut
        shape = list(box_shape(self.share.job.box))
        shape[0] = self.stop - self.start
        shape[cut.dim] = cut.span[1] - cut.span[0]
        return math.prod(shape) * self.share.job.dest.element_size()

    def cost(self) -> int:
        """The block's bytes over the members: what each reads on average (the same on every member)."""
        return -(-self.nbytes() // len(self.share.cut.cols))


def replica_dim(t: torch.Tensor, mesh_shape: tuple[int, ...] | None = None) -> int | None:
    """The mesh dim over which ``t`` is replicated on more than one rank (the largest such dim,
    the first of equals), or ``None``. ``mesh_shape``: the shape of ``t``'s mesh where the caller
    has it (asking a mesh its sizes rebuilds its layout in some torch releases).

    Example::

        dim = replica_dim(dtensor)  # None for a tensor sharded on every mesh dim
    """
    if not isinstance(t, DTensor):
        return None
    sizes = mesh_shape if mesh_shape is not None else tuple(t.device_mesh.shape)
    best = None
    for i, p in enumerate(t.placements):
        n = sizes[i]
        if p.is_replicate() and n > 1 and (best is None or n > sizes[best]):
            best = i
    return best


def replica_parts(key: str, rows: int, nbytes: int, r: int) -> list[tuple[int, int]]:
    """Each of ``r`` replicas' block of a shard of ``rows`` rows along dim 0: nearly equal parts;
    or, where ``nbytes`` (the rows at the tensor's full width: the same for every replica and
    every TP peer, so that peers sharing rows cut alike) over ``r`` is under :data:`MIN_SPLIT`,
    the whole shard for one replica (picked from the key, so the same on every replica and in
    the dry run) and nothing for the others: short reads cost storage whole pages."""
    if nbytes < r * MIN_SPLIT:
        owner = zlib.crc32(key.encode()) % r
        return [(0, rows) if j == owner else (0, 0) for j in range(r)]
    return [(j * rows // r, (j + 1) * rows // r) for j in range(r)]


def row_cut(
    box: Box, shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: tuple[int, ...], placements: tuple[object, ...],
    itemsize: int, gap: int,
) -> RowCut | None:
    """Whether the members of a mesh dim share the rows of job ``box`` of a tensor of ``shape``
    placed by ``placements`` on a mesh of ``mesh_shape`` (this rank at ``coordinate``), and how.

    The dim is the largest one (the first of equals) whose placement is ``Shard(d)``, ``d >= 1``.
    Every member's shard must differ from this rank's only along ``d``, the members' columns
    must tile one range, each member must hold columns and the box rows, and the rows must be
    runs: some member reading its own runs would make storage deliver more than
    :data:`ROW_GAIN` times their bytes (runs at most ``gap`` bytes apart are read through; a
    run read alone costs a page more on average). Every member decides the same from the same
    geometry. ``None`` where the rows are not shared."""
    dims = [i for i, p in enumerate(placements)
            if isinstance(p, Shard) and not isinstance(p, _StridedShard) and p.dim >= 1 and mesh_shape[i] > 1]
    if not dims or not box or box[0][1] <= box[0][0]:
        return None
    i = max(dims, key=lambda j: (mesh_shape[j], -j))
    d = placements[i].dim  # type: ignore[attr-defined]
    mine = shard_box(shape, mesh_shape, coordinate, placements)
    if mine is None:
        return None
    cols = []
    for k in range(mesh_shape[i]):
        other = shard_box(shape, mesh_shape, coordinate[:i] + (k,) + coordinate[i + 1 :], placements)
        if other is None or any(other[x] != mine[x] for x in range(len(shape)) if x != d):
            return None
        cols.append(other[d])
    if any(b <= a for a, b in cols) or any(cols[k][1] != cols[k + 1][0] for k in range(len(cols) - 1)):
        return None
    if box[d] != mine[d] or math.prod(n for n in (b - a for a, b in box[:d])) < 2:
        return None  # one run: read whole already
    inner = math.prod(b - a for a, b in box[d + 1 :]) * itemsize
    span = (cols[-1][1] - cols[0][0]) * inner
    worst = 0.0
    for a, b in cols:
        run = (b - a) * inner
        cost = span if span - run <= gap else run + PAGE
        worst = max(worst, cost / run)
    if worst <= ROW_GAIN:
        return None
    return RowCut(i, d, tuple(cols), coordinate[i])


def split(
    jobs: Sequence[Job], targets: Sequence[torch.Tensor | None], rows_gap: int | None = None,
    spans_hosts: Callable[[dist.ProcessGroup], bool] | None = None,
) -> tuple[list[Job], list[Share], list[RowShare]]:
    """The jobs this rank reads on its own (replicated ones cut to its block), what to broadcast
    after, and the jobs whose rows it shares with its peers (``rows_gap``: the engine's
    ``gap_bytes``; ``None``: rows are not shared).

    ``targets[i]`` is the DTensor (or ``None``) whose local shard ``jobs[i].dest`` is part of.
    ``spans_hosts``: rows are shared only within the groups for which it answers ``True``
    (collective over the group: ``share_rows="auto"``'s question, whether its members run on
    more than one host); asked once per group that has rows to share, in one order on every
    rank (the groups' sorted ranks), so that no two ranks wait on each other's groups."""
    mine: list[Job] = []
    shares: list[Share] = []
    rows: list[RowShare] = []
    groups: dict[tuple[int, int], tuple[dist.ProcessGroup, list[int], int]] = {}

    def group_of(mesh: object, dim: int) -> tuple[dist.ProcessGroup, list[int], int]:
        key = (id(mesh), dim)
        if key not in groups:
            group = mesh.get_group(dim)  # type: ignore[attr-defined]
            groups[key] = (group, dist.get_process_group_ranks(group), dist.get_group_rank(group, dist.get_rank()))
        return groups[key]

    # each mesh's shape and this rank's coordinate, asked once: the jobs' tensors share a few meshes
    meshes: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}

    def geometry(mesh: DeviceMesh) -> tuple[tuple[int, ...], tuple[int, ...]]:
        if (found := meshes.get(id(mesh))) is None:
            found = meshes[id(mesh)] = (tuple(mesh.shape), tuple(mesh.get_coordinate() or ()))
        return found

    for job, target in zip(jobs, targets, strict=True):
        if not isinstance(target, DTensor) or not job.box or not job.dest.is_contiguous():
            mine.append(job)
            continue
        mesh_shape, coordinate = geometry(target.device_mesh)
        dim = replica_dim(target, mesh_shape)
        if dim is not None:
            group, ranks, me = group_of(target.device_mesh, dim)
            a, b = job.box[0]
            # the decision's bytes: the shard's rows at the tensor's full width, the same on every
            # replica and every TP peer (their slices may differ in width)
            width = math.prod(target.shape[1:]) * job.dest.element_size()
            parts = replica_parts(job.key, b - a, (b - a) * width, len(ranks))
            shares.append(Share(group, ranks, job.dest, parts, me))
            s, e = parts[me]
            if e <= s:
                continue
            job = Job(job.key, job.node, ((a + s, a + e),) + tuple(job.box[1:]), job.dest.narrow(0, s, e - s))
        cut = None
        if rows_gap is not None:
            cut = row_cut(job.box, tuple(target.shape), mesh_shape, coordinate, tuple(target.placements), job.dest.element_size(), rows_gap)
        if cut is None:
            mine.append(job)
        else:
            rows.append(RowShare(group_of(target.device_mesh, cut.mesh_dim)[0], job, cut))
    if spans_hosts is not None and rows:
        asked = {id(r.group): r.group for r in rows}
        order = sorted(asked.values(), key=lambda g: tuple(sorted(dist.get_process_group_ranks(g))))
        apart = {id(g) for g in order if spans_hosts(g)}  # type: ignore[arg-type]
        mine += [r.job for r in rows if id(r.group) not in apart]
        rows = [r for r in rows if id(r.group) in apart]
    return mine, shares, rows


def rounds(rows: Sequence[RowShare], round_bytes: int) -> list[list[Unit]]:
    """The row-shared jobs cut into blocks of rows and packed into rounds of at most
    ``round_bytes`` per member (a block alone may hold one row more), each round within one
    group; the same rounds on every member (the jobs taken in key order). Groups come in the
    order their first job does."""
    by_group: dict[object, list[Unit]] = {}
    loads: dict[object, list[int]] = {}  # bytes each member of a group reads so far
    for rs in sorted(rows, key=lambda x: (x.job.key, x.job.box)):  # one order for every member and the dry run
        a, b = rs.job.box[0]
        r = len(rs.cut.cols)
        one = Unit(rs, a, a + 1).cost()
        step = max(r, round_bytes // max(1, one))
        key = id(rs.group) if rs.group is not None else ("mesh dim", rs.cut.mesh_dim)
        load = loads.setdefault(key, [0] * r)
        for s in range(a, b, step):
            u = Unit(rs, s, min(b, s + step))
            if u.cost() < min(MIN_SPLIT, round_bytes // 2):  # too small to split well: whole to the least-loaded member
                owner = min(range(r), key=lambda k: (load[k], k))
                u = Unit(rs, u.start, u.stop, owner)
                load[owner] += u.nbytes()
            else:
                for k in range(r):
                    first, last = u.rows(k)
                    load[k] += u.nbytes() * (last - first) // (u.stop - u.start)
            by_group.setdefault(key, []).append(u)
    out: list[list[Unit]] = []
    for units in by_group.values():
        cur: list[Unit] = []
        size = 0
        for u in units:
            if cur and size + u.cost() > round_bytes:
                out.append(cur)
                cur, size = [], 0
            cur.append(u)
            size += u.cost()
        if cur:
            out.append(cur)
    return out


def read_jobs(units: Sequence[Unit], device: torch.device | str = "meta", buffer: torch.Tensor | None = None) -> list[Job]:
    """The jobs that read a round: each unit's rows across its members' columns, for the units
    this rank reads rows of (in their order), each into a new buffer on ``device``, or into
    views of ``buffer`` (uint8, at least :func:`round_sizes`' read bytes), one after the other."""
    jobs = []
    at = 0
    for u in units:
        box = u.read_box()
        if box[0][1] > box[0][0]:  # this rank reads rows of it
            dtype = u.share.job.dest.dtype
            if buffer is None:
                dest = torch.empty(box_shape(box), dtype=dtype, device=device)
            else:
                n = math.prod(box_shape(box)) * dtype.itemsize
                dest = buffer[at : at + n].view(dtype).view(box_shape(box))
                at += _up(n)
            jobs.append(Job(u.share.job.key, u.share.job.node, box, dest))
    return jobs


def round_sizes(units: Sequence[Unit]) -> tuple[int, int, int]:
    """The bytes of a round's three buffers on this rank: the rows it reads, what it sends, what
    it receives (each piece starting on a multiple of :data:`ALIGN`)."""
    me = units[0].share.cut.me if units else 0
    r = len(units[0].share.cut.cols) if units else 0
    read = sum(_up(math.prod(box_shape(u.read_box())) * u.share.job.dest.element_size()) for u in units)
    send = sum(_up(u.piece_bytes(me, k)) for u in units for k in range(r))
    recv = sum(_up(u.piece_bytes(j, me)) for u in units for j in range(r))
    return read, send, recv


def round_memory(units: Sequence[Unit]) -> int:
    """The bytes a round holds on this rank: the rows it read, what it sends, what it receives."""
    return sum(round_sizes(units))


def rows_config(cfg: EngineConfig) -> EngineConfig:
    """The settings of the engine that reads the rows' rounds beside a rank's other reads: its
    staging no larger than a round (it never holds more of a round's reads at once)."""
    return dataclasses.replace(cfg, staging_bytes=min(cfg.staging_bytes, cfg.share_round_bytes))


def rounds_memory(rounds: Sequence[Sequence[Unit]]) -> int:
    """The bytes the exchange of ``rounds`` holds on this rank: its three buffers, each as large
    as the largest round needs, allocated once and reused by every round (:func:`exchange_rows`)."""
    sizes = [round_sizes(units) for units in rounds]
    return sum(max((s[i] for s in sizes), default=0) for i in range(3))


def received(units: Sequence[Unit]) -> int:
    """The bytes of this rank's shards that a round brings from its peers."""
    return sum(u.piece_bytes(j, u.share.cut.me) for u in units for j in range(len(u.share.cut.cols)) if j != u.share.cut.me)


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _segments(units: Sequence[Unit], r: int, send: bool) -> tuple[list[int], list[list[int]]]:
    """Each member's segment size in a round's flat buffer, and each piece's offset within it
    (``send``: pieces to each member; else from each member)."""
    sizes, offsets = [], []
    for other in range(r):
        at, offs = 0, []
        for u in units:
            me = u.share.cut.me
            offs.append(at)
            at += _up(u.piece_bytes(me, other) if send else u.piece_bytes(other, me))
        sizes.append(at)
        offsets.append(offs)
    return sizes, offsets


def _pack(units: Sequence[Unit], jobs: Sequence[Job], r: int, send: torch.Tensor) -> list[int]:
    """A round's send buffer (each member's pieces, in member order, written into ``send``) from
    the rows this rank read (``jobs``: :func:`read_jobs` of ``units``); each member's segment size."""
    out_sizes, out_offs = _segments(units, r, send=True)
    mine = iter(jobs)
    read_of = [next(mine) if u.read_box()[0][1] > u.read_box()[0][0] else None for u in units]
    base = 0
    for k in range(r):
        for u, o, job in zip(units, out_offs[k], read_of, strict=True):
            cut = u.share.cut
            n = u.piece_bytes(cut.me, k)
            if n and job is not None:
                src = job.dest.narrow(cut.dim, cut.cols[k][0] - cut.span[0], cut.cols[k][1] - cut.cols[k][0])
                _copy(send[base + o : base + o + n].view(job.dest.dtype).view(src.shape), src)
        base += out_sizes[k]
    return out_sizes


def _unpack(units: Sequence[Unit], recv: torch.Tensor, r: int) -> None:
    """Each member's pieces of a round's receive buffer into this rank's destinations."""
    in_sizes, in_offs = _segments(units, r, send=False)
    base = 0
    for j in range(r):
        for u, o in zip(units, in_offs[j], strict=True):
            me, dest = u.share.cut.me, u.share.job.dest
            a, b = u.rows(j)
            n = u.piece_bytes(j, me)
            if n:
                piece = recv[base + o : base + o + n].view(dest.dtype).view(u.piece_shape(j, me))
                _copy(dest.narrow(0, a - u.share.job.box[0][0], b - a), piece)
        base += in_sizes[j]


def exchange_rows(
    rows: Sequence[RowShare], read: Callable[[list[Job]], object], stop: threading.Event, round_bytes: int
) -> tuple[BaseException | None, int]:
    """Collective over each row group: for each round, read this rank's part (``read`` runs the
    engine over the jobs), pack the slices and post one ``all_to_all``; the next round is read
    while it is in flight, then its pieces are copied into the destinations.

    Every member runs every round's exchange, whatever fails, so that no member waits for
    another; no round needs an agreement. Once ``stop`` is set (a read of this rank failed, in a
    round or in the caller's run beside it) this rank reads nothing more and sends what its
    buffers hold: its peers' shards are then wrong, and the load fails on every rank where the
    ranks agree on its outcome after reading. Returns the first error of this rank's rounds (a
    read's, or the exchange's own), if any, and the bytes received from peers."""
    error: BaseException | None = None
    got = 0
    pending: tuple[object, list[Unit], torch.Tensor] | None = None

    def finish() -> None:
        nonlocal pending, got, error
        if pending is None:
            return
        work, units, recv = pending
        pending = None
        work.wait()  # type: ignore[attr-defined]
        if stop.is_set():
            return  # the load fails: the pieces are not copied
        try:
            _unpack(units, recv, len(units[0].share.cut.cols))
        except BaseException as e:  # noqa: BLE001 - later rounds' exchanges must still run (no hang)
            error = error or e
            stop.set()
            return
        got += received(units)

    planned = rounds(rows, round_bytes)
    sizes = [round_sizes(units) for units in planned]
    buffers: dict[torch.device, list[torch.Tensor]] = {}  # read, send, receive: made once, as large as the largest round's
    for units, (_, n_send, n_recv) in zip(planned, sizes, strict=True):
        group = units[0].share.group
        device = units[0].share.job.dest.device
        r = len(units[0].share.cut.cols)
        if device not in buffers:
            buffers[device] = [torch.empty(max(s[i] for s in sizes), dtype=torch.uint8, device=device) for i in range(3)]
        read_buf, send, recv = buffers[device]
        jobs = read_jobs(units, device, read_buf)
        if not stop.is_set():
            try:
                read(jobs)
            except BaseException as e:  # noqa: BLE001 - the peers still exchange with this rank (no hang)
                error = error or e
                stop.set()
        finish()  # the previous round's exchange is over: its send and receive buffers are free again
        out_sizes = _segments(units, r, send=True)[0]
        if not stop.is_set():  # else the buffer is sent as it is (the load fails)
            try:
                _pack(units, jobs, r, send)
                if device.type == "cuda":  # the copies out of the read buffer are done before the next round reads into it
                    torch.cuda.current_stream(device).synchronize()
            except BaseException as e:  # noqa: BLE001 - as above
                error = error or e
                stop.set()
        in_sizes = _segments(units, r, send=False)[0]
        work = dist.all_to_all_single(recv[:n_recv], send[:n_send], in_sizes, out_sizes, group=group, async_op=True)
        pending = (work, units, recv[:n_recv])
    finish()
    return error, got


def read_and_exchange(
    read_own: Callable[[], object] | None, rows: Sequence[RowShare], read_rows: Callable[[list[Job]], object] | None, round_bytes: int
) -> tuple[BaseException | None, BaseException | None, int]:
    """Collective over each row group: ``read_own()`` (the engine over this rank's other jobs)
    on this thread while a second thread reads and exchanges the rows' rounds
    (:func:`exchange_rows`, ``read_rows`` reading each round), so that the exchanges overlap
    the reads. A failure of either stops the other's reads (the exchanges still run);
    ``read_own=None``: this rank failed before reading (it reads nothing, and still exchanges);
    ``read_rows=None``: there are no rows (``rows`` empty), only ``read_own`` runs.
    Returns the error of ``read_own``, that of the rounds, and the bytes received from peers."""
    if rows and read_rows is None:
        raise ValueError("read_and_exchange: rows to exchange need read_rows, the reader of their rounds")
    stop = threading.Event()
    if read_own is None:
        stop.set()
    out: list[tuple[BaseException | None, int]] = []
    device = next((r.job.dest.device for r in rows), None)

    def rounds_thread(read: Callable[[list[Job]], object]) -> None:
        try:
            if device is not None and device.type == "cuda":
                with torch.cuda.device(device):
                    out.append(exchange_rows(rows, read, stop, round_bytes))
                    torch.cuda.current_stream(device).synchronize()  # the pieces are in place on return
            else:
                out.append(exchange_rows(rows, read, stop, round_bytes))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            out.append((e, 0))

    thread = None
    if rows and read_rows is not None:
        thread = threading.Thread(target=rounds_thread, args=(read_rows,), name="sdadapt-rows", daemon=True)
        thread.start()
    own: BaseException | None = None
    try:
        if read_own is not None:
            read_own()
    except BaseException as e:  # noqa: BLE001 - the rounds still run (no hang); handed to the caller
        own = e
        stop.set()
    if thread is None:
        return own, None, 0
    thread.join()
    return own, out[0][0], out[0][1]


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
