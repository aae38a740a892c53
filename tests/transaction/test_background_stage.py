"""Staging a background save's state (sdadapt._state.background.stage): every save stages a
copy that training may no longer change, also when torch closes its stager after each stage
(torch 2.11's DefaultStager does: a second stage with it would fail)."""

from __future__ import annotations

import torch

from sdadapt._state import background


def test_each_stage_copies_the_state_and_a_kept_stager_stays_usable(monkeypatch):
    monkeypatch.setattr(background, "_STAGER", [])
    for step in range(3):
        weight = torch.full((4, 3), float(step))
        state = {"model": {"w": weight}, "extra": {"step": step, "kind": torch.nn.Linear}}
        staged = background.stage(state)
        weight.add_(100)  # training goes on: the staged copy keeps the values it had
        assert torch.equal(staged["model"]["w"], torch.full((4, 3), float(step)))
        assert staged["extra"] == {"step": step, "kind": torch.nn.Linear}
    assert len(background._STAGER) <= 1


def test_a_stager_that_closes_after_each_stage_serves_every_save(monkeypatch):
    """torch 2.11's DefaultStager closes its state-dict stager at the end of each stage."""

    class ClosingStager(background.DefaultStager):
        def stage(self, state_dict, **kwargs):
            staged = super().stage(state_dict, **kwargs)
            self._state_dict_stager.close()
            return staged

    monkeypatch.setattr(background, "DefaultStager", ClosingStager)
    monkeypatch.setattr(background, "_STAGER", [])
    for step in range(3):
        staged = background.stage({"w": torch.full((2,), float(step)), "extra": {"kind": torch.nn.Linear}})
        assert torch.equal(staged["w"], torch.full((2,), float(step))) and staged["extra"]["kind"] is torch.nn.Linear
        assert background._STAGER == []  # not kept: the next save makes its own
