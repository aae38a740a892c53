"""Floor 7, training state: ``sdadapt.save_state()`` and ``sdadapt.load_state()``, the model, its
optimizer (planned like its parameters) and extras through DCP."""

from .saved import SaveReport
from .state import StateLoadReport, load_state, save_state

__all__ = ["SaveReport", "StateLoadReport", "load_state", "save_state"]
