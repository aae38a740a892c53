"""Export re-quantizes the scaled formats in the release's own format and geometry.

compressed-tensors releases (written by its own compressors: ``pack-quantized`` int4 / int8 with
and without zero points, ``int-quantized`` int8, ``mxfp4-pack-quantized``, ``mxfp8-quantized``)
and ModelOpt NVFP4 (written by hand with ModelOpt's published scale rule) are loaded into a
float32 and a bf16 model of ``test_quant_ct`` and exported with the same adapter; each tensor
of the export is compared byte for byte with the release, and compressed-tensors decompresses
the export to the release's values. Where bytes cannot come back (MXFP8 groups whose largest
code is 224, releases whose scales follow no quantizer's rule), the test checks the exact
property docs/quantized.md states.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
from support.checkpoints import write_safetensors

import sdadapt
from sdadapt._recipes import quant_scaled as S
from sdadapt.errors import AdapterError

ct_release = pytest.importorskip("support.ct_release")

from support.scaled_releases import FP4, LINEARS, Tiny, bits, case_weights, ct_scheme, export_case, write_case  # noqa: E402

EXACT = ["w4a16", "w4a16_asym", "w8a16", "w8a8", "mxfp4"]


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, dict]]:
    root = tmp_path_factory.mktemp("quant_ct_export")
    return {n: (str(root / n), write_case(str(root / n), n)) for n in EXACT + ["mxfp8", "mxfp8_e8m0", "modelopt_nvfp4"]}


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a.reshape(-1)), bits(b.reshape(-1)))


def _module(tensors: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    """One module's stored tensors (``weight_packed``, ``weight_scale``, ...) under their local names."""
    return {k[len(name) + 1 :]: v for k, v in tensors.items() if k.startswith(name + ".")}


@pytest.mark.parametrize("name", EXACT)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_gives_the_release_bytes(cases, name: str, dtype: torch.dtype, tmp_path) -> None:
    """int4 / int8 codes with bf16 scales (packed in int32 words or not, zero points packed along
    rows, ``weight_shape``) and MXFP4 come back byte for byte from a float32 and from a bf16
    model: of the candidate scales, export takes the one whose values, rounded to the model's
    dtype, are the model's values. compressed-tensors decompresses the export to the release's values."""
    original, exported = export_case(cases, name, dtype, tmp_path)
    assert sorted(exported) == sorted(original)
    for k, v in exported.items():
        assert _same_bytes(v, original[k]), (k, v.dtype, original[k].dtype)
    scheme = ct_scheme(name)
    for key in LINEARS:
        mine, theirs = _module(exported, key), _module(original, key)
        assert sorted(mine) == sorted(theirs)
        back = ct_release.decompress(mine, name, scheme)
        assert torch.equal(bits(back), bits(ct_release.decompress(theirs, name, scheme))), key


def _e4m3_groups(values: torch.Tensor, exponents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes as float32 ``[R, G, 32]`` and the groups' exponents ``[R, G]`` (int)."""
    rows, cols = values.shape
    return values.float().reshape(rows, cols // 32, 32), exponents.view(torch.uint8).to(torch.int32)


@pytest.mark.parametrize("name", ["mxfp8", "mxfp8_e8m0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp8_export_gives_the_same_values_and_the_release_bytes_but_doubled_224s(cases, name, dtype, tmp_path) -> None:
    """MXFP8 (e4m3 codes times ``2 ** (e - 127)`` per 32) is held exactly by bf16 and float32. A
    group of values has one (codes, exponent) form whose largest |code| lies in [240, 448]: export
    writes that one, in the release's scale dtype (``U8`` or ``F8_E8M0``). compressed-tensors' rule
    writes the same form except where the largest |code| is 224 (then export writes the codes
    doubled and the exponent one lower); a release made by hand with random exponents comes back
    in that form too. Every group holds the same values."""
    original, exported = export_case(cases, name, dtype, tmp_path)
    assert sorted(exported) == sorted(original)
    doubled = 0
    for key in LINEARS:
        w, s = key + ".weight", key + ".weight_scale"
        assert exported[s].dtype == original[s].dtype and exported[w].dtype == original[w].dtype
        c0, e0 = _e4m3_groups(original[w], original[s])
        c1, e1 = _e4m3_groups(exported[w], exported[s])
        assert torch.equal(c1 * torch.exp2((e1 - e0).float()).unsqueeze(-1), c0), key  # the same values
        top = c1.abs().amax(-1)
        assert bool(((top >= 240) & (top <= 448)).all()), key
        same = e1 == e0
        assert torch.equal(bits(c1[same]), bits(c0[same])), key  # the same exponent: the same code bytes
        if name == "mxfp8":  # compressed-tensors' own rule: only its 224 groups differ, and by one doubling
            assert torch.equal(~same, c0.abs().amax(-1) == 224), key
            assert bool((e1[~same] == e0[~same] - 1).all()), key
            doubled += int((~same).sum())
        for k in (w, s):
            assert _same_bytes(exported[k], original[k]) == bool(same.all()), k
    if name == "mxfp8":
        assert doubled > 0  # the releases hold 224 groups: the statement is exercised
        scheme = ct_scheme(name)
        for key in LINEARS:
            assert torch.equal(ct_release.decompress(_module(exported, key), name, scheme),
                               ct_release.decompress(_module(original, key), name, scheme)), key  # fmt: skip


# --- ModelOpt NVFP4 ---------------------------------------------------------------------------------


def modelopt_nvfp4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """ModelOpt's NVFP4 weight quantizer as published (``NVFP4QTensor``): ``weight_scale_2 = amax /
    (6 * 448)``, each 16 values' scale ``block_amax / (6 * weight_scale_2)`` in e4m3, codes the
    nearest e2m1 value of ``w / (scale * weight_scale_2)`` (ties to the even code; the sign of
    -0.0 kept), two per byte, low nibble first."""
    w = w.float()
    rows, cols = w.shape
    scale_2 = w.abs().amax() / torch.tensor(6.0 * 448.0)
    block_amax = w.reshape(rows, cols // 16, 16).abs().amax(-1)
    scale = (block_amax / (6.0 * scale_2)).to(torch.float8_e4m3fn)
    x = w / (scale.float() * scale_2).repeat_interleave(16, dim=-1)
    mags = torch.tensor(FP4[:8])
    dist = (x.abs().unsqueeze(-1) - mags).abs()
    best = dist.min(-1, keepdim=True).values
    ties = (dist == best).to(torch.int64)
    first = ties.argmax(-1)
    code = torch.where(ties.sum(-1) > 1, first + first % 2, first)  # on a midpoint: the even code
    code = (code | (torch.signbit(x).to(torch.int64) << 3)).to(torch.uint8)
    return {"weight": code[:, 0::2] | (code[:, 1::2] << 4), "weight_scale": scale, "weight_scale_2": scale_2}


def _modelopt_release(folder: str, seed: int) -> None:
    os.makedirs(folder)
    tensors: dict[str, torch.Tensor] = {}
    for key, w in case_weights(seed).items():
        if key in LINEARS:
            tensors |= {f"{key}.{k}": v for k, v in modelopt_nvfp4(w).items()}
            tensors[f"{key}.input_scale"] = torch.tensor(0.5)
        else:
            tensors[key] = w
    write_safetensors(os.path.join(folder, "model.safetensors"), tensors)
    hq = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}}
    with open(os.path.join(folder, "hf_quant_config.json"), "w") as f:
        json.dump(hq, f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"model_type": "tiny"}, f)


def test_modelopt_nvfp4_release_bytes_come_back_from_a_float32_model(tmp_path) -> None:
    """A release written with ModelOpt's rule: export chooses ``weight_scale_2`` again from the
    tensor's largest value (``amax / 2688``, or the float32 neighbour that reproduces the values)
    and each group's scale and codes by the same rule, so every byte comes back."""
    folder = str(tmp_path / "release")
    _modelopt_release(folder, seed=11)
    cases = {"modelopt": (folder, None)}
    original, exported = export_case(cases, "modelopt", torch.float32, tmp_path)
    assert sorted(exported) == sorted(k for k in original if not k.endswith("input_scale"))
    for k, v in exported.items():
        assert _same_bytes(v, original[k]), k


def test_modelopt_nvfp4_of_other_scales_comes_back_requantized_by_modelopts_rule(cases, tmp_path) -> None:
    """A release whose ``weight_scale_2`` is not its ``amax / 2688`` (here 0.00123 with random
    group scales and codes: a group's largest code need not be 6): export cannot see the release's
    scales, only its values, and writes ModelOpt's rule applied to them: other bytes, and values
    within NVFP4's rounding of the release's."""
    original, exported = export_case(cases, "modelopt_nvfp4", torch.float32, tmp_path)
    folder, want = cases["modelopt_nvfp4"]
    for key, mkey in ((k, k.removeprefix("model.")) for k in LINEARS):
        ref = modelopt_nvfp4(want["float32"][mkey + ".weight"])
        for part, v in ref.items():
            assert _same_bytes(exported[f"{key}.{part}"], v), (key, part)
        assert not _same_bytes(exported[f"{key}.weight_scale_2"], original[f"{key}.weight_scale_2"])


# --- what refuses ---------------------------------------------------------------------------------


def test_formats_no_tool_writes_refuse_to_invert(tmp_path) -> None:
    """e2m1 codes with float scales but no global scale, int codes with e8m0 exponents, or zero
    points on float codes are no format: the rule refuses to invert, and a QuantizeScaled built
    by hand is a plan problem naming the key."""
    for kwargs, why in (
        ({"codec": "e2m1", "strategy": "group", "group_size": 16, "scale_dtype": "float32"}, "global scale"),
        ({"codec": "int4", "strategy": "group", "group_size": 32, "scale_dtype": "uint8"}, "float scales only"),
        ({"codec": "e4m3", "strategy": "group", "group_size": 32, "global_suffix": "_g"}, "no global scale"),
    ):
        with pytest.raises(AdapterError, match=f"cannot be inverted: .*{why}"):
            sdadapt.dequant_scaled(**kwargs).inverse()
    from sdadapt.rules._dequant_scaled import QuantizeScaled

    path = write_safetensors(tmp_path / "plain.safetensors", Tiny(torch.float32).state_dict())
    rule = QuantizeScaled(keys="layers.0.w1.weight", codec="e2m1", strategy="group", group_size=16, scale_dtype="float32")
    rep = sdadapt.diff(Tiny(torch.float32), path, sdadapt.Adapter([rule]))
    assert not rep.ok and "layers.0.w1.weight: cannot be quantized: e2m1 codes need a global scale" in str(rep)


def test_mx_rules_without_headers_export_exponent_bytes(cases) -> None:
    """From a config alone (no checkpoint headers), the MX formats' rules take the config's
    ``scale_dtype`` (``uint8`` by default), so export writes e8m0 exponents, not float scales."""
    with open(os.path.join(cases["mxfp8"][0], "config.json")) as f:
        cfg: dict[str, Any] = json.load(f)
    (rule,) = sdadapt.dequant_rules(cfg)
    assert rule.scale_dtype == "uint8" and rule.inverse()[0].scale_dtype == "uint8"
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["scale_dtype"] = "torch.float8_e8m0fnu"
    (rule,) = sdadapt.dequant_rules(cfg)
    assert rule.scale_dtype == "float8_e8m0fnu"


def test_int_quantizer_takes_the_release_pair_among_candidates() -> None:
    """The pure quantizer against compressed-tensors' own quantize + pack: int4 groups with and
    without zero points, whose largest code is +7, -7 or -8, come back as the same codes, scales
    and zero points from their float32 values; values no release produced get the closest pair."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    g = torch.Generator().manual_seed(5)
    codes = torch.randint(-8, 8, (16, 64), generator=g, dtype=torch.int8)
    codes[0:4].clamp_(-7, 7)  # largest magnitude +-7 (else -8: the scale is amax / 8)
    codes[4:8, 0::32], codes[4:8, 1::32] = 7, -8
    scale = (torch.rand(16, 2, generator=g) * 0.05 + 0.01).to(torch.bfloat16)

    def values(z: torch.Tensor) -> torch.Tensor:
        return ((codes.float() - z.float().repeat_interleave(32, dim=-1)) * scale.float().repeat_interleave(32, dim=-1))

    stored, s, z = S.quantize(values(torch.zeros(16, 2)), "int4", (1, 32), torch.bfloat16)
    assert z is None and torch.equal(bits(s), bits(scale)) and torch.equal(stored, pack_to_int32(codes, 4))
    # zero points as compressed-tensors makes them: the lowest code -8 sits on min(values, 0), the highest on max(values, 0)
    codes[:, 0::32], codes[:, 1::32] = -8, 7
    zero = torch.randint(-8, 8, (16, 2), generator=g, dtype=torch.int8)
    stored, s, z = S.quantize(values(zero), "int4", (1, 32), torch.bfloat16, zero=True)
    assert torch.equal(bits(s), bits(scale)) and torch.equal(stored, pack_to_int32(codes, 4))
    assert z is not None and torch.equal(z, pack_to_int32(zero, 4, packed_dim=0))
    noise = torch.randn(4, 32, generator=g)
    q, s, _ = S.quantize_int(noise, (1, 32), 4, torch.float32, False)
    err = (q.float() * s.repeat_interleave(32, dim=-1) - noise).abs().amax(-1)
    ct_scale = noise.abs().amax(-1) / 7.5
    ct_err = ((noise / ct_scale[:, None]).round().clamp(-8, 7) * ct_scale[:, None] - noise).abs().amax(-1)
    assert bool((err <= ct_err).all())  # no worse than compressed-tensors' own choice


@pytest.mark.parametrize(
    "codec,block,scale_dtype,zero",
    [
        ("int4", (1, 32), torch.bfloat16, False),
        ("int4", (1, 32), torch.bfloat16, True),
        ("int8_packed", (1, 16), torch.float32, True),
        ("int8", (1, 70), torch.bfloat16, True),  # one scale per row, zero points int8
        ("int4", (4, 16), torch.float16, True),  # 2-D blocks: zero points packed over block rows
        ("e4m3", (1, 32), torch.uint8, False),  # MXFP8
        ("e4m3", (1, 32), torch.float8_e8m0fnu, False),
        ("e2m1", (1, 32), torch.uint8, False),  # MXFP4
        ("e2m1", (1, 16), torch.float8_e4m3fn, False),  # NVFP4 (with its global scale)
    ],
)
def test_quantize_regions_equal_the_whole(codec, block, scale_dtype, zero) -> None:
    """Every region of each part (codes cut inside packs and groups, scales and zero points cut
    inside packed words of rows), over stacked experts ``[2, 21, 70]``, equals the same region of
    the whole tensor's quantization: what a rank writes of its shard on export."""
    import random

    from support.checkpoints import DictIO

    from sdadapt._recipes import quant_scaled_nodes as SN
    from sdadapt._recipes.nodes import Leaf

    x = (torch.randn(2, 21, 70, generator=torch.Generator().manual_seed(3)) * 0.1).to(torch.bfloat16)
    io = DictIO({"x": x})
    leaf = Leaf("x", tuple(x.shape), x.dtype)
    glob = SN.GlobalScaleOf(leaf, "divide") if scale_dtype == torch.float8_e4m3fn else None
    parts = ["values", "scales"] + (["zeros"] if zero else [])
    rng = random.Random(f"{codec}{block}{zero}")
    for part in parts:
        node = SN.QuantizedScaled(leaf, codec, block, part, scale_dtype, glob, "divide", None, zero)
        whole = node.full(io)
        assert tuple(whole.shape) == node.shape and whole.dtype == node.dtype, part
        boxes = [tuple((0, n) for n in node.shape)]
        for _ in range(8):
            box = []
            for n in node.shape:
                a = rng.randrange(n)
                box.append((a, rng.randrange(a + 1, n + 1)))
            boxes.append(tuple(box))
        for box in boxes:
            got = node.read(box, io)
            assert _same_bytes(got, whole[tuple(slice(a, b) for a, b in box)]), (part, box)


@pytest.mark.parametrize("name", ["w4a16", "mxfp8", "mxfp4"])
def test_all_zero_groups_come_back_with_scale_one(name: str) -> None:
    """A group of zeros: compressed-tensors writes a small epsilon scale (exponent 0 for the MX
    formats), export writes scale 1 (exponent 127); codes and every other group's bytes are the
    release's, and the values are the same."""
    scheme = ct_scheme(name)
    w = (torch.randn(4, 64, generator=torch.Generator().manual_seed(2)) * 0.1).to(torch.bfloat16)
    w[1, 32:] = 0
    stored = ct_release.compress(w, name, scheme)
    values = ct_release.decompress(stored, name, scheme)
    codec = {"w4a16": "int4", "mxfp8": "e4m3", "mxfp4": "e2m1"}[name]
    q, s, _ = S.quantize(values, codec, (1, 32), stored["weight_scale"].dtype)
    packed = stored["weight_packed"] if "weight_packed" in stored else stored["weight"]
    assert _same_bytes(q, packed)
    zero = torch.zeros_like(s, dtype=torch.bool)
    zero[1, 1] = True
    assert _same_bytes(s[~zero], stored["weight_scale"][~zero])
    assert s[1, 1].item() == (127 if codec != "int4" else 1.0) and stored["weight_scale"][1, 1].item() not in (1.0, 127)
    back = S.dequantize(q, codec, s, (1, 32), 64, torch.bfloat16)
    assert torch.equal(back, values)
