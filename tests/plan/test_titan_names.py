"""sdadapt._plan.titan_names: which renames to torchtitan's current names a model's keys call for.
(tests/adapters/test_torchtitan_real.py runs them against torchtitan's own model classes.)"""

from __future__ import annotations

import torch

import sdadapt
from sdadapt._plan.titan_names import for_export, native_names, retarget_ties, training_state, unexported_state
from sdadapt.torchtitan import apply_adapter


def _sd(*keys: str, shape: tuple[int, ...] = (4, 4)) -> dict[str, torch.Tensor]:
    return {k: torch.empty(shape, device="meta") for k in keys}


def _pairs(adapter: sdadapt.Adapter | None) -> list[tuple[str, str]]:
    assert adapter is not None
    return [(r.src, r.dst) for r in adapter.rules]  # type: ignore[attr-defined]


def test_our_documented_layout_gets_no_rule() -> None:
    assert native_names(_sd("tok_embeddings.weight", "layers.0.attention.wq.weight", "output.weight")) is None


def test_one_rule_per_pattern_when_every_key_has_torchtitans_name() -> None:
    sd = _sd("layers.0.attention.qkv_linear.wq.weight", "layers.1.attention.qkv_linear.wq.weight",
             "layers.0.attention.qkv_linear.wq.bias", "lm_head.weight")  # fmt: skip
    assert _pairs(native_names(sd)) == [
        ("layers.{i}.attention.wq.{p}", "layers.{i}.attention.qkv_linear.wq.{p}"),
        ("output.weight", "lm_head.weight"),
    ]


def test_a_key_the_model_also_holds_under_our_name_is_left_alone() -> None:
    """DeepSeek's MLA keeps ``attention.wq``; a model holding both names of one key gets literal
    rules for the others only."""
    sd = _sd("layers.0.attention.wq.weight", "layers.0.attention.qkv_linear.wq.weight",
             "layers.1.attention.qkv_linear.wq.weight")  # fmt: skip
    assert _pairs(native_names(sd)) == [("layers.1.attention.wq.weight", "layers.1.attention.qkv_linear.wq.weight")]


def test_produced_keys_limit_the_rules() -> None:
    sd = _sd("lm_head.weight", "layers.0.moe.expert_bias_E")
    assert _pairs(native_names(sd, produced={"output.weight"})) == [("output.weight", "lm_head.weight")]
    assert training_state(sd, produced={"output.weight"}) == ["layers.0.moe.expert_bias_E"]
    assert training_state(sd, produced={"layers.0.moe.expert_bias_E"}) == []


def test_gpt_oss_experts_fuse_and_interleave_gate_and_up() -> None:
    sd = _sd("layers.0.moe.routed_experts.inner_experts.mlp1_weight_EGD", shape=(2, 6, 4))
    adapter = native_names(sd)
    assert adapter is not None
    io = {"layers.0.moe.experts.w1": torch.arange(24.0).reshape(2, 3, 4), "layers.0.moe.experts.w3": -torch.arange(24.0).reshape(2, 3, 4)}
    out = apply_adapter(adapter, io)
    fused = out["layers.0.moe.routed_experts.inner_experts.mlp1_weight_EGD"]
    assert torch.equal(fused[:, 0::2], io["layers.0.moe.experts.w1"]) and torch.equal(fused[:, 1::2], io["layers.0.moe.experts.w3"])
    back = apply_adapter(adapter.inverse(), out)
    assert all(torch.equal(back[k], v) for k, v in io.items())


def test_ties_and_exports() -> None:
    adapter = sdadapt.get_adapter("llama", n_heads=2, tie_embeddings=True)
    model = _sd("tok_embeddings.weight", "lm_head.weight", "layers.0.moe.expert_bias_E")
    retargeted = retarget_ties(adapter, model)
    assert any(getattr(r, "kind", None) == "tie" and r.dst == "lm_head.weight" for r in retargeted.rules)  # type: ignore[attr-defined]
    assert unexported_state(model, adapter) == ["layers.0.moe.expert_bias_E"]
    _, kept = for_export(adapter, model)
    assert sorted(kept) == ["tok_embeddings.weight"]  # the tied output and the training state stay out
