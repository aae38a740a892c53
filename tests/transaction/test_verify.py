"""sdadapt verify: a tiny transformers Llama checkpoint loaded into the Meta-layout reference Llama.

PASS with the shipped ``llama`` adapter; FAIL (exit 1) when the adapter is wrong: without the
rotary permute (against the transformers reference), and with a fused qkv that is not
interleaved per TP rank (parity between an FSDP mesh and a TP mesh, 2 gloo ranks).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from support.dist_helper import TESTS_DIR, run_distributed

import sdadapt
from sdadapt._tools.verifying import compare_logits, reference_from_checkpoint, verify
from sdadapt.cli import main
from sdadapt.errors import VerifyError
from sdadapt.rules import Rotary

CFG = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, hidden_dim=64, norm_eps=1e-6, rope_theta=10000.0)

BUILD_PY = f"""
import sys
sys.path.insert(0, {str(TESTS_DIR)!r})
import torch
from support.reference_models import MetaLlama

CFG = {CFG!r}


def build(fused_qkv=False):
    with torch.device("meta"):
        return MetaLlama({{**CFG, "fused_qkv": fused_qkv}})


class Buffered(MetaLlama):
    # MetaLlama whose logits pass through a non-persistent buffer (a stand-in for a rotary table)

    def __init__(self, cfg):
        super().__init__(cfg)
        self.register_buffer("logit_scale", torch.ones(()), persistent=False)

    def forward(self, tokens):
        return super().forward(tokens) * self.logit_scale


def build_buffered():
    with torch.device("meta"):
        return Buffered(CFG)


def fill(model):
    model.logit_scale.fill_(1.0)


def fill_wrong(model):
    model.logit_scale.fill_(1.001)
"""


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("verify")
    cfg = LlamaConfig(hidden_size=CFG["dim"], intermediate_size=CFG["hidden_dim"], num_hidden_layers=CFG["n_layers"],
                      num_attention_heads=CFG["n_heads"], num_key_value_heads=CFG["n_kv_heads"],
                      vocab_size=CFG["vocab_size"], rms_norm_eps=CFG["norm_eps"], rope_theta=CFG["rope_theta"],
                      tie_word_embeddings=False)  # fmt: skip
    assert cfg.rope_parameters["rope_theta"] == CFG["rope_theta"]
    torch.manual_seed(0)
    hf = LlamaForCausalLM(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # weights large enough that a wrong row order shows in the logits
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.2 * noise)
    path = root / "hf"
    hf.save_pretrained(path)
    reference_py = "def reference():\n    from transformers import LlamaForCausalLM\n\n"
    reference_py += f"    return LlamaForCausalLM.from_pretrained({str(path)!r})\n"
    (root / "build.py").write_text(BUILD_PY + "\n\n" + reference_py)
    wrong = sdadapt.get_adapter("llama", source=str(path))
    no_rotary = sdadapt.Adapter([r for r in wrong.rules if not isinstance(r, Rotary)], name="llama-without-rotary")
    assert len(no_rotary.rules) == len(wrong.rules) - 2
    (root / "no_rotary.json").write_text(no_rotary.to_json())
    return dict(path=str(path), build=f"{root / 'build.py'}:build", no_rotary=str(root / "no_rotary.json"),
                py=str(root / "build.py"))


def _model(fused_qkv: bool = False) -> Any:
    from support.reference_models import MetaLlama

    with torch.device("meta"):
        return MetaLlama({**CFG, "fused_qkv": fused_qkv})


def test_verify_pass_and_fail(case: dict[str, str]) -> None:
    reference = reference_from_checkpoint(case["path"])
    assert type(reference).__name__ == "LlamaForCausalLM"
    model = _model()
    sdadapt.load(model, case["path"], sdadapt.get_adapter("llama", source=case["path"]))
    rep = verify(model, reference)
    assert rep.passed and rep.max_abs_diff < 1e-4 and rep.kl < 1e-8 and rep.tokens == [2, 16]
    assert rep.format().startswith("PASS")

    bad = _model()
    sdadapt.load(bad, case["path"], sdadapt.Adapter.from_json(Path(case["no_rotary"]).read_text()))
    rep = verify(bad, reference)
    assert not rep.passed and rep.max_abs_diff > 0.1 and rep.format().startswith("FAIL")
    # a measure: identical logits give 0, 0; shapes must agree
    x = torch.randn(2, 3, 5)
    assert compare_logits(x, x) == (0.0, 0.0)
    with pytest.raises(VerifyError, match="logits are"):
        compare_logits(x, x[:, :2])


def test_cli_single_process(case: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", case["path"], "--model", case["build"], "--adapter", "llama"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("PASS  MetaLlama vs LlamaForCausalLM"), out
    assert main(["verify", case["path"], "--model", case["build"], "--adapter", case["no_rotary"]]) == 1
    assert capsys.readouterr().out.startswith("FAIL")
    reference = case["build"].replace(":build", ":reference")  # any module:function returning a model
    assert main(["verify", case["path"], "--model", case["build"], "--adapter", "llama", "--reference", reference, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["passed"] is True
    # usage errors: exit 2 with a message
    assert main(["verify", case["path"], "--model", case["build"], "--adapter", "llama", "--mesh", "tp=2"]) == 2
    assert "torchrun" in capsys.readouterr().err
    os.rename(os.path.join(case["path"], "config.json"), os.path.join(case["path"], "config.moved"))
    try:
        assert main(["verify", case["path"], "--model", case["build"], "--adapter", "llama", "-O", "n_heads=4", "-O", "n_kv_heads=2"]) == 2
        assert "--reference" in capsys.readouterr().err
    finally:
        os.rename(os.path.join(case["path"], "config.moved"), os.path.join(case["path"], "config.json"))


def test_cli_verdict_once_and_layers(case: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    """A FAIL prints its verdict once (stdout), with the layer table and the first difference."""
    assert main(["verify", case["path"], "--model", case["build"], "--adapter", case["no_rotary"]]) == 1
    cap = capsys.readouterr()
    assert cap.out.count("FAIL") == 1 and "FAIL" not in cap.err, (cap.out, cap.err)
    assert "first difference: layers.0" in cap.out and "layers.0.attention" in cap.out, cap.out
    # the localisation knows the adapter: it has no rotary rule for the tensors that explain the difference
    assert "Rotary order of wq/wk undecided" in cap.out and "adapter 'llama-without-rotary' has no rotary rule" in cap.out


def test_cli_init_buffers(case: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    """A model with a non-persistent buffer: the error names --init-buffers, which then works."""
    build = f"{case['py']}:build_buffered"
    assert main(["verify", case["path"], "--model", build, "--adapter", "llama"]) == 2
    assert "--init-buffers" in capsys.readouterr().err
    assert main(["verify", case["path"], "--model", build, "--adapter", "llama", "--init-buffers", f"{case['py']}:fill"]) == 0
    assert capsys.readouterr().out.startswith("PASS")
    # a buffer 0.1% off is a wrong model: the dtype's tolerance catches it, a fixed atol 1e-3 would not
    wrong = ["verify", case["path"], "--model", build, "--adapter", "llama", "--init-buffers", f"{case['py']}:fill_wrong"]
    assert main(wrong) == 1
    out = capsys.readouterr().out
    assert "every decoder layer's output agrees" in out, out
    assert main([*wrong, "--atol", "1e-2"]) == 0
    assert main(["verify", case["path"], "--model", build, "--adapter", "llama", "--init-buffers", f"{case['py']}:CFG"]) == 2
    assert "names no function" in capsys.readouterr().err


def _swap_norms(model: Any, layer: int) -> None:
    blk = model.layers[layer]
    with torch.no_grad():
        a = blk.attention_norm.weight.clone()
        blk.attention_norm.weight.copy_(blk.ffn_norm.weight)
        blk.ffn_norm.weight.copy_(a)


def test_verify_fails_subtle_wrong_loads(tmp_path: Path) -> None:
    """Wrong loads whose logits move by less than 1e-3 (norms near 1, small weights) still FAIL,
    and the report names the first layer and module that disagree; the right load PASSes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=96, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(1)
    hf = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.003 * torch.randn_like(p) if "norm" in name else 0.02 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    adapter = sdadapt.get_adapter("llama", source=str(tmp_path))

    def loaded() -> Any:
        m = _model_cfg(dict(CFG, n_layers=3))
        sdadapt.load(m, str(tmp_path), adapter)
        return m

    right = verify(loaded(), hf)
    assert right.passed and right.dtype == "float32" and right.max_abs_diff < 1e-6, right.format()
    assert len(right.layers) == 3 and all(x.ok for x in right.layers)

    swapped = loaded()
    _swap_norms(swapped, 2)
    rep = verify(swapped, hf)
    assert not rep.passed and rep.max_abs_diff < 1e-3, rep.format()  # a fixed atol of 1e-3 would have passed it
    assert [x.ok for x in rep.layers] == [True, True, False]
    assert rep.first_difference and rep.first_difference.startswith("layers.2 "), rep.first_difference
    assert "layers.2.attention_norm.weight" in rep.first_difference
    assert "FAIL" in rep.format() and "DIFFERS" in rep.format()

    flipped = loaded()
    with torch.no_grad():
        w = flipped.layers[1].feed_forward.w2.weight
        w.copy_(w.flip(1))  # the down projection reads the hidden features in reverse
    rep = verify(flipped, hf)
    assert not rep.passed and [x.ok for x in rep.layers] == [True, False, False], rep.format()
    assert "layers.1.feed_forward.w2.weight" in (rep.first_difference or ""), rep.first_difference
    # an explicit tolerance is taken as given
    assert verify(swapped, hf, atol=1e-2).passed
    assert not verify(swapped, hf, layers=False).layers


def _model_cfg(cfg: dict[str, Any]) -> Any:
    from support.reference_models import MetaLlama

    with torch.device("meta"):
        return MetaLlama(cfg)


def _dist_cli(case: dict[str, str]) -> dict[str, int]:
    common = ["verify", case["path"], "--model", case["build"], "--parallelize", "support.reference_models:parallelize_meta_llama"]
    return {
        "fsdp_vs_hf": main([*common, "--adapter", "llama", "--mesh", "fsdp=2"]),
        "tp_vs_hf": main([*common, "--adapter", "llama", "--mesh", "tp=2"]),
        "fused_parity": main([*common, "--adapter", "llama", "-O", "fused_qkv=true", "--model-option", "fused_qkv=true",
                              "--mesh", "tp=2", "--parity-mesh", "fsdp=2"]),  # fmt: skip
        # tp=1: fused rows not interleaved for 2 TP ranks; the FSDP copy does not notice, TP does
        "fused_not_interleaved": main([*common, "--adapter", "llama", "-O", "fused_qkv=true", "-O", "tp=1",
                                       "--model-option", "fused_qkv=true", "--mesh", "tp=2", "--parity-mesh", "fsdp=2"]),  # fmt: skip
        "mesh_too_big": main([*common, "--adapter", "llama", "--mesh", "fsdp=4"]),
        "parity_too_big": main([*common, "--adapter", "llama", "--mesh", "fsdp=2", "--parity-mesh", "tp=2,fsdp=2"]),
    }


def test_cli_under_two_ranks(case: dict[str, str]) -> None:
    results = run_distributed(_dist_cli, 2, case, timeout=300)
    for r in results:
        assert r == {"fsdp_vs_hf": 0, "tp_vs_hf": 0, "fused_parity": 0, "fused_not_interleaved": 1, "mesh_too_big": 2,
                     "parity_too_big": 2}, r


def test_localisation_names_the_inputs_that_explain_it(case: dict[str, str]) -> None:
    """A load without the rotary rules: the first module whose output differs is wo, but its input
    differs already; the report names wq/wk/wv as the inputs, finds by experiment that the rotary
    order of wq/wk explains it, says whether the adapter decided it, and the rules it suggests
    make the load pass. A model that keeps HF's order, loaded with a rotary rule, gets the
    rule named."""
    import re

    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(case["path"]).eval()
    no_rotary = sdadapt.Adapter.from_json(Path(case["no_rotary"]).read_text())
    model = _model()
    sdadapt.load(model, case["path"], no_rotary)
    rep = verify(model, hf, adapter=no_rotary)
    text = rep.first_difference or ""
    assert not rep.passed and text.startswith("layers.0 "), text
    assert "layers.0.attention.wo's output and input match nothing" in text and "weights are not the cause" in text, text
    assert "from the outputs of layers.0.attention.wq, wk, wv" in text, text
    assert "check the mapping of layers.0.attention.wo" not in text, text
    assert ("Rotary order of wq/wk undecided: with the rows of wq/wk reordered per head (8 rows) from half to "
            "interleaved rotary order, the layer equals the reference's, and adapter 'llama-without-rotary' has no "
            "rotary rule for layers.{i}.attention.wq.weight, layers.{i}.attention.wk.weight") in text, text
    fix = re.findall(r'sdadapt\.rotary\([^)]*\)', text)
    assert fix == ['sdadapt.rotary("layers.{i}.attention.wq.weight", heads=4, to="interleaved")',
                   'sdadapt.rotary("layers.{i}.attention.wk.weight", heads=2, to="interleaved")'], text
    fixed = _model()
    sdadapt.load(fixed, case["path"], no_rotary + sdadapt.Adapter([eval(f, {"sdadapt": sdadapt}) for f in fix]))  # noqa: S307
    assert verify(fixed, hf).passed
    # without the adapter: the same experiment, the rules an adapter needs
    plain = verify(model, hf).first_difference or ""
    assert "Rotary order of wq/wk: with the rows of wq/wk reordered" in plain and "an adapter loading it right has" in plain
    # a draft's adapter: its open question is named
    d = sdadapt.draft(_model(), case["path"], reference=None)
    drafted = _model()
    sdadapt.load(drafted, case["path"], d.adapter)
    assert "(the draft left it open: its DECIDE 'rotary row order')" in (verify(drafted, hf, adapter=d.adapter).first_difference or "")
    # a model that keeps HF's half order, loaded with the shipped adapter's rotary rules: those rules are named
    from support.draft_natives import Native, native_config

    cfg = json.loads((Path(case["path"]) / "config.json").read_text())
    with torch.device("meta"):
        half = Native(native_config(cfg, "half")).eval()
    llama = sdadapt.get_adapter("llama", source=case["path"])
    sdadapt.load(half, case["path"], llama)
    text = verify(half, hf, adapter=llama).first_difference or ""
    rules = [f"#{i} rotary(to='interleaved')" for i, r in enumerate(llama.rules) if isinstance(r, Rotary)]
    assert f"adapter 'llama''s rule(s) {', '.join(rules)} on them give an order the model does not read" in text, text
    assert 'to="half"' in text, text


def test_localisation_without_an_explaining_layout_names_the_inputs(case: dict[str, str]) -> None:
    """A model computing rotary with another theta than the checkpoint's family: wo's input differs,
    no row order explains it; the report names wq/wk/wv and their parameters as the inputs, and a
    setting that differs as the other cause."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(case["path"]).eval()
    model = _model_cfg(dict(CFG, rope_theta=500.0))
    llama = sdadapt.get_adapter("llama", source=case["path"])
    sdadapt.load(model, case["path"], llama)
    text = verify(model, hf, adapter=llama).first_difference or ""
    assert "from the outputs of layers.0.attention.wq, wk, wv" in text and "Rotary order" not in text, text
    assert "a setting that differs (rope theta, scaling)" in text, text
    assert ("check the mapping of layers.0.attention.wq.weight, layers.0.attention.wk.weight, "
            "layers.0.attention.wv.weight") in text, text


def test_localisation_names_an_undecided_norm_offset(tmp_path: Path) -> None:
    """A Gemma checkpoint (norms store w for x_hat * (1 + w)) drafted headers only into a model whose
    norms multiply by their weight: the first module that differs is layer 0's first norm, whose
    input agrees; with 1 added to its weight it equals the reference's, and the draft's adapter has
    no affine rule for it: the report says so and names the rule."""
    from support.draft_natives import Native, native_config, read_config, save_hf

    path, hf = save_hf("gemma", tmp_path, seed=4)
    cfg = native_config(read_config(path), "interleaved")

    def native() -> Any:
        with torch.device("meta"):
            return Native(cfg).eval()

    d = sdadapt.draft(native(), path, reference=None)
    assert any(q.question.startswith("norm offset") for q in d.questions), d.format()
    model = native()
    sdadapt.load(model, path, d.adapter)
    text = verify(model, hf.eval(), adapter=d.adapter).first_difference or ""
    assert text.startswith("layers.0 ") and "layers.0.attention_norm's output matches no output" in text, text
    assert ("Norm offset of layers.0.attention_norm.weight: with 1 added to it, its output equals the reference's" in text
            and "norm offset undecided: adapter 'draft' has no affine rule for layers.{i}.attention_norm.weight (the "
            "draft left it open: its DECIDE 'norm offset'); add sdadapt.affine(\"layers.{i}.attention_norm.weight\", "
            "shift=1.0)") in text, text
