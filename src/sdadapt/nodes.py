"""Recipes: small expression trees that say how a target tensor is made from source tensors.

A plan maps every target key to one :class:`Node`. Each node knows its global ``shape`` and
``dtype`` and answers two questions:

- ``read(box, io)``: the values of the region ``box`` of its output, reading from the source
  only the regions of its inputs that this box needs (the lazy path, used per rank/shard);
- ``full(io)``: the whole output computed eagerly with plain torch ops on full tensors (the
  reference the lazy path is checked against).

A box is a tuple of ``(start, stop)`` pairs, one per dimension, in global coordinates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

Box = tuple[tuple[int, int], ...]


class SourceIO(Protocol):
    """Where leaves get their bytes: ``read(key, box)`` returns that region of a source tensor."""

    def read(self, key: str, box: Box) -> torch.Tensor: ...


def full_box(shape: tuple[int, ...]) -> Box:
    return tuple((0, n) for n in shape)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def _with_dim(box: Box, dim: int, span: tuple[int, int]) -> Box:
    return box[:dim] + (span,) + box[dim + 1 :]


class Node:
    shape: tuple[int, ...]
    dtype: torch.dtype

    def read(self, box: Box, io: SourceIO) -> torch.Tensor:
        raise NotImplementedError

    def full(self, io: SourceIO) -> torch.Tensor:
        raise NotImplementedError

    def leaves(self) -> list[str]:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True, eq=False)
class Leaf(Node):
    """A tensor of the source checkpoint, as stored."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def read(self, box: Box, io: SourceIO) -> torch.Tensor:
        return io.read(self.key, box)

    def full(self, io: SourceIO) -> torch.Tensor:
        return io.read(self.key, full_box(self.shape)).clone()

    def leaves(self) -> list[str]:
        return [self.key]

    def describe(self) -> str:
        return self.key


@dataclass(frozen=True, eq=False)
class Cast(Node):
    child: Node
    dtype: torch.dtype
    shape: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", self.child.shape)

    def read(self, box: Box, io: SourceIO) -> torch.Tensor:
        return self.child.read(box, io).to(self.dtype)

    def full(self, io: SourceIO) -> torch.Tensor:
        return self.child.full(io).to(self.dtype)

    def leaves(self) -> list[str]:
        return self.child.leaves()

    def describe(self) -> str:
        return f"cast({self.child.describe()}, {str(self.dtype).removeprefix('torch.')})"


@dataclass(frozen=True, eq=False)
class Concat(Node):
    """Inputs joined along ``dim`` (fuse). Sizes along ``dim`` may differ (GQA q/k/v)."""

    parts: tuple[Node, ...]
    dim: int
    shape: tuple[int, ...] = field(init=False)
    dtype: torch.dtype = field(init=False)

    def __post_init__(self) -> None:
        first = self.parts[0]
        size = sum(p.shape[self.dim] for p in self.parts)
        object.__setattr__(self, "shape", _with_dim_shape(first.shape, self.dim, size))
        object.__setattr__(self, "dtype", first.dtype)

    def read(self, box: Box, io: SourceIO) -> torch.Tensor:
        lo, hi = box[self.dim]
        if lo >= hi:
            return torch.empty(box_shape(box), dtype=self.dtype)
        pieces = []
        offset = 0
        for part in self.parts:
            n = part.shape[self.dim]
            a, b = max(lo, offset), min(hi, offset + n)
            if a < b:
                pieces.append(part.read(_with_dim(box, self.dim, (a - offset, b - offset)), io))
            offset += n
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=self.dim)

    def full(self, io: SourceIO) -> torch.Tensor:
        return torch.cat([p.full(io) for p in self.parts], dim=self.dim)

    def leaves(self) -> list[str]:
        return [k for p in self.parts for k in p.leaves()]

    def describe(self) -> str:
        return f"cat([{', '.join(p.describe() for p in self.parts)}], dim={self.dim})"


@dataclass(frozen=True, eq=False)
class Narrow(Node):
    """Rows ``[start, start + length)`` of the input along ``dim`` (split)."""

    child: Node
    dim: int
    start: int
    length: int
    shape: tuple[int, ...] = field(init=False)
    dtype: torch.dtype = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", _with_dim_shape(self.child.shape, self.dim, self.length))
        object.__setattr__(self, "dtype", self.child.dtype)

    def read(self, box: Box, io: SourceIO) -> torch.Tensor:
        a, b = box[self.dim]
        return self.child.read(_with_dim(box, self.dim, (a + self.start, b + self.start)), io)

    def full(self, io: SourceIO) -> torch.Tensor:
        return self.child.full(io).narrow(self.dim, self.start, self.length)

    def leaves(self) -> list[str]:
        return self.child.leaves()

    def describe(self) -> str:
        return f"{self.child.describe()}[{self.dim}: {self.start}:{self.start + self.length}]"


def _with_dim_shape(shape: tuple[int, ...], dim: int, size: int) -> tuple[int, ...]:
    return shape[:dim] + (size,) + shape[dim + 1 :]
