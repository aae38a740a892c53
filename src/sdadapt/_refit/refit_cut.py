"""FP8 blocks cut by the trainer's shards, quantized where their rows are.

A block of an FP8 engine weight (vLLM's 128 x 128 tiles) whose values several trainer ranks hold
(FSDP rows that are not a multiple of 128 per rank) has one scale, its largest magnitude over
448, so no one of them can quantize it alone. Rather than sending the block's float32 values to
the engine rank, its holders agree on the block's largest magnitude: each computes it over its
own rows, one ``all_reduce`` (MAX over the float32 bits, which order non-negative floats as
integers) per run gives every rank every cut block's, and each holder quantizes its own rows with
the block's scale and sends their e4m3 codes. The engine rank makes the scales from the agreed
values (nothing moves for them). For float32 trainers the scale is then the first of ``amax /
448`` and its float32 neighbours that gives back the whole block exactly
(:func:`sdadapt._recipes.quant.fp8_scale_candidates`): each holder checks the three on its rows
and a second ``all_reduce`` (MIN) combines them. The codes and scales are those of quantizing the
whole block: division, rounding and the scale choice are elementwise once the scale is known.
FP8 with one float scale per weight (compressed-tensors' ``strategy="tensor"``, :func:`per_tensor`)
is one block the size of the weight: ``amax / 448`` in its scale dtype, no search. NVFP4
(:func:`nvfp4`) likewise: the weight's largest magnitude gives its global scale (``GlobalScaleOf``:
of ``448 * 6 / amax`` and its float32 neighbours the first that gives back the whole weight, each
holder checking its rows after a first-row test), and each holder sends its rows' e2m1 codes and
e4m3 group scales; its rows are cut only between groups of 16.

Planned once (:func:`plan_cut`): the cut region's rows of blocks (:class:`Band`), each cut among
the trainer ranks holding its values (:class:`Band.pieces`); one engine rank's bands are gathered
with its requests, so every rank knows every band and its place in the agreed vectors.
"""

from __future__ import annotations

import datetime
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .._base.regions import Box, intersect
from .._base.schema import dtype_name
from .._export import reads_of
from .._recipes import quant as Q
from .._recipes import quant_fused as QF
from .._recipes import quant_scaled as S
from .._recipes.nodes import Node, SourceIO
from .._recipes.quant_nodes import QuantizedFP8
from .._recipes.quant_scaled_nodes import GlobalScaleOf, QuantizedScaled, few_magnitudes, nvfp4_reproduced
from ..errors import RefitError
from .refit_schedule import Held, Request, maker

_NAN_BITS = 0x7FC00000  # every NaN largest magnitude as the one positive NaN: the bits' MAX keeps it


@dataclass(frozen=True)
class Band:
    """One row of blocks of engine tensor ``target`` (an FP8 weight or its scales) that the
    trainer's shards cut: ``box``, a region of the quantized values (the leading dims one index
    each, one block's rows, whole blocks' columns), cut into ``pieces`` ``(trainer rank, region)``,
    each held whole by that rank, which quantizes it."""

    target: str
    box: Box
    pieces: tuple[tuple[int, Box], ...]
    block: tuple[int, int]

    @property
    def tiles(self) -> int:
        (c0, c1) = self.box[-1]
        return Q.cdiv(c1 - c0, self.block[1])


@dataclass
class CutPlan:
    """One engine rank's bands, and where the agreed scales of its FP8 scale tensors land."""

    bands: list[Band] = field(default_factory=list)
    index: dict[tuple[str, Box], int] = field(default_factory=dict)
    writes: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (band, view of the engine scales)


def applies(node: Node) -> bool:
    """Whether a region of ``node`` cut by the trainer's shards is quantized by its holders."""
    return isinstance(node, QuantizedFP8) or whole_weight(node)


def whole_weight(node: Node) -> bool:
    """Whether ``node``'s agreed value is its whole weight's (:func:`per_tensor`, :func:`nvfp4`)."""
    return per_tensor(node) or nvfp4(node)


def nvfp4(node: Node) -> bool:
    """Whether ``node`` is a 2-D weight's NVFP4 codes, group scales or global scale, that global
    scale made from the weight itself (``GlobalScaleOf``), its rows whole groups of 16."""
    if isinstance(node, QuantizedScaled):
        if node.codec != "e2m1" or node.part not in ("values", "scales") or node.block != (1, S.NVFP4_GROUP):
            return False
        if not isinstance(node.glob, GlobalScaleOf) or node.glob.child is not node.child or node.glob.mode != node.mode:
            return False
    elif not isinstance(node, GlobalScaleOf):
        return False
    shape = node.child.shape
    return len(shape) == 2 and shape[-1] % S.NVFP4_GROUP == 0


def per_tensor(node: Node) -> bool:
    """Whether ``node`` is the values or the scale of a 2-D weight quantized to FP8 with one float
    scale for the whole weight (compressed-tensors' ``strategy="tensor"``): its holders agree on
    the weight's largest magnitude as on one block's."""
    return isinstance(node, QuantizedScaled) and node.part in ("values", "scales") and node.one_fp8_scale()


def _pieces(child: Node, box: Box, trainer: list[dict[str, Held]], dtypes: dict[str, torch.dtype], dst: int,
            groups: bool = False) -> list[tuple[int, Box]] | None:  # fmt: skip
    """``box`` of ``child`` cut (in halves along its longest dim; with ``groups``, NVFP4's: along
    rows, then along columns between groups of 16 only) until one trainer rank holds all each part
    reads (``dst`` where it does), adjacent parts of one rank joined again; ``None`` where a group
    of 16 has no one holder."""

    def holder(part: Box) -> int:
        return maker(trainer, reads_of(child, part, dtypes), dst)

    out: list[tuple[int, Box]] = []

    def cut(part: Box) -> bool:
        r = holder(part)
        if r >= 0:
            out.append((r, part))
            return True
        halves = _group_halves(part) if groups else _halves(child, part)
        return halves is not None and all(cut(h) for h in halves)

    return _joined(out, holder) if cut(box) else None


def _halves(child: Node, part: Box) -> list[Box]:
    d = max(range(len(part)), key=lambda i: part[i][1] - part[i][0])
    a, b = part[d]
    if b - a < 2:
        raise RefitError(f"an element of {child.describe()} at {list(part)} is made from values no one trainer rank holds")
    return [part[:d] + (h,) + part[d + 1 :] for h in ((a, (a + b) // 2), ((a + b) // 2, b))]


def _group_halves(part: Box) -> list[Box] | None:
    (a, b), (c, d) = part
    if b - a > 1:
        m = (a + b) // 2
        return [((a, m), (c, d)), ((m, b), (c, d))]
    m = (c + d) // 2 // S.NVFP4_GROUP * S.NVFP4_GROUP
    return [((a, b), (c, m)), ((a, b), (m, d))] if m > c else None


def can_cut(node: Node, part: Box, trainer: list[dict[str, Held]], dtypes: dict[str, torch.dtype], dst: int) -> bool:
    """Whether :func:`plan_cut` takes region ``part`` of ``node`` (NVFP4: where each group of 16
    has one holder and ``part`` cuts no group)."""
    if not nvfp4(node):
        return applies(node)
    assert isinstance(node, (QuantizedScaled, GlobalScaleOf))
    rows, cols = node.child.shape
    if isinstance(node, QuantizedScaled) and node.part == "values":
        unit = S.NVFP4_GROUP // S.PER_UNIT["e2m1"]
        if any(c % unit and c * S.PER_UNIT["e2m1"] != cols for c in part[-1]):
            return False
    return _pieces(node.child, ((0, rows), (0, cols)), trainer, dtypes, dst, groups=True) is not None


def _joined(out: list[tuple[int, Box]], holder: Callable[[Box], int]) -> list[tuple[int, Box]]:
    """Pieces in order (halves of one dim follow each other), adjacent ones of one rank joined again."""
    joined: list[tuple[int, Box]] = []
    for r, part in out:
        if joined and joined[-1][0] == r:
            both = _join(joined[-1][1], part)
            if both is not None and holder(both) == r:
                joined[-1] = (r, both)
                continue
        joined.append((r, part))
    return joined


def _join(a: Box, b: Box) -> Box | None:
    """The box of two boxes that touch along one dim and agree on the others, else ``None``."""
    diff = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    if len(diff) != 1 or a[diff[0]][1] != b[diff[0]][0]:
        return None
    d = diff[0]
    return a[:d] + ((a[d][0], b[d][1]),) + a[d + 1 :]


def _band(cut: CutPlan, target: str, node: Node, box: Box, trainer: list[dict[str, Held]],
          dtypes: dict[str, torch.dtype], dst: int) -> int:  # fmt: skip
    i = cut.index.get((target, box), -1)
    if i < 0:
        assert isinstance(node, (QuantizedFP8, QuantizedScaled, GlobalScaleOf))
        i = cut.index[(target, box)] = len(cut.bands)
        groups = isinstance(node, GlobalScaleOf) or nvfp4(node)
        pieces = _pieces(node.child, box, trainer, dtypes, dst, groups)
        assert pieces is not None  # can_cut()
        block = tuple(node.child.shape) if isinstance(node, GlobalScaleOf) or groups else node.block
        cut.bands.append(Band(target, box, tuple(pieces), (block[0], block[1])))
    return i


def plan_cut(target: str, node: Node, part: Box, dest: torch.Tensor, trainer: list[dict[str, Held]],
             dtypes: dict[str, torch.dtype], dst: int, cut: CutPlan, add: Callable[[Request, torch.Tensor], None]) -> None:  # fmt: skip
    """Region ``part`` of FP8 engine tensor ``target`` (into ``dest``, its view here), which no
    one trainer rank can make: its rows of blocks as bands (a per-tensor scale's weight: one band);
    for the values, one request per piece (its codes, computed by the piece's holder); for the
    scales, a write from the agreed values."""
    assert isinstance(node, (QuantizedFP8, QuantizedScaled, GlobalScaleOf)) and applies(node)
    rows, cols = node.child.shape[-2:]
    whole = ((0, rows), (0, cols))
    if isinstance(node, GlobalScaleOf) or per_tensor(node) and node.part == "scales":  # one value for the whole weight
        cut.writes.append((_band(cut, target, node, whole, trainer, dtypes, dst), dest))
        return
    if nvfp4(node):  # codes or group scales: each piece's from its holder
        i = _band(cut, target, node, whole, trainer, dtypes, dst)
        per = S.PER_UNIT["e2m1"] if node.part == "values" else S.NVFP4_GROUP
        for holder, ((a, b), (c, d)) in cut.bands[i].pieces:
            got = intersect(((a, b), (c // per, d // per)), part)
            if got is not None:
                within = tuple(slice(x - p, y - p) for (x, y), (p, _) in zip(got, part, strict=True))
                add(Request(target, target, got, dtype_name(node.dtype), -1, holder, band=i), dest[within])
        return
    assert isinstance(node, (QuantizedFP8, QuantizedScaled))
    b0, b1 = node.block
    lead = part[:-2]
    (r0, r1), (c0, c1) = part[-2:]
    if node.part == "values":
        tile_rows, tiles = range(r0 // b0, Q.cdiv(r1, b0)), (c0 // b1, Q.cdiv(c1, b1))
    else:
        tile_rows, tiles = range(r0, r1), (c0, c1)
    span = (tiles[0] * b1, min(cols, tiles[1] * b1))
    for idx in itertools.product(*(range(a, b) for a, b in lead)):
        at = tuple((i, i + 1) for i in idx)
        for t in tile_rows:
            box = at + ((t * b0, min(rows, (t + 1) * b0)), span)
            i = _band(cut, target, node, box, trainer, dtypes, dst)
            if node.part != "values":
                view = dest[tuple(i0 - p0 for i0, (p0, _) in zip(idx, lead, strict=True)) + (t - r0,)]
                cut.writes.append((i, view))
                continue
            for holder, piece in cut.bands[i].pieces:
                got = intersect(piece, part)
                if got is not None:
                    within = tuple(slice(a - p, b - p) for (a, b), (p, _) in zip(got, part, strict=True))
                    add(Request(target, target, got, "float8_e4m3fn", -1, holder, band=i), dest[within])


class CutBlocks:
    """The agreed scales of every engine rank's bands (``bands[rank]``), made by :meth:`agree`
    once per run; :meth:`codes` quantizes a piece with them, :meth:`write` lands the scales."""

    def __init__(self, bands: list[list[Band]], recipes: dict[str, Node], group: dist.ProcessGroup | None,
                 rank: int, device: torch.device, timeout: float):  # fmt: skip
        self.bands, self.recipes, self.group, self.rank = bands, recipes, group, rank
        self.device, self.timeout = device, timeout
        self.offset: dict[tuple[int, int], int] = {}
        self.mult = torch.empty(0)
        self.stored: dict[tuple[int, int], torch.Tensor] = {}

    def any(self, active: set[str]) -> bool:
        return any(b.target in active for bands in self.bands for b in bands)

    def agree(self, active: set[str], io: SourceIO, world: int) -> None:
        """Every active band's scales, agreed by their holders (every rank calls it)."""
        todo = [(r, i, b) for r, bands in enumerate(self.bands) for i, b in enumerate(bands) if b.target in active]
        self.offset, n = {}, 0
        for r, i, b in todo:
            self.offset[(r, i)] = n
            n += b.tiles
        bits = torch.zeros(n, dtype=torch.int32)
        mine: list[tuple[int, torch.Tensor, int, Node, torch.Tensor]] = []  # (first tile, blocks, tiles, node, values) held here
        for r, i, b in todo:
            node = self._node(b)
            base, b1 = b.box[-1][0], b.block[1]
            for holder, piece in b.pieces:
                if holder != self.rank:
                    continue
                c0 = piece[-1][0]
                x = node.child.read(piece, io)
                blocks = Q.tile_row_blocks(x, b1, (c0 - base) % b1)
                amax = blocks.abs().amax(dim=(-3, -1)).reshape(-1).cpu()
                at, k = self.offset[(r, i)] + (c0 - base) // b1, amax.numel()
                got = torch.where(amax.isnan(), torch.tensor(_NAN_BITS, dtype=torch.int32), amax.view(torch.int32))
                bits[at : at + k] = torch.maximum(bits[at : at + k], got)
                mine.append((at, blocks, k, node, x))
        amax = self._reduce(bits, dist.ReduceOp.MAX, world).view(torch.float32)
        mult = torch.empty(n, dtype=torch.float32)
        search = torch.zeros(n, dtype=torch.bool)
        self.stored = {}
        for r, i, b in todo:
            node, at = self._node(b), self.offset[(r, i)]
            if nvfp4(node):  # the global scale of the largest magnitude, searched below
                g = S.nvfp4_global_scale(amax[at : at + 1], _mode(node))
                self.stored[(r, i)], mult[at : at + 1], search[at] = g, g, True
                continue
            if isinstance(node, QuantizedScaled):  # compressed-tensors' per-tensor FP8: amax / 448 in its scale dtype
                a = amax[at : at + b.tiles]
                stored = torch.where(a > 0, Q.true_div(a, Q.E4M3_MAX), torch.ones_like(a)).to(node.scale_dtype)
                self.stored[(r, i)], mult[at : at + b.tiles] = stored, stored.to(torch.float32)
                continue
            assert isinstance(node, QuantizedFP8)
            self.stored[(r, i)], mult[at : at + b.tiles] = Q.fp8_scale_of(amax[at : at + b.tiles], node.scale_format)
            search[at : at + b.tiles] = node.scale_format == "float32" and node.child.dtype == torch.float32
        if bool(search.any()):  # the same on every rank: from the plan
            cands = Q.fp8_scale_candidates(mult)
            fp4 = (mult, torch.nextafter(mult, torch.zeros_like(mult)), torch.nextafter(mult, 2 * mult))
            flags = torch.ones((3, n), dtype=torch.int32)
            for at, blocks, k, held, x in mine:
                if nvfp4(held):
                    flags[:, at] &= _nvfp4_reproduced(x, [c[at : at + 1] for c in fp4], _mode(held))
                    continue
                for j, c in enumerate(cands):
                    ok = Q.fp8_reproduced(blocks, c[at : at + k].to(blocks.device).reshape(blocks.shape[:-4] + (1, k)))
                    flags[j, at : at + k] &= ok.reshape(-1).cpu().to(torch.int32)
            flags = self._reduce(flags, dist.ReduceOp.MIN, world)
            fp4_of = torch.tensor([nvfp4(self._node(b)) for _, _, b in todo for _ in range(b.tiles)], dtype=torch.bool)
            picked = [torch.where(fp4_of, a, c) for a, c in zip(fp4, cands, strict=True)]
            mult = torch.where(search, Q.pick_fp8_scale((picked[0], picked[1], picked[2]), [f.bool() for f in flags]), mult)
            for r, i, b in todo:
                at = self.offset[(r, i)]
                if bool(search[at]):
                    self.stored[(r, i)] = mult[at : at + b.tiles]
        self.mult = mult

    def _node(self, band: Band) -> QuantizedFP8 | QuantizedScaled | GlobalScaleOf:
        node = self.recipes[band.target]
        assert isinstance(node, (QuantizedFP8, QuantizedScaled, GlobalScaleOf))
        return node

    def _reduce(self, t: torch.Tensor, op: dist.ReduceOp.RedOpType, world: int) -> torch.Tensor:
        if world == 1 or t.numel() == 0:
            return t
        on = t.to(self.device)
        work = dist.all_reduce(on, op=op, group=self.group, async_op=True)
        assert work is not None
        if not work.wait(timeout=datetime.timedelta(seconds=self.timeout)):
            raise RefitError(f"agreeing on the scales of FP8 blocks cut by the trainer's shards took over timeout={self.timeout} s")
        return on.cpu()

    def codes(self, dst: int, band: int, box: Box, io: SourceIO) -> torch.Tensor:
        """The e4m3 codes of region ``box`` (held here) of engine rank ``dst``'s band ``band``."""
        b = self.bands[dst][band]
        node = self._node(b)
        at = self.offset[(dst, band)]
        if nvfp4(node):  # e2m1 codes (two a byte) or e4m3 group scales of these rows, under the agreed global scale
            assert isinstance(node, QuantizedScaled)
            per = S.PER_UNIT["e2m1"] if node.part == "values" else S.NVFP4_GROUP
            (a, b_), (c0, c1) = box
            x = node.child.read(((a, b_), (c0 * per, c1 * per)), io)
            glob = self.mult[at : at + 1].to(x.device)
            q, s, _ = QF.quantize_scaled(x, "e2m1", (1, S.NVFP4_GROUP), node.scale_dtype, glob=glob, mode=node.mode)
            got = q if node.part == "values" else s
            assert got is not None
            return got
        assert not isinstance(node, GlobalScaleOf)
        x = node.child.read(box, io).to(torch.float32)
        b1, (base, end) = b.block[1], b.box[-1]
        per_col = self.mult[at : at + b.tiles].repeat_interleave(b1)[: end - base]
        (c0, c1) = box[-1]
        return Q.e4m3_codes(x / per_col[c0 - base : c1 - base].to(x.device))

    def write(self, cut: CutPlan) -> None:
        """This engine rank's scales of its cut bands, from the agreed values."""
        for i, view in cut.writes:
            key = (self.rank, i)
            if key in self.offset:
                view.copy_(Q.store_scales(self.stored[key], self._node(self.bands[self.rank][i]).dtype).reshape(view.shape))


def _mode(node: Node) -> S.GlobalMode:
    return node.mode if isinstance(node, (QuantizedScaled, GlobalScaleOf)) else "divide"


def _nvfp4_reproduced(x: torch.Tensor, cands: list[torch.Tensor], mode: S.GlobalMode) -> torch.Tensor:
    """Per candidate global scale, whether the NVFP4 values of rows ``x`` under it give back ``x``
    (int32 flags, 0 for every candidate where a row's group holds more than 8 magnitudes)."""
    if not bool(few_magnitudes(x[..., :1, :])):  # any row: the first is enough to rule trainer values out
        return torch.zeros(len(cands), dtype=torch.int32)
    f = x.to(torch.float32)
    return torch.tensor([int(bool(nvfp4_reproduced(f, c.to(x.device), mode))) for c in cands], dtype=torch.int32)


__all__ = ["Band", "CutBlocks", "CutPlan", "applies", "can_cut", "nvfp4", "per_tensor", "plan_cut", "whole_weight"]
