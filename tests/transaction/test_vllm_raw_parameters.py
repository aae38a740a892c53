"""``raw_parameters``: what the sdadapt backend stages for a vLLM engine rank, here on modules
shaped as vLLM's are after their post-processing (no vLLM needed; the live engine's staging is
checked in tests/transaction/test_vllm_live.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from sdadapt._refit.vllm_worker import raw_parameters


def _processed_linear(params_dtype: torch.dtype | None) -> nn.Module:
    """A linear layer as vLLM's CPU kernels for AMX leave it: the weight packed away (an empty
    parameter), the bias widened to float32; the weight as created recorded for reloading."""
    layer = nn.Module()
    layer.weight = nn.Parameter(torch.empty(0, dtype=torch.bfloat16), requires_grad=False)
    layer.bias = nn.Parameter(torch.zeros(4, dtype=torch.float32), requires_grad=False)
    if params_dtype is not None:
        layer.params_dtype = params_dtype
    return layer


def _infos(model: nn.Module) -> dict[nn.Module, SimpleNamespace]:
    recorded = {"weight": torch.empty(4, 3, dtype=torch.bfloat16, device="meta")}
    return {m: SimpleNamespace(restore_metadata=(recorded if hasattr(m, "weight") else {}, {})) for m in model.modules()}


def test_a_widened_bias_is_staged_in_the_dtype_its_layer_created_it_in() -> None:
    model = nn.Sequential(_processed_linear(torch.bfloat16))
    assert raw_parameters(model, _infos(model), frozenset({"e_score_correction_bias"})) == [
        ("0.weight", torch.bfloat16, (4, 3)),
        ("0.bias", torch.bfloat16, (4,)),
    ]


def test_a_live_tensor_without_a_created_dtype_keeps_its_own() -> None:
    model = nn.Sequential(_processed_linear(None))
    gate = model[0]
    gate.e_score_correction_bias = nn.Parameter(torch.zeros(4, dtype=torch.float32), requires_grad=False)
    gate.params_dtype = torch.bfloat16  # a router's: its correction bias is float32 whatever the layer's dtype
    got = raw_parameters(model, _infos(model), frozenset({"e_score_correction_bias"}))
    assert ("0.e_score_correction_bias", torch.float32, (4,)) in got
    lone = nn.Sequential(_processed_linear(None))
    assert ("0.bias", torch.float32, (4,)) in raw_parameters(lone, _infos(lone))
