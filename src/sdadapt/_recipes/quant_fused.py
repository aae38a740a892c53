"""Quantization that reads each block once where it gives the eager bits, the eager functions elsewhere.

:func:`quantize_fp8` and :func:`quantize_scaled` return exactly what
:func:`sdadapt._recipes.quant.quantize_fp8` and :func:`sdadapt._recipes.quant_scaled.quantize`
return. On a CUDA device (compute capability 8.9 or later, Triton installed) the formats that
:mod:`sdadapt._recipes.quant_kernels` implements run there in one pass over each block: FP8 with
float32 block scales (the exact-neighbour search of float32 inputs included), UE8M0 FP8, MXFP8,
compressed-tensors FP8 per tensor, channel, group or block, and NVFP4. Before a kernel variant is
first used on a device it runs beside the eager function on a sample holding the cases that
differ most easily (all-zero blocks, values dequantised from FP8, subnormals, NaN and infinity,
partial blocks), against the eager function on the CPU (the reference, whose arithmetic is
compressed-tensors'); where any byte differs, or the kernel fails to build, that variant is never
used in the process and the eager function serves (logged once). Everything else (CPU tensors,
integer and MXFP4 codes, zero points) goes to the eager functions.

``SDADAPT_QUANT_KERNELS=0`` turns the kernels off (the eager functions everywhere).

``values=False`` asks for the scales alone: the kernel then writes no codes (the scale of a
float32 block still needs its codes, computed and dropped).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
from collections.abc import Callable, Iterator

import torch

from . import quant as Q
from . import quant_scaled as S
from .quant_kernels import MODE_FP8, MODE_NVFP4, MODE_POW2, MODE_SCALED, SDT_CODES, build

log = logging.getLogger(__name__)

_TILE = 8192  # elements per program for small blocks (several blocks a program)
_checked: dict[tuple[object, ...], bool] = {}
_lock = threading.Lock()


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _device_ok(x: torch.Tensor) -> bool:
    if os.environ.get("SDADAPT_QUANT_KERNELS", "1") == "0":
        return False
    if x.device.type != "cuda" or x.dim() < 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    return torch.cuda.get_device_capability(x.device) >= (8, 9) and build() is not None


def _geometry(block: tuple[int, int], search: bool) -> tuple[int, int] | None:
    """Blocks per program ``(GR, GC)``: one block where the search needs it, else about :data:`_TILE` elements."""
    b0, b1 = block
    if not (_pow2(b0) and _pow2(b1)) or b0 * b1 > 16384:
        return None
    if search:
        return (1, 1)
    gc = max(1, 128 // b1)
    return max(1, _TILE // (b0 * b1 * gc)), gc


def _as3(x: torch.Tensor) -> torch.Tensor:
    return x.reshape((-1,) + tuple(x.shape[-2:])) if x.dim() != 3 else x


def writable(t: torch.Tensor, dtype: torch.dtype = Q.FP8_DTYPE) -> bool:
    """Whether the kernels write their codes straight into ``t``: a CUDA tensor of the codes'
    ``dtype`` (e4m3, or ``uint8`` for e2m1 two per byte) of 2 or 3 dims whose last dim is
    contiguous (any row stride: a view of an engine tensor)."""
    return t.device.type == "cuda" and t.dtype == dtype and t.dim() in (2, 3) and (t.stride(-1) == 1 or t.shape[-1] == 1)


def _into(out: torch.Tensor | None, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    """``out`` where the kernels can write codes of ``shape`` there, else ``None``."""
    if out is None or tuple(out.shape) != shape or out.device != device or not writable(out, dtype):
        return None
    return out


def _launch(
    x: torch.Tensor, block: tuple[int, int], mode: int, *, search: bool = False, sdt: int = 0, mult: bool = False,
    glob: torch.Tensor | None = None, values: bool = True, scale_dtype: torch.dtype = torch.float32, packed: bool = False,
    out: torch.Tensor | None = None, scales_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Run the block kernel: (codes as stored, or ``None`` without ``values``: into ``out`` where
    given, one :func:`writable` of the codes' shape; scales in ``scale_dtype``, into
    ``scales_out`` where it is one of theirs)."""
    kernels = build()
    assert kernels is not None
    blocks_kernel = kernels[0]
    geo = _geometry(block, search)
    assert geo is not None
    gr, gc = geo
    b0, b1 = block
    lead, (rows, cols) = tuple(x.shape[:-2]), tuple(x.shape[-2:])
    x3 = _as3(x)
    nr, nc = Q.cdiv(rows, b0), Q.cdiv(cols, b1)
    qshape, qdtype = lead + (rows, cols // 2 if packed else cols), torch.uint8 if packed else Q.FP8_DTYPE
    q = _into(out, qshape, x.device, qdtype) if values else None
    if values and q is None:
        q = torch.empty(qshape, dtype=qdtype, device=x.device)
    s = _into(scales_out, lead + (nr, nc), x.device, scale_dtype)
    if s is None:
        s = torch.empty(lead + (nr, nc), dtype=scale_dtype, device=x.device)
    q3 = _as3(q.view(torch.uint8)) if q is not None else torch.empty((1, 1, 1), dtype=torch.uint8, device=x.device)
    s3 = _as3(s.view(torch.uint8) if scale_dtype.itemsize == 1 else s)
    g = glob if glob is not None else s3
    grid = (Q.cdiv(rows, gr * b0), Q.cdiv(cols, gc * b1), x3.shape[0])
    with torch.cuda.device(x.device):
        blocks_kernel[grid](
            x3, q3, s3, g, rows, cols, nr, nc, x3.stride(0), x3.stride(1), x3.stride(2),
            q3.stride(0), q3.stride(1), s3.stride(0), s3.stride(1),
            MODE=mode, SEARCH=search, SDT=sdt, MULT=mult, WRITE_Q=values, B0=b0, B1=b1, GR=gr, GC=gc,
            num_warps=8 if gr * b0 * gc * b1 >= 8192 else 4,
        )
    return q, s


def _sample(block: tuple[int, int], dtype: torch.dtype, device: torch.device, whole_cols: bool = False, peak: float = 0.0) -> torch.Tensor:
    """A tensor of 3 x 4 blocks (partial at the ends where the block allows) holding the cases
    the kernels could get wrong: zero blocks, values dequantised from FP8 (the float32 scale
    search finds their scale), subnormals (a block of nothing else), NaN, infinities, wide
    magnitudes (12 decades; ``peak`` > 0: scaled so that the largest finite magnitude is about
    ``peak``)."""
    b0, b1 = block
    g = torch.Generator().manual_seed(64)
    rows, cols = 3 * b0 - (1 if b0 > 2 else 0), 4 * b1 - (0 if whole_cols or b1 <= 4 else 3)
    x = torch.randn((2, rows, cols), generator=g, dtype=torch.float32)
    x *= torch.logspace(-6, 6, rows * cols, dtype=torch.float32)[torch.randperm(rows * cols, generator=g)].view(rows, cols)
    blk = (slice(0, b0), slice(0, b1))
    x[0][blk] = 0.0
    dq = torch.randn((b0, b1), generator=g) * 3.0
    q, sc = Q.quantize_fp8(dq, (b0, b1), "float32")
    x[0, b0 : 2 * b0, 0:b1] = Q.dequantize_fp8(q, sc, (b0, b1), "float32", torch.float32)
    x[0, 0:b0, b1 : 2 * b1] *= 1e-39
    x[1, 0, 0] = float("nan")
    x[1, b0 if rows > b0 else 0, b1] = float("inf")
    x[1, -1, -1] = float("-inf")
    x[1, 0:b0, 2 * b1 : 3 * b1] = torch.randint(-4, 5, (b0, b1), generator=g).float() * 0.25
    tail = x[0, 2 * b0 :, 3 * b1 :]
    tail.copy_(torch.randn(tail.shape, generator=g) * 1e-41)  # a block of subnormals only: its scale is one too
    if peak > 0 and math.isfinite(peak):
        x *= peak / float(x.abs().nan_to_num(0.0, 0.0, 0.0).amax())
    return x.to(dtype).to(device)


def _nvfp4_peak(glob: torch.Tensor, mode: S.GlobalMode) -> float:
    """The tensor amax a global scale was made from (``6 * 448 / amax`` dividing, ``amax / (6 *
    448)`` multiplying): NVFP4's sample spans the group scales that global scale gives."""
    g = float(glob.reshape(-1)[0])
    full = S.E2M1_MAX * Q.E4M3_MAX
    return g * full if mode == "multiply" else (full / g if g > 0 else 0.0)


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    a, b = a.cpu(), b.cpu()
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _checked_already(key: tuple[object, ...], device: torch.device) -> bool:
    return ((device.index if device.index is not None else torch.cuda.current_device(),) + key) in _checked


def _exact(key: tuple[object, ...], device: torch.device, fused: Callable[[torch.Tensor], tuple[torch.Tensor | None, ...]],
           eager: Callable[[torch.Tensor], tuple[torch.Tensor | None, ...]], sample: Callable[[], torch.Tensor]) -> bool:
    """Whether kernel variant ``key`` gives on ``device`` the bits of the eager function on the
    CPU (the reference: compressed-tensors' arithmetic), decided once per process."""
    full = (device.index if device.index is not None else torch.cuda.current_device(),) + key
    got = _checked.get(full)
    if got is not None:
        return got
    with _lock:
        if full in _checked:
            return _checked[full]
        try:
            x = sample()
            ok = all(_same(a, b) for a, b in zip(fused(x), eager(x.cpu()), strict=True))
            if not ok:
                log.warning("the fused quantization kernel %s differs from the eager arithmetic on %s: not used", key, device)
        except Exception as e:  # a kernel that does not build or run here: the eager function serves
            log.warning("the fused quantization kernel %s is not usable on %s (%s): not used", key, device, e)
            ok = False
        _checked[full] = ok
        return ok


class _Memo(threading.local):
    """The scales :func:`quantize_fp8` made for the codes of an input, inside :func:`scales_memo`."""

    entries: dict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor]] | None = None
    values: dict[object, torch.Tensor] | None = None  # memoized(): per-tensor values, by the node that makes them


_memo = _Memo()
_MEMO_SIZE = 8  # inputs kept (each held alive, so that no other tensor takes its memory meanwhile)


@contextlib.contextmanager
def scales_memo() -> Iterator[None]:
    """Within it (on this thread), the scales of an input whose codes :func:`quantize_fp8` made
    are kept, and a later ``values=False`` call on the same input (the same memory, shape,
    strides, dtype and version counter) takes them instead of reading the input again: a refit
    computes the codes and then the scales of each weight from the same trainer region, which
    nothing changes while it runs. The last few inputs are kept, and held until used or until the
    block ends; :func:`memoized` values until it ends."""
    saved = (_memo.entries, _memo.values)
    _memo.entries, _memo.values = {}, {}
    try:
        yield
    finally:
        _memo.entries, _memo.values = saved


def memoized(key: object, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``make()``, made once per ``key`` inside :func:`scales_memo` (on this thread), else each
    time: a per-tensor value (NVFP4's global scale) that a refit's values, scales and the value
    itself each read, from trainer weights nothing changes while it runs."""
    values = _memo.values
    if values is None:
        return make()
    got = values.get(key)
    if got is None:
        got = values[key] = make()
    return got


def memoized_already(key: object) -> bool:
    """Whether :func:`memoized` holds a value for ``key``; outside :func:`scales_memo`, ``True``
    (nothing is kept there: nothing to make ahead)."""
    values = _memo.values
    return values is None or key in values


def _memo_key(x: torch.Tensor, block: tuple[int, int], fmt: object) -> tuple[object, ...] | None:
    try:
        version = x._version
    except RuntimeError:  # an inference tensor has no version counter: never kept
        return None
    return (x.data_ptr(), x.device, x.dtype, tuple(x.shape), x.stride(), version, block, fmt)


def quantize_fp8(
    x: torch.Tensor, block: tuple[int, int], fmt: Q.ScaleFormat, *, values: bool = True, out: torch.Tensor | None = None,
    scales_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """:func:`sdadapt._recipes.quant.quantize_fp8`, in one pass where that is exact (the codes
    ``None`` with ``values=False`` on that path; written into ``out`` where the kernel serves and
    ``out`` is :func:`writable`, of ``x``'s shape: the codes returned are then ``out``; the
    scales likewise into ``scales_out``, of the scales' shape and stored dtype)."""
    entries = _memo.entries
    key = _memo_key(x, block, fmt) if entries is not None else None
    if entries is not None and key is not None and not values:
        hit = entries.pop(key, None)
        if hit is not None:
            return None, hit[1]
    q, s = _quantize_fp8(x, block, fmt, values, out, scales_out)
    if entries is not None and key is not None and values:
        if len(entries) >= _MEMO_SIZE:
            entries.pop(next(iter(entries)))
        entries[key] = (x, s)
    return q, s


def _quantize_fp8(
    x: torch.Tensor, block: tuple[int, int], fmt: Q.ScaleFormat, values: bool, out: torch.Tensor | None,
    scales_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    search = fmt == "float32" and x.dtype == torch.float32
    if not _device_ok(x) or _geometry(block, search) is None:
        return Q.quantize_fp8(x, block, fmt)
    mode = MODE_FP8 if fmt == "float32" else MODE_POW2
    scale_dtype = torch.float32 if mode == MODE_FP8 else torch.uint8

    def fused(t: torch.Tensor, values: bool = True, out: torch.Tensor | None = None,
              scales_out: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:  # fmt: skip
        decode = fmt == "ue8m0_float32"  # the kernel's exponent bytes, decoded: never written in place
        q, s = _launch(t, block, mode, search=search, values=values, scale_dtype=scale_dtype, out=out,
                       scales_out=None if decode else scales_out)  # fmt: skip
        return q, (Q.decode_e8m0(s) if decode else s)

    key = ("fp8", fmt, block, x.dtype)
    if not _exact(key, x.device, fused, lambda t: Q.quantize_fp8(t, block, fmt), lambda: _sample(block, x.dtype, x.device)):
        return Q.quantize_fp8(x, block, fmt)
    return fused(x, values, out, scales_out)


def kept(key: object) -> torch.Tensor | None:
    """Inside :func:`scales_memo` (on this thread): the tensor :func:`keep` put under ``key``,
    taken (a later call finds none), else ``None``."""
    values = _memo.values
    return None if values is None else values.pop(key, None)


def keep(key: object, t: torch.Tensor) -> None:
    """Inside :func:`scales_memo` (on this thread), keep ``t`` under ``key`` for one :func:`kept`:
    the scales a node's codes pass made, for the node of its scales (the key names the input
    node and region, which nothing changes while a refit runs)."""
    if _memo.values is not None:
        _memo.values[key] = t


def quantize_scaled(
    x: torch.Tensor, codec: S.Codec, block: tuple[int, int], scale_dtype: torch.dtype, zero: bool = False,
    glob: torch.Tensor | None = None, mode: S.GlobalMode = "divide", *, values: bool = True, out: torch.Tensor | None = None,
    scales_out: torch.Tensor | None = None, amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """:func:`sdadapt._recipes.quant_scaled.quantize`, in one pass where that is exact (the codes
    ``None`` with ``values=False`` on that path; written into ``out`` where the kernel serves and
    ``out`` is :func:`writable` for them, of the codes' shape: the codes returned are then
    ``out``; the scales likewise into ``scales_out``, of their shape and dtype; ``amax``: FP8's
    one largest magnitude, given, for a part of a per-tensor weight). Inside
    :func:`scales_memo`, as :func:`quantize_fp8`: the scales of an input whose
    codes were made here are kept for a later ``values=False`` call on it."""
    entries = _memo.entries
    key = None
    if entries is not None and not zero and amax is None:
        got = _memo_key(x, block, (codec, scale_dtype, mode))
        key = None if got is None else got + ((glob.data_ptr(), glob._version) if glob is not None else None,)
    if entries is not None and key is not None and not values:
        hit = entries.pop(key, None)
        if hit is not None:
            return None, hit[1], None
    q, s, z = _quantize_scaled(x, codec, block, scale_dtype, zero, glob, mode, values, out, scales_out, amax)
    if entries is not None and key is not None and values:
        if len(entries) >= _MEMO_SIZE:
            entries.pop(next(iter(entries)))
        entries[key] = (x, s)
    return q, s, z


def _quantize_scaled(
    x: torch.Tensor, codec: S.Codec, block: tuple[int, int], scale_dtype: torch.dtype, zero: bool,
    glob: torch.Tensor | None, mode: S.GlobalMode, values: bool, out: torch.Tensor | None, scales_out: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    run = _scaled_kernel(x, codec, block, scale_dtype, zero, glob, mode)
    if run is None or amax is not None and run[1][0] != "scaled-tensor":  # a given amax: the per-tensor kernel's, or eager
        return S.quantize(x, codec, block, scale_dtype, zero, glob, mode, amax)
    fused, key, sample_block = run

    def sample_geometry(t: torch.Tensor) -> tuple[int, int]:  # the sample's block: per row and per tensor span it
        rows, cols = t.shape[-2:]
        return (1, cols) if key[0] == "scaled-rows" else (rows, cols) if key[0] == "scaled-tensor" else sample_block

    def eager(t: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        g = None if glob is None else glob.to(t.device)
        return S.quantize(t, codec, sample_geometry(t), scale_dtype, zero, g, mode)[:2]

    def fused_sample(t: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return fused(t, sample_geometry(t), True, None, None)

    whole = key[0] == "nvfp4"  # its groups are whole, its values around the global scale's amax
    peak = _nvfp4_peak(glob, mode) if whole and glob is not None and not _checked_already(key, x.device) else 0.0
    if not _exact(key, x.device, fused_sample, eager, lambda: _sample(sample_block, x.dtype, x.device, whole, peak)):
        return S.quantize(x, codec, block, scale_dtype, zero, glob, mode, amax)
    q, s = (fused if amax is None else _large_of(scale_dtype, True, amax))(x, block, values, out, scales_out)
    return q, s, None


_Out = torch.Tensor | None
_Scaled = Callable[[torch.Tensor, tuple[int, int], bool, _Out, _Out], tuple[_Out, torch.Tensor]]  # fn(x, block, values, out, scales_out)


def _scaled_kernel(
    x: torch.Tensor, codec: S.Codec, block: tuple[int, int], scale_dtype: torch.dtype, zero: bool,
    glob: torch.Tensor | None, mode: S.GlobalMode,
) -> tuple[_Scaled, tuple[object, ...], tuple[int, int]] | None:
    """The fused form of a scaled format: ``(fn(x, block, values), variant key, the sample's
    block)``, or ``None`` where it has none."""
    if zero or not _device_ok(x):
        return None
    if codec == "e2m1" and glob is not None:  # NVFP4: its own (1, 16) groups
        if mode == "multiply":  # ModelOpt's global scale: eager (the kernel's codes were not the eager ones on a GPU)
            return None
        group = (1, S.NVFP4_GROUP)
        if glob.numel() != 1 or x.shape[-1] % S.NVFP4_GROUP or glob.device != x.device:
            return None
        g = glob.reshape(1)

        def nvfp4(t: torch.Tensor, _b: tuple[int, int], values: bool, out: torch.Tensor | None,
                  so: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor]:  # fmt: skip
            return _launch(t, group, MODE_NVFP4, mult=False, glob=g, values=values, scale_dtype=Q.FP8_DTYPE, packed=True,
                           out=out, scales_out=so)  # fmt: skip

        return nvfp4, ("nvfp4", mode, x.dtype, glob.dtype), group
    if codec != "e4m3" or glob is not None:
        return None
    if scale_dtype in S.E8M0_DTYPES:  # MXFP8
        if _geometry(block, False) is None:
            return None

        def mx(t: torch.Tensor, b: tuple[int, int], values: bool, out: torch.Tensor | None,
               so: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor]:  # fmt: skip
            return _launch(t, b, MODE_POW2, values=values, scale_dtype=scale_dtype, out=out, scales_out=so)

        return mx, ("mx", block, scale_dtype, x.dtype), block
    name = str(scale_dtype).removeprefix("torch.")
    if name not in SDT_CODES:
        return None
    if _geometry(block, False) is not None:

        def small(t: torch.Tensor, b: tuple[int, int], values: bool, out: torch.Tensor | None,
                  so: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor]:  # fmt: skip
            return _launch(t, b, MODE_SCALED, sdt=SDT_CODES[name], values=values, scale_dtype=scale_dtype, out=out, scales_out=so)

        return small, ("scaled", block, scale_dtype, x.dtype), block
    rows, cols = x.shape[-2:]
    if block[0] == 1 and block[1] >= cols:  # per channel
        return _per_row(SDT_CODES[name], scale_dtype), ("scaled-rows", scale_dtype, x.dtype), (1, 4096)
    if block[0] >= rows and block[1] >= cols:  # per tensor
        return _large_of(scale_dtype, True), ("scaled-tensor", scale_dtype, x.dtype), (384, 640)
    return _large_of(scale_dtype, False), ("scaled-large", scale_dtype, x.dtype), (1, 512) if block[0] == 1 else (64, 512)


def _per_row(sdt: int, scale_dtype: torch.dtype) -> _Scaled:
    """One scale per row of the whole width: each program's rows read for the amax, then for the codes."""

    def run(t: torch.Tensor, block: tuple[int, int], values: bool, out: torch.Tensor | None,
            so: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor]:  # fmt: skip
        kernels = build()
        assert kernels is not None
        rows, cols = t.shape[-2:]
        x3 = _as3(t)
        shape = tuple(t.shape)
        q = _into(out, shape, t.device, Q.FP8_DTYPE) if values else None
        if values and q is None:
            q = torch.empty(shape, dtype=Q.FP8_DTYPE, device=t.device)
        s = _into(so, tuple(t.shape[:-1]) + (1,), t.device, scale_dtype)
        if s is None or not s.is_contiguous():  # its rows are reshaped into the kernel's view: a copy would be lost
            s = torch.empty(tuple(t.shape[:-1]) + (1,), dtype=scale_dtype, device=t.device)
        q3 = _as3(q.view(torch.uint8)) if q is not None else torch.empty((1, 1, 1), dtype=torch.uint8, device=t.device)
        s2 = (s.view(torch.uint8) if scale_dtype.itemsize == 1 else s).reshape(x3.shape[0], rows)
        tr = 4
        with torch.cuda.device(t.device):
            kernels[2][(Q.cdiv(rows, tr), x3.shape[0])](
                x3, q3, s2, rows, cols, x3.stride(0), x3.stride(1), x3.stride(2), q3.stride(0), q3.stride(1), s2.stride(0),
                SDT=sdt, WRITE_Q=values, TR=tr, TC=1024, num_warps=4,
            )
        return q, s

    return run


def _large_of(scale_dtype: torch.dtype, whole: bool, given: torch.Tensor | None = None) -> _Scaled:
    """FP8 against blocks too large for one program: the block scales as the eager function
    makes them (``whole``: one per tensor of the lead dims, its amax in one pass, or ``given``),
    then one pass dividing by them."""

    def run(t: torch.Tensor, block: tuple[int, int], values: bool, out: torch.Tensor | None,
            so: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor]:  # fmt: skip
        lead = tuple(t.shape[:-2])
        if given is not None:
            amax = given.to(torch.float32).reshape(lead + (1, 1))
        elif whole:
            low, high = torch.aminmax(t.reshape(lead + (-1,)).to(torch.float32), dim=-1)
            amax = torch.maximum(-low, high).reshape(lead + (1, 1))
        else:
            amax = S._grid_amax(t, block)
        stored = torch.where(amax > 0, Q.true_div(amax, Q.E4M3_MAX), torch.ones_like(amax)).to(scale_dtype)
        if not values:
            return None, stored
        kernels = build()
        assert kernels is not None
        s = stored.to(torch.float32).contiguous()
        rows, cols = t.shape[-2:]
        x3 = _as3(t)
        shape = tuple(t.shape)
        q = _into(out, shape, t.device, Q.FP8_DTYPE)
        if q is None:
            q = torch.empty(shape, dtype=Q.FP8_DTYPE, device=t.device)
        q3, s3 = _as3(q.view(torch.uint8)), _as3(s)
        tr, tc = 32, 256
        with torch.cuda.device(t.device):
            kernels[1][(Q.cdiv(rows, tr), Q.cdiv(cols, tc), x3.shape[0])](
                x3, q3, s3, rows, cols, block[0], block[1], s3.shape[-1], x3.stride(0), x3.stride(1), x3.stride(2),
                q3.stride(0), q3.stride(1), s3.stride(0) if s3.shape[0] > 1 else 0, SCALAR=whole, TR=tr, TC=tc, num_warps=8,
            )
        return q, stored

    return run
