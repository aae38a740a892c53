"""``sdadapt draft``: a first adapter inferred from a checkpoint's and a model's headers.

Acceptance: on the shipped families' own layouts, built with the real libraries at tiny
configs (HF Llama -> Meta layout, plain and fused; HF Mixtral per-expert and stacked ->
stacked experts; HF GPT-2 -> nanoGPT's Linear orientation, with and without split q/k/v;
Flux BFL -> diffusers), the drafted adapter plans the same key mapping as the hand-written
adapter (for every model key, the set of checkpoint keys its recipe reads) and the same
transposes, and the only things left to the user are the value-level questions (rotary row
order, fused per-rank layout, Flux's adaLN chunk order). A pair with no relation gets no
proposals. Schemas come from headers only: ``save_pretrained`` files for HF, the meta-device
state dicts otherwise.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import sdadapt
from sdadapt._draft.segments import build_tree
from sdadapt._plan.plan import build_plan
from sdadapt._plan.target import schema_of
from sdadapt.sources import TensorInfo

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")
diffusers = pytest.importorskip("diffusers", reason="the test extra installs diffusers")

from support.reference_models import MetaLlama, NanoGPT  # noqa: E402

L, H, KV, DIM, FFN, VOCAB, E = 2, 4, 2, 32, 48, 40, 4
FLUX_CFG = dict(
    patch_size=1, in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=8, num_attention_heads=2,
    joint_attention_dim=12, pooled_projection_dim=10, guidance_embeds=True, axes_dims_rope=(2, 2, 4),
)  # fmt: skip


def meta_schema(model_fn: Any, *args: Any, **kw: Any) -> dict[str, TensorInfo]:
    with torch.device("meta"):
        return schema_of(model_fn(*args, **kw).state_dict())


def source_schema(path: str) -> dict[str, TensorInfo]:
    with sdadapt.sources.open_source(path) as s:
        return dict(s.schema)


def meta_llama(**kw: Any) -> dict[str, TensorInfo]:
    cfg = dict(dim=DIM, n_layers=L, n_heads=H, n_kv_heads=KV, vocab_size=VOCAB, hidden_dim=FFN, norm_eps=1e-5,
               rope_theta=1e4, **kw)  # fmt: skip
    return meta_schema(MetaLlama, cfg)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Tiny checkpoints written by the real libraries (a few hundred KB in all)."""
    from safetensors.torch import load_file, save_file
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    root = tmp_path_factory.mktemp("draft")
    out = {}
    torch.manual_seed(0)
    for tie in (False, True):
        cfg = LlamaConfig(hidden_size=DIM, intermediate_size=FFN, num_hidden_layers=L, num_attention_heads=H,
                          num_key_value_heads=KV, vocab_size=VOCAB, tie_word_embeddings=tie)  # fmt: skip
        out[f"llama{int(tie)}"] = p = str(root / f"llama{int(tie)}")
        LlamaForCausalLM(cfg).save_pretrained(p)
    mcfg = MixtralConfig(hidden_size=DIM, intermediate_size=FFN, num_hidden_layers=L, num_attention_heads=H,
                         num_key_value_heads=KV, vocab_size=VOCAB, num_local_experts=E, num_experts_per_tok=2)  # fmt: skip
    hf = MixtralForCausalLM(mcfg)
    out["mixtral"] = p = str(root / "mixtral")
    hf.save_pretrained(p)
    out["mixtral_stacked"] = p = str(root / "mixtral_stacked.pt")
    torch.save(hf.state_dict(), p)
    gcfg = GPT2Config(n_embd=DIM, n_layer=L, n_head=H, vocab_size=VOCAB, n_positions=16)
    g = GPT2LMHeadModel(gcfg)
    out["gpt2"] = p = str(root / "gpt2")
    g.save_pretrained(p)
    out["gpt2_bare"] = p = str(root / "gpt2_bare")
    g.transformer.save_pretrained(p)
    sd = load_file(os.path.join(p, "model.safetensors"))
    for i in range(L):
        sd[f"h.{i}.attn.bias"] = torch.tril(torch.ones(16, 16, dtype=torch.bool)).view(1, 1, 16, 16)
        sd[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(sd, os.path.join(p, "model.safetensors"), metadata={"format": "pt"})
    return out


def flux_schemas(prefix: str, guidance: bool = True) -> tuple[dict[str, TensorInfo], dict[str, TensorInfo]]:
    """(BFL checkpoint schema, diffusers model schema), on the meta device."""
    from diffusers import FluxTransformer2DModel
    from support.hf_families import diffusers_to_bfl

    cfg = {**FLUX_CFG, "guidance_embeds": guidance}
    with torch.device("meta"):
        sd = FluxTransformer2DModel(**cfg).state_dict()
    bfl = diffusers_to_bfl(sd, cfg)
    return {prefix + k: TensorInfo(tuple(v.shape), v.dtype) for k, v in bfl.items()}, schema_of(sd)


def key_mapping(src: dict[str, TensorInfo], tgt: dict[str, TensorInfo], adapter: sdadapt.Adapter) -> dict[str, Any]:
    """For each model key: the checkpoint keys its recipe reads, and how many transposes it applies."""
    plan = build_plan(src, tgt, adapter)
    assert plan.report.ok, plan.report.format()
    return {k: (frozenset(n.leaves()), n.describe().count("transpose(")) for k, n in plan.recipes.items()}


def exec_module(text: str) -> sdadapt.Adapter:
    ns: dict[str, Any] = {}
    exec(compile(text, "<draft>", "exec"), ns)  # noqa: S102 - the module we just wrote
    return ns["ADAPTER"]


def check_reproduces(src: dict[str, TensorInfo], tgt: dict[str, TensorInfo], shipped: sdadapt.Adapter) -> sdadapt.draft:
    d = sdadapt.draft(tgt, src)
    assert d.related, d.format()
    assert d.report.ok, d.format()
    written = exec_module(d.module)
    assert written.rules == d.adapter.rules, "the module text builds a different adapter"
    assert key_mapping(src, tgt, d.adapter) == key_mapping(src, tgt, shipped)
    return d


def questions(d: Any) -> dict[str, list[str]]:
    return {q.question.split(":")[0]: sorted(q.about) for q in d.questions}


# ----------------------------------------------------------------------------------------------
# acceptance: the shipped families
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tie", [False, True])
def test_llama_hf_to_meta(ckpts: dict[str, str], tie: bool) -> None:
    src = source_schema(ckpts[f"llama{int(tie)}"])
    tgt = meta_llama()
    shipped = sdadapt.get_adapter("llama", n_heads=H, n_kv_heads=KV, tie_embeddings=tie)
    d = check_reproduces(src, tgt, shipped)
    kinds = {p.kind for p in d.proposals}
    assert ("tie" in kinds) == tie
    assert not d.uncertain, [p.evidence for p in d.uncertain]
    assert questions(d) == {"rotary row order": ["layers.{i}.attention.wk.weight", "layers.{i}.attention.wq.weight"]}
    text = d.module
    assert 'sdadapt.rename("model.layers.{i}.self_attn.q_proj.weight", "layers.{i}.attention.wq.weight")' in text
    assert '# sdadapt.rotary("layers.{i}.attention.wq.weight", heads=N_HEADS, to="interleaved")' in text
    assert '# sdadapt.rotary("layers.{i}.attention.wk.weight", heads=N_KV_HEADS, to="interleaved")' in text


def test_llama_old_checkpoint_drops_inv_freq(ckpts: dict[str, str]) -> None:
    src = source_schema(ckpts["llama0"])
    for i in range(L):
        src[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = TensorInfo((DIM // H // 2,), torch.float32)
    shipped = sdadapt.get_adapter("llama", n_heads=H, n_kv_heads=KV, tie_embeddings=False, inv_freq=True)
    d = check_reproduces(src, meta_llama(), shipped)
    drops = [p for p in d.proposals if p.kind == "drop"]
    assert [p.sources for p in drops] == [["model.layers.*.self_attn.rotary_emb.inv_freq"]]


def test_llama_fused_qkv_w13(ckpts: dict[str, str]) -> None:
    src = source_schema(ckpts["llama1"])
    tgt = meta_llama(fused_qkv=True, fused_w13=True)
    shipped = sdadapt.get_adapter("llama", n_heads=H, n_kv_heads=KV, dim=DIM, hidden_dim=FFN, fused_qkv=True,
                                  fused_w13=True, tie_embeddings=True)  # fmt: skip
    d = check_reproduces(src, tgt, shipped)
    fuses = {p.targets[0]: p.sources for p in d.proposals if p.kind == "fuse"}
    assert fuses == {
        "layers.{i}.attention.wqkv.weight": [f"model.layers.{{i}}.self_attn.{x}_proj.weight" for x in "qkv"],
        "layers.{i}.feed_forward.w13.weight": [f"model.layers.{{i}}.mlp.{x}_proj.weight" for x in ("gate", "up")],
    }
    q = questions(d)
    # rotary on the HF q/k before they are fused; the per-rank layout of both fused tensors
    assert q["rotary row order"] == ["model.layers.{i}.self_attn.k_proj.weight", "model.layers.{i}.self_attn.q_proj.weight"]
    assert q["tensor-parallel layout of a fused tensor"] == ["layers.{i}.attention.wqkv.weight",
                                                             "layers.{i}.feed_forward.w13.weight"]


@pytest.mark.parametrize("layout", ["per_expert", "stacked"])
def test_mixtral_to_stacked_experts(ckpts: dict[str, str], layout: str) -> None:
    src = source_schema(ckpts["mixtral" if layout == "per_expert" else "mixtral_stacked"])
    tgt = meta_llama(n_experts=E, top_k=2)
    shipped = sdadapt.get_adapter("mixtral", n_heads=H, n_kv_heads=KV, experts=layout)
    d = check_reproduces(src, tgt, shipped)
    if layout == "per_expert":
        stacks = sorted((p.sources[0], p.targets[0]) for p in d.proposals if p.kind == "stack")
        assert stacks == [
            (f"model.layers.{{i}}.block_sparse_moe.experts.{{e}}.{w}.weight", f"layers.{{i}}.moe.experts.{w}")
            for w in ("w1", "w2", "w3")
        ]
        assert 'sdadapt.stack("model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight", "layers.{i}.moe.experts.w1")' in d.module
    else:
        splits = [(p.sources, p.targets) for p in d.proposals if p.kind == "split"]
        assert splits == [(["model.layers.{i}.mlp.experts.gate_up_proj"], ["layers.{i}.moe.experts.w1",
                                                                           "layers.{i}.moe.experts.w3"])]
    assert list(questions(d)) == ["rotary row order"]


@pytest.mark.parametrize("case", ["prefixed", "bare_split_qkv"])
def test_gpt2_conv1d_to_linear(ckpts: dict[str, str], case: str) -> None:
    split = case == "bare_split_qkv"
    src = source_schema(ckpts["gpt2" if case == "prefixed" else "gpt2_bare"])
    tgt = meta_schema(NanoGPT, vocab_size=VOCAB, block_size=16, n_layer=L, n_head=H, n_embd=DIM, split_qkv=split)
    shipped = sdadapt.get_adapter("gpt2", prefix="transformer." if case == "prefixed" else "", split_qkv=split,
                                  buffers=split)  # fmt: skip
    d = check_reproduces(src, tgt, shipped)
    kinds = [p.kind for p in d.proposals]
    assert kinds.count("tie") == 1
    assert ("drop" in kinds) == split
    # attn.c_proj (and q/k/v cut from c_attn) are square: their transpose is inferred from their
    # siblings, so it is marked uncertain
    unsure = sorted((p.kind, tuple(p.targets)) for p in d.uncertain)
    qkv = [("transpose", tuple(f"transformer.h.{{i}}.attn.{x}_proj.weight" for x in "qkv"))] if split else []
    assert unsure == sorted([("transpose", ("transformer.h.{i}.attn.c_proj.weight",)), *qkv])
    assert d.questions == []


@pytest.mark.parametrize("prefix,guidance", [("model.diffusion_model.", True), ("", False)])
def test_flux_bfl_to_diffusers(prefix: str, guidance: bool) -> None:
    src, tgt = flux_schemas(prefix, guidance)
    shipped = sdadapt.get_adapter("flux", guidance=guidance, prefix=bool(prefix))
    d = check_reproduces(src, tgt, shipped)
    splits = {p.sources[0]: p.targets for p in d.proposals if p.kind == "split"}
    # weight and bias of a module move together: one rule on {p}
    assert splits["double_blocks.{i}.img_attn.qkv.{p}"] == [f"transformer_blocks.{{i}}.attn.to_{x}.{{p}}" for x in "qkv"]
    assert splits["double_blocks.{i}.txt_attn.qkv.{p}"] == [
        f"transformer_blocks.{{i}}.attn.add_{x}_proj.{{p}}" for x in "qkv"
    ]
    # linear1 -> q, k, v, mlp: shapes add up but no name says so: proposed, marked uncertain
    assert splits["single_blocks.{i}.linear1.{p}"] == [
        *(f"single_transformer_blocks.{{i}}.attn.to_{x}.{{p}}" for x in "qkv"),
        "single_transformer_blocks.{i}.proj_mlp.{p}",
    ]
    assert [p.sources for p in d.uncertain] == [["single_blocks.{i}.linear1.{p}"]]
    renames = {p.sources[0]: p.targets[0] for p in d.proposals if p.kind == "rename"}
    assert renames["double_blocks.{i}.txt_mod.lin.{p}"] == "transformer_blocks.{i}.norm1_context.linear.{p}"
    assert renames["double_blocks.{i}.img_mod.lin.{p}"] == "transformer_blocks.{i}.norm1.linear.{p}"
    assert list(questions(d)) == ["chunk order"]


@pytest.mark.parametrize("family", ["llama_fused", "mixtral"])
def test_reverse_direction_matches_the_inverse_adapter(ckpts: dict[str, str], family: str) -> None:
    """Export direction: Meta layout -> HF (fused tensors split, stacked experts unstacked)."""
    if family == "mixtral":
        hf = source_schema(ckpts["mixtral"])
        meta = meta_llama(n_experts=E, top_k=2)
        shipped = sdadapt.get_adapter("mixtral", n_heads=H, n_kv_heads=KV)
    else:
        hf = source_schema(ckpts["llama1"])
        meta = meta_llama(fused_qkv=True, fused_w13=True)
        shipped = sdadapt.get_adapter("llama", n_heads=H, n_kv_heads=KV, dim=DIM, hidden_dim=FFN, fused_qkv=True,
                                      fused_w13=True)  # fmt: skip
        hf["lm_head.weight"] = hf["model.embed_tokens.weight"]  # an export writes the head too
    d = check_reproduces(meta, hf, shipped.inverse())
    kinds = {p.kind for p in d.proposals}
    assert kinds >= ({"unstack"} if family == "mixtral" else {"split"})
    assert "rotary row order" in questions(d)


# ----------------------------------------------------------------------------------------------
# no relation; the CLI; bad input
# ----------------------------------------------------------------------------------------------
def test_unrelated_pair_gets_no_proposals(ckpts: dict[str, str]) -> None:
    d = sdadapt.draft(meta_llama(), ckpts["gpt2"])
    assert not d.related
    assert d.proposals == [] and d.questions == [] and len(d.adapter) == 0
    text = d.format()
    assert "look unrelated" in text and "no adapter proposed" in text
    assert len(text.splitlines()) <= 8, text
    assert "transformer.h.{i}" in text and "layers.{i}" in text  # the evidence: blocks that do not pair
    assert exec_module(d.module).rules == []


MODEL_PY = """
import sys
import torch
sys.path.insert(0, {tests!r})
from support.reference_models import MetaLlama


def build(n_experts=0):
    cfg = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=40, hidden_dim=48, norm_eps=1e-5,
               rope_theta=1e4)
    if n_experts:
        cfg.update(n_experts=n_experts, top_k=2)
    with torch.device("meta"):
        return MetaLlama(cfg)
"""


def test_cli_writes_an_adapter_that_diff_accepts(ckpts: dict[str, str], tmp_path: Path, capsys: Any) -> None:
    from sdadapt.cli import main

    model_py = tmp_path / "model.py"
    model_py.write_text(MODEL_PY.format(tests=str(Path(__file__).parent.parent)))
    out = tmp_path / "my_adapter.py"
    src = ckpts["mixtral"]
    rc = main(["draft", src, "--target", f"{model_py}:build", "--target-option", "n_experts=4", "-o", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "OK: checkpoint and model line up" in printed and f"wrote {out}" in printed
    assert "DECIDE" in out.read_text() and "sdadapt.stack(" in out.read_text()
    rc = main(["diff", src, "--target", f"{model_py}:build", "--target-option", "n_experts=4",
               "--adapter", f"{out}:ADAPTER"])  # fmt: skip
    assert rc == 0, capsys.readouterr().out
    # without -o the module goes to stdout, the summary to stderr; an existing -o is not overwritten
    capsys.readouterr()
    assert main(["draft", src, "-t", f"{model_py}:build", "--target-option", "n_experts=4", "--reference", "none"]) == 0
    cap = capsys.readouterr()
    assert cap.out.startswith('"""Adapter drafted by `sdadapt draft`') and "remaining diff" in cap.err
    assert main(["draft", src, "-t", f"{model_py}:build", "-o", str(out)]) == 2
    assert "exists" in capsys.readouterr().err
    # unrelated: a few lines, exit 1, nothing written
    other = tmp_path / "other.py"
    assert main(["draft", ckpts["gpt2"], "-t", f"{model_py}:build", "-o", str(other)]) == 1
    assert "look unrelated" in capsys.readouterr().out and not other.exists()


def test_bad_input(ckpts: dict[str, str], tmp_path: Path, capsys: Any) -> None:
    from sdadapt.cli import main

    # the same source errors as diff
    missing = str(tmp_path / "nope.safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00" * 3)
    for path in (missing, str(bad)):
        assert main(["diff", path, "--target", ckpts["llama0"]]) == 2
        diff_err = capsys.readouterr().err
        assert main(["draft", path, "--target", ckpts["llama0"]]) == 2
        draft_err = capsys.readouterr().err
        assert draft_err.replace("sdadapt draft", "sdadapt diff") == diff_err
        with pytest.raises(sdadapt.errors.SourceError):
            sdadapt.draft(ckpts["llama0"], path)
    # a target that cannot be imported: the import error, exit 2
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module_for_sdadapt\n")
    assert main(["draft", ckpts["llama0"], "--target", f"{broken}:build"]) == 2
    err = capsys.readouterr().err
    assert "ModuleNotFoundError" in err and "no_such_module_for_sdadapt" in err and "broken.py" in err
    # ... or whose function fails
    failing = tmp_path / "failing.py"
    failing.write_text("def build():\n    raise RuntimeError('cannot build this model')\n")
    assert main(["draft", ckpts["llama0"], "--target", f"{failing}:build"]) == 2
    assert "cannot build this model" in capsys.readouterr().err


def test_checkpoint_as_target_and_tree_segments(ckpts: dict[str, str]) -> None:
    """A checkpoint can be the target (same family: everything lines up, nothing proposed); and
    the segmenter keeps nn.Sequential indices literal while layer/expert indices become captures."""
    d = sdadapt.draft(ckpts["llama0"], ckpts["llama0"])
    assert d.related and d.report.ok and d.proposals == []
    tree = build_tree(source_schema(ckpts["mixtral"]))
    layers = next(iter(tree.root.children.values()))
    assert (layers.label(), layers.count) == ("model.layers.{i}", L)
    experts = next(iter(layers.children.values()))
    assert (experts.label(), experts.count) == ("model.layers.{i}.block_sparse_moe.experts.{e}", E)
    fam = build_tree({f"h.{i}.mlp.{j}.weight": TensorInfo((4, 4) if j == 0 else (4, 8), torch.float32)
                      for i in range(3) for j in (0, 2)})  # fmt: skip
    assert sorted(f.pattern(f.scope.names()) for f in fam.families) == ["h.{i}.mlp.0.weight", "h.{i}.mlp.2.weight"]


def test_casts_and_transposed_stacks_on_synthetic_schemas() -> None:
    """bf16 checkpoint, fp32 model: one explicit cast; experts stored [F, D] per expert, model
    wants [E, D, F]: a stack followed by a transpose of dims 1 and 2."""
    bf, f32 = torch.bfloat16, torch.float32
    src = {"embed_tokens.weight": TensorInfo((40, 8), bf)}
    tgt = {"tok_embeddings.weight": TensorInfo((40, 8), f32)}
    for i in range(2):
        src[f"layers.{i}.moe.router.weight"] = TensorInfo((3, 8), bf)
        tgt[f"blocks.{i}.moe.gate.weight"] = TensorInfo((3, 8), f32)
        for e in range(3):
            src[f"layers.{i}.moe.experts.{e}.up_proj.weight"] = TensorInfo((12, 8), bf)
            src[f"layers.{i}.moe.experts.{e}.down_proj.weight"] = TensorInfo((8, 12), bf)
        tgt[f"blocks.{i}.moe.experts.w3"] = TensorInfo((3, 8, 12), f32)
        tgt[f"blocks.{i}.moe.experts.w2"] = TensorInfo((3, 12, 8), f32)
    d = sdadapt.draft(tgt, src)
    assert d.report.ok, d.format()
    codes = [c for p in d.proposals for c in p.code]
    assert 'sdadapt.cast("**", "float32", from_dtype="bfloat16")' in codes
    assert 'sdadapt.stack("layers.{i}.moe.experts.{e}.up_proj.weight", "blocks.{i}.moe.experts.w3")' in codes
    assert 'sdadapt.transpose("blocks.{i}.moe.experts.w3", dim0=1, dim1=2)' in codes
    plan = build_plan(src, tgt, exec_module(d.module))
    assert plan.recipes["blocks.1.moe.experts.w2"].describe().count("transpose(") == 1
    assert plan.recipes["blocks.1.moe.experts.w2"].dtype == f32


def test_default_check_bounds_its_search(ckpts: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Run by default, the numerical check tries every combination of the choices only below a
    smaller bound than when asked for, and says so when none agreed (here MetaLlama's MoE routes
    otherwise than Mixtral: no candidate can agree)."""
    from sdadapt._draft import numeric

    monkeypatch.setattr(numeric, "MAX_COMBINATIONS_BY_DEFAULT", 4)
    cfg = dict(dim=DIM, n_layers=L, n_heads=H, n_kv_heads=KV, vocab_size=VOCAB, hidden_dim=FFN, norm_eps=1e-5,
               rope_theta=1e4, n_experts=E, top_k=2)  # fmt: skip
    with torch.device("meta"):
        model = MetaLlama(cfg)
    d = sdadapt.draft(model, ckpts["mixtral"])
    text = "\n".join(d.summary)
    assert "values unproven: no candidate agreed" in text, text
    assert "combinations of the choices were not all tried, as they are with reference='config'" in text, text
