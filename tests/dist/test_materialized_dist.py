"""After materialising a meta FSDP2 model, a load's targets are the tensors the model holds now,
whether they come from ``to_empty``'s own record (``Materialized.current``: no walk) or from
walking the state dict again: a persistent buffer gets a new tensor, an ``init_weights()`` may
replace one, a buffer two modules hold gets one tensor in each. Every case loads the
checkpoint's values into the model's own tensors (gloo, one and two ranks)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from support.dist_helper import run_distributed
from support.models import TinyTransformer, parallelize
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import sdadapt
from sdadapt._plan.target import load_targets
from sdadapt._transaction import transaction as txn_mod


class Buffered(TinyTransformer):
    """A persistent buffer beside the parameters (in the state dict, so the load writes it)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(5))


class Replacing(Buffered):
    """``init_weights()`` puts a new tensor in the buffer's place (torchtitan's models recompute
    their buffers so): the load must write into that one."""

    def init_weights(self) -> None:
        self.scale = torch.zeros(5)


class Sharing(Buffered):
    """The buffer held by two modules: materialising gives each of them a tensor of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.norm.register_buffer("scale", self.scale)


def _values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()}


def _build(cls: type[TinyTransformer]) -> TinyTransformer:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    with torch.device("meta"):
        model = cls()
    return parallelize(model, mesh)


def _case(folder: str, name: str) -> dict[str, Any]:
    cls = {"buffered": Buffered, "replacing": Replacing, "sharing": Sharing}[name]
    path = os.path.join(folder, f"{name}.safetensors")
    seen: dict[str, Any] = {}
    real = txn_mod.Transaction.materialize

    def spy(self: Any, *a: Any, **k: Any) -> bool:  # what the load's materialising recorded
        out = real(self, *a, **k)
        seen["renewed"] = self.materialized is not None and self.materialized.renewed is not None
        return out

    txn_mod.Transaction.materialize = spy  # type: ignore[method-assign]
    try:
        model = _build(cls)
        sdadapt.load(model, path)
    finally:
        txn_mod.Transaction.materialize = real  # type: ignore[method-assign]
    want = torch.load(os.path.join(folder, f"{name}.pt"))
    got = _values(model)
    own = {id(t) for t in (*model.parameters(), *model.buffers())}
    targets = load_targets(model)
    return {"renewed": seen["renewed"], "equal": sorted(k for k in want if torch.equal(got[k], want[k])), "keys": sorted(want),
            "own": all(id(t) in own for t in targets.values())}  # fmt: skip


def _write(folder: str, name: str, cls: type[TinyTransformer]) -> None:
    torch.manual_seed(7)
    model = cls()
    for p in model.parameters():
        torch.nn.init.normal_(p)
    with torch.no_grad():
        model.scale.copy_(torch.arange(5.0) + 2)
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    torch.save(sd, os.path.join(folder, f"{name}.pt"))
    save_file(sd, os.path.join(folder, f"{name}.safetensors"))  # a shared buffer under each of its keys


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize(("name", "renewed"), [("buffered", True), ("replacing", False), ("sharing", False)])
def test_targets_after_materialising_are_the_models_tensors(tmp_path: Any, world: int, name: str, renewed: bool) -> None:
    cls = {"buffered": Buffered, "replacing": Replacing, "sharing": Sharing}[name]
    _write(str(tmp_path), name, cls)
    for r in run_distributed(_case, world, str(tmp_path), name, timeout=300):
        assert r["equal"] == r["keys"], set(r["keys"]) - set(r["equal"])  # every key holds the checkpoint's values, the buffer too
        assert r["renewed"] is renewed, r  # the record is used only where it says it all
        assert r["own"], r
