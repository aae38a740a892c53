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


# --- layout nodes (transpose, unit permutation, stack/select, pad, per-rank interleave) ---------


@dataclass(frozen=True, eq=False)
class Transpose(Node):
    """The input with dims ``dim0`` and ``dim1`` swapped (GPT-2 ``Conv1D`` ``[in, out]`` <->
    ``nn.Linear`` ``[out, in]``). A box maps to one box with the two spans swapped."""

    child: Node
    dim0: int
    dim1: int
    shape: tuple[int, ...] = field(init=False)
    dtype: torch.dtype = field(init=False)

    def __post_init__(self) -> None:
        s = list(self.child.shape)
        s[self.dim0], s[self.dim1] = s[self.dim1], s[self.dim0]
        object.__setattr__(self, "shape", tuple(s))
        object.__setattr__(self, "dtype", self.child.dtype)

    def read(self, box: Box, io: SourceIO) -> torch.Tensor:
        b = list(box)
        b[self.dim0], b[self.dim1] = b[self.dim1], b[self.dim0]
        return self.child.read(tuple(b), io).transpose(self.dim0, self.dim1)

    def full(self, io: SourceIO) -> torch.Tensor:
        return self.child.full(io).transpose(self.dim0, self.dim1).contiguous()

    def leaves(self) -> list[str]:
        return self.child.leaves()

    def describe(self) -> str:
        return f"transpose({self.child.describe()}, {self.dim0}, {self.dim1})"


@dataclass(frozen=True, eq=False)
class UnitPermute(Node):
    """Along ``dim``, the input is cut in aligned units of ``unit`` rows (a head); inside every
    unit, output row ``j`` is input row ``perm[j]`` (rotary layouts).

    ``read`` expands the box to whole units, reads them, permutes, then narrows: a shard that
    cuts a unit is never permuted as if it were whole. ``full`` permutes with ``view`` +
    ``index_select`` on the whole tensor. ``label`` names the transform in ``describe()``.
    """

    child: Node
    dim: int
    unit: int
    perm: tuple[int, ...]
    label: str = "permute"
    shape: tuple[int, ...] = field(init=False)
    dtype: torch.dtype = field(init=False)

    def __post_init__(self) -> None:
        if sorted(self.perm) != list(range(self.unit)):
            raise ValueError(f"perm {self.perm} is not a permutation of range({self.unit})")
        if self.unit <= 0 or self.child.shape[self.dim] % self.unit:
            raise ValueError(f"unit {self.unit} does not divide {self.child.shape[self.dim]}")
        object.__setattr__(self, "shape", self.child.shape)
        object.__setattr__(self, "dtype", self.child.dtype)

    def read(self, box: Box, io: SourceIO) -> torch.Tensor:
        a, b = box[self.dim]
        if a >= b:
            return torch.empty(box_shape(box), dtype=self.dtype)
        u0, u1 = a // self.unit, -(-b // self.unit)
        lo = u0 * self.unit
        whole = self.child.read(_with_dim(box, self.dim, (lo, u1 * self.unit)), io)
        n = u1 - u0
        idx = torch.tensor(self.perm, dtype=torch.long)
        idx = (idx.unsqueeze(0) + self.unit * torch.arange(n).unsqueeze(1)).reshape(-1)
        idx = idx[a - lo : b - lo]  # only the rows the box wants
        return whole.index_select(self.dim, idx)

    def full(self, io: SourceIO) -> torch.Tensor:
        t = self.child.full(io)
        d = self.dim
        units = t.shape[d] // self.unit
        v = t.reshape(t.shape[:d] + (units, self.unit) + t.shape[d + 1 :])
        v = v.index_select(d + 1, torch.tensor(self.perm, dtype=torch.long))
        return v.reshape(t.shape)

    def leaves(self) -> list[str]:
        return self.child.leaves()

    def describe(self) -> str:
        return f"{self.label}({self.child.describe()})"


@dataclass(frozen=True, eq=False)
class Stack(Node):
    """Inputs of one shape stacked along a new dim ``dim`` (MoE experts -> ``[E, ...]``)."""

    parts: tuple[Node, ...]
    dim: int
    shape: tuple[int, ...] = field(init=False)
    dtype: torch.dtype = field(init=False)

    def __post_init__(self) -> None:
        first = self.parts[0].shape
        object.__setattr__(self, "shape", first[: self.dim] + (len(self.parts),) + first[self.dim :])
        object.__setattr__(self, "dtype", self.parts[0].dtype)

    def read(self, box: Box, io: SourceIO) -> torch.Tensor:
        a, b = box[self.dim]
        if a >= b:
            return torch.empty(box_shape(box), dtype=self.dtype)
        inner = box[: self.dim] + box[self.dim + 1 :]
        return torch.stack([self.parts[e].read(inner, io) for e in range(a, b)], dim=self.dim)

    def full(self, io: SourceIO) -> torch.Tensor:
        return torch.stack([p.full(io) for p in self.parts], dim=self.dim)

    def leaves(self) -> list[str]:
        return [k for p in self.parts for k in p.leaves()]

    def describe(self) -> str:
        if len(self.parts) > 3:
            inner = f"{self.parts[0].describe()}, ..., {self.parts[-1].describe()}"
        else:
            inner = ", ".join(p.describe() for p in self.parts)
        return f"stack([{inner}], dim={self.dim})"


@dataclass(frozen=True, eq=False)
class Select(Node):
    """Entry ``index`` of the input along ``dim``, that dim removed (unstack)."""

    child: Node
    dim: int
    index: int
    shape: tuple[int, ...] = field(init=False)
    dtype: torch.dtype = field(init=False)

    def __post_init__(self) -> None:
        s = self.child.shape
        object.__setattr__(self, "shape", s[: self.dim] + s[self.dim + 1 :])
        object.__setattr__(self, "dtype", self.child.dtype)

    def read(self, box: Box, io: SourceIO) -> torch.Tensor:
        outer = box[: self.dim] + ((self.index, self.index + 1),) + box[self.dim :]
        return self.child.read(outer, io).select(self.dim, 0)

    def full(self, io: SourceIO) -> torch.Tensor:
        return self.child.full(io).select(self.dim, self.index)

    def leaves(self) -> list[str]:
        return self.child.leaves()

    def describe(self) -> str:
        return f"{self.child.describe()}[{self.dim}: {self.index}]"


@dataclass(frozen=True, eq=False)
class Pad(Node):
    """The input extended along ``dim`` to ``size`` with ``value`` (vocab padded for TP)."""

    child: Node
    dim: int
    size: int
    value: float = 0.0
    shape: tuple[int, ...] = field(init=False)
    dtype: torch.dtype = field(init=False)

    def __post_init__(self) -> None:
        if self.size < self.child.shape[self.dim]:
            raise ValueError(f"cannot pad {self.child.shape[self.dim]} down to {self.size}")
        object.__setattr__(self, "shape", _with_dim_shape(self.child.shape, self.dim, self.size))
        object.__setattr__(self, "dtype", self.child.dtype)

    def read(self, box: Box, io: SourceIO) -> torch.Tensor:
        a, b = box[self.dim]
        n = self.child.shape[self.dim]
        pieces = []
        if a < min(b, n):
            pieces.append(self.child.read(_with_dim(box, self.dim, (a, min(b, n))), io))
        if b > max(a, n):
            pad_shape = box_shape(_with_dim(box, self.dim, (max(a, n), b)))
            pieces.append(torch.full(pad_shape, self.value, dtype=self.dtype))
        if not pieces:
            return torch.empty(box_shape(box), dtype=self.dtype)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=self.dim)

    def full(self, io: SourceIO) -> torch.Tensor:
        t = self.child.full(io)
        extra = self.size - t.shape[self.dim]
        spec = [0, 0] * (t.dim() - 1 - self.dim) + [0, extra]
        if t.dtype == torch.bool:  # constant_pad_nd does not take bool
            return torch.nn.functional.pad(t.to(torch.uint8), spec, value=self.value).to(torch.bool)
        return torch.nn.functional.pad(t, spec, value=self.value)

    def leaves(self) -> list[str]:
        return self.child.leaves()

    def describe(self) -> str:
        return f"pad({self.child.describe()}, dim={self.dim}, size={self.size})"


@dataclass(frozen=True, eq=False)
class Interleave(Node):
    """A fused tensor ``[part0; part1; ...]`` (``sizes`` along ``dim``) laid out per TP rank:
    ``[p0_r0; p1_r0; ...; p0_r1; p1_r1; ...]``, each part cut in ``tp`` equal blocks, so a
    ``ColwiseParallel`` shard of rank ``r`` holds ``[p0_r; p1_r; ...]``. ``inverse=True``
    maps that layout back to contiguous parts.

    A box maps to several boxes (one per block it touches): ``read`` reads exactly the box's
    volume. ``full`` uses ``view``/``cat`` on whole parts.
    """

    child: Node
    dim: int
    sizes: tuple[int, ...]
    tp: int
    inverse: bool = False
    shape: tuple[int, ...] = field(init=False)
    dtype: torch.dtype = field(init=False)
    segments: tuple[tuple[int, int, int], ...] = field(init=False, repr=False)  # (out_start, in_start, length)

    def __post_init__(self) -> None:
        if sum(self.sizes) != self.child.shape[self.dim]:
            raise ValueError(f"sizes {self.sizes} do not add up to {self.child.shape[self.dim]}")
        if self.tp <= 0 or any(s % self.tp for s in self.sizes):
            raise ValueError(f"sizes {self.sizes} do not divide by tp={self.tp}")
        object.__setattr__(self, "shape", self.child.shape)
        object.__setattr__(self, "dtype", self.child.dtype)
        segs = []
        out = 0
        starts = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        for r in range(self.tp):
            for s, start in zip(self.sizes, starts):
                blk = s // self.tp
                if blk:
                    # contiguous position start + r*blk  <->  interleaved position out
                    segs.append((start + r * blk, out, blk) if self.inverse else (out, start + r * blk, blk))
                out += blk
        object.__setattr__(self, "segments", tuple(sorted(segs)))

    def read(self, box: Box, io: SourceIO) -> torch.Tensor:
        a, b = box[self.dim]
        pieces = []
        for out0, in0, n in self.segments:
            lo, hi = max(a, out0), min(b, out0 + n)
            if lo < hi:
                pieces.append(self.child.read(_with_dim(box, self.dim, (in0 + lo - out0, in0 + hi - out0)), io))
        if not pieces:
            return torch.empty(box_shape(box), dtype=self.dtype)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=self.dim)

    def full(self, io: SourceIO) -> torch.Tensor:
        t = self.child.full(io)
        d, tp = self.dim, self.tp
        rest = t.shape[d + 1 :]
        if not self.inverse:
            parts = t.split(list(self.sizes), dim=d)
            blocks = [p.reshape(p.shape[:d] + (tp, p.shape[d] // tp) + rest) for p in parts]
            return torch.cat(blocks, dim=d + 1).reshape(t.shape)
        v = t.reshape(t.shape[:d] + (tp, t.shape[d] // tp) + rest)
        parts = v.split([s // tp for s in self.sizes], dim=d + 1)
        return torch.cat([p.reshape(p.shape[:d] + (-1,) + rest) for p in parts], dim=d)

    def leaves(self) -> list[str]:
        return self.child.leaves()

    def describe(self) -> str:
        name = "deinterleave" if self.inverse else "interleave"
        return f"{name}({self.child.describe()}, sizes={list(self.sizes)}, tp={self.tp}, dim={self.dim})"
