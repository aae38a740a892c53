"""The state dicts a background save takes, remembered between saves (``_state/taken.py``).

Each take, the first (named without ``get_state_dict``'s walk) and the remembered ones, is
compared with a fresh ``get_state_dict``: the same keys, each model value the same memory, the
optimizer's state the live dicts and its hyperparameters current. Anything that moves a tensor
(a new parameter, ``.data`` swapped) takes the state afresh; a fresh optimizer, a model whose
keys are renamed or an optimizer over another model's parameter go through ``get_state_dict``;
a model whose state dict holds more than tensors is never remembered. Last, two background saves
of one process read back bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from support.models import TinyTransformer
from support.training import train_steps
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import get_state_dict

import sdadapt
from sdadapt._state import taken
from sdadapt._state.taken import take_state


def _counted() -> tuple[list[int], object]:
    calls: list[int] = []

    def take(m: nn.Module, o: torch.optim.Optimizer | None):
        calls.append(1)
        return get_state_dict(m, o)

    return calls, take


def _same_as_fresh(model: nn.Module, opt: torch.optim.Optimizer, got: tuple) -> None:
    model_sd, optim_sd = got
    want_model, want_optim = get_state_dict(model, opt)
    assert list(model_sd) == list(want_model)
    for k, v in want_model.items():
        assert model_sd[k].data_ptr() == v.data_ptr() and torch.equal(model_sd[k], v), k
    assert list(optim_sd["state"]) == list(want_optim["state"])
    for k, v in want_optim["state"].items():
        assert optim_sd["state"][k].keys() == v.keys()
        assert all(torch.equal(optim_sd["state"][k][n], v[n]) for n in v), k
    assert optim_sd["param_groups"] == want_optim["param_groups"]


def test_a_remembered_take_is_get_state_dict():
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train_steps(model, opt, 1)
    calls, take = _counted()
    _same_as_fresh(model, opt, take_state(model, opt, take))  # the first: named without get_state_dict
    assert model in taken._TAKEN
    train_steps(model, opt, 1)
    opt.param_groups[0]["lr"] = 5e-3  # as a scheduler would
    _same_as_fresh(model, opt, take_state(model, opt, take))  # remembered
    model.head.weight = nn.Parameter(model.head.weight.detach().clone())  # a new tensor object
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train_steps(model, opt, 1)
    _same_as_fresh(model, opt, take_state(model, opt, take))
    model.norm.weight.data = model.norm.weight.detach().clone()  # same object, new memory
    _same_as_fresh(model, opt, take_state(model, opt, take))
    assert calls == []  # no take walked the names
    take_state(model, None, lambda m, o: (m.state_dict(), None))  # another optimizer (none): afresh
    assert taken._TAKEN[model].optimizer is None

    fresh = torch.optim.Adam(model.parameters(), lr=1e-2)  # no state yet: get_state_dict makes it
    _same_as_fresh(model, fresh, take_state(model, fresh, take))
    assert len(calls) == 1
    wrapped = nn.Sequential(checkpoint_wrapper(nn.Linear(3, 3)))  # its keys are renamed: taken in full
    wopt = torch.optim.Adam(wrapped.parameters(), lr=1e-2)
    wrapped(torch.ones(2, 3)).sum().backward()
    wopt.step()
    _same_as_fresh(wrapped, wopt, take_state(wrapped, wopt, take))
    assert len(calls) == 2
    stranger = torch.optim.Adam([nn.Parameter(torch.ones(2))] + list(model.parameters()))  # a parameter the model lacks
    stranger.state[stranger.param_groups[0]["params"][0]]["step"] = torch.tensor(1.0)
    try:
        take_state(model, stranger, take)
        raise AssertionError("an optimizer over a parameter the model lacks was taken")
    except KeyError:
        assert len(calls) == 3  # the full take raised get_state_dict's own error


class _WithExtra(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def get_extra_state(self):
        return {"calls": 1}

    def set_extra_state(self, state):
        pass


def test_a_state_dict_beyond_tensors_is_never_remembered():
    model = _WithExtra()
    calls, take = _counted()
    for _ in range(2):
        take_state(model, None, lambda m, o: (calls.append(1) or m.state_dict(), None))
    assert len(calls) == 2 and model not in taken._TAKEN
    hooked = nn.Linear(3, 3)
    hooked.register_state_dict_pre_hook(lambda *a, **k: None)
    take_state(hooked, None, lambda m, o: (m.state_dict(), None))
    assert hooked not in taken._TAKEN


def test_background_saves_of_one_process_read_back(tmp_path):
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    wanted = []
    for i in range(2):
        train_steps(model, opt, 1)
        wanted.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        pending = sdadapt.save_state(model, tmp_path / f"s{i}", opt, extra={"step": i}, async_=True)
        train_steps(model, opt, 1)  # changes the model while it writes
        pending.wait()
    for i, want in enumerate(wanted):
        back = TinyTransformer()
        back_opt = torch.optim.Adam(back.parameters(), lr=1e-2)
        extra = {"step": -1}
        sdadapt.load_state(back, tmp_path / f"s{i}", back_opt, extra=extra, progress=False)
        assert extra["step"] == i
        assert all(torch.equal(back.state_dict()[k], v) for k, v in want.items())
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    pending = sdadapt.save_state(model, tmp_path / "full", opt, async_=True)  # the check is raised by wait()
    try:
        pending.wait()
        raise AssertionError("a non-empty folder was overwritten")
    except sdadapt.errors.StateError as e:
        assert "exists and is not empty" in str(e)


class _Tied(nn.Module):
    """A tied weight (two keys, one tensor), a persistent and a non-persistent buffer, and a
    submodule that saves its state its own way (its model is taken through ``state_dict()``)."""

    def __init__(self, own: bool):
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.out = nn.Linear(3, 5, bias=False)
        self.out.weight = self.emb.weight
        self.register_buffer("seen", torch.zeros(2))
        self.register_buffer("scratch", torch.ones(2), persistent=False)
        self.own = _OwnSave() if own else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(x)) + self.seen.sum()


class _OwnSave(nn.Linear):
    def __init__(self):
        super().__init__(2, 2)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)


def test_a_first_take_keeps_state_dict_keys():
    for own in (False, True):
        model = _Tied(own)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        model(torch.tensor([1, 2])).sum().backward()
        opt.step()
        calls, take = _counted()
        got = take_state(model, opt, take)
        _same_as_fresh(model, opt, got)  # out.weight beside emb.weight, seen, not scratch
        assert "out.weight" in got[0] and "scratch" not in got[0] and calls == []
        assert (got[0]["emb.weight"] is model.emb.weight) != own  # the live tensor, or state_dict()'s detached one


def test_a_tensor_on_meta_is_refused_before_any_take(tmp_path):
    """The first take looks at every tensor in its one pass over the modules: with none on the
    meta device it needs no separate check; with one (a buffer never materialised), the check
    runs and refuses before anything is taken, and a background save's wait() raises it."""
    model = nn.Linear(2, 2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    checks: list[int] = []
    calls, take = _counted()
    _same_as_fresh(model, opt, take_state(model, opt, take, lambda: checks.append(1)))
    assert checks == [] and calls == []  # the cheap first take checked the tensors itself
    taken._TAKEN.pop(model, None)
    model.register_buffer("late", torch.empty(3, device="meta"))

    def refuse() -> None:
        checks.append(1)
        raise sdadapt.errors.StateError("meta")

    with pytest.raises(sdadapt.errors.StateError, match="meta"):
        take_state(model, opt, take, refuse)
    assert checks == [1] and calls == []
    pending = sdadapt.save_state(model, str(tmp_path / "s"), opt, async_=True)
    with pytest.raises(sdadapt.errors.StateError, match="meta device"):
        pending.wait()


def test_one_meta_check_for_a_model_and_a_take(monkeypatch):
    """``has_meta`` answers for a model and for tensors already listed; the first take asks it
    of the tensors its pass found (not a check of its own), and a meta tensor then goes to the
    save's check, which refuses."""
    from sdadapt._transaction import has_meta

    model = nn.Linear(2, 2)
    assert not has_meta(model) and not has_meta(list(model.parameters()))
    model.register_buffer("late", torch.empty(3, device="meta"))
    assert has_meta(model) and has_meta([model.weight, model.late]) and not has_meta([model.weight])
    opt = torch.optim.Adam([model.weight, model.bias], lr=1e-2)
    model.weight.grad = torch.ones_like(model.weight)
    opt.step()
    asked: list[list[torch.Tensor]] = []
    monkeypatch.setattr(taken, "has_meta", lambda ts: asked.append(list(ts)) or has_meta(ts))

    def refuse() -> None:
        raise sdadapt.errors.StateError("meta")

    calls, take = _counted()
    with pytest.raises(sdadapt.errors.StateError, match="meta"):
        take_state(model, opt, take, refuse)
    assert len(asked) == 1 and any(t is model.late for t in asked[0]) and calls == []
