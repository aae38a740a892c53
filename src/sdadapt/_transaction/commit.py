"""The pieces of a load transaction's commit step (:mod:`sdadapt._transaction.transaction`): its named
steps, the record of how far a rank's commit got, and an optimizer's param groups kept so that
an optimizer that held no state can be given its own back after a failed commit."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)

COPY_IN = "copying the staged shards in"
COPY_BACK = "copying detached tensors back into the model"

# A named step of a commit: (what it does, for the error message; the step).
CommitStep = tuple[str, Callable[[], None]]


@dataclass(eq=False)
class CommitProgress:
    """How far this rank's commit got: whether it had begun changing the model or the
    optimizer, the steps it finished, and its failure (``"<step> failed: <error>"``)."""

    model: bool = False
    optimizer: bool = False
    done: list[str] = field(default_factory=list)
    error: str | None = None

    def run(self, steps: list[CommitStep]) -> BaseException | None:
        """Run ``steps`` in order up to the first that raises; return what it raised."""
        for name, step in steps:
            try:
                step()
            except BaseException as e:  # noqa: BLE001 - any step's failure is agreed, then re-raised as LoadError
                if not isinstance(e, (Exception, *_dcp_failure())):
                    raise
                self.error = f"{name} failed: {type(e).__name__}: {e}"
                log.debug("rank-local commit failure in %r", name, exc_info=True)
                return e
            self.done.append(name)
        return None


def _dcp_failure() -> tuple[type[BaseException], ...]:
    """DCP's ``CheckpointException`` (a ``BaseException``) where DCP was imported: a step can
    raise it only then, and a load that needs no DCP does not import it for this."""
    api = sys.modules.get("torch.distributed.checkpoint.api")
    return (api.CheckpointException,) if api is not None else ()


def touching_optimizer(step: Callable[[], None], progress: CommitProgress, has_optimizer: bool) -> Callable[[], None]:
    """``step`` (a caller's finishing step), first recording that it may change the optimizer."""

    def run() -> None:
        progress.optimizer = progress.optimizer or has_optimizer
        step()

    return run


# an optimizer's param groups list and a copy of each group's entries, taken before a commit
ParamGroups = tuple[list[dict[str, Any]], list[dict[str, Any]]]


def param_groups_of(optimizer: torch.optim.Optimizer) -> ParamGroups:
    return optimizer.param_groups, [dict(g) for g in optimizer.param_groups]


def restore_param_groups(optimizer: torch.optim.Optimizer, saved: ParamGroups) -> None:
    """Give ``optimizer`` back the param group objects and entries of ``saved``
    (``load_state_dict`` replaces them with the checkpoint's)."""
    groups, entries = saved
    for group, before in zip(groups, entries, strict=True):
        group.clear()
        group.update(before)
    optimizer.param_groups = groups
