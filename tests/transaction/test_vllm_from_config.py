"""The vLLM layouts read from a model's HF config (``from_config``), with what the hand-sized
``build`` could not express before: q/k/v biases (Qwen2), tied embeddings with one KV head on TP 2,
and transformers 5's stacked experts. Each engine shard is checked against vLLM's rule written out
(rank ``r``: its q heads, KV head ``r // (tp / n_kv)``, the vocabulary padded to 64); no processes.
The live engine: tests/transaction/test_vllm_live.py."""

from __future__ import annotations

import torch
import transformers
from sdadapt.adapters import vllm_llama, vllm_qwen3_moe
from support.refit_eager import eager

from sdadapt._base.schema import slices


def _shard(whole: dict[str, torch.Tensor], layout, key: str) -> torch.Tensor:
    """Rank's shard of ``key``: ``layout`` gives the box of a tensor of the shard's shape."""
    t = whole[key]
    d = layout.dim_of(key)
    shard_shape = list(t.shape)
    if d is not None:
        shard_shape[d] //= layout.size
    _, box = layout(key, torch.empty(shard_shape, device="meta"))
    return t[slices(box)]


def test_qwen2_biases_tied_one_kv_head_on_tp2() -> None:
    config = transformers.Qwen2Config(vocab_size=70, hidden_size=24, intermediate_size=16, num_hidden_layers=1,
                                      num_attention_heads=6, num_key_value_heads=1, tie_word_embeddings=True)  # fmt: skip
    shape = vllm_llama.config_shape(config)
    assert shape == dict(n_heads=6, n_kv_heads=1, head_dim=4, hidden_dim=16, tie_embeddings=True, qkv_bias=True, mlp_bias=False,
                         o_bias=False, qk_norm=False)  # fmt: skip
    torch.manual_seed(0)
    full = {k: v.detach() for k, v in transformers.Qwen2ForCausalLM(config).state_dict().items()}
    whole = eager(full, vllm_llama.from_config(config, tp=2))
    sizes = vllm_llama.parameter_shapes(n_layers=1, vocab_size=70, dim=24, tp=2, **shape)
    assert "lm_head.weight" not in whole and "model.layers.0.self_attn.qkv_proj.bias" in sizes
    p = "model.layers.0.self_attn."
    for r in range(2):
        lay = vllm_llama.layout(2, r)
        for kind in ("weight", "bias"):
            q, k, v = (full[p + f"{n}_proj.{kind}"] for n in "qkv")
            want = torch.cat([q[r * 12 : (r + 1) * 12], k, v])  # 3 q heads each; the one KV head on both ranks
            assert torch.equal(_shard(whole, lay, p + f"qkv_proj.{kind}"), want), (r, kind)
        emb = _shard(whole, lay, "model.embed_tokens.weight")
        padded = torch.cat([full["model.embed_tokens.weight"], torch.zeros(58, 24)])  # 70 -> 128 rows
        assert torch.equal(emb, padded[r * 64 : (r + 1) * 64])
        assert {k: tuple(_shard(whole, lay, k).shape) for k in whole} == sizes


def test_llama_attention_and_mlp_biases() -> None:
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=8, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, attention_bias=True, mlp_bias=True)  # fmt: skip
    shape = vllm_llama.config_shape(config)
    assert shape["qkv_bias"] and shape["mlp_bias"] and shape["o_bias"] and not shape["tie_embeddings"]
    full = {k: v.detach() for k, v in transformers.LlamaForCausalLM(config).state_dict().items()}
    whole = eager(full, vllm_llama.from_config(config, tp=2))
    sizes = vllm_llama.parameter_shapes(n_layers=1, vocab_size=64, dim=16, tp=2, **shape)
    lay = vllm_llama.layout(2, 1)
    assert {k: tuple(_shard(whole, lay, k).shape) for k in whole} == sizes
    up = full["model.layers.0.mlp.gate_proj.bias"][4:], full["model.layers.0.mlp.up_proj.bias"][4:]
    assert torch.equal(_shard(whole, lay, "model.layers.0.mlp.gate_up_proj.bias"), torch.cat(up))
    assert torch.equal(whole["model.layers.0.self_attn.o_proj.bias"], full["model.layers.0.self_attn.o_proj.bias"])


def test_qwen3_moe_stacked_experts_make_what_per_expert_weights_make() -> None:
    config = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_experts=4,
                                         num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=4, mlp_only_layers=[])  # fmt: skip
    torch.manual_seed(0)
    stacked = {k: v.detach() for k, v in transformers.Qwen3MoeForCausalLM(config).state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in stacked  # transformers 5 holds them so
    per_expert = {k: v for k, v in stacked.items() if ".mlp.experts." not in k}
    gate_up, down = stacked["model.layers.0.mlp.experts.gate_up_proj"], stacked["model.layers.0.mlp.experts.down_proj"]
    for e in range(4):
        per_expert[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"] = gate_up[e, :8]
        per_expert[f"model.layers.0.mlp.experts.{e}.up_proj.weight"] = gate_up[e, 8:]
        per_expert[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] = down[e]
    a = eager(stacked, vllm_qwen3_moe.from_config(config, tp=2))
    b = eager(per_expert, vllm_qwen3_moe.from_config(config, tp=2, stacked_experts=False))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    w13 = "model.layers.0.mlp.experts.routed_experts.w13_weight"
    assert torch.equal(_shard(a, vllm_qwen3_moe.layout(2, 1), w13), torch.cat([gate_up[:, 4:8], gate_up[:, 12:]], dim=1))
