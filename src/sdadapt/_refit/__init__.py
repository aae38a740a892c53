"""Floor 7, refit: ``sdadapt.refit_plan()`` -> :class:`Refit`, a trainer's shards sent to an
engine's shards over a process group, every training step."""

from .refit import refit_plan
from .refit_run import Refit, RefitReport

__all__ = ["Refit", "RefitReport", "refit_plan"]
