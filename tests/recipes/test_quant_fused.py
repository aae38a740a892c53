"""Quantization through :mod:`sdadapt._recipes.quant_fused`: on the CPU the eager functions, on a
CUDA device the one-pass kernels; both give compressed-tensors' codes and scales for the formats
it quantizes the same way (FP8 per tensor, per channel, per 128 x 128 block and NVFP4, on float32
values), and the kernels give the bytes of the eager functions on the CPU (the reference) on any
input (edge cases, views, lead dims, partial blocks) or are not chosen; on plain values also
the bytes of the eager functions run on the GPU. For float32 inputs the kernels are chosen."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import pytest
import torch

from sdadapt._recipes import quant as Q
from sdadapt._recipes import quant_fused as QF
from sdadapt._recipes import quant_scaled as S

ct_release = pytest.importorskip("support.ct_release")

CUDA = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device of compute capability 8.9 or later")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    assert a is not None and b is not None
    a, b = a.cpu(), b.cpu()
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bytes(a), _bytes(b))


def _weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((rows, cols), generator=g) * torch.logspace(-3, 1, rows).unsqueeze(1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["fp8_block", "fp8_channel", "fp8_tensor", "nvfp4"])
def test_codes_and_scales_are_compressed_tensors(name: str, device: str) -> None:
    """compressed-tensors' own quantization (its scales, its compressor) of a float32 weight with
    partial blocks, against ours on ``device``, byte for byte; FP8 blocks through both of our FP8
    functions (the block-scaled release's ``quantize_fp8`` and compressed-tensors' format)."""
    w = _weight(300, 640)
    ref = ct_release.compress(w, name, ct_release.scheme_of(name))
    x = w.to(device)
    rows, cols = w.shape
    if name == "nvfp4":
        q, s, _ = QF.quantize_scaled(x, "e2m1", (1, 16), Q.FP8_DTYPE, glob=ref["weight_global_scale"].to(device))
        assert _same(q, ref["weight_packed"].to(device)) and _same(s, ref["weight_scale"].to(device))
        return
    block = {"fp8_block": (128, 128), "fp8_channel": (1, cols), "fp8_tensor": (rows, cols)}[name]
    q, s, _ = QF.quantize_scaled(x, "e4m3", block, torch.float32)
    assert _same(q, ref["weight"].to(device))
    assert torch.equal(s.reshape(-1), ref["weight_scale"].to(device).reshape(-1))
    if name == "fp8_block":
        q2, s2 = QF.quantize_fp8(x, block, "float32")
        assert _same(q2, ref["weight"].to(device)) and torch.equal(s2, ref["weight_scale"].to(device))


def _cases(dtype: torch.dtype) -> list[torch.Tensor]:
    """Weights the kernels could get wrong: partial blocks, a strided view, lead dims, values
    dequantised from FP8 (the float32 search finds their scale), zeros, subnormals, NaN, inf."""
    g = torch.Generator().manual_seed(1)
    plain = _weight(384, 512, seed=2)
    fp8 = Q.dequantize_fp8(*Q.quantize_fp8(plain, (128, 128), "float32"), (128, 128), "float32", torch.float32)
    odd = _weight(259, 333, seed=3)
    odd[:128, :128] = 0.0
    odd[128:256, 128:256] *= 1e-39
    odd[5, 300] = float("nan")
    odd[200, 7] = float("inf")
    wide = torch.randn((3, 256, 1024), generator=g)[:, :, ::2]  # lead dim, strided columns
    return [t.to(dtype) for t in (plain, fp8, wide, torch.zeros(128, 256), odd)]


PLAIN = 4  # the first cases hold finite normal values only (and zeros)


def _fused_used(prefix: str) -> bool:
    return any(ok for key, ok in QF._checked.items() if key[1] == prefix)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", ["float32", "ue8m0", "ue8m0_float32"])
def test_fp8_block_kernel_is_the_eager_function(fmt: Q.ScaleFormat, dtype: torch.dtype) -> None:
    for i, x in enumerate(_cases(dtype)):
        for block in ((128, 128), (1, 128)):
            want = Q.quantize_fp8(x, block, fmt)
            got = QF.quantize_fp8(x.cuda(), block, fmt)
            assert got[0] is not None and _same(got[0].cpu(), want[0]) and _same(got[1].cpu(), want[1]), (i, block)
            if i < PLAIN:
                on_gpu = Q.quantize_fp8(x.cuda(), block, fmt)
                assert _same(got[0], on_gpu[0]) and _same(got[1], on_gpu[1]), (i, block)
            scales_only = QF.quantize_fp8(x.cuda(), block, fmt, values=False)
            assert _same(scales_only[1].cpu(), want[1])
    if dtype == torch.float32:
        assert _fused_used("fp8"), "the fused FP8 kernel was not chosen on this device"


SCALED = [
    ("e4m3", (128, 128), torch.float32),
    ("e4m3", (1, 128), torch.bfloat16),
    ("e4m3", (1, 32), torch.float8_e4m3fn),
    ("e4m3", (1, 32), torch.uint8),  # MXFP8
    ("e4m3", (1, 32), torch.float8_e8m0fnu),
    ("e4m3", "channel", torch.float32),
    ("e4m3", "tensor", torch.bfloat16),
]


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("codec", "block", "scale_dtype"), SCALED)
def test_scaled_kernels_are_the_eager_function(codec: S.Codec, block, scale_dtype: torch.dtype, dtype: torch.dtype) -> None:
    for i, x in enumerate(_cases(dtype)):
        b = (1, x.shape[-1]) if block == "channel" else tuple(x.shape[-2:]) if block == "tensor" else block
        want = S.quantize(x, codec, b, scale_dtype)
        got = QF.quantize_scaled(x.cuda(), codec, b, scale_dtype)
        assert got[0] is not None and _same(got[0].cpu(), want[0]) and _same(got[1].cpu(), want[1]) and got[2] is None, (i, b)
        if i < PLAIN:
            on_gpu = S.quantize(x.cuda(), codec, b, scale_dtype)
            assert _same(got[0], on_gpu[0]) and _same(got[1], on_gpu[1]), (i, b)
    kernel = {"channel": "scaled-rows", "tensor": "scaled-tensor"}.get(block) if isinstance(block, str) else None
    if dtype == torch.float32:
        assert _fused_used(kernel or ("mx" if scale_dtype in S.E8M0_DTYPES else "scaled"))


@needs_cuda
@pytest.mark.parametrize("mode", ["divide", "multiply"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_kernel_is_the_eager_function(mode: S.GlobalMode, dtype: torch.dtype) -> None:
    for i, x in enumerate(_cases(dtype)):
        if x.shape[-1] % 16:
            x = x[..., : x.shape[-1] // 16 * 16]
        amax = x.float().abs().nan_to_num(0.0, 0.0, 0.0).amax()
        glob = (448.0 * 6.0 / amax if amax > 0 else torch.ones(())) if mode == "divide" else amax / (448.0 * 6.0)
        glob = glob.reshape(1).float()
        want = S.quantize(x, "e2m1", (1, 16), Q.FP8_DTYPE, glob=glob, mode=mode)
        got = QF.quantize_scaled(x.cuda(), "e2m1", (1, 16), Q.FP8_DTYPE, glob=glob.cuda(), mode=mode)
        assert got[0] is not None and _same(got[0].cpu(), want[0]) and _same(got[1].cpu(), want[1]), i
        if i < PLAIN:
            on_gpu = S.quantize(x.cuda(), "e2m1", (1, 16), Q.FP8_DTYPE, glob=glob.cuda(), mode=mode)
            assert _same(got[0], on_gpu[0]) and _same(got[1], on_gpu[1]), i
    if mode == "multiply":  # ModelOpt's multiplying global scale takes the eager function
        assert not any(key[1:3] == ("nvfp4", "multiply") for key in QF._checked)
    elif dtype == torch.float32:
        assert _fused_used("nvfp4")


def _global_scale_reference(x: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' ``weight_global_scale`` (``448 * 6 / amax``) of ``x``, or of its float32
    neighbours the first whose NVFP4 values give back ``x`` exactly, each tried on the whole
    tensor on the CPU: what a release's global scale comes back as."""
    x = x.cpu().float()
    g = ct_release.generate_gparam(x.amin(), x.amax()).reshape(1)
    for cand in (g, torch.nextafter(g, torch.zeros_like(g)), torch.nextafter(g, 2 * g)):
        q, sc = S.quantize_nvfp4(x, cand, "divide")
        if torch.equal(S.dequantize(q, "e2m1", sc, (1, 16), x.shape[-1], torch.float32, glob=cand), x):
            return cand
    return g


@pytest.mark.parametrize("device", DEVICES)
def test_nvfp4_global_scale_is_generate_gparams(device: str) -> None:
    """The global scale of a largest magnitude, made on ``device``, is compressed-tensors'
    ``generate_gparam`` of it on the CPU bit for bit: magnitudes over 12 decades, and zero,
    subnormal, tiny, NaN, infinite and largest ones (its true quotient differs in about a quarter)."""
    g = torch.Generator().manual_seed(7)
    spread = torch.rand(600, generator=g) * 10.0 ** torch.randint(-6, 7, (600,), generator=g).float()
    edges = torch.tensor([0.0, 1e-41, 1e-38, 1e-36, 7e-36, 1.0, 448.0, float("nan"), float("inf"), 3.4e38])
    for a in torch.cat([spread, edges]):
        want = ct_release.generate_gparam(-a.reshape(1), a.reshape(1))
        assert _same(S.nvfp4_global_scale(a.reshape(1).to(device), "divide"), want), float(a)


@contextlib.contextmanager
def _waits(device: str) -> Iterator[list[str]]:
    """The host's waits for a CUDA device inside the block (torch's synchronisation warnings,
    listed as they come); on the CPU none is listed."""
    seen: list[str] = []
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            yield seen
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    seen += [str(m.message) for m in got if "synchroniz" in str(m.message)]


def _global_scale_inputs() -> list[torch.Tensor]:
    """A trainer's values (float32; bf16 whose first row's groups repeat a few magnitudes), values
    dequantised by compressed-tensors from its NVFP4 release, and values dequantised in float32
    whose amax gives back the global scale only to a unit in the last place."""
    w = _weight(300, 640, seed=4)
    coarse = w.clone()
    coarse[0] = torch.tensor([0.5, -1.0, 2.0, 0.25]).repeat(160)  # 4 magnitudes a group: the search runs
    scheme = ct_release.scheme_of("nvfp4")
    released = ct_release.decompress(ct_release.compress(w, "nvfp4", scheme), "nvfp4", scheme)
    found = 0
    for k in range(24):  # dequantised in float32 under a global scale one unit off the amax's
        glob = torch.nextafter(ct_release.generate_gparam(w.amin(), w.amax()).reshape(1) * (1 + k / 64), torch.zeros(1))
        q, sc = S.quantize_nvfp4(w, glob, "divide")
        deq = S.dequantize(q, "e2m1", sc, (1, 16), w.shape[-1], torch.float32, glob=glob)
        found += not torch.equal(_global_scale_reference(deq), ct_release.generate_gparam(deq.amin(), deq.amax()).reshape(1))
        if found:
            break
    assert found, "no case whose global scale is a neighbour of its amax's"
    return [w, coarse.to(torch.bfloat16), released, deq]


@pytest.mark.parametrize("device", DEVICES)
def test_nvfp4_global_scale_is_compressed_tensors_once_per_refit(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """NVFP4's global scale (``GlobalScaleOf``), made on ``device``, is
    :func:`_global_scale_reference`'s: for a trainer's values (float32; bf16 whose first row's
    groups repeat a few magnitudes), values dequantised by compressed-tensors from its NVFP4
    release, and values dequantised in float32 whose amax gives back the global scale only to a
    unit in the last place (the neighbour is found). Inside ``scales_memo`` (a refit's run) it is
    made once per weight however often the values, the scales and the global scale itself read
    it; on a CUDA device the host waits fewer times than there are candidates while it is made for
    a trainer's values (once: the first-row test)."""

    from support.checkpoints import DictIO

    from sdadapt._base.regions import full_box
    from sdadapt._recipes import quant_scaled_nodes as SN
    from sdadapt._recipes.nodes import Leaf

    inputs = _global_scale_inputs()
    made: list[int] = []
    of = SN.GlobalScaleOf._of_parts
    monkeypatch.setattr(SN.GlobalScaleOf, "_of_parts", lambda self, parts: made.append(1) or of(self, parts))
    for i, x in enumerate(inputs):
        want = _global_scale_reference(x)
        leaf = Leaf("x", tuple(x.shape), x.dtype)
        node = SN.GlobalScaleOf(leaf, "divide")
        io = DictIO({"x": x.to(device)})
        box = full_box(node.shape)
        got = node.read(box, io)  # lands where io says (this one names no device: the host)
        assert _same(got, want), i
        assert node._of_parts([io.tensors["x"]]).device.type == device, i  # computed where the weight is
        values = SN.QuantizedScaled(leaf, "e2m1", (1, 16), "values", Q.FP8_DTYPE, node)
        scales = SN.QuantizedScaled(leaf, "e2m1", (1, 16), "scales", Q.FP8_DTYPE, node)
        made.clear()
        with QF.scales_memo():
            with _waits(device) as seen:
                node.read(box, io)
            q = values.read(full_box(values.shape), io)
            s = scales.read(full_box(scales.shape), io)
            assert _same(node.read(box, io), want), i
        assert len(made) == 1, i
        if device == "cuda" and i == 0:
            # the first-row test's one wait expected; never one per candidate, as the search before it had
            assert len(seen) < 3, seen
        want_q, want_s, _ = S.quantize(x.float(), "e2m1", (1, 16), Q.FP8_DTYPE, glob=want)
        assert _same(q, want_q) and _same(s, want_s), i


@pytest.mark.parametrize("device", DEVICES)
def test_nvfp4_global_scales_made_together(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A refit's run makes its NVFP4 global scales ahead (``prepare_global_scales``): the same
    values as each alone, read back from the memo without making them again; on a CUDA device
    with one wait for all of them (the first-row tests of several weights read together)."""

    from support.checkpoints import DictIO

    from sdadapt._base.regions import full_box
    from sdadapt._recipes import quant_scaled_nodes as SN
    from sdadapt._recipes.nodes import Leaf

    inputs = _global_scale_inputs()
    trainer = [x.clone() for x in inputs] + [_weight(64, 128, seed=s) for s in (5, 6)]
    io = DictIO({f"x{i}": x.to(device) for i, x in enumerate(trainer)})
    nodes = [SN.GlobalScaleOf(Leaf(f"x{i}", tuple(x.shape), x.dtype), "divide") for i, x in enumerate(trainer)]
    with QF.scales_memo():
        with _waits(device) as seen:
            SN.prepare_global_scales([nodes[0], nodes[4], nodes[5]], io)  # trainer values: no search
        if device == "cuda":
            assert len(seen) == 1, seen
        SN.prepare_global_scales(nodes, io)  # the rest, the searches among them
        monkeypatch.setattr(SN.GlobalScaleOf, "_of_parts", lambda self, parts: pytest.fail("made again"))
        for x, node in zip(trainer, nodes, strict=True):
            assert _same(node.read(full_box(node.shape), io), _global_scale_reference(x))


def test_cpu_tensors_take_the_eager_functions() -> None:
    x = _weight(256, 256)
    q, s = QF.quantize_fp8(x, (128, 128), "float32", values=False)
    want = Q.quantize_fp8(x, (128, 128), "float32")
    assert q is not None and _same(q, want[0]) and _same(s, want[1])


@pytest.mark.parametrize("device", DEVICES)
def test_a_nan_code_is_the_positive_nan_on_every_device(device: str) -> None:
    """inf / inf and 0 / 0 make a negative NaN on x86 CPUs and a positive one on CUDA devices; a
    NaN input keeps its sign through a division on the CPU only. Every NaN code is 0x7F (e4m3),
    and e2m1 gives a NaN code 0, in the eager functions and the kernels alike."""
    x = torch.zeros(128, 256)
    x[0, 0] = float("inf")  # its block's scale is inf (no exact-neighbour search for bf16): inf / inf
    x[0, 128] = -torch.tensor(float("nan"))  # a negative NaN input
    x[1, 1] = 1e-6  # its block's e4m3 scale underflows to 0: 0 / 0 beside it
    x = x.to(device)
    q = QF.quantize_fp8(x.bfloat16(), (128, 128), "float32")[0]
    q2 = QF.quantize_scaled(x, "e4m3", (1, 32), torch.float8_e4m3fn)[0]
    assert q is not None and q2 is not None
    assert q.view(torch.uint8)[0, 0].item() == 0x7F and q.view(torch.uint8)[0, 128].item() == 0x7F
    assert q2.view(torch.uint8)[0, 128].item() == 0x7F
    assert q2.view(torch.uint8)[1, 0].item() == 0x7F and q2.view(torch.uint8)[1, 1].item() == 0x7E
    y = torch.tensor([float("nan"), -torch.tensor(float("nan")).item(), -1.0], device=device)
    assert Q.e2m1_codes(y).tolist() == [0, 0, 10]
    zeros = torch.zeros(4, 32, device=device)
    _, s, _ = QF.quantize_scaled(zeros, "e2m1", (1, 16), Q.FP8_DTYPE, glob=torch.zeros(1, device=device), mode="multiply")
    assert bool((s.view(torch.uint8) == 0x7F).all())  # 0 / (6 * 0)


@pytest.mark.parametrize("device", DEVICES)
def test_scales_memo_gives_the_scales_of_the_codes_pass(device: str) -> None:
    """Inside ``scales_memo`` the scales-only call on the input of a codes call returns that
    call's scales; an input changed in place since (its version moved) is quantized again."""
    x = _weight(256, 384).to(device)
    want = Q.quantize_fp8(x.cpu(), (128, 128), "float32")[1]
    with QF.scales_memo():
        q, s = QF.quantize_fp8(x, (128, 128), "float32")
        got = QF.quantize_fp8(x, (128, 128), "float32", values=False)[1]
        assert got is s and _same(got, want)
        assert QF.quantize_fp8(x, (128, 128), "float32", values=False)[1] is not s  # taken once
        QF.quantize_fp8(x, (128, 128), "float32")
        x.mul_(3.0)
        again = QF.quantize_fp8(x, (128, 128), "float32", values=False)[1]
        assert _same(again, Q.quantize_fp8(x.cpu(), (128, 128), "float32")[1]) and not _same(again, want)
    assert QF._memo.entries is None


@needs_cuda
def test_codes_written_into_a_view_of_an_engine_tensor() -> None:
    """``out=``: a view with a row stride of a larger FP8 tensor (an engine shard) receives the
    codes, bytes as the eager function's; nothing beside it is touched."""
    x = _weight(300, 256, seed=5).cuda()
    engine = torch.full((320, 512), 1.0, device="cuda").to(Q.FP8_DTYPE)
    view = engine[10:310, 128:384]
    q, s = QF.quantize_fp8(x, (128, 128), "float32", out=view)
    want = Q.quantize_fp8(x.cpu(), (128, 128), "float32")
    assert q is view and _same(view, want[0]) and _same(s, want[1])
    rest = engine.float().clone()
    rest[10:310, 128:384] = 1.0
    assert bool((rest == 1.0).all())
