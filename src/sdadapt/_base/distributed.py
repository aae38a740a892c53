"""Agreement between ranks: one rank's failure becomes every rank's error, never a hang."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..errors import RemoteRankError


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_and_world(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    if not is_distributed():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def agree(error: BaseException | None, group: dist.ProcessGroup | None = None) -> None:
    """Collective: every rank calls it; if any rank passes an error, every rank raises.

    The failing rank re-raises its own error; the others raise :class:`RemoteRankError`
    quoting it. Call it at the same point on every rank.
    """
    if not is_distributed():
        if error is not None:
            raise error
        return
    mine = None if error is None else f"{type(error).__name__}: {error}"
    msgs = gather_if_any(mine, mine is not None, group)
    if error is not None:
        raise error
    for r, m in enumerate(msgs):
        if m is not None:
            raise RemoteRankError(f"rank {r} failed, so this rank stops too:\n{m}")


def gather_if_any(obj: Any, flagged: bool, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Collective: every rank's ``obj`` if any rank is ``flagged``, else ``[None] * world``.

    The common case (nobody flagged) costs one one-element all-reduce, not an object
    all-gather (pickling, two collectives and device copies): a few microseconds instead of
    milliseconds on NCCL. Every rank must call it at the same point."""
    world = dist.get_world_size(group)
    if not any_rank(flagged, group):
        return [None] * world
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def any_rank(flagged: bool, group: dist.ProcessGroup | None = None) -> bool:
    """Collective: whether any rank of ``group`` passed ``flagged=True`` (one one-element
    all-reduce)."""
    flag = torch.tensor([1 if flagged else 0], dtype=torch.int32, device=collective_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
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
