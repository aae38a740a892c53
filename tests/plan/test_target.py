"""``model_state_dict``'s fast path returns exactly what ``get_model_state_dict`` returns."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from sdadapt._plan.target import model_state_dict, renames_nothing


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))
        self.register_buffer("cache", torch.zeros(4), persistent=False)


def tiny() -> nn.Module:
    m = nn.Module()
    m.emb = nn.Embedding(8, 4)
    m.layers = nn.ModuleList([Block(), Block()])
    m.out = nn.Linear(4, 8, bias=False)
    m.out.weight = m.emb.weight  # tied: both keys, one tensor
    return m


def wrapped_layers() -> nn.Module:
    m = tiny()
    m.layers[0] = checkpoint_wrapper(m.layers[0])
    return m


class Modifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(2, 2)

    def _fqn_modifiers(self) -> dict[str, str]:
        return {"inner": ""}


@pytest.mark.parametrize(
    "make, fast",
    [
        (tiny, True),
        (lambda: torch.compile(tiny()), False),  # OptimizedModule: keys lose "_orig_mod."
        (wrapped_layers, False),  # activation checkpointing's wrapper segment
        (lambda: nn.Sequential(Modifier()), False),
    ],
)
def test_same_as_get_model_state_dict(make, fast):
    model = make()
    assert renames_nothing(model) is fast
    ours = model_state_dict(model)
    theirs = {k: v for k, v in get_model_state_dict(model).items() if isinstance(v, torch.Tensor)}
    assert list(ours) == list(theirs)
    for k in ours:
        assert ours[k] is theirs[k] or (ours[k].data_ptr() == theirs[k].data_ptr() and ours[k].shape == theirs[k].shape), k


def test_reserve_asks_once_for_the_large_tensors(monkeypatch):
    """One allocation as large as the model's > 1 MiB local tensors (rounded like the caching
    allocator), only on CUDA, and not under allocator settings that would strand it."""
    from sdadapt._transaction import materialize as materialize

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4096, 4096, bias=False), nn.Linear(4096, 2001, bias=True), nn.Linear(10, 10))
        small = nn.Linear(1024, 1024)  # 4 MiB: under 64 MiB nothing is worth reserving
    asked: list[int] = []
    monkeypatch.setattr(materialize.torch, "empty", lambda n, **kw: asked.append(n))  # nothing allocated
    big = 4096 * 4096 * 4 + 2001 * 4096 * 4  # the two large weights (96 MiB); biases and the small layer stay out
    materialize._reserve(model, torch.device("cpu"))
    assert asked == []  # CPU: nothing to reserve
    materialize._reserve(small, torch.device("cuda", 0))
    assert asked == []
    materialize._reserve(model, torch.device("cuda", 0))
    assert asked == [big]
    for env in ({"SDADAPT_RESERVE": "0"}, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, {"PYTORCH_ALLOC_CONF": "max_split_size_mb:64"}):
        asked.clear()
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            materialize._reserve(model, torch.device("cuda", 0))
        assert asked == [], env


def test_reservation_asks_on_a_thread_and_never_raises(monkeypatch):
    """Started before the plan: the same one allocation, made on a thread (joined by wait());
    nothing for a CPU device or a model already materialised; a bad device= is left to
    materialising (which reports it on every rank), not raised here."""
    from sdadapt._transaction import materialize as materialize

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4096, 4096, bias=False), nn.Linear(4096, 2001, bias=True))
    real = nn.Linear(4096, 4096)
    threads: list[str] = []

    def empty(n: int, **kw: object) -> None:
        threads.append(threading.current_thread().name)
        asked.append(n)

    asked: list[int] = []
    monkeypatch.setattr(materialize.torch, "empty", empty)
    monkeypatch.setattr(materialize.torch.cuda, "current_stream", lambda device=None: None)  # a CPU-only build has none
    materialize.Reservation(model, "cuda:0").wait()
    assert asked == [4096 * 4096 * 4 + 2001 * 4096 * 4] and threads == ["sdadapt-reserve"]
    asked.clear()
    materialize.Reservation(model, "cpu").wait()
    materialize.Reservation(real, "cuda:0").wait()  # nothing on meta
    materialize.Reservation(model, "no-such-device").wait()
    assert asked == []


@pytest.mark.parametrize("make", [tiny, lambda: torch.compile(tiny()), wrapped_layers])
def test_load_targets_are_the_models_own_tensors(make):
    """A load's targets: ``model_state_dict``'s keys, each value the model's own parameter or
    buffer where that is ``model.state_dict()`` (else ``model_state_dict``'s own tensors)."""
    from sdadapt._plan.target import load_targets

    model = make()
    ours, theirs = load_targets(model), model_state_dict(model)
    assert list(ours) == list(theirs)
    own = {id(t) for t in (*model.parameters(), *model.buffers())}
    for k in ours:
        assert ours[k].data_ptr() == theirs[k].data_ptr() and ours[k].shape == theirs[k].shape, k
        assert (id(ours[k]) in own) is renames_nothing(model), k
    if renames_nothing(model):
        assert ours["out.weight"] is ours["emb.weight"] is model.emb.weight
