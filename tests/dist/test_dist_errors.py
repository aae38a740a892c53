"""Errors on every rank, never a hang, and the model untouched (issue 2, on real gloo processes).

One launched group of 3 ranks runs every case in turn (a failed load leaves the process group
usable, which the last case proves by loading successfully); the tests below check what each
rank saw. Cases:

- key mismatch (misspelt, extra and wrong-shape keys) and an undeclared narrowing dtype change:
  every rank raises PlanError (rank 0's with the whole report, the others' one line pointing at
  it); a meta model stays on meta, a materialised one keeps its exact values and storage
  (FSDP-sharded and plain);
- a source that exists on rank 1 only not (a missing path, a checkpoint with a key missing):
  rank 1 raises its own error, the others RemoteRankError naming rank 1;
- a model with a non-persistent buffer and no hook: every rank raises before anything changes;
  with ``init_buffers=`` the buffer is computed and the load succeeds; a model with
  ``init_weights()`` gets it called once, and the load overwrites what it put in parameters;
- the last load's plan reused on two ranks while the third plans afresh: one agreement, the load
  bit-exact; with other options on that rank, a ``DisagreementError`` on every rank.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support.checkpoints import write_safetensors, write_torch_save
from support.dist_helper import run_distributed
from support.models import TinyTransformer, parallelize
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import sdadapt

WORLD = 3


# --------------------------------------------------------------------------------------
# models with a non-persistent buffer (a rotary inv_freq), with and without init_weights()
# --------------------------------------------------------------------------------------
def inv_freq(dim: int) -> torch.Tensor:
    return 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


class Rotary(nn.Module):
    def __init__(self, dim: int = 8, out: int = 7):
        super().__init__()
        self.dim = dim
        self.proj = nn.Linear(dim, out)
        self.register_buffer("inv_freq", inv_freq(dim), persistent=False)


class RotaryWithInit(Rotary):
    """torchtitan's convention: ``init_weights()`` computes buffers (and initialises params)."""

    def __init__(self, dim: int = 8, out: int = 7):
        super().__init__(dim, out)
        self.init_calls = 0

    def init_weights(self) -> None:
        self.init_calls += 1
        self.inv_freq.copy_(inv_freq(self.dim))
        self.proj.weight.fill_(7.0)  # must be overwritten by the load
        self.proj.bias.fill_(7.0)


def rotary_state_dict() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return {"proj.weight": torch.randn(7, 8, generator=gen), "proj.bias": torch.randn(7, generator=gen)}


def tiny_state_dict() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(11)
    return {k: torch.randn(v.shape, generator=gen) for k, v in TinyTransformer().state_dict().items()}


# --------------------------------------------------------------------------------------
# checkpoints
# --------------------------------------------------------------------------------------
def write_sources(folder: str) -> None:
    sd = tiny_state_dict()
    write_torch_save(os.path.join(folder, "good.pt"), sd)
    bad = dict(sd)
    bad["norm.wieght"] = bad.pop("norm.weight")  # misspelt
    bad["extra.weight"] = torch.zeros(3)  # unexpected
    bad["head.bias"] = torch.zeros(36)  # wrong shape (vocab is 37)
    write_torch_save(os.path.join(folder, "mismatch.pt"), bad)
    write_safetensors(os.path.join(folder, "f64.safetensors"), {k: v.to(torch.float64) for k, v in sd.items()})
    write_torch_save(os.path.join(folder, "missing_key.pt"), {k: v for k, v in sd.items() if k != "layers.1.ffn.2.bias"})
    write_torch_save(os.path.join(folder, "rotary.pt"), rotary_state_dict())


# --------------------------------------------------------------------------------------
# worker side
# --------------------------------------------------------------------------------------
def _outcome(fn: Any) -> dict[str, Any]:
    """Run one load; record the sdadapt error it raised (anything else propagates)."""
    try:
        fn()
    except sdadapt.SdadaptError as e:
        return {"error": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__], "message": str(e)}
    return {"error": None}


def _all_meta(model: nn.Module) -> bool:
    return all(
        (t.to_local() if isinstance(t, DTensor) else t).is_meta for t in (*model.parameters(), *model.buffers())
    )


def _snapshot(model: nn.Module) -> dict[str, tuple[torch.Tensor, int]]:
    out = {}
    for k, v in model.state_dict().items():
        local = v.to_local() if isinstance(v, DTensor) else v
        out[k] = (local.detach().clone(), local.data_ptr())
    return out


def _unchanged(model: nn.Module, snap: dict[str, tuple[torch.Tensor, int]]) -> bool:
    now = _snapshot(model)
    return set(now) == set(snap) and all(
        torch.equal(now[k][0], snap[k][0]) and now[k][1] == snap[k][1] for k in snap
    )


def _fsdp_meta_tiny(mesh: Any) -> nn.Module:
    with torch.device("meta"):
        model = TinyTransformer()
    return parallelize(model, mesh)


def _error_cases(folder: str) -> dict[str, dict[str, Any]]:
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("fsdp",))
    path = lambda name: os.path.join(folder, name)  # noqa: E731
    out: dict[str, dict[str, Any]] = {}

    # 1. key mismatch into a meta FSDP model: PlanError everywhere, still on meta
    model = _fsdp_meta_tiny(mesh)
    out["mismatch_meta"] = _outcome(lambda: sdadapt.load(model, path("mismatch.pt")))
    out["mismatch_meta"]["untouched"] = _all_meta(model)

    # 2. the same into a materialised FSDP model and into a plain one: values and storage kept
    torch.manual_seed(3)
    model = parallelize(TinyTransformer(), mesh)
    snap = _snapshot(model)
    out["mismatch_fsdp_real"] = _outcome(lambda: sdadapt.load(model, path("mismatch.pt")))
    out["mismatch_fsdp_real"]["untouched"] = _unchanged(model, snap)
    plain = TinyTransformer()
    snap = _snapshot(plain)
    out["mismatch_plain_real"] = _outcome(lambda: sdadapt.load(plain, path("mismatch.pt")))
    out["mismatch_plain_real"]["untouched"] = _unchanged(plain, snap)

    # 3. a narrowing dtype change no rule declares (float64 file into a float32 model)
    model = _fsdp_meta_tiny(mesh)
    out["undeclared_cast"] = _outcome(lambda: sdadapt.load(model, path("f64.safetensors")))
    out["undeclared_cast"]["untouched"] = _all_meta(model)

    # 4. the source is missing on rank 1 only
    model = _fsdp_meta_tiny(mesh)
    src = path("good.pt") if rank != 1 else path("not-there.pt")
    out["missing_on_rank1"] = _outcome(lambda: sdadapt.load(model, src))
    out["missing_on_rank1"]["untouched"] = _all_meta(model)

    # 5. rank 1's checkpoint lacks a key the others have: its PlanError becomes everyone's stop
    torch.manual_seed(4)
    model = parallelize(TinyTransformer(), mesh)
    snap = _snapshot(model)
    src = path("good.pt") if rank != 1 else path("missing_key.pt")
    out["plan_differs_on_rank1"] = _outcome(lambda: sdadapt.load(model, src))
    out["plan_differs_on_rank1"]["untouched"] = _unchanged(model, snap)

    # 6. a non-persistent buffer on meta and no hook: raise before anything changes
    with torch.device("meta"):
        rot = Rotary()
    fully_shard(rot, mesh=mesh)
    out["buffer_no_hook"] = _outcome(lambda: sdadapt.load(rot, path("rotary.pt")))
    out["buffer_no_hook"]["untouched"] = _all_meta(rot)

    # 7. ... with init_buffers=: the buffer is computed, the load succeeds
    calls = []

    def init_buffers(m: nn.Module) -> None:
        calls.append(m is rot)  # called once, with the model itself
        m.inv_freq.copy_(inv_freq(m.dim))

    out["buffer_init_buffers"] = _outcome(lambda: sdadapt.load(rot, path("rotary.pt"), init_buffers=init_buffers))
    out["buffer_init_buffers"].update(_rotary_facts(rot), hook_calls=calls)

    # 8. ... a model with init_weights(): called once, its parameter values overwritten
    with torch.device("meta"):
        rot2 = RotaryWithInit()
    fully_shard(rot2, mesh=mesh)
    out["buffer_init_weights"] = _outcome(lambda: sdadapt.load(rot2, path("rotary.pt")))
    out["buffer_init_weights"].update(_rotary_facts(rot2), init_calls=rot2.init_calls)

    # 9. after all that, the group is healthy: a good load succeeds bit-exactly
    model = _fsdp_meta_tiny(mesh)
    out["good_after_errors"] = _outcome(lambda: sdadapt.load(model, path("good.pt")))
    want = tiny_state_dict()
    out["good_after_errors"]["exact"] = all(
        torch.equal(v.full_tensor() if isinstance(v, DTensor) else v, want[k]) for k, v in model.state_dict().items()
    )

    # 10. the same load again: ranks 0 and 2 reuse the kept plan, rank 1 (its plan forgotten) plans
    from sdadapt._transaction.steps import LAST_PLAN

    if rank == 1:
        LAST_PLAN.clear()
    hits = LAST_PLAN.hits
    model = _fsdp_meta_tiny(mesh)
    out["reused_on_two"] = _outcome(lambda: sdadapt.load(model, path("good.pt")))
    out["reused_on_two"]["exact"] = all(
        torch.equal(v.full_tensor() if isinstance(v, DTensor) else v, want[k]) for k, v in model.state_dict().items()
    )
    out["reused_on_two"]["reused"] = LAST_PLAN.hits - hits

    # 11. ranks 0 and 2 reuse it again, rank 1 asks for other options: the agreement still stops every rank
    hits = LAST_PLAN.hits
    model = _fsdp_meta_tiny(mesh)
    more = {"allow_missing": ["nothing.*"]} if rank == 1 else {}
    out["reused_disagrees"] = _outcome(lambda: sdadapt.load(model, path("good.pt"), **more))
    out["reused_disagrees"].update(reused=LAST_PLAN.hits - hits, untouched=_all_meta(model))
    dist.barrier()
    return out


def _rotary_facts(model: nn.Module) -> dict[str, Any]:
    want = rotary_state_dict()
    return {
        "buffer_ok": torch.equal(model.inv_freq, inv_freq(model.dim)),
        "params_exact": all(torch.equal(v.full_tensor() if isinstance(v, DTensor) else v, want[k]) for k, v in model.state_dict().items()),
        "on_meta": _all_meta(model),
    }


# --------------------------------------------------------------------------------------
# test side
# --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, Any]]]:
    folder = str(tmp_path_factory.mktemp("dist_errors"))
    write_sources(folder)
    return run_distributed(_error_cases, WORLD, folder, timeout=120)  # a hang fails in 2 minutes


@pytest.mark.parametrize("case", ["mismatch_meta", "mismatch_fsdp_real", "mismatch_plain_real"])
def test_key_mismatch_raises_plan_error_on_every_rank(results: list[dict], case: str) -> None:
    for rank, r in enumerate(results):
        o = r[case]
        assert o["error"] == "PlanError", (rank, o)
        if rank == 0:  # the whole report, once
            for name in ("norm.weight", "norm.wieght", "extra.weight", "head.bias"):
                assert name in o["message"], (rank, name, o["message"])
        else:  # one line pointing at rank 0's
            assert "\n" not in o["message"] and "rank 0's error has the whole message" in o["message"], o["message"]
        assert o["untouched"], f"rank {rank}: the model changed"


def test_undeclared_dtype_change_raises_everywhere(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        o = r["undeclared_cast"]
        assert o["error"] == "PlanError", (rank, o)
        if rank == 0:
            assert "float64" in o["message"] and "float32" in o["message"], o["message"]
        assert o["untouched"]


def test_source_missing_on_one_rank(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        o = r["missing_on_rank1"]
        assert o["untouched"], f"rank {rank}: the model changed"
        if rank == 1:
            assert o["error"] == "SourceError", o
            assert "not-there.pt" in o["message"]
        else:
            assert o["error"] == "RemoteRankError", (rank, o)
            assert "rank 1" in o["message"] and "not-there.pt" in o["message"], o["message"]
        assert "SdadaptError" in o["mro"]


def test_plan_differs_on_one_rank(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        o = r["plan_differs_on_rank1"]
        assert o["error"] == ("PlanError" if rank == 1 else "RemoteRankError"), (rank, o)
        if rank == 0:  # quotes rank 1's whole error
            assert "layers.1.ffn.2.bias" in o["message"] and "rank 1" in o["message"], o["message"]
        else:  # rank 1 itself and the others: one line pointing at rank 0's
            assert "\n" not in o["message"] and "rank 0's error" in o["message"], o["message"]
        if rank == 2:
            assert o["message"].startswith("rank 1 failed (PlanError: checkpoint does not match the model"), o["message"]
        assert o["untouched"], f"rank {rank}: the model changed"


def test_non_persistent_buffer_without_hook_raises_before_changes(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        o = r["buffer_no_hook"]
        assert o["error"] is not None and "SdadaptError" in o["mro"], (rank, o)
        assert "inv_freq" in o["message"] and "init_buffers" in o["message"], o["message"]
        assert o["untouched"], f"rank {rank}: the model changed"


def test_init_buffers_hook_computes_buffer(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        o = r["buffer_init_buffers"]
        assert o["error"] is None, (rank, o)
        assert o["hook_calls"] == [True]
        assert o["buffer_ok"] and o["params_exact"] and not o["on_meta"], (rank, o)


def test_init_weights_is_called(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        o = r["buffer_init_weights"]
        assert o["error"] is None, (rank, o)
        assert o["init_calls"] == 1
        assert o["buffer_ok"] and o["params_exact"] and not o["on_meta"], (rank, o)


def test_group_still_healthy_after_errors(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        assert r["good_after_errors"] == {"error": None, "exact": True}, rank


def test_a_reused_plan_is_agreed_like_a_fresh_one(results: list[dict]) -> None:
    """Ranks that reuse the kept plan and a rank that plans afresh meet in one agreement: the
    load succeeds bit-exactly where they agree, and stops every rank where one asks otherwise."""
    for rank, r in enumerate(results):
        o = r["reused_on_two"]
        assert o["error"] is None and o["exact"], (rank, o)
        assert o["reused"] == (0 if rank == 1 else 1), (rank, o)
        o = r["reused_disagrees"]
        assert o["error"] == "DisagreementError", (rank, o)
        assert o["untouched"], f"rank {rank}: the model changed"
        assert o["reused"] == (0 if rank == 1 else 1), (rank, o)
