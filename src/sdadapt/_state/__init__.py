"""Floor 7, training state: ``sdadapt.save_state()`` and ``sdadapt.load_state()``, the model, its
optimizer (planned like its parameters) and extras through DCP; saves in the background and
:class:`Checkpointer`, periodic saves keeping the last few."""

from .background import SaveHandle
from .checkpointer import Checkpointer
from .saved import SaveReport
from .saving import save_state
from .state import StateLoadReport, load_state

__all__ = ["Checkpointer", "SaveHandle", "SaveReport", "StateLoadReport", "load_state", "save_state"]
