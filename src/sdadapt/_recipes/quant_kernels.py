"""Block quantization in one pass over each block on a CUDA device, as Triton kernels.

Each program loads whole scale blocks once, takes their largest magnitude, chooses the scale and
writes the codes and the scales, with the arithmetic of the eager functions in
:mod:`sdadapt._recipes.quant` and :mod:`sdadapt._recipes.quant_scaled`, operation for operation:
the divisions and products are IEEE float32 ones (``div.rn.f32`` / ``mul.rn.f32``, never a
reciprocal, an approximate division or a flush of subnormals), the e4m3 casts round to nearest
even on values already clamped to +-448. Whether that gives the eager bits on a device is not
assumed: :mod:`sdadapt._recipes.quant_fused` compares both on a sample before it uses a kernel.

Triton ships with torch's CUDA builds; it is imported when a kernel is first built (the
``cuda`` extra), and the kernels are made inside :func:`build` so that importing this module
imports nothing beyond torch.
"""

from __future__ import annotations

import functools
from typing import Any

MODE_FP8 = 0  # float32 scale amax / 448 (1 for an all-zero block); SEARCH: float32 inputs' exact neighbour
MODE_POW2 = 1  # e8m0 byte of the smallest 2**k with amax / 2**k <= 464 (FP8 UE8M0, MXFP8)
MODE_SCALED = 2  # scale (amax / 448) rounded to the scale dtype SDT, codes against it (compressed-tensors FP8)
MODE_NVFP4 = 3  # e4m3 group scale against a global scale, e2m1 codes two per byte

SDT_CODES = {"float32": 0, "bfloat16": 1, "float16": 2, "float8_e4m3fn": 3}

tl: Any = None  # triton.language, once build() has imported it (the kernels' global)


@functools.cache
def build() -> tuple[Any, Any, Any] | None:
    """The kernels ``(blocks, spread, rows)``, or ``None`` where Triton is not installed."""
    try:
        import triton
        import triton.language as language
    except ImportError:
        return None
    global tl
    tl = language

    @triton.jit
    def _div(a, b):  # noqa: ANN001, ANN202
        return tl.inline_asm_elementwise("div.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1)

    @triton.jit
    def _mul(a, b):  # noqa: ANN001, ANN202
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1)

    @triton.jit
    def _e4m3(y):  # noqa: ANN001, ANN202
        """clamp(y, -448, 448) rounded to e4m3, as bytes; every NaN the positive NaN 0x7F."""
        y = tl.where(y > 448.0, 448.0, tl.where(y < -448.0, -448.0, y))
        y = tl.where(y != y, tl.abs(y), y)
        return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)

    @triton.jit
    def _f32(bits):  # noqa: ANN001, ANN202
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _bits(x):  # noqa: ANN001, ANN202
        return x.to(tl.int32, bitcast=True)

    @triton.jit
    def _pow2_byte(amax):  # noqa: ANN001, ANN202
        """:func:`sdadapt._recipes.quant.pow2_scale_bytes`: frexp(amax) = mant * 2**e; k = e - 9
        where mant <= 0.90625, else e - 8; byte k + 127 clamped to [0, 254]; 127 where amax is not
        positive (NaN too); frexp(inf) has e = 0."""
        sub = amax < 1.1754943508222875e-38
        a = tl.where(sub, _mul(amax, tl.zeros_like(amax) + 1.8446744073709552e19), amax)  # 2**64: exact
        b = _bits(a)
        e = ((b >> 23) & 0xFF) - 126 - tl.where(sub, 64, 0)
        k = tl.where((b & 0x7FFFFF) <= 6815744, e - 9, e - 8)  # mant <= 0.90625
        k = tl.where(amax == float("inf"), -8, k)
        k = tl.where(amax > 0.0, k, 0)
        return tl.minimum(tl.maximum(k + 127, 0), 254)

    @triton.jit
    def _e8m0(byte):  # noqa: ANN001, ANN202
        """2 ** (byte - 127) as float32 (byte 0: the subnormal 2**-127)."""
        return tl.where(byte == 0, _f32(tl.zeros_like(byte) + 0x400000), _f32(byte << 23))

    @triton.jit
    def _e2m1(y):  # noqa: ANN001, ANN202
        """:func:`sdadapt._recipes.quant.e2m1_codes`: thresholds as there, sign in bit 3 (none for NaN)."""
        a = tl.abs(y)
        code = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) + (a >= 1.75).to(tl.int32)
        code += (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32)
        return code | (tl.where(y != y, 0, (_bits(y) >> 31) & 1) << 3)

    @triton.jit
    def _codes_ok(x, c):  # noqa: ANN001, ANN202
        """(e4m3 bytes of x / c, 1 where every code times c gives x back)."""
        q = _e4m3(_div(x, c))
        back = _mul(q.to(tl.float8e4nv, bitcast=True).to(tl.float32), c)
        return q, tl.min((back == x).to(tl.int32))

    @triton.jit
    def _scaled_scale(amax, SDT: tl.constexpr):  # noqa: ANN001, ANN202
        """(stored scale, as stored: bf16 / f16 / e4m3 bytes / float32; its float32 value) of amax / 448."""
        v = tl.where(amax > 0.0, _div(amax, tl.zeros_like(amax) + 448.0), 1.0)
        if SDT == 0:
            st = v
            s = v
        elif SDT == 1:
            st = v.to(tl.bfloat16)
            s = st.to(tl.float32)
        elif SDT == 2:
            st = v.to(tl.float16)
            s = st.to(tl.float32)
        else:  # e4m3 scales: torch gives NaN past 464 (round to nearest would pass 448)
            st = tl.where(v > 464.0, 0x7F, _e4m3(v).to(tl.int32)).to(tl.uint8)
            s = st.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        return st, s

    @triton.jit
    def blocks(x_ptr, q_ptr, s_ptr, g_ptr, R, C, NR, NC, sxl, sxr, sxc, sql, sqr, ssl, ssr,  # noqa: ANN001, ANN202
               MODE: tl.constexpr, SEARCH: tl.constexpr, SDT: tl.constexpr, MULT: tl.constexpr, WRITE_Q: tl.constexpr,
               B0: tl.constexpr, B1: tl.constexpr, GR: tl.constexpr, GC: tl.constexpr):
        TR: tl.constexpr = GR * B0
        TC: tl.constexpr = GC * B1
        lead = tl.program_id(2).to(tl.int64)
        rows = tl.program_id(0) * TR + tl.arange(0, TR)
        cols = tl.program_id(1) * TC + tl.arange(0, TC)
        inside = (rows[:, None] < R) & (cols[None, :] < C)
        xp = x_ptr + lead * sxl + rows[:, None].to(tl.int64) * sxr + cols[None, :].to(tl.int64) * sxc
        x = tl.load(xp, mask=inside, other=0.0).to(tl.float32)
        # per block: the largest magnitude, NaN where the block holds one (torch's amax)
        a4 = tl.reshape(tl.abs(x), (GR, B0, GC, B1))
        n4 = tl.reshape((x != x).to(tl.int32), (GR, B0, GC, B1))
        amax = tl.max(tl.max(a4, axis=3), axis=1)
        amax = tl.where(tl.max(tl.max(n4, axis=3), axis=1) > 0, float("nan"), amax)  # [GR, GC]
        srow = tl.program_id(0) * GR + tl.arange(0, GR)
        scol = tl.program_id(1) * GC + tl.arange(0, GC)
        smask = (srow[:, None] < NR) & (scol[None, :] < NC)
        sp = s_ptr + lead * ssl + srow[:, None].to(tl.int64) * ssr + scol[None, :]
        if MODE == 0:
            s = tl.where(amax > 0.0, _div(amax, tl.zeros_like(amax) + 448.0), 1.0)
            if SEARCH:  # one block per program: the first of s and its two neighbours that gives x back
                s0 = tl.max(tl.max(s, axis=1), axis=0)
                am = tl.max(tl.max(amax, axis=1), axis=0)
                xs = tl.zeros_like(x)
                q, ok = _codes_ok(x, xs + s0)
                chosen = s0
                if ok == 0:
                    normal = ((s0 >= 1.1754943508222875e-38) & (s0 < float("inf"))).to(tl.int32)
                    down = tl.where(s0 == 0.0, 0.0, _f32(_bits(s0) - 1))
                    up = tl.where((s0 == 0.0) | (s0 == float("inf")), s0, _f32(_bits(s0) + 1))
                    # a candidate can give x back only if 448 times it is the block's amax (checked in full otherwise)
                    if (normal == 0) | (am == _mul(down, tl.zeros_like(down) + 448.0)):
                        qd, okd = _codes_ok(x, xs + down)
                        if okd != 0:
                            q = qd
                            chosen = down
                            ok = okd
                    if ok == 0:
                        if (normal == 0) | (am == _mul(up, tl.zeros_like(up) + 448.0)):
                            qu, oku = _codes_ok(x, xs + up)
                            if oku != 0:
                                q = qu
                                chosen = up
                s = tl.zeros_like(s) + chosen
            else:
                q = _e4m3(_div(x, tl.reshape(tl.broadcast_to(tl.reshape(s, (GR, 1, GC, 1)), (GR, B0, GC, B1)), (TR, TC))))
            tl.store(sp, s, mask=smask)
        elif MODE == 1:
            byte = _pow2_byte(amax)
            m = tl.reshape(tl.broadcast_to(tl.reshape(_e8m0(byte), (GR, 1, GC, 1)), (GR, B0, GC, B1)), (TR, TC))
            q = _e4m3(_div(x, m))
            tl.store(sp, byte.to(tl.uint8), mask=smask)
        elif MODE == 2:
            st, s = _scaled_scale(amax, SDT)
            tl.store(sp, st, mask=smask)
            q = _e4m3(_div(x, tl.reshape(tl.broadcast_to(tl.reshape(s, (GR, 1, GC, 1)), (GR, B0, GC, B1)), (TR, TC))))
        else:  # NVFP4: group scale against the global one, e2m1 codes
            g = tl.load(g_ptr).to(tl.float32)
            gs = tl.zeros_like(amax) + g
            if MULT:
                want = _div(amax, _mul(tl.zeros_like(amax) + 6.0, gs))
            else:
                want = _mul(gs, _div(amax, tl.zeros_like(amax) + 6.0))
            sb = _e4m3(tl.where(want > 448.0, 448.0, want))
            s = sb.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            if MULT:  # the multiplier: stored * global (ModelOpt), stored / global (compressed-tensors)
                s = _mul(s, gs)
            else:
                s = _div(s, gs)
            s = tl.where(s > 0.0, s, 1.0)
            tl.store(sp, sb, mask=smask)
            code = _e2m1(_div(x, tl.reshape(tl.broadcast_to(tl.reshape(s, (GR, 1, GC, 1)), (GR, B0, GC, B1)), (TR, TC))))
            lo, hi = tl.split(tl.reshape(code, (TR, TC // 2, 2)))
            pcols = tl.program_id(1) * (TC // 2) + tl.arange(0, TC // 2)
            pmask = (rows[:, None] < R) & (pcols[None, :] < (C // 2))
            qp = q_ptr + lead * sql + rows[:, None].to(tl.int64) * sqr + pcols[None, :]
            if WRITE_Q:
                tl.store(qp, (lo | (hi << 4)).to(tl.uint8), mask=pmask)
        if MODE != 3:
            if WRITE_Q:
                qp = q_ptr + lead * sql + rows[:, None].to(tl.int64) * sqr + cols[None, :]
                tl.store(qp, q, mask=inside)

    @triton.jit
    def rows(x_ptr, q_ptr, s_ptr, R, C, sxl, sxr, sxc, sql, sqr, ssl,  # noqa: ANN001, ANN202
             SDT: tl.constexpr, WRITE_Q: tl.constexpr, TR: tl.constexpr, TC: tl.constexpr):
        """One scale per row (compressed-tensors' per-channel FP8): each program's rows read twice
        (the amax, then the codes; the second read mostly from L2)."""
        lead = tl.program_id(1).to(tl.int64)
        r = tl.program_id(0) * TR + tl.arange(0, TR)
        rmask = r < R
        base = x_ptr + lead * sxl + r[:, None].to(tl.int64) * sxr
        amax = tl.zeros((TR,), dtype=tl.float32)
        nan = tl.zeros((TR,), dtype=tl.int32)
        for c0 in range(0, C, TC):
            c = c0 + tl.arange(0, TC)
            m = rmask[:, None] & (c[None, :] < C)
            x = tl.load(base + c[None, :].to(tl.int64) * sxc, mask=m, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
            nan = tl.maximum(nan, tl.max((x != x).to(tl.int32), axis=1))
        amax = tl.where(nan > 0, float("nan"), amax)
        st, s = _scaled_scale(amax, SDT)
        tl.store(s_ptr + lead * ssl + r, st, mask=rmask)
        if WRITE_Q:
            sb = tl.zeros((TR, TC), dtype=tl.float32) + s[:, None]
            for c0 in range(0, C, TC):
                c = c0 + tl.arange(0, TC)
                m = rmask[:, None] & (c[None, :] < C)
                x = tl.load(base + c[None, :].to(tl.int64) * sxc, mask=m, other=0.0).to(tl.float32)
                tl.store(q_ptr + lead * sql + r[:, None].to(tl.int64) * sqr + c[None, :], _e4m3(_div(x, sb)), mask=m)

    @triton.jit
    def spread(x_ptr, q_ptr, s_ptr, R, C, B0, B1, NC, sxl, sxr, sxc, sql, sqr, ssl,  # noqa: ANN001, ANN202
               SCALAR: tl.constexpr, TR: tl.constexpr, TC: tl.constexpr):
        """e4m3 codes of x against float32 multipliers given per block of any size (B0 x B1), or
        one per lead index (SCALAR)."""
        lead = tl.program_id(2).to(tl.int64)
        rows = tl.program_id(0) * TR + tl.arange(0, TR)
        cols = tl.program_id(1) * TC + tl.arange(0, TC)
        inside = (rows[:, None] < R) & (cols[None, :] < C)
        x = tl.load(x_ptr + lead * sxl + rows[:, None].to(tl.int64) * sxr + cols[None, :].to(tl.int64) * sxc,
                    mask=inside, other=0.0).to(tl.float32)
        if SCALAR:
            s = tl.zeros((TR, TC), dtype=tl.float32) + tl.load(s_ptr + lead * ssl)
        else:
            s = tl.load(s_ptr + lead * ssl + (rows[:, None] // B0).to(tl.int64) * NC + cols[None, :] // B1, mask=inside, other=1.0)
        q = _e4m3(_div(x, s))
        tl.store(q_ptr + lead * sql + rows[:, None].to(tl.int64) * sqr + cols[None, :], q, mask=inside)

    return blocks, spread, rows
