"""Quantized weight formats as pure functions on tensors (no I/O, no plan).

- **FP8 block scaling** (DeepSeek-V3/R1, Kimi-K2, Qwen3-FP8): a ``float8_e4m3fn`` weight
  ``[..., R, C]`` and a scale ``scale_inv`` of shape ``[..., ceil(R / b0), ceil(C / b1)]``;
  value ``[i, j] = float(w[i, j]) * scale_inv[i // b0, j // b1]``. The scale is stored as
  ``float32`` (``scale_format="float32"``) or, for power-of-two scales (UE8M0, DeepSeek-V3.1+),
  as one biased exponent byte per block (``scale_format="ue8m0"``: ``uint8`` or
  ``float8_e8m0fnu``, value ``2 ** (byte - 127)``). DeepSeek-V3.1 stores its power-of-two
  scales as float32 ``2.0 ** k`` (``scale_format="ue8m0_float32"``): read as float32, chosen
  on export as UE8M0 ones are.
- **MXFP4** (GPT-OSS, OCP microscaling): ``blocks`` ``uint8 [..., G, 16]`` hold 32 e2m1 values
  per block, two per byte, the low nibble first (element ``2k`` is ``byte[k] & 0xF``, element
  ``2k + 1`` is ``byte[k] >> 4``, as transformers' ``integrations/mxfp4.py`` unpacks them);
  ``scales`` ``uint8 [..., G]`` are e8m0 exponents (bias 127). The values are
  ``[..., G * 32]``: the packed dim is the last one (the projection's input dim).

Dequantising multiplies in float32 and then casts to the target dtype, element by element, so a
region computed on its own equals the same region of the whole tensor bit for bit, and the
dequantising functions give the same bits on any device (they allocate on their inputs' device).

Quantising is the inverse used for export. Its scale choice makes quantise(dequantise(q)) give
back ``q`` and the scale whenever the dequantised values are exact in the dtype they were held
in: FP8 float32 scales are ``amax / 448`` (or the float32 neighbour of it that reproduces the
block's float32 values exactly, when one does); UE8M0 scales (either storage) are the smallest
power of two ``2**k`` with ``amax / 2**k <= 464`` (what still rounds to e4m3's largest value,
448), so a block whose largest code was 224 or less comes back with its codes doubled and ``k``
one lower (the same values; see docs/quantized.md); MXFP4 scales
follow the OCP rule ``2 ** (floor(log2(amax)) - 2)``. An all-zero block gets scale 1.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

ScaleFormat = Literal["float32", "ue8m0", "ue8m0_float32"]

FP8_SCALE_SUFFIX = "_scale_inv"  # key of a weight's FP8 scale = weight key + this
MX_BLOCKS_SUFFIX, MX_SCALES_SUFFIX = "_blocks", "_scales"  # MXFP4 <name>_blocks + <name>_scales
FP8_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0
MX_BLOCK = 32  # values per MXFP4 block
MX_BYTES = MX_BLOCK // 2  # bytes per MXFP4 block
SCALE_DTYPES: dict[str, tuple[torch.dtype, ...]] = {
    "float32": (torch.float32,),
    "ue8m0": (torch.uint8, torch.float8_e8m0fnu),
    "ue8m0_float32": (torch.float32,),
}
"""The dtypes each scale format may be stored in; the first is what export writes unless told."""
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# e2m1 magnitudes 0..7 and the midpoints between neighbours; a value on a midpoint rounds to the
# even code (IEEE round-half-to-even), so it moves up only past midpoints after an odd code.
_FP4_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def true_div(a: torch.Tensor, b: float) -> torch.Tensor:
    """``a / b`` rounded once, as IEEE division, on every device: torch's CUDA kernels multiply by
    the reciprocal of a divisor given as a Python number (another rounding than the CPU's
    division and compressed-tensors' reference), never of a tensor."""
    return a / torch.full_like(a, b)


# --- scales ---------------------------------------------------------------------------------------


def decode_e8m0(raw: torch.Tensor) -> torch.Tensor:
    """Biased exponent bytes (``uint8`` or ``float8_e8m0fnu``) -> float32 ``2 ** (byte - 127)``
    (byte 255 is NaN)."""
    if raw.dtype == torch.uint8:
        raw = raw.view(torch.float8_e8m0fnu)
    return raw.to(torch.float32)


def encode_e8m0(exponent: torch.Tensor) -> torch.Tensor:
    """Integer exponents ``k`` -> ``uint8`` bytes ``k + 127``, clamped to the finite range."""
    return (exponent + 127).clamp(0, 254).to(torch.uint8)


def scale_values(raw: torch.Tensor, fmt: ScaleFormat) -> torch.Tensor:
    """Stored FP8 scales -> float32 multipliers."""
    if fmt == "ue8m0":
        return decode_e8m0(raw)
    return raw if raw.dtype == torch.float32 else raw.to(torch.float32)


def store_scales(stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Scales as :func:`quantize_fp8` gives them, in the storage ``dtype`` (one of the format's
    :data:`SCALE_DTYPES`): UE8M0 exponent bytes become ``float8_e8m0fnu`` by reinterpretation."""
    if stored.dtype == dtype:
        return stored
    if stored.dtype == torch.uint8 and dtype == torch.float8_e8m0fnu:
        return stored.view(dtype)
    raise ValueError(f"FP8 scales of dtype {stored.dtype} cannot be stored as {dtype}")


def fp8_scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale grid of an FP8 weight of ``shape`` with ``block`` ``(b0, b1)`` over its last two dims."""
    return tuple(shape[:-2]) + (cdiv(shape[-2], block[0]), cdiv(shape[-1], block[1]))


# --- FP8 ------------------------------------------------------------------------------------------


def dequantize_fp8(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], fmt: ScaleFormat, dtype: torch.dtype
) -> torch.Tensor:
    """Whole-tensor dequantisation: pad to whole blocks, view ``[..., nr, b0, nc, b1]``, scale, unpad."""
    rows, cols = weight.shape[-2:]
    b0, b1 = block
    nr, nc = cdiv(rows, b0), cdiv(cols, b1)
    w = F.pad(weight.to(torch.float32), (0, nc * b1 - cols, 0, nr * b0 - rows))
    lead = tuple(weight.shape[:-2])
    v = w.reshape(lead + (nr, b0, nc, b1)) * scale_values(scale, fmt).reshape(lead + (nr, 1, nc, 1))
    return v.reshape(lead + (nr * b0, nc * b1))[..., :rows, :cols].to(dtype)


def dequantize_fp8_region(
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    offset: tuple[int, int],
    fmt: ScaleFormat,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Dequantise a region of an FP8 weight that starts ``offset`` = ``(row % b0, col % b1)``
    inside its first block; ``scale`` holds exactly the scale rows/cols the region touches.

    The region is placed in a float32 buffer aligned to those tiles and scaled through a
    ``[..., nr, b0, nc, b1]`` view, so the scales are broadcast, never expanded to the weight's size."""
    rows, cols = weight.shape[-2:]
    (b0, b1), (r, c) = block, offset
    s = scale_values(scale, fmt)
    lead, (nr, nc) = tuple(weight.shape[:-2]), tuple(s.shape[-2:])
    buf = torch.empty(lead + (nr * b0, nc * b1), dtype=torch.float32, device=weight.device)  # margin scaled, then dropped
    region = buf[..., r : r + rows, c : c + cols]
    region.copy_(weight)
    buf.view(lead + (nr, b0, nc, b1)).mul_(s.reshape(lead + (nr, 1, nc, 1)))
    return region.to(dtype)


# e4m3 values are exact in these dtypes: a product computed from them in float32 and rounded once
# to the destination is the reference's ``(float(w) * scale).to(dtype)``
_FP8_EXACT = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def dequantize_fp8_into(dest: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], fmt: ScaleFormat) -> bool:
    """Dequantise ``weight``, a region of whole blocks (``scale`` holds exactly its tiles), straight
    into ``dest`` (same shape, the target dtype), with no temporary: the weight converted into
    ``dest`` (exact), then multiplied in place in float32 and rounded once, the bits of
    :func:`dequantize_fp8`. Returns ``False``, touching nothing, where the region is not whole
    blocks or ``dest``'s dtype is not one e4m3 converts to exactly (any strides of ``dest`` take
    the block view: it only splits dims)."""
    rows, cols = weight.shape[-2:]
    b0, b1 = block
    if rows % b0 or cols % b1 or dest.dtype not in _FP8_EXACT:
        return False
    lead, nr, nc = tuple(weight.shape[:-2]), rows // b0, cols // b1
    out = dest.view(lead + (nr, b0, nc, b1))
    out.copy_(weight.view(lead + (nr, b0, nc, b1)))
    out.mul_(scale_values(scale, fmt).view(lead + (nr, 1, nc, 1)))  # in float32 (the scale's), rounded once
    return True


def _fp8_blocks(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``x`` as float32 ``[..., nr, b0, nc, b1]`` (zero-padded), and the original shape."""
    rows, cols = x.shape[-2:]
    b0, b1 = block
    nr, nc = cdiv(rows, b0), cdiv(cols, b1)
    w = F.pad(x.to(torch.float32), (0, nc * b1 - cols, 0, nr * b0 - rows))
    return w.reshape(tuple(x.shape[:-2]) + (nr, b0, nc, b1)), tuple(x.shape)


def e4m3_codes(y: torch.Tensor) -> torch.Tensor:
    """float32 values -> ``float8_e4m3fn`` codes: clamped to +-448, rounded to nearest even; every
    NaN becomes the positive NaN code ``0x7F``. (The sign of a NaN that arithmetic makes depends on
    the processor: x86 CPUs give ``inf / inf`` and ``0 / 0`` a negative one, CUDA devices a
    positive one; so the codes are the same bytes on every device.)"""
    y = y.clamp(-E4M3_MAX, E4M3_MAX)
    return torch.where(y.isnan(), y.abs(), y).to(FP8_DTYPE)


def _fp8_values(blocks: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return e4m3_codes(blocks / scale[..., :, None, :, None])


def fp8_scale_candidates(scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The float32 scales tried, in order, for a float32 block whose ``amax / 448`` is ``scale``:
    it, then its float32 neighbours below and above (values dequantised from FP8 with float32
    scales: their ``amax / 448`` can miss the original scale by one unit in the last place)."""
    return scale, torch.nextafter(scale, torch.zeros_like(scale)), torch.nextafter(scale, 2 * scale)


def fp8_reproduced(blocks: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """Per block of ``blocks [..., nr, b0, nc, b1]`` (float32), whether scale ``cand [..., nr, nc]``
    gives back its values exactly (codes times the scale)."""
    back = _fp8_values(blocks, cand).to(torch.float32) * cand[..., :, None, :, None]
    return (back == blocks).all(dim=-1).all(dim=-2)


def pick_fp8_scale(cands: tuple[torch.Tensor, ...], oks: list[torch.Tensor]) -> torch.Tensor:
    """Per block, the first candidate scale whose ``ok`` holds; the first candidate where none does."""
    chosen, found = cands[0].clone(), torch.zeros_like(cands[0], dtype=torch.bool)
    for cand, ok in zip(cands, oks, strict=True):
        ok = ok & ~found
        chosen, found = torch.where(ok, cand, chosen), found | ok
    return chosen


def _exact_fp32_scale(blocks: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per block, ``scale`` or one of its float32 neighbours (:func:`fp8_scale_candidates`), the
    first that reproduces the block's float32 values exactly; ``scale`` where none does (values
    that never were FP8)."""
    cands = fp8_scale_candidates(scale)
    return pick_fp8_scale(cands, [fp8_reproduced(blocks, c) for c in cands])


def pow2_scale_bytes(amax: torch.Tensor) -> torch.Tensor:
    """Per block, the exponent byte of the smallest ``2**k`` with ``amax / 2**k <= 464`` (byte
    127, scale 1, for an all-zero block)."""
    mant, exp = torch.frexp(amax)  # amax = mant * 2**exp, mant in [0.5, 1)
    k = torch.where(mant <= 0.90625, exp - 9, exp - 8)  # 464 = 0.90625 * 2**9
    return encode_e8m0(torch.where(amax > 0, k, torch.zeros_like(k)))


def fp8_scale_of(amax: torch.Tensor, fmt: ScaleFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks' largest magnitudes -> (stored scales, float32 multipliers): ``amax / 448`` in
    float32 (before the exact-neighbour search of float32 inputs), or the UE8M0 power of two
    (float32 ``2.0 ** k``, or its exponent byte); 1 for an all-zero block."""
    if fmt == "float32":
        stored = torch.where(amax > 0, true_div(amax, E4M3_MAX), torch.ones_like(amax))
        return stored, stored
    raw = pow2_scale_bytes(amax)
    mult = decode_e8m0(raw)
    return (mult if fmt == "ue8m0_float32" else raw), mult  # float32 2**k, or its exponent byte


def quantize_fp8(x: torch.Tensor, block: tuple[int, int], fmt: ScaleFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., R, C]`` -> (``float8_e4m3fn`` weight, stored scale) with ``block`` scale tiles;
    the scale is float32 (``"float32"``, ``"ue8m0_float32"``: ``2.0 ** k``) or ``uint8`` exponent
    bytes (``"ue8m0"``; :func:`store_scales` gives ``float8_e8m0fnu``)."""
    blocks, shape = _fp8_blocks(x, block)
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., nr, nc]
    stored, mult = fp8_scale_of(amax, fmt)
    if fmt == "float32" and x.dtype == torch.float32:
        stored = mult = _exact_fp32_scale(blocks, stored)
    q = _fp8_values(blocks, mult)
    rows, cols = shape[-2:]
    q = q.reshape(shape[:-2] + (blocks.shape[-4] * block[0], blocks.shape[-2] * block[1]))[..., :rows, :cols]
    return q, stored


def tile_row_blocks(x: torch.Tensor, b1: int, skip: int) -> torch.Tensor:
    """Rows of one row of FP8 blocks, ``x [..., rows, cols]`` starting ``skip`` columns into its
    first block of width ``b1``, as float32 ``[..., 1, rows, nt, b1]`` (zero-padded to whole
    blocks): what :func:`fp8_reproduced` and a largest magnitude per block take. A holder of
    part of a block computes its part's; the padding decides nothing (a zero raises no largest
    magnitude, and fails a candidate scale only where a value of the block fails it too: an
    infinite or zero scale)."""
    rows, cols = x.shape[-2:]
    nt = cdiv(skip + cols, b1)
    w = F.pad(x.to(torch.float32), (skip, nt * b1 - skip - cols))
    return w.reshape(tuple(x.shape[:-2]) + (1, rows, nt, b1))


# --- MXFP4 ----------------------------------------------------------------------------------------


_FP4_PAIRS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def e2m1_pair_table(device: torch.device) -> torch.Tensor:
    """``[256, 2]`` float32, computed with ops on ``device``: byte -> the e2m1 values of its low
    and high nibble (code 8 is -0.0)."""
    code = torch.arange(16, dtype=torch.int32, device=device)
    e, m = (code >> 1) & 3, (code & 1).to(torch.float32)
    mag = torch.where(e == 0, m * 0.5, (m + 2.0) * torch.exp2((e - 2).to(torch.float32)))
    lut = torch.where((code & 8) != 0, -mag, mag)
    return torch.stack([lut.repeat(16), lut.repeat_interleave(16)], dim=-1).contiguous()  # byte & 0xF, byte >> 4


def fp4_pairs(device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`e2m1_pair_table` in ``dtype`` (one e2m1 values convert to exactly) on ``device``.

    Made once per device and dtype, then kept: computed on the host and copied to the device in
    one copy. (Computed with device ops instead, each of the dozen kernels that takes is loaded
    into the device on its first launch in the process, which costs far more than the copy; a
    copy from the host does wait for the work queued on the current stream, once.)"""
    pairs = _FP4_PAIRS.get((device, dtype))
    if pairs is not None:
        return pairs
    with torch.inference_mode(False), torch.no_grad():
        pairs = e2m1_pair_table(torch.device("cpu")).to(dtype).to(device)
        if pairs.device.type == "cuda":  # later use may be on another stream: the table must be there
            torch.cuda.current_stream(pairs.device).synchronize()
    _FP4_PAIRS[(device, dtype)] = pairs
    return pairs


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``blocks [..., G, 16]`` + ``scales [..., G]`` -> values ``[..., G * 32]`` in ``dtype``.

    One table lookup per byte (byte -> its low-nibble and high-nibble values, in that order)."""
    v = F.embedding(blocks.to(torch.int64), fp4_pairs(blocks.device)).reshape(tuple(blocks.shape[:-1]) + (MX_BLOCK,))
    v.mul_(decode_e8m0(scales).unsqueeze(-1))
    return v.reshape(tuple(blocks.shape[:-2]) + (blocks.shape[-2] * MX_BLOCK,)).to(dtype)


def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """Round float32 values to e2m1 codes (``uint8`` 0..15, sign in bit 3), saturating at +-6; a
    NaN (e2m1 has none) gives code 0 whatever its sign (which depends on the processor)."""
    a = y.abs()
    code = torch.zeros_like(y, dtype=torch.uint8)
    for c, m in enumerate(_FP4_MIDPOINTS):
        code += (a > m) if c % 2 == 0 else (a >= m)
    return code | ((torch.signbit(y) & ~a.isnan()).to(torch.uint8) << 3)


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., C]`` (``C`` a multiple of 32) -> (``blocks uint8 [..., C/32, 16]``, ``scales uint8 [..., C/32]``)."""
    lead, cols = tuple(x.shape[:-1]), x.shape[-1]
    xb = x.to(torch.float32).reshape(lead + (cols // MX_BLOCK, MX_BLOCK))
    amax = xb.abs().amax(dim=-1)
    _, exp = torch.frexp(amax)  # floor(log2(amax)) = exp - 1; e2m1's largest exponent is 2
    scales = encode_e8m0(torch.where(amax > 0, exp - 3, torch.zeros_like(exp)))
    code = e2m1_codes(xb / decode_e8m0(scales).unsqueeze(-1))
    return code[..., 0::2] | (code[..., 1::2] << 4), scales
