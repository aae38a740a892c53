"""What refit tests compare engine shards against: the adapter's recipes applied eagerly to the
trainer's full tensors, and a tensor's bytes for equality (float8 has no equality on every build)."""

from __future__ import annotations

import torch

import sdadapt
from sdadapt._base.schema import TensorInfo, slices
from sdadapt._export import plan_outputs


class _IO:
    def __init__(self, sd: dict[str, torch.Tensor]):
        self.sd = sd

    def read(self, key, box):
        return self.sd[key][slices(box)]


def eager(full: dict[str, torch.Tensor], adapter: sdadapt.Adapter) -> dict[str, torch.Tensor]:
    """The engine's whole tensors: the adapter's recipes applied eagerly to the full weights."""
    schema = {k: TensorInfo(tuple(v.shape), v.dtype) for k, v in full.items()}
    outputs, _ = plan_outputs(schema, adapter, what="test")
    return {k: node.full(_IO(full)) for k, node in outputs.items()}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (float8 has no equality on every build)."""
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t
