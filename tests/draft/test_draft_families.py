"""``sdadapt draft`` on families sdadapt ships no adapter for: right, or says it is unsure.

Checkpoints are ``save_pretrained`` files of transformers 5.x tiny models (Qwen2, Qwen3,
Qwen3-MoE, Phi-3, Gemma, Gemma2, DeepSeek-V3, GPT-OSS) with every norm and bias perturbed (HF
initialises them to 1 and 0, which hides layout mistakes). Targets are native, torchtitan-style
modules (:mod:`draft_natives`), with Meta's interleaved rotary where noted.

For the six families whose native decoder runs here, a user's review is replayed: the drafted
rules are kept, except the ones marked UNCERTAIN, which are replaced by the right mapping (the
test knows it; a wrong rule that is *not* marked fails the logits check), and the DECIDE rules
the target needs are enabled. The resulting adapter must give logits equal to transformers' in
one process and on a 2-rank FSDP2 mesh. DeepSeek-V3 and GPT-OSS are checked against the keys and
values of their native layout (no native forward here), and a fake FP8 checkpoint gets a
dequantisation, never a cast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import sdadapt
from sdadapt.sources import TensorInfo

pytest.importorskip("transformers", reason="the test extra installs transformers")

from support.dist_helper import run_distributed  # noqa: E402
from support.draft_natives import Native, logits_hf, native_config, read_config, save_hf, tokens  # noqa: E402

ROTARY = {"qwen2": "interleaved", "qwen3": "interleaved", "qwen3_moe": "half", "phi3": "interleaved",
          "gemma": "interleaved", "gemma2": "interleaved"}  # fmt: skip
"""Rotary layout of each family's native target (Qwen3-MoE keeps HF's half order, as torchtitan's Qwen3)."""

NORM_NAMES = {
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
    "norm": "norm",
}
GEMMA2_NORM_NAMES = {
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffn_norm",
}
"""The right native name of each HF norm: what a reviewer puts in place of an UNCERTAIN guess."""


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.Tensor]]:
    root = tmp_path_factory.mktemp("families")
    out = {}
    for i, family in enumerate(["qwen2", "qwen3", "qwen3_moe", "phi3", "gemma", "gemma2", "deepseek_v3", "gpt_oss"]):
        path, model = save_hf(family, root, seed=i)
        ref = logits_hf(model, tokens(model.config.vocab_size)) if family in ROTARY else torch.empty(0)
        out[family] = (path, ref)
    return out


def _native(family: str, path: Path) -> nn.Module:
    with torch.device("meta"):
        return Native(native_config(read_config(path), ROTARY[family])).eval()


def _norm_truth(family: str, src: str) -> str:
    names = GEMMA2_NORM_NAMES if family == "gemma2" else NORM_NAMES
    seg = src.split(".")[-2]
    assert seg in names, f"{family}: UNCERTAIN guess on {src} that no reviewer rule covers"
    return f"layers.{{i}}.{names[seg]}.weight"


def reviewed_adapter(family: str, d: Any) -> tuple[sdadapt.Adapter, list[str]]:
    """The draft as a reviewer finishes it: UNCERTAIN renames replaced by the right ones, DECIDE
    rules enabled where the native target needs them. Also returns the norm keys that need
    Gemma's ``+ 1`` when ``sdadapt.affine`` is not available to do it."""
    uncertain = {c for p in d.uncertain for c in p.code}
    for p in d.uncertain:
        assert p.kind == "rename" and len(p.sources) == 1, f"{family}: unexpected UNCERTAIN {p.kind} {p.sources}"
    rules = []
    for p in d.proposals:
        for code, rule in zip(p.code, _rules_of(d, p), strict=True):
            if code in uncertain:
                rule = sdadapt.rename(p.sources[0], _norm_truth(family, p.sources[0]))
            rules.append(rule)
    plus_one: list[str] = []
    for q in d.questions:
        lines = [s.rstrip(",") for s in q.suggestion if s.startswith("sdadapt.")]
        if q.question.startswith("rotary row order"):
            if ROTARY[family] == "interleaved":  # a half-order target declines it
                rules += [eval(s, {"sdadapt": sdadapt}) for s in lines]  # noqa: S307 - the draft's own suggestions
        elif q.question.startswith("norm offset"):
            if hasattr(sdadapt, "affine"):
                rules += [eval(s, {"sdadapt": sdadapt}) for s in lines]  # noqa: S307
            else:
                plus_one += q.about
        else:
            pytest.fail(f"{family}: unexpected question {q.question}")
    return sdadapt.Adapter(rules, name=f"reviewed-{family}"), plus_one


def _rules_of(d: Any, p: Any) -> list[Any]:
    """The rule objects of proposal ``p`` (its code lines, in the adapter's order)."""
    start = sum(len(q.code) for q in d.proposals[: d.proposals.index(p)])
    return list(d.adapter.rules[start : start + len(p.code)])


def _add_one(model: nn.Module, patterns: list[str]) -> None:
    """What ``affine(..., shift=1.0)`` does, applied eagerly to the loaded model."""
    import re

    regs = [re.compile("^" + re.escape(p).replace(r"\{i\}", r"\d+") + "$") for p in patterns]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(r.match(name) for r in regs):
                p.add_(1.0)


NUMERIC = list(ROTARY)


@pytest.mark.parametrize("family", NUMERIC)
def test_reviewed_draft_loads_logits_equal_to_transformers(family: str, ckpts: dict) -> None:
    path, ref = ckpts[family]
    d = sdadapt.draft(_native(family, path), path, reference=None)
    assert d.related and d.report.ok, d.format()
    ns: dict[str, Any] = {}
    exec(d.module, ns)  # noqa: S102 - the drafted module is what the user edits
    assert ns["ADAPTER"].to_json() == d.adapter.to_json()
    if family in ("gemma", "gemma2"):
        assert any(q.question.startswith("norm offset") for q in d.questions), d.format()
    adapter, plus_one = reviewed_adapter(family, d)
    model = _native(family, path)
    sdadapt.load(model, path, adapter)
    _add_one(model, plus_one)
    with torch.no_grad():
        out = model(tokens(model.c["vocab"]))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_evidence_is_true_and_ties_are_uncertain(ckpts: dict) -> None:
    path, _ = ckpts["gemma2"]
    d = sdadapt.draft(_native("gemma2", path), path, reference=None)
    norms = [p for p in d.proposals if p.kind == "rename" and "layernorm" in p.sources[0] and "layers" in p.sources[0]]
    assert len(norms) == 4
    for p in norms:
        right = _norm_truth("gemma2", p.sources[0]) == p.targets[0]
        assert right or p.uncertain, p
        assert not any("the only candidates of this shape" in e for e in p.evidence), p.evidence
        if p.uncertain:
            assert any("fits as well" in e for e in p.evidence), p.evidence
    q3 = sdadapt.draft(_native("qwen3", ckpts["qwen3"][0]), ckpts["qwen3"][0], reference=None)
    rotary = [q for q in q3.questions if q.question.startswith("rotary row order")]
    assert len(rotary) == 1
    assert sorted(rotary[0].suggestion) == sorted([
        'sdadapt.rotary("layers.{i}.attention.wq.weight", heads=4, to="interleaved"),',
        'sdadapt.rotary("layers.{i}.attention.wk.weight", heads=2, to="interleaved"),',
        'sdadapt.rotary("layers.{i}.attention.q_norm.weight", head_dim=8, to="interleaved"),',
        'sdadapt.rotary("layers.{i}.attention.k_norm.weight", head_dim=8, to="interleaved"),',
    ])  # fmt: skip


# --- numerical drafting: the draft settles its own questions against transformers' code ---------


@pytest.mark.parametrize("family", NUMERIC)
def test_numerical_draft_loads_right_values_without_review(family: str, ckpts: dict) -> None:
    """With ``reference="config"`` the draft needs no review: no UNCERTAIN rule, no question; every
    rule says it was checked numerically; the drafted adapter as it is loads, key by key, what the
    reviewed draft (hand truths for the norms, the right DECIDE answers) loads, and logits equal
    to transformers'. The unreviewed draft without a reference is a wrong load that
    ``sdadapt.verify`` fails, and the draft says its values are unproven."""
    path, ref = ckpts[family]
    d = sdadapt.draft(_native(family, path), path, reference="config")
    assert d.related and d.report.ok, d.format()
    assert not d.uncertain and not d.questions, d.format()
    assert d.report.values_checked and "values checked" in d.format(), d.format()
    assert all(any(e.startswith("checked numerically") for e in p.evidence) for p in d.proposals), d.format()
    ns: dict[str, Any] = {}
    exec(d.module, ns)  # noqa: S102 - the drafted module is what the user loads
    assert ns["ADAPTER"].to_json() == d.adapter.to_json()
    got = _native(family, path)
    sdadapt.load(got, path, d.adapter)
    plain = sdadapt.draft(_native(family, path), path, reference=None)
    assert any("values unproven" in line for line in plain.summary), plain.summary
    reviewed, plus_one = reviewed_adapter(family, plain)
    want = _native(family, path)
    sdadapt.load(want, path, reviewed)
    _add_one(want, plus_one)
    wrong_keys = [k for k, v in want.state_dict().items() if not torch.equal(got.state_dict()[k], v)]
    assert wrong_keys == [], (family, wrong_keys)
    with torch.no_grad():
        out = got(tokens(got.c["vocab"]))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # the draft without review or reference: where it loads a wrong value, verify fails it
    import transformers as T

    unreviewed = _native(family, path)
    sdadapt.load(unreviewed, path, plain.adapter)
    differ = [k for k, v in want.state_dict().items() if not torch.equal(unreviewed.state_dict()[k], v)]
    hf = T.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    rep = sdadapt.verify(unreviewed, hf)
    assert rep.passed == (not differ), (differ, rep.format())
    assert rep.passed or rep.first_difference, rep.format()
    assert family == "qwen3_moe" or differ  # its native target keeps HF's half order: the raw draft is right
    assert sdadapt.verify(got, hf).passed


def test_numerical_draft_that_matches_nothing_stays_open(ckpts: dict) -> None:
    """A reference that computes something else (a far larger norm epsilon): no candidate agrees,
    so nothing is claimed: the questions stay, the report says values unchecked."""
    from sdadapt._draft.numeric import _hf_reference

    path, _ = ckpts["qwen3"]
    d = sdadapt.draft(_native("qwen3", path), path, reference=lambda cfg: _hf_reference({**cfg, "rms_norm_eps": 10.0}))
    assert any(line.startswith("values unproven: no candidate agreed") for line in d.summary), d.summary
    assert any(q.question.startswith("rotary row order") for q in d.questions)
    assert d.report.values_checked is None and "values unchecked" in d.format()
    # and a target that is a checkpoint, not a model, cannot be checked: said plainly
    d2 = sdadapt.draft(sdadapt.sources.open_source(str(path)).schema, path, reference="config")
    assert any("needs the model itself" in line for line in d2.summary) or not d2.related, d2.summary


# --- families checked against their native layout -----------------------------------------------

def schema_module(shapes: dict[str, tuple[int, ...]]) -> nn.Module:
    """A meta-device module holding a parameter of each shape under each dotted name."""
    root = nn.Module()
    with torch.device("meta"):
        for key, shape in shapes.items():
            *path, leaf = key.split(".")
            mod = root
            for seg in path:
                if not hasattr(mod, seg):
                    mod.add_module(seg, nn.Module())
                mod = getattr(mod, seg)
            mod.register_parameter(leaf, nn.Parameter(torch.empty(shape)))
    return root


def gpt_oss_native(cfg: dict[str, Any]) -> nn.Module:
    d, h, kv, hd, e, f, v = (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
                             cfg["num_local_experts"], cfg["intermediate_size"], cfg["vocab_size"])
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (v, d), "norm.weight": (d,), "output.weight": (v, d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        for name, rows in (("wq", h * hd), ("wk", kv * hd), ("wv", kv * hd)):
            shapes[p + f"attention.{name}.weight"] = (rows, d)
            shapes[p + f"attention.{name}.bias"] = (rows,)
        shapes.update({p + "attention.wo.weight": (d, h * hd), p + "attention.wo.bias": (d,), p + "attention.sinks": (h,),
                       p + "attention_norm.weight": (d,), p + "ffn_norm.weight": (d,),
                       p + "moe.router.gate.weight": (e, d), p + "moe.router.gate.bias": (e,),
                       p + "moe.experts.w1": (e, f, d), p + "moe.experts.w3": (e, f, d), p + "moe.experts.w2": (e, d, f),
                       p + "moe.experts.b1": (e, f), p + "moe.experts.b3": (e, f), p + "moe.experts.b2": (e, d)})
    return schema_module(shapes)


def test_gpt_oss_gate_up_rows_are_deinterleaved(ckpts: dict) -> None:
    from safetensors.torch import load_file

    path, _ = ckpts["gpt_oss"]
    cfg = read_config(path)
    d = sdadapt.draft(gpt_oss_native(cfg), path, reference=None)
    assert d.report.ok, d.format()
    f = cfg["intermediate_size"]
    dein = [r for r in d.adapter.rules if r.kind == "deinterleave"]
    assert {(r.keys, tuple(r.sizes), r.tp, r.dim) for r in dein} >= {
        ("model.layers.{i}.mlp.experts.gate_up_proj", (f, f), f, 2)}, d.module
    model = gpt_oss_native(cfg)
    sdadapt.load(model, path, d.adapter)
    hf = load_file(str(path / "model.safetensors"))
    sd = model.state_dict()
    for i in range(cfg["num_hidden_layers"]):
        gu = hf[f"model.layers.{i}.mlp.experts.gate_up_proj"]  # [E, D, 2F], gate and up alternate along 2F
        assert torch.equal(sd[f"layers.{i}.moe.experts.w1"], gu[..., ::2].transpose(1, 2))
        assert torch.equal(sd[f"layers.{i}.moe.experts.w3"], gu[..., 1::2].transpose(1, 2))
        assert torch.equal(sd[f"layers.{i}.moe.experts.w2"], hf[f"model.layers.{i}.mlp.experts.down_proj"].transpose(1, 2))
        bias = hf[f"model.layers.{i}.mlp.experts.gate_up_proj_bias"]
        b1, b3 = sd[f"layers.{i}.moe.experts.b1"], sd[f"layers.{i}.moe.experts.b3"]
        flagged = {k for p in d.uncertain for k in p.targets}
        if not (torch.equal(b1, bias[:, ::2]) and torch.equal(b3, bias[:, 1::2])):
            assert {"layers.{i}.moe.experts.b1", "layers.{i}.moe.experts.b3"} <= flagged, d.format()


def deepseek_native(cfg: dict[str, Any]) -> nn.Module:
    d, h, v = cfg["hidden_size"], cfg["num_attention_heads"], cfg["vocab_size"]
    ql, kvl, rope, nope, vd = (cfg["q_lora_rank"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"],
                               cfg["v_head_dim"])
    e, f, mf = cfg["n_routed_experts"], cfg["intermediate_size"], cfg["moe_intermediate_size"]
    sf = mf * cfg["n_shared_experts"]
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (v, d), "norm.weight": (d,), "output.weight": (v, d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes.update({p + "attention.wq_a.weight": (ql, d), p + "attention.q_norm.weight": (ql,),
                       p + "attention.wq_b.weight": (h * (nope + rope), ql), p + "attention.wkv_a.weight": (kvl + rope, d),
                       p + "attention.kv_norm.weight": (kvl,), p + "attention.wkv_b.weight": (h * (nope + vd), kvl),
                       p + "attention.wo.weight": (d, h * vd), p + "attention_norm.weight": (d,), p + "ffn_norm.weight": (d,)})
        if i < cfg["first_k_dense_replace"]:
            shapes.update({p + "feed_forward.w1.weight": (f, d), p + "feed_forward.w2.weight": (d, f),
                           p + "feed_forward.w3.weight": (f, d)})
        else:
            shapes.update({p + "moe.router.gate.weight": (e, d), p + "moe.expert_bias": (e,),
                           p + "moe.experts.w13": (e, 2 * mf, d), p + "moe.experts.w2": (e, d, mf),
                           p + "moe.shared_experts.w1.weight": (sf, d), p + "moe.shared_experts.w2.weight": (d, sf),
                           p + "moe.shared_experts.w3.weight": (sf, d)})
    return schema_module(shapes)


def test_deepseek_v3_stacks_then_fuses_experts(ckpts: dict) -> None:
    """Per-expert gate/up on disk, one fused ``w13`` [E, 2F, D] in the model: stack, then fuse."""
    from safetensors.torch import load_file

    path, _ = ckpts["deepseek_v3"]
    cfg = read_config(path)
    d = sdadapt.draft(deepseek_native(cfg), path, reference=None)
    assert d.report.ok, d.format()
    model = deepseek_native(cfg)
    sdadapt.load(model, path, d.adapter)
    hf = load_file(str(path / "model.safetensors"))
    sd = model.state_dict()
    flagged = {k for p in d.uncertain for k in p.targets} | {k for q in d.questions for k in q.about}
    e = cfg["n_routed_experts"]
    p = "model.layers.1.mlp."
    want = {
        "layers.1.moe.experts.w13": torch.cat([torch.stack([hf[f"{p}experts.{j}.{n}_proj.weight"] for j in range(e)])
                                              for n in ("gate", "up")], dim=1),
        "layers.1.moe.experts.w2": torch.stack([hf[f"{p}experts.{j}.down_proj.weight"] for j in range(e)]),
        "layers.1.moe.router.gate.weight": hf[f"{p}gate.weight"],
        "layers.1.moe.expert_bias": hf[f"{p}gate.e_score_correction_bias"],
        "layers.1.moe.shared_experts.w1.weight": hf[f"{p}shared_experts.gate_proj.weight"],
        "layers.0.attention.wq_a.weight": hf["model.layers.0.self_attn.q_a_proj.weight"],
        "layers.0.attention.q_norm.weight": hf["model.layers.0.self_attn.q_a_layernorm.weight"],
        "layers.0.attention.wkv_a.weight": hf["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"],
        "layers.0.attention.kv_norm.weight": hf["model.layers.0.self_attn.kv_a_layernorm.weight"],
        "layers.0.attention.wkv_b.weight": hf["model.layers.0.self_attn.kv_b_proj.weight"],
        "layers.0.attention_norm.weight": hf["model.layers.0.input_layernorm.weight"],
        "layers.0.ffn_norm.weight": hf["model.layers.0.post_attention_layernorm.weight"],
    }  # fmt: skip
    assert any(r.kind == "stack" for r in d.adapter.rules) and any(r.kind == "fuse" for r in d.adapter.rules), d.module
    for key, value in want.items():
        pattern = key.replace("layers.1.", "layers.{i}.").replace("layers.0.", "layers.{i}.")
        assert torch.equal(sd[key], value) or pattern in flagged, (key, d.format())


def test_fp8_scales_get_dequantisation_never_a_cast(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    d_, f_ = 32, 48
    tensors = {}
    for i in range(2):
        tensors.update({f"model.layers.{i}.mlp.up_proj.weight": torch.randn(f_, d_).to(torch.float8_e4m3fn),
                        f"model.layers.{i}.mlp.up_proj.weight_scale_inv": torch.ones(1, 1),
                        f"model.layers.{i}.input_layernorm.weight": torch.ones(d_)})
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v3", "quantization_config": '
                                          '{"quant_method": "fp8", "weight_block_size": [128, 128]}}')
    target = {f"layers.{i}.{name}": TensorInfo(shape, torch.float32) for i in range(2)
              for name, shape in (("feed_forward.w3.weight", (f_, d_)), ("attention_norm.weight", (d_,)))}
    d = sdadapt.draft(target, tmp_path)
    assert not [r for r in d.adapter.rules if r.kind == "cast"], d.module
    q = [q for q in d.questions if q.question.startswith("quantized weights")]
    assert q and any("dequant_fp8" in s for s in q[0].suggestion), d.format()
    assert "DECIDE" in d.format() and "sdadapt.dequant_fp8(" in d.module
    if not hasattr(sdadapt, "dequant_fp8"):
        return
    # enabled, the suggestion loads float(w) * scale (first in the adapter: it acts on checkpoint keys)
    enabled = [eval(s.rstrip(","), {"sdadapt": sdadapt}) for s in q[0].suggestion if s.startswith("sdadapt.")]  # noqa: S307
    adapter = sdadapt.Adapter(enabled + list(d.adapter.rules))
    assert sdadapt.diff(target, tmp_path, adapter).ok
    model = schema_module({k: v.shape for k, v in target.items()})
    sdadapt.load(model, tmp_path, adapter)
    for i in range(2):
        w = tensors[f"model.layers.{i}.mlp.up_proj.weight"].float() * tensors[f"model.layers.{i}.mlp.up_proj.weight_scale_inv"]
        assert torch.equal(model.state_dict()[f"layers.{i}.feed_forward.w3.weight"], w)


# --- the same reviewed adapters on a 2-rank FSDP2 mesh ------------------------------------------

def _dist_logits(cases: list[tuple[str, str, str, list[str]]]) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))
    out = {}
    for family, path, adapter_json, plus_one in cases:
        model = _native(family, Path(path))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        sdadapt.load(model, path, sdadapt.Adapter.from_json(adapter_json))
        _add_one(model, plus_one)
        with torch.no_grad():
            out[family] = model(tokens(model.c["vocab"]))
    return out


def test_reviewed_drafts_on_two_fsdp2_ranks(ckpts: dict) -> None:
    cases = []
    for family in NUMERIC:
        path, _ = ckpts[family]
        adapter, plus_one = reviewed_adapter(family, sdadapt.draft(_native(family, path), path, reference=None))
        cases.append((family, str(path), adapter.to_json(), plus_one))
    results = run_distributed(_dist_logits, 2, cases, timeout=120.0)
    for rank_out in results:
        for family in NUMERIC:
            torch.testing.assert_close(rank_out[family], ckpts[family][1], rtol=1e-5, atol=1e-5)


# --- docs/writing-adapters.md -------------------------------------------------------------------

def test_writing_adapters_guide_snippets_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The guide's Python snippets, in order, in one namespace; ``build_model()`` is the native
    decoder with Meta's interleaved rotary for the guide's tiny Qwen2 (the snippets check logits)."""
    import re

    guide = (Path(__file__).resolve().parents[2] / "docs" / "writing-adapters.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", guide, flags=re.S)
    assert len(blocks) >= 8
    monkeypatch.chdir(tmp_path)

    def build_model() -> nn.Module:
        with torch.device("meta"):
            return Native(native_config(read_config(tmp_path / "tiny-qwen2"), "interleaved"))

    ns: dict[str, Any] = {"build_model": build_model}
    torch.manual_seed(0)
    for i, code in enumerate(blocks):
        exec(compile(code, f"writing-adapters.md python block {i}", "exec"), ns)  # noqa: S102 - the guide's own code
    assert ns["report"].passed
    # the check in step 6 is what catches a missing rule: without the rotary rules it fails
    model = build_model()
    sdadapt.load(model, "tiny-qwen2", ns["drafted"].ADAPTER)
    assert not sdadapt.verify(model, ns["hf"]).passed
