"""``sdadapt draft`` with a reference on twelve more transformers families, none tuned for.

Checkpoints are ``save_pretrained`` files of tiny transformers 5.x models (Mistral, Helium,
Granite, OLMo2, StableLM, Cohere, Phi, GPT-NeoX, Starcoder2, GLM, Mixtral, Qwen2-MoE) with every
weight random and every norm and bias perturbed; targets are :class:`draft_natives2.Native2`
(torchtitan's names, Meta's interleaved rotary on the rotating rows). What sets each apart:
post-norm and q/k norms over the whole projection (OLMo2), config multipliers (Granite),
partial rotary (StableLM, Phi, GPT-NeoX, GLM), parallel blocks (Cohere, Phi, GPT-NeoX), a
per-head fused qkv (GPT-NeoX), rotary that HF already interleaves (Cohere, GLM), LayerNorm with
biases and non-gated MLPs (StableLM, Phi, GPT-NeoX, Starcoder2), a fused gate|up (GLM), MoE with
a shared expert (Qwen2-MoE).

For each family the draft with ``reference="config"`` must load, without any edit, every key
equal to the one a hand-written mapping (here, written from the families' code) loads, flag
nothing it could not prove, and give logits equal to transformers'. The draft without a
reference is loaded as well: wherever it loads a wrong key, ``sdadapt.verify`` must FAIL.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import sdadapt
from sdadapt._plan.resolve import resolve_adapter

pytest.importorskip("transformers", reason="the test extra installs transformers")

from support.draft_natives import perturb  # noqa: E402
from support.draft_natives2 import FAMILIES, Native2, more_configs, native2_config  # noqa: E402

HALF = {"mistral", "granite", "olmo2", "stablelm", "phi", "gpt_neox", "starcoder2", "mixtral", "qwen2_moe"}
"""Families whose HF code keeps rotary rows in "half" order (the others, Helium, Cohere and GLM, already
interleave: their ``rotate_half`` pairs rows 2j and 2j + 1)."""


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, nn.Module]]:
    import transformers as T

    root = tmp_path_factory.mktemp("families_more")
    out = {}
    for i, (family, cfg) in enumerate(more_configs().items()):
        torch.manual_seed(100 + i)
        model = T.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
        perturb(model, 100 + i)
        model.save_pretrained(root / family)
        out[family] = (root / family, model)
    return out


def _native(path: Path) -> nn.Module:
    with torch.device("meta"):
        return Native2(native2_config(json.loads((path / "config.json").read_text()))).eval()


def hand_adapter(family: str, cfg: dict[str, Any]) -> sdadapt.Adapter:
    """The mapping written by hand from each family's modeling code."""
    c = native2_config(cfg)
    a = "layers.{i}.attention."
    r: list[Any] = []
    if family == "gpt_neox":
        h = "gpt_neox.layers.{i}."
        r += [sdadapt.rename("gpt_neox.embed_in.weight", "tok_embeddings.weight"),
              sdadapt.rename("embed_out.weight", "output.weight"),
              sdadapt.rename("gpt_neox.final_layer_norm.{p}", "norm.{p}"),
              sdadapt.split(h + "attention.query_key_value.{p}", [a + "wq.{p}", a + "wk.{p}", a + "wv.{p}"], heads=c["heads"]),
              sdadapt.rename(h + "attention.dense.{p}", a + "wo.{p}"),
              sdadapt.rename(h + "input_layernorm.{p}", "layers.{i}.attention_norm.{p}"),
              sdadapt.rename(h + "post_attention_layernorm.{p}", "layers.{i}.ffn_norm.{p}"),
              sdadapt.rename(h + "mlp.dense_h_to_4h.{p}", "layers.{i}.feed_forward.w1.{p}"),
              sdadapt.rename(h + "mlp.dense_4h_to_h.{p}", "layers.{i}.feed_forward.w2.{p}")]  # fmt: skip
    else:
        h = "model.layers.{i}."
        r += [sdadapt.rename("model.embed_tokens.weight", "tok_embeddings.weight"),
              sdadapt.rename("model.final_layernorm.{p}" if family == "phi" else "model.norm.{p}", "norm.{p}")]
        r.append(sdadapt.tie("output.weight", "tok_embeddings.weight") if family in ("cohere", "starcoder2")
                 else sdadapt.rename("lm_head.{p}", "output.{p}"))
        qk_norms = (("q_norm", "q_norm"), ("k_norm", "k_norm")) if family == "olmo2" else ()
        for hf, native in (("q_proj", "wq"), ("k_proj", "wk"), ("v_proj", "wv"),
                           ("dense" if family == "phi" else "o_proj", "wo"), *qk_norms):
            r.append(sdadapt.rename(h + f"self_attn.{hf}.{{p}}", a + f"{native}.{{p}}"))
        norms = {"olmo2": {"post_attention_layernorm": "post_attention_norm", "post_feedforward_layernorm": "post_ffn_norm"},
                 "cohere": {"input_layernorm": "attention_norm"}, "phi": {"input_layernorm": "attention_norm"}}.get(
            family, {"input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm"})
        r += [sdadapt.rename(h + f"{hf}.{{p}}", f"layers.{{i}}.{native}.{{p}}") for hf, native in norms.items()]
        f = "layers.{i}.feed_forward."
        if family == "phi":
            r += [sdadapt.rename(h + "mlp.fc1.{p}", f + "w1.{p}"), sdadapt.rename(h + "mlp.fc2.{p}", f + "w2.{p}")]
        elif family == "starcoder2":
            r += [sdadapt.rename(h + "mlp.c_fc.{p}", f + "w1.{p}"), sdadapt.rename(h + "mlp.c_proj.{p}", f + "w2.{p}")]
        elif family == "glm":
            r += [sdadapt.split(h + "mlp.gate_up_proj.weight", [f + "w1.weight", f + "w3.weight"]),
                  sdadapt.rename(h + "mlp.down_proj.weight", f + "w2.weight")]
        elif family == "mixtral":
            m, e = h + "block_sparse_moe.", "layers.{i}.moe."
            r += [sdadapt.rename(m + "gate.weight", e + "router.gate.weight")]
            r += [sdadapt.stack(m + f"experts.{{e}}.{w}.weight", e + f"experts.{w}") for w in ("w1", "w2", "w3")]
        elif family == "qwen2_moe":
            m, e = h + "mlp.", "layers.{i}.moe."
            r += [sdadapt.rename(m + "gate.weight", e + "router.gate.weight"),
                  sdadapt.rename(m + "shared_expert_gate.weight", e + "shared_gate.weight")]
            for hf, native in (("gate_proj", "w1"), ("down_proj", "w2"), ("up_proj", "w3")):
                r += [sdadapt.stack(m + f"experts.{{e}}.{hf}.weight", e + f"experts.{native}"),
                      sdadapt.rename(m + f"shared_expert.{hf}.weight", e + f"shared_experts.{native}.weight")]
        else:
            r += [sdadapt.rename(h + f"mlp.{hf}.weight", f + f"{native}.weight")
                  for hf, native in (("gate_proj", "w1"), ("down_proj", "w2"), ("up_proj", "w3"))]
    if family in HALF:
        frac = c["rot_dim"] / c["head_dim"]
        rd = None if frac == 1 else frac
        r += [sdadapt.rotary([a + "wq.weight", a + "wq.bias"], c["heads"], rotary_dim=rd),
              sdadapt.rotary([a + "wk.weight", a + "wk.bias"], c["kv_heads"], rotary_dim=rd)]
        if family == "olmo2":
            r.append(sdadapt.rotary([a + "q_norm.weight", a + "k_norm.weight"], head_dim=c["head_dim"]))
    return sdadapt.Adapter(r, name=f"hand-{family}")


def _loaded(path: Path, adapter: sdadapt.Adapter) -> nn.Module:
    model = _native(path)
    sdadapt.load(model, path, adapter)
    return model


def _decided(d: Any) -> dict[str, int]:
    out = {"names/shapes": 0, "numbers": 0}
    for p in d.proposals:
        out["numbers" if any(e.startswith("checked numerically") for e in p.evidence) else "names/shapes"] += p.keys
    return out


ROWS: dict[str, str] = {}


@pytest.mark.parametrize("family", FAMILIES)
def test_numerical_draft_on_untuned_family(family: str, ckpts: dict[str, tuple[Path, nn.Module]]) -> None:
    path, hf = ckpts[family]
    cfg = json.loads((path / "config.json").read_text())
    hand = _loaded(path, hand_adapter(family, cfg))
    hand_rep = sdadapt.verify(hand, hf)
    assert hand_rep.passed, (family, "the hand mapping or the native decoder is wrong", hand_rep.format())

    d = sdadapt.draft(_native(path), path, reference="config")
    assert d.related and d.report.ok, d.format()
    assert d.report.values_checked, d.format()
    ns: dict[str, Any] = {}
    exec(d.module, ns)  # noqa: S102 - the drafted module, as the user gets it
    assert ns["ADAPTER"].to_json() == d.adapter.to_json()
    got = _loaded(path, d.adapter)
    want = hand.state_dict()
    wrong = [k for k, v in got.state_dict().items() if not torch.equal(v, want[k])]
    flagged = bool(d.uncertain or d.questions)
    assert not wrong or flagged, (family, "silently wrong keys", wrong, d.format())
    assert not wrong and not flagged, (family, wrong, d.format())  # with a reference: right, nothing left open
    assert sdadapt.verify(got, hf).passed

    plain = sdadapt.draft(_native(path), path, reference=None)
    assert any("values unproven" in s for s in plain.summary), plain.summary
    unchecked = _loaded(path, plain.adapter)
    plain_wrong = [k for k, v in unchecked.state_dict().items() if not torch.equal(v, want[k])]
    rep = sdadapt.verify(unchecked, hf)
    assert rep.passed == (not plain_wrong), (family, plain_wrong, rep.format())  # verify fails every wrong load
    decided = _decided(d)
    ROWS[family] = (f"{family}: {len(want)} keys; with reference: {decided['numbers']} checked numerically, "
                    f"{len(d.uncertain)} uncertain, {len(d.questions)} open, wrong 0; without: "
                    f"{len(plain_wrong)} wrong keys, {len(plain.uncertain)} uncertain, {len(plain.questions)} DECIDE, "
                    f"verify {'PASS' if rep.passed else 'FAIL'}")
    print(ROWS[family])


def test_without_reference_the_unproven_rules_are_listed(ckpts: dict[str, tuple[Path, nn.Module]]) -> None:
    """GPT-NeoX's draft without a reference splits query_key_value as parts one after the other
    (wrong: it is fused per head); the draft names that split, and the rotary choice, as unproven."""
    path, _ = ckpts["gpt_neox"]
    d = sdadapt.draft(_native(path), path, reference=None)
    text = "\n".join(d.summary)
    assert "unproven: layout of gpt_neox.layers.{i}.attention.query_key_value.{p}" in text, text
    assert "fused per head group (4 groups" in text and "unproven: rotary" in text, text
    split = next(p for p in d.proposals if p.kind == "split")
    assert any(e.startswith("unproven: layout of") for e in split.evidence), split.evidence


def test_cli_draft_with_reference(ckpts: dict[str, tuple[Path, nn.Module]], tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    """``sdadapt draft SRC --target T --reference config -o FILE``: the module it writes loads
    right values as it is; ``--reference`` with a checkpoint as the target is a usage error."""
    from sdadapt.cli import main

    path, hf = ckpts["phi"]
    build = tmp_path / "build.py"
    build.write_text(
        "import json, sys, torch\n"
        f"sys.path.insert(0, {str(Path(__file__).parent.parent)!r})\n"
        "from support.draft_natives2 import Native2, native2_config\n\n\n"
        "def build():\n"
        f"    cfg = json.loads(open({str(path / 'config.json')!r}).read())\n"
        "    with torch.device('meta'):\n"
        "        return Native2(native2_config(cfg))\n"
    )
    out = tmp_path / "phi_adapter.py"
    assert main(["draft", str(path), "--target", f"{build}:build", "--reference", "config", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "values checked" in printed and "checked numerically" in out.read_text(), printed
    adapter = resolve_adapter(f"{out}:ADAPTER")
    assert sdadapt.verify(_loaded(path, adapter), hf).passed
    assert main(["draft", str(path), "--target", str(path), "--reference", "config"]) == 2
    assert "--reference needs the model" in capsys.readouterr().err


def test_per_head_fused_source_into_a_fused_target(ckpts: dict[str, tuple[Path, nn.Module]]) -> None:
    """GPT-NeoX's query_key_value ([heads, 3, head_dim], half-order partial rotary) into a target
    with one contiguous ``wqkv`` [q; k; v] and interleaved rotary: names say "rename as it is";
    the experiment finds split per head -> rotary on q and k -> fuse. Values equal the eager
    transform; logits equal transformers'."""
    path, hf = ckpts["gpt_neox"]
    cfg = native2_config(json.loads((path / "config.json").read_text()))
    c = {**cfg, "fused_qkv": True}
    with torch.device("meta"):
        target = Native2(c).eval()
    d = sdadapt.draft(target, path, reference="config")
    assert d.report.ok and d.report.values_checked and not d.uncertain and not d.questions, d.format()
    with torch.device("meta"):
        got = Native2(c).eval()
    sdadapt.load(got, path, d.adapter)
    assert sdadapt.verify(got, hf).passed
    h, hd, rd = c["heads"], c["head_dim"], c["rot_dim"]
    w = hf.state_dict()["gpt_neox.layers.0.attention.query_key_value.weight"].view(h, 3, hd, -1)

    def meta_rows(t: torch.Tensor) -> torch.Tensor:  # [h, hd, D]: the first rd rows half -> interleaved
        rot = t[:, :rd].reshape(h, 2, rd // 2, -1).transpose(1, 2).reshape(h, rd, -1)
        return torch.cat([rot, t[:, rd:]], 1).reshape(h * hd, -1)

    want = torch.cat([meta_rows(w[:, 0]), meta_rows(w[:, 1]), w[:, 2].reshape(h * hd, -1)])
    assert torch.equal(got.layers[0].attention.wqkv.weight, want)
    plain = sdadapt.draft(target, path, reference=None)  # without the reference: the rename is listed as unproven
    assert any("unproven: layout of gpt_neox.layers.{i}.attention.query_key_value" in s for s in plain.summary), plain.summary
