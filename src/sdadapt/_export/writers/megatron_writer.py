"""A Megatron-Core ``torch_dist`` checkpoint: the DCP folder plus what ``dist_checkpointing`` adds.

Megatron-Core's ``dist_checkpointing.load`` reads a DCP folder whose keys are its global tensor
names, and besides the tensors asks for: one ``_extra_state`` object per linear layer (its
``ShardedObject``, stored as the bytes of ``torch.save([state])`` under
``<module>._extra_state/shard_<offsets>_<shape>``, the offsets and shape over the stacked layer
axis, and the expert axis for stacked experts); ``common.pt`` (the state that is not sharded,
merged into what ``load`` returns); ``metadata.json`` (the backends, which its loader checks
first). The tensors are written by :class:`~.dcp_writer.DCPWriter`'s lazy planner; the extra state
written is empty (``None``: a model without FP8 state, which is what a load from any other
layout has), so Megatron's modules start their FP8 scaling afresh.
"""

from __future__ import annotations

import json
import math
import os
import re

import torch

from ..._base.schema import TensorInfo
from .base import Pull
from .dcp_writer import DCPWriter, fake_state, save_lazy

METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", "common_backend_version": 1}
"""``metadata.json`` of a ``torch_dist`` save (megatron-core 0.16)."""
CHECKPOINT_VERSION = 3.0
"""Megatron-LM's ``checkpoint_version`` of this layout."""

# the linear layers that carry an _extra_state: <prefix><module>.weight (or .weight_w of split fc1)
_LINEAR = re.compile(r"^(.*\.(?:linear_qkv|linear_proj|linear_fc1|linear_fc2))\.weight(?:_w)?$")
_STACKED_EXPERTS = ".experts.experts."


def extra_state_keys(entries: dict[str, TensorInfo]) -> list[str]:
    """The ``_extra_state`` object keys Megatron's load asks for, given the tensors written."""
    out: list[str] = []
    for key, info in entries.items():
        m = _LINEAR.match(key)
        if m is None:
            continue
        module = m.group(1)
        stacked_layers = module.startswith("decoder.layers.") and not module[len("decoder.layers.") :].split(".")[0].isdigit()
        experts = _STACKED_EXPERTS in module and not module.split(_STACKED_EXPERTS)[1].split(".")[0].isdigit()
        axes = [info.shape[0]] if stacked_layers else []
        if experts:
            axes.append(info.shape[len(axes)])
        if not axes:
            out.append(f"{module}._extra_state/shard_0_1")
            continue
        for flat in range(math.prod(axes)):
            index, rest = [], flat
            for n in reversed(axes):
                index.append(rest % n)
                rest //= n
            index.reverse()
            out.append(f"{module}._extra_state/shard_{'.'.join(map(str, index))}_{'.'.join(map(str, axes))}")
    return out


class MegatronWriter(DCPWriter):
    """``path`` is the folder to write: ``.metadata``, one ``.distcp`` file, ``common.pt``, ``metadata.json``."""

    def write(self, entries: dict[str, TensorInfo], pull: Pull) -> None:
        state = fake_state(entries)
        for key in extra_state_keys(entries):
            state[key] = [None]  # DCP stores torch.save([None]): what Megatron stores for a module without FP8 state
        save_lazy(self.path, state, entries, pull)
        common = {"checkpoint_version": CHECKPOINT_VERSION, "iteration": 0, "content_metadata": {"singleton_local_shards": False}}
        torch.save(common, os.path.join(self.path, "common.pt"))
        with open(os.path.join(self.path, "metadata.json"), "w", encoding="utf-8") as f:
            json.dump(METADATA, f)
