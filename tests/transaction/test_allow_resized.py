"""``load(..., allow_resized=[patterns])``: a model a bit larger than its checkpoint (a
classifier head of another size, tokens added to the vocabulary), torch's counterpart of
transformers' ``ignore_mismatched_sizes`` limited to the keys named.

The named keys whose shapes differ are not read and get their values as allowed missing keys
do (the module's ``reset_parameters()``, ``init_missing=``; a materialised model keeps its own),
said on one line; every other key loads bit for bit, and every other shape difference stays a
``PlanError`` before anything is written. On one process, then on 2 gloo ranks with FSDP2.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support.checkpoints import write_safetensors
from support.dist_helper import run_distributed
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import sdadapt
from sdadapt.errors import PlanError


class Classifier(nn.Module):
    """An embedding, a body and a head; ``vocab`` and ``classes`` set the two resizable sizes."""

    def __init__(self, vocab: int = 10, classes: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, 8)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, classes)


def checkpoint() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.detach().clone() for k, v in Classifier().state_dict().items()}


def meta_model(vocab: int = 12, classes: int = 5) -> Classifier:
    with torch.device("meta"):
        return Classifier(vocab, classes)


@pytest.fixture
def ckpt(tmp_path: Path) -> str:
    return str(write_safetensors(tmp_path / "m.safetensors", checkpoint()))


def test_named_keys_may_differ_and_the_rest_loads_exactly(ckpt: str) -> None:
    model = meta_model()
    rep = sdadapt.load(model, ckpt, allow_resized=["head.*", "emb.weight"])
    want = checkpoint()
    assert torch.equal(model.body.weight, want["body.weight"]) and torch.equal(model.body.bias, want["body.bias"])
    assert [m.key for m in rep.report.resized] == ["emb.weight", "head.weight", "head.bias"]
    assert rep.report.ok and rep.keys_loaded == 2
    assert model.head.weight.shape == (5, 8) and torch.isfinite(model.head.weight).all()  # its reset_parameters()
    lines = [line for line in str(rep).splitlines() if line.startswith("resized")]
    assert lines == [
        "resized (allow_resized, not read): 3 key(s): emb.weight [12, 8] (checkpoint [10, 8]), head.weight [5, 8] "
        "(checkpoint [3, 8]), head.bias [5] (checkpoint [3]): initialised by reset_parameters() of their modules"
    ]


def test_init_missing_and_a_materialised_model(ckpt: str) -> None:
    given: list[str] = []

    def init(model: nn.Module, keys: list[str]) -> None:
        given.extend(keys)
        with torch.no_grad():
            for k in keys:
                model.get_parameter(k).fill_(0.25)

    model = meta_model(10, 5)
    rep = sdadapt.load(model, ckpt, allow_resized=["head.*"], init_missing=init)
    assert sorted(given) == ["head.bias", "head.weight"] and torch.equal(model.head.bias, torch.full((5,), 0.25))
    assert "given by init_missing=" in str(rep)
    real = Classifier(10, 5)
    head = real.head.weight.detach().clone()
    sdadapt.load(real, ckpt, allow_resized=["head.*"])
    assert torch.equal(real.head.weight, head)  # kept
    assert torch.equal(real.body.weight, checkpoint()["body.weight"])


def test_strict_everywhere_else(ckpt: str) -> None:
    model = meta_model()
    with pytest.raises(PlanError) as e:  # emb.weight differs too and is not named
        sdadapt.load(model, ckpt, allow_resized=["head.*"])
    text = str(e.value)
    assert "emb.weight: model [12, 8], checkpoint gives [10, 8]" in text and "allow_resized=[patterns]" in text
    assert "resized (allow_resized, not read): 2 key(s)" in text
    assert all(p.is_meta for p in model.parameters())  # nothing was written
    with pytest.raises(PlanError, match="head.weight: model"):  # another number of dims is never a resize
        sdadapt.load(meta_model(10, 3), write_safetensors(Path(ckpt).parent / "flat.safetensors",
                     {**checkpoint(), "head.weight": torch.zeros(24)}), allow_resized=["head.*"])
    # same shapes: the pattern changes nothing
    same = meta_model(10, 3)
    rep = sdadapt.load(same, ckpt, allow_resized=["**"])
    assert rep.report.resized == [] and torch.equal(same.head.weight, checkpoint()["head.weight"])


def _ranks(path: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = meta_model(12, 6)
    for m in (model.emb, model.body, model.head):
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    rep = sdadapt.load(model, path, allow_resized=["head.*", "emb.weight"], progress=False)
    want = checkpoint()
    out = {
        "body": all(torch.equal(getattr(model.body, n).full_tensor(), want[f"body.{n}"]) for n in ("weight", "bias")),
        "dtensor": isinstance(model.head.weight, DTensor),
        "head_shape": tuple(model.head.weight.full_tensor().shape),
        "finite": bool(torch.isfinite(model.head.weight.full_tensor()).all() and torch.isfinite(model.emb.weight.full_tensor()).all()),
        "resized": [m.key for m in rep.report.resized],
        "line": [line for line in str(rep).splitlines() if line.startswith("resized")],
    }
    bad = meta_model(12, 6)
    fully_shard(bad, mesh=mesh)
    try:
        sdadapt.load(bad, path, allow_resized=["head.*"], progress=False)
        out["refused"] = False
    except PlanError:
        out["refused"] = all(p.is_meta for p in bad.parameters())
    dist.barrier()
    return out


def test_two_gloo_ranks_with_fsdp2(tmp_path: Path) -> None:
    path = str(write_safetensors(tmp_path / "m.safetensors", checkpoint()))
    results = run_distributed(_ranks, 2, path, timeout=180)
    for r in results:
        assert r["body"] and r["dtensor"] and r["head_shape"] == (6, 8) and r["finite"], r
        assert r["resized"] == ["emb.weight", "head.weight", "head.bias"]
        assert len(r["line"]) == 1 and r["line"][0].startswith("resized (allow_resized, not read): 3 key(s)")
        assert r["refused"], r
    assert os.path.exists(path)
