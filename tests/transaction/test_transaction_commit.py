"""A failure while committing a load (one process): the staged copy-in, setting the optimizer
state, restoring an extra, each raising after every read and check passed. The load raises
``LoadError`` naming the step, and what the commit had begun to change is marked (the model's
forward and the optimizer's step raise ``ModelError``) until a load into them succeeds; an
optimizer that held no state gets none back (param groups as they were), a model that was
on the meta device goes back to meta, and what the commit had not reached is left alone."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from support.models import TinyTransformer
from support.training import VOCAB, Counter, forward_error, step_error, train_steps  # helpers shared with the 2-rank tests
from torch import nn

import sdadapt
from sdadapt._state import state as state_mod
from sdadapt._transaction import transaction as txn_mod
from sdadapt._transaction.transaction import is_marked


def _new(seed: int, trained: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyTransformer(vocab=VOCAB)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if trained:
        train_steps(model, opt, 1)
    return model, opt


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    if opt is not None:
        sd = opt.state_dict()
        for i, s in sd["state"].items():
            for name, v in s.items():
                out[f"optim.{i}.{name}"] = v.clone()
        out["groups"] = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
    return out


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    return all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    model, opt = _new(0, trained=False)
    train_steps(model, opt, 2)
    ck = str(tmp_path_factory.mktemp("commit") / "state")
    sdadapt.save_state(model, ck, opt, {"counter": Counter(5)})
    return ck, _snapshot(model, opt)


def _raise_on_set_state_dict(*_: Any, **__: Any) -> None:
    raise RuntimeError("injected: set_state_dict failed")


@pytest.mark.parametrize("stage", [False, True])
def test_optimizer_state_failure_marks_model_and_optimizer(saved: Any, monkeypatch: pytest.MonkeyPatch, stage: bool) -> None:
    """The tensors are in (read in place, or copied in from staging) when setting the optimizer
    state fails: both are marked; a later successful load clears the marks, bit-exactly."""
    ck, want = saved
    model, opt = _new(1, trained=True)
    monkeypatch.setattr(state_mod, "set_state_dict", _raise_on_set_state_dict)
    with pytest.raises(sdadapt.errors.LoadError) as e:
        sdadapt.load_state(model, ck, opt, {"counter": Counter()}, atomic=stage)
    msg = str(e.value)
    assert "setting the optimizer state failed: RuntimeError: injected: set_state_dict failed" in msg, msg
    assert "the model's forward raises ModelError" in msg and "the optimizer's step raises ModelError" in msg, msg
    assert is_marked(model) and is_marked(opt)
    assert forward_error(model) == txn_mod.COMMIT_FAILED.format(what="model")
    assert step_error(opt) == txn_mod.COMMIT_FAILED.format(what="optimizer")
    monkeypatch.undo()
    counter = Counter()
    sdadapt.load_state(model, ck, opt, {"counter": counter})
    assert not is_marked(model) and not is_marked(opt) and counter.n == 5
    assert _same(_snapshot(model, opt), want)
    assert forward_error(model) is None


def test_extra_failure_with_fresh_optimizer_gives_it_no_state(saved: Any) -> None:
    """Restoring an extra fails after the optimizer state was set: an optimizer that held no
    state gets none back and keeps its own param groups (not marked); the model is marked."""
    ck, _ = saved
    model, opt = _new(1, trained=False)
    groups = [dict(g) for g in opt.param_groups]
    with pytest.raises(sdadapt.errors.LoadError) as e:
        sdadapt.load_state(model, ck, opt, {"counter": Counter(fail=True)}, atomic=True)
    msg = str(e.value)
    assert "restoring extra state 'counter' failed: ValueError: injected" in msg, msg
    assert "setting the optimizer state" in msg  # the steps done before the failure
    assert is_marked(model) and forward_error(model) is not None
    assert len(opt.state) == 0 and not is_marked(opt) and step_error(opt) is None
    assert opt.param_groups == groups and opt.param_groups[0]["lr"] == 1e-2


def test_extra_failure_puts_a_meta_model_back_on_meta(saved: Any) -> None:
    ck, _ = saved
    with torch.device("meta"):
        model = TinyTransformer(vocab=VOCAB)
    with pytest.raises(sdadapt.errors.LoadError, match="restoring extra state 'counter' failed") as e:
        sdadapt.load_state(model, ck, None, {"counter": Counter(fail=True)}, device="cpu")
    assert "back on the meta device" in str(e.value)
    assert all(t.is_meta for t in model.state_dict().values()) and not is_marked(model)


def _failing_copy_in(of_model: bool, keep: int = 0) -> Any:
    """A ``copy_staged_in`` that raises for the parts of the model (``of_model``) or of the
    optimizer, after copying ``keep`` of their shards in."""
    real = txn_mod.copy_staged_in

    def copy_in(part: txn_mod.Part) -> None:
        if part.of_model != of_model:
            return real(part)
        assert part.staged is not None
        for k in list(part.staged)[:keep]:
            txn_mod.local(part.targets[k]).copy_(txn_mod.local(part.staged[k]))
        raise MemoryError("injected: no memory for the copy")

    return copy_in


def test_copy_in_failure_in_the_optimizer_part_leaves_the_model_alone(saved: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Staged: the optimizer's parts are copied in before the model's, so a failure there has
    not touched the model (bit for bit, not marked); the optimizer, which held state, is marked."""
    ck, _ = saved
    model, opt = _new(1, trained=True)
    before = _snapshot(model)
    monkeypatch.setattr(txn_mod, "copy_staged_in", _failing_copy_in(of_model=False))
    with pytest.raises(sdadapt.errors.LoadError) as e:
        sdadapt.load_state(model, ck, opt, atomic=True)
    msg = str(e.value)
    assert "copying the staged shards in failed: MemoryError: injected" in msg and "The model was not changed" in msg, msg
    assert _same(_snapshot(model), before) and not is_marked(model) and forward_error(model) is None
    assert is_marked(opt) and step_error(opt) == txn_mod.COMMIT_FAILED.format(what="optimizer")


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, torch.Tensor]]:
    torch.manual_seed(7)
    sd = {k: v.contiguous() for k, v in TinyTransformer(vocab=VOCAB).state_dict().items()}
    path = str(tmp_path_factory.mktemp("commit") / "model.safetensors")
    save_file(sd, path)
    return path, sd


def test_load_copy_in_failure_marks_the_model_until_a_load_succeeds(weights: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    path, sd = weights
    model, _ = _new(1, trained=False)
    monkeypatch.setattr(txn_mod, "copy_staged_in", _failing_copy_in(of_model=True, keep=3))
    with pytest.raises(sdadapt.errors.LoadError, match="committing the load of .* failed on rank\\(s\\) 0") as e:
        sdadapt.load(model, path, atomic=True)
    assert "copying the staged shards in failed" in str(e.value) and "done before it: nothing" in str(e.value)
    assert is_marked(model) and forward_error(model) == txn_mod.COMMIT_FAILED.format(what="model")
    monkeypatch.undo()
    sdadapt.load(model, path, atomic=True)
    assert not is_marked(model) and forward_error(model) is None
    assert all(torch.equal(v, sd[k]) for k, v in model.state_dict().items())


def test_load_copy_back_failure_puts_a_meta_model_back_on_meta(weights: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = weights
    with torch.device("meta"):
        model = TinyTransformer(vocab=VOCAB)

    def fail(*_: Any) -> None:
        raise RuntimeError("injected: copy-back failed")

    monkeypatch.setattr(txn_mod, "copy_back_if_detached", fail)
    with pytest.raises(sdadapt.errors.LoadError, match="copying detached tensors back into the model failed: RuntimeError") as e:
        sdadapt.load(model, path, device="cpu")
    assert "back on the meta device" in str(e.value)
    assert all(t.is_meta for t in model.state_dict().values()) and not is_marked(model)
