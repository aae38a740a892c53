"""Tiny models of the families torchtitan ships and sdadapt ships adapters for: each family's
transformers model (the checkpoint, written with ``save_pretrained``) and torchtitan's own model
class built from a config of the same sizes, with attention on ``flex`` (torchtitan's language
models reject SDPA; flex runs on CPU).

torchtitan's config builders (``_build_llama3_layers`` ...) are the ones its own flavours use.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

DIM, VOCAB, LAYERS = 32, 96, 2


def _flex_on_cpu_exact() -> None:
    """torchtitan runs flex attention compiled; on CPUs whose widest vector ISA is AVX2, torch's
    C++ flex-attention template returns wrong values for these models' sizes (head_dim 8: up to
    1.7 off SDPA for random inputs, NaN in the logits). There the oracle runs flex attention
    eagerly (the same function, exact, slower), with torch's warning about it silenced."""
    import warnings

    from torch._inductor.cpu_vec_isa import pick_vec_isa
    from torch.nn.attention.flex_attention import flex_attention

    try:
        from torchtitan.models.common.attention import FlexAttention
    except ImportError:  # a release without this class (the compatibility venvs' older torchtitan)
        return
    if str(pick_vec_isa()) == "avx2" and hasattr(FlexAttention, "_compiled_flex_attn"):
        FlexAttention._compiled_flex_attn = flex_attention
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")


_flex_on_cpu_exact()


@dataclass
class Family:
    name: str  # ours: the shipped adapter's name
    hf_config: Any
    hf_class: Any
    titan_config: Any
    titan_adapter: Any  # torchtitan's own StateDictAdapter class
    logits: bool = True  # transformers and torchtitan compute the same function for this config


def _top(cls: Any, layers: list[Any], **kw: Any) -> Any:
    from torchtitan.models.common import Embedding, Linear, RMSNorm

    return cls.Config(
        dim=DIM, vocab_size=VOCAB, tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        norm=RMSNorm.Config(normalized_shape=DIM, eps=kw.pop("eps", 1e-5)),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB), layers=layers, **kw,
    )  # fmt: skip


def llama3() -> Family:
    from torchtitan.models.common import ComplexRoPE
    from torchtitan.models.llama3 import Llama3Model, Llama3StateDictAdapter, _build_llama3_layers
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaConfig(hidden_size=DIM, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=VOCAB, rms_norm_eps=1e-5, rope_theta=10000.0,
                     tie_word_embeddings=False)  # fmt: skip
    layers = _build_llama3_layers(n_layers=LAYERS, dim=DIM, n_heads=4, n_kv_heads=2, hidden_dim=64, attn_backend="flex",
                                  rope=ComplexRoPE.Config(dim=DIM // 4, max_seq_len=64, theta=10000.0))  # fmt: skip
    return Family("llama", hf, LlamaForCausalLM, _top(Llama3Model, layers), Llama3StateDictAdapter)


def _qwen3_rope() -> Any:
    from torchtitan.models.common import CosSinRoPE

    return CosSinRoPE.Config(dim=16, max_seq_len=64, theta=1000000.0)


def qwen3() -> Family:
    from torchtitan.models.qwen3 import Qwen3Model, Qwen3StateDictAdapter, _build_qwen3_layers
    from transformers import Qwen3Config, Qwen3ForCausalLM

    hf = Qwen3Config(hidden_size=DIM, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, rms_norm_eps=1e-6, rope_theta=1000000.0,
                     tie_word_embeddings=False)  # fmt: skip
    layers = _build_qwen3_layers(n_layers=LAYERS, dim=DIM, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=64,
                                 attn_backend="flex", rope=_qwen3_rope())  # fmt: skip
    return Family("qwen3", hf, Qwen3ForCausalLM, _top(Qwen3Model, layers, eps=1e-6), Qwen3StateDictAdapter)


def qwen3_tied() -> Family:
    """Qwen3 with tied embeddings (the small releases): no ``lm_head.weight`` in the checkpoint."""
    family = qwen3()
    family.hf_config.tie_word_embeddings = True
    family.titan_config.enable_weight_tying = True
    return family


def qwen3_moe() -> Family:
    from torchtitan.models.qwen3 import Qwen3Model, Qwen3StateDictAdapter, _build_qwen3_moe_layers
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    hf = Qwen3MoeConfig(hidden_size=DIM, intermediate_size=64, moe_intermediate_size=24, num_experts=4,
                        num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=LAYERS, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, rms_norm_eps=1e-6,
                        rope_theta=1000000.0, tie_word_embeddings=False)  # fmt: skip
    layers = _build_qwen3_moe_layers(n_layers=LAYERS, dim=DIM, n_heads=4, n_kv_heads=2, head_dim=16, moe_hidden_dim=24,
                                     num_experts=4, top_k=2, attn_backend="flex", moe_comm_backend="standard",
                                     rope=_qwen3_rope())  # fmt: skip
    return Family("qwen3_moe", hf, Qwen3MoeForCausalLM, _top(Qwen3Model, layers, eps=1e-6), Qwen3StateDictAdapter)


def deepseek_v3() -> Family:
    from torchtitan.models.common import ComplexRoPE
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3StateDictAdapter, _build_dsv3_layers
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    # routed_scaling_factor 1 and no top-k renormalisation: torchtitan's router as built below
    hf = DeepseekV3Config(hidden_size=DIM, intermediate_size=64, moe_intermediate_size=16, n_routed_experts=4,
                          n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                          num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
                          kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, vocab_size=VOCAB,
                          rms_norm_eps=1e-5, rope_theta=10000.0, routed_scaling_factor=1.0, norm_topk_prob=False,
                          tie_word_embeddings=False)  # fmt: skip
    layers = _build_dsv3_layers(n_layers=LAYERS, n_dense_layers=1, dim=DIM, n_heads=4, q_lora_rank=0, kv_lora_rank=16,
                                qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, mscale=1.0, dense_hidden_dim=64,
                                moe_hidden_dim=16, num_experts=4, num_shared_experts=1, router_top_k=2,
                                router_score_func="sigmoid", attn_backend="flex", moe_comm_backend="standard",
                                non_blocking_capacity_factor=None,
                                rope=ComplexRoPE.Config(dim=8, max_seq_len=64, theta=10000.0))  # fmt: skip
    return Family("deepseek_v3", hf, DeepseekV3ForCausalLM, _top(DeepSeekV3Model, layers, mtp_layers=[]),
                  DeepSeekV3StateDictAdapter)  # fmt: skip


def gpt_oss() -> Family:
    from torchtitan.models.gpt_oss import GptOssModel, GptOssStateDictAdapter, _build_gptoss_layers
    from transformers import GptOssConfig, GptOssForCausalLM

    hf = GptOssConfig(hidden_size=DIM, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                      num_hidden_layers=LAYERS, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                      vocab_size=VOCAB, rms_norm_eps=1e-5, rope_theta=150000.0, rope_scaling=None,
                      tie_word_embeddings=False)  # fmt: skip
    layers = _build_gptoss_layers(dim=DIM, n_layers=LAYERS, hidden_dim=16, num_experts=4, top_k=2, load_balance_coeff=1e-3,
                                  attn_backend="flex", moe_comm_backend="standard", rope=_gpt_oss_rope())  # fmt: skip
    # no logits: torchtitan's flex attention with sinks needs return_lse, which compiled flex lacks on CPU
    return Family("gpt_oss", hf, GptOssForCausalLM, _top(GptOssModel, layers), GptOssStateDictAdapter, logits=False)


def _gpt_oss_rope() -> Any:
    from torchtitan.models.common import CosSinRoPE

    return CosSinRoPE.Config(dim=64, max_seq_len=64, theta=150000.0)


FAMILIES = {
    "llama3": llama3, "qwen3": qwen3, "qwen3_tied": qwen3_tied, "qwen3_moe": qwen3_moe, "deepseek_v3": deepseek_v3,
    "gpt_oss": gpt_oss,
}  # fmt: skip


def write_hf(family: Family, root: str, seed: int = 0, shard: str | None = "40KB") -> tuple[str, Any]:
    """The family's transformers model with random weights, saved with ``save_pretrained``
    (sharded, with an index, when ``shard`` is given). Returns (folder, the model)."""
    torch.manual_seed(seed)
    model = family.hf_class(family.hf_config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    path = os.path.join(root, family.name)
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    return path, model


def titan_model(family: Family, device: str = "meta") -> torch.nn.Module:
    """torchtitan's model for the family, built on ``device`` (torchtitan's flow: meta first)."""
    with torch.device(device):
        return family.titan_config.build()


def titan_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    return model(tokens, positions=positions, attention_masks=model.get_attention_masks(positions))
