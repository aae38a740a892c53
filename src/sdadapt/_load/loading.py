"""``sdadapt.load``: validate on headers, materialise, then read each rank's shards of the adapted view."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict
from torch import nn

from .._base import agreement
from .._base.distributed import rank_and_world
from .._base.gc import without_gc
from .._base.progress import TransferBar
from .._base.summary import Summarized
from .._engine import EngineConfig, EngineStats, device_work, heading, kvikio_deferred, prefetch_pinned, warm_kernels, warm_kvikio
from .._plan.adapter import Adapter
from .._plan.intent import intent
from .._plan.plan import KeyPatterns, Plan, key_patterns
from .._plan.report import Report
from .._plan.target import load_targets, local_nbytes, schema_of
from .._transaction.args import check_model_and_path, renamed_keywords
from .._transaction.headers import SharedHeaders, share_headers
from .._transaction.materialize import (
    InitFn,
    MissingInitFn,
    Reservation,
    check_buffers,
    choose_device,
    has_meta,
    missing_values,
    own_tensors,
)
from .._transaction.options import Options
from .._transaction.steps import LAST_PLAN, family_hint, judge, open_checkpoint, plan_model
from .._transaction.tidy import call_started, public
from .._transaction.transaction import ATOMIC_WHY, Part, Transaction
from ..sources import CHECKSUMS_WHY, LoraMerged, Source, remember_source

if TYPE_CHECKING:
    from typing import Unpack  # Python 3.11; annotations only, the package runs on 3.10

log = logging.getLogger("sdadapt")


class LoadReport(Summarized, BaseModel):
    """What one rank did: keys and bytes it read, and how long each phase took.

    Attributes:
        rank: this rank.
        world_size: the ranks that loaded.
        source: the checkpoint.
        keys_loaded: the keys written on this rank.
        items_read: the reads DCP asked this rank for.
        bytes_read: the bytes read from the files.
        storage_bytes: what storage delivers for those reads on a cold page cache: every file
            page they touch, once, the gaps a joined read of a column slice's rows reads through
            included (the dry run predicts it: ``DryRunRank.storage_bytes``). This rank's reads
            as if it read alone: ranks on one host share its page cache, so the host reads each
            page its ranks touch once, and their figures summed count a page they share once per
            rank (the host's figure is the dry run's ``node_storage_bytes``; a process's own
            ``read_bytes`` in ``/proc`` charges a shared page to the first rank that faults it).
        bytes_shared: the bytes received from replicas and TP peers (``share_reads=True``).
        bytes_fetched: the bytes fetched from object storage (a ``s3://`` / ``gs://`` source):
            the ranges the engine fetched into memory, the probes made before writing, and what
            ``Source.read`` reads (quantized blocks, DCP records); headers not counted. The line
            of the load then says it instead of ``storage_bytes``.
        requests: the ranged requests those bytes took.
        local_bytes: the bytes of this rank's destination shards.
        seconds: the whole call.
        plan_seconds: planning.
        read_seconds: reading.
        phase_seconds: each phase's wall time, in order.
        engine_thread_seconds: the engine threads' busy, read and wait seconds, summed; a GPU
            load adds its device lane's thread: ``lane`` (its run), of which ``lane_cpu`` (CPU
            time), ``lane_idle`` (waiting for work) and ``lane_copy_wait`` (waiting for copies);
            one that read through kvikio adds ``kvikio_wait`` (waiting for its reads once the
            threads had finished).
        materialized: whether the model was materialised from meta.
        missing_values: what gave the keys the checkpoint lacks (allowed missing) their values:
            the model's own (a materialised model keeps them), ``init_missing=``, the model's
            ``init_weights()`` or its modules' ``reset_parameters()``; empty when none is missing.
        report: the plan's :class:`Report`.
        lora: what a LoRA merge changed (``lora=``), else ``None``.

    Example::

        report = sdadapt.load(model, "ckpt/", "llama")
        summary = str(report)  # keys, bytes and time of each phase
    """

    # built when a report is first validated or dumped: a load makes its report with model_construct
    model_config = ConfigDict(defer_build=True)

    rank: int
    world_size: int
    source: str
    keys_loaded: int
    items_read: int
    bytes_read: int
    storage_bytes: int = 0  # what a cold page cache reads from storage for this rank's reads
    bytes_shared: int = 0  # received from replicas and TP peers (share_reads=True) instead of read
    bytes_fetched: int = 0  # from object storage (s3:// and gs:// sources)
    requests: int = 0  # the ranged requests that fetch took
    local_bytes: int  # bytes of this rank's destination shards
    seconds: float
    plan_seconds: float
    read_seconds: float
    phase_seconds: dict[str, float] = {}  # wall time of each step of the load, in order
    # the engine's threads, their seconds summed: "busy" running tasks, of which "read" (preadv
    # and Source.read) and "wait" (for a staging or band buffer, or the copy out of it); the
    # rest of "busy" is copying, computing and Python
    engine_thread_seconds: dict[str, float] = {}
    materialized: bool
    missing_values: str = ""  # what gave the allowed-missing keys their values (see load's init_missing=)
    report: Report
    lora: LoraMerged | None = None  # load(..., lora=folder): what the LoRA merge changed

    def format(self) -> str:
        return (
            f"rank {self.rank}/{self.world_size}: loaded {self.keys_loaded} keys ({self.items_read} shard "
            f"regions), read {self.bytes_read / 2**20:.1f} MiB for {self.local_bytes / 2**20:.1f} MiB of "
            f"local shards"
            + (f" ({self.storage_bytes / 2**20:.1f} MiB from storage when cold)" if self.storage_bytes and not self.bytes_fetched else "")
            + (f", fetched {self.bytes_fetched / 2**20:.1f} MiB from object storage in {self.requests} requests"
               if self.bytes_fetched else "")
            + (f" (+{self.bytes_shared / 2**20:.1f} MiB from peers)" if self.bytes_shared else "")
            + f" in {self.seconds:.2f} s (plan {self.plan_seconds:.2f} s, read {self.read_seconds:.2f} s)"
            + (f"; {self.lora.format()}" if self.lora is not None else "")
            + self._missing_line()
        )

    def _missing_line(self) -> str:
        resized = {m.key for m in self.report.resized}
        skipped = [k for k in [*self.report.allowed_missing, *self.report.missing] if k not in resized]
        line = f"\n{self.report.resized_line()}: {self.missing_values}" if resized and self.missing_values else ""
        if not skipped or not self.missing_values:
            return line
        from .._base.keyruns import compress

        rows = compress(skipped)
        shown = ", ".join(rows[:4]) + (f" and {len(rows) - 4} more" if len(rows) > 4 else "")
        return f"\nnot in the checkpoint: {len(skipped)} key(s) {shown}: {self.missing_values}" + line


class _Phases:
    """Wall time between consecutive marks (for ``LoadReport.phase_seconds``)."""

    def __init__(self, start: float):
        self.last = start
        self.seconds: dict[str, float] = {}

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = now - self.last
        self.last = now


def _thread_seconds(st: EngineStats) -> dict[str, float]:
    """``LoadReport.engine_thread_seconds`` of a load whose engine runs counted ``st``."""
    out = {"busy": st.busy_seconds, "read": st.read_seconds, "wait": st.wait_seconds}
    if st.lane.wall:
        out.update(lane=st.lane.wall, lane_cpu=st.lane.cpu, lane_idle=st.lane.idle, lane_copy_wait=st.lane.copy_wait)
    if st.kvikio_bytes:
        out["kvikio_wait"] = st.kvikio_wait_seconds
    return {k: round(v, 6) for k, v in out.items()}


@public
def plan_load(
    model: nn.Module,
    src: str | os.PathLike[str] | Source,
    adapter: Adapter | str | None = None,
    *,
    subtree: str | None = None,
    pipeline_stage: bool = False,
    lora: str | os.PathLike[str] | None = None,
    dtype: str | torch.dtype | None = None,
    **patterns: Unpack[KeyPatterns],
) -> tuple[Source, Plan]:
    """Open the source and plan against the model (headers only; nothing is read or changed);
    ``pipeline_stage``, ``lora`` and ``dtype`` as in :func:`load`.

    Args:
        model: the model to plan against (its state dict's shapes and dtypes; meta is fine).
        src: the checkpoint path, Hub id or :class:`~sdadapt.sources.Source`.
        adapter: an :class:`Adapter` or a spec string, as in :func:`load`.
        subtree: the nested dict of a ``torch.save`` file or DCP folder to read.
        pipeline_stage: ``model`` is one pipeline stage.
        lora: a PEFT LoRA adapter folder to merge.
        dtype: ``"model"`` or a dtype to convert every tensor to.
        **patterns: ``allow_missing=`` / ``allow_unexpected=``: key patterns of the model that the
            checkpoint may lack / of the checkpoint that the model may lack (:class:`KeyPatterns`).

    Returns:
        ``(source, plan)``: the open :class:`~sdadapt.sources.Source` (close it when done) and
        the :class:`~sdadapt.reports.Plan`, whose ``report`` says what lines up.

    Example::

        source, plan = sdadapt.plan_load(model, "ckpt/", "llama")
        with source:
            assert plan.report.ok, plan.report.format()
    """
    check_model_and_path("sdadapt.plan_load(model, src, adapter=None, ...)", model, src)
    options = Options.of(src, adapter=adapter, subtree=subtree, pipeline_stage=pipeline_stage, lora=lora, dtype=dtype,
                         **key_patterns("sdadapt.plan_load", patterns))  # fmt: skip
    planned = plan_model(model, open_checkpoint(src, subtree), options)
    return planned.source, planned.plan


def _gpu_target(model: nn.Module, device: torch.device | str | None, tensors: list[torch.Tensor] | None = None) -> torch.device | None:
    """The GPU a load into ``model`` reads to: the device of its first parameter or buffer on a
    GPU, else, for a model with tensors on meta, the device it is materialised on (``device``,
    or its mesh's); ``None`` for a load that stays off GPUs. CUDA is asked about only for a load
    bound for a GPU: in a process that has not used it, ``torch.cuda.is_available()`` starts the
    driver, a wait a load into the CPU has no use for. ``tensors``: :func:`own_tensors` of
    ``model``, where the caller has them."""
    tensors = own_tensors(model) if tensors is None else tensors
    target = next((t.device for t in tensors if t.is_cuda), None)
    if target is None and has_meta(tensors):
        try:
            target = choose_device(model, device)
        except Exception:  # noqa: BLE001 - a bad device= is reported by materialising, agreed on every rank
            return None
    if target is None or target.type != "cuda" or not torch.cuda.is_available():
        return None
    return target


def _prepare_device(
    target: torch.device | None, planned: dict[str, torch.Tensor], plan: Plan, engine: EngineConfig | None, files: Sequence[str] = ()
) -> None:
    """Once planned, a load into GPU shards (``target``) starts pinning its band buffers where
    its computations may use them, and (when its recipes compute on the device) loads their
    kernels into the GPU, while the model is materialised: the engine's first run then finds
    both done (or nearly). Its staging is pinned from the start of the load. Where it reads
    through kvikio, kvikio is warmed up meanwhile on the source's ``files`` (not by a process's
    first GPU load, which reads without kvikio and starts it afterwards)."""
    if target is None:
        return
    cfg = engine or EngineConfig.from_env()
    if cfg.kvikio_warm and not kvikio_deferred(cfg.kvikio, *cfg.kvikio_settings()):
        warm_kvikio(target, list(files), cfg.kvikio, *cfg.kvikio_settings())
    kernels, bands = device_work(plan.recipes, planned, cfg.gather_inputs)
    if bands:
        prefetch_pinned(target, True, cfg)
    if kernels and cfg.warm_kernels:
        warm_kernels(target, kernels)


@public
@renamed_keywords("sdadapt.load", {"stage": ("atomic", ATOMIC_WHY), "verify": ("checksums", CHECKSUMS_WHY)})
@without_gc  # no full collection stalls the load: see sdadapt._base.gc
def load(
    model: nn.Module,
    src: str | os.PathLike[str] | Source,
    adapter: Adapter | str | None = None,
    *,
    strict: bool = True,
    subtree: str | None = None,
    allow_missing: list[str] | None = None,
    allow_unexpected: list[str] | None = None,
    allow_resized: list[str] | None = None,
    device: torch.device | str | None = None,
    init_buffers: InitFn | None = None,
    init_missing: MissingInitFn | None = None,
    process_group: dist.ProcessGroup | None = None,
    checksums: bool = False,
    check_finite: bool = False,
    atomic: bool = False,
    share_reads: bool | None = None,
    pipeline_stage: bool = False,
    dtype: str | torch.dtype | None = None,
    lora: str | os.PathLike[str] | None = None,
    engine: EngineConfig | None = None,
    progress: bool = True,
) -> LoadReport:
    """Load checkpoint ``src`` into ``model`` through ``adapter``; every rank reads only its shards.

    Call on every rank (a collective when a process group is initialised). ``model`` may be on
    the meta device and parallelised (TP, FSDP2, HSDP): it is materialised once the plan is
    valid. Everything checkable from headers is agreed on every rank before anything is
    written: a :class:`~sdadapt.errors.PlanError` leaves the model as it was; a failure while
    reading is a :class:`~sdadapt.errors.LoadError` on every rank (``atomic=True``: the model
    then keeps its values bit for bit). The checkpoint is opened once for the call, its headers
    read by one rank and broadcast. docs/loading.md says what each option changes and the steps
    a call takes (resolve, open, adapter, plan, run).

    Args:
        model: the model to fill, on the meta device or materialised, parallelised or not.
        src: the checkpoint: a path :func:`sdadapt.sources.open_source` opens, a Hub id
            ``"hf://org/name[@revision]"``, or an open :class:`~sdadapt.sources.Source`.
        adapter: an :class:`Adapter`, a shipped adapter's name, ``file.py:ATTR``, ``module:ATTR``
            or a ``.json`` file; ``None``: the checkpoint's keys are the model's.
        strict: raise :class:`~sdadapt.errors.PlanError` on any planning problem (else log it
            and load what lines up).
        subtree: the nested dict of a ``torch.save`` file or DCP folder to read.
        allow_missing: key patterns of the model that the checkpoint may lack.
        allow_unexpected: key patterns of the checkpoint that the model may lack.
        allow_resized: key patterns of the model whose shape may differ from the checkpoint's
            (a classifier head of another size, a vocabulary with tokens added; the same number
            of dims): such keys are not read and get their values as allowed missing keys do
            (``init_missing``, ``init_weights()``, ``reset_parameters()``; a materialised model
            keeps its own), said on one line of the report. Any other shape difference stays a
            :class:`~sdadapt.errors.PlanError`. torch's counterpart of transformers'
            ``ignore_mismatched_sizes``, limited to the keys named.
        device: where a meta model is materialised (default: its mesh's device, else CPU).
        init_buffers: ``fn(model)`` that fills non-persistent buffers after materialising.
        init_missing: ``fn(model, keys)`` that gives the state-dict keys the checkpoint lacks
            (``allow_missing``) their values after a meta model is materialised (default: the
            model's ``init_weights()``, else ``reset_parameters()`` of each key's module).
        process_group: the group the ranks agree over (default: the world, when initialised).
        checksums: check every region read against ``sdadapt.checksums.json``.
        check_finite: refuse NaN/Inf values, naming each key.
        atomic: read into a second copy and copy in only once every rank succeeded.
        share_reads: ranks holding the same shard each read a part and broadcast it, and TP
            peers holding column slices of the same rows each read whole rows once and
            exchange the slices, by default only where the peers run on more than one host
            (``EngineConfig.share_rows``) (``None``: on for GPU shards, off for CPU ones).
        pipeline_stage: ``model`` is one pipeline stage; other stages' keys are allowed.
        dtype: ``"model"`` or a dtype: convert every tensor (a ``cast`` rule after ``adapter``'s).
        lora: a PEFT LoRA adapter folder merged into the base weights as they are read.
        engine: the I/O engine's settings for this call (:class:`EngineConfig`); ``None``: the
            defaults, overridden by the ``SDADAPT_IO_*`` environment variables.
        progress: a bar of the bytes read (and the tensor count) on rank 0's stderr, drawn only
            on a terminal with sdadapt's logging on; ``False``: never.

    Returns:
        This rank's :class:`~sdadapt.reports.LoadReport`: keys and bytes read, the time of each
        phase, and the plan's :class:`~sdadapt.reports.Report`.

    Raises:
        PlanError: the checkpoint does not line up with the model (on every rank, nothing read).
        LoadError: a read failed on some rank (raised on every rank; see above for the model's state).

    Example::

        with torch.device("meta"):
            model = build_model()
        fully_shard(model)
        report = sdadapt.load(model, "path/to/llama", "llama")
        summary = str(report)
    """
    t0 = call_started()
    check_model_and_path("sdadapt.load(model, src, adapter=None, ...)", model, src)
    options = Options.of(src, adapter=adapter, strict=strict, subtree=subtree, allow_missing=allow_missing,
                         allow_unexpected=allow_unexpected, allow_resized=allow_resized, pipeline_stage=pipeline_stage,
                         dtype=dtype, lora=lora,
                         init_buffers=init_buffers, init_missing=init_missing, checksums=checksums)  # fmt: skip
    rank, world = rank_and_world(process_group)
    txn = Transaction(model, process_group, options.name)
    txn.engine = engine
    local = txn.resolve(src)  # **resolve**: a Hub id's snapshot folder, fetched and agreed on every rank
    tensors = own_tensors(model, txn.modules)  # once for both questions below
    reserved = Reservation(model, device, tensors)  # a meta model's GPU memory, asked for while the plan is made
    target = _gpu_target(model, device, tensors)
    if target is not None:  # pinned while the plan is made (kept for the next load if it fails)
        prefetch_pinned(target, False, engine)
    shared = share_headers(local, subtree, process_group)  # opened by one rank, its headers broadcast
    share = share_reads if share_reads is not None else target is not None  # GPU shards: share by default
    # TP row sharing's "auto" needs to know whether the ranks share a host: asked in the plan's agreement
    txn.ask_hosts = share and world > 1 and (engine or EngineConfig.from_env()).share_rows == "auto"
    try:  # every rank raises if any failed; nothing was changed
        prep = txn.prepare(lambda: _prepare(txn, model, local, shared, options), _intent(options))
    except BaseException:
        reserved.wait()
        raise
    phases = _Phases(t0)
    phases.mark("plan")
    _prepare_device(target, prep.planned, prep.plan, engine, txn.sources[-1].files())
    with heading(target, txn.sources[-1], prep.plan.recipes, engine, world == 1):  # read ahead while materialising
        # every rank's hook has run (a hook may touch the files) before any rank checks them
        materialized = txn.materialize(device, init_buffers, reserved, then=prep.fill_missing[1])
        phases.mark("materialize")
        # materialising gave the buffers new tensors (and a hook may have replaced any); otherwise
        # the planned state dict is current
        targets, own = prep.planned, None
        if txn.materialized is not None:
            own = txn.materialized.current(prep.planned)  # the model's own tensors, known without a walk
            targets = own or load_targets(model, prep.plain)
        wanted = {k: v for k, v in targets.items() if k in prep.plan.recipes}
        part = Part("model", prep.plan, txn.sources[-1], wanted, share_reads=share, own=bool(own))
        phases.mark("prepare")
        log.info("rank %d: reading %d keys from %s%s", rank, len(wanted), options.name, " (atomic)" if atomic else "")
        total = sum(local_nbytes(t) for t in wanted.values())
        with TransferBar(total, "sdadapt.load", tensors=len(wanted), rank=rank, enabled=progress) as bar:  # **run**
            txn.on_done = bar.update if bar.on else None
            txn.run([part], atomic=atomic, check_finite=check_finite, mark=phases.mark)
    rep = _load_report(part, prep, options, phases, rank=rank, world=world, total=total, materialized=materialized, t0=t0)
    remember_source(model, src)  # export / save_state with an adapter name read the same folder
    rep.seconds = time.perf_counter() - t0  # the whole call, from entering it
    log.info("%s", rep.format())
    return rep


# an internal record: no generated __eq__ / __repr__ (unused; each costs the import an exec)
@dataclass(eq=False, repr=False)
class _Prepared:
    """What :func:`_prepare` hands on: the plan, the model's state dict it was made against, and
    what gives the keys the checkpoint lacks their values (``missing_values``)."""

    plan: Plan
    planned: dict[str, torch.Tensor]
    fill_missing: tuple[str, InitFn | None]
    adapter: Adapter | None = None  # as resolved and derived from the checkpoint
    plain: bool | None = None  # renames_nothing(model), as planned (None: not asked)


def _intent(options: Options) -> Callable[[_Prepared], Mapping[str, Any]]:
    """What the ranks agree on: the adapter, the plan (each stage of a pipeline plans its own
    keys: not compared), the options that change the plan (kept with a reused plan), and the
    versions, read every load (a reused plan's key does not hold them)."""
    o = options
    return lambda p: {**LAST_PLAN.parts(p.plan, lambda: intent(
        p.adapter, None if o.pipeline_stage else p.plan.recipes, strict=o.strict, dtype=str(o.dtype), pipeline_stage=o.pipeline_stage,
        subtree=o.subtree, allow_missing=list(o.allow_missing), allow_unexpected=list(o.allow_unexpected))),
        "versions": agreement.installed_versions()}  # fmt: skip


def _prepare(txn: Transaction, model: nn.Module, local: str | os.PathLike[str] | Source, shared: SharedHeaders,
             options: Options) -> _Prepared:  # fmt: skip
    """:func:`load`'s agreed step, headers only: **open** the checkpoint (once), derive the
    **adapter** from it, **plan** and judge the plan, then the checks that need the plan (buffer
    hooks, what fills the missing keys, the checksums sidecar). The source joins the transaction
    (closed with it)."""
    source = shared.open(local, options.subtree)
    # the adapter is resolved inside the agreed step: a rank failing to resolve or derive it stops them all
    # an open Source given by the caller may present any schema over its files: its plans are not kept
    planned = plan_model(model, source, options, None if isinstance(local, Source) else LAST_PLAN, txn.modules)
    source, plan = planned.source, planned.plan
    txn.add_source(source, planned.files)
    judge(plan, options.strict, lambda: family_hint(plan.report, source, schema_of(planned.targets), options, model))
    check_buffers(model, options.init_buffers)
    fill_missing = missing_values(model, [*plan.skipped, *plan.report.missing], options.init_buffers, options.init_missing)
    if options.checksums:
        from ..sources import ChecksummedSource, read_checksums  # noqa: PLC0415 - checksums=True only

        sidecar, sums = read_checksums(source)
        leaves = sorted({k for node in plan.recipes.values() for k in node.leaves()})
        txn.sources[-1] = ChecksummedSource(source, sidecar, sums, leaves)
    return _Prepared(plan, planned.targets, fill_missing, planned.adapter, planned.plain)


def _load_report(part: Part, prep: _Prepared, options: Options, phases: _Phases, *, rank: int, world: int, total: int,
                 materialized: bool, t0: float) -> LoadReport:  # fmt: skip
    """This rank's :class:`LoadReport` once ``part`` was read."""
    reader = part.reader
    assert reader is not None
    timings = dict(phases.seconds)
    timings["engine"] = reader.stats.seconds  # inside dcp_load: first task to last byte
    timings["engine_plan"] = reader.stats.plan_seconds  # of which planning (reads start meanwhile)
    timings["engine_first_task"] = reader.stats.first_task_seconds  # until the first task's bytes were handed on
    merged = None
    if options.lora is not None:
        from ..rules import merged_lora

        merged = merged_lora(options.lora, prep.plan.recipes)
    # the load's own values, of the fields' types: not validated (a load builds no validator of its own)
    return LoadReport.model_construct(
        rank=rank,
        world_size=world,
        source=options.name,
        keys_loaded=len(part.targets),
        items_read=reader.items_read,
        bytes_read=reader.io.bytes_read,
        storage_bytes=reader.stats.storage_bytes,
        bytes_shared=reader.shared_bytes,
        bytes_fetched=reader.fetched[0],
        requests=reader.fetched[1],
        local_bytes=total,
        seconds=time.perf_counter() - t0,
        plan_seconds=phases.seconds["plan"],
        read_seconds=reader.seconds,
        phase_seconds={k: round(v, 6) for k, v in timings.items()},
        engine_thread_seconds=_thread_seconds(reader.stats),
        materialized=materialized,
        missing_values=prep.fill_missing[0],
        report=prep.plan.report,
        lora=merged,
    )
