"""``sdadapt.dry_run``: what every rank of a load at any world size would read, open and hold.

One process, no process group: the mesh is a shape (:class:`~sdadapt._plan.layout.Mesh`), each
rank's shard of each target tensor is computed from the mesh and the tensor's placements with
DTensor's own offset rule (:mod:`sdadapt._plan.layout`), and each rank's jobs go through the
engine's real planning on meta destinations (:mod:`sdadapt._engine.predict`): the byte ranges,
``preadv`` calls and files are those the load would have. The headers are read here once, and
counted as the load counts them: every rank opening every file, or (the default for a
distributed load) the first rank only, the others receiving them in one broadcast.

Symmetry: ranks whose coordinates agree on every mesh dim where some tensor is sharded or
owned (pipeline stages, expert owners; with shared reads, the replicated dims too) hold the same
shards and plan identically; each such class is planned once and counted ``ranks`` times. When
there are more classes than ``max_ranks``, an evenly spaced sample of them (the first and the
last included) is planned, and the totals are estimated from it (``exact=False``): the bytes
read as the sample's bytes read per shard byte times every rank's shard bytes, which are exact
either way (arithmetic), the opens as the sample's mean.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from pydantic import BaseModel
from torch import nn

from .._base.agreement import agreement_bytes
from .._base.regions import box_shape
from .._base.summary import Summarized
from .._engine import EngineConfig, RowShare, replica_parts, rounds_memory, row_cut, row_read_jobs, row_received, row_rounds, rows_config
from .._engine.predict import mapping_granule, predict
from .._engine.tasks import Job
from .._plan.adapter import Adapter, with_dtype
from .._plan.intent import PARTS
from .._plan.layout import Layout, Mesh, default_layouts, group_coordinate, local_box, model_layouts
from .._plan.plan import KeyPatterns, Plan, adapted_schema, build_plan, key_patterns
from .._plan.report import Report
from .._plan.resolve import adapter_or_none
from .._transaction.options import Options
from .._transaction.steps import open_checkpoint, plan_model
from ..errors import PlanError, UsageError
from ..sources import Source, TensorInfo, encode_headers, open_source, recording_headers
from .nodes import Extents, node_storage, rows_apart, rows_said

if TYPE_CHECKING:
    from typing import Unpack  # Python 3.11; annotations only, the package runs on 3.10


class DryRunRank(BaseModel):
    """The figures of one rank (and of every rank of its class, which plan identically).

    Attributes:
        rank: the rank planned.
        ranks: how many ranks share its shards (its class).
        coordinate: its mesh coordinate, by dim name.
        keys: target keys it holds a shard of.
        local_bytes: its destination shards' bytes.
        bytes_read: bytes it reads from the files.
        storage_bytes: the bytes storage delivers for its reads on a cold page cache: every
            file page they touch, once, the gaps a joined read of a column slice's rows reads
            through included (what ``read_bytes`` of ``/proc/<pid>/io`` shows).
        files_read: files it reads data from.
        file_bytes: bytes read per file.
        preadv_calls: ``preadv`` calls (one per run, or per joined runs of a column slice).
        mapped_reads: regions copied out of the files' mappings.
        opens: files it opens: headers, ``preadv`` and mappings.
        header_bytes: header and index bytes it reads from disk.
        header_bytes_received: header bytes it receives by broadcast.
        shared_bytes: bytes it receives from replicas, and from TP peers sharing the rows of
            column slices, instead of reading (``share_reads``).
        rows_bytes: the part of ``shared_bytes`` it receives from TP peers sharing rows
            (``EngineConfig.share_rows``; 0 where it reads its own column slices).
        staging_bytes: at most this much staging and band memory.
        host_bytes: the host memory the load adds: on CPU its shards, the staging it writes
            and the file pages its mapped reads touch; on GPU its pinned staging and those pages.
            Shared rows add their largest round's buffers on the shards' device.
        device_bytes: the GPU memory of its shards and row rounds (``device="cuda"``), else 0.
        tasks: the engine's tasks.
        plan_seconds: this dry run's time to plan the rank.

    Example::

        busiest = max(sdadapt.dry_run(None, "ckpt/", mesh="dp_shard=8").ranks, key=lambda r: r.bytes_read)
    """

    rank: int
    ranks: int
    coordinate: dict[str, int]
    keys: int
    local_bytes: int
    bytes_read: int
    storage_bytes: int = 0
    files_read: int
    file_bytes: dict[str, int]
    preadv_calls: int
    mapped_reads: int
    opens: int
    header_bytes: int
    header_bytes_received: int
    shared_bytes: int
    rows_bytes: int = 0
    staging_bytes: int
    host_bytes: int
    device_bytes: int
    tasks: int
    plan_seconds: float


class DryRunReport(Summarized, BaseModel):
    """What a load at a world size would do on each rank, from one process (:func:`dry_run`).

    Attributes:
        source: the checkpoint.
        target: what it is loaded into (a model's class name, or the checkpoint's own layout).
        mesh: the mesh, ``name=size`` per dim.
        world_size: ranks in the mesh.
        device: the device the shards are on (``cpu`` or ``cuda``).
        share_reads: whether replicas read once and broadcast, and ``share_why`` why.
        share_why: why (or why not).
        share_rows: TP row sharing (``EngineConfig.share_rows``): ``"on"``, ``"off"``, or
            ``"auto"``, on for the TP groups whose ranks lie on more than one node.
        headers: ``"once"`` (the first rank reads them, one broadcast) or ``"every"``.
        checkpoint_bytes: the checkpoint's tensor bytes.
        checkpoint_files: its files (headers and index included).
        classes: groups of ranks that plan identically.
        exact: every class planned (else the totals are estimated from a sample).
        ranks: the planned ranks, one per class, in rank order.
        total_local_bytes: every rank's shards together (exact).
        total_bytes_read: bytes read by all ranks.
        total_opens: files opened by all ranks.
        total_header_bytes: header bytes read from disk by all ranks.
        amplification: ``total_bytes_read / checkpoint_bytes``.
        ranks_per_node: ranks per node for the node figures.
        max_node_bytes_read: the most any node's ranks read together (exact runs only).
        node_bytes_read: the bytes the first node's ranks (0 to ``ranks_per_node - 1``) read together.
        node_storage_bytes: what those ranks make storage deliver together on a cold page cache,
            which they share: every file page their reads touch, once (TP peers reading their
            own column slices on one node touch each page of the rows, together, once).
        collective_bytes_per_rank: bytes each rank receives in the header broadcast.
        agreement_bytes_per_rank: bytes each rank puts into the all-reduce in which the ranks agree
            on the adapter, the plan and the versions (and on failures), at any world size.
        mapping_granule: what one fault on a file mapping makes resident here (4 KiB pages, or
            a large page-cache folio), as ``host_bytes`` counts mapped reads.
        seconds: the dry run's own time.
        report: the plan's :class:`Report`.

    Example::

        report = sdadapt.dry_run(None, "ckpt/", mesh="dp_shard=1024", headers="every")
        per_rank = {r.rank: r.bytes_read for r in report.ranks}
    """

    source: str
    target: str
    mesh: str
    world_size: int
    device: str
    share_reads: bool
    share_why: str
    share_rows: str = "off"
    headers: str
    checkpoint_bytes: int
    checkpoint_files: int
    classes: int
    exact: bool
    ranks: list[DryRunRank]
    total_local_bytes: int
    total_bytes_read: int
    total_opens: int
    total_header_bytes: int
    amplification: float
    ranks_per_node: int
    max_node_bytes_read: int | None
    node_bytes_read: int = 0
    node_storage_bytes: int = 0
    collective_bytes_per_rank: int
    agreement_bytes_per_rank: int = agreement_bytes(len(PARTS))
    mapping_granule: int = 4096
    seconds: float
    report: Report

    def format(self) -> str:
        """A table: one row per planned rank, then the totals."""
        from ..sources import human

        lines = [
            f"dry run of {self.source} into {self.target} on {self.world_size} ranks ({self.mesh}), {self.device}; "
            f"headers {self.headers}; share_reads {'on' if self.share_reads else 'off'} ({self.share_why})"
            + (f"; TP rows shared: {self.share_rows}" if self.share_reads else ""),
            f"{self.classes} class(es) of ranks with the same shards; "
            + ("every class planned" if self.exact else f"{len(self.ranks)} planned (evenly spaced); totals estimated: bytes "
               "read as the sample's bytes read per shard byte times all shard bytes (exact), opens as its mean"),
            f"{'rank':>6} {'ranks':>6} {'keys':>7} {'shards':>10} {'read':>10} {'storage':>10} {'files':>5} {'opens':>5} "
            f"{'preadv':>7} {'headers':>10} {'shared':>10} {'host mem':>10} {'plan s':>7}",
        ]
        for r in self.ranks:
            lines.append(
                f"{r.rank:>6} {r.ranks:>6} {r.keys:>7} {human(r.local_bytes):>10} {human(r.bytes_read):>10} {human(r.storage_bytes):>10} "
                f"{r.files_read:>5} {r.opens:>5} {r.preadv_calls:>7} {human(r.header_bytes):>10} "
                f"{human(r.shared_bytes):>10} {human(r.host_bytes):>10} {r.plan_seconds:>7.2f}"
            )
        node = f"; busiest node ({self.ranks_per_node} ranks) reads {human(self.max_node_bytes_read)}" if self.max_node_bytes_read else ""
        node += (f"; the first node's ranks read {human(self.node_bytes_read)}, {human(self.node_storage_bytes)} from storage "
                 "cold (one page cache)") if self.node_bytes_read else ""
        lines.append(
            f"total: {human(self.total_bytes_read)} read for a checkpoint of {human(self.checkpoint_bytes)} in "
            f"{self.checkpoint_files} files (amplification {self.amplification:.2f}x), {self.total_opens} opens, "
            f"{human(self.total_header_bytes)} of headers read, {human(self.total_local_bytes)} of shards{node}; "
            f"{human(self.collective_bytes_per_rank)} per rank in the header broadcast, "
            f"{human(self.agreement_bytes_per_rank)} in the ranks' agreement; dry run {self.seconds:.1f} s"
        )
        return "\n".join(lines)


def _name(src: str | os.PathLike[str] | Source) -> str:
    return src.path if isinstance(src, Source) else os.fspath(src)


def _sample(n: int, k: int) -> list[int]:
    if n <= k:
        return list(range(n))
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)}) if k > 1 else [0]


def dry_run(
    target: nn.Module | Mapping[str, TensorInfo] | None,
    src: str | os.PathLike[str] | Source,
    adapter: Adapter | str | None = None,
    *,
    mesh: str | Mapping[str, int],
    ep: int | None = None,
    pp: int | None = None,
    device: str = "cpu",
    share_reads: bool | None = None,
    headers: str = "once",
    ranks_per_node: int = 8,
    max_ranks: int = 16,
    subtree: str | None = None,
    dtype: str | torch.dtype | None = None,
    engine: EngineConfig | None = None,
    **patterns: Unpack[KeyPatterns],
) -> DryRunReport:
    """Plan a load of ``src`` at any world size on this one process, and say per rank what it
    would read (bytes, from which files), open, receive and hold; nothing is read but headers.

    Each rank's shards come from ``mesh`` and the placements torchtitan gives a transformer
    (FSDP2, HSDP, TP, EP, PP: see :mod:`sdadapt._plan.layout`), computed with DTensor's own
    offset rule; each rank's reads from the engine's own planning (:mod:`sdadapt._engine.predict`),
    so bytes, ``preadv`` calls and opens are those of a load with the same settings. Ranks with
    the same shards are planned once (see :mod:`sdadapt._dry_run.dryrun`).

    Args:
        target: a model (its state dict's global shapes and dtypes; build it on meta), a
            schema ``{key: TensorInfo}``, or ``None``: the keys the adapter gives from ``src``.
            A model already parallelised (DTensor parameters, on a real or fake process group
            of ``mesh``'s world) is planned with its own placements instead of the defaults.
        src: the checkpoint, as in :func:`sdadapt.load`.
        adapter: as in :func:`sdadapt.load`.
        mesh: ``"dp_replicate=8,dp_shard=16,tp=8"`` or a mapping; dims ``pp``,
            ``dp_replicate``, ``dp_shard``, ``ep``, ``tp``.
        ep: expert-parallel degree (added to ``mesh``).
        pp: pipeline stages (added to ``mesh``).
        device: ``"cpu"`` or ``"cuda"``: where the shards would be.
        share_reads: replicas read once and broadcast; ``None``: on for ``"cuda"`` (as
            :func:`sdadapt.load` decides), off for ``"cpu"``.
        headers: ``"once"``: one rank reads the headers and broadcasts them (a distributed
            load's default); ``"every"``: every rank reads them.
        ranks_per_node: ranks per node, for the node figures.
        max_ranks: plan at most this many classes of ranks (a sample beyond).
        subtree: as in :func:`sdadapt.load`.
        dtype: as in :func:`sdadapt.load`.
        engine: the engine settings of the ranks (default: this machine's).
        **patterns: ``allow_missing=`` / ``allow_unexpected=``, as in :func:`sdadapt.load`
            (:class:`~sdadapt.KeyPatterns`).

    Returns:
        A :class:`~sdadapt.reports.DryRunReport`: per planned rank and in total (``str()`` is
        a table, ``model_dump_json()`` the JSON).

    Raises:
        PlanError: the checkpoint does not line up with the target.
        UsageError: a bad mesh, device or ``headers``.

    Example::

        report = sdadapt.dry_run(None, "ckpt/", mesh="dp_replicate=2,dp_shard=4,tp=2")
        summary = str(report)
    """
    start = time.perf_counter()
    patterns = key_patterns("sdadapt.dry_run", patterns)
    if device not in ("cpu", "cuda"):
        raise UsageError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if headers not in ("once", "every"):
        raise UsageError(f"headers must be 'once' or 'every', got {headers!r}")
    grid = Mesh.parse(mesh, ep=ep, pp=pp)
    cfg = engine or EngineConfig.from_env()
    share = share_reads if share_reads is not None else device == "cuda"
    why = ("asked" if share else "turned off") if share_reads is not None else (
        "the default for GPU shards" if share else "off by default for CPU shards (gloo moves them slower than storage)")
    with recording_headers() as rec_src:
        open_source(src, subtree=subtree).close()
    with recording_headers() as rec_all:
        options = Options.of(src, adapter=adapter, subtree=subtree, dtype=dtype, **patterns)
        source, plan, target_name, state = _plan(target, src, options)
    try:
        if not plan.report.ok:
            raise PlanError(plan.report)
        other = [p for p in rec_all.files if p not in rec_src.files]  # read by every rank itself
        schema = {k: plan.target[k] for k in plan.recipes}
        layouts = default_layouts(schema, grid)
        from torch.distributed.tensor import DTensor

        if state is not None and any(isinstance(t, DTensor) for t in state.values()):
            layouts = model_layouts(state, grid, layouts)  # an already-parallelised model: its own placements
        granule = mapping_granule(source)
        dry = DryRunJob(source, plan, schema, layouts, grid, cfg, torch.device(device), share, granule, ranks_per_node)
        ranks, exact, n_classes, class_of, planned = _plan_ranks(dry, max_ranks)
        node_read, node_cold = _first_node(dry, planned, class_of)
        ckpt_files = len(rec_src.files)  # header and index files: what a rank that reads the headers opens
        every = headers == "every" or grid.size == 1  # each rank reads the headers (else the first, and broadcasts them)
        payload = 0 if every else len(encode_headers(rec_src))
        for r in ranks:
            first = every or r.rank == 0
            r.header_bytes = (rec_src.nbytes if first else 0) + sum(len(rec_all.files[p][0]) for p in other)
            r.header_bytes_received = 0 if first else payload
            r.opens += (ckpt_files if first else 0) + len(other)
        ckpt_bytes = sum(i.nbytes for i in source.schema.values())
    finally:
        source.close()
    scale = 1.0 if exact else n_classes / max(1, len(ranks))
    total_local = _total_local(schema, layouts, grid)
    total_read = round(sum(r.bytes_read * r.ranks for r in ranks) * scale)
    sampled_local = sum(r.local_bytes * r.ranks for r in ranks)
    if not exact and sampled_local:
        # ranks hold unequal shares (FSDP's first ranks hold a row of every tensor): the sample's
        # bytes read per shard byte, times every rank's shard bytes (exact), not the sample's mean
        total_read = round(total_local * sum(r.bytes_read * r.ranks for r in ranks) / sampled_local)
    # every rank opens the files it reads and the side files; the headers once, or on every rank
    readers = grid.size if every else 1
    rank_opens = sum((r.opens - (ckpt_files if every or r.rank == 0 else 0)) * r.ranks for r in ranks)  # but the headers
    total_opens = ckpt_files * readers + round(rank_opens * scale)
    header_total = rec_src.nbytes * readers + sum(len(rec_all.files[p][0]) for p in other) * grid.size
    node_max = None
    if exact:
        per_class = {class_of(r.rank): r.bytes_read for r in ranks}
        nodes: dict[int, int] = {}
        for rank in range(grid.size):
            nodes[rank // ranks_per_node] = nodes.get(rank // ranks_per_node, 0) + per_class[class_of(rank)]
        node_max = max(nodes.values())
    return DryRunReport(
        source=_name(src),
        target=target_name,
        mesh=str(grid),
        world_size=grid.size,
        device=device,
        share_reads=share,
        share_why=why,
        share_rows=rows_said(cfg.share_rows, (r.rows_bytes for r in ranks), ranks_per_node) if share else "off",
        headers=headers,
        checkpoint_bytes=ckpt_bytes,
        checkpoint_files=ckpt_files,
        classes=n_classes,
        exact=exact,
        ranks=ranks,
        total_local_bytes=total_local,
        total_bytes_read=total_read,
        total_opens=total_opens,
        total_header_bytes=header_total,
        amplification=total_read / ckpt_bytes if ckpt_bytes else 0.0,
        ranks_per_node=min(ranks_per_node, grid.size),  # a node never holds more ranks than the job
        max_node_bytes_read=node_max,
        node_bytes_read=node_read,
        node_storage_bytes=node_cold,
        collective_bytes_per_rank=payload,
        agreement_bytes_per_rank=agreement_bytes(len(PARTS), spread=share and grid.size > 1 and cfg.share_rows == "auto"),
        mapping_granule=granule,
        seconds=time.perf_counter() - start,
        report=plan.report,
    )


def _plan(target: Any, src: Any, options: Options) -> tuple[Source, Plan, str, dict[str, torch.Tensor] | None]:
    """The source, the plan, the target's name and, for a model, its state dict, as a load plans them."""
    if isinstance(target, nn.Module):
        # opened once: the adapter is derived from the open source
        planned = plan_model(target, open_checkpoint(src, options.subtree), options)
        return planned.source, planned.plan, type(target).__name__, planned.targets
    source = open_source(src, subtree=options.subtree)
    try:
        resolved = adapter_or_none(options.adapter, source)
        if options.dtype is not None and options.dtype != "model":
            resolved = with_dtype(resolved, options.dtype)
        schema = dict(target) if target is not None else adapted_schema(source.schema, resolved, source.non_tensor)
        plan = build_plan(
            source.schema, schema, resolved, non_tensor=source.non_tensor, allow_missing=list(options.allow_missing),
            allow_unexpected=list(options.allow_unexpected), source_name=_name(src),
            target_name="schema" if target is not None else "the checkpoint's layout",
        )
    except BaseException:
        source.close()
        raise
    return source, plan, plan.report.target, None


def _relevant(layouts: dict[str, Layout], grid: Mesh, share: bool) -> list[int]:
    """The mesh dims on which ranks differ in what they hold or read."""
    dims: set[int] = set()
    seen: set[Layout] = set()
    for lay in layouts.values():
        if lay in seen:
            continue
        seen.add(lay)
        dims |= lay.dims()
        if share and (g := lay.replica_group(grid)) is not None:
            dims.update(g)
    return sorted(dims)


@dataclass(frozen=True)
class DryRunJob:
    """What every rank of one dry run is planned from, built once by :func:`dry_run`: the open
    source, the plan, the target's schema and layouts, the mesh, the engine settings, the
    shards' device, whether replicas share reads, and what one fault on a file mapping makes
    resident (:func:`~sdadapt._engine.predict.mapping_granule`)."""

    source: Source
    plan: Plan
    schema: dict[str, TensorInfo]
    layouts: dict[str, Layout]
    grid: Mesh
    cfg: EngineConfig
    device: torch.device
    share: bool
    granule: int
    ranks_per_node: int = 8


def _plan_ranks(dry: DryRunJob, max_ranks: int) -> tuple[list[DryRunRank], bool, int, Any, dict[int, Planned]]:
    """One rank of each class of ``dry``'s mesh (of an evenly spaced sample of at most
    ``max_ranks`` classes), whether every class was planned, how many classes, the class of a
    rank, and each planned rank (by rank) with what its reads ask storage for, where its class
    has a rank on the first node (:func:`_first_node`; else nothing, to hold less)."""
    dims = _relevant(dry.layouts, dry.grid, dry.share)
    sizes = [dry.grid.sizes[d] for d in dims]
    n_classes = math.prod(sizes)
    per_class = dry.grid.size // n_classes

    def class_of(rank: int) -> int:
        coord = dry.grid.coordinate(rank)
        c = 0
        for d, s in zip(dims, sizes, strict=True):
            c = c * s + coord[d]
        return c

    def coordinate(c: int, over: list[int], coord: list[int]) -> list[int]:
        for d in reversed(over):
            coord[d] = c % dry.grid.sizes[d]
            c //= dry.grid.sizes[d]
        return coord

    if n_classes <= max_ranks:
        coords = [coordinate(c, dims, [0] * len(dry.grid.sizes)) for c in range(n_classes)]
    else:
        # a sample of the classes without sharing, each with its whole replica group: the
        # members of a group split its reads between them, so only whole groups add up
        base = _relevant(dry.layouts, dry.grid, False)
        group = [d for d in dims if d not in base]
        n_group = math.prod(dry.grid.sizes[d] for d in group)
        coords = [coordinate(g, group, coordinate(c, base, [0] * len(dry.grid.sizes)))
                  for c in _sample(math.prod(dry.grid.sizes[d] for d in base), max(2, max_ranks // n_group)) for g in range(n_group)]
    node = {class_of(rank) for rank in range(min(dry.ranks_per_node, dry.grid.size))}
    planned = []
    for coord in coords:
        p = _plan_rank(dry, tuple(coord), per_class)
        planned.append(p if class_of(p[0].rank) in node else (p[0], {}, 0))  # extents kept for the first node only
    out = sorted((p[0] for p in planned), key=lambda r: r.rank)
    return out, len(coords) == n_classes, n_classes, class_of, {p[0].rank: p for p in planned}


Planned = tuple[DryRunRank, Extents, int]  # a planned rank, the extents its reads ask storage for, its mapped reads' span


def _first_node(dry: DryRunJob, planned: dict[int, Planned], class_of: Any) -> tuple[int, int]:
    """The bytes the first node's ranks (0 to ``ranks_per_node - 1``) read, and what they make
    storage deliver together on a cold page cache they share (:func:`~sdadapt._dry_run.nodes.node_storage`);
    a rank whose class was not planned is planned here."""
    by_class = {class_of(rank): p for rank, p in planned.items()}
    members = []
    for rank in range(min(dry.ranks_per_node, dry.grid.size)):
        p = by_class.get(class_of(rank)) or _plan_rank(dry, dry.grid.coordinate(rank), 1)
        members.append(p)
    return sum(p[0].bytes_read for p in members), node_storage((p[1], p[2]) for p in members)


def _plan_rank(dry: DryRunJob, coord: tuple[int, ...], per_class: int) -> Planned:
    t0 = time.perf_counter()
    jobs: list[Job] = []
    rows: list[RowShare] = []
    keys = local = shared = 0
    for key, node in dry.plan.recipes.items():
        info, lay = dry.schema[key], dry.layouts[key]
        box = local_box(info, dry.grid, lay, coord)
        if box is None:
            continue
        keys += 1
        shape = box_shape(box)
        nbytes = math.prod(shape) * info.dtype.itemsize
        local += nbytes
        if nbytes == 0:
            continue
        group = lay.replica_group(dry.grid) if dry.share else None
        if group is not None and box:
            r = math.prod(dry.grid.sizes[d] for d in group)
            me = 0
            for d in group:
                me = me * dry.grid.sizes[d] + coord[d]
            (a, b) = box[0]
            s, e = replica_parts(key, b - a, (b - a) * math.prod(info.shape[1:]) * info.dtype.itemsize, r)[me]
            box = ((a + s, a + e), *box[1:])
            shape = box_shape(box)
            shared += nbytes - math.prod(shape) * info.dtype.itemsize
            if e <= s:
                continue
        job = Job(key, node, box, torch.empty(shape, dtype=info.dtype, device="meta"))
        cut = None
        if dry.share and dry.cfg.share_rows:
            mesh_shape, at = group_coordinate(dry.grid, lay, coord)
            cut = row_cut(box, tuple(info.shape), mesh_shape, at, tuple(p for _, p in lay.groups), info.dtype.itemsize, dry.cfg.gap_bytes)
            if cut is not None and dry.cfg.share_rows == "auto" and not rows_apart(dry.grid, lay, coord, cut.mesh_dim, dry.ranks_per_node):
                cut = None  # the group on one node: its page cache is shared
        if cut is None:
            jobs.append(job)
        else:
            rows.append(RowShare(None, job, cut))
    rounds = row_rounds(rows, dry.cfg.share_round_bytes)
    rows_got = sum(row_received(r) for r in rounds)
    shared += rows_got
    fig = predict(dry.source, jobs, dry.cfg, dry.device, dry.granule)
    staging, touched = fig.staging_bytes, fig.staging_touched
    rows_staging = rows_touched = 0  # the rounds' own engine runs beside the rank's other reads: its staging adds
    for units in rounds:  # each round of shared rows is a run of its own
        run = predict(dry.source, row_read_jobs(units), rows_config(dry.cfg), dry.device, dry.granule)
        rows_staging, rows_touched = max(rows_staging, run.staging_bytes), max(rows_touched, run.staging_touched)
        fig.add(run)
    exchange = rounds_memory(rounds)  # the round buffers, on the shards' device
    rank = DryRunRank(
        rank=dry.grid.rank_of(coord),
        ranks=per_class,
        coordinate=dict(zip(dry.grid.names, coord, strict=True)),
        keys=keys,
        local_bytes=local,
        bytes_read=fig.bytes_read,
        storage_bytes=fig.storage_bytes,
        files_read=len(fig.file_bytes),
        file_bytes=fig.file_bytes,
        preadv_calls=fig.preadv_calls,
        mapped_reads=fig.mapped_reads,
        opens=len(fig.opened) + len(fig.mapped),
        header_bytes=0,
        header_bytes_received=0,
        shared_bytes=shared,
        rows_bytes=rows_got,
        staging_bytes=staging + rows_staging,
        host_bytes=(local + exchange if dry.device.type == "cpu" else 0) + touched + rows_touched + fig.mapped_span,
        device_bytes=local + exchange if dry.device.type == "cuda" else 0,
        tasks=fig.tasks,
        plan_seconds=time.perf_counter() - t0,
    )
    return rank, fig.extents, fig.mapped_span


def _total_local(schema: dict[str, TensorInfo], layouts: dict[str, Layout], grid: Mesh) -> int:
    """Every rank's shard bytes together: each tensor once per copy (its replicated dims)."""
    total = 0
    for key, info in schema.items():
        lay = layouts[key]
        copies = 1
        for dims, p in lay.groups:
            if p.is_replicate():
                copies *= math.prod(grid.sizes[d] for d in dims)
        owned = {d for d, _ in lay.owners}
        grouped = {d for dims, _ in lay.groups for d in dims}
        for d, s in enumerate(grid.sizes):
            if d not in owned and d not in grouped:
                copies *= s
        total += info.nbytes * copies
    return total
