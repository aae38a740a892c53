"""Value nodes: elementwise arithmetic on one input (a box maps to the same box of the input),
each a computation step of the node protocol in :mod:`sdadapt._recipes.nodes`."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .._base.regions import Box
from .._base.schema import dtype_name
from .nodes import Compute, Input, Node, RoundedOnce, SourceIO, Step


@dataclass(frozen=True, eq=False)
class AffineMapped(RoundedOnce):
    """The input times ``scale`` plus ``shift`` (``invert``: minus ``shift``, divided by
    ``scale``), elementwise; computed in float32 (float64 for float64 outputs) and rounded once to
    the input's floating dtype, or to ``out_dtype``. A box maps to the same box of the input."""

    child: Node
    scale: float
    shift: float
    invert: bool = False

    def __post_init__(self) -> None:
        if not self.child.dtype.is_floating_point:
            raise ValueError(f"affine needs a floating input, got {self.child.dtype}")
        self.derive(self.child.shape, self.out_dtype or self.child.dtype)

    def _apply(self, t: torch.Tensor) -> torch.Tensor:
        w = t.to(torch.float64 if self.dtype == torch.float64 else torch.float32)
        w = (w - self.shift) / self.scale if self.invert else w * self.scale + self.shift
        return w.to(self.dtype)

    def produce(self, box: Box, dest: torch.Tensor, out: list[Step]) -> None:
        out.append(Compute(self, box, dest, functools.partial(self._region, box), (Input(self.child, box),)))

    def _region(self, box: Box, io: SourceIO) -> torch.Tensor:
        return self._apply(self.child.read(box, io))

    def full(self, io: SourceIO) -> torch.Tensor:
        return self._apply(self.child.full(io))

    def describe(self) -> str:
        to = f" as {dtype_name(self.out_dtype)}" if self.out_dtype is not None else ""
        if self.invert:
            return f"({self.child.describe()} - {self.shift:g}) / {self.scale:g}{to}"
        return f"{self.child.describe()} * {self.scale:g} + {self.shift:g}{to}"
