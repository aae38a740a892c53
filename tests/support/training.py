"""A tiny training loop and the faults injected into it, for the load transaction's tests."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import sdadapt

VOCAB = 37


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        model(_tokens()).sum().backward()
        opt.step()
        opt.zero_grad()


def forward_error(model: nn.Module) -> str | None:
    try:
        model(_tokens())
    except sdadapt.errors.ModelError as e:
        return str(e)
    return None


# --------------------------------------------------------------------------------------------
# failures while committing: a second launched group
# --------------------------------------------------------------------------------------------
class Counter:
    """A ``Stateful`` extra whose ``load_state_dict`` fails when ``fail``."""

    def __init__(self, n: int = 0, fail: bool = False):
        self.n, self.fail = n, fail

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if self.fail:
            raise ValueError("injected: this counter refuses its state")
        self.n = sd["n"]


def step_error(opt: torch.optim.Optimizer) -> str | None:
    try:
        opt.step()
    except sdadapt.errors.ModelError as e:
        return str(e)
    return None
