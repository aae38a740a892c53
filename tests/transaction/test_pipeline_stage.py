"""Pipeline stages: a model that holds a subset of the layers loads its own keys strictly
(``pipeline_stage=True`` of ``load`` / ``plan_load`` / ``diff`` and ``sdadapt diff --pipeline-stage``).

The checkpoint is a tiny HF Llama (4 layers) written by transformers; the model is the Meta
layout (``reference_models.MetaLlama``) split as ``torch.distributed.pipelining``'s manual
split leaves it: the kept layers under their original indices in a ``ModuleDict``, the other
stages' top-level modules set to ``None``. Stage 0 holds ``tok_embeddings`` and layers 0-1,
stage 1 layers 2-3, ``norm`` and ``output``. The distributed case runs both stages with FSDP2
inside each (4 gloo ranks: 2 stages x 2) and compares every parameter bit-exactly with the
eager reference: the whole (unsplit) model's plan computed with ``Node.full`` on full tensors.
"""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from support.checkpoints import DictIO, write_safetensors
from support.dist_helper import run_distributed
from support.reference_models import MetaLlama
from torch import nn

import sdadapt
from sdadapt.cli import main
from sdadapt.errors import PlanError

CFG = dict(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=64, hidden_dim=64, norm_eps=1e-5, rope_theta=10000.0)
STAGES = {0: (0, 1), 1: (2, 3)}


def stage_model(stage: int, *, vacate: str = "none", device: str = "meta") -> MetaLlama:
    """Stage ``stage`` of the Meta Llama: its layers kept under their original indices in a
    ``ModuleDict``; the modules of the other stage set to ``None`` (``vacate="none"``, as
    torch's manual split does) or deleted (``vacate="delete"``)."""
    with torch.device(device):
        model = MetaLlama(CFG)
    layers = model.layers
    model.layers = nn.ModuleDict({str(i): layers[i] for i in STAGES[stage]})
    others = ("norm", "output") if stage == 0 else ("tok_embeddings",)
    for name in others:
        if vacate == "none":
            setattr(model, name, None)
        else:
            delattr(model, name)
    return model


def write_hf_llama(folder: str, tie: bool = False) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=CFG["dim"], intermediate_size=CFG["hidden_dim"], num_hidden_layers=CFG["n_layers"],
                      num_attention_heads=CFG["n_heads"], num_key_value_heads=CFG["n_kv_heads"],
                      vocab_size=CFG["vocab_size"], tie_word_embeddings=tie)  # fmt: skip
    hf = LlamaForCausalLM(cfg)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    hf.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_hf_llama(str(tmp_path_factory.mktemp("pp") / "llama"))


def eager_reference(path: str) -> dict[str, torch.Tensor]:
    """Every key of the whole model, computed eagerly (``Node.full``) from the full tensors."""
    adapter = sdadapt.get_adapter("llama", source=path)
    with torch.device("meta"):
        whole = MetaLlama(CFG)
    source, plan = sdadapt.plan_load(whole, path, adapter)
    source.close()
    assert plan.report.ok, plan.report.format()
    io = DictIO(load_file(os.path.join(path, "model.safetensors")))
    return {k: node.full(io) for k, node in plan.recipes.items()}


def other_stage_keys(stage: int) -> set[str]:
    """The model keys of the other stage (what its checkpoint keys become through the adapter)."""
    with torch.device("meta"):
        whole = MetaLlama(CFG)
    return set(whole.state_dict()) - set(stage_model(stage).state_dict())


# --- 2 stages x FSDP2 (4 gloo ranks) --------------------------------------------------------------


def _load_stages(path: str, reference: dict[str, torch.Tensor]) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "fsdp"))
    stage = mesh["pp"].get_local_rank()
    model = stage_model(stage)
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh["fsdp"])
    fully_shard(model, mesh=mesh["fsdp"])
    rep = sdadapt.load(model, path, sdadapt.get_adapter("llama", source=path), pipeline_stage=True)
    bad = []
    for k, v in model.state_dict().items():
        assert isinstance(v, DTensor), k
        if not torch.equal(v.full_tensor(), reference[k]):
            bad.append(k)
    return {
        "stage": stage,
        "keys": sorted(model.state_dict()),
        "bad": bad,
        "allowed_unexpected": sorted(rep.report.allowed_unexpected),
        "unexpected": rep.report.unexpected,
        "bytes_read": rep.bytes_read,
        "local_bytes": rep.local_bytes,
    }


def test_two_stages_with_fsdp_load_bit_exact(hf_llama: str) -> None:
    reference = eager_reference(hf_llama)
    results = run_distributed(_load_stages, 4, hf_llama, reference, timeout=170)
    assert sorted(r["stage"] for r in results) == [0, 0, 1, 1]
    for r in results:
        assert r["bad"] == [], r
        assert r["unexpected"] == []
        assert set(r["allowed_unexpected"]) == other_stage_keys(r["stage"])
        assert r["bytes_read"] == r["local_bytes"]  # its own shards of its own layers only
    held = {r["stage"]: r["keys"] for r in results}
    assert [k for k in held[0] if k.startswith("layers.")] == sorted(
        k for k in reference if k.startswith(("layers.0.", "layers.1."))
    )
    assert "tok_embeddings.weight" in held[0] and "output.weight" not in held[0]
    assert "norm.weight" in held[1] and "tok_embeddings.weight" not in held[1]
    assert set(held[0]) | set(held[1]) == set(reference)


# --- planning rules and errors (one process, meta models) ------------------------------------------


def test_stage_plan_lists_other_stages_keys(hf_llama: str) -> None:
    adapter = sdadapt.get_adapter("llama", source=hf_llama)
    for stage in STAGES:
        source, plan = sdadapt.plan_load(stage_model(stage), hf_llama, adapter, pipeline_stage=True)
        source.close()
        assert plan.report.ok, plan.report.format()
        assert set(plan.other_stages) == other_stage_keys(stage)
        assert set(plan.recipes) == set(stage_model(stage).state_dict())


def test_without_the_argument_other_stages_keys_are_unexpected(hf_llama: str) -> None:
    adapter = sdadapt.get_adapter("llama", source=hf_llama)
    report = sdadapt.diff(stage_model(0), hf_llama, adapter)
    assert set(report.unexpected) == other_stage_keys(0)
    with pytest.raises(PlanError, match=r"layers\.\{2\.\.3\}\.attention\.wq\.weight") as err:
        sdadapt.load(stage_model(0), hf_llama, adapter)
    assert set(err.value.report.unexpected) == other_stage_keys(0)


def _rewrite(src: str, dst: Path, drop: tuple[str, ...] = (), add: dict[str, torch.Tensor] | None = None) -> str:
    tensors = load_file(os.path.join(src, "model.safetensors"))
    for k in drop:
        del tensors[k]
    tensors.update(add or {})
    dst.mkdir()
    (dst / "config.json").write_text(Path(src, "config.json").read_text())
    write_safetensors(str(dst / "model.safetensors"), tensors)
    return str(dst)


def test_missing_key_of_own_layer_is_an_error(hf_llama: str, tmp_path: Path) -> None:
    path = _rewrite(hf_llama, tmp_path / "ck", drop=("model.layers.1.mlp.up_proj.weight",))
    adapter = sdadapt.get_adapter("llama", source=path)
    with pytest.raises(PlanError, match=r"layers\.1\.feed_forward\.w3\.weight") as err:
        sdadapt.load(stage_model(0), path, adapter, pipeline_stage=True)
    assert err.value.report.missing == ["layers.1.feed_forward.w3.weight"]
    assert sdadapt.diff(stage_model(1), path, adapter, pipeline_stage=True).ok  # not stage 1's layer


def test_keys_that_map_to_nothing_stay_unexpected(hf_llama: str, tmp_path: Path) -> None:
    extra = {
        "model.layers.3.self_attn.rotary.weight": torch.zeros(2),  # no rule maps it; not the model's pattern
        "layers.7.attention.extra": torch.zeros(2),  # an index, but no key of the stage has this pattern
        "model.extra.weight": torch.zeros(2),  # no index, no vacant module
    }
    path = _rewrite(hf_llama, tmp_path / "ck", add=extra)
    adapter = sdadapt.get_adapter("llama", source=path)
    for stage in STAGES:
        report = sdadapt.diff(stage_model(stage), path, adapter, pipeline_stage=True)
        assert sorted(report.unexpected) == sorted(extra), stage
        assert set(report.allowed_unexpected) == other_stage_keys(stage)
        with pytest.raises(PlanError, match="model.extra.weight"):
            sdadapt.load(stage_model(stage), path, adapter, pipeline_stage=True)


def test_deleted_top_level_modules_leave_no_slot(hf_llama: str) -> None:
    """Only ``None`` slots say that a top-level module is another stage's; a deleted one leaves
    no trace in the model, so its keys are unexpected (``allow_unexpected`` names them)."""
    adapter = sdadapt.get_adapter("llama", source=hf_llama)
    report = sdadapt.diff(stage_model(0, vacate="delete"), hf_llama, adapter, pipeline_stage=True)
    assert sorted(report.unexpected) == ["norm.weight", "output.weight"]
    report = sdadapt.diff(
        stage_model(0, vacate="delete"), hf_llama, adapter, pipeline_stage=True, allow_unexpected=["norm.weight", "output.weight"]
    )
    assert report.ok


def test_stage_loads_in_one_process_bit_exact(hf_llama: str) -> None:
    reference = eager_reference(hf_llama)
    adapter = sdadapt.get_adapter("llama", source=hf_llama)
    for stage in STAGES:
        model = stage_model(stage)
        rep = sdadapt.load(model, hf_llama, adapter, pipeline_stage=True)
        assert rep.keys_loaded == len(model.state_dict())
        for k, v in model.state_dict().items():
            assert torch.equal(v, reference[k]), k


def test_tied_output_on_the_last_stage(tmp_path: Path) -> None:
    """A tied checkpoint (no ``lm_head.weight``): the last stage fills ``output`` from the
    embeddings' bytes although ``tok_embeddings`` is another stage's module."""
    path = write_hf_llama(str(tmp_path / "tied"), tie=True)
    embed = load_file(os.path.join(path, "model.safetensors"))["model.embed_tokens.weight"]
    adapter = sdadapt.get_adapter("llama", source=path)
    first, last = stage_model(0), stage_model(1)
    sdadapt.load(first, path, adapter, pipeline_stage=True)
    rep = sdadapt.load(last, path, adapter, pipeline_stage=True)
    assert "tok_embeddings.weight" in rep.report.allowed_unexpected
    assert torch.equal(last.output.weight, embed) and torch.equal(first.tok_embeddings.weight, embed)


STAGE_PY = """
from test_pipeline_stage import stage_model


def build(stage=0):
    return stage_model(stage)
"""


def test_cli_diff_pipeline_stage(
    hf_llama: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "pp_stage_models.py").write_text(textwrap.dedent(STAGE_PY))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    monkeypatch.delitem(sys.modules, "pp_stage_models", raising=False)
    base = ["diff", hf_llama, "-t", "pp_stage_models:build", "--adapter", "llama", "--target-option", "stage=1"]
    assert main(base) == 1
    assert "layers.{0..1}.attention.wq.weight" in capsys.readouterr().out
    assert main([*base, "--pipeline-stage"]) == 0
    out = capsys.readouterr().out
    assert "allowed: 0 missing and 19 unexpected key(s)" in out, out
