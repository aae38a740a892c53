"""Resuming a pipeline stage: ``load_state(..., pipeline_stage=True)`` restores the stage's own
parameters and the state of its own optimizer, from a checkpoint saved by the whole model or by
another split into stages.

The model is the Meta Llama of ``reference_models`` (4 layers); a stage keeps some layers under
their original indices in a ``ModuleDict`` and sets the top-level modules it does not hold to
``None`` (as ``torch.distributed.pipelining``'s manual split and torchtitan leave them). Each
stage has its own AdamW over its own parameters. The saved model and optimizer took one step
with fixed gradients, so every moment (``exp_avg``, ``exp_avg_sq``, ``step``) holds values of
its own; every comparison is bit for bit.
"""

from __future__ import annotations

import os
import zlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support.dist_helper import run_distributed
from support.reference_models import MetaLlama
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

import sdadapt
from sdadapt.errors import PlanError

CFG = dict(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=64, hidden_dim=64, norm_eps=1e-5, rope_theta=10000.0)
MOMENTS = ("exp_avg", "exp_avg_sq", "step")


def stage_model(layers: tuple[int, ...], cfg: dict[str, Any] = CFG, seed: int = 1) -> MetaLlama:
    """The stage of the Meta Llama that holds ``layers``: ``tok_embeddings`` with layer 0,
    ``norm`` and ``output`` with the last layer, the other top-level modules set to ``None``."""
    torch.manual_seed(seed)
    model = MetaLlama(cfg)
    kept = model.layers
    model.layers = nn.ModuleDict({str(i): kept[i] for i in layers})
    if 0 not in layers:
        model.tok_embeddings = None
    if cfg["n_layers"] - 1 not in layers:
        model.norm = None
        model.output = None
    return model


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def take_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    """One optimizer step with gradients fixed by (``seed``, parameter name): the same
    parameter gets the same gradient whichever stage (or whole model) holds it."""
    for name, p in model.named_parameters():
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    opt.zero_grad()


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def moments_of(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """The optimizer's per-parameter state by parameter name."""
    state = get_state_dict(model, opt)[1]["state"]
    return {fqn: {n: v.detach().clone() for n, v in st.items()} for fqn, st in state.items()}


def nbytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """The bytes of the model's state tensors and of its optimizer's state tensors."""
    tensors = [*model.state_dict().values(), *(v for st in opt.state.values() for v in st.values())]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def differences(
    model: nn.Module, opt: torch.optim.Optimizer, params: dict[str, torch.Tensor], moments: dict[str, dict[str, torch.Tensor]]
) -> list[str]:
    """The stage's parameters and moments that differ from ``params`` / ``moments`` (by name)."""
    bad = [k for k, v in model.state_dict().items() if not torch.equal(v, params[k])]
    got = moments_of(model, opt)
    bad += [f"{fqn}.{n}" for fqn, st in got.items() for n in MOMENTS if not torch.equal(st[n], moments[fqn][n])]
    if sorted(got) != sorted(model.state_dict()):
        bad.append(f"optimizer state for {sorted(got)}")
    return bad


def others_allowed(stage: nn.Module, whole_keys: set[str]) -> set[str]:
    """What a stage's report allows: the other stages' model keys and their optimizer state."""
    other = whole_keys - set(stage.state_dict())
    return other | {f"optim.state.{k}.{n}" for k in other for n in MOMENTS}


@pytest.fixture(scope="module")
def saved_whole(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """A checkpoint of the whole model after one AdamW step, with its parameters and moments."""
    whole = stage_model((0, 1, 2, 3), seed=0)
    opt = adamw(whole)
    take_step(whole, opt, seed=1)
    dst = str(tmp_path_factory.mktemp("ppstate") / "whole")
    sdadapt.save_state(whole, dst, opt, extra={"step": 1})
    return dst, params_of(whole), moments_of(whole, opt)


# --- one process ----------------------------------------------------------------------------------


def test_two_stages_resume_their_own_state_from_a_whole_checkpoint(saved_whole: tuple[str, Any, Any]) -> None:
    dst, params, moments = saved_whole
    for layers in ((0, 1), (2, 3)):
        model = stage_model(layers)
        opt = adamw(model)
        extra = {"step": 0}
        rep = sdadapt.load_state(model, dst, opt, extra, pipeline_stage=True)
        assert differences(model, opt, params, moments) == [], layers
        assert rep.report.unexpected == [] and rep.report.missing == []
        assert set(rep.report.allowed_unexpected) == others_allowed(model, set(params)), layers
        assert rep.model_keys == len(model.state_dict()) and rep.optimizer_keys == 3 * len(model.state_dict())
        assert rep.bytes_read == nbytes(model, opt)  # its own layers' bytes, nothing of the other stage
        assert extra["step"] == 1


def test_resumed_stages_continue_as_the_whole_model(saved_whole: tuple[str, Any, Any], tmp_path: Any) -> None:
    """Hyperparameters and step counts came back too: the next step of each stage gives what
    the next step of the whole model gives."""
    dst, _, _ = saved_whole
    whole = stage_model((0, 1, 2, 3), seed=3)
    whole_opt = adamw(whole)
    sdadapt.load_state(whole, dst, whole_opt)
    take_step(whole, whole_opt, seed=2)
    for layers in ((0,), (1, 2), (3,)):
        model = stage_model(layers)
        opt = adamw(model)
        sdadapt.load_state(model, dst, opt, pipeline_stage=True)
        take_step(model, opt, seed=2)
        assert differences(model, opt, params_of(whole), moments_of(whole, whole_opt)) == [], layers


def test_without_the_argument_other_stages_keys_and_state_are_unexpected(saved_whole: tuple[str, Any, Any]) -> None:
    dst, params, _ = saved_whole
    model = stage_model((2, 3))
    with pytest.raises(PlanError) as err:
        sdadapt.load_state(model, dst, adamw(model))
    assert set(err.value.report.unexpected) == others_allowed(model, set(params))


def test_a_missing_key_of_the_stage_is_an_error_naming_it(tmp_path: Any) -> None:
    """The checkpoint lacks layer 1's ``w3`` (and so its moments): stage 0-1 refuses to load,
    naming the key and its state, and is left as it was; stage 2-3 does not need it."""
    whole = stage_model((0, 1, 2, 3), seed=0)
    del whole.layers["1"].feed_forward.w3
    whole_opt = adamw(whole)
    take_step(whole, whole_opt, seed=1)
    dst = str(tmp_path / "ck")
    sdadapt.save_state(whole, dst, whole_opt)

    model = stage_model((0, 1))
    opt = adamw(model)
    before = params_of(model)
    key = "layers.1.feed_forward.w3.weight"
    with pytest.raises(PlanError, match=key.replace(".", r"\.")) as err:
        sdadapt.load_state(model, dst, opt, pipeline_stage=True)
    assert sorted(err.value.report.missing) == sorted([key] + [f"optim.state.{key}.{n}" for n in MOMENTS])
    assert err.value.report.unexpected == []
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())

    other = stage_model((2, 3))
    other_opt = adamw(other)
    sdadapt.load_state(other, dst, other_opt, pipeline_stage=True)
    assert differences(other, other_opt, params_of(whole), moments_of(whole, whole_opt)) == []


def test_stage_resumes_through_a_refactor(saved_whole: tuple[str, Any, Any]) -> None:
    """Saved with separate q/k/v, resumed into stages with a fused ``wqkv``: the moments are
    fused as the weights are, and ``step`` (one value per parameter) comes from ``wq``'s; the
    other stage's q/k/v state, which the stage's names do not resemble, is still allowed."""
    dst, params, moments = saved_whole
    qkv = ["layers.{i}.attention.wq.weight", "layers.{i}.attention.wk.weight", "layers.{i}.attention.wv.weight"]
    adapter = sdadapt.Adapter([sdadapt.fuse(qkv, "layers.{i}.attention.wqkv.weight", sizes=[32, 16, 16])], name="fuse-qkv")
    for layers in ((0, 1), (2, 3)):
        model = stage_model(layers, {**CFG, "fused_qkv": True})
        opt = adamw(model)
        rep = sdadapt.load_state(model, dst, opt, adapter=adapter, pipeline_stage=True)
        assert rep.report.unexpected == []
        got = moments_of(model, opt)
        for i in layers:
            fused, parts = f"layers.{i}.attention.wqkv.weight", [k.format(i=i) for k in qkv]
            assert torch.equal(model.state_dict()[fused], torch.cat([params[k] for k in parts]))
            for n in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(got[fused][n], torch.cat([moments[k][n] for k in parts])), (fused, n)
            assert torch.equal(got[fused]["step"], moments[parts[0]]["step"])
        other = {i for i in range(4) if i not in layers}
        for i in other:
            assert f"optim.state.layers.{i}.attention.wk.weight.step" in rep.report.allowed_unexpected


# --- 2 gloo ranks, one stage each -----------------------------------------------------------------


def _save_stages_then_resume_another_split(folder: str) -> dict[str, Any]:
    """Each rank holds one 2-layer stage, takes a step and saves collectively; then each rank
    resumes a stage of another split (rank 0: layer 0, rank 1: layers 1-3)."""
    rank = dist.get_rank()
    model = stage_model(((0, 1), (2, 3))[rank], seed=0)
    opt = adamw(model)
    take_step(model, opt, seed=1)
    dst = os.path.join(folder, "stages")
    sdadapt.save_state(model, dst, opt)
    saved = (params_of(model), moments_of(model, opt))

    resumed = stage_model(((0,), (1, 2, 3))[rank])
    resumed_opt = adamw(resumed)
    rep = sdadapt.load_state(resumed, dst, resumed_opt, pipeline_stage=True)
    return {
        "saved": saved,
        "resumed": (params_of(resumed), moments_of(resumed, resumed_opt)),
        "allowed_unexpected": set(rep.report.allowed_unexpected),
        "unexpected": rep.report.unexpected,
        "bytes_read": rep.bytes_read,
        "own_bytes": nbytes(resumed, resumed_opt),
    }


def test_stages_saved_on_two_ranks_resume_into_other_splits(tmp_path: Any) -> None:
    results = run_distributed(_save_stages_then_resume_another_split, 2, str(tmp_path), timeout=240)
    params = {k: v for r in results for k, v in r["saved"][0].items()}
    moments = {k: v for r in results for k, v in r["saved"][1].items()}
    assert set(params) == set(MetaLlama(CFG).state_dict())  # the two stages saved the whole model
    for rank, r in enumerate(results):
        got_params, got_moments = r["resumed"]
        assert [k for k, v in got_params.items() if not torch.equal(v, params[k])] == [], rank
        assert sorted(got_moments) == sorted(got_params)
        assert [f for f, st in got_moments.items() for n in MOMENTS if not torch.equal(st[n], moments[f][n])] == []
        assert r["unexpected"] == [] and r["bytes_read"] == r["own_bytes"], rank
        other = set(params) - set(got_params)
        assert r["allowed_unexpected"] == other | {f"optim.state.{k}.{n}" for k in other for n in MOMENTS}
    # the same checkpoint, resumed in this process into four 1-layer stages
    for i in range(4):
        model = stage_model((i,))
        opt = adamw(model)
        rep = sdadapt.load_state(model, os.path.join(str(tmp_path), "stages"), opt, pipeline_stage=True)
        assert differences(model, opt, params, moments) == [], i
        assert rep.bytes_read == nbytes(model, opt)
