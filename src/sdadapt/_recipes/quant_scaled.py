"""Scaled quantized formats as pure functions on tensors (no I/O, no plan): the codes of a weight
times a grid of scales, optionally less zero points and with a per-tensor second scale.

One arithmetic serves the formats other tools write:

- **compressed-tensors** (``quant_method: compressed-tensors``, written by llm-compressor):
  ``float-quantized`` / ``naive-quantized`` FP8 (``weight`` e4m3 and ``weight_scale`` per tensor,
  per output channel ``[R, 1]``, per group ``[R, C/g]`` or per block ``[ceil(R/b0), ceil(C/b1)]``)
  and ``int-quantized`` int8; ``pack-quantized`` int4 / int8 (``weight_packed`` int32 holding
  32 / num_bits values per word, element ``i`` at bits ``i * num_bits``, stored with the offset
  ``2 ** (num_bits - 1)``; zero points packed the same way along dim 0); ``nvfp4-pack-quantized``
  (``weight_packed`` uint8, two e2m1 values per byte, low nibble first; ``weight_scale`` e4m3 per
  16 values; ``weight_global_scale`` float32, which divides the scales); ``mxfp8-quantized``
  (e4m3 values, one e8m0 exponent byte per 32).
- **NVIDIA ModelOpt**: NVFP4 (``weight`` uint8 as above, ``weight_scale`` e4m3 per 16 values,
  ``weight_scale_2`` float32, which multiplies the scales) and per-tensor FP8.

The value of element ``[i, j]`` is ``(code[i, j] - zero[i // b0, j // b1]) * s[i // b0, j // b1]``
with ``s = float(scale) / global`` (compressed-tensors) or ``float(scale) * global`` (ModelOpt),
computed in float32 and rounded once to the target's dtype. That is compressed-tensors' own
``dequantize`` where its scale is float32 or the product is exact (e4m3 or int codes times a bf16
scale: a bf16 target gets the same bits as its bf16 arithmetic); a float32 target gets the exact
float32 product, not a bf16 one widened. Codes decode exactly (e4m3, e2m1 and small integers are
exact in float32), so a region computed on its own equals the same region of the whole tensor.

:func:`quantize` is the inverse (export): codes, scales and zero points in the same format and
geometry, each scale chosen per block as the format's tool chooses it, or so that values
dequantised from a release give back its bytes (see each function).
"""

from __future__ import annotations

import sys
from typing import Literal

import torch
import torch.nn.functional as F

from .quant import E4M3_MAX, FP8_DTYPE, decode_e8m0, e2m1_codes, e4m3_codes, encode_e8m0, fp4_pairs, pow2_scale_bytes, true_div

Codec = Literal["e4m3", "int8", "e2m1", "int4", "int8_packed"]
Strategy = Literal["tensor", "channel", "group", "block"]
GlobalMode = Literal["divide", "multiply"]

PER_UNIT: dict[str, int] = {"e4m3": 1, "int8": 1, "e2m1": 2, "int4": 8, "int8_packed": 4}
"""Values per stored element along the last dim."""
STORED: dict[str, torch.dtype] = {
    "e4m3": FP8_DTYPE,
    "int8": torch.int8,
    "e2m1": torch.uint8,
    "int4": torch.int32,
    "int8_packed": torch.int32,
}
"""The dtype each codec's values are stored in."""
BITS: dict[str, int] = {"e4m3": 8, "int8": 8, "e2m1": 4, "int4": 4, "int8_packed": 8}
E8M0_DTYPES = (torch.uint8, torch.float8_e8m0fnu)
FLOAT_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, FP8_DTYPE)
NVFP4_GROUP = 16
MX_GROUP = 32
E2M1_MAX = 6.0

if sys.byteorder != "little":  # pragma: no cover - the packed int32 words are read as bytes
    raise ImportError("sdadapt reads packed int32 quantized weights on little-endian hosts only")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def decode_codes(raw: torch.Tensor, codec: Codec) -> torch.Tensor:
    """Stored values ``[..., P]`` -> float32 codes ``[..., P * PER_UNIT[codec]]`` (exact)."""
    if codec in ("e4m3", "int8"):
        return raw.to(torch.float32)
    if codec == "e2m1":
        return F.embedding(raw.to(torch.int64), fp4_pairs(raw.device)).flatten(-2)  # byte -> (low, high)
    raw = torch.empty(raw.shape, dtype=raw.dtype, device=raw.device).copy_(raw) if raw.dim() and raw.stride(-1) != 1 else raw
    b = raw.contiguous().view(torch.uint8)  # little-endian words: element i at bits i * num_bits
    if codec == "int8_packed":
        return b.to(torch.float32) - 128.0
    lo, hi = (b & 0x0F).to(torch.float32), (b >> 4).to(torch.float32)
    return torch.stack([lo, hi], dim=-1).flatten(-2) - 8.0


def decode_zero_rows(raw: torch.Tensor, bits: int) -> torch.Tensor:
    """Zero points packed along dim -2 in int32 words (compressed-tensors ``pack_to_int32(...,
    packed_dim=0)``) -> float32 ``[..., words * 32 / bits, G]``."""
    codec: Codec = "int4" if bits == 4 else "int8_packed"
    return decode_codes(raw.transpose(-1, -2), codec).transpose(-1, -2)


def scale_multipliers(scale: torch.Tensor, glob: torch.Tensor | None, mode: GlobalMode) -> torch.Tensor:
    """Stored scales (any float dtype, or e8m0 exponent bytes) -> float32 multipliers, divided
    (compressed-tensors' global scale) or multiplied (ModelOpt's ``weight_scale_2``) by ``glob``."""
    s = decode_e8m0(scale) if scale.dtype in E8M0_DTYPES else scale.to(torch.float32)
    if glob is None:
        return s
    # a float32 global scale of one element divides as it is (every tensor call on a GPU load's
    # device lane lets the readers take the interpreter lock: none is made that is not needed)
    g = glob if glob.dtype == torch.float32 and glob.dim() <= s.dim() and glob.numel() == 1 else glob.to(torch.float32).reshape(())
    return s / g if mode == "divide" else s * g


def dequantize_region(
    codes: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    offset: tuple[int, int],
    zero: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``codes [..., R, C]`` (float32) whose element ``[0, 0]`` sits at ``offset`` = ``(row % b0,
    col % b1)`` of its first block; ``scale`` (float32 multipliers) and ``zero`` (float32) hold
    the grid rows/cols the region touches (or one value for the whole tensor) -> values in ``dtype``.

    The grids are broadcast, not expanded to the region's size: along a dim of one grid entry
    (a tensor's or a channel's scale), and along columns of whole groups through a ``[..., R,
    C / b1, b1]`` view; rows are gathered per row (a ``[R, nC]`` grid)."""
    rows, cols = codes.shape[-2:]
    (b0, b1), (r, c) = block, offset
    lead = tuple(codes.shape[:-2])
    ri = torch.div(torch.arange(r, r + rows, device=codes.device), b0, rounding_mode="floor")

    def by_rows(grid: torch.Tensor) -> torch.Tensor:
        grid = grid.reshape(grid.shape if grid.dim() >= 2 else (1, 1))
        return grid.index_select(-2, ri) if grid.shape[-2] > 1 else grid

    s = by_rows(scale)
    z = None if zero is None else by_rows(zero)
    grouped = s.shape[-1] > 1 or (z is not None and z.shape[-1] > 1)
    if grouped and c == 0 and cols % b1 == 0 and s.shape[-1] in (1, cols // b1):
        v = codes.reshape(lead + (rows, cols // b1, b1))
        if z is not None:
            v = v - z.unsqueeze(-1)
        return (v * s.unsqueeze(-1)).reshape(codes.shape).to(dtype)
    if grouped:
        ci = torch.div(torch.arange(c, c + cols, device=codes.device), b1, rounding_mode="floor")
        s = s.index_select(-1, ci) if s.shape[-1] > 1 else s
        z = z.index_select(-1, ci) if z is not None and z.shape[-1] > 1 else z
    v = codes if z is None else codes - z
    return (v * s).to(dtype)


_INTO_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # every e4m3, e2m1 and int8 code is exact in these


def dequantize_into(
    dest: torch.Tensor, raw: torch.Tensor, codec: Codec, scale: torch.Tensor, block: tuple[int, int], c0: int
) -> bool:
    """Dequantise stored values ``raw`` (rows ``[..., R, P]``, from column ``c0``) straight into
    ``dest`` with no float32 temporary, where the region allows it: the codes converted into
    ``dest`` (exact), then multiplied in place by ``scale`` (float32 multipliers, one per row and
    column group ``[..., R, C / b1]``, per row ``[..., R, 1]``, or one for the tensor), which
    computes in float32 and rounds once: the bits of :func:`dequantize_region`. Returns ``False``,
    touching nothing, for zero points' codecs, a dtype the codes are not exact in, column groups
    the region cuts, row blocks taller than one row, or (e2m1) half a byte or a strided ``dest``."""
    rows, cols = dest.shape[-2:]
    b1 = block[1]
    one = scale.numel() == 1
    if codec not in ("e4m3", "int8", "e2m1") or dest.dtype not in _INTO_DTYPES:
        return False
    if not one and (scale.dim() < 2 or scale.shape[-2] != rows or block[0] != 1):
        return False
    groups = 1 if one else scale.shape[-1]
    if groups > 1 and (c0 % b1 or cols != groups * b1):
        return False
    if codec == "e2m1":
        if c0 % 2 or raw.shape[-1] * 2 != cols or not dest.is_contiguous():
            return False
        idx = raw.reshape(-1).to(torch.int32)
        torch.index_select(fp4_pairs(raw.device, dest.dtype), 0, idx, out=dest.view(-1, 2))
    else:
        dest.copy_(raw)
    # a multiplier of at least one dim takes part in type promotion: the product is float32
    s = scale.reshape((1, 1)) if one else scale
    if groups > 1:
        dest.view(dest.shape[:-1] + (groups, b1)).mul_(s.unsqueeze(-1))
    else:
        dest.mul_(s)
    return True


def dequantize(
    raw: torch.Tensor,
    codec: Codec,
    scale: torch.Tensor,
    block: tuple[int, int],
    cols: int,
    dtype: torch.dtype,
    zero: torch.Tensor | None = None,
    glob: torch.Tensor | None = None,
    mode: GlobalMode = "divide",
) -> torch.Tensor:
    """Whole-tensor dequantisation (``zero`` as stored: packed along rows for packed codecs)."""
    codes = decode_codes(raw, codec)[..., :cols]
    z = None
    if zero is not None:
        z = decode_zero_rows(zero, BITS[codec])[..., : scale.shape[-2], :] if codec in ("int4", "int8_packed") else zero.float()
    return dequantize_region(codes, scale_multipliers(scale, glob, mode), block, (0, 0), z, dtype)


# --- quantizing (export) --------------------------------------------------------------------------


def _blocked(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``x [..., R, C]`` as float32 ``[..., nR, b0, nC, b1]``, zero-padded to whole blocks."""
    rows, cols = x.shape[-2:]
    b0, b1 = block
    nr, nc = cdiv(rows, b0), cdiv(cols, b1)
    w = F.pad(x.to(torch.float32), (0, nc * b1 - cols, 0, nr * b0 - rows))
    return w.reshape(tuple(x.shape[:-2]) + (nr, b0, nc, b1))


def _grid_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Per block of ``x [..., R, C]`` (zero-padded to whole blocks) the largest magnitude."""
    return _blocked(x.abs(), block).amax(dim=(-3, -1))


def _unblock(v: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """The inverse of :func:`_blocked`: ``[..., nR, b0, nC, b1]`` -> ``[..., R, C]`` of ``shape``."""
    nr, b0, nc, b1 = v.shape[-4:]
    rows, cols = shape[-2:]
    return v.reshape(tuple(v.shape[:-4]) + (nr * b0, nc * b1))[..., :rows, :cols]


def quantize_problem(codec: Codec, scale_dtype: torch.dtype, zero: bool, glob: bool) -> str | None:
    """Why values cannot be re-quantized in ``codec`` with these scales (``None``: they can)."""
    e8m0 = scale_dtype in E8M0_DTYPES
    if codec in ("e4m3", "e2m1") and zero:
        return f"{codec} has no zero points"
    if codec == "e2m1" and not glob and not e8m0:
        return "e2m1 codes need a global scale (NVFP4) or e8m0 scales (MXFP4)"
    if codec == "e2m1" and glob and e8m0:
        return "NVFP4's group scales are e4m3, not e8m0 exponents"
    if codec == "e4m3" and glob:
        return "e4m3 codes take no global scale"
    if codec in ("int8", "int4", "int8_packed") and (e8m0 or glob):
        return f"{codec} codes take float scales only"
    return None


def quantize(
    x: torch.Tensor,
    codec: Codec,
    block: tuple[int, int],
    scale_dtype: torch.dtype,
    zero: bool = False,
    glob: torch.Tensor | None = None,
    mode: GlobalMode = "divide",
    amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``x [..., R, C]`` -> (stored values ``[..., R, ceil(C / PER_UNIT)]``, scales ``[..., nR, nC]``
    in ``scale_dtype``, zero points as stored or ``None``): the inverse of :func:`dequantize`
    (see :func:`quantize_problem` for the combinations it takes). Scale choice per format:
    :func:`quantize_fp8_scaled` (FP8, float scales; ``amax``: its blocks' largest magnitudes,
    given), :func:`quantize_nvfp4`, :func:`quantize_mx` (e8m0 exponents) and :func:`quantize_int`."""
    if glob is not None and codec == "e2m1":
        packed, scales = quantize_nvfp4(x, glob, mode)
        return packed, scales, None
    if scale_dtype in E8M0_DTYPES:
        values, scales = quantize_mx(x, block, codec, scale_dtype)
        return values, scales, None
    if codec == "e4m3":
        values, scales = quantize_fp8_scaled(x, block, scale_dtype, amax)
        return values, scales, None
    codes, scales, zeros = quantize_int(x, block, BITS[codec], scale_dtype, zero)
    if zeros is not None:
        zeros = zeros.to(torch.int8) if codec == "int8" else pack_int_codes(zeros.transpose(-1, -2), codec).transpose(-1, -2).contiguous()
    return pack_int_codes(codes, codec), scales, zeros


def quantize_fp8_scaled(
    x: torch.Tensor, block: tuple[int, int], scale_dtype: torch.dtype, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., R, C]`` -> (e4m3 codes, scales ``[..., nR, nC]`` in ``scale_dtype``) with the
    scale ``amax / 448`` of each block (all-zero blocks: 1), as compressed-tensors' min-max
    observer chooses it (``amax``: given, one for all of ``x``, a part of a per-tensor weight
    under the weight's). Values dequantised from such codes give their scales back exactly
    whenever some code of the block is +-448 (the largest value of a block quantizes to 448)."""
    amax = _grid_amax(x, block) if amax is None else amax.to(torch.float32).reshape(x.shape[:-2] + (1, 1))
    stored = torch.where(amax > 0, true_div(amax, E4M3_MAX), torch.ones_like(amax)).to(scale_dtype)
    s = stored.to(torch.float32)
    codes = e4m3_codes(x.to(torch.float32) / _spread(s, x.shape, block))
    return codes, stored


def quantize_mx(x: torch.Tensor, block: tuple[int, int], codec: Codec, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., R, C]`` -> (e4m3 codes, or e2m1 codes two per byte, and one e8m0 exponent per
    block in ``scale_dtype``: ``uint8`` or ``float8_e8m0fnu``). MXFP8 takes the smallest ``2**k``
    with ``amax / 2**k <= 464`` (what still rounds to 448, as UE8M0 FP8 block scales); MXFP4 the
    OCP rule ``2 ** (floor(log2(amax)) - 2)``. Both give back the exponent and codes of values
    dequantised from compressed-tensors' MX formats, except a block whose largest e4m3 code was
    224, which comes back doubled with the exponent one lower (the same values). An all-zero
    block gets exponent 127 (scale 1)."""
    amax = _grid_amax(x, block)
    if codec == "e4m3":
        raw = pow2_scale_bytes(amax)
    else:
        _, exp = torch.frexp(amax)  # floor(log2(amax)) = exp - 1; e2m1's largest exponent is 2
        raw = encode_e8m0(torch.where(amax > 0, exp - 3, torch.zeros_like(exp)))
    y = x.to(torch.float32) / _spread(decode_e8m0(raw), x.shape, block)
    values = e4m3_codes(y) if codec == "e4m3" else _pack_e2m1(e2m1_codes(y))
    return values, raw.view(scale_dtype) if scale_dtype != torch.uint8 else raw


def nvfp4_global_scale(amax: torch.Tensor, mode: GlobalMode) -> torch.Tensor:
    """The per-tensor second scale of NVFP4 values whose largest magnitude is ``amax`` (float32),
    as each tool makes it. ``"divide"``: compressed-tensors' ``generate_gparam``, ``448 * 6 / amax``
    in torch's arithmetic for a number over a tensor (the reciprocal, then the product: not the
    quotient, which differs by a unit in the last place for about a quarter of the values), with
    ``amax`` raised to the least normal float and a NaN or infinite result taken as 1.
    ``"multiply"``: ModelOpt's ``amax / (448 * 6)``, 1 where ``amax`` is not positive."""
    if mode == "divide":
        g = (E4M3_MAX * E2M1_MAX) / amax.clamp(min=torch.finfo(torch.float32).tiny)
        return torch.nan_to_num(g, nan=1.0, posinf=1.0, neginf=1.0)
    return torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX * E2M1_MAX), torch.ones_like(amax))


def quantize_nvfp4(
    x: torch.Tensor, glob: torch.Tensor, mode: GlobalMode
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., R, C]`` -> (packed e2m1 ``uint8 [..., R, C/2]``, e4m3 scales ``[..., R, C/16]``)
    under the stored per-tensor ``glob``: each group's scale is ``amax / 6`` expressed against the
    global scale, in each tool's float32 arithmetic (compressed-tensors: ``glob * (amax / 6)``;
    ModelOpt: ``amax / (6 * glob)``), and rounded to e4m3; the codes round half to even, keeping
    the sign of -0.0."""
    amax = _grid_amax(x, (1, NVFP4_GROUP))
    g = glob.to(torch.float32).reshape(())
    want = g * true_div(amax, E2M1_MAX) if mode == "divide" else amax / (E2M1_MAX * g)
    stored = e4m3_codes(want)  # want >= 0 or NaN (0 / 0)
    s = scale_multipliers(stored, glob, mode)
    s = torch.where(s > 0, s, torch.ones_like(s))
    return _pack_e2m1(e2m1_codes(x.to(torch.float32) / _spread(s, x.shape, (1, NVFP4_GROUP)))), stored


def quantize_int(
    x: torch.Tensor, block: tuple[int, int], bits: int, scale_dtype: torch.dtype, zero: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``x [..., R, C]`` -> (integer codes ``[..., R, C]`` in ``[-2**(bits-1), 2**(bits-1) - 1]``
    as int32, scales ``[..., nR, nC]`` in ``scale_dtype``, integer zero points ``[..., nR, nC]`` or
    ``None``), the value of a code being ``(code - zero) * scale`` computed in float32.

    Per block, a few candidate (scale, zero point) pairs are tried, each scale with its two
    neighbours in ``scale_dtype`` (values rounded to a bf16 model's dtype give a scale back only to
    one unit in its last place). Symmetric: the largest magnitude over ``2**(bits-1) - 1`` or over
    ``2**(bits-1)`` (the block's largest code, positive or negative), then compressed-tensors' own
    ``amax / (2**(bits-1) - 0.5)``. Asymmetric, over the range ``lo <= 0 <= hi``: ``(hi - lo) /
    (2**bits - 1)`` (compressed-tensors' choice) or ``/ (2**bits - 2)``, each with the zero point
    ``round(-2**(bits-1) - lo / scale)`` that puts the lowest value on the lowest code, or one
    above. The first pair whose values ``(code - zero) * scale``, rounded to ``x``'s dtype, are
    ``x`` is taken: values dequantised from a release give back its codes, scales and zero
    points. Where none is (values that never were so quantized), the pair closest to ``x``
    (largest absolute error; the first on ties)."""
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    xb = _blocked(x, block)  # [..., nR, b0, nC, b1]
    grid = xb.shape[:-3] + xb.shape[-2:-1]  # [..., nR, nC]
    flat = xb.transpose(-3, -2).reshape(-1, block[0] * block[1])  # one row per block
    lo, hi = flat.amin(-1).clamp(max=0), flat.amax(-1).clamp(min=0)
    cands: list[tuple[torch.Tensor, torch.Tensor | None]] = []  # (stored scale, zero) per block
    if zero:
        for span in (qmax - qmin, qmax - qmin - 1):
            for stored in _neighbours(_stored_scale(true_div(hi - lo, span), scale_dtype)):
                z0 = torch.round(qmin - lo / stored.to(torch.float32))
                cands += [(stored, (z0 + dz).clamp(qmin, qmax)) for dz in (0, 1)]
    else:
        amax = torch.maximum(-lo, hi)
        cands = [(s, None) for n in (qmax, qmax + 1) for s in _neighbours(_stored_scale(true_div(amax, n), scale_dtype))]
        cands.append((_stored_scale(true_div(amax, qmax + 0.5), scale_dtype), None))
    best_s, best_z = cands[0][0].clone(), None if cands[0][1] is None else cands[0][1].clone()
    best_q = torch.empty_like(flat)
    score = torch.full_like(lo, float("inf"))
    todo = torch.arange(flat.shape[0], device=flat.device)  # blocks no candidate has reproduced yet
    for stored, z in cands:
        if todo.numel() == 0:
            break
        xs, s = flat[todo], stored[todo].to(torch.float32).unsqueeze(-1)
        zs = None if z is None else z[todo].unsqueeze(-1)
        q = torch.round(xs / s if zs is None else xs / s + zs).clamp(qmin, qmax)
        back = (q if zs is None else q - zs) * s
        exact = (back.to(x.dtype).to(torch.float32) == xs).all(-1)
        new = torch.where(exact, -1.0, (back - xs).abs().amax(-1))  # exact first, then the closest
        take = new < score[todo]
        idx = todo[take]
        best_s[idx], best_q[idx], score[idx] = stored[idx], q[take], new[take]
        if best_z is not None and z is not None:
            best_z[idx] = z[idx]
        todo = todo[~exact]
    q = best_q.reshape(grid + block).transpose(-3, -2)  # back to [..., nR, b0, nC, b1]
    return _unblock(q, x.shape).to(torch.int32), best_s.reshape(grid), None if best_z is None else best_z.reshape(grid).to(torch.int32)


def _neighbours(s: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``s`` and, in a dtype with them, its two neighbours: values rounded to a narrow dtype (a
    bf16 model's) give back a scale only to one unit in its last place."""
    if s.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return (s,)
    return (s, torch.nextafter(s, torch.zeros_like(s)), torch.nextafter(s, torch.full_like(s, float("inf"))))


def _stored_scale(s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Scales in their storage ``dtype``; 1 where a block is all zero (or its scale underflows)."""
    stored = s.to(dtype)
    return torch.where(stored.to(torch.float32) > 0, stored, torch.ones_like(stored))


def pack_int_codes(q: torch.Tensor, codec: Codec) -> torch.Tensor:
    """Integer codes ``[..., C]`` -> stored values: ``int8`` as is; ``int4`` / ``int8_packed``
    offset by ``2 ** (bits - 1)`` and packed into little-endian int32 words along the last dim
    (element ``i`` at bits ``i * bits``, the last word padded with zero bits), as
    compressed-tensors' ``pack_to_int32`` writes them."""
    if codec == "int8":
        return q.to(torch.int8)
    bits, unit = BITS[codec], PER_UNIT[codec]
    u = F.pad((q + (1 << (bits - 1))).to(torch.int32), (0, -q.shape[-1] % unit)).to(torch.uint8)
    if bits == 4:
        u = u[..., 0::2] | (u[..., 1::2] << 4)
    return u.reshape(-1).view(torch.int32).reshape(tuple(u.shape[:-1]) + (u.shape[-1] // 4,))  # flat: any strides of size-1 dims


def _pack_e2m1(code: torch.Tensor) -> torch.Tensor:
    """e2m1 codes ``[..., C]`` -> bytes ``[..., ceil(C / 2)]``, low nibble first."""
    code = F.pad(code, (0, code.shape[-1] % 2))
    return code[..., 0::2] | (code[..., 1::2] << 4)


def _spread(s: torch.Tensor, shape: torch.Size | tuple[int, ...], block: tuple[int, int]) -> torch.Tensor:
    rows, cols = shape[-2:]
    return s.repeat_interleave(block[0], dim=-2)[..., :rows, :].repeat_interleave(block[1], dim=-1)[..., :cols]
