"""transformers families as adapter targets: tiny configs and models, the shipped adapters'
specs, checkpoint perturbation, loads on meshes and their checks.
"""

from __future__ import annotations

from typing import Any

import torch

from support.adapter_check import (
    load_on_meshes,
)


def perturb_model(model: torch.nn.Module, seed: int) -> None:
    """Weights with spread (std 0.2), biases non-zero, norm scales 1 + noise."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.2 * noise)


L, H, DIM, FFN, MOE_FFN, E, VOCAB, SEQ = 3, 4, 32, 48, 24, 4, 40, 7


Q_RANK, KV_RANK, NOPE, ROPE, V_DIM = 24, 16, 16, 8, 12


def hf_config(**kw: Any) -> Any:
    """A tiny ``DeepseekV3Config``: 4 routed experts in 2 groups (1 chosen), top-2, one shared."""
    from transformers import DeepseekV3Config

    base = dict(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=FFN, moe_intermediate_size=MOE_FFN,
                num_hidden_layers=L, num_attention_heads=H, num_key_value_heads=H, n_shared_experts=1,
                n_routed_experts=E, kv_lora_rank=KV_RANK, q_lora_rank=Q_RANK, qk_rope_head_dim=ROPE,
                v_head_dim=V_DIM, qk_nope_head_dim=NOPE, n_group=2, topk_group=1, num_experts_per_tok=2,
                first_k_dense_replace=1, rms_norm_eps=1e-6)  # fmt: skip
    return DeepseekV3Config(**{**base, **kw})


def hf_model(cfg: Any, seed: int) -> Any:
    """``DeepseekV3ForCausalLM(cfg)`` with perturbed weights and a non-zero routing bias."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    hf = DeepseekV3ForCausalLM(cfg).eval()
    perturb_model(hf, seed)
    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, buf in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.3 * torch.randn(buf.shape, generator=gen))
    return hf


def spec_of(cfg: Any) -> dict[str, Any]:
    """The :class:`reference_models.DeepSeekV3` config matching an HF config."""
    return dict(dim=cfg.hidden_size, n_layers=cfg.num_hidden_layers, n_heads=cfg.num_attention_heads,
                vocab_size=cfg.vocab_size, hidden_dim=cfg.intermediate_size, norm_eps=cfg.rms_norm_eps,
                rope_theta=cfg.rope_parameters["rope_theta"], q_lora_rank=cfg.q_lora_rank or 0,
                kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
                n_dense_layers=cfg.first_k_dense_replace, n_experts=cfg.n_routed_experts,
                top_k=cfg.num_experts_per_tok, n_groups=cfg.n_group, topk_groups=cfg.topk_group,
                norm_topk=cfg.norm_topk_prob, route_scale=cfg.routed_scaling_factor,
                moe_hidden_dim=cfg.moe_intermediate_size, n_shared_experts=cfg.n_shared_experts)  # fmt: skip


def mtp_layer(sd: dict[str, torch.Tensor], n_layers: int, seed: int) -> dict[str, torch.Tensor]:
    """A multi-token-prediction layer ``model.layers.{n_layers}`` shaped as the releases ship it:
    the last (MoE) block's tensors with new values, plus embed_tokens, enorm, hnorm, eh_proj and
    shared_head.norm|head. transformers does not build it, so the test writes it."""
    gen = torch.Generator().manual_seed(seed)
    last, mtp = f"model.layers.{n_layers - 1}.", f"model.layers.{n_layers}."
    shapes = {mtp + k[len(last) :]: v.shape for k, v in sd.items() if k.startswith(last)}
    shapes.update({mtp + "embed_tokens.weight": (VOCAB, DIM), mtp + "enorm.weight": (DIM,), mtp + "hnorm.weight": (DIM,),
                   mtp + "eh_proj.weight": (DIM, 2 * DIM), mtp + "shared_head.norm.weight": (DIM,),
                   mtp + "shared_head.head.weight": (VOCAB, DIM)})  # fmt: skip
    return {k: torch.randn(s, generator=gen) for k, s in shapes.items()}


# ----------------------------------------------------------------------------------------------
# the launched check: every case on both meshes (tests/support/adapter_check.py; shared with the FP8 tests)
# ----------------------------------------------------------------------------------------------
def target_model(case: dict, mesh: Any | None) -> torch.nn.Module:
    """The reference model of ``case["family"]`` on the meta device, parallelised on ``mesh``."""
    from support.reference_deepseek import DeepSeekV3, parallelize_deepseek
    from support.reference_models import Qwen3, parallelize_meta_llama

    cls, parallelize = (DeepSeekV3, parallelize_deepseek) if case["family"] == "deepseek_v3" else (Qwen3, parallelize_meta_llama)
    with torch.device("meta"):
        model = cls(case["spec"]).eval()
    return model if mesh is None else parallelize(model, mesh)


def load_all(root: str) -> dict[str, dict[str, dict]]:
    """Worker on 4 ranks: every case of ``root/cases.pt`` loaded into :func:`target_model` on both
    meshes of :func:`adapter_check.load_on_meshes`; :func:`adapter_check.check_results` checks them."""
    return load_on_meshes(root, target_model)


# ----------------------------------------------------------------------------------------------
# the releases
# ----------------------------------------------------------------------------------------------
def qwen_spec(cfg: Any, hf: Any) -> dict[str, Any]:
    spec = dict(dim=cfg.hidden_size, n_layers=cfg.num_hidden_layers, n_heads=cfg.num_attention_heads,
                n_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, vocab_size=cfg.vocab_size,
                hidden_dim=cfg.intermediate_size, norm_eps=cfg.rms_norm_eps,
                rope_theta=cfg.rope_parameters["rope_theta"], attention_bias=cfg.attention_bias)  # fmt: skip
    if hasattr(cfg, "num_experts"):
        dense = [i for i, layer in enumerate(hf.model.layers) if not hasattr(layer.mlp, "experts")]
        spec.update(n_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok, moe_hidden_dim=cfg.moe_intermediate_size,
                    norm_topk=cfg.norm_topk_prob, dense_layers=dense)  # fmt: skip
    return spec


# ----------------------------------------------------------------------------------------------
# independent writer of Black Forest Labs' layout (from diffusers' conversion code, reversed)
# ----------------------------------------------------------------------------------------------
def diffusers_to_bfl(sd: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    emb = [("time_in", "timestep_embedder"), ("vector_in", "text_embedder")]
    if cfg["guidance_embeds"]:
        emb.append(("guidance_in", "guidance_embedder"))
    for p in ("weight", "bias"):
        for bfl, hf in emb:
            out[f"{bfl}.in_layer.{p}"] = sd[f"time_text_embed.{hf}.linear_1.{p}"]
            out[f"{bfl}.out_layer.{p}"] = sd[f"time_text_embed.{hf}.linear_2.{p}"]
        out[f"txt_in.{p}"] = sd[f"context_embedder.{p}"]
        out[f"img_in.{p}"] = sd[f"x_embedder.{p}"]
        for i in range(cfg["num_layers"]):
            d, t = f"double_blocks.{i}.", f"transformer_blocks.{i}."
            out[d + f"img_mod.lin.{p}"] = sd[t + f"norm1.linear.{p}"]
            out[d + f"txt_mod.lin.{p}"] = sd[t + f"norm1_context.linear.{p}"]
            out[d + f"img_attn.qkv.{p}"] = torch.cat([sd[t + f"attn.to_{x}.{p}"] for x in "qkv"])
            out[d + f"txt_attn.qkv.{p}"] = torch.cat([sd[t + f"attn.add_{x}_proj.{p}"] for x in "qkv"])
            out[d + f"img_mlp.0.{p}"] = sd[t + f"ff.net.0.proj.{p}"]
            out[d + f"img_mlp.2.{p}"] = sd[t + f"ff.net.2.{p}"]
            out[d + f"txt_mlp.0.{p}"] = sd[t + f"ff_context.net.0.proj.{p}"]
            out[d + f"txt_mlp.2.{p}"] = sd[t + f"ff_context.net.2.{p}"]
            out[d + f"img_attn.proj.{p}"] = sd[t + f"attn.to_out.0.{p}"]
            out[d + f"txt_attn.proj.{p}"] = sd[t + f"attn.to_add_out.{p}"]
        for i in range(cfg["num_single_layers"]):
            s, t = f"single_blocks.{i}.", f"single_transformer_blocks.{i}."
            out[s + f"modulation.lin.{p}"] = sd[t + f"norm.linear.{p}"]
            out[s + f"linear1.{p}"] = torch.cat([sd[t + f"attn.to_{x}.{p}"] for x in "qkv"] + [sd[t + f"proj_mlp.{p}"]])
            out[s + f"linear2.{p}"] = sd[t + f"proj_out.{p}"]
        out[f"final_layer.linear.{p}"] = sd[f"proj_out.{p}"]
        scale, shift = sd[f"norm_out.linear.{p}"].chunk(2, dim=0)
        out[f"final_layer.adaLN_modulation.1.{p}"] = torch.cat([shift, scale])
    for i in range(cfg["num_layers"]):
        d, t = f"double_blocks.{i}.", f"transformer_blocks.{i}."
        out[d + "img_attn.norm.query_norm.scale"] = sd[t + "attn.norm_q.weight"]
        out[d + "img_attn.norm.key_norm.scale"] = sd[t + "attn.norm_k.weight"]
        out[d + "txt_attn.norm.query_norm.scale"] = sd[t + "attn.norm_added_q.weight"]
        out[d + "txt_attn.norm.key_norm.scale"] = sd[t + "attn.norm_added_k.weight"]
    for i in range(cfg["num_single_layers"]):
        s, t = f"single_blocks.{i}.", f"single_transformer_blocks.{i}."
        out[s + "norm.query_norm.scale"] = sd[t + "attn.norm_q.weight"]
        out[s + "norm.key_norm.scale"] = sd[t + "attn.norm_k.weight"]
    assert sum(v.numel() for v in out.values()) == sum(v.numel() for v in sd.values()), "a tensor was left out"
    return {k: v.contiguous() for k, v in out.items()}
