"""How FP8 releases store their scales, through the shipped adapters: load and export keep it.

A release's ``scale_fmt: ue8m0`` says its block scales are powers of two, not how they are
stored: as ``F8_E8M0`` or ``U8`` exponent bytes (``k + 127``), or as ``F32`` values ``2.0 ** k``
(DeepSeek-V3.1). Given the checkpoint (``sdadapt.get_adapter(name, source=...)``), the
``deepseek_v3`` and ``qwen3`` adapters read that from the headers, so that the export through
``adapter.inverse()`` writes every tensor back with the release's bytes AND its safetensors dtype
names (the header is read by hand, as ``test_quant_export`` does).

The releases are the key names and shapes of tiny transformers models (``save_pretrained``),
every quantized weight made of random e4m3 codes whose tiles each hold a code of magnitude 240
or more, so that their power-of-two scale is the only one that holds their values (the bytes
can then come back exactly). The values the model must hold come from an independent plain
torch dequantisation (``float(code) * 2.0 ** k`` per tile), written as a plain float32 copy of
the release and loaded through the same adapter.

Also: a DCP checkpoint holding ``float8_e8m0fnu`` scales beside FP8 weights loads bit-exactly,
with the raw-bytes fast path (``torch.save``'s v3 tensor records).
"""

from __future__ import annotations

import json
import os
import typing
import warnings
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from support.fp8_releases import raw, read_by_hand, write_by_hand

import sdadapt
from sdadapt._plan.registry import adapter_module
from sdadapt._recipes.quant import ScaleFormat
from sdadapt.errors import AdapterError
from sdadapt.rules import DequantFP8

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")

BLOCK = (20, 10)  # divides none of the weights' shapes: partial last tiles
KEPT = ("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight")
"""2-D weights the releases keep unquantized (embeddings, output head, MoE routers)."""
STORAGES = {"F8_E8M0": torch.float8_e8m0fnu, "U8": torch.uint8, "F32": torch.float32}
"""How the scales are stored -> their torch dtype."""
FAMILIES = ("deepseek_v3", "qwen3")


# --- a release of random FP8 codes ------------------------------------------------------------


def tiles_of(shape: tuple[int, ...]) -> tuple[int, int]:
    return -(-shape[0] // BLOCK[0]), -(-shape[1] // BLOCK[1])


def fp8_codes(shape: tuple[int, int], g: torch.Generator) -> torch.Tensor:
    """Random e4m3 codes (no NaN), the first element of each tile of magnitude byte 0x77..0x7E
    (240..448): a tile's largest code then fixes its power-of-two scale."""
    mag = torch.randint(0, 0x7F, shape, generator=g, dtype=torch.int32)
    sign = torch.randint(0, 2, shape, generator=g, dtype=torch.int32) << 7
    codes = (mag | sign).to(torch.uint8)
    firsts = codes[:: BLOCK[0], :: BLOCK[1]]
    codes[:: BLOCK[0], :: BLOCK[1]] = torch.randint(0x77, 0x7F, firsts.shape, generator=g, dtype=torch.uint8) | (firsts & 0x80)
    return codes.view(torch.float8_e4m3fn)


def stored_scales(k: torch.Tensor, storage: str) -> torch.Tensor:
    """Exponents ``k`` as the release stores them: exponent bytes ``k + 127`` or float32 ``2.0 ** k``."""
    if storage == "F32":
        return torch.tensor([[2.0**e for e in row] for row in k.tolist()], dtype=torch.float32)
    return (k + 127).to(torch.uint8).view(STORAGES[storage])


def dequantized(codes: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``float(code) * 2.0 ** k`` of each code's tile, element by element, in float32."""
    scale = torch.tensor([[2.0**e for e in row] for row in k.tolist()], dtype=torch.float64)
    full = scale.repeat_interleave(BLOCK[0], dim=0).repeat_interleave(BLOCK[1], dim=1)[: codes.shape[0], : codes.shape[1]]
    return (codes.to(torch.float64) * full).to(torch.float32)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def hf_state(family: str) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """(state dict of a tiny transformers model of ``family``, its config.json, the reference model's spec)."""
    if family == "deepseek_v3":
        from support.hf_families import hf_config, hf_model, spec_of

        hf = hf_model(hf_config(), 50)
        spec = spec_of(hf.config)
    else:
        from support.hf_families import qwen_spec
        from transformers import Qwen3Config, Qwen3ForCausalLM

        torch.manual_seed(51)
        cfg = Qwen3Config(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, vocab_size=40, rms_norm_eps=1e-6, tie_word_embeddings=False)  # fmt: skip
        hf = Qwen3ForCausalLM(cfg).eval()
        spec = qwen_spec(cfg, hf)
    state = {k: v.detach().clone().contiguous() for k, v in hf.state_dict().items() if not k.endswith("inv_freq")}
    return state, json.loads(hf.config.to_json_string()), spec


def write_release(folder: str, state: dict[str, torch.Tensor], cfg: dict[str, Any], storage: str, seed: int) -> dict[str, torch.Tensor]:
    """The FP8 release of ``state``'s key names in ``folder`` (safetensors written by hand, scales
    stored as ``storage``, ``config.json`` with ``scale_fmt: ue8m0``) and, beside it in
    ``folder + "_plain"``, its independent dequantisation; returns the release's tensors."""
    g = torch.Generator().manual_seed(seed)
    release: dict[str, torch.Tensor] = {}
    plain: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if value.dim() != 2 or key.endswith(KEPT):
            release[key] = plain[key] = value
            continue
        codes, k = fp8_codes(tuple(value.shape), g), torch.randint(-20, 4, tiles_of(tuple(value.shape)), generator=g)
        release[key], release[key + "_scale_inv"] = codes, stored_scales(k, storage)
        plain[key] = dequantized(codes, k)
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK), "scale_fmt": "ue8m0"}
    for where, tensors, config in ((folder, release, {**cfg, "quantization_config": qc}), (folder + "_plain", plain, cfg)):
        os.makedirs(where)
        write_by_hand(os.path.join(where, "model.safetensors"), {k: raw(v) for k, v in tensors.items()})
        with open(os.path.join(where, "config.json"), "w") as f:
            json.dump(config, f)
    return release


def model_of(family: str, spec: dict[str, Any]) -> torch.nn.Module:
    from support.reference_deepseek import DeepSeekV3
    from support.reference_models import Qwen3

    with torch.device("meta"):
        model = (DeepSeekV3 if family == "deepseek_v3" else Qwen3)(spec)
    return model.to_empty(device="cpu")


def exported_raw(folder: str) -> dict[str, tuple[str, list[int], bytes]]:
    """Every tensor of an exported safetensors folder, as (dtype name, shape, bytes) from its headers."""
    out: dict[str, tuple[str, list[int], bytes]] = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(read_by_hand(os.path.join(folder, name)))
    return out


@pytest.fixture(scope="module")
def hf_states() -> dict[str, tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]]:
    return {family: hf_state(family) for family in FAMILIES}


# --- load and export through the shipped adapters --------------------------------------------

WANT_RULE = {"F8_E8M0": ("ue8m0", "float8_e8m0fnu"), "U8": ("ue8m0", "uint8"), "F32": ("ue8m0_float32", None)}
"""Storage of the scales -> (scale_format, scale_dtype) the adapter must pick from the headers."""


@pytest.mark.parametrize("storage", sorted(STORAGES))
@pytest.mark.parametrize("family", FAMILIES)
def test_adapter_keeps_the_stored_scale_format_and_dtype(tmp_path, hf_states, family: str, storage: str) -> None:
    state, cfg, spec = hf_states[family]
    folder = str(tmp_path / "release")
    release = write_release(folder, state, cfg, storage, seed=len(storage) + len(family))
    scales = [k for k in release if k.endswith("_scale_inv")]
    assert scales and {release[k].dtype for k in scales} == {STORAGES[storage]}

    adapter = sdadapt.get_adapter(family, source=folder, dtype="float32")
    (rule,) = [r for r in adapter.rules if isinstance(r, DequantFP8)]
    assert (rule.scale_format, rule.scale_dtype, tuple(rule.block)) == (*WANT_RULE[storage], BLOCK)

    model, reference = model_of(family, spec), model_of(family, spec)
    sdadapt.load(model, folder, adapter)
    sdadapt.load(reference, folder + "_plain", sdadapt.get_adapter(family, source=folder + "_plain"))
    got, want = model.state_dict(), reference.state_dict()
    assert sorted(got) == sorted(want)
    assert [k for k in want if not same_bits(got[k], want[k])] == []

    sdadapt.export(model, str(tmp_path / "out"), adapter)
    exported = exported_raw(str(tmp_path / "out"))
    assert exported[scales[0]][0] == storage
    assert exported == {k: raw(v) for k, v in release.items()}  # every dtype name, shape and byte


def test_without_the_headers_exponent_bytes_are_written_as_uint8(tmp_path, hf_states) -> None:
    """The documented fallback: an adapter that does not know how the scales are stored
    (``scale_dtype=None``) reads ``F8_E8M0`` scales and writes the same bytes as ``U8``."""
    state, cfg, spec = hf_states["deepseek_v3"]
    folder = str(tmp_path / "release")
    release = write_release(folder, state, cfg, "F8_E8M0", seed=3)
    adapter = sdadapt.get_adapter("deepseek_v3", source=folder, dtype="float32", scale_dtype=None)
    model = model_of("deepseek_v3", spec)
    sdadapt.load(model, folder, adapter)
    sdadapt.export(model, str(tmp_path / "out"), adapter)
    exported = exported_raw(str(tmp_path / "out"))
    want = {k: ("U8", *raw(v)[1:]) if v.dtype == torch.float8_e8m0fnu else raw(v) for k, v in release.items()}
    assert exported == want


def test_scale_options_are_checked_and_typed(hf_states) -> None:
    quantization = {"quant_method": "fp8", "weight_block_size": list(BLOCK), "scale_fmt": "ue8m0"}
    for family in ("deepseek_v3", "qwen3", "qwen3_moe"):
        build = adapter_module(family).build
        assert typing.get_type_hints(build)["scale_format"] == ScaleFormat | None, family
        (rule,) = [r for r in build(quantization=quantization, scale_format="ue8m0_float32").rules if isinstance(r, DequantFP8)]
        assert (rule.scale_format, rule.scale_dtype) == ("ue8m0_float32", None)
        (rule,) = [r for r in build(quantization=quantization, scale_dtype=torch.float8_e8m0fnu).rules
                   if isinstance(r, DequantFP8)]  # fmt: skip
        assert (rule.scale_format, rule.scale_dtype) == ("ue8m0", "float8_e8m0fnu")
        with pytest.raises(AdapterError, match=rf"the {family} adapter: scale_dtype='float8_e8m0fnu' does not store "
                                               r"scale_format='ue8m0_float32' scales \(those are stored as float32\)"):  # fmt: skip
            build(quantization=quantization, scale_format="ue8m0_float32", scale_dtype="float8_e8m0fnu")


# --- F8_E8M0 in a DCP checkpoint ---------------------------------------------------------------


class Linear2(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(45, 33))
        self.register_buffer("e", torch.zeros(5, 7, dtype=torch.uint8).view(torch.float8_e8m0fnu))


def test_dcp_checkpoint_with_e8m0_scales_loads_bit_exact_from_raw_bytes(tmp_path, monkeypatch) -> None:
    """A DCP folder with an FP8 weight, its ``float8_e8m0fnu`` scales and a plain
    ``float8_e8m0fnu`` tensor: the source reads them back bit-exactly, region by region, from
    the raw bytes of the chunks (DCP's own reader never runs), and a dequant rule loads the
    weight's values."""
    from torch.distributed.checkpoint import FileSystemReader

    g = torch.Generator().manual_seed(8)
    codes, k = fp8_codes((45, 33), g), torch.randint(-20, 4, tiles_of((45, 33)), generator=g)
    every_byte = torch.arange(0, 35, dtype=torch.uint8).mul(7).view(torch.float8_e8m0fnu).reshape(5, 7)
    saved = {"w": codes, "w_scale_inv": stored_scales(k, "F8_E8M0"), "e": every_byte}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(saved, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    monkeypatch.setattr(FileSystemReader, "read_data", lambda *a, **kw: pytest.fail("FileSystemReader read data"))

    with sdadapt.sources.open_source(str(tmp_path / "ck")) as src:
        assert {key: src.schema[key].dtype for key in saved} == {key: t.dtype for key, t in saved.items()}
        for key, t in saved.items():
            assert src.locate_region(key, tuple((0, n) for n in t.shape)) is not None, key
            box = tuple((n // 3, n - 1) for n in t.shape)
            got = src.read(key, box)
            assert same_bits(got, t[tuple(slice(a, b) for a, b in box)]), key

    model = Linear2()
    rule = sdadapt.dequant_fp8("w", BLOCK, scale_format="ue8m0", scale_dtype="float8_e8m0fnu", dtype="float32")
    sdadapt.load(model, str(tmp_path / "ck"), sdadapt.Adapter([rule]))
    assert same_bits(model.w.detach(), dequantized(codes, k)) and same_bits(model.e, every_byte)
