"""FP8 releases through the ``qwen3``, ``qwen3_moe`` and ``deepseek_v3`` adapters.

Each tiny transformers model is written as its FP8 release would be: ``save_pretrained``'s keys,
every 2-D weight except embeddings, ``lm_head`` and routers quantized here with plain torch to
``float8_e4m3fn`` with ``<key>_scale_inv`` block scales, and ``config.json`` carrying
``quantization_config`` (``quant_method: fp8``, ``weight_block_size``). The blocks are
``BLOCK`` = 20 x 10, which divides none of the weights' shapes: the last row and column tiles
are partial, TP and FSDP shards cut tiles (two ranks share one scale tile) and some shards are
smaller than a tile. Scales are float32 (``amax / 448``) or UE8M0 (``2**ceil(log2(amax / 448))``,
DeepGEMM's rule, stored as biased exponent bytes, ``scale_fmt: ue8m0``).

The oracle is independent of sdadapt: the test dequantises the same file with plain torch
(``float(w) * scale_inv[i // b0, j // b1]``), loads the result into transformers
(``from_pretrained`` of a plain copy) and takes its logits. Each adapter must pick the FP8
variant by itself (``sdadapt.get_adapter(name, source=...)``), load into the reference model on
a 2x2 FSDP2+TP mesh and on 3 ranks with uneven shards, give those logits, and export through
``adapter.inverse()`` the release's bytes (FP8 weights and scales) unchanged. One limit is
inherent to UE8M0: a tile whose largest code is 224 holds the same values as 448 at half the
scale, so its bytes cannot be recovered from values; those weights must come back value-exact.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.adapter_check import check_results
from support.dist_helper import run_distributed
from support.hf_families import hf_config, hf_model, load_all, mtp_layer, perturb_model, qwen_spec, spec_of, target_model

import sdadapt

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")

BLOCK = (20, 10)
E4M3_MAX = 448.0
NOT_QUANTIZED = ("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight", "shared_head.head.weight", "eh_proj.weight")
"""2-D weights the releases keep in bf16: embeddings, heads, routers, DeepSeek's MTP ``eh_proj``."""
VOCAB, SEQ, DIM = 40, 7, 32


# ----------------------------------------------------------------------------------------------
# an FP8 release and its independent dequantisation, in plain torch
# ----------------------------------------------------------------------------------------------
def _tiles(x: torch.Tensor, b0: int, b1: int) -> torch.Tensor:
    """``x [R, C]`` zero-padded to whole tiles, as ``[R/b0, b0, C/b1, b1]``."""
    rows, cols = x.shape
    nr, nc = -(-rows // b0), -(-cols // b1)
    padded = torch.zeros(nr * b0, nc * b1, dtype=torch.float32)
    padded[:rows, :cols] = x
    return padded.reshape(nr, b0, nc, b1)


def quantize(w: torch.Tensor, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [R, C]`` -> (``float8_e4m3fn [R, C]``, scale ``[ceil(R/b0), ceil(C/b1)]``: float32
    ``amax / 448``, or with ``ue8m0`` the power of two ``2**ceil(log2(amax / 448))`` stored as
    the byte ``exponent + 127``)."""
    tiles = _tiles(w, *BLOCK)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    if ue8m0:
        exponent = torch.ceil(torch.log2(scale))
        scale, stored = torch.exp2(exponent), (exponent + 127).to(torch.uint8)
    else:
        stored = scale
    q = (tiles / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(tiles.shape[0] * BLOCK[0], -1)[: w.shape[0], : w.shape[1]].contiguous(), stored


def dequantize(q: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    """The reference dequantisation: ``float(q[i, j]) * scale[i // b0, j // b1]`` in float32."""
    scale = torch.exp2(stored.float() - 127) if stored.dtype == torch.uint8 else stored
    full = scale.repeat_interleave(BLOCK[0], dim=0).repeat_interleave(BLOCK[1], dim=1)
    return q.float() * full[: q.shape[0], : q.shape[1]]


def ambiguous(q: torch.Tensor) -> bool:
    """Whether a UE8M0 weight has a tile whose largest code is 224: 224 at scale ``2**k`` and 448
    at ``2**(k-1)`` hold the same values, so its bytes cannot be told from its values (the
    exporter, seeing only values, picks ``2**(k-1)``; a power-of-two release has both kinds)."""
    return bool((_tiles(q.float(), *BLOCK).abs().amax(dim=(1, 3)) == 224).any())


def write_release(hf: Any, path: str, *, ue8m0: bool, extra: Callable | None = None) -> dict[str, torch.Tensor]:
    """``hf`` as an FP8 release in ``path`` (one safetensors file + config.json with
    ``quantization_config``); ``extra(tensors)`` gives tensors to add (an MTP layer). Returns the
    dequantised tensors under the release's keys."""
    plain = path + "_plain"
    hf.save_pretrained(plain)
    sd = load_file(os.path.join(plain, "model.safetensors"))
    sd.update(extra(sd) if extra else {})
    release: dict[str, torch.Tensor] = {}
    values: dict[str, torch.Tensor] = {}
    for key, w in sd.items():
        if w.dim() == 2 and not key.endswith(NOT_QUANTIZED):
            release[key], release[key + "_scale_inv"] = quantize(w, ue8m0)
            values[key] = dequantize(release[key], release[key + "_scale_inv"])
        else:
            release[key] = values[key] = w
    os.makedirs(path)
    save_file(release, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads(hf.config.to_json_string())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(BLOCK), **({"scale_fmt": "ue8m0"} if ue8m0 else {})}  # fmt: skip
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return values


def reference_logits(hf: Any, values: dict[str, torch.Tensor], path: str, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' logits with the dequantised weights: a plain (unquantized) copy of the
    release written beside it and read back with ``from_pretrained``."""
    plain = path + "_plain"
    save_file({k: v.contiguous() for k, v in values.items()}, os.path.join(plain, "model.safetensors"), metadata={"format": "pt"})
    model, info = type(hf).from_pretrained(plain, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    model.eval()
    with torch.no_grad():
        return model(tokens).logits.float()


def _write_cases(root: str) -> list[dict]:
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    qwen = dict(hidden_size=DIM, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, vocab_size=VOCAB, rms_norm_eps=1e-6)  # fmt: skip
    cases: list[dict] = []

    def add(name: str, family: str, hf: Any, spec: dict, *, ue8m0: bool, extra: Callable | None = None, skip: tuple = ()) -> None:
        path = os.path.join(root, name)
        values = write_release(hf, path, ue8m0=ue8m0, extra=extra)
        expected = reference_logits(hf, {k: v for k, v in values.items() if not k.startswith(skip)}, path, tokens)
        release = load_file(os.path.join(path, "model.safetensors"))
        unsure = [k for k, v in release.items() if ue8m0 and v.dtype == torch.float8_e4m3fn and not k.startswith(skip) and ambiguous(v)]
        cases.append(dict(name=name, path=path, family=family, adapter=family, spec=spec, tokens=tokens, expected=expected,
                          options={"dtype": "float32"}, export_unexpected=[], export_skip=skip,
                          ambiguous=unsure))  # fmt: skip

    torch.manual_seed(40)
    cfg = Qwen3Config(**qwen, tie_word_embeddings=False)
    hf = Qwen3ForCausalLM(cfg).eval()
    perturb_model(hf, 40)
    add("qwen3_fp8", "qwen3", hf, qwen_spec(cfg, hf), ue8m0=False)

    torch.manual_seed(41)
    cfg = Qwen3MoeConfig(**qwen, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1])
    hf = Qwen3MoeForCausalLM(cfg).eval()
    perturb_model(hf, 41)
    add("qwen3_moe_fp8_ue8m0", "qwen3_moe", hf, qwen_spec(cfg, hf), ue8m0=True)

    # DeepSeek-V3 as released: q_lora, one dense layer, an MTP layer (quantized too, dropped)
    hf = hf_model(hf_config(), 42)
    n = hf.config.num_hidden_layers
    add("deepseek_v3_fp8", "deepseek_v3", hf, spec_of(hf.config), ue8m0=False, extra=lambda sd: mtp_layer(sd, n, 43),
        skip=(f"model.layers.{n}.",))  # fmt: skip
    return cases


@pytest.fixture(scope="module")
def cases_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("adapters_fp8"))
    torch.save(_write_cases(root), os.path.join(root, "cases.pt"))
    return root


def _cases(root: str) -> list[dict]:
    return torch.load(os.path.join(root, "cases.pt"), weights_only=False)


def test_fp8_releases_load_and_export(cases_root: str) -> None:
    """Logits on both meshes; the export gives the release's bytes, except for UE8M0 weights with
    an ambiguous tile (see :func:`ambiguous`): those give the same values."""
    cases = _cases(cases_root)
    results = run_distributed(load_all, 4, cases_root, timeout=300)
    may_differ = {c["name"]: [*c["ambiguous"], *(k + "_scale_inv" for k in c["ambiguous"])] for c in cases}
    check_results(results, [c["name"] for c in cases], may_differ=may_differ)
    ue8m0 = next(c for c in cases if "ue8m0" in c["name"])
    assert ue8m0["ambiguous"], "no ambiguous tile: the case no longer covers them"
    release = load_file(os.path.join(ue8m0["path"], "model.safetensors"))
    for result in results:
        for by_case in result.values():
            exported = by_case[ue8m0["name"]]["differ_bytes"]
            for key in ue8m0["ambiguous"]:
                weight, scale = exported[key].view(torch.float8_e4m3fn), exported[key + "_scale_inv"]  # uint8 scales
                assert torch.equal(dequantize(weight, scale), dequantize(release[key], release[key + "_scale_inv"])), key


def test_adapters_pick_the_fp8_variant(cases_root: str) -> None:
    """From config.json alone: block size and scale format; the plan checks every scale."""
    for case in _cases(cases_root):
        adapter = sdadapt.get_adapter(case["adapter"], source=case["path"], **case["options"])
        (rule,) = [r for r in adapter.rules if isinstance(r, sdadapt.rules.DequantFP8)]
        assert list(rule.block) == list(BLOCK) and rule.dtype == "float32", rule
        assert rule.scale_format == ("ue8m0" if "ue8m0" in case["name"] else "float32"), rule
        assert ("**.eh_proj.weight" in rule.exclude) == (case["adapter"] == "deepseek_v3"), rule
        rep = sdadapt.diff(target_model(case, None), case["path"], adapter)
        assert rep.ok, rep.format()


def test_fp8_release_without_dequant_is_refused(cases_root: str) -> None:
    """The same release read as plain weights (quantization forced off): the scales are
    unexpected and the FP8 weights a dtype mismatch, before anything is read."""
    case = next(c for c in _cases(cases_root) if c["name"] == "qwen3_fp8")
    adapter = sdadapt.get_adapter("qwen3", source=case["path"], quantization=None)
    rep = sdadapt.diff(target_model(case, None), case["path"], adapter)
    assert not rep.ok
    assert "layers.0.attention.wq.weight" in [m.key for m in rep.dtype_mismatch], rep.format()
    assert "model.layers.0.self_attn.q_proj.weight_scale_inv" in rep.unexpected, rep.format()
