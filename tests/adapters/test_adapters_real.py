"""The shipped adapters (issue 3), proven against the real model code that writes each layout.

For each adapter a tiny model is built from a config with the real library (transformers,
diffusers; no downloads), or ``tests/support/models.py`` for the discussion's model, and its checkpoint
is written in its native format (``save_pretrained``; ``torch.save``; a BFL-layout safetensors
file made by an independent converter written here from diffusers' conversion code). Each
checkpoint is loaded with ``sdadapt.load`` through ``sdadapt.get_adapter(name, source=...)``
into the counterpart model (Meta layout / nanoGPT: ``tests/support/reference_models.py``; diffusers
``FluxTransformer2DModel``) parallelised on a gloo mesh, FSDP2+TP 2x2 and FSDP over 3 ranks
(uneven shards), and the forward outputs are compared with the original model's (fp32).
Then the loaded model's state dict goes back through ``adapter.inverse()`` and must give the
original checkpoint's tensors bit-exactly. One 4-rank launch runs every case on both meshes
(the 3-rank mesh is ranks 0-2 of it).

Single-process tests: a wrong adapter gives a short ``diff`` report; bad options (head
counts, expert counts, fused sizes) fail while planning, naming rule, key and numbers, with
nothing read and the model left on the meta device.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.adapter_check import case_named, cases_fixture, check_on_meshes, plan_error
from support.hf_families import diffusers_to_bfl

import sdadapt

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")
diffusers = pytest.importorskip("diffusers", reason="the test extra installs diffusers")

L, H, KV, DIM, FFN, VOCAB = 2, 4, 2, 32, 48, 40
SEQ = 7
FLUX_CFG = dict(
    patch_size=1, in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=8, num_attention_heads=2,
    joint_attention_dim=12, pooled_projection_dim=10, guidance_embeds=True, axes_dims_rope=(2, 2, 4),
)  # fmt: skip
FLUX_SCHNELL_CFG = {**FLUX_CFG, "guidance_embeds": False, "num_layers": 1, "num_single_layers": 1}


def _spread(model: torch.nn.Module, seed: int, std: float = 0.2) -> None:
    """Random weights large enough that a wrong row order changes the outputs clearly; norm
    scales near 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            is_scale = p.dim() == 1 and ("norm" in name or "ln_" in name) and not name.endswith("bias")
            p.copy_(1.0 + 0.1 * noise if is_scale else std * noise)


def meta_cfg(**kw: Any) -> dict:
    return dict(dim=DIM, n_layers=L, n_heads=H, n_kv_heads=KV, vocab_size=VOCAB, hidden_dim=FFN, **kw)


def flux_inputs(cfg: dict) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    img, txt = 6, 3
    inputs = dict(
        hidden_states=torch.randn(1, img, cfg["in_channels"], generator=gen),
        encoder_hidden_states=torch.randn(1, txt, cfg["joint_attention_dim"], generator=gen),
        pooled_projections=torch.randn(1, cfg["pooled_projection_dim"], generator=gen),
        timestep=torch.tensor([0.4]),
        img_ids=torch.stack([torch.zeros(img), torch.arange(img) // 3, torch.arange(img) % 3], dim=-1).float(),
        txt_ids=torch.zeros(txt, 3),
    )
    if cfg["guidance_embeds"]:
        inputs["guidance"] = torch.tensor([3.5])
    return inputs


# ----------------------------------------------------------------------------------------------
# checkpoints + expected outputs, written once by the parent process
# ----------------------------------------------------------------------------------------------
def _write_cases(root: str) -> list[dict]:
    from support.models import TinyTransformer, split_qkv
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    cases: list[dict] = []

    def add(name: str, path: str, adapter: str, target: str, spec: Any, inputs: Any, expected: torch.Tensor, **kw: Any) -> None:
        cases.append(dict(name=name, path=path, adapter=adapter, target=target, spec=spec, inputs=inputs,
                          expected=expected.detach().float(), **kw))  # fmt: skip

    def llama_cfg(tie: bool) -> Any:
        return LlamaConfig(hidden_size=DIM, intermediate_size=FFN, num_hidden_layers=L, num_attention_heads=H,
                           num_key_value_heads=KV, vocab_size=VOCAB, tie_word_embeddings=tie, rope_theta=500000.0)  # fmt: skip

    # Llama: untied -> split Meta layout; tied -> fused wqkv/w13 (per-TP-rank interleaved)
    for tie, seed in ((False, 10), (True, 11)):
        torch.manual_seed(seed)
        hf = LlamaForCausalLM(llama_cfg(tie)).eval()
        _spread(hf, seed)
        path = os.path.join(root, f"llama_tied{int(tie)}")
        hf.save_pretrained(path)
        cfg = hf.config
        rope = cfg.rope_parameters["rope_theta"]
        fused = dict(fused_qkv=True, fused_w13=True) if tie else {}
        spec = meta_cfg(norm_eps=cfg.rms_norm_eps, rope_theta=rope, **fused)
        with torch.no_grad():
            out = hf(tokens).logits
        add(f"llama{'_tied_fused' if tie else ''}", path, "llama", "meta_llama", spec, tokens, out, options=fused,
            export_unexpected=["output.weight"] if tie else [])  # fmt: skip

    # Mixtral: save_pretrained writes per-expert weights; torch.save of the state dict is stacked
    torch.manual_seed(12)
    mcfg = MixtralConfig(hidden_size=DIM, intermediate_size=FFN, num_hidden_layers=L, num_attention_heads=H,
                         num_key_value_heads=KV, vocab_size=VOCAB, num_local_experts=4, num_experts_per_tok=2)  # fmt: skip
    hf = MixtralForCausalLM(mcfg).eval()
    _spread(hf, 12)
    path = os.path.join(root, "mixtral")
    hf.save_pretrained(path)
    with torch.no_grad():
        out = hf(tokens).logits
    spec = meta_cfg(norm_eps=mcfg.rms_norm_eps, rope_theta=mcfg.rope_parameters["rope_theta"], n_experts=4, top_k=2)
    add("mixtral_per_expert", path, "mixtral", "meta_llama", spec, tokens, out)
    stacked = os.path.join(root, "mixtral_stacked")
    os.makedirs(stacked)
    torch.save(hf.state_dict(), os.path.join(stacked, "model.pt"))
    with open(os.path.join(stacked, "config.json"), "w") as f:
        f.write(mcfg.to_json_string())
    add("mixtral_stacked", os.path.join(stacked, "model.pt"), "mixtral", "meta_llama", spec, tokens, out)

    # GPT-2: GPT2LMHeadModel.save_pretrained ("transformer." keys, no lm_head, Conv1D weights)
    torch.manual_seed(13)
    gcfg = GPT2Config(n_embd=DIM, n_layer=L, n_head=H, vocab_size=VOCAB, n_positions=16,
                      attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip
    hf = GPT2LMHeadModel(gcfg).eval()
    _spread(hf, 13)
    path = os.path.join(root, "gpt2")
    hf.save_pretrained(path)
    with torch.no_grad():
        out = hf(tokens).logits
    nano = dict(vocab_size=VOCAB, block_size=16, n_layer=L, n_head=H, n_embd=DIM, eps=gcfg.layer_norm_epsilon)
    add("gpt2", path, "gpt2", "nanogpt", nano, tokens, out, export_unexpected=["lm_head.weight"])
    # ... and the released files' layout: GPT2Model keys (no prefix) with the causal-mask buffers
    bare = os.path.join(root, "gpt2_bare")
    hf.transformer.save_pretrained(bare)
    sd = load_file(os.path.join(bare, "model.safetensors"))
    assert not any(k.startswith("transformer.") for k in sd), "GPT2Model.save_pretrained wrote prefixed keys"
    for i in range(L):
        sd[f"h.{i}.attn.bias"] = torch.tril(torch.ones(16, 16, dtype=torch.bool)).view(1, 1, 16, 16)
        sd[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(sd, os.path.join(bare, "model.safetensors"), metadata={"format": "pt"})
    add("gpt2_bare_split_qkv", bare, "gpt2", "nanogpt", {**nano, "split_qkv": True}, tokens, out,
        options=dict(split_qkv=True), export_unexpected=["lm_head.weight"],
        export_missing=["h.*.attn.bias", "h.*.attn.masked_bias"])  # fmt: skip

    # Flux: diffusers FluxTransformer2DModel -> BFL single file (dev: guidance, under model.diffusion_model.)
    from diffusers import FluxTransformer2DModel

    for name, fcfg, prefix, seed in (("flux_dev", FLUX_CFG, "model.diffusion_model.", 14), ("flux_schnell", FLUX_SCHNELL_CFG, "", 15)):
        torch.manual_seed(seed)
        fm = FluxTransformer2DModel(**fcfg).eval()
        _spread(fm, seed)
        bfl = diffusers_to_bfl(fm.state_dict(), fcfg)
        path = os.path.join(root, f"{name}.safetensors")
        save_file({prefix + k: v for k, v in bfl.items()}, path)
        inputs = flux_inputs(fcfg)
        with torch.no_grad():
            out = fm(**inputs, return_dict=False)[0]
        add(name, path, "flux", "flux", fcfg, inputs, out)

    # the discussion's model: split q/k/v names in a torch.save file
    torch.manual_seed(16)
    tiny = TinyTransformer().eval()
    path = os.path.join(root, "discussion.pt")
    torch.save(split_qkv(tiny.state_dict()), path)
    dtok = torch.randint(0, 37, (2, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = tiny(dtok)
    add("discussion", path, "discussion", "tiny", {}, dtok, out)
    return cases


# ----------------------------------------------------------------------------------------------
# the counterpart models, parallelised
# ----------------------------------------------------------------------------------------------
def parallelize_flux(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    """TP where diffusers' Flux code allows it (q/k/v and the MLP inputs column-wise, gathered
    where the code needs full widths; the MLPs' output row-wise), FSDP2 over blocks."""
    from support.reference_models import _fsdp
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    names = mesh.mesh_dim_names or ()
    if "tp" in names and mesh["tp"].size() > 1:
        gathered = ColwiseParallel(output_layouts=Replicate())
        plan: dict = {"norm_out.linear": gathered}
        for i in range(len(model.transformer_blocks)):
            p = f"transformer_blocks.{i}."
            for n in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
                plan[p + "attn." + n] = gathered
            for ff in ("ff", "ff_context"):
                plan[p + ff + ".net.0.proj"] = ColwiseParallel()
                plan[p + ff + ".net.2"] = RowwiseParallel()
        for i in range(len(model.single_transformer_blocks)):
            p = f"single_transformer_blocks.{i}."
            for n in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"):
                plan[p + n] = gathered
        parallelize_module(model, mesh["tp"], plan)
    _fsdp(model, [*model.transformer_blocks, *model.single_transformer_blocks], mesh)
    return model


def _build_target(case: dict, mesh: Any) -> torch.nn.Module:
    from support.models import TP_PLAN_FORWARD, TinyTransformer, parallelize
    from support.reference_models import MetaLlama, NanoGPT, parallelize_meta_llama, parallelize_nanogpt

    kind, spec = case["target"], case["spec"]
    with torch.device("meta"):
        if kind == "meta_llama":
            model = MetaLlama(spec)
        elif kind == "nanogpt":
            model = NanoGPT(**spec)
        elif kind == "flux":
            from diffusers import FluxTransformer2DModel

            model = FluxTransformer2DModel(**spec)
        else:
            model = TinyTransformer()
    model.eval()
    if kind == "meta_llama":
        return parallelize_meta_llama(model, mesh)
    if kind == "nanogpt":
        return parallelize_nanogpt(model, mesh)
    if kind == "flux":
        return parallelize_flux(model, mesh)
    return parallelize(model, mesh, TP_PLAN_FORWARD)


def _forward(model: torch.nn.Module, case: dict) -> torch.Tensor:
    """The model on the case's inputs: keyword tensors for Flux, tokens for the others."""
    if case["target"] == "flux":
        return model(**case["inputs"], return_dict=False)[0]
    return model(case["inputs"])


cases_root = cases_fixture("adapters_real", _write_cases)


def test_adapters_load_real_checkpoints(cases_root: str) -> None:
    """Every case on both meshes (tests/support/adapter_check.py): outputs, keys, byte-exact export."""
    check_on_meshes(cases_root, _build_target, forward=_forward)


# ----------------------------------------------------------------------------------------------
# single process: wrong adapter, bad options (planning only; nothing is read)
# ----------------------------------------------------------------------------------------------
class _NoMesh:
    mesh_dim_names: tuple = ()


def _meta_model(case: dict) -> torch.nn.Module:
    return _build_target(case, _NoMesh())


def test_wrong_adapter_diff_is_short(cases_root: str) -> None:
    llama, gpt2 = case_named(cases_root, "llama"), case_named(cases_root, "gpt2")
    adapter = sdadapt.get_adapter("gpt2", source=llama["path"])
    for target in (_meta_model(llama), _meta_model(gpt2)):
        rep = sdadapt.diff(target, llama["path"], adapter)
        text = rep.format()
        assert not rep.ok and rep.matched <= 1
        assert len(rep.missing) >= 20 and len(rep.unexpected) >= 20
        lines = text.splitlines()
        # runs of layers are compressed and long sections cut: a handful of readable rows per
        # section, whatever the layer count, and the rules that matched nothing are named
        assert len(lines) < 40, text
        assert "rules that matched nothing" in text and "transpose(keys='transformer.h.{i}.attn.c_attn.weight'" in text
        assert any("{0..1}" in line for line in lines)
        rows = [line for line in lines if line.startswith("  ")]
        assert rows and not any(".0." in row or ".1." in row for row in rows), text  # no per-layer rows


def _plan_error(case: dict, adapter: sdadapt.Adapter) -> str:
    return plan_error(_meta_model(case), case["path"], adapter)


def test_bad_options_fail_while_planning(cases_root: str) -> None:
    llama, fused = case_named(cases_root, "llama"), case_named(cases_root, "llama_tied_fused")
    mixtral, flux = case_named(cases_root, "mixtral_per_expert"), case_named(cases_root, "flux_dev")

    # head counts that do not divide the rows
    msg = _plan_error(llama, sdadapt.get_adapter("llama", source=llama["path"], n_heads=3, n_kv_heads=1))
    assert "rotary(keys='layers.{i}.attention.wq.weight', heads=3" in msg
    assert "layers.{0..1}.attention.wq.weight: 32 rows along dim 0 do not divide into heads=3" in msg

    # a fused size that does not add up (head_dim 6: q, k, v declared as 24, 12, 12 rows)
    msg = _plan_error(fused, sdadapt.get_adapter("llama", source=fused["path"], head_dim=6, **fused["options"]))
    assert "fuse(srcs=['layers.{i}.attention.wq.weight'" in msg
    assert "layers.{0..1}.attention.wqkv.weight: declared sizes [24, 12, 12] but the parts have [32, 16, 16]" in msg
    msg = _plan_error(flux, sdadapt.get_adapter("flux", source=flux["path"], inner_dim=20))
    assert "single_blocks.{0..1}.linear1.weight: sizes [20, 20, 20, 80] (declared) add up to 140, but dim 0 has 112" in msg

    # an expert count that differs: from the option (config) ...
    msg = _plan_error(mixtral, sdadapt.get_adapter("mixtral", source=mixtral["path"], n_experts=5))
    assert "stack(src='model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight'" in msg
    assert "layers.{0..1}.moe.experts.w1: found 4 entries (e=0..3) but count=5" in msg
    # ... and from the model, when the option is not known
    five = {**mixtral, "spec": {**mixtral["spec"], "n_experts": 5}}
    msg = _plan_error(five, sdadapt.get_adapter("mixtral", n_heads=H, n_kv_heads=KV))
    assert "layers.{0..1}.moe.experts.w1: model [5, 48, 32], checkpoint gives [4, 48, 32]" in msg


def test_adapter_options_are_checked() -> None:
    with pytest.raises(sdadapt.errors.AdapterError, match="needs option 'n_heads'"):
        sdadapt.get_adapter("llama")
    with pytest.raises(sdadapt.errors.AdapterError, match="n_heads 4 is not a multiple of n_kv_heads 3"):
        sdadapt.get_adapter("llama", n_heads=4, n_kv_heads=3)
    with pytest.raises(sdadapt.errors.AdapterError, match="needs hidden_dim"):
        sdadapt.get_adapter("llama", n_heads=4, fused_w13=True)
    with pytest.raises(sdadapt.errors.AdapterError, match="experts must be 'per_expert' or 'stacked'"):
        sdadapt.get_adapter("mixtral", n_heads=4, experts="fused")
    names = dict(sdadapt.list_adapters())
    assert {"llama", "mixtral", "gpt2", "flux", "discussion"} <= set(names)
    assert all(not s.startswith("(unavailable") for s in names.values()), names


def test_options_from_checkpoints(cases_root: str) -> None:
    """What each adapter reads from a checkpoint's config.json and key names (headers only)."""
    from sdadapt._plan.registry import config_folder

    def opts(name: str, case: str) -> dict:
        path = case_named(cases_root, case)["path"]
        mod = __import__(f"sdadapt.adapters.{name}", fromlist=["options_from_config"])
        return mod.options_from_config(config_folder(path), path)

    assert opts("llama", "llama") == dict(n_heads=H, n_kv_heads=KV, dim=DIM, head_dim=DIM // H, hidden_dim=FFN,
                                         tie_embeddings=False)  # fmt: skip
    assert opts("llama", "llama_tied_fused")["tie_embeddings"] is True
    assert opts("mixtral", "mixtral_per_expert")["n_experts"] == 4
    assert "experts" not in opts("mixtral", "mixtral_per_expert")
    assert opts("mixtral", "mixtral_stacked")["experts"] == "stacked"
    assert opts("gpt2", "gpt2") == dict(prefix="transformer.", buffers=False)
    assert opts("gpt2", "gpt2_bare_split_qkv") == dict(prefix="", buffers=True)
    assert opts("flux", "flux_dev") == dict(prefix=True, guidance=True)
    assert opts("flux", "flux_schnell") == dict(prefix=False, guidance=False)
