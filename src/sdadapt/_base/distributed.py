"""Agreement between ranks: one rank's failure becomes every rank's error, never a hang."""

from __future__ import annotations

import contextvars
import datetime
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..errors import RemoteRankError, SdadaptError
from . import teardown

CHECKPOINT: contextvars.ContextVar[str | None] = contextvars.ContextVar("sdadapt_checkpoint", default=None)
"""The checkpoint of the public operation running (its ``src`` or ``dst``, set by
:func:`sdadapt._transaction.tidy.public`): the one-line errors of ranks other than 0
(:func:`brief_off_rank0`) name it when their line does not."""


teardown.register()  # a process that runs sdadapt's collectives ends its groups before finalizing


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_and_world(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    if not is_distributed():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def agree(
    error: BaseException | None,
    group: dist.ProcessGroup | None = None,
    remote: Callable[[str], BaseException] = RemoteRankError,
    timeout: float | None = None,
) -> None:
    """Collective: every rank calls it; if any rank passes an error, every rank raises.

    The failing rank re-raises its own error; the others raise :class:`RemoteRankError`
    quoting it. Only rank 0's error carries the whole message: on the other ranks it is one
    line pointing at rank 0 (:func:`brief_off_rank0`), so that N ranks do not print N copies.
    Call it at the same point on every rank. ``remote``: the error class of the ranks that did
    not fail (``RefitError`` where every rank's error must be one). ``timeout``: seconds to wait
    for the other ranks to arrive (``None``: the group's own timeout); past it, the backend's
    ``RuntimeError``.
    """
    if not is_distributed():
        if error is not None:
            raise error
        return
    if any_rank(error is not None, group, timeout):
        raise_agreed(error, group, remote)


def raise_agreed(
    error: BaseException | None, group: dist.ProcessGroup | None = None, remote: Callable[[str], BaseException] = RemoteRankError
) -> None:
    """Collective, once every rank knows that some rank failed: the failing ranks re-raise their
    own error, the others ``remote`` (:class:`RemoteRankError`) quoting the first failing rank's."""
    _raise_first(error, gather_objects(_message(error), group), group, remote)


def gather_agreed(
    obj: Any, error: BaseException | None, group: dist.ProcessGroup | None = None,
    remote: Callable[[str], BaseException] = RemoteRankError,
) -> list[Any]:  # fmt: skip
    """Collective: :func:`agree` then :func:`gather_objects` in one all-gather. Every rank's
    ``obj`` in rank order; if any rank passes an ``error``, every rank raises as :func:`agree`
    has it (the failing ranks their own error, the others ``remote`` quoting the first)."""
    every = gather_objects((_message(error), None if error is not None else obj), group)
    _raise_first(error, [m for m, _ in every], group, remote)
    return [o for _, o in every]


def _message(error: BaseException | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"


def _raise_first(
    error: BaseException | None, msgs: list[str | None], group: dist.ProcessGroup | None, remote: Callable[[str], BaseException]
) -> None:
    """Given every rank's error message (``None``: it did not fail): this rank's own error if it
    failed, else ``remote`` quoting the first failing rank's, else nothing."""
    if error is not None:
        brief_off_rank0(error, group)
        raise error
    for r, m in enumerate(msgs):
        if m is not None:
            other = remote(f"rank {r} failed, so this rank stops too:\n{m}")
            brief_off_rank0(other, group, first=f"rank {r} failed ({m.split(chr(10), 1)[0].rstrip(':')}), so this rank stops too")
            raise other


def brief_off_rank0(error: BaseException, group: dist.ProcessGroup | None = None, first: str | None = None) -> None:
    """On a rank other than 0 (of ``group``) of a distributed run, cut an sdadapt error that every
    rank raises to its first line, pointing at rank 0's error, which has the whole message (its
    ``full_message`` attribute keeps it here); ``first``: the line to say instead of the first.
    The line names the checkpoint of the public operation running (:data:`CHECKPOINT`),
    so that every rank's one line says which checkpoint and what kind of problem. Errors that
    are not sdadapt's are left alone."""
    if not isinstance(error, SdadaptError) or not is_distributed() or dist.get_rank(group) == 0 or not error.args:
        return
    full = str(error)
    first = first or full.split("\n", 1)[0].rstrip(":")
    if first == full:
        return
    error.full_message = full  # type: ignore[attr-defined]
    more = "; this error's .report holds the report" if hasattr(error, "report") else ""
    where = CHECKPOINT.get()
    about = f", checkpoint {where}" if where and where not in first else ""
    error.args = (f"{first} [rank {dist.get_rank(group)}{about}: rank 0's error has the whole message{more}]", *error.args[1:])


def gather_objects(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Collective: every rank's ``obj`` (picklable), in rank order; ``[obj]`` outside a process
    group or in a group of one (no collective). Every rank must call it at the same point."""
    world = dist.get_world_size(group) if is_distributed() else 1
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def gather_if_any(obj: Any, flagged: bool, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Collective: every rank's ``obj`` if any rank is ``flagged``, else ``[None] * world``.

    The common case (nobody flagged) costs one one-element all-reduce, not an object
    all-gather (pickling, two collectives and device copies): a few microseconds instead of
    milliseconds on NCCL. Every rank must call it at the same point."""
    if not any_rank(flagged, group):
        return [None] * dist.get_world_size(group)
    return gather_objects(obj, group)


def any_rank(flagged: bool, group: dist.ProcessGroup | None = None, timeout: float | None = None) -> bool:
    """Collective: whether any rank of ``group`` passed ``flagged=True`` (one one-element
    all-reduce; none in a group of one). ``timeout``: seconds to wait for the other ranks
    (``None``: the group's own); past it, the backend's ``RuntimeError``."""
    if dist.get_world_size(group) == 1:
        return flagged
    flag = torch.tensor([1 if flagged else 0], dtype=torch.int32, device=collective_device(group))
    work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=timeout is not None)
    if timeout is not None:
        assert work is not None
        work.wait(timeout=datetime.timedelta(seconds=timeout))
    return bool(int(flag.item()))


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a small tensor for a collective on ``group`` must live (as ``all_gather_object``
    decides: the current GPU for NCCL, else the CPU)."""
    try:
        return torch.device(dist.distributed_c10d._get_object_coll_device(group))
    except Exception:  # noqa: BLE001 - older/newer torch: decide from the backend's name
        backend = str(dist.get_backend(group))
        if "nccl" in backend and "gloo" not in backend and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
