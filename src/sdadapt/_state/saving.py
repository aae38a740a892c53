"""``save_state``: model + optimizer (+ extras) into a DCP folder, now or in the background.

The folder is ``dcp.save`` of ``{"model": ..., "optim": ..., **extra}`` plus ``sdadapt.json`` (see
:mod:`.state`); an object storage URL is saved into a local folder on each rank, then uploaded,
the commit objects last (:func:`_save_to_url`). ``async_=True`` stages and returns a handle
(:mod:`.background`).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal, overload

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from .._base.agreement import agree_on
from .._base.distributed import agree, gather_agreed, is_distributed, rank_and_world
from .._base.version import VERSION
from .._plan.adapter import Adapter
from .._plan.intent import intent, no_intent
from .._plan.resolve import adapter_or_none
from .._plan.target import model_state_dict
from .._transaction.args import check_model_and_path
from .._transaction.materialize import has_meta
from .._transaction.tidy import call_started, public, single_process_quiet
from ..errors import SdadaptError, StateError
from ..sources import CHECKSUMS_NAME, SDADAPT_JSON, is_url, write_checksums_shared
from .background import SaveHandle, given_up, start_save, start_writer, storage_writer
from .saved import SaveReport
from .state import MODEL_KEY, OPTIM_KEY, STATE_FORMAT, _get_state
from .taken import take_state

log = logging.getLogger(__name__)


@overload
def save_state(
    model: nn.Module, dst: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Stateful | Any] | None = None, adapter: Adapter | str | None = None, *, overwrite: bool = False,
    process_group: dist.ProcessGroup | None = None, checksums: bool = False, async_: Literal[False] = False,
) -> SaveReport: ...


@overload
def save_state(
    model: nn.Module, dst: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Stateful | Any] | None = None, adapter: Adapter | str | None = None, *, overwrite: bool = False,
    process_group: dist.ProcessGroup | None = None, checksums: bool = False, async_: Literal[True],
) -> SaveHandle: ...


@public
def save_state(
    model: nn.Module,
    dst: str | os.PathLike[str],
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Stateful | Any] | None = None,
    adapter: Adapter | str | None = None,
    *,
    overwrite: bool = False,
    process_group: dist.ProcessGroup | None = None,
    checksums: bool = False,
    async_: bool = False,
) -> SaveReport | SaveHandle:
    """Save model (+ optimizer, + ``extra`` entries) to the DCP folder ``dst``; every rank calls it.

    ``checksums=True`` also writes ``sdadapt.checksums.json`` (for ``load(..., checksums=True)``):
    the ranks read the saved tensors back, each a share of the keys, so it costs one read of
    the checkpoint spread over the ranks.

    ``extra`` maps names to ``Stateful`` objects (LR scheduler, dataloader: saved through
    ``state_dict()``) or plain values (``{"step": 7}``). ``adapter``, the checkpoint->model
    adapter the model was first loaded with, is recorded in ``sdadapt.json``. An existing
    non-empty ``dst`` is an error unless ``overwrite=True``.

    ``async_=True`` (DCP's ``async_save``) returns once this rank's shards, optimizer state and
    extras are copied into host memory, and writes them in a background thread (over a gloo
    group of the same ranks, made once, so training's own collectives go on meanwhile): it
    returns a :class:`~sdadapt.reports.SaveHandle` whose ``wait()`` gives the
    :class:`~sdadapt.reports.SaveReport` or raises the save's error, on every rank (a check
    that failed on any rank too: the ranks agree in the background, not in the call). The model
    and optimizer may change as soon as it returns; the host copy is kept and reused by the
    next save (one copy of this rank's state in host memory while the model lives, and no
    fresh memory touched by later saves), and so are the state dicts' names while the model's
    tensors stay where they were. ``.metadata`` (DCP's) and then
    ``sdadapt.json`` are written last, once every rank's files are written, so a folder a crash
    cut short never looks complete. :class:`sdadapt.Checkpointer` saves every N training steps
    and keeps the last few.

    Args:
        model: the model whose state is saved.
        dst: the DCP folder to write.
        optimizer: its optimizer, saved too.
        extra: ``name -> Stateful or value`` entries to save beside them.
        adapter: the checkpoint->model adapter the model was first loaded with (recorded).
        overwrite: replace a non-empty ``dst``.
        process_group: the group the ranks save over.
        checksums: also write ``sdadapt.checksums.json``.
        async_: stage in host memory, write in the background, return a handle.

    Returns:
        This rank's :class:`~sdadapt.reports.SaveReport`, which also stands for ``dst`` as a path
        (``os.fspath(report)``, ``report.path``, ``report == dst``); with ``async_=True`` a
        :class:`~sdadapt.reports.SaveHandle` whose ``wait()`` returns it.

    Example::

        sdadapt.save_state(model, "ckpt/step_100", optimizer, extra={"step": 100, "sched": scheduler})
        pending = sdadapt.save_state(model, "ckpt/step_200", optimizer, async_=True)
        saved = pending.wait()  # before the next save
    """
    t0 = call_started()
    check_model_and_path("sdadapt.save_state(model, dst, optimizer=None, extra=None, ...)", model, dst, path_arg="dst")
    dst = os.fspath(dst)
    if is_url(dst):
        if async_:
            raise StateError("async_=True is not supported for an object storage destination yet; save to a folder, or without it")
        done: list[SaveReport] = []

        def local_save(folder: str) -> None:
            done.append(save_state(model, folder, optimizer, extra, adapter, overwrite=True, process_group=process_group))

        if checksums:
            raise StateError("checksums=True is not supported for an object storage destination yet; save without it")
        _save_to_url(dst, local_save, overwrite, process_group)
        return done[0].model_copy(update={"path": dst, "seconds": time.perf_counter() - t0})
    rank, world = rank_and_world(process_group)
    extra = dict(extra or {})
    error: SdadaptError | None = None
    state: dict[str, Any] = {}
    taking = 0.0  # the take's seconds, part of a background save's staging
    if async_:
        start_writer()  # its thread starts while this one copies, not after
    try:
        for name in extra:
            if not isinstance(name, str) or not name or "." in name or name in (MODEL_KEY, OPTIM_KEY):
                raise StateError(
                    f"extra entry name {name!r}: use a non-empty name without dots, other than {MODEL_KEY!r} and {OPTIM_KEY!r}"
                )
        if async_:  # the dicts are remembered between saves (the name walk held training); the rest of the checks in the background
            t_take = time.perf_counter()
            model_sd, optim_sd = take_state(model, optimizer, _take, lambda: _check_meta(model))
            taking = time.perf_counter() - t_take
        else:
            _check_dst(dst, rank, overwrite)
            _check_meta(model)
            model_sd, optim_sd = _take(model, optimizer)
        state = {MODEL_KEY: model_sd} if optim_sd is None else {MODEL_KEY: model_sd, OPTIM_KEY: optim_sd}
        state.update(extra)
    except SdadaptError as e:
        error = e
    keys = len(state.get(MODEL_KEY, ()))

    def write(staged: dict[str, Any], group: dist.ProcessGroup | None) -> SaveReport:
        """Every rank's checks, and the same adapter, extras and versions (the stages of a
        pipeline save different keys), agreed before anything is written; then the writing."""
        failed = error
        resolved: Adapter | None = None
        try:
            if async_ and failed is None:
                _check_dst(dst, rank, overwrite)
            resolved = adapter_or_none(adapter, None, model) if adapter is not None else None  # None: nothing to import
        except SdadaptError as e:
            failed = failed or e
        parts = no_intent() if failed is not None else intent(resolved, None, extra=sorted(extra), optimizer=optimizer is not None)
        agree_on(parts, failed, group, what=f"save {dst}")
        record = {
            "format": STATE_FORMAT,
            "sdadapt_version": _version(),
            "torch_version": torch.__version__,
            "world_size": world,
            "model_key": MODEL_KEY,
            "optim_key": OPTIM_KEY if optimizer is not None else None,
            "optimizer": type(optimizer).__name__ if optimizer is not None else None,
            "extra": sorted(extra),
            "adapter": json.loads(resolved.to_json()) if resolved is not None else None,
        }
        _write_rest(staged, dst, record, rank, world, group, checksums)
        return SaveReport(
            rank=rank, world_size=world, path=dst, model_keys=keys,
            optimizer=type(optimizer).__name__ if optimizer is not None else None, extra=sorted(extra),
            checksums=checksums, seconds=time.perf_counter() - t0,
        )  # fmt: skip

    if async_:  # a failed check is raised by the handle's wait(), on every rank
        return start_save(state if error is None else None, dst, process_group, t0, write, taking)
    with single_process_quiet():
        saved = write(state, process_group)
    log.info("%s", saved.format())
    return saved


def _check_dst(dst: str, rank: int, overwrite: bool) -> None:
    """Rank 0: ``dst`` is a folder, empty unless ``overwrite``."""
    if rank == 0 and os.path.isdir(dst) and os.listdir(dst) and not overwrite:
        raise StateError(f"{dst} exists and is not empty; pass overwrite=True or choose a new folder")
    if rank == 0 and os.path.exists(dst) and not os.path.isdir(dst):
        raise StateError(f"{dst} exists and is not a folder")


def _check_meta(model: nn.Module) -> None:
    if has_meta(model):
        raise StateError("the model still has tensors on the meta device; there is nothing to save")


def _take(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The model's state dict and the optimizer's (``get_state_dict``'s names), or ``None`` for it."""
    if optimizer is None:
        return model_state_dict(model), None
    return _get_state(model, optimizer)


def _write_rest(state: dict[str, Any], dst: str, record: dict[str, Any], rank: int, world: int,
                group: dist.ProcessGroup | None, checksums: bool) -> None:  # fmt: skip
    """Collective over ``group``, once the ranks agreed: an old checkpoint's ``.metadata``,
    ``sdadapt.json`` and checksums removed before any rank writes (a save cut short must not look
    complete, with old and new files mixed, nor keep another save's record or checksums), the
    DCP save of ``state`` (its ``.metadata`` last), the checksums, then ``sdadapt.json`` by rank 0,
    which marks the folder complete (not once exit gave the save up: ``background.given_up``);
    one rank's failure is every rank's. In the background (``async_=True``) all of it runs on
    the writing thread: the caller waits for none of it."""
    error: SdadaptError | None = None
    for name in (".metadata", SDADAPT_JSON, CHECKSUMS_NAME) if rank == 0 else ():
        try:
            os.remove(os.path.join(dst, name))
        except FileNotFoundError:
            pass
        except OSError as e:
            error = StateError(f"saving to {dst} failed removing the old {name} ({e}); nothing was written")
            break
    agree(error, group)  # and no rank writes before they are gone
    try:
        # a group given (the background one) is used even if the world was destroyed meanwhile: its collectives fail
        dcp.save(state, checkpoint_id=dst, storage_writer=storage_writer(dst), process_group=group,
                 no_dist=group is None and not is_distributed())
    except CheckpointException as e:
        cause = _os_error(e)
        if cause is not None:  # a full disk on any rank: named, with its errno, on every rank
            full = " (the disk is full)" if cause.errno == errno.ENOSPC else ""
            raise StateError(f"saving to {dst} failed{full}: {cause}") from None
        raise StateError(f"saving to {dst} failed: {e}") from None
    if checksums:  # before sdadapt.json: a folder that looks complete has the checksums asked for
        write_checksums_shared(dst, rank, world, group)
    if rank == 0 and given_up():  # exit stopped waiting for this save: it must not look complete
        error = StateError(f"saving to {dst} was given up at exit before it was marked complete ({SDADAPT_JSON})")
    elif rank == 0:
        try:
            tmp = os.path.join(dst, f".{SDADAPT_JSON}.{uuid.uuid4().hex[:8]}")
            with open(tmp, "w") as f:
                json.dump(record, f, indent=2)
            os.replace(tmp, os.path.join(dst, SDADAPT_JSON))
        except OSError as e:
            error = StateError(f"saving to {dst} failed writing {SDADAPT_JSON}: {e}")
    agree(error, group)


def _os_error(e: CheckpointException) -> OSError | None:
    """The first rank's ``OSError`` among DCP's failures ({rank: exception or (exception, trace)})."""
    for _, failure in sorted(e.failures.items()):
        inner = failure[0] if isinstance(failure, tuple) and failure else failure
        if isinstance(inner, OSError):
            return inner
    return None


def _save_to_url(url: str, local_save: Callable[[str], None], overwrite: bool, group: dist.ProcessGroup | None) -> str:
    """Collective: save into a local folder on each rank (the spool, under ``TMPDIR``), then
    upload: one rank retires the old checkpoint's commit objects (only once every rank's local
    copy is written: a spool that fills leaves the old checkpoint as it was), every rank uploads
    its own ``.distcp`` files, and only once all succeeded does one rank upload
    ``sdadapt.json`` and ``.metadata`` (so a reader never sees a half-written checkpoint), then
    delete what the old checkpoint had beyond the new."""
    from ..sources import COMMIT_NAMES, Uploader, check_writable  # only for a URL: the object store client

    rank, _ = rank_and_world(group)
    folder = tempfile.mkdtemp(prefix="sdadapt-save-")
    up: Uploader | None = None
    old: list[str] = []
    try:
        error: SdadaptError | None = None
        try:
            up = Uploader(url)
            if rank == 0:
                check_writable(url, overwrite)
        except SdadaptError as e:
            error = StateError(str(e))
        agree(error, group)
        assert up is not None
        try:
            local_save(folder)
        except StateError as e:
            if not str(e).startswith(f"saving to {folder} failed"):  # a check, not the writing
                raise
            raise StateError(
                f"saving to {url} failed writing the local copy each rank uploads from ({e}); set "
                "TMPDIR to a folder with room for this rank's shards and optimizer state; nothing was uploaded, and what "
                f"{url} held before is as it was"
            ) from None
        names = sorted(os.listdir(folder))
        data = [n for n in names if n not in COMMIT_NAMES]
        try:
            if rank == 0:
                old = up.retire(overwrite)
        except SdadaptError as e:
            error = StateError(str(e))
        agree(error, group)
        try:
            up.put([(os.path.join(folder, n), up.dest(n)) for n in data])
        except SdadaptError as e:
            error = StateError(str(e))
        everything = gather_agreed(names, error, group)  # what every rank uploaded, once all did
        if rank == 0:
            try:
                up.put([(os.path.join(folder, n), up.dest(n)) for n in names if n in COMMIT_NAMES])
                up.sweep(old, {up.dest(n) for ns in everything for n in ns})
            except SdadaptError as e:
                error = StateError(str(e))
        agree(error, group)
    except BaseException:
        if up is not None:
            up.undo()
        raise
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    log.info("rank %d: saved state to %s", rank, url)
    return url


def _version() -> str:
    return VERSION


__all__ = ["save_state"]
