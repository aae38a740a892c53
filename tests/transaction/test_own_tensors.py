"""``own_tensors``: what ``model.parameters()`` then ``model.buffers()`` give, from one walk over
the modules (a load asks which tensor comes first on a GPU, and whether a tensor is the model's)."""

from __future__ import annotations

import torch
from support.models import TinyTransformer
from torch import nn

from sdadapt._transaction.materialize import own_tensors


def ids(tensors: list[torch.Tensor]) -> list[int]:
    return [id(t) for t in tensors]


def first_seen(tensors: list[torch.Tensor]) -> list[int]:
    return list(dict.fromkeys(ids(tensors)))


def test_the_same_tensors_in_the_same_order() -> None:
    model = TinyTransformer()
    model.register_buffer("scale", torch.ones(3))
    model.layers[0].register_buffer("cache", torch.zeros(2), persistent=False)
    assert ids(own_tensors(model)) == ids([*model.parameters(), *model.buffers()])


def test_shared_tensors_and_modules_come_in_first_seen_order() -> None:
    model = TinyTransformer()
    model.head.weight = model.embedding.weight  # tied: parameters() gives it once
    model.again = model.layers[1]  # one module under two names: walked once
    ours = own_tensors(model)
    assert first_seen(ours) == ids([*model.parameters(), *model.buffers()])
    assert {id(t) for t in ours} == {id(t) for t in (*model.parameters(), *model.buffers())}


def test_an_empty_model() -> None:
    assert own_tensors(nn.Module()) == []
