"""FP8 export fidelity: power-of-two scales stored as float32, ``F8_E8M0`` scale tensors, and the
UE8M0 tile whose bytes cannot be told from its values.

Releases are written byte by byte here (JSON header + raw bytes, as the safetensors format
defines it), so neither sdadapt's writer nor the ``safetensors`` library decides what a file
holds; exports are read back the same way and compared byte for byte, dtype names included.
The values the model must hold come from the element-by-element loop of ``test_quant``.
"""

from __future__ import annotations

import json

import pytest
import torch
from support.fp8_releases import NAMES, Raw, raw, read_by_hand, ref_dequant_fp8, write_by_hand
from torch import nn

import sdadapt
from sdadapt._recipes import quant as Q
from sdadapt.errors import AdapterError
from sdadapt.sources._hf_sharded import HFShardedSource
from sdadapt.sources._safetensors_file import SafetensorsFile

BLOCK = (16, 32)
R, C = 40, 72  # 40 rows cut 16-row tiles, 72 cols cut 32-col tiles
E4M3_NAN = (0x7F, 0xFF)


# --- safetensors by hand --------------------------------------------------------------------------


# --- releases made by hand ------------------------------------------------------------------------


def random_codes(shape: tuple[int, int], g: torch.Generator, max_byte: int = 0x7E) -> torch.Tensor:
    """Random e4m3 bytes of magnitude byte at most ``max_byte`` (0x7E: 448, 0x76: 224), no NaN."""
    mag = torch.randint(0, max_byte + 1, shape, generator=g, dtype=torch.int32)
    sign = torch.randint(0, 2, shape, generator=g, dtype=torch.int32) << 7
    return (mag | sign).to(torch.uint8).view(torch.float8_e4m3fn)


def set_tile_max(codes: torch.Tensor, magnitudes: list[int], g: torch.Generator) -> torch.Tensor:
    """``codes`` with the first element of each tile set to a magnitude byte drawn from ``magnitudes``."""
    b = codes.view(torch.uint8).clone()
    tiles = b[:: BLOCK[0], :: BLOCK[1]]
    pick = torch.tensor(magnitudes, dtype=torch.uint8)[torch.randint(0, len(magnitudes), tiles.shape, generator=g)]
    b[:: BLOCK[0], :: BLOCK[1]] = pick | (tiles & 0x80)
    assert not any((b == n).any() for n in E4M3_NAN)
    return b.view(torch.float8_e4m3fn)


def exponents(shape: tuple[int, int], g: torch.Generator) -> torch.Tensor:
    """Random scale exponents ``k``, one per tile of a weight of ``shape``."""
    return torch.randint(-20, 6, (-(-shape[0] // BLOCK[0]), -(-shape[1] // BLOCK[1])), generator=g)


def float32_pow2(k: torch.Tensor) -> torch.Tensor:
    return torch.tensor([[2.0**e for e in row] for row in k.tolist()], dtype=torch.float32)


def exponent_bytes(k: torch.Tensor) -> torch.Tensor:
    return (k + 127).to(torch.uint8)


def pow2_by_hand(shape: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes, exponents ``k``): each tile's largest |code| is 240 or more (bytes
    0x77..0x7E), so its power-of-two scale is the only one that holds its values."""
    g = torch.Generator().manual_seed(seed)
    return set_tile_max(random_codes(shape, g), list(range(0x77, 0x7F)), g), exponents(shape, g)


def config(scale_fmt: str | None) -> dict:
    qc = {"quant_method": "fp8", "weight_block_size": list(BLOCK), **({"scale_fmt": scale_fmt} if scale_fmt else {})}
    return {"quantization_config": qc}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(C, R, bias=False, dtype=torch.bfloat16)  # weight [40, 72]
        self.w2 = nn.Linear(R, C, bias=False, dtype=torch.bfloat16)  # weight [72, 40]
        self.norm = nn.Parameter(torch.ones(C, dtype=torch.bfloat16))


def release_of(w1: tuple[torch.Tensor, torch.Tensor], w2: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Raw]:
    g = torch.Generator().manual_seed(99)
    return {
        "model.w1.weight": raw(w1[0]),
        "model.w1.weight_scale_inv": raw(w1[1]),
        "model.w2.weight": raw(w2[0]),
        "model.w2.weight_scale_inv": raw(w2[1]),
        "model.norm": raw(torch.randn(C, generator=g).to(torch.bfloat16)),
    }


def load_and_export(tmp_path, release: dict[str, Raw], rules: list) -> tuple[dict[str, torch.Tensor], dict[str, Raw]]:
    """Load the release into :class:`Net` with ``rules`` first, export it back; (model state, exported file)."""
    src = write_by_hand(str(tmp_path / "release.safetensors"), release)
    adapter = sdadapt.Adapter([*rules, sdadapt.rename("model.{rest:*}", "{rest}")])
    model = Net()
    sdadapt.load(model, src, adapter)
    sdadapt.export(model, str(tmp_path / "out"), adapter)
    return model.state_dict(), read_by_hand(str(tmp_path / "out" / "model.safetensors"))


def check_values(state: dict[str, torch.Tensor], w1, w2, fmt: str) -> None:
    for key, (w, s) in (("w1.weight", w1), ("w2.weight", w2)):
        want = ref_dequant_fp8(w, s, BLOCK, fmt, torch.bfloat16)
        assert torch.equal(state[key].view(torch.int16), want.view(torch.int16)), key


def schema_of(release: dict[str, Raw]) -> dict[str, sdadapt.sources.TensorInfo]:
    dtypes = {v: k for k, v in NAMES.items()}
    return {k: sdadapt.sources.TensorInfo(tuple(shape), dtypes[dt]) for k, (dt, shape, _) in release.items()}


# --- 1. power-of-two scales stored as float32 (DeepSeek-V3.1) -------------------------------------


def test_pow2_float32_scales_made_by_hand_load_and_export_the_same_bytes(tmp_path):
    (c1, k1), (c2, k2) = pow2_by_hand((R, C), seed=1), pow2_by_hand((C, R), seed=2)
    w1, w2 = (c1, float32_pow2(k1)), (c2, float32_pow2(k2))
    release = release_of(w1, w2)
    (rule,) = sdadapt.dequant_rules(config("ue8m0"), schema=schema_of(release))
    assert (rule.scale_format, rule.scale_dtype) == ("ue8m0_float32", None)
    state, exported = load_and_export(tmp_path, release, [rule])
    check_values(state, w1, w2, "ue8m0_float32")
    assert exported == release  # every dtype name, shape and byte


def test_pow2_float32_scales_made_by_quantize_fp8(tmp_path):
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(shape, generator=g) * torch.exp2(torch.randint(-8, 8, shape, generator=g).float()) for shape in ((R, C), (C, R))]
    w1, w2 = (Q.quantize_fp8(x, BLOCK, "ue8m0_float32") for x in xs)
    for x, (w, s) in zip(xs, (w1, w2), strict=True):
        wb, sb = Q.quantize_fp8(x, BLOCK, "ue8m0")  # the same choice, stored as exponent bytes
        assert s.dtype == torch.float32 and torch.equal(w.view(torch.uint8), wb.view(torch.uint8))
        assert s.tolist() == [[2.0 ** (b - 127) for b in row] for row in sb.tolist()]
    release = release_of(w1, w2)
    state, exported = load_and_export(tmp_path, release, sdadapt.dequant_rules(config("ue8m0"), schema=schema_of(release)))
    check_values(state, w1, w2, "ue8m0_float32")
    assert exported == release


def test_float32_format_loses_the_powers_of_two_on_export(tmp_path):
    """Read as plain float32 scales, the same file loads the same values but exports ``amax / 448``
    scales: why ``scale_fmt: ue8m0`` with float32 scales needs its own format."""
    (c1, k1), (c2, k2) = pow2_by_hand((R, C), seed=5), pow2_by_hand((C, R), seed=6)
    w1, w2 = (c1, float32_pow2(k1)), (c2, float32_pow2(k2))
    release = release_of(w1, w2)
    state, exported = load_and_export(tmp_path, release, [sdadapt.dequant_fp8(block=BLOCK, scale_format="float32")])
    check_values(state, w1, w2, "float32")
    assert exported["model.w1.weight_scale_inv"] != release["model.w1.weight_scale_inv"]


# --- 2. F8_E8M0 scale tensors ---------------------------------------------------------------------


def test_safetensors_sources_read_f8_e8m0(tmp_path):
    data = bytes([0, 1, 100, 126, 127, 128, 200, 254, 255, 3, 77, 129])
    path = write_by_hand(str(tmp_path / "s.safetensors"), {"a": ("F8_E8M0", [3, 4], data), "b": ("U8", [2], b"\x05\x06")})
    sf = SafetensorsFile(path)
    assert sf.schema["a"] == sdadapt.sources.TensorInfo((3, 4), torch.float8_e8m0fnu)
    got = sf.read("a", ((1, 3), (1, 4)))
    assert got.dtype == torch.float8_e8m0fnu
    assert got.view(torch.uint8).flatten().tolist() == [data[i * 4 + j] for i in (1, 2) for j in (1, 2, 3)]
    sf.close()
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "s.safetensors", "b": "s.safetensors"}}))
    with HFShardedSource(str(tmp_path)) as hf:
        assert hf.schema["a"].dtype == torch.float8_e8m0fnu
        assert bytes(hf.read("a", ((0, 3), (0, 4))).contiguous().view(torch.uint8).flatten().tolist()) == data


def e8m0_release(seed: int) -> tuple[dict[str, Raw], tuple, tuple]:
    """An FP8 release whose scales are ``F8_E8M0`` tensors (the exponent bytes ``k + 127``)."""
    (c1, k1), (c2, k2) = pow2_by_hand((R, C), seed), pow2_by_hand((C, R), seed + 1)
    w1 = (c1, exponent_bytes(k1).view(torch.float8_e8m0fnu))
    w2 = (c2, exponent_bytes(k2).view(torch.float8_e8m0fnu))
    return release_of(w1, w2), w1, w2


def test_fp8_release_with_f8_e8m0_scales_loads_and_exports_that_dtype(tmp_path):
    release, w1, w2 = e8m0_release(seed=7)
    assert release["model.w1.weight_scale_inv"][0] == "F8_E8M0"
    with sdadapt.sources.open_source(write_by_hand(str(tmp_path / "header.safetensors"), release)) as source:
        (rule,) = sdadapt.dequant_rules(config("ue8m0"), schema=source.schema)
    assert (rule.scale_format, rule.scale_dtype) == ("ue8m0", "float8_e8m0fnu")
    state, exported = load_and_export(tmp_path, release, [rule])
    check_values(state, w1, w2, "ue8m0")
    assert exported == release


def test_ue8m0_rule_without_scale_dtype_exports_uint8(tmp_path):
    """The documented default: the same exponent bytes, under the dtype name ``U8``."""
    release, w1, w2 = e8m0_release(seed=9)
    state, exported = load_and_export(tmp_path, release, [sdadapt.dequant_fp8(block=BLOCK, scale_format="ue8m0")])
    check_values(state, w1, w2, "ue8m0")
    for key, (dtype, shape, data) in release.items():
        want = ("U8", shape, data) if dtype == "F8_E8M0" else (dtype, shape, data)
        assert exported[key] == want, key


# --- 3. the UE8M0 tile whose bytes values cannot tell -----------------------------------------------


def ambiguous_pair(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes with every tile's largest |code| 224, the same codes doubled, exponents k)."""
    g = torch.Generator().manual_seed(seed)
    codes = set_tile_max(random_codes((R, C), g, max_byte=0x76), [0x76], g)
    doubled = (codes.float() * 2).to(torch.float8_e4m3fn)
    assert torch.equal(doubled.float(), codes.float() * 2)  # exact: every code <= 224 doubles in e4m3
    return codes, doubled, exponents((R, C), g)


@pytest.mark.parametrize("fmt", ["ue8m0", "ue8m0_float32"])
def test_ue8m0_largest_code_224_comes_back_doubled(fmt):
    codes, doubled, k = ambiguous_pair(seed=11)

    stored = exponent_bytes if fmt == "ue8m0" else float32_pow2
    forms = [(codes, stored(k)), (doubled, stored(k - 1))]
    values = [ref_dequant_fp8(w, s, BLOCK, fmt, torch.float32) for w, s in forms]
    assert torch.equal(values[0], values[1])  # the two byte forms hold the same values
    for v in values:
        w, s = Q.quantize_fp8(v, BLOCK, fmt)  # type: ignore[arg-type]
        assert torch.equal(w.view(torch.uint8), doubled.view(torch.uint8)) and torch.equal(s, forms[1][1])


def test_ue8m0_ambiguous_release_exports_the_doubled_form(tmp_path):
    codes, doubled, k = ambiguous_pair(seed=12)
    c2, k2 = pow2_by_hand((C, R), seed=13)
    w1, w2 = (codes, exponent_bytes(k)), (c2, exponent_bytes(k2))
    release = release_of(w1, w2)
    state, exported = load_and_export(tmp_path, release, [sdadapt.dequant_fp8(block=BLOCK, scale_format="ue8m0")])
    check_values(state, w1, w2, "ue8m0")
    assert exported["model.w1.weight"] == raw(doubled)
    assert exported["model.w1.weight_scale_inv"] == raw(exponent_bytes(k - 1))
    assert exported["model.w2.weight"] == release["model.w2.weight"]


# --- strict checks ----------------------------------------------------------------------------------


def _issues(tmp_path, release: dict[str, Raw], rule) -> str:
    src = write_by_hand(str(tmp_path / "bad.safetensors"), release)
    rep = sdadapt.diff(Net(), src, sdadapt.Adapter([rule, sdadapt.rename("model.{rest:*}", "{rest}")]))
    assert not rep.ok
    return "\n".join(f"{i.key}: {i.message}" for i in rep.rule_issues)


def test_scale_dtype_problems_name_the_setting_that_reads_them(tmp_path):
    (c1, k1), (c2, k2) = pow2_by_hand((R, C), seed=14), pow2_by_hand((C, R), seed=15)
    floats = release_of((c1, float32_pow2(k1)), (c2, float32_pow2(k2)))
    text = _issues(tmp_path, floats, sdadapt.dequant_fp8(block=BLOCK, scale_format="ue8m0"))
    assert "model.w1.weight: scale 'model.w1.weight_scale_inv' is float32, not what scale_format='ue8m0' stores " \
           "(uint8, float8_e8m0fnu); scale_format='ue8m0_float32'?" in text  # fmt: skip
    release, _, _ = e8m0_release(seed=16)
    text = _issues(tmp_path, release, sdadapt.dequant_fp8(block=BLOCK, scale_format="ue8m0_float32"))
    assert "is float8_e8m0fnu, not what scale_format='ue8m0_float32' stores (float32); scale_format='ue8m0'?" in text
    text = _issues(tmp_path, release, sdadapt.dequant_fp8(block=BLOCK, scale_format="ue8m0", scale_dtype="uint8"))
    assert "is float8_e8m0fnu, not what scale_format='ue8m0', scale_dtype='uint8' stores (uint8); " \
           "scale_dtype='float8_e8m0fnu'?" in text  # fmt: skip
    with pytest.raises(AdapterError, match="scale_dtype='uint8' is not a storage of scale_format='float32'"):
        sdadapt.dequant_fp8(block=BLOCK, scale_format="float32", scale_dtype=torch.uint8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("storage", ["F8_E8M0", "F32"])
def test_pow2_scales_dequantise_on_the_gpu(tmp_path, storage):
    """The device path copies the raw scales (``float8_e8m0fnu`` or float32 powers of two) to
    the GPU and dequantises there: the same bits as the loop reference."""
    if storage == "F8_E8M0":
        release, w1, w2 = e8m0_release(seed=17)
        rules = [sdadapt.dequant_fp8(block=BLOCK, scale_format="ue8m0")]
    else:
        (c1, k1), (c2, k2) = pow2_by_hand((R, C), seed=18), pow2_by_hand((C, R), seed=19)
        w1, w2 = (c1, float32_pow2(k1)), (c2, float32_pow2(k2))
        release = release_of(w1, w2)
        rules = [sdadapt.dequant_fp8(block=BLOCK, scale_format="ue8m0_float32")]
    src = write_by_hand(str(tmp_path / "release.safetensors"), release)
    with torch.device("cuda"):
        model = Net()
    sdadapt.load(model, src, sdadapt.Adapter([*rules, sdadapt.rename("model.{rest:*}", "{rest}")]))
    check_values({k: v.cpu() for k, v in model.state_dict().items()}, w1, w2, "ue8m0" if storage == "F8_E8M0" else "ue8m0_float32")
