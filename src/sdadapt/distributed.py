"""Agreement between ranks: one rank's failure becomes every rank's error, never a hang."""

from __future__ import annotations

import torch.distributed as dist

from .errors import RemoteRankError


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
    world = dist.get_world_size(group)
    mine = None if error is None else f"{type(error).__name__}: {error}"
    msgs: list[str | None] = [None] * world
    dist.all_gather_object(msgs, mine, group=group)
    if error is not None:
        raise error
    for r, m in enumerate(msgs):
        if m is not None:
            raise RemoteRankError(f"rank {r} failed, so this rank stops too:\n{m}")
