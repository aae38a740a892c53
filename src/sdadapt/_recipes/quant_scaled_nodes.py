"""Recipe nodes for the scaled formats of :mod:`sdadapt._recipes.quant_scaled` (compressed-tensors,
ModelOpt, MXFP8, per-tensor and per-channel FP8): dequantise on load, re-quantize on export.

:class:`DequantizedScaled` reads, for a region, the stored values of exactly its rows and of the
whole packs its columns touch (two e2m1 values per byte, eight int4 or four int8 per int32 word),
and from the scales, zero points and global scale only the grid entries the region touches (a
per-tensor scale is one value). Its inputs (``_inputs``, declared regions) and its arithmetic
(``_kernel``) are given apart, so that on a GPU the engine copies the raw bytes and dequantises
there, in the target's dtype.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from .._base.regions import Box, box_shape, full_box
from .._base.schema import dtype_name
from . import quant_fused as QF
from . import quant_scaled as S
from .moves import Concatenated
from .nodes import Compute, Derived, Input, Node, SourceIO, Step
from .quant_nodes import _Computed, _Dequant, _same_view, quantize_parts, row_parts


@dataclass(frozen=True, eq=False)
class DequantizedScaled(_Dequant):
    """``values`` (codes of ``codec``, packed along the last dim) times ``scale`` per ``block``
    of the ``[..., R, cols]`` output, less ``zero`` (packed along rows for packed codecs), with
    the per-tensor ``glob`` dividing or multiplying the scales (``mode``), in ``dtype``. A scale
    of one element is the whole tensor's."""

    values: Node
    scale: Node
    zero: Node | None
    glob: Node | None
    codec: S.Codec
    block: tuple[int, int]
    cols: int
    mode: S.GlobalMode
    dtype: torch.dtype
    follows: bool = False  # no dtype= on the rule: the target's dtype replaces ``dtype``
    shape: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.values.shape[:-1]) + (self.cols,))

    def children(self) -> tuple[Node, ...]:
        return tuple(n for n in (self.values, self.scale, self.zero, self.glob) if n is not None)

    def _value_bytes(self) -> float:
        return self.values.dtype.itemsize / S.PER_UNIT[self.codec]

    def _align(self, ndim: int) -> dict[int, int]:
        unit = 32 // S.BITS[self.codec] if self.zero is not None and self.codec in ("int4", "int8_packed") else 1
        return {ndim - 2: max(self.block[0] if self.block[0] < self.shape[-2] else 1, unit)}

    def _kind(self) -> object:
        return (super()._kind(), self.codec, self.mode, self.zero is not None, self.glob is not None)

    def _per_tensor(self) -> bool:
        return len(self.scale.shape) < 2 or (self.scale.shape[-2:] == (1, 1) and self.block == tuple(self.shape[-2:]))

    def _inputs(self, box: Box) -> tuple[Input, ...]:
        (r0, r1), (c0, c1) = box[-2:]
        unit = S.PER_UNIT[self.codec]
        b0, b1 = self.block
        lead = box[:-2]
        out = [Input(self.values, lead + ((r0, r1), (c0 // unit, S.cdiv(c1, unit))))]
        grid = lead + ((r0 // b0, S.cdiv(r1, b0)), (c0 // b1, S.cdiv(c1, b1)))
        out.append(Input(self.scale, full_box(tuple(self.scale.shape)) if self._per_tensor() else grid))
        if self.zero is not None:
            if self.codec in ("int4", "int8_packed"):
                per = 32 // S.BITS[self.codec]
                (g0, g1), cols = grid[-2], grid[-1]
                out.append(Input(self.zero, lead + ((g0 // per, S.cdiv(g1, per)), cols)))
            else:
                out.append(Input(self.zero, grid))
        if self.glob is not None:
            out.append(Input(self.glob, full_box(tuple(self.glob.shape))))
        return tuple(out)

    def _kernel(self, box: Box, dest: torch.Tensor, *inputs: torch.Tensor) -> None:
        (r0, _), (c0, c1) = box[-2:]
        b0, b1 = self.block
        raw, scale, rest = inputs[0], inputs[1], list(inputs[2:])
        zero = rest.pop(0) if self.zero is not None else None
        glob = rest.pop(0) if self.glob is not None else None
        s = S.scale_multipliers(scale, glob, self.mode)
        if zero is None and dest.dtype == self.dtype and (self._per_tensor() or b0 == 1):
            if S.dequantize_into(dest, raw, self.codec, s, self.block, c0):
                return
        unit = S.PER_UNIT[self.codec]
        skip = c0 // unit * unit
        codes = S.decode_codes(raw, self.codec)[..., c0 - skip : c1 - skip]
        z = None
        if zero is not None:
            if self.codec in ("int4", "int8_packed"):
                per = 32 // S.BITS[self.codec]
                g0, g1 = r0 // b0, r0 // b0 + scale.shape[-2]
                z = S.decode_zero_rows(zero, S.BITS[self.codec])[..., g0 - g0 // per * per : g1 - g0 // per * per, :]
            else:
                z = zero.to(torch.float32)
        dest.copy_(S.dequantize_region(codes, s, self.block, (r0 % b0, c0 % b1), z, self.dtype))

    def full(self, io: SourceIO) -> torch.Tensor:
        zero = None if self.zero is None else self.zero.full(io)
        glob = None if self.glob is None else self.glob.full(io)
        return S.dequantize(self.values.full(io), self.codec, self.scale.full(io), self.block, self.cols, self.dtype,
                            zero, glob, self.mode)  # fmt: skip

    def describe(self) -> str:
        extra = "".join(f", {n.describe()}" for n in (self.zero, self.glob) if n is not None)
        b0, b1 = self.block
        return (f"dequant_scaled({self.values.describe()}, {self.scale.describe()}{extra}, {self.codec}, block=[{b0}, {b1}], "
                f"dtype={dtype_name(self.dtype)})")  # fmt: skip


@dataclass(frozen=True, eq=False)
class QuantizedScaled(_Computed, Derived):
    """One part of ``child [..., R, C]`` re-quantized in a scaled format (:func:`S.quantize`): the
    stored codes (``part="values"``: e4m3 or int8, e2m1 two per byte, int4 / int8 packed in int32
    words), the scales (``part="scales"``, in ``scale_dtype``: float, or e8m0 exponent bytes) or
    the zero points (``part="zeros"``, with ``zero``: int8, or packed along rows in int32 words),
    with ``block`` scale tiles; NVFP4 needs the stored global scale ``glob``. A region is computed
    from the whole tiles it touches (and, for packed zero points, the whole words of tile rows)."""

    child: Node
    codec: S.Codec
    block: tuple[int, int]
    part: str
    scale_dtype: torch.dtype
    glob: Node | None = None
    mode: S.GlobalMode = "divide"
    scale_shape: tuple[int, ...] | None = None  # the stored scale's shape (a per-tensor scale's 0-d or [1])
    zero: bool = False

    def __post_init__(self) -> None:
        s = tuple(self.child.shape)
        grid = s[:-2] + (S.cdiv(s[-2], self.block[0]), S.cdiv(s[-1], self.block[1]))
        if self.part == "values":
            shape, dtype = s[:-1] + (S.cdiv(s[-1], S.PER_UNIT[self.codec]),), S.STORED[self.codec]
        elif self.part == "zeros":
            packed = self.codec in ("int4", "int8_packed")
            rows = S.cdiv(grid[-2], 32 // S.BITS[self.codec]) if packed else grid[-2]
            shape, dtype = grid[:-2] + (rows, grid[-1]), torch.int32 if packed else torch.int8
        else:
            shape, dtype = self.scale_shape if self.scale_shape is not None else grid, self.scale_dtype
        self.derive(shape, dtype)

    def children(self) -> tuple[Node, ...]:
        return (self.child,) if self.glob is None else (self.child, self.glob)

    def _glob(self, io: SourceIO) -> torch.Tensor | None:
        if self.glob is None:
            return None
        if isinstance(self.glob, GlobalScaleOf):  # made once per run (memoized), on the weight's device
            return self.glob.value(io)
        return self.glob.read(full_box(tuple(self.glob.shape)), io)

    def _quantize(
        self, src: Box, io: SourceIO, into: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """The codes (``None`` where the fused path skipped them for a part that is not the
        values; ``into`` where given and the kernels wrote there), scales and zero points of
        region ``src`` of ``child`` (whole tiles). Parts joined along the rows that the tiles do
        not straddle are quantized apart, from their own regions (no joined copy)."""
        values = self.part == "values"
        key = ("scaled-scales", self.child, src, self.codec, self.block, self.scale_dtype, self.glob, self.mode)
        if not values and not self.zero and (hit := QF.kept(key)) is not None:
            return None, hit, None
        got = self._quantize_parts(src, io, into)
        if values and not self.zero:
            QF.keep(key, got[1])
        return got

    def _quantize_parts(
        self, src: Box, io: SourceIO, into: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        glob, values = self._glob(io), self.part == "values"
        parts = None if self.zero else row_parts(self.child, src, 1 if self.one_fp8_scale() else self.block[0])
        amax = largest_magnitude([p.read(b, io) for p, b, _ in parts]) if parts and self.one_fp8_scale() else None  # the parts'
        if parts is None:
            return QF.quantize_scaled(self.child.read(src, io), self.codec, self.block, self.scale_dtype, self.zero, glob,
                                      self.mode, values=values, out=into)  # fmt: skip
        (b0, b1), shape = self.block, box_shape(src)
        quantize = functools.partial(QF.quantize_scaled, codec=self.codec, block=self.block, scale_dtype=self.scale_dtype, glob=glob,
                                     mode=self.mode, values=values, amax=amax)  # fmt: skip
        grid = (shape[:-2] + (S.cdiv(shape[-2], b0), S.cdiv(shape[-1], b1)), self.scale_dtype)
        codes = (shape[:-1] + (S.cdiv(shape[-1], S.PER_UNIT[self.codec]),), S.STORED[self.codec])
        return *quantize_parts(parts, io, quantize, b0, grid, codes if values else None, into), None

    def one_fp8_scale(self) -> bool:
        """Whether this is a 2-D weight quantized to FP8 with one float scale for the whole weight
        (compressed-tensors' ``strategy="tensor"``)."""
        rows, cols = self.child.shape[-2:]
        return (len(self.child.shape) == 2 and self.codec == "e4m3" and self.glob is None and not self.zero and self.block[0] >= rows
                and self.block[1] >= cols and self.scale_dtype.is_floating_point and self.scale_dtype.itemsize >= 2)  # fmt: skip

    def _source_box(self, box: Box) -> Box:
        """The region of ``child`` that region ``box`` is quantized from: the whole blocks it
        touches (the whole tile rows of packed zero points; all of ``child`` for a per-tensor
        scale)."""
        rows, cols = self.child.shape[-2:]
        b0, b1 = self.block
        if self.part == "values":
            (a0, a1), (p0, p1) = box[-2:]
            unit = S.PER_UNIT[self.codec]
            c0, c1 = p0 * unit, min(cols, p1 * unit)
            return box[:-2] + ((a0 // b0 * b0, min(rows, S.cdiv(a1, b0) * b0)), (c0 // b1 * b1, min(cols, S.cdiv(c1, b1) * b1)))
        if self._per_tensor():
            return full_box(tuple(self.child.shape))
        (g0, g1), (h0, h1) = box[-2:]
        per = 32 // S.BITS[self.codec] if self.part == "zeros" and self.codec in ("int4", "int8_packed") else 1
        t0, t1 = g0 * per, min(S.cdiv(rows, b0), g1 * per)  # the tile rows of these (packed) rows
        return box[:-2] + ((t0 * b0, min(rows, t1 * b0)), (h0 * b1, min(cols, h1 * b1)))

    def _per_tensor(self) -> bool:
        return self.part == "scales" and self.scale_shape is not None and len(self.scale_shape) < 2

    def _inputs(self, box: Box) -> tuple[Input, ...]:
        src = (Input(self.child, self._source_box(box)),)
        return src if self.glob is None else src + (Input(self.glob, full_box(tuple(self.glob.shape))),)

    def produce(self, box: Box, dest: torch.Tensor, out: list[Step]) -> None:
        out.append(Compute(self, box, dest, functools.partial(self._region_into, box, dest), self._inputs(box)))

    def _region_into(self, box: Box, dest: torch.Tensor, io: SourceIO) -> torch.Tensor:
        """:meth:`_region`, the codes written straight into ``dest`` (returned: its copy into
        itself is none) where ``box`` is whole tiles and ``dest`` a device tensor the kernels
        write (last dim contiguous, 2 or 3 dims)."""
        src = self._source_box(box)
        if self.part != "values" or self.zero or not QF.writable(dest, S.STORED[self.codec]):
            return self._region(box, io)
        (a0, a1), (p0, p1) = box[-2:]
        unit = S.PER_UNIT[self.codec]
        c0, c1 = src[-1]
        if src[:-1] != box[:-1] or c0 != p0 * unit or c1 != min(self.child.shape[-1], p1 * unit) or S.cdiv(c1 - c0, unit) != p1 - p0:
            return self._region(box, io)
        q = self._quantize(src, io, into=dest)[0]
        if q is not None and not _same_view(q, dest):
            dest.copy_(q)
        return dest

    def _region(self, box: Box, io: SourceIO) -> torch.Tensor:
        src = self._source_box(box)
        if self.part == "values":
            (a0, a1), (p0, p1) = box[-2:]
            unit = S.PER_UNIT[self.codec]
            c0 = p0 * unit
            (r_lo, _), (c_lo, _) = src[-2:]
            q = self._quantize(src, io)[0]
            assert q is not None
            return q[..., a0 - r_lo : a1 - r_lo, (c0 - c_lo) // unit : (c0 - c_lo) // unit + p1 - p0]
        _, scales, zeros = self._quantize(src, io)
        if self._per_tensor():  # one scale for the whole tensor
            return scales.reshape(self.shape)
        out = scales if self.part == "scales" else zeros
        assert out is not None
        return out.reshape(box_shape(box))

    def full(self, io: SourceIO) -> torch.Tensor:
        glob = None if self.glob is None else self.glob.full(io)
        q, s, z = S.quantize(self.child.full(io), self.codec, self.block, self.scale_dtype, self.zero, glob, self.mode)
        if self.part == "zeros":
            assert z is not None
            return z
        return q if self.part == "values" else s.reshape(self.shape)

    def describe(self) -> str:
        b0, b1 = self.block
        return f"quantize_scaled({self.child.describe()}, {self.codec}, block=[{b0}, {b1}]).{self.part}"


@dataclass(frozen=True, eq=False)
class ShapeOf(_Computed, Derived):
    """The shape of ``child`` as a 1-D int64 tensor (compressed-tensors' ``weight_shape``)."""

    child: Node

    def __post_init__(self) -> None:
        self.derive((len(self.child.shape),), torch.int64)

    def _inputs(self, box: Box) -> tuple[Input, ...]:
        return ()  # the shape only: nothing is read

    def _region(self, box: Box, io: SourceIO) -> torch.Tensor:
        (a, b), = box
        return torch.tensor(self.child.shape, dtype=torch.int64)[a:b]

    def full(self, io: SourceIO) -> torch.Tensor:
        return torch.tensor(self.child.shape, dtype=torch.int64)

    def leaves(self) -> list[str]:
        return []

    def describe(self) -> str:
        return f"shape_of({self.child.describe()})"


@dataclass(frozen=True, eq=False)
class GlobalScaleOf(_Computed, Derived):
    """NVFP4's per-tensor second scale of ``child``, as the release's tool chooses it from the
    tensor's largest magnitude: compressed-tensors' ``weight_global_scale = 448 * 6 / amax``
    (``mode="divide"``, shape ``[1]``), ModelOpt's ``weight_scale_2 = amax / (448 * 6)``
    (``"multiply"``, 0-d)."""

    child: Node
    mode: S.GlobalMode

    def __post_init__(self) -> None:
        self.derive((1,) if self.mode == "divide" else (), torch.float32)

    def _inputs(self, box: Box) -> tuple[Input, ...]:
        return (Input(self.child, full_box(tuple(self.child.shape))),)

    def value(self, io: SourceIO) -> torch.Tensor:
        """The global scale of the child's values in ``io``, on the device they are on; made once
        per ``key`` inside ``quant_fused.scales_memo`` (a refit's run), however often the values,
        the scales and the global scale itself read it."""
        return QF.memoized(("global", self), lambda: self._of_parts(self._parts(io)))

    def _region(self, box: Box, io: SourceIO) -> torch.Tensor:
        return self.value(io)

    def _parts(self, io: SourceIO) -> list[torch.Tensor]:
        """The child's values as read, by part where it joins parts along a dim before the last
        (fused q/k/v, gate/up: the largest magnitude is the parts' largest, and rows quantize
        apart), so that no joined copy is made."""
        child, nd = self.child, len(self.child.shape)
        if isinstance(child, Concatenated) and nd >= 2 and child.dim % nd != nd - 1:
            return [p.read(full_box(tuple(p.shape)), io) for p in child.parts]
        return [child.read(full_box(tuple(child.shape)), io)]

    def full(self, io: SourceIO) -> torch.Tensor:
        return self._of_parts([self.child.full(io)])

    def _of_parts(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The global scale of the values of ``parts`` (a tensor's rows, in order), on their device."""
        flats, g, first = self._start(parts)
        return self._finish(flats, g, first is not None and bool(first))

    def _start(self, parts: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None]:
        """(the parts as rows, ``448 * 6 / amax`` or its inverse as the mode has it, whether the
        first row's groups hold few enough magnitudes for a neighbour to be searched (a device
        bool; ``None`` for no values)), with no wait for the device.

        Values dequantised from NVFP4 give back amax / 6 only to a unit in the last place of the
        original scale: of g and its float32 neighbours, the first that reproduces the values is
        the global scale. Rows quantize apart given the global scale, so a candidate that fails
        the first row fails the tensor; and a group of 16 values that one scale reproduces holds
        at most 8 magnitudes (e2m1's), so a first row with a group of more fails every candidate:
        trainer values, which never were NVFP4, need no search."""
        flats = [p.reshape(-1, p.shape[-1]) if p.dim() else p.reshape(1, 1) for p in parts]
        flats = [f for f in flats if f.numel()]
        if not flats:
            return flats, torch.ones(self.shape, dtype=torch.float32, device=parts[0].device), None
        g = S.nvfp4_global_scale(largest_magnitude(flats).to(torch.float32), self.mode)
        return flats, g, few_magnitudes(flats[0][:1])

    def _finish(self, flats: list[torch.Tensor], g: torch.Tensor, search: bool) -> torch.Tensor:
        """The global scale from :meth:`_start`'s ``g``: it, or where ``search`` its first float32
        neighbour that reproduces the values (each candidate tried on the first row, then on all)."""
        if search:
            x = (torch.cat(flats) if len(flats) > 1 else flats[0]).to(torch.float32)
            for cand in (g, torch.nextafter(g, torch.zeros_like(g)), torch.nextafter(g, 2 * g)):
                if bool(nvfp4_reproduced(x[:1], cand, self.mode)) and bool(nvfp4_reproduced(x, cand, self.mode)):
                    return cand.reshape(self.shape)
        return g.reshape(self.shape)

    def describe(self) -> str:
        return f"global_scale_of({self.child.describe()}, {self.mode})"


def prepare_global_scales(nodes: list[GlobalScaleOf], io: SourceIO) -> None:
    """Inside ``quant_fused.scales_memo`` (a refit's run): make the global scales of ``nodes``
    from ``io`` with one wait for the device in all (each first-row test read together), not one
    per weight, before any is used; outside it, nothing."""
    pending = []
    for node in nodes:
        if QF.memoized_already(("global", node)):
            continue
        flats, g, first = node._start(node._parts(io))
        pending.append((node, flats, g, first))
    firsts = [f for *_, f in pending if f is not None]
    if not firsts or len({f.device for f in firsts}) != 1:
        return  # nothing to wait for, or devices apart: each node's own wait serves
    found = iter(torch.stack(firsts).tolist())  # the one wait
    for node, flats, g, first in pending:
        search = first is not None and bool(next(found))
        QF.memoized(("global", node), functools.partial(node._finish, flats, g, search))


def largest_magnitude(parts: list[torch.Tensor]) -> torch.Tensor:
    """The largest magnitude of the values of ``parts`` (NaN where one holds a NaN), a 0-d tensor
    on their device: one pass each, no float32 copy (a largest magnitude is exact in any float
    dtype)."""
    amax: torch.Tensor | None = None
    for f in parts:
        low, high = torch.aminmax(f)
        m = torch.maximum(-low, high)
        amax = m if amax is None else torch.maximum(amax, m)
    assert amax is not None
    return amax


def few_magnitudes(rows: torch.Tensor) -> torch.Tensor:
    """Whether each whole group of 16 in ``rows [..., C]`` holds at most 8 distinct magnitudes, as
    every group of values that one NVFP4 scale gives back does (a device bool; a NaN is distinct
    from everything)."""
    whole = rows.shape[-1] // S.NVFP4_GROUP * S.NVFP4_GROUP
    mags = rows[..., :whole].abs().reshape(-1, S.NVFP4_GROUP).sort(dim=-1).values
    return ((mags[:, 1:] != mags[:, :-1]).sum(dim=-1) < 8).all()


def nvfp4_reproduced(x: torch.Tensor, glob: torch.Tensor, mode: S.GlobalMode) -> torch.Tensor:
    """Whether the NVFP4 values of float32 ``x [..., C]`` under global scale ``glob`` give back
    ``x`` exactly (a device bool)."""
    packed, scales = S.quantize_nvfp4(x, glob, mode)
    back = S.dequantize(packed, "e2m1", scales, (1, S.NVFP4_GROUP), x.shape[-1], torch.float32, glob=glob, mode=mode)
    return (back == x).all()
