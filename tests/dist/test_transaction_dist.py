"""The load transaction (sdadapt._transaction.transaction) on real gloo processes: faults injected on ONE
rank, in the optimizer part and in the model part of ``load_state`` and in ``load`` into a
model that holds values (torchtitan's flow: meta init -> FSDP2 -> ``to_empty`` ->
``init_weights()`` -> load). Every rank must raise; the model and optimizer must be exactly as
the policy says:

- a failure in the optimizer part (read before the model) leaves the model bit for bit as it
  was and not marked; an optimizer that held no state gets none back; one that held state is
  marked (its ``step`` raises) unless ``atomic=True``, which keeps it bit for bit;
- a failure after in-place writing of the model began: ``LoadError`` "partly overwritten" on
  every rank, with this rank's key count, and the forward raises ``ModelError`` until a
  successful load, which clears the mark and gives the checkpoint's values bit-exactly;
- ``atomic=True``: the model keeps its values bit for bit and is not marked;
- a failure found before writing (a file changed after planning): unchanged, not marked;
- an optimizer that has taken no step, with gradients present, gets every moment restored;
- a failure while committing (setting the optimizer state, restoring an extra, the staged
  copy-in) on rank 1 only: ``LoadError`` naming the step on every rank, and the model and
  optimizer marked on every rank as soon as the commit had changed them on any rank (a
  successful load clears the marks, bit-exactly); a fresh optimizer gets no state back.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support.dist_helper import run_distributed
from support.models import TinyTransformer, parallelize
from support.training import VOCAB, Counter, _tokens, forward_error, step_error, train_steps
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import sdadapt
from sdadapt._engine import syscalls
from sdadapt._state import state as state_mod
from sdadapt._transaction import transaction as txn_mod
from sdadapt._transaction.transaction import Transaction, is_marked
from sdadapt.sources._namespaced import NamespacedSource

WORLD = 2


class InitModel(TinyTransformer):
    """torchtitan's convention: ``init_weights()`` gives every parameter a value."""

    def init_weights(self) -> None:
        gen = torch.Generator().manual_seed(99)
        with torch.no_grad():
            for p in self.parameters():
                local = p._local_tensor if isinstance(p, DTensor) else p
                local.copy_(torch.randn(local.shape, generator=gen))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer | None = None) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": _local(v).detach().clone() for k, v in model.state_dict().items()}
    if opt is not None:
        params = [p for g in opt.param_groups for p in g["params"]]
        for i, p in enumerate(params):
            for name, v in opt.state.get(p, {}).items():
                out[f"optim.{i}.{name}"] = _local(v).detach().clone() if isinstance(v, torch.Tensor) else torch.tensor(v)
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _fsdp_model(seed: int, meta: bool = False) -> nn.Module:
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("fsdp",))
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            model = InitModel(vocab=VOCAB)
    else:
        model = InitModel(vocab=VOCAB)
    return parallelize(model, mesh)


def _attempt(fn: Any) -> dict[str, Any]:
    try:
        fn()
    except sdadapt.SdadaptError as e:
        return {"error": type(e).__name__, "message": str(e)}
    return {"error": None, "message": ""}


@contextlib.contextmanager
def _faulty_namespace(rank: int, part: str) -> Iterator[None]:
    """While open, reading the entries of ``part`` ("exp_avg": the optimizer's; "model": the
    model's) raises on rank 1, whichever way the engine reads them: the byte locations it
    reads with ``preadv`` (``NamespacedSource.locate_region``) or ``NamespacedSource.read``."""
    ns = NamespacedSource
    real = {name: getattr(ns, name) for name in ("read", "locate_region")}

    def faulty(name: str) -> Any:
        def method(self: Any, key: str, box: Any) -> Any:
            if rank == 1 and (part in self.fmt if part != "model" else self.fmt.startswith("model.")):
                raise RuntimeError(f"injected read failure in the {part} part")
            return real[name](self, key, box)

        return method

    for name in real:
        setattr(ns, name, faulty(name))
    try:
        yield
    finally:
        for name, method in real.items():
            setattr(ns, name, method)


# --------------------------------------------------------------------------------------------
# the worker: every case in one launched group
# --------------------------------------------------------------------------------------------
def worker(folder: str) -> dict[str, Any]:
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    ck = os.path.join(folder, "state")
    model, opt = _fsdp_model(0), None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    train_steps(model, opt, 2)
    sdadapt.save_state(model, ck, opt)
    saved = _snapshot(model, opt)
    st = os.path.join(folder, "model.safetensors")
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    if rank == 0:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in full.items()}, st)
    dist.barrier()

    # 1. fault in the optimizer part; optimizer fresh (no step): model unchanged, no state left
    for stage in (False, True):
        m = _fsdp_model(1)
        o = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
        before = _snapshot(m)
        with _faulty_namespace(rank, "exp_avg"):
            got = _attempt(lambda m=m, o=o, stage=stage: sdadapt.load_state(m, ck, o, atomic=stage))
        got |= {
            "model_unchanged": _same(_snapshot(m), before),
            "model_marked": is_marked(m),
            "optim_empty": len(o.state) == 0,
            "optim_marked": is_marked(o),
        }
        out[f"optim_fault_fresh/{'staged' if stage else 'in_place'}"] = got

    # 2. fault in the optimizer part; optimizer with state: in place marks it, staged keeps it
    for stage in (False, True):
        m = _fsdp_model(1)
        o = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
        train_steps(m, o, 1)
        before = _snapshot(m, o)
        with _faulty_namespace(rank, "exp_avg"):
            got = _attempt(lambda m=m, o=o, stage=stage: sdadapt.load_state(m, ck, o, atomic=stage))
        after = _snapshot(m, o)
        got |= {
            "model_unchanged": all(torch.equal(after[k], v) for k, v in before.items() if k.startswith("model.")),
            "optim_unchanged": _same(after, before),
            "model_marked": is_marked(m),
            "optim_marked": is_marked(o),
        }
        try:
            o.step()
            got["step_error"] = None
        except sdadapt.errors.ModelError as e:
            got["step_error"] = str(e)
        out[f"optim_fault_trained/{'staged' if stage else 'in_place'}"] = got
        if not stage:  # a successful restore clears the marks and gives the saved state exactly
            sdadapt.load_state(m, ck, o)
            out["optim_fault_trained/then_ok"] = {
                "exact": _same(_snapshot(m, o), saved),
                "marked": is_marked(m) or is_marked(o),
            }

    # 3. fault in the model part of load_state (after the optimizer was read)
    m = _fsdp_model(1)
    o = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    with _faulty_namespace(rank, "model"):
        got = _attempt(lambda: sdadapt.load_state(m, ck, o))
    got |= {"forward_error": forward_error(m), "optim_empty": len(o.state) == 0}
    sdadapt.load_state(m, ck, o)
    got |= {"then_exact": _same(_snapshot(m, o), saved), "then_forward_error": forward_error(m)}
    out["model_fault_state"] = got

    # 4. a fresh optimizer with gradients present (a backward, no step): every moment restored
    m = _fsdp_model(1)
    o = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    m(_tokens()).sum().backward()
    grads = {n: _local(p.grad).clone() for n, p in m.named_parameters()}
    rep = sdadapt.load_state(m, ck, o)
    out["fresh_with_grads"] = {
        "exact": _same(_snapshot(m, o), saved),
        "names": rep.optimizer_state_names,
        "optimizer_keys": rep.optimizer_keys,
        "grads_kept": all(torch.equal(_local(p.grad), grads[n]) for n, p in m.named_parameters()),
    }

    # 5. load into a materialised model (to_empty + init_weights), I/O error on rank 1
    real_pread = syscalls.preadv_into

    def eio(*a: Any, **k: Any) -> int:
        raise OSError(5, "Input/output error (injected)")

    for stage in (False, True):
        m = _fsdp_model(2, meta=True)
        m.to_empty(device="cpu")
        m.init_weights()
        before = _snapshot(m)
        syscalls.preadv_into = eio if rank == 1 else real_pread
        try:
            got = _attempt(lambda m=m, stage=stage: sdadapt.load(m, st, atomic=stage))
        finally:
            syscalls.preadv_into = real_pread
        got |= {"unchanged": _same(_snapshot(m), before), "forward_error": forward_error(m), "marked": is_marked(m)}
        if not stage:
            # a failed plan does not clear the mark; a successful load does, bit-exactly
            got["plan_error"] = _attempt(lambda m=m: sdadapt.load(m, st, allow_missing=None, subtree="nope"))["error"]
            got["still_marked"] = is_marked(m)
            sdadapt.load(m, st)
            got["then_exact"] = all(
                torch.equal(v.full_tensor() if isinstance(v, DTensor) else v, full[k]) for k, v in m.state_dict().items()
            )
            got["then_forward_error"] = forward_error(m)
        out[f"load_fault/{'staged' if stage else 'in_place'}"] = got

    # 6. a file changed after planning, found before writing: unchanged, not marked
    m = _fsdp_model(2, meta=True)
    m.to_empty(device="cpu")
    m.init_weights()
    before = _snapshot(m)
    real_check = Transaction.check_files

    def touch_then_check(self: Transaction) -> None:
        if rank == 1:
            os.utime(st, ns=(os.stat(st).st_atime_ns, os.stat(st).st_mtime_ns + 1_000_000))
        real_check(self)

    Transaction.check_files = touch_then_check  # type: ignore[method-assign]
    try:
        got = _attempt(lambda: sdadapt.load(m, st))
    finally:
        Transaction.check_files = real_check  # type: ignore[method-assign]
    got |= {"unchanged": _same(_snapshot(m), before), "marked": is_marked(m)}
    out["changed_before_write"] = got

    # 7. the old argument order and the renamed keywords, on every rank: a UsageError naming the
    # new call before anything is read or written; the group then goes on (no rank is left in a
    # collective), and a correct load_state gives the saved state exactly
    m = _fsdp_model(3)
    o = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    before = _snapshot(m)
    fresh = os.path.join(folder, "never_written")
    old = {
        "load_state": lambda: sdadapt.load_state(ck, m, o),
        "save_state": lambda: sdadapt.save_state(fresh, m, o),
        "load_stage": lambda: sdadapt.load(m, st, stage=True),
        "load_verify": lambda: sdadapt.load(m, st, verify=True),
        "load_state_stage": lambda: sdadapt.load_state(m, ck, o, stage=True),
    }
    for name, call in old.items():
        out[f"old/{name}"] = _attempt(call)
    dist.barrier()  # every rank got here: none is waiting in a collective of the refused calls
    got = {"unchanged": _same(_snapshot(m), before), "optim_empty": len(o.state) == 0, "not_written": not os.path.exists(fresh)}
    sdadapt.load_state(m, ck, o)
    got["then_exact"] = _same(_snapshot(m, o), saved)
    out["old/after"] = got
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(worker, WORLD, str(tmp_path_factory.mktemp("txn")), timeout=240)


def test_optimizer_fault_leaves_model_unchanged_and_fresh_optimizer_empty(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        for mode in ("in_place", "staged"):
            got = r[f"optim_fault_fresh/{mode}"]
            assert got["error"] == "LoadError", (rank, mode, got)
            assert "rank(s) 1" in got["message"] and "exp_avg" in got["message"], got["message"]
            assert got["model_unchanged"] and not got["model_marked"], (rank, mode, got)
            assert got["optim_empty"] and not got["optim_marked"], (rank, mode, got)


def test_optimizer_fault_with_state_marks_in_place_and_staging_keeps_it(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        got = r["optim_fault_trained/in_place"]
        assert got["error"] == "LoadError" and "partly overwritten" in got["message"], (rank, got)
        assert "optimizer state tensor(s)" in got["message"] and "0 model key" not in got["message"], got["message"]
        assert got["model_unchanged"] and not got["model_marked"], (rank, got)
        assert got["optim_marked"] and "partly overwritten" in (got["step_error"] or ""), (rank, got)
        assert r["optim_fault_trained/then_ok"] == {"exact": True, "marked": False}, rank
        got = r["optim_fault_trained/staged"]
        assert got["error"] == "LoadError" and "Nothing was kept" in got["message"], (rank, got)
        assert got["optim_unchanged"] and not got["optim_marked"] and got["step_error"] is None, (rank, got)


def test_model_fault_in_load_state_marks_model_until_a_load_succeeds(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        got = r["model_fault_state"]
        assert got["error"] == "LoadError" and "rank(s) 1" in got["message"], (rank, got)
        assert "partly overwritten" in got["message"] and "model key(s)" in got["message"], got["message"]
        assert got["forward_error"] is not None and "atomic=True" in got["forward_error"], (rank, got)
        assert got["optim_empty"], (rank, got)  # it held no state before: none is left
        assert got["then_exact"] and got["then_forward_error"] is None, (rank, got)


def test_old_argument_order_and_renamed_keywords_fail_on_every_rank(results: list[dict[str, Any]]) -> None:
    want = {
        "load_state": "sdadapt.load_state: the arguments are swapped",
        "save_state": "sdadapt.save_state: the arguments are swapped",
        "load_stage": "sdadapt.load: the keyword stage= is now atomic=",
        "load_verify": "sdadapt.load: the keyword verify= is now checksums=",
        "load_state_stage": "sdadapt.load_state: the keyword stage= is now atomic=",
    }
    new = {"load_state": "call sdadapt.load_state(model, src,", "save_state": "call sdadapt.save_state(model, dst,"}
    for rank, r in enumerate(results):
        for name, start in want.items():
            got = r[f"old/{name}"]
            assert got["error"] == "UsageError" and got["message"].startswith(start), (rank, name, got)
            assert new.get(name, "call sdadapt.") in got["message"], (rank, name, got)
        assert r["old/after"] == {"unchanged": True, "optim_empty": True, "not_written": True, "then_exact": True}, rank
    assert results[0]["old/load_state"] == results[1]["old/load_state"]  # the same error on every rank


def test_fresh_optimizer_with_grads_restores_every_moment(results: list[dict[str, Any]]) -> None:
    for r in results:
        got = r["fresh_with_grads"]
        assert got["exact"] and got["grads_kept"], got
        assert got["names"] == ["exp_avg", "exp_avg_sq", "step"] and got["optimizer_keys"] > 0, got


def test_load_into_materialised_model_in_place_and_staged(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        got = r["load_fault/in_place"]
        assert got["error"] == "LoadError" and "rank(s) 1" in got["message"], (rank, got)
        assert "partly overwritten" in got["message"] and "model key(s)" in got["message"], got["message"]
        assert got["marked"] and "partly overwritten" in (got["forward_error"] or ""), (rank, got)
        assert got["plan_error"] is not None and got["still_marked"], (rank, got)
        assert got["then_exact"] and got["then_forward_error"] is None, (rank, got)
        got = r["load_fault/staged"]
        assert got["error"] == "LoadError" and "Nothing was kept" in got["message"], (rank, got)
        assert got["unchanged"] and not got["marked"] and got["forward_error"] is None, (rank, got)


def test_file_changed_before_writing_leaves_model_untouched(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        got = r["changed_before_write"]
        # rank 0 checks before or after rank 1 touched the file: its own error or rank 1's
        assert got["error"] in ({"SourceError"} if rank == 1 else {"SourceError", "RemoteRankError"}), (rank, got)
        assert "changed after planning" in got["message"], got["message"]
        assert got["unchanged"] and not got["marked"], (rank, got)


@contextlib.contextmanager
def _patched(module: Any, name: str, replacement: Any) -> Iterator[None]:
    real = getattr(module, name)
    setattr(module, name, replacement)
    try:
        yield
    finally:
        setattr(module, name, real)


def _trained_pair(seed: int, steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    m = _fsdp_model(seed)
    o = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    train_steps(m, o, steps)
    return m, o


def commit_worker(folder: str) -> dict[str, Any]:
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    ck = os.path.join(folder, "state")
    model, opt = _trained_pair(0, 2)
    sdadapt.save_state(model, ck, opt, {"counter": Counter(5)})
    saved = _snapshot(model, opt)

    def set_state_dict_failing(*a: Any, **k: Any) -> None:
        raise RuntimeError("injected: set_state_dict failed on rank 1")

    # 1. setting the optimizer state fails on rank 1 only (in place and staged)
    for stage in (False, True):
        m, o = _trained_pair(1, 1)
        with _patched(state_mod, "set_state_dict", set_state_dict_failing if rank == 1 else state_mod.set_state_dict):
            got = _attempt(lambda m=m, o=o, stage=stage: sdadapt.load_state(m, ck, o, {"counter": Counter()}, atomic=stage))
        got |= {"model_marked": is_marked(m), "optim_marked": is_marked(o)}
        got |= {"forward_error": forward_error(m), "step_error": step_error(o)}
        counter = Counter()
        sdadapt.load_state(m, ck, o, {"counter": counter})
        got |= {"then_exact": _same(_snapshot(m, o), saved), "then_marked": is_marked(m) or is_marked(o), "counter": counter.n}
        got["then_forward_error"] = forward_error(m)
        out[f"set_state/{'staged' if stage else 'in_place'}"] = got

    # 2. the staged copy-in fails on rank 1 in the optimizer's part: rank 0 has copied its model
    # shards in, rank 1 has not; the model is one model, so both ranks mark it
    m, o = _trained_pair(1, 1)
    before = _snapshot(m)
    real_copy_in = txn_mod.copy_staged_in

    def copy_in_failing(part: txn_mod.Part) -> None:
        if rank == 1 and not part.of_model:
            raise MemoryError("injected: no memory for the copy on rank 1")
        real_copy_in(part)

    with _patched(txn_mod, "copy_staged_in", copy_in_failing):
        got = _attempt(lambda: sdadapt.load_state(m, ck, o, atomic=True))
    got |= {"model_unchanged": _same(_snapshot(m), before), "model_marked": is_marked(m), "optim_marked": is_marked(o)}
    out["copy_in"] = got

    # 3. restoring an extra fails on rank 1 only, the optimizer fresh: it gets no state back
    m = _fsdp_model(1)
    o = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    groups = [dict(g) for g in o.param_groups]
    got = _attempt(lambda: sdadapt.load_state(m, ck, o, {"counter": Counter(fail=rank == 1)}, atomic=True))
    got |= {"model_marked": is_marked(m), "optim_marked": is_marked(o), "optim_empty": len(o.state) == 0}
    got |= {"groups_kept": o.param_groups == groups, "forward_error": forward_error(m)}
    out["extra"] = got
    return out


@pytest.fixture(scope="module")
def commit_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(commit_worker, WORLD, str(tmp_path_factory.mktemp("commit")), timeout=240)


def test_commit_failure_on_one_rank_is_a_load_error_everywhere_and_marks(commit_results: list[dict[str, Any]]) -> None:
    marked = txn_mod.COMMIT_FAILED
    for mode in ("in_place", "staged"):
        messages = set()
        for rank, r in enumerate(commit_results):
            got = r[f"set_state/{mode}"]
            assert got["error"] == "LoadError", (rank, mode, got)
            assert "failed on rank(s) 1:" in got["message"], got["message"]
            assert "rank 1: setting the optimizer state failed: RuntimeError: injected" in got["message"], got["message"]
            assert got["model_marked"] and got["optim_marked"], (rank, mode, got)
            assert got["forward_error"] == marked.format(what="model"), (rank, mode, got)
            assert got["step_error"] == marked.format(what="optimizer"), (rank, mode, got)
            assert got["then_exact"] and not got["then_marked"] and got["counter"] == 5, (rank, mode, got)
            assert got["then_forward_error"] is None, (rank, mode, got)
            messages.add(got["message"])
        assert len(messages) == 1, messages  # the same agreed error on every rank


def test_commit_copy_in_failure_on_one_rank_marks_the_model_on_every_rank(commit_results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(commit_results):
        got = r["copy_in"]
        assert got["error"] == "LoadError" and "rank 1: copying the staged shards in failed: MemoryError" in got["message"], got
        assert got["model_marked"] and got["optim_marked"], (rank, got)
        assert got["model_unchanged"] == (rank == 1), (rank, got)  # rank 0 had committed its shards


def test_commit_extra_failure_on_one_rank_gives_a_fresh_optimizer_no_state(commit_results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(commit_results):
        got = r["extra"]
        assert got["error"] == "LoadError" and "rank 1: restoring extra state 'counter' failed: ValueError" in got["message"], got
        assert got["model_marked"] and got["forward_error"] is not None, (rank, got)
        assert got["optim_empty"] and got["groups_kept"] and not got["optim_marked"], (rank, got)
