"""DCP's default load planner, minus arbitrary unpickling.

``DefaultLoadPlanner.load_bytes`` restores non-tensor entries (a scheduler's state, a step
count) with ``torch.load(weights_only=False)``, which runs whatever the checkpoint's pickle
says. :class:`SafeLoadPlanner` loads them with ``weights_only=True``: tensors, containers and
primitives only; anything else is refused with an error naming the entry.
"""

from __future__ import annotations

import io
import pickle

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.planner import ReadItem

from ..errors import SourceError


class SafeLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            first = (str(e).strip().splitlines() or ["unpickling failed"])[0]
            raise SourceError(
                f"refusing to unpickle non-tensor entry {fqn!r} (weights_only=True): {first}. Store plain "
                "tensors, numbers, strings, lists and dicts in checkpoint extras"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
