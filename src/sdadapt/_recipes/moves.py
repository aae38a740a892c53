"""The node kinds that move data (concatenate, narrow, transpose, permute, stack, select, pad):
each maps a box of its output to boxes of its children, so a recipe of them becomes pieces read
straight into the destination (:func:`~sdadapt._recipes.nodes.emit`)."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from .._base.regions import Box, box_shape
from .nodes import (
    Compute,
    Derived,
    Fill,
    Input,
    Node,
    Read,
    Rearrangement,
    SourceIO,
    Step,
    emit,
    with_dim,
    with_dim_shape,
)


@dataclass(frozen=True, eq=False)
class Concatenated(Rearrangement, Derived):
    """Inputs joined along ``dim`` (fuse). Sizes along ``dim`` may differ (GQA q/k/v)."""

    parts: tuple[Node, ...]
    dim: int

    def __post_init__(self) -> None:
        first = self.parts[0]
        size = sum(p.shape[self.dim] for p in self.parts)
        self.derive(with_dim_shape(first.shape, self.dim, size), first.dtype)

    def produce(self, box: Box, dest: torch.Tensor, out: list[Step]) -> None:
        d = self.dim
        lo, hi = box[d]
        offset = 0
        for part in self.parts:
            n = part.shape[d]
            a, b = max(lo, offset), min(hi, offset + n)
            if a < b:
                emit(part, with_dim(box, d, (a - offset, b - offset)), dest.narrow(d, a - lo, b - a), out)
            offset += n

    def source_region(self, box: Box) -> Read | None:
        d = self.dim
        offset = 0
        for part in self.parts:
            n = part.shape[d]
            if offset <= box[d][0] and box[d][1] <= offset + n:
                return part.source_region(with_dim(box, d, (box[d][0] - offset, box[d][1] - offset)))
            offset += n
        return None

    def full(self, io: SourceIO) -> torch.Tensor:
        return torch.cat([p.full(io) for p in self.parts], dim=self.dim)

    def describe(self) -> str:
        return f"cat([{', '.join(p.describe() for p in self.parts)}], dim={self.dim})"


@dataclass(frozen=True, eq=False)
class Narrowed(Rearrangement, Derived):
    """Rows ``[start, start + length)`` of the input along ``dim`` (split)."""

    child: Node
    dim: int
    start: int
    length: int

    def __post_init__(self) -> None:
        self.derive(with_dim_shape(self.child.shape, self.dim, self.length), self.child.dtype)

    def produce(self, box: Box, dest: torch.Tensor, out: list[Step]) -> None:
        a, b = box[self.dim]
        emit(self.child, with_dim(box, self.dim, (a + self.start, b + self.start)), dest, out)

    def source_region(self, box: Box) -> Read | None:
        a, b = box[self.dim]
        return self.child.source_region(with_dim(box, self.dim, (a + self.start, b + self.start)))

    def full(self, io: SourceIO) -> torch.Tensor:
        return self.child.full(io).narrow(self.dim, self.start, self.length)

    def describe(self) -> str:
        return f"{self.child.describe()}[{self.dim}: {self.start}:{self.start + self.length}]"


# --- layout nodes (transpose, unit permutation, stack/select, pad, per-rank interleave) ---------


@dataclass(frozen=True, eq=False)
class Transposed(Rearrangement, Derived):
    """The input with dims ``dim0`` and ``dim1`` swapped (GPT-2 ``Conv1D`` ``[in, out]`` <->
    ``nn.Linear`` ``[out, in]``). A box maps to one box with the two spans swapped."""

    child: Node
    dim0: int
    dim1: int

    def __post_init__(self) -> None:
        s = list(self.child.shape)
        s[self.dim0], s[self.dim1] = s[self.dim1], s[self.dim0]
        self.derive(tuple(s), self.child.dtype)

    def produce(self, box: Box, dest: torch.Tensor, out: list[Step]) -> None:
        b = list(box)
        b[self.dim0], b[self.dim1] = b[self.dim1], b[self.dim0]
        emit(self.child, tuple(b), dest.transpose(self.dim0, self.dim1), out)

    def full(self, io: SourceIO) -> torch.Tensor:
        return self.child.full(io).transpose(self.dim0, self.dim1).contiguous()

    def describe(self) -> str:
        return f"transpose({self.child.describe()}, {self.dim0}, {self.dim1})"


@dataclass(frozen=True, eq=False)
class UnitPermuted(Rearrangement, Derived):
    """Along ``dim``, the input is cut in aligned units of ``unit`` rows (a head); inside every
    unit, output row ``j`` is input row ``perm[j]`` (rotary layouts). A region is a computation
    on the box widened to whole units, so a shard that cuts a unit is never permuted as if it
    were whole. ``label`` names the transform in ``describe()``."""

    child: Node
    dim: int
    unit: int
    perm: tuple[int, ...]
    label: str = "permute"

    def __post_init__(self) -> None:
        if sorted(self.perm) != list(range(self.unit)):
            raise ValueError(f"perm {self.perm} is not a permutation of range({self.unit})")
        if self.unit <= 0 or self.child.shape[self.dim] % self.unit:
            raise ValueError(f"unit {self.unit} does not divide {self.child.shape[self.dim]}")
        self.derive(self.child.shape, self.child.dtype)

    def produce(self, box: Box, dest: torch.Tensor, out: list[Step]) -> None:
        out.append(Compute(self, box, dest, functools.partial(self._permuted, box), (Input(self.child, self._units(box)),)))

    def _units(self, box: Box) -> Box:
        """``box`` widened along ``dim`` to whole units."""
        a, b = box[self.dim]
        return with_dim(box, self.dim, (a // self.unit * self.unit, -(-b // self.unit) * self.unit))

    def _permuted(self, box: Box, io: SourceIO) -> torch.Tensor:
        (a, b), (lo, hi) = box[self.dim], self._units(box)[self.dim]
        whole = self.child.read(self._units(box), io)
        idx = torch.tensor(self.perm, dtype=torch.long)
        idx = (idx.unsqueeze(0) + self.unit * torch.arange((hi - lo) // self.unit).unsqueeze(1)).reshape(-1)
        return whole.index_select(self.dim, idx[a - lo : b - lo])  # only the rows the box wants

    def full(self, io: SourceIO) -> torch.Tensor:
        t = self.child.full(io)
        d = self.dim
        units = t.shape[d] // self.unit
        v = t.reshape(t.shape[:d] + (units, self.unit) + t.shape[d + 1 :])
        v = v.index_select(d + 1, torch.tensor(self.perm, dtype=torch.long))
        return v.reshape(t.shape)

    def describe(self) -> str:
        return f"{self.label}({self.child.describe()})"


@dataclass(frozen=True, eq=False)
class Stacked(Rearrangement, Derived):
    """Inputs of one shape stacked along a new dim ``dim`` (MoE experts -> ``[E, ...]``)."""

    parts: tuple[Node, ...]
    dim: int

    def __post_init__(self) -> None:
        first = self.parts[0].shape
        self.derive(first[: self.dim] + (len(self.parts),) + first[self.dim :], self.parts[0].dtype)

    def produce(self, box: Box, dest: torch.Tensor, out: list[Step]) -> None:
        a, b = box[self.dim]
        inner = box[: self.dim] + box[self.dim + 1 :]
        for e in range(a, b):
            emit(self.parts[e], inner, dest.select(self.dim, e - a), out)

    def full(self, io: SourceIO) -> torch.Tensor:
        return torch.stack([p.full(io) for p in self.parts], dim=self.dim)

    def describe(self) -> str:
        if len(self.parts) > 3:
            inner = f"{self.parts[0].describe()}, ..., {self.parts[-1].describe()}"
        else:
            inner = ", ".join(p.describe() for p in self.parts)
        return f"stack([{inner}], dim={self.dim})"


@dataclass(frozen=True, eq=False)
class Selected(Rearrangement, Derived):
    """Entry ``index`` of the input along ``dim``, that dim removed (unstack)."""

    child: Node
    dim: int
    index: int

    def __post_init__(self) -> None:
        s = self.child.shape
        self.derive(s[: self.dim] + s[self.dim + 1 :], self.child.dtype)

    def produce(self, box: Box, dest: torch.Tensor, out: list[Step]) -> None:
        outer = box[: self.dim] + ((self.index, self.index + 1),) + box[self.dim :]
        emit(self.child, outer, dest.unsqueeze(self.dim), out)

    def full(self, io: SourceIO) -> torch.Tensor:
        return self.child.full(io).select(self.dim, self.index)

    def source_region(self, box: Box) -> Read | None:
        inner = self.child.source_region(box[: self.dim] + ((self.index, self.index + 1),) + box[self.dim :])
        return None if inner is None else dataclasses.replace(inner, shape=box_shape(box))

    def read(self, box: Box, io: SourceIO) -> torch.Tensor:
        """The child's region with the entry's index put in, read as the child reads it (an
        expert of fused 3-D experts stays a view of the staged read: no copy on the host)."""
        outer = box[: self.dim] + ((self.index, self.index + 1),) + box[self.dim :]
        return self.child.read(outer, io).select(self.dim, 0)

    def describe(self) -> str:
        return f"{self.child.describe()}[{self.dim}: {self.index}]"


@dataclass(frozen=True, eq=False)
class Padded(Derived):
    """The input extended along ``dim`` to ``size`` with ``value`` (vocab padded for TP)."""

    child: Node
    dim: int
    size: int
    value: float = 0.0

    def __post_init__(self) -> None:
        if self.size < self.child.shape[self.dim]:
            raise ValueError(f"cannot pad {self.child.shape[self.dim]} down to {self.size}")
        self.derive(with_dim_shape(self.child.shape, self.dim, self.size), self.child.dtype)

    def produce(self, box: Box, dest: torch.Tensor, out: list[Step]) -> None:
        d = self.dim
        a, b = box[d]
        n = self.child.shape[d]
        if a < min(b, n):
            emit(self.child, with_dim(box, d, (a, min(b, n))), dest.narrow(d, 0, min(b, n) - a), out)
        if b > max(a, n):
            # the value as the output holds it (bool goes through uint8, as in full())
            held = torch.full((), self.value, dtype=torch.uint8 if self.dtype == torch.bool else self.dtype)
            value = held.to(self.dtype).item()
            out.append(Fill(dest.narrow(d, max(a, n) - a, b - max(a, n)), value))

    def source_region(self, box: Box) -> Read | None:
        return self.child.source_region(box) if box[self.dim][1] <= self.child.shape[self.dim] else None

    def full(self, io: SourceIO) -> torch.Tensor:
        t = self.child.full(io)
        extra = self.size - t.shape[self.dim]
        spec = [0, 0] * (t.dim() - 1 - self.dim) + [0, extra]
        if t.dtype == torch.bool:  # constant_pad_nd does not take bool
            return torch.nn.functional.pad(t.to(torch.uint8), spec, value=self.value).to(torch.bool)
        return torch.nn.functional.pad(t, spec, value=self.value)

    def describe(self) -> str:
        return f"pad({self.child.describe()}, dim={self.dim}, size={self.size})"
