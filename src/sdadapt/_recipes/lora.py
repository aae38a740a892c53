"""The LoRA merge node: ``weight + scale * B @ A``, computed per region.

Region ``box`` of a merged weight is ``W[box] + s * B[rows of box] @ A[:, cols of box]``, so a
rank reads only the rows of ``B`` and the columns of ``A`` its shard needs. The product and the
sum are computed in float64 and rounded once to the weight's dtype: products of float32/bf16
numbers are exact in float64, so the value of an element does not depend on the shape of the
block it was computed in (BLAS may sum a block's products in another order), and
``read(box) == full()[box]``. The rule that builds it, and the PEFT folder it reads, are in
:mod:`sdadapt.rules._lora`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .._base.regions import Box, box_shape
from .._base.schema import dtype_name
from .nodes import Compute, Input, Node, RoundedOnce, SourceIO, Step

_ROWS_PER_CHUNK_ELEMENTS = 1 << 22  # float64 temporaries of a region are computed this many elements at a time


@dataclass(frozen=True, eq=False)
class MergedLora(RoundedOnce):
    """``weight + scale * B @ A`` (``weight`` ``[out, in]``, ``a`` ``[r, in]``, ``b`` ``[out, r]``),
    in ``weight``'s dtype (or ``out_dtype``); ``transposed``: ``weight`` is stored ``[in, out]``
    (PEFT's ``fan_in_fan_out``, GPT-2's ``Conv1D``) and gets ``(B @ A).T``. A region is one
    computation that reads ``weight[box]``, the rows of ``b`` and the columns of ``a`` that the
    box covers, computed in float64 and rounded once."""

    weight: Node
    a: Node
    b: Node
    scale: float
    transposed: bool = False

    def __post_init__(self) -> None:
        self.derive(tuple(self.weight.shape), self.out_dtype or self.weight.dtype)

    def produce(self, box: Box, dest: torch.Tensor, out: list[Step]) -> None:
        out.append(Compute(self, box, dest, functools.partial(self._region, box), self._inputs(box)))

    def _inputs(self, box: Box) -> tuple[Input, ...]:
        """``weight[box]``, and the rows of ``b`` and the columns of ``a`` it covers (read in
        chunks of rows by :meth:`_region`)."""
        rank = self.a.shape[0]
        (r0, r1), (c0, c1) = box
        if self.transposed:  # weight [in, out]: box rows are A's columns, box cols are B's rows
            return Input(self.weight, box), Input(self.a, ((0, rank), (r0, r1))), Input(self.b, ((c0, c1), (0, rank)))
        return Input(self.weight, box), Input(self.a, ((0, rank), (c0, c1))), Input(self.b, ((r0, r1), (0, rank)))

    def _region(self, box: Box, io: SourceIO) -> torch.Tensor:
        rank = self.a.shape[0]
        (r0, r1), (c0, c1) = box
        out = torch.empty(box_shape(box), dtype=self.dtype)
        step = max(1, _ROWS_PER_CHUNK_ELEMENTS // max(1, c1 - c0))
        for lo in range(r0, r1, step):
            hi = min(r1, lo + step)
            rows, cols = (lo, hi), (c0, c1)
            if self.transposed:  # weight [in, out]: box rows are A's columns, box cols are B's rows
                delta = (self.b.read((cols, (0, rank)), io).double() @ self.a.read(((0, rank), rows), io).double()).T
            else:
                delta = self.b.read((rows, (0, rank)), io).double() @ self.a.read(((0, rank), cols), io).double()
            merged = self.weight.read((rows, cols), io).double() + self.scale * delta
            out[lo - r0 : hi - r0] = merged.to(self.dtype)
        return out

    def full(self, io: SourceIO) -> torch.Tensor:
        delta = self.b.full(io).double() @ self.a.full(io).double()
        if self.transposed:
            delta = delta.T
        return (self.weight.full(io).double() + self.scale * delta).to(self.dtype)

    def describe(self) -> str:
        t = ", transposed" if self.transposed else ""
        to = f", dtype={dtype_name(self.out_dtype)}" if self.out_dtype is not None else ""
        return f"merge_lora({self.weight.describe()}, {self.a.describe()}, {self.b.describe()}, scale={self.scale:g}{t}{to})"
