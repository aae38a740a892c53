"""MXFP8 releases under ``quant_method: mxfp8`` (the layout SGLang's loader and transformers'
fine-grained FP8 read): ``<m>.weight`` e4m3, ``<m>.weight_scale_inv`` one e8m0 exponent per 32
values of a row (``U8`` or ``F8_E8M0``), ``weight_block_size: [1, 32]``, ``scale_fmt: ue8m0``,
``modules_to_not_convert``.

The releases are those of ``test_quant_ct`` (``mxfp8_method``: the OCP MX rule, exponents as
``U8``; ``mxfp8_method_e8m0``: written by transformers' own quantizer, exponents as
``F8_E8M0``); the loaded values there equal transformers' own ``Fp8Dequantize`` bit for bit, and
``test_quant_ct_dist`` loads them on a 2x2 mesh and on 3 uneven ranks. Here: the config read
into rules, the reference cross-checked with an element-by-element loop, export's bytes, and a
tiny Llama loaded by name against transformers' ``from_pretrained`` of the same folder.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from support.checkpoints import write_safetensors

import sdadapt
from sdadapt.errors import AdapterError

pytest.importorskip("transformers", reason="the test extra installs transformers: the reference")
pytest.importorskip("support.ct_release")

from support.scaled_releases import LINEARS, Tiny, bits, export_case, mxfp8_method_release, transformers_mxfp8_dequant, write_case  # noqa: E402

NAMES = ["mxfp8_method", "mxfp8_method_e8m0"]


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, dict]]:
    root = tmp_path_factory.mktemp("quant_mxfp8")
    return {n: (str(root / n), write_case(str(root / n), n)) for n in NAMES}


def _groups(values: torch.Tensor, exponents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes as float32 ``[R, G, 32]`` and the groups' exponents ``[R, G]`` (int)."""
    rows, cols = values.shape
    return values.float().reshape(rows, cols // 32, 32), exponents.view(torch.uint8).to(torch.int32)


def test_the_config_reads_into_one_scaled_rule(cases) -> None:
    for name, stored in (("mxfp8_method", "uint8"), ("mxfp8_method_e8m0", "float8_e8m0fnu")):
        (rule,) = sdadapt.dequant_rules(cases[name][0])
        assert isinstance(rule, sdadapt.rules.DequantScaled)
        assert (rule.codec, rule.strategy, rule.group_size, rule.scale_suffix) == ("e4m3", "group", 32, "_scale_inv")
        assert rule.scale_dtype == stored  # the exponents' stored dtype, which export writes back
        assert "lm_head.weight" in rule.exclude  # modules_to_not_convert, resolved against the headers
    # without the headers: U8 exponents assumed, the matrices releases keep and the named modules excluded
    qc = {"quant_method": "mxfp8", "weight_block_size": [1, 32], "scale_fmt": "ue8m0", "ignored_layers": ["mlp.gate"]}
    (rule,) = sdadapt.dequant_rules({"quantization_config": qc})
    assert rule.scale_dtype == "uint8" and rule.group_size == 32
    assert "**mlp.gate.weight" in rule.exclude and "lm_head.weight" in rule.exclude
    assert "**.activation_scale" in rule.drop


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [("weight_block_size", [32], "quantization_config.weight_block_size"),
     ("scale_fmt", "float", "quantization_config.scale_fmt"),
     ("weight_block_size", [1, 0], "two positive integers")],  # fmt: skip
)
def test_a_bad_mxfp8_config_names_the_field(field: str, value: object, says: str) -> None:
    qc = {"quant_method": "mxfp8", "weight_block_size": [1, 32], field: value}
    with pytest.raises(AdapterError, match=says):
        sdadapt.dequant_rules({"quantization_config": qc})


def test_transformers_reference_equals_an_element_loop() -> None:
    """The reference itself, checked: transformers' ``Fp8Dequantize`` of both releases' layouts
    is ``float(code) * 2 ** (exponent - 127)`` element by element, rounded once."""
    w = (torch.randn(6, 64, generator=torch.Generator().manual_seed(5)) * 0.3).to(torch.bfloat16)
    for rule in ("ocp", "transformers"):
        q, s = mxfp8_method_release(w, rule)
        raw = s.view(torch.uint8)
        loop = torch.tensor([[float(v) * 2.0 ** (int(raw[i, j // 32]) - 127) for j, v in enumerate(row)]
                             for i, row in enumerate(q.float().tolist())], dtype=torch.float64)  # fmt: skip
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(bits(transformers_mxfp8_dequant(q, s, dtype)), bits(loop.to(dtype))), (rule, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_gives_the_release_bytes(cases, dtype: torch.dtype, tmp_path) -> None:
    """A release quantized by the OCP rule (largest |code| of every group in [256, 448]) comes back
    byte for byte from a float32 and from a bf16 model: codes, and exponents as ``U8``."""
    original, exported = export_case(cases, "mxfp8_method", dtype, tmp_path)
    assert sorted(exported) == sorted(original)
    for k, v in exported.items():
        assert v.dtype == original[k].dtype and v.shape == original[k].shape, k
        assert torch.equal(bits(v.reshape(-1)), bits(original[k].reshape(-1))), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_of_a_transformers_release_is_transformers_own_requantization(cases, dtype, tmp_path) -> None:
    """transformers' quantizer (``2 ** ceil(log2(amax / 448))``) leaves a group's largest |code| at
    224 where ``amax / scale`` lies in (224, 232]. Those values are also 448 codes at half the
    scale, and that form is what transformers' own quantizer writes from the loaded values: the
    export is exactly transformers' re-quantization of the model, in the release's ``F8_E8M0``,
    and equals the release byte for byte in every group but the 224 ones (which hold the same values)."""
    original, exported = export_case(cases, "mxfp8_method_e8m0", dtype, tmp_path)
    assert sorted(exported) == sorted(original)
    folder, want = cases["mxfp8_method_e8m0"]
    doubled = 0
    for key in LINEARS:
        w, s = key + ".weight", key + ".weight_scale_inv"
        assert exported[s].dtype == torch.float8_e8m0fnu and exported[w].dtype == torch.float8_e4m3fn
        q, e = mxfp8_method_release(want[str(dtype).removeprefix("torch.")][key.removeprefix("model.") + ".weight"], "transformers")
        assert torch.equal(bits(exported[w]), bits(q)) and torch.equal(bits(exported[s]), bits(e)), key
        c0, e0 = _groups(original[w], original[s])
        c1, e1 = _groups(exported[w], exported[s])
        same = e1 == e0
        assert torch.equal(bits(c1[same]), bits(c0[same])), key
        assert torch.equal(~same, c0.abs().amax(-1) == 224) and bool((e1[~same] == e0[~same] - 1).all()), key
        assert torch.equal(c1 * torch.exp2((e1 - e0).float()).unsqueeze(-1), c0), key  # the same values
        doubled += int((~same).sum())
    assert doubled > 0  # the release holds 224 groups: the statement is exercised


def test_a_load_reads_each_stored_byte_once(cases) -> None:
    """The load reads the release's codes and exponents once each, and nothing else of the file
    (the region reads of every format, cut inside groups, are checked in ``test_quant_ct``; the
    shards on 2x2 and 3 ranks, each reading less than the file, in ``test_quant_ct_dist``)."""
    folder, want = cases["mxfp8_method"]
    model = Tiny(torch.float32)
    adapter = sdadapt.Adapter([*sdadapt.dequant_rules(folder), sdadapt.rename("model.{rest:*}", "{rest}"),
                               sdadapt.cast("**", "model", from_dtype="bfloat16")])  # fmt: skip
    rep = sdadapt.load(model, folder, adapter)
    stored = load_file(os.path.join(folder, "model.safetensors"))
    assert rep.bytes_read == sum(t.numel() * t.element_size() for t in stored.values())
    for k, v in model.state_dict().items():
        assert torch.equal(bits(v), bits(want["float32"][k])), k


# --- a tiny Llama by name, against transformers' own loader of the same folder ---------------------

VOCAB, DIM, HIDDEN, HEADS, KV = 40, 64, 96, 4, 2
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("rule", ["ocp", "transformers"])
def test_llama_release_by_name_gives_transformers_logits(tmp_path, rule: str) -> None:
    """A tiny Llama as an MXFP8 release (``lm_head`` kept bf16 through ``modules_to_not_convert``)
    loaded by name (``sdadapt.load(model, folder, "llama")``) gives the logits of transformers'
    ``LlamaForCausalLM.from_pretrained`` of the same folder (on CPU it dequantises on load)."""
    from support.reference_models import MetaLlama
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(7)
    cfg = LlamaConfig(hidden_size=DIM, intermediate_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS,
                      num_key_value_heads=KV, vocab_size=VOCAB, rms_norm_eps=1e-6, tie_word_embeddings=False)  # fmt: skip
    hf = LlamaForCausalLM(cfg).eval()
    tensors = {}
    for key, w in hf.state_dict().items():
        w = (w + torch.randn_like(w) * 0.05).to(torch.bfloat16)
        if key.endswith(".weight") and key.split(".")[-2] in LINEAR:
            q, s = mxfp8_method_release(w, rule)
            tensors |= {key: q, key + "_scale_inv": s}
        else:
            tensors[key] = w
    write_safetensors(tmp_path / "model.safetensors", tensors)
    qc = {"quant_method": "mxfp8", "weight_block_size": [1, 32], "scale_fmt": "ue8m0", "activation_scheme": "dynamic",
          "modules_to_not_convert": ["lm_head"]}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps({**cfg.to_dict(), "quantization_config": qc}))
    ref = LlamaForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16).eval()
    tokens = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    spec = dict(dim=DIM, n_layers=2, n_heads=HEADS, n_kv_heads=KV, vocab_size=VOCAB, hidden_dim=HIDDEN, norm_eps=1e-6,
                rope_theta=cfg.rope_parameters["rope_theta"])  # fmt: skip
    with torch.device("meta"):
        model = MetaLlama(spec).to(torch.bfloat16)
    rep = sdadapt.load(model, str(tmp_path), "llama")
    assert rep.report.ok, rep.report
    theirs = dict(ref.state_dict())
    assert torch.equal(bits(model.layers[1].feed_forward.w2.weight), bits(theirs["model.layers.1.mlp.down_proj.weight"]))
    assert torch.equal(bits(model.output.weight), bits(theirs["lm_head.weight"]))
    with torch.no_grad():
        got, want = model(tokens).float(), ref(tokens).logits.float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert stored["model.layers.0.mlp.up_proj.weight_scale_inv"].dtype == (torch.uint8 if rule == "ocp" else torch.float8_e8m0fnu)
