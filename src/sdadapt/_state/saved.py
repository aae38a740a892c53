"""``SaveReport``: what :func:`sdadapt.save_state` wrote on one rank, usable as the folder's path."""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel

from .._base.summary import Summarized


class SaveReport(Summarized, BaseModel):
    """What :func:`sdadapt.save_state` wrote on this rank. It stands for the folder where a path
    is wanted (``os.fspath(report)``, ``open(os.path.join(report, ...))``, ``report == dst``), as
    the plain path ``save_state`` used to return did; ``report.path`` is that path as a string.

    Attributes:
        rank: this rank.
        world_size: the ranks that saved.
        path: the DCP folder written.
        model_keys: the model's keys saved.
        optimizer: the optimizer's class name, or ``None`` when none was saved.
        extra: the extra entries' names.
        checksums: whether ``sdadapt.checksums.json`` was written.
        seconds: the whole call.

    Example::

        saved = sdadapt.save_state(model, "ckpt/step_100", optimizer, extra={"step": 100})
        summary = str(saved)  # keys, extras, seconds
        folder = os.fspath(saved)  # or saved.path
    """

    rank: int
    world_size: int
    path: str
    model_keys: int
    optimizer: str | None = None
    extra: list[str] = []
    checksums: bool = False
    seconds: float

    def format(self) -> str:
        what = f"{self.model_keys} model keys" + (f", {self.optimizer} state" if self.optimizer else "")
        if self.extra:
            what += f", extras {self.extra}"
        sums = " with checksums" if self.checksums else ""
        return f"rank {self.rank}/{self.world_size}: saved {what} to {self.path}{sums} in {self.seconds:.2f} s"

    def __fspath__(self) -> str:
        return self.path

    def __eq__(self, other: Any) -> bool:
        if isinstance(other, (str, os.PathLike)):
            return self.path == os.fspath(other)
        return super().__eq__(other)

    __hash__ = None  # type: ignore[assignment]
