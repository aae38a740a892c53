"""GPTQ and AWQ (GEMM) int weights: the layouts AutoGPTQ and AutoAWQ write, and their dequantisation.

Both keep a linear layer ``[out, in]`` as int32 words of ``32 / bits`` codes, with per-group
scales and zero points (``group`` input features per group):

- **GPTQ** (``checkpoint_format: gptq``): ``qweight`` int32 ``[in * bits / 32, out]``, packed
  along the input dim (word ``r`` holds inputs ``r * p + j`` at bit ``bits * j``, ``p = 32 /
  bits``); ``qzeros`` int32 ``[G, out * bits / 32]`` packed along the output dim the same way,
  stored less one (the tools add one when they read it back); ``scales`` ``[G, out]``; ``g_idx``
  int32 ``[in]``, the group of every input feature (act-order releases permute it; without it,
  feature ``i`` is in group ``i // group``). ``G = ceil(in / group)``.
- **AWQ GEMM**: ``qweight`` int32 ``[in, out * bits / 32]`` packed along the output dim in the
  order ``0 2 4 6 1 3 5 7`` (nibble ``i`` of word ``c`` holds output ``8c + AWQ_ORDER[i]``);
  ``qzeros`` int32 ``[in / group, out / 8]`` packed the same way, stored as they are;
  ``scales`` ``[in / group, out]``.

The value is ``(code - zero) * scale`` in the scales' dtype (float16 as the tools write them),
rounded once there, as ``auto_gptq``'s ``QuantLinear`` (its torch path) and ``awq``'s
``dequantize_gemm`` compute it, then cast to the target's dtype. Pure tensor functions and the
recipe node; no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from .._base.regions import Box
from .._base.schema import dtype_name
from ..errors import LoadError
from .nodes import Input, Leaf, Node, SourceIO
from .quant_nodes import _Dequant

Layout = Literal["gptq", "awq"]

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""AutoAWQ's packing order: nibble ``i`` of a word holds output column ``AWQ_ORDER[i]`` of its eight."""

AWQ_SHIFT = tuple(4 * AWQ_ORDER.index(j) for j in range(8))
"""The bit offset of output column ``j`` (of eight) inside an AWQ word."""

GPTQ_BITS = (2, 4, 8)
"""The GPTQ widths read: codes that do not straddle words (3-bit GPTQ packs across words)."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def per_word(bits: int) -> int:
    return 32 // bits


def _codes(words: torch.Tensor, shifts: list[int], bits: int, dim: int) -> torch.Tensor:
    """int32 ``words`` -> int32 codes, each word's codes (at ``shifts``) side by side along ``dim``."""
    w = words.to(torch.int32)
    s = torch.tensor(shifts, dtype=torch.int32, device=w.device)
    mask = (1 << bits) - 1
    if dim == 0:
        out = (w.unsqueeze(1) >> s.view(1, -1, *([1] * (w.dim() - 1)))) & mask
        return out.reshape(w.shape[0] * len(shifts), *w.shape[1:])
    out = (w.unsqueeze(-1) >> s) & mask
    return out.reshape(*w.shape[:-1], w.shape[-1] * len(shifts))


def unpack(words: torch.Tensor, layout: Layout, bits: int, dim: int) -> torch.Tensor:
    """Packed int32 ``words`` -> their codes in order along ``dim`` (0: GPTQ's ``qweight``; -1:
    GPTQ's ``qzeros`` and both AWQ tensors, in AWQ's order)."""
    shifts = list(AWQ_SHIFT) if layout == "awq" else [bits * j for j in range(per_word(bits))]
    return _codes(words, shifts, bits, dim)


def _values(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(codes - zeros) * scales`` (``[in, out]`` each), rounded once in the scales' dtype, then ``dtype``.

    The difference is a small integer and the scale has at most 24 significant bits, so the float32
    product is exact and its rounding to float16 is the one rounding the tools' float16 product makes."""
    prod = (codes - zeros).to(torch.float32) * scales.to(torch.float32)
    return prod.to(scales.dtype).to(dtype)


def group_problem(g_idx: torch.Tensor, groups: int, where: str, start: int = 0) -> str | None:
    """Why ``g_idx`` (the groups of input features ``start..``) cannot index ``groups`` scale rows, or ``None``."""
    if g_idx.numel() == 0:
        return None
    bad = (g_idx < 0) | (g_idx >= groups)
    if not bool(bad.any()):
        return None
    i = int(bad.nonzero()[0, 0])
    return (f"{where}: g_idx[{start + i}] = {int(g_idx[i])} is out of range for the {groups} groups of its scales; "
            "the release is damaged (re-download or re-quantize it)")  # fmt: skip


def dequantize(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    layout: Layout,
    bits: int,
    group: int,
    dtype: torch.dtype,
    where: str = "g_idx",
) -> torch.Tensor:
    """Whole tensors -> the ``[out, in]`` weight in ``dtype`` (the eager reference)."""
    if layout == "gptq":
        codes = unpack(qweight, layout, bits, 0)  # [in, out]
        zeros = unpack(qzeros, layout, bits, -1)[:, : scales.shape[1]] + 1  # [G, out]
        n = codes.shape[0]
        gi = torch.arange(n) // group if g_idx is None else g_idx.to(torch.int64)
        problem = group_problem(gi, scales.shape[0], where)
        if problem:
            raise LoadError(problem)
        return _values(codes, zeros[gi], scales[gi], dtype).t().contiguous()
    codes = unpack(qweight, layout, bits, -1)  # [in, out]
    zeros = unpack(qzeros, layout, bits, -1)
    rows = torch.arange(codes.shape[0]) // group
    return _values(codes, zeros[rows], scales[rows], dtype).t().contiguous()


@dataclass(frozen=True, eq=False)
class DequantizedGPTQ(_Dequant):
    """A GPTQ or AWQ linear weight ``[out, in]`` from its ``qweight``, ``qzeros``, ``scales`` (and
    GPTQ's ``g_idx``), in ``dtype``. A region of output rows ``r0:r1`` and input columns
    ``c0:c1`` reads the words of exactly those codes, their rows of ``g_idx``, and the scales
    and zero points of its output rows (GPTQ: every group, since ``g_idx`` may send any input to
    any group; AWQ: the groups its inputs fall in)."""

    qweight: Node
    qzeros: Node
    scales: Node
    g_idx: Node | None
    layout: Layout
    bits: int
    group: int  # input features per group (``group_size: -1``: all of them)
    dtype: torch.dtype
    follows: bool = False  # no dtype= on the rule: the target's dtype replaces ``dtype``
    shape: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        out = self.scales.shape[-1]
        rows = self.qweight.shape[0] * per_word(self.bits) if self.layout == "gptq" else self.qweight.shape[0]
        object.__setattr__(self, "shape", (int(out), int(rows)))

    def children(self) -> tuple[Node, ...]:
        return tuple(n for n in (self.qweight, self.qzeros, self.scales, self.g_idx) if n is not None)

    def _value_bytes(self) -> float:
        return self.bits / 8

    def _align(self, ndim: int) -> dict[int, int]:
        return {0: per_word(self.bits)} if self.layout == "awq" else {}  # AWQ: whole words of output rows

    def _kind(self) -> object:
        return (super()._kind(), self.layout, self.bits, self.g_idx is not None)

    def _sample(self) -> Box:
        p = per_word(self.bits)
        return ((0, min(self.shape[0], p)), (0, min(self.shape[1], p)))

    def _groups(self) -> int:
        return int(self.scales.shape[0])

    def _inputs(self, box: Box) -> tuple[Input, ...]:
        (r0, r1), (c0, c1) = box
        p = per_word(self.bits)
        if self.layout == "gptq":
            groups = self._groups()
            out = [Input(self.qweight, ((c0 // p, cdiv(c1, p)), (r0, r1))),
                   Input(self.qzeros, ((0, groups), (r0 // p, cdiv(r1, p)))),
                   Input(self.scales, ((0, groups), (r0, r1)))]  # fmt: skip
            if self.g_idx is not None:
                out.append(Input(self.g_idx, ((c0, c1),)))
            return tuple(out)
        g0, g1 = c0 // self.group, cdiv(c1, self.group)
        words = (r0 // p, cdiv(r1, p))
        return (Input(self.qweight, ((c0, c1), words)), Input(self.qzeros, ((g0, g1), words)),
                Input(self.scales, ((g0, g1), (r0, r1))))  # fmt: skip

    def _where(self) -> str:
        node = self.g_idx if self.g_idx is not None else self.qweight
        return node.key if isinstance(node, Leaf) else node.describe()

    def _kernel(self, box: Box, dest: torch.Tensor, *inputs: torch.Tensor) -> None:
        (r0, r1), (c0, c1) = box
        p = per_word(self.bits)
        qweight, qzeros, scales = inputs[:3]
        if self.layout == "gptq":
            codes = unpack(qweight, "gptq", self.bits, 0)[c0 - c0 // p * p : c1 - c0 // p * p]  # [c, r]
            zeros = unpack(qzeros, "gptq", self.bits, -1)[:, r0 - r0 // p * p : r1 - r0 // p * p] + 1  # [G, r]
            if self.g_idx is None:
                gi = torch.arange(c0, c1, device=codes.device) // self.group
            else:
                gi = inputs[3].to(torch.int64)
                problem = group_problem(gi, self._groups(), self._where(), c0)
                if problem:
                    raise LoadError(problem)
            dest.copy_(_values(codes, zeros[gi], scales[gi], self.dtype).t())
            return
        codes = unpack(qweight, "awq", self.bits, -1)[:, r0 - r0 // p * p : r1 - r0 // p * p]  # [c, r]
        zeros = unpack(qzeros, "awq", self.bits, -1)[:, r0 - r0 // p * p : r1 - r0 // p * p]  # [g, r]
        rows = torch.arange(c0, c1, device=codes.device) // self.group - c0 // self.group
        dest.copy_(_values(codes, zeros[rows], scales[rows], self.dtype).t())

    def full(self, io: SourceIO) -> torch.Tensor:
        g_idx = None if self.g_idx is None else self.g_idx.full(io)
        return dequantize(self.qweight.full(io), self.qzeros.full(io), self.scales.full(io), g_idx, self.layout,
                          self.bits, self.group, self.dtype, self._where())  # fmt: skip

    def describe(self) -> str:
        g = "" if self.g_idx is None else f", {self.g_idx.describe()}"
        return (f"dequant_{self.layout}({self.qweight.describe()}, {self.qzeros.describe()}, {self.scales.describe()}{g}, "
                f"bits={self.bits}, group={self.group}, dtype={dtype_name(self.dtype)})")  # fmt: skip
