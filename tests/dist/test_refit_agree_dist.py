"""Issue 65's refit cases on real gloo processes: every failure a ``RefitError`` on every rank,
within about twice ``timeout``, nothing written.

- adapters that disagree (the last rank fuses q, k, v in another order), on 2 and 4 ranks:
  ``refit_plan`` raises ``RefitError`` on every rank naming that rank, the engine untouched;
- a planning failure on one rank only (a split rule the others do not have): every rank raises
  ``RefitError``, the others quoting the first cause;
- a delta run whose trainer rank is gone, or stalls, when the run starts (the version agreement):
  the engine rank raises ``RefitError`` with ``updated`` / ``not_updated`` within the bound;
- a rank gone, or alive but stalled, before the ranks plan: ``RefitError`` on the others, within
  about twice ``timeout`` for the stalled one;
- planning takes four collectives whatever the world size, with an engine in the group or ``send=``.
"""

from __future__ import annotations

import collections
import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support.dist_helper import WorkerError, group_seconds, outcome, run_distributed

import sdadapt
from sdadapt.errors import RefitError

QKV = {"q": (4, 2), "k": (2, 2), "v": (2, 2)}


def _trainer() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {f"l.0.{n}.weight": torch.randn(s, generator=gen) for n, s in QKV.items()} | {"o.weight": torch.randn(2, 2, generator=gen)}


def _adapter(order: str, extra: list[Any] | None = None) -> sdadapt.Adapter:
    sizes = [QKV[p][0] for p in order]
    fuse = sdadapt.fuse([f"l.{{i}}.{p}.weight" for p in order], "l.{i}.qkv.weight", sizes=sizes)
    return sdadapt.Adapter([fuse, *(extra or [])], name="qkv")


def _engine() -> dict[str, torch.Tensor]:
    return {"l.0.qkv.weight": torch.zeros(8, 2), "o.weight": torch.zeros(2, 2)}


@contextlib.contextmanager
def _counted() -> Iterator[collections.Counter[str]]:
    """The collectives of ``torch.distributed`` called inside the block, by name."""
    counts: collections.Counter[str] = collections.Counter()
    names = ["all_reduce", "all_gather_object", "all_gather", "broadcast", "broadcast_object_list", "barrier", "gather_object"]
    saved = {n: getattr(dist, n) for n in names}

    def counting(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return saved[name](*args, **kwargs)

        return call

    try:
        for n in names:
            setattr(dist, n, counting(n))
        yield counts
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)


def _cases() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    engine = _engine()
    out["disagree"] = outcome(lambda: sdadapt.refit_plan(_trainer(), engine, _adapter("kqv" if rank == world - 1 else "qkv")))
    out["disagree_untouched"] = all(bool((t == 0).all()) for t in engine.values())
    split = [sdadapt.split("o.weight", ["o.a.weight", "o.b.weight"])] if rank == 1 else []
    out["one_fails"] = outcome(lambda: sdadapt.refit_plan(_trainer(), engine, _adapter("qkv", split)))
    out["one_fails_untouched"] = all(bool((t == 0).all()) for t in engine.values())
    with _counted() as counts:
        refit = sdadapt.refit_plan(_trainer(), engine, _adapter("qkv"), timeout=60)
    out["collectives"] = sum(counts.values())
    with _counted() as counts:
        whole = {k: torch.empty(t.shape, device="meta") for k, t in engine.items()}
        sdadapt.refit_plan(_trainer(), whole, _adapter("qkv"), timeout=60, send=lambda bucket: None)
    out["collectives_send"] = sum(counts.values())
    out["after"] = outcome(refit.run)
    t = _trainer()
    out["right"] = torch.equal(engine["l.0.qkv.weight"], torch.cat([t["l.0.q.weight"], t["l.0.k.weight"], t["l.0.v.weight"]]))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_refit_ranks_disagree(world: int) -> None:
    results = run_distributed(_cases, world, timeout=240)
    for r in results:
        assert r["disagree"][0] == "RefitError" and r["disagree_untouched"], r["disagree"]
        assert r["disagree"][2] < 30
        assert r["one_fails"][0] == "RefitError" and r["one_fails_untouched"] and r["one_fails"][2] < 30, r["one_fails"]
        assert r["after"][0] == "ok" and r["right"], r["after"]
        # planning's collectives: arrival, what each rank holds, the agreement, the requests (docs/refit.md)
        assert (r["collectives"], r["collectives_send"]) == (4, 4)
    assert f"rank {world - 1}'s adapter (rule #0) fuses [l.{{i}}.k.weight, l.{{i}}.q.weight, l.{{i}}.v.weight]" in results[0]["disagree"][1]
    assert "do not line up" in results[1]["one_fails"][1] and "o.a.weight" in results[1]["one_fails"][1]
    for r in (0, *range(2, world)):
        assert "rank 1 failed" in results[r]["one_fails"][1] and "do not line up" in results[r]["one_fails"][1], results[r]["one_fails"]


def _stall_until(done: str) -> None:
    """Stay alive, sockets open, doing nothing, until the other rank has written ``done``."""
    while not os.path.exists(done):
        time.sleep(0.1)


def _delta_start(hang: bool, done: str) -> dict[str, Any]:
    rank = dist.get_rank()
    trainer = _trainer() if rank == 0 else None
    engine = _engine() if rank == 1 else None
    refit = sdadapt.refit_plan(trainer, engine, _adapter("qkv"), delta=True, timeout=3)
    refit.run()  # a first run that succeeds
    if rank == 0:
        if hang:
            _stall_until(done)  # alive, not in the run
        os._exit(0)
    assert engine is not None
    before = {k: v.clone() for k, v in engine.items()}
    took = group_seconds()
    try:
        refit.run()
    except RefitError as e:
        raise RuntimeError(
            f"OUTCOME RefitError after {took():.1f} s, updated={e.updated} not_updated={e.not_updated} "
            f"unchanged={all(torch.equal(before[k], engine[k]) for k in engine)}: {e}"
        ) from None
    finally:
        open(done, "w").close()
    raise RuntimeError("OUTCOME no error")


@pytest.mark.parametrize("hang", [False, True])
def test_refit_delta_rank_gone_or_stalled_at_start(hang: bool, tmp_path: Any) -> None:
    with pytest.raises(WorkerError) as info:
        run_distributed(_delta_start, 2, hang, str(tmp_path / "done"), timeout=120)
    by_rank = {f.rank: f for f in info.value.failures}
    msg = by_rank[1].message
    assert "OUTCOME RefitError" in msg, msg
    seconds = float(msg.split("after ")[1].split(" s")[0])
    assert seconds < 2 * 3 + 4, msg  # about twice the timeout
    assert "updated=[]" in msg and "not_updated=['l.0.qkv.weight', 'o.weight']" in msg and "unchanged=True" in msg, msg


def _inverse_refit(folder: str) -> dict[str, Any]:
    """[fuse, interleave (no tp=), cast] loads a TP trainer; a refit through adapter.inverse() gives
    every engine rank the checkpoint's q and k (cast back) whole."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = os.path.join(folder, "qk.pt")
    if rank == 0:
        gen = torch.Generator().manual_seed(5)
        torch.save({"q.weight": torch.randn(4, 2, generator=gen), "k.weight": torch.randn(4, 2, generator=gen)}, ckpt)
    dist.barrier()
    adapter = sdadapt.Adapter([sdadapt.fuse(["q.weight", "k.weight"], "qk.weight", sizes=[4, 4]),
                               sdadapt.interleave("qk.weight", sizes=[4, 4]),
                               sdadapt.cast("qk.weight", "bfloat16", from_dtype="float32")], name="qk")  # fmt: skip
    trainer = nn.ModuleDict({"qk": nn.Linear(2, 8, bias=False)}).to(torch.bfloat16)
    parallelize_module(trainer, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)), {"qk": ColwiseParallel()})
    sdadapt.load(trainer, ckpt, adapter)
    engine = {"q.weight": torch.zeros(4, 2), "k.weight": torch.zeros(4, 2)}
    sdadapt.refit_plan(trainer, engine, adapter.inverse())()
    return {"engine": engine, "ckpt": torch.load(ckpt)}


def test_refit_through_the_inverse_of_an_interleave_without_tp(tmp_path: Any) -> None:
    for r in run_distributed(_inverse_refit, 2, str(tmp_path), timeout=120):
        for k in ("q.weight", "k.weight"):
            assert torch.equal(r["engine"][k], r["ckpt"][k].bfloat16().float()), k


def _plan_gone() -> dict[str, Any]:
    rank = dist.get_rank()
    if rank == 0:
        os._exit(0)  # gone before the ranks plan
    time.sleep(1)
    sdadapt.refit_plan(None, _engine(), _adapter("qkv"))
    return {}


def test_refit_plan_rank_gone() -> None:
    """A rank gone while the ranks plan: a RefitError on the others, not the backend's error."""
    with pytest.raises(WorkerError) as info:
        run_distributed(_plan_gone, 2, timeout=120)
    by_rank = {f.rank: f for f in info.value.failures}
    assert by_rank[1].type_name == "RefitError" and "planning the refit failed" in by_rank[1].message, by_rank[1]


def _plan_stalled(done: str) -> dict[str, Any]:
    rank = dist.get_rank()
    if rank == 0:
        _stall_until(done)  # alive, not planning
        os._exit(0)
    took = group_seconds()
    try:
        sdadapt.refit_plan(None, _engine(), _adapter("qkv"), timeout=3)
    except RefitError as e:
        raise RuntimeError(f"OUTCOME RefitError after {took():.1f} s: {e}") from None
    finally:
        open(done, "w").close()
    raise RuntimeError("OUTCOME no error")


def test_refit_plan_rank_stalled(tmp_path: Any) -> None:
    """A rank alive but not planning: the others raise RefitError within about twice ``timeout``."""
    with pytest.raises(WorkerError) as info:
        run_distributed(_plan_stalled, 2, str(tmp_path / "done"), timeout=120)
    msg = {f.rank: f for f in info.value.failures}[1].message
    assert "OUTCOME RefitError" in msg and "planning the refit failed" in msg, msg
    assert float(msg.split("after ")[1].split(" s")[0]) < 2 * 3 + 4, msg
