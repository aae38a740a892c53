"""Periodic training-state saves keeping the last few: :class:`Checkpointer`.

A folder counts as complete once ``sdadapt.json`` is beside DCP's ``.metadata`` (both written
after every rank's files): :meth:`Checkpointer.latest` never names a folder a crash cut short.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._base.distributed import rank_and_world
from ..errors import StateError
from ..sources import SDADAPT_JSON
from .background import SaveHandle, prepare_group
from .saved import SaveReport
from .saving import save_state

_STEP = re.compile(r"^step_(\d+)$")


def complete(folder: str) -> bool:
    """Whether a ``save_state`` folder was written to the end (``.metadata`` and ``sdadapt.json``)."""
    return os.path.isfile(os.path.join(folder, ".metadata")) and os.path.isfile(os.path.join(folder, SDADAPT_JSON))


def _steps(root: str) -> list[tuple[int, str]]:
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), os.path.join(root, n)) for n in os.listdir(root) if (m := _STEP.match(n))]
    return sorted(found)


class Checkpointer:
    """Periodic training-state saves into ``root/step_<N>``, keeping the last ``keep`` complete ones.

    Call :meth:`step` after every training step on every rank: every ``every`` steps it saves
    (with ``async_=True``, by default: the call returns once the state is staged in host memory,
    after waiting for the save before); once that save is complete (at the next save, or
    :meth:`wait` / :meth:`close`), rank 0 deletes the older folders beyond the newest ``keep``
    complete ones (and any older folder a crash left incomplete). :meth:`latest` names the newest complete folder, to resume from.

    Args:
        root: the folder holding the ``step_<N>`` folders.
        every: save when ``step % every == 0``.
        keep: complete checkpoints kept (``None``: all).
        async_: write in the background (``save_state(..., async_=True)``).
        process_group: the group the ranks save over.

    Every rank makes it: with ``async_``, the gloo group the background writes use starts being
    made here, on the writing thread (the ranks meet there, not in this call).

    Example::

        ckpt = sdadapt.Checkpointer("ckpt", every=100, keep=3)
        for step in range(1, 1001):
            train_step()
            ckpt.step(step, model, optimizer, extra={"step": step})
        ckpt.close()  # waits for the last save
        resume_from = ckpt.latest()
    """

    def __init__(self, root: str | os.PathLike[str], every: int, keep: int | None = 3, *, async_: bool = True,
                 process_group: dist.ProcessGroup | None = None):  # fmt: skip
        if every < 1 or (keep is not None and keep < 1):
            raise StateError(f"Checkpointer(every={every}, keep={keep}): both must be at least 1")
        self.root = os.fspath(root)
        self.every, self.keep, self.async_ = every, keep, async_
        self.process_group = process_group
        self.pending: SaveHandle | None = None
        if async_:
            prepare_group(process_group)

    def step(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
             extra: dict[str, Any] | None = None, *, force: bool = False) -> SaveHandle | SaveReport | None:  # fmt: skip
        """Save at ``step`` when it is a multiple of ``every`` (or ``force``); every rank calls it.

        Args:
            step: the training step just done.
            model: the model to save.
            optimizer: its optimizer, saved too.
            extra: ``name -> Stateful or value`` entries to save beside them.
            force: save whatever the step.

        Returns:
            The save's handle (``async_``) or report, or ``None`` when this step saves nothing.

        Example::

            ckpt.step(step, model, optimizer, extra={"step": step})
        """
        if not force and step % self.every:
            return None
        self.wait()
        dst = os.path.join(self.root, f"step_{step:08d}")
        if self.async_:
            self.pending = save_state(model, dst, optimizer, extra, overwrite=True, process_group=self.process_group, async_=True)
            return self.pending
        saved = save_state(model, dst, optimizer, extra, overwrite=True, process_group=self.process_group)
        self._prune()
        return saved

    def wait(self) -> SaveReport | None:
        """Wait for the save in the background, if any, and prune.

        Returns:
            Its :class:`~sdadapt.reports.SaveReport`, or ``None`` when none was running.

        Example::

            ckpt.wait()
        """
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        saved = pending.wait()
        self._prune()
        return saved

    def close(self) -> None:
        """Wait for the last save (its error raised here).

        Example::

            ckpt.close()
        """
        self.wait()

    def latest(self) -> str | None:
        """The newest complete checkpoint folder under ``root``.

        Returns:
            Its path, or ``None`` when there is none.

        Example::

            sdadapt.load_state(model, ckpt.latest(), optimizer)
        """
        done = [path for _, path in _steps(self.root) if complete(path)]
        return done[-1] if done else None

    def _prune(self) -> None:
        if self.keep is None or rank_and_world(self.process_group)[0] != 0:
            return
        steps = _steps(self.root)
        kept = [p for _, p in steps if complete(p)][-self.keep :]
        if len(kept) < self.keep:
            return
        oldest = kept[0]
        for _, path in steps:
            if path == oldest:
                break
            shutil.rmtree(path, ignore_errors=True)


__all__ = ["Checkpointer", "complete"]
