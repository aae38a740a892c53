"""One load transaction, shared by ``load``, ``load_state`` and ``export``/``convert``.

Steps, in order, each agreed on every rank (one rank's failure is every rank's error):

1. **prepare**: plan from headers, fingerprint the files (size, mtime, inode), agree that every
   rank plans the same; a failure leaves the model untouched (or back on meta); run buffer hooks;
2. **check files** right before the first byte is written;
3. **read** every part (by the engine, or one ``dcp.load``) into its targets: the model's own shards, or
   a staged copy laid out like them (``atomic=True``);
4. **check** after reading (read errors from every rank, files unchanged, ``check_finite``);
5. **commit** (copy staged shards in, run the caller's finishing steps such as setting the
   optimizer state, copy tensors DCP wrote into copies back into the model) or **roll back**.

Roll-back policy: a model that was on the meta device is put back on meta. A model that already
held values is written in place unless staged: a failure after writing began cannot restore its
old values, so every rank raises :class:`LoadError` saying so (how many keys this rank was
writing), and the model is *marked*: its forward raises :class:`ModelError` (and a restored
optimizer's ``step`` too) until a load into it succeeds. An optimizer that held no state before
the load gets none back. With staging, nothing is written before every rank succeeded, so a
failure reading or checking leaves model and optimizer bit for bit as they were, for a second
copy of the staged shards: one more model's worth of memory where memory is tightest, and the
copy's time, against failures that the checks before writing already make rare.

A failure *while committing* (a step of the commit raising on any rank, after every read and
check passed) is agreed too: every rank raises :class:`LoadError` naming the failing ranks and
step. By then the commit cannot be undone, staged or not: without staging the reads wrote in
place; with it the staged shards of the parts the commit reached were copied in (optimizer
parts first, then the model), and the finishing steps run only once the model is committed.
So, over all ranks (a model's shards are one model: a rank whose own shards are untouched is
marked when another rank's were changed), the model is marked when any of its tensors were
written, and the optimizer when its state tensors were written or a finishing step began
(setting its state may have changed its param groups too), with a mark whose message says the
load failed while committing. An optimizer that held no state before the load gets none back,
its param groups as they were, and is not marked. A model that was on the meta device goes
back to meta, as after any other failure: the values it was given are the checkpoint's but the
rest of the restore (optimizer, extras) is not, and a meta model cannot run by mistake.
"""

from __future__ import annotations

import functools
import logging
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from .._base.agreement import agree_on, host_id
from .._base.distributed import any_rank, gather_if_any, is_distributed, rank_and_world
from .._engine import EngineConfig
from .._engine.direct import EngineReader, direct_targets
from .._plan.intent import no_intent
from .._plan.plan import Plan
from .._plan.target import model_state_dict
from ..errors import LoadError, ModelError, SdadaptError, SourceError, VersionError
from ..sources import Fingerprint, Source, check_unchanged, fingerprint, is_hub_id
from .checks import after_read_checks
from .commit import (
    COPY_BACK,
    COPY_IN,
    CommitProgress,
    CommitStep,
    ParamGroups,
    param_groups_of,
    restore_param_groups,
    touching_optimizer,
)
from .materialize import InitFn, Materialized, Reservation, choose_device, has_meta, materialize, own_tensors
from .tidy import single_process_quiet

if TYPE_CHECKING:
    from torch.distributed.checkpoint.api import CheckpointException

log = logging.getLogger(__name__)

T = TypeVar("T")

PARTLY_LOADED = "a failed sdadapt.load left this model partly overwritten; load again or pass atomic=True"
# why load / load_state call it ``atomic`` (shown when the old keyword ``stage`` is passed): "stage" is
# a pipeline stage only (``pipeline_stage=True``)
ATOMIC_WHY = "read into a staged copy, copied in once every rank succeeded; 'stage' means a pipeline stage"
COMMIT_FAILED = (
    "a sdadapt load failed while committing, after it had begun changing this {what}: it holds part of "
    "the checkpoint's state and not the rest; load into it again"
)
# model or optimizer -> the hook that refuses to run it (see mark_unusable)
_marks: weakref.WeakKeyDictionary[Any, RemovableHandle] = weakref.WeakKeyDictionary()


@dataclass
class Part:
    """One read of a transaction: ``plan`` read from ``source`` into ``targets`` (by the engine
    alone where :func:`~sdadapt._engine.direct.direct_targets` accepts them, else through ``dcp.load``).

    ``of_model``: the targets are the model's tensors (else the optimizer's state). ``own``: they
    are known to be the model's own (``Materialized.current``): no copy to write back is looked for."""

    name: str
    plan: Plan
    source: Source
    targets: dict[str, torch.Tensor]
    of_model: bool = True
    share_reads: bool = False
    own: bool = False
    reader: EngineReader | None = field(default=None, init=False)
    staged: dict[str, torch.Tensor] | None = field(default=None, init=False)  # atomic=True: read here

    @property
    def into(self) -> dict[str, torch.Tensor]:
        """Where the read writes: the staging shards, else the targets themselves."""
        return self.staged if self.staged is not None else self.targets


def local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class Transaction:
    """The state of one load on this rank; every method marked *collective* is called by every
    rank at the same point."""

    def __init__(self, model: nn.Module | None, group: dist.ProcessGroup | None, what: str):
        self.model = model
        self.group = group
        self.what = what
        self.was_meta = model is not None and has_meta(model)
        self.files: Fingerprint = {}
        self.sources: list[Source] = []
        self.optimizer: torch.optim.Optimizer | None = None
        self.optimizer_was_empty = False
        self.written: list[Part] = []  # parts this rank began writing into
        self.engine: EngineConfig | None = None  # the I/O engine's settings; None: from the environment
        self.on_done: Callable[[int], None] | None = None  # progress: each finished read's destination bytes
        self.ask_hosts = False  # whether prepare's agreement also asks whether every rank runs on one host
        self.one_host: bool | None = None  # its answer (None: not asked)
        self.materialized: Materialized | None = None  # what materialising did (None: nothing was on meta)

    @functools.cached_property
    def modules(self) -> list[nn.Module]:
        """``list(model.modules())`` for the walks up to materialising (none adds a module: hooks run after)."""
        return list(self.model.modules()) if self.model is not None else []

    # ------------------------------------------------------------------ prepare
    def add_source(self, source: Source, files: Fingerprint | None = None) -> None:
        """Fingerprint the files of ``source`` (closed with the transaction); ``files``: their
        fingerprints, where the caller took them already (for the plan's key)."""
        self.sources.append(source)
        self.files.update(files if files is not None else fingerprint(source.files()))

    def add_optimizer(self, optimizer: torch.optim.Optimizer, was_empty: bool) -> None:
        """The optimizer whose state the parts write; ``was_empty``: it held no state before."""
        self.optimizer, self.optimizer_was_empty = optimizer, was_empty

    def prepare(self, step: Callable[[], T], intent: Callable[[T], Mapping[str, Any]] | None = None) -> T:
        """Collective: run ``step`` (planning: headers only, nothing changed) on every rank; if it
        raises on any rank, every rank raises (see :meth:`agree`). Whatever ``step`` raises is
        caught: an :class:`SdadaptError` as it is, any other exception (a bug, or input a check
        missed) as a :class:`SourceError` naming the file it was about (or the source), so that no
        rank leaves while the others wait. ``step`` must not run collectives of its own (a rank
        failing before one would leave the others in it): Hub ids are resolved first, by
        :meth:`resolve`. ``intent(out)``: what this rank is about to do (``_plan.intent``), agreed
        in the same collective (``DisagreementError`` where ranks differ)."""
        error: SdadaptError | None = None
        out: Any = None
        intent = intent if rank_and_world(self.group)[1] > 1 else None  # a rank alone has nobody to compare it with
        parts: Mapping[str, Any] = no_intent() if intent is not None else {}
        try:
            out = step()
            parts = intent(out) if intent is not None else parts
        except SdadaptError as e:
            error = e
        except Exception as e:  # noqa: BLE001 - every failure must be agreed, whatever its type
            error = foreign_error(e, self.what, "preparing")
        self.agree(error, parts, hosts=self.ask_hosts)
        return out

    def resolve(self, src: T) -> T | str:
        """Collective: ``src`` with a Hub id (``hf://...``) replaced by its local snapshot folder
        (downloaded by one process per node, agreed on every rank: see
        :func:`sdadapt.sources._hub.hub_folder`); anything else as it is."""
        if not isinstance(src, str) or not is_hub_id(src):
            return src
        from ..sources import hub_folder  # imported only for a Hub id

        hub_id: str = src
        if is_distributed():
            return hub_folder(hub_id, agree_fn=self.agree)
        return self.prepare(lambda: hub_folder(hub_id))

    def agree(self, error: BaseException | None, parts: Mapping[str, Any] | None = None, hosts: bool = False) -> None:
        """Collective: if any rank failed (or ``parts`` differ), close the sources, undo what this
        load changed, raise. ``hosts``: the same all-reduce learns whether every rank runs on
        one host (:attr:`one_host`; TP row sharing's ``"auto"``)."""
        try:
            if hosts:
                self.one_host = agree_on(parts or {}, error, self.group, what=self.what, spread=host_id())
            else:
                agree_on(parts or {}, error, self.group, what=self.what)
        except SdadaptError:
            self.close()
            self._undo(partly_written=False)
            raise

    def materialize(self, device: torch.device | str | None, init_buffers: InitFn | None,
                    reserved: Reservation | None = None, then: InitFn | None = None) -> bool:
        """Collective: ``to_empty`` a meta model and run its buffer hook (and ``then``: the
        allowed-missing keys' values), on every rank; a hook failing on one rank stops the others
        before any reads. ``reserved``: the model's memory, asked for while the load planned
        (see :func:`materialize`)."""
        assert self.model is not None
        error: SdadaptError | None = None
        try:
            self.materialized = materialize(self.model, choose_device(self.model, device), init_buffers, reserved, then, self.modules)
        except Exception as e:  # noqa: BLE001 - user hooks can raise anything; re-raised below
            error = e if isinstance(e, SdadaptError) else ModelError(f"materialising the model failed: {type(e).__name__}: {e}")
            error.__cause__ = e
        self.agree(error)
        return self.materialized is not None

    def check_files(self) -> None:
        """Collective: the files are unchanged since planning (every rank checks; a hook may have
        touched them), before the first byte is written."""
        error: SdadaptError | None = None
        try:
            self.files_unchanged("after planning, before reading")
        except SdadaptError as e:
            error = e
        self.agree(error)

    def fetch_ahead(self, parts: list[Part]) -> None:
        """Collective: a source at an object storage URL fetches what this rank will read
        (:meth:`EngineReader.fetch_ahead`) before any rank writes, so that a fetch
        failing on one rank (403, a missing or changed object) leaves every rank's model as
        it was. Nothing for local sources."""
        if not any(p.source.remote_url() for p in parts):
            return
        error: SdadaptError | None = None
        for part in parts:
            part.reader = self._reader(part, direct_targets(part.targets))
        try:
            for part in parts:
                assert part.reader is not None
                part.reader.fetch_ahead(part.targets)
        except SdadaptError as e:
            error = e
        except Exception as e:  # noqa: BLE001 - every failure must be agreed, whatever its type
            error = foreign_error(e, self.what, "fetching")
        self.agree(error)

    def files_unchanged(self, when: str) -> None:
        """This rank alone: raise :class:`SourceError` naming the first fingerprinted file that
        changed (``when`` says since when, for the message)."""
        check_unchanged(self.files, when)

    # ------------------------------------------------------------------ read, check, commit
    def run(
        self,
        parts: list[Part],
        *,
        atomic: bool,
        check_finite: bool = False,
        finish: Sequence[CommitStep] = (),
        mark: Callable[[str], None] = lambda phase: None,
    ) -> None:
        """Collective: check the files, read every part in order (into a staged copy when
        ``atomic``), check, then commit (copy the staged shards in, run the ``finish`` steps in
        order, copy detached tensors back) or roll back; a failure reading, checking or
        committing on any rank raises :class:`LoadError` on every rank. ``mark(phase)`` is
        called at the end of the phases ``dcp_load``, ``check`` and ``commit`` (for timing)."""
        self.check_files()
        self.fetch_ahead(parts)
        for part in parts:
            part.staged = staging_like(part.targets) if atomic else None
        errors: list[str] = []
        for i, part in enumerate(parts):
            errors = self._read(part)
            if i == len(parts) - 1:
                break
            # before the next part, every rank learns whether this one failed anywhere (one
            # one-element all-reduce): a failure in the optimizer's part leaves the model unwritten
            if any_rank(bool(errors), self.group) if is_distributed() else errors:
                break  # the failing ranks' errors are gathered in the checks below
        self.close()
        mark("dcp_load")
        loaded = {f"{p.name}:{k}": v for p in parts for k, v in p.into.items()}
        failure = after_read_checks(self.files, loaded, parts, check_finite, self.group, errors, self.what)
        mark("check")
        if failure is not None:
            for part in parts:
                part.staged = None
            partly = not atomic and not self.was_meta and bool(self.written)
            self._undo(partly_written=partly)
            failure.args = (failure.args[0] + "\n" + (self._overwritten() if partly else "Nothing was kept from this load."),)
            raise failure
        self._commit(parts, atomic, finish)
        for obj in (self.model, self.optimizer):
            if obj is not None:
                clear_mark(obj)
        mark("commit")

    # ------------------------------------------------------------------ commit
    def _commit(self, parts: list[Part], atomic: bool, finish: Sequence[CommitStep]) -> None:
        """Collective: run the commit's steps on this rank, stopping at the first that raises,
        then agree; if a step failed on any rank, undo what can be undone, mark what cannot
        (see the module's docstring) and raise :class:`LoadError` on every rank."""
        groups = param_groups_of(self.optimizer) if self.optimizer is not None and self.optimizer_was_empty else None
        progress = CommitProgress(
            model=not atomic and any(p.of_model for p in parts),  # the reads wrote in place
            optimizer=not atomic and any(not p.of_model for p in parts),
        )
        cause = progress.run(self._commit_steps(parts, atomic, finish, progress))
        for part in parts:
            part.staged = None
        mine = (progress.error, progress.done, progress.model, progress.optimizer)
        # Cannot hang: every rank reaches this gather exactly once, right after its own commit
        # attempt, whether a step raised or not (progress.run catches it; the failing rank only
        # skips its remaining steps). No step sdadapt runs before it communicates: the copy-in
        # writes this rank's own shards, set_state_dict on sharded state without
        # full_state_dict / broadcast_from_rank0 works on local shards, the copy-back for FSDP2 /
        # TP / plain modules finds nothing detached. (A caller's step that ran a collective of
        # its own could wait for a rank that failed before it.) Nobody failing: one one-element
        # all-reduce.
        gathered = gather_if_any(mine, progress.error is not None, self.group) if is_distributed() else [mine]
        failed = {r: g for r, g in enumerate(gathered) if g is not None and g[0] is not None}
        if not failed:
            return
        model_changed = any(g[2] for g in gathered if g is not None)
        optimizer_changed = any(g[3] for g in gathered if g is not None)
        state = self._undo_commit(model_changed, optimizer_changed, groups)
        lines = [f"  rank {r}: {err} (done before it: {', '.join(done) or 'nothing'})" for r, (err, done, _, _) in sorted(failed.items())]
        error = LoadError(
            f"committing the load of {self.what} failed on rank(s) {', '.join(map(str, sorted(failed)))}:\n"
            + "\n".join(lines)
            + "\n"
            + state
        )
        error.failures = {r: g[0] for r, g in failed.items()}  # type: ignore[attr-defined]
        raise error from cause

    def _commit_steps(self, parts: list[Part], atomic: bool, finish: Sequence[CommitStep], progress: CommitProgress) -> list[CommitStep]:
        """The commit's steps in order, each recording in ``progress`` what it begins to change."""
        steps: list[CommitStep] = [(COPY_IN, lambda: self._copy_in(parts, progress))] if atomic else []
        for name, step in finish:
            steps.append((name, touching_optimizer(step, progress, self.optimizer is not None)))
        if self.model is not None and any(p.of_model for p in parts):
            steps.append((COPY_BACK, lambda: self._copy_back(parts, progress)))
        return steps

    def _copy_in(self, parts: list[Part], progress: CommitProgress) -> None:
        for part in parts:
            if part.of_model:
                progress.model = True
            else:
                progress.optimizer = True
            copy_staged_in(part)
            part.staged = None

    def _copy_back(self, parts: list[Part], progress: CommitProgress) -> None:
        assert self.model is not None
        progress.model = True
        for p in parts:
            if p.of_model and not p.own:
                copy_back_if_detached(self.model, p.targets)

    def _undo_commit(self, model_changed: bool, optimizer_changed: bool, groups: ParamGroups | None) -> str:
        """After a failed commit (agreed over all ranks): give a fresh optimizer no state and its
        own param groups back, a meta model back to meta; mark what else was changed. Returns
        the sentences that say so."""
        said: list[str] = []
        if self.model is not None and self.was_meta:
            self.model.to_empty(device="meta")
            log.info("commit failed: the model is back on the meta device")
            said.append("The model is back on the meta device.")
        elif self.model is not None and model_changed:
            mark_unusable(self.model, COMMIT_FAILED.format(what="model"))
            said.append(
                "The model holds the checkpoint's values (in whole or in part) without the rest of the restored state: "
                "the model's forward raises ModelError until a load into it succeeds."
            )
        elif self.model is not None:
            said.append("The model was not changed.")
        if self.optimizer is not None and groups is not None:
            self.optimizer.state.clear()
            restore_param_groups(self.optimizer, groups)
            said.append("The optimizer held no state before the load and holds none now, its param groups as they were.")
        elif self.optimizer is not None and optimizer_changed:
            mark_unusable(self.optimizer, COMMIT_FAILED.format(what="optimizer"))
            said.append(
                "The optimizer holds part of the checkpoint's state: the optimizer's step raises ModelError until a load into it succeeds."
            )
        elif self.optimizer is not None:
            said.append("The optimizer was not changed.")
        said.append("atomic=True does not guard this step (it fails while committing); remove the cause and load again.")
        return " ".join(said)

    def _reader(self, part: Part, direct: bool) -> EngineReader:
        """The reader of ``part``: the engine's own (``direct``), else DCP's ``StorageReader`` face."""
        if direct:
            return EngineReader(part.plan, part.source, config=self.engine, share_reads=part.share_reads, one_host=self.one_host)
        from .._engine.reader import AdaptedStorageReader  # noqa: PLC0415 - imports torch.distributed.checkpoint

        return AdaptedStorageReader(part.plan, part.source, config=self.engine, share_reads=part.share_reads, one_host=self.one_host)

    def _read(self, part: Part) -> list[str]:
        """Read one part on this rank alone: by the engine (tensors and DTensors: the same jobs
        ``dcp.load`` would make), else one ``dcp.load`` with a local read plan (the reader's
        metadata is the target schema, which every rank has, so DCP's plan exchange is skipped:
        ``no_dist``); the outcome is agreed in the checks after reading. Returns this rank's
        read errors, one line each."""
        direct = direct_targets(part.into)
        if part.reader is None or (not direct and type(part.reader) is EngineReader):
            fetched = part.reader.fetched if part.reader is not None else (0, 0)
            part.reader = self._reader(part, direct)  # made by fetch_ahead for a source at a URL
            part.reader.fetched = fetched
        part.reader.on_done = self.on_done
        self.written.append(part)
        log.debug("reading %d keys of %s from %s", len(part.into), part.name, self.what)
        try:
            if direct:
                part.reader.load_into(part.into)
                errors = []
            else:
                errors = _dcp_load(part, self.group)
        except Exception as e:  # noqa: BLE001 - named and agreed on after reading
            errors = [f"{type(e).__name__}: {e}"]
        if not errors:
            return []
        if not part.reader.began_writing:
            self.written.remove(part)  # it failed before writing a byte (fetching from object storage)
        return errors

    def _overwritten(self) -> str:
        model = sum(len(p.targets) for p in self.written if p.of_model)
        optim = sum(len(p.targets) for p in self.written if not p.of_model)
        what = [f"{model} model key(s)"] if model else []
        if optim:
            what.append(f"{optim} optimizer state tensor(s)")
        said = [
            f"The load wrote in place (atomic=True was not given): this rank had begun writing {' and '.join(what)}, "
            "so they are partly overwritten."
        ]
        if model:
            said.append("The model's forward raises ModelError until a load into it succeeds.")
        if optim and self.optimizer_was_empty:
            said.append("The optimizer held no state before the load, and its state was cleared again.")
        elif optim:
            said.append("The optimizer's step raises ModelError until a load into it succeeds.")
        said.append("Load again, or pass atomic=True to keep the old values when a load fails.")
        return " ".join(said)

    def _undo(self, partly_written: bool) -> None:
        """Put back what can be put back: a meta model to meta, a fresh optimizer to no state;
        mark what was partly overwritten."""
        if self.optimizer is not None and self.optimizer_was_empty:
            self.optimizer.state.clear()
        if self.model is not None and self.was_meta:
            self.model.to_empty(device="meta")
            log.info("load failed: the model is back on the meta device")
            return
        if not partly_written:
            return
        if self.model is not None and any(p.of_model for p in self.written):
            mark_unusable(self.model)
        if self.optimizer is not None and not self.optimizer_was_empty and any(not p.of_model for p in self.written):
            mark_unusable(self.optimizer)

    def close(self) -> None:
        for s in self.sources:
            s.close()
        self.sources = []


def foreign_error(e: BaseException, what: str, doing: str) -> SdadaptError:
    """An exception that is not sdadapt's, raised while ``doing`` the load of ``what``: a
    :class:`VersionError` naming the package and its version where it comes from a dependency's
    API (an ``AttributeError``, ``ImportError`` or ``TypeError`` of transformers, torch...), else a
    :class:`SourceError` naming the file it was about (an ``OSError``'s file name) or ``what``."""
    from .._base.env import version_problem  # noqa: PLC0415 - on a failed load only: a plain load never imports it

    version = version_problem(e, f"{doing} the load of {what}")
    path = getattr(e, "filename", None)
    err = VersionError(version) if version is not None else SourceError(
        f"{doing} the load of {what} failed: {type(e).__name__}: {e}; a file it reads is malformed in a way "
        "sdadapt does not check yet (please report it)",
        path=os.fspath(path) if isinstance(path, (str, os.PathLike)) else what,
    )
    err.__cause__ = e
    return err


# ---------------------------------------------------------------------------- marks
def _refusing(reason: str) -> Callable[..., None]:
    def refuse(*_: Any) -> None:
        raise ModelError(reason)

    return refuse


def mark_unusable(obj: nn.Module | torch.optim.Optimizer, reason: str = PARTLY_LOADED) -> None:
    """Make ``obj``'s forward (a module) or ``step`` (an optimizer) raise :class:`ModelError`
    with ``reason`` until :func:`clear_mark`: a partly overwritten model must not train or infer
    silently. A mark already there is replaced (the latest failure says what holds now)."""
    clear_mark(obj)
    if isinstance(obj, nn.Module):
        _marks[obj] = obj.register_forward_pre_hook(_refusing(reason), prepend=True)
    else:
        _marks[obj] = obj.register_step_pre_hook(_refusing(reason))
    log.warning("%s is marked unusable: %s", type(obj).__name__, reason)


def clear_mark(obj: nn.Module | torch.optim.Optimizer) -> None:
    handle = _marks.pop(obj, None)
    if handle is not None:
        handle.remove()


def is_marked(obj: nn.Module | torch.optim.Optimizer) -> bool:
    """Whether a failed load left ``obj`` partly overwritten (see :func:`mark_unusable`)."""
    return obj in _marks


# ---------------------------------------------------------------------------- helpers
def copy_staged_in(part: Part) -> None:
    """Copy ``part``'s staging shards into its targets (this rank's own shards)."""
    assert part.staged is not None
    with torch.no_grad():
        for k, s in part.staged.items():
            local(part.targets[k]).copy_(local(s))


def staging_like(wanted: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Empty shards laid out like ``wanted`` (same DTensor mesh, placements, global shape)."""
    out: dict[str, torch.Tensor] = {}
    for k, v in wanted.items():
        if isinstance(v, DTensor):
            out[k] = DTensor.from_local(
                torch.empty_like(v._local_tensor), v.device_mesh, v.placements, run_check=False, shape=v.shape, stride=v.stride()
            )
        else:
            out[k] = torch.empty_like(v.detach())
    return out


def _dcp_load(part: Part, group: dist.ProcessGroup | None) -> list[str]:
    """``dcp.load`` of ``part`` through its :class:`~sdadapt._engine.reader.AdaptedStorageReader`;
    DCP's exception (a ``BaseException``) as this rank's read errors."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415 - only targets the engine cannot read alone need it
    from torch.distributed.checkpoint.api import CheckpointException  # noqa: PLC0415

    from .._engine.reader import AdaptedLoadPlanner  # noqa: PLC0415 - imports torch.distributed.checkpoint

    try:
        with single_process_quiet():
            dcp.load(part.into, storage_reader=part.reader, planner=AdaptedLoadPlanner(), process_group=group, no_dist=True)
    except CheckpointException as e:  # a BaseException: turn it into ours
        return read_errors(e)
    return []


def read_errors(e: CheckpointException) -> list[str]:
    """This rank's own read errors out of DCP's exception (file, key), one line each."""
    failures = [(p[0] if isinstance(p, tuple) else p) for _, p in sorted((getattr(e, "failures", {}) or {}).items())]
    return [f"{type(exc).__name__}: {exc}" for exc in failures] or [str(e)]


def copy_back_if_detached(model: nn.Module, loaded: dict[str, torch.Tensor]) -> None:
    """DCP wrote into the state dict's tensors. They are the model's own (sharded) tensors for
    plain modules, TP and FSDP2; if some are copies (other wrappers), copy them back.

    Cheap checks first: when every loaded tensor is one of the model's own parameters or buffers
    (a load's targets, :func:`~sdadapt._plan.target.load_targets`), or its memory is that of one,
    nothing is detached (no second ``get_model_state_dict``)."""
    tensors = own_tensors(model)
    ids = {id(t) for t in tensors}
    if all(id(v) in ids for v in loaded.values()):
        return
    own = {local(t).data_ptr() for t in tensors}
    if all(local(v).data_ptr() in own or local(v).numel() == 0 for v in loaded.values()):
        return
    current = model_state_dict(model)
    detached: dict[str, Any] = {k: v for k, v in loaded.items() if not _same_storage(current.get(k), v)}
    if detached:
        log.debug("copying %d detached tensors back into the model", len(detached))
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict  # noqa: PLC0415 - wrapped models only

        set_model_state_dict(model, detached, options=StateDictOptions(strict=False))


def _same_storage(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    if a is None:
        return False
    la, lb = local(a), local(b)
    return la.data_ptr() == lb.data_ptr() or la.numel() == 0
