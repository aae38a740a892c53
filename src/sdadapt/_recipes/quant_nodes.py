"""Recipe nodes for quantized sources: dequantise on load, re-quantize on export.

Each node produces a region as one :class:`~sdadapt._recipes.nodes.Compute` step that declares
the regions of its children it reads, only what that region needs (for FP8 the weight region
itself and the scale rows/cols its blocks touch; for MXFP4 the whole 32-value blocks it touches
and their scale bytes). A dequantisation's step is those inputs (``_inputs(box)``, raw bytes)
and its arithmetic on them (``_kernel(box, dest, *values)``, a
:class:`~sdadapt._recipes.nodes.Kernel`), so that on a GPU the engine copies the raw, smaller,
inputs and dequantises there; it also says how the region may be cut into bands of whole
blocks (:class:`~sdadapt._recipes.nodes.Bands`), which the engine's threads compute apart.
Re-quantization (export, whose destinations are on the host) is one host function,
``_region(box, io)``. ``full(io)`` is a separate eager implementation on whole tensors (the
reference the region path is tested against). The formats themselves are in
:mod:`sdadapt._recipes.quant`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from .._base.regions import Box, box_shape
from .._base.schema import dtype_name
from . import quant as Q
from . import quant_fused as QF
from .moves import Concatenated
from .nodes import Bands, Compute, Derived, Input, Kernel, Node, SourceIO, Step

Part = Literal["values", "scales"]


class _Computed(Node):
    """A node whose every region is one host computation, :meth:`_region`, of the children's
    regions :meth:`_inputs` declares."""

    def produce(self, box: Box, dest: torch.Tensor, out: list[Step]) -> None:
        out.append(Compute(self, box, dest, functools.partial(self._region, box), self._inputs(box)))

    def _inputs(self, box: Box) -> tuple[Input, ...]:
        raise NotImplementedError

    def _region(self, box: Box, io: SourceIO) -> torch.Tensor:
        raise NotImplementedError


class _Dequant(Node):
    """A node whose every region is one computation that may run on the destination's device:
    :meth:`_inputs` declares the raw regions it reads, :meth:`_kernel` dequantises their values.
    The engine may cut a large region into bands of whole scale blocks (:class:`Bands`)."""

    def produce(self, box: Box, dest: torch.Tensor, out: list[Step]) -> None:
        kernel = Kernel(functools.partial(self._kernel, box), self._kind(), self._sample())
        bands = Bands(self._value_bytes(), tuple(sorted(self._align(len(box)).items())))
        out.append(Compute(self, box, dest, inputs=self._inputs(box), kernel=kernel, bands=bands))

    def _kind(self) -> object:
        """What tells this node's device kernels apart (equal kinds run the same kernels)."""
        return (type(self).__name__, self.dtype, tuple(c.dtype for c in self.children()))

    def _sample(self) -> Box:
        """A small region at the origin, of whole blocks where the tensor has them."""
        return tuple((0, 1) for _ in self.shape[:-1]) + ((0, min(self.shape[-1], 32)),)

    def follows_target_dtype(self) -> bool:
        """A dequantisation's values have no checkpoint dtype: unless its rule pinned one
        (``dtype=``), it computes in the dtype the target holds."""
        return bool(getattr(self, "follows", False))

    def as_dtype(self, dtype: torch.dtype) -> Node | None:
        """The same dequantisation, into ``dtype`` (any floating dtype)."""
        if not dtype.is_floating_point or not dataclasses.is_dataclass(self):
            return None
        if hasattr(self, "follows"):  # a dtype asked for (a cast rule, or the target's) is pinned
            return dataclasses.replace(self, dtype=dtype, follows=False)
        return dataclasses.replace(self, dtype=dtype)

    def _value_bytes(self) -> float:
        """Stored bytes per value (the scales are left out: a small fraction)."""
        raise NotImplementedError

    def _align(self, ndim: int) -> dict[int, int]:
        """Dims whose cuts fall on block boundaries, and the block size there."""
        return {}

    def _inputs(self, box: Box) -> tuple[Input, ...]:
        raise NotImplementedError

    def _kernel(self, box: Box, dest: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> None:
        raise NotImplementedError


@dataclass(frozen=True, eq=False)
class DequantizedFP8(_Dequant):
    """An FP8 e4m3 ``weight`` times its block ``scale`` (``block`` over the last two dims), in ``dtype``."""

    weight: Node
    scale: Node
    block: tuple[int, int]
    scale_format: Q.ScaleFormat
    dtype: torch.dtype
    follows: bool = False  # no dtype= on the rule: the target's dtype replaces ``dtype``
    shape: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.weight.shape))

    def _value_bytes(self) -> float:
        return self.weight.dtype.itemsize

    def _align(self, ndim: int) -> dict[int, int]:
        return {ndim - 2: self.block[0]}  # bands of whole scale rows

    def _kind(self) -> object:
        return (super()._kind(), self.scale_format)  # UE8M0 scales decode with a kernel of their own

    def _sample(self) -> Box:
        rows, cols = self.shape[-2:]
        return tuple((0, 1) for _ in self.shape[:-2]) + ((0, min(rows, self.block[0])), (0, min(cols, self.block[1])))

    def _inputs(self, box: Box) -> tuple[Input, ...]:
        (r0, r1), (c0, c1) = box[-2:]
        b0, b1 = self.block
        scale_box = box[:-2] + ((r0 // b0, Q.cdiv(r1, b0)), (c0 // b1, Q.cdiv(c1, b1)))
        return Input(self.weight, box), Input(self.scale, scale_box)

    def _kernel(self, box: Box, dest: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> None:
        (r0, _), (c0, _) = box[-2:]
        offset = (r0 % self.block[0], c0 % self.block[1])
        if offset == (0, 0) and dest.dtype == self.dtype and Q.dequantize_fp8_into(dest, weight, scale, self.block, self.scale_format):
            return
        dest.copy_(Q.dequantize_fp8_region(weight, scale, self.block, offset, self.scale_format, self.dtype))

    def full(self, io: SourceIO) -> torch.Tensor:
        return Q.dequantize_fp8(self.weight.full(io), self.scale.full(io), self.block, self.scale_format, self.dtype)

    def describe(self) -> str:
        b0, b1 = self.block
        return (f"dequant_fp8({self.weight.describe()}, {self.scale.describe()}, block=[{b0}, {b1}], "
                f"scale_format={self.scale_format}, dtype={dtype_name(self.dtype)})")


@dataclass(frozen=True, eq=False)
class DequantizedMXFP4(_Dequant):
    """MXFP4 ``blocks [..., G, 16]`` and e8m0 ``scales [..., G]`` as values ``[..., G * 32]`` in ``dtype``."""

    blocks: Node
    scales: Node
    dtype: torch.dtype
    follows: bool = False  # no dtype= on the rule: the target's dtype replaces ``dtype``
    shape: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        s = tuple(self.blocks.shape)
        object.__setattr__(self, "shape", s[:-2] + (s[-2] * Q.MX_BLOCK,))

    def _value_bytes(self) -> float:
        return 0.5  # two e2m1 values per byte; the last dim (the packed one) is never cut

    def _inputs(self, box: Box) -> tuple[Input, ...]:
        c0, c1 = box[-1]
        g0, g1 = c0 // Q.MX_BLOCK, Q.cdiv(c1, Q.MX_BLOCK)
        lead = box[:-1]
        return Input(self.blocks, lead + ((g0, g1), (0, Q.MX_BYTES))), Input(self.scales, lead + ((g0, g1),))

    def _kernel(self, box: Box, dest: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> None:
        c0, c1 = box[-1]
        skip = c0 // Q.MX_BLOCK * Q.MX_BLOCK
        dest.copy_(Q.dequantize_mxfp4(blocks, scales, self.dtype)[..., c0 - skip : c1 - skip])

    def full(self, io: SourceIO) -> torch.Tensor:
        blocks = self.blocks.full(io)
        lut = torch.tensor(Q.FP4_VALUES, dtype=torch.float32)
        *lead, groups, nbytes = blocks.shape
        out = torch.empty((*lead, groups, 2 * nbytes), dtype=torch.float32)
        out[..., 0::2] = lut[(blocks & 0x0F).long()]
        out[..., 1::2] = lut[(blocks >> 4).long()]
        out *= Q.decode_e8m0(self.scales.full(io))[..., None]
        return out.flatten(-2).to(self.dtype)

    def describe(self) -> str:
        return f"dequant_mxfp4({self.blocks.describe()}, {self.scales.describe()}, dtype={dtype_name(self.dtype)})"


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def row_parts(child: Node, box: Box, b0: int) -> list[tuple[Node, Box, int]] | None:
    """Where ``child`` joins parts along its rows (dim -2) and ``box`` (whole blocks of ``b0``
    rows) cuts them only at block boundaries (fused q/k/v, gate/up): ``(part, its region, first
    row in box)`` for each part the box touches, to be quantized apart (no block holds two parts'
    rows), never joined first; else ``None``."""
    rows_dim = len(child.shape) - 2
    if not isinstance(child, Concatenated) or child.dim % len(child.shape) != rows_dim:
        return None
    (a0, a1), out, offset = box[rows_dim], [], 0
    for part in child.parts:
        n = part.shape[rows_dim]
        lo, hi = max(a0, offset), min(a1, offset + n)
        if lo < hi:
            if (lo - a0) % b0:
                return None
            out.append((part, box[:rows_dim] + ((lo - offset, hi - offset),) + box[rows_dim + 1 :], lo - a0))
        offset += n
    return out if len(out) > 1 else None


def quantize_parts(
    parts: list[tuple[Node, Box, int]], io: SourceIO, quantize: Callable[..., tuple[torch.Tensor | None, ...]], b0: int,
    grid: tuple[tuple[int, ...], torch.dtype], codes: tuple[tuple[int, ...], torch.dtype] | None, into: torch.Tensor | None,
) -> tuple[torch.Tensor | None, torch.Tensor]:  # fmt: skip
    """The codes and scales of :func:`row_parts`' ``parts``, each read and quantized apart by
    ``quantize(x, out=its rows of into or None, scales_out=its rows of the grid)`` (codes, scales,
    ...), into one scale grid of ``grid`` (shape, dtype) and, with ``codes`` (shape, dtype), one
    codes tensor (``into`` where given), each kernel writing its rows in place where it can."""
    q: torch.Tensor | None = into
    scale: torch.Tensor | None = None
    for part, box, first in parts:
        rows = box_shape(box)[-2]
        x = part.read(box, io)
        if scale is None:
            scale = torch.empty(grid[0], dtype=grid[1], device=x.device)
        rows_of = scale[..., first // b0 : first // b0 + Q.cdiv(rows, b0), :]
        qi, si = quantize(x, out=None if into is None else into[..., first : first + rows, :], scales_out=rows_of)[:2]
        assert si is not None
        if not _same_view(si, rows_of):
            rows_of.copy_(si.reshape(rows_of.shape))
        if codes is not None and q is None:
            q = torch.empty(codes[0], dtype=codes[1], device=x.device)
        if q is not None and qi is not None and not _same_view(qi, q[..., first : first + rows, :]):
            q[..., first : first + rows, :] = qi
    assert scale is not None
    return q, scale


@dataclass(frozen=True, eq=False)
class QuantizedFP8(_Computed, Derived):
    """One part of ``child`` quantized to FP8 with ``block`` scale tiles: the e4m3 weight
    (``part="values"``) or its stored scale grid (``part="scales"``, in ``scale_dtype``, by
    default the format's first storage dtype). A region is computed from the whole blocks it
    touches."""

    child: Node
    block: tuple[int, int]
    scale_format: Q.ScaleFormat
    part: Part
    scale_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.part == "values":
            shape, dtype = tuple(self.child.shape), Q.FP8_DTYPE
        else:
            shape = Q.fp8_scale_shape(tuple(self.child.shape), self.block)
            dtype = self.scale_dtype or Q.SCALE_DTYPES[self.scale_format][0]
        self.derive(shape, dtype)

    def _inputs(self, box: Box) -> tuple[Input, ...]:
        """The whole blocks of ``child`` that ``box`` (of the values, or of the scale grid) touches."""
        rows, cols = self.child.shape[-2:]
        b0, b1 = self.block
        (a0, a1), (c0, c1) = box[-2:]
        if self.part == "values":
            wide = ((a0 // b0 * b0, min(rows, Q.cdiv(a1, b0) * b0)), (c0 // b1 * b1, min(cols, Q.cdiv(c1, b1) * b1)))
        else:
            wide = ((a0 * b0, min(rows, a1 * b0)), (c0 * b1, min(cols, c1 * b1)))
        return (Input(self.child, box[:-2] + wide),)

    def _quantize(self, src: Input, io: SourceIO, into: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Codes (``into`` where given: the codes are written there) and scales of ``src``'s
        region; inside a refit's run the scales of the codes' pass serve the scales' node."""
        values = self.part == "values"
        key = ("fp8-scales", self.child, src.box, self.block, self.scale_format)
        if not values and (hit := QF.kept(key)) is not None:
            return None, hit
        q, scale = self._quantize_parts(src, io, into)
        if values:
            QF.keep(key, scale)
        return q, scale

    def _quantize_parts(self, src: Input, io: SourceIO, into: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor]:
        values = self.part == "values"
        parts = row_parts(self.child, src.box, self.block[0])
        if parts is None:
            return QF.quantize_fp8(src.value(io), self.block, self.scale_format, values=values, out=into)
        shape = box_shape(src.box)
        grid = (Q.fp8_scale_shape(shape, self.block), torch.uint8 if self.scale_format == "ue8m0" else torch.float32)
        quantize = functools.partial(QF.quantize_fp8, block=self.block, fmt=self.scale_format, values=values)
        return quantize_parts(parts, io, quantize, self.block[0], grid, (shape, Q.FP8_DTYPE) if values else None, into)

    def produce(self, box: Box, dest: torch.Tensor, out: list[Step]) -> None:
        out.append(Compute(self, box, dest, functools.partial(self._region_into, box, dest), self._inputs(box)))

    def _region_into(self, box: Box, dest: torch.Tensor, io: SourceIO) -> torch.Tensor:
        """:meth:`_region`, the codes written straight into ``dest`` (returned: its copy into
        itself is none) where ``box`` is whole blocks (or reaches the tensor's end) and ``dest``
        a device tensor the kernels write (last dim contiguous, 2 or 3 dims)."""
        (src,) = self._inputs(box)
        if self.part != "values" or src.box != box or not QF.writable(dest):
            return self._region(box, io)
        q, _ = self._quantize(src, io, into=dest)
        if q is not None and not _same_view(q, dest):
            dest.copy_(q)
        return dest

    def _region(self, box: Box, io: SourceIO) -> torch.Tensor:
        (src,) = self._inputs(box)
        q, scale = self._quantize(src, io)
        if self.part == "values":  # quantized whole blocks, narrowed
            assert q is not None
            (a0, a1), (c0, c1) = box[-2:]
            (r_lo, _), (c_lo, _) = src.box[-2:]
            return q[..., a0 - r_lo : a1 - r_lo, c0 - c_lo : c1 - c_lo]
        return Q.store_scales(scale, self.dtype)

    def full(self, io: SourceIO) -> torch.Tensor:
        q, scale = Q.quantize_fp8(self.child.full(io), self.block, self.scale_format)
        return q if self.part == "values" else Q.store_scales(scale, self.dtype)

    def describe(self) -> str:
        b0, b1 = self.block
        return f"quantize_fp8({self.child.describe()}, block=[{b0}, {b1}], {self.scale_format}).{self.part}"


@dataclass(frozen=True, eq=False)
class QuantizedMXFP4(_Computed, Derived):
    """One part of ``child [..., C]`` (``C`` a multiple of 32) quantized to MXFP4: the packed
    ``blocks [..., C/32, 16]`` (``part="values"``) or the e8m0 ``scales [..., C/32]``."""

    child: Node
    part: Part

    def __post_init__(self) -> None:
        s = tuple(self.child.shape)
        groups = (s[-1] // Q.MX_BLOCK,)
        shape = s[:-1] + groups + ((Q.MX_BYTES,) if self.part == "values" else ())
        self.derive(shape, torch.uint8)

    def _inputs(self, box: Box) -> tuple[Input, ...]:
        lead = box[: len(self.child.shape) - 1]
        g0, g1 = box[len(lead)]
        return (Input(self.child, lead + ((g0 * Q.MX_BLOCK, g1 * Q.MX_BLOCK),)),)

    def _region(self, box: Box, io: SourceIO) -> torch.Tensor:
        (src,) = self._inputs(box)
        blocks, scales = Q.quantize_mxfp4(src.value(io))
        if self.part == "scales":
            return scales
        k0, k1 = box[-1]
        return blocks[..., k0:k1]

    def full(self, io: SourceIO) -> torch.Tensor:
        blocks, scales = Q.quantize_mxfp4(self.child.full(io))
        return blocks if self.part == "values" else scales

    def describe(self) -> str:
        return f"quantize_mxfp4({self.child.describe()}).{self.part}"
