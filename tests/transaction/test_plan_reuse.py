"""A load reuses the plan of the process's last load only where everything a plan is made from
is equal (``_transaction/steps.LastPlan``): the file's identity, the model's layout and class, the
adapter and the options; the loaded values are the file's, bit for bit, either way. One plan is
kept. The ranks' agreement with a reused plan is tests/dist/test_dist_errors.py's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from support.checkpoints import write_safetensors
from support.models import TinyTransformer
from torch import nn

import sdadapt
from sdadapt._transaction.steps import LAST_PLAN
from sdadapt.errors import PlanError


class OtherName(TinyTransformer):
    """The same layout under another class name (the report names the model's class)."""


def values(seed: int, **size: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: torch.randn_like(v) for k, v in TinyTransformer(**size).state_dict().items()}


def meta(cls: type[nn.Module] = TinyTransformer, **size: int) -> nn.Module:
    with torch.device("meta"):
        return cls(**size)


def hit(model: nn.Module, path: str | os.PathLike[str], want: dict[str, torch.Tensor], adapter: sdadapt.Adapter | None = None,
        **kw: object) -> bool:  # fmt: skip
    """Load ``path`` into ``model``; whether the kept plan was reused. The values must be ``want``'s."""
    before = LAST_PLAN.hits
    sdadapt.load(model, path, adapter, **kw)  # type: ignore[arg-type]
    got = model.state_dict()
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    return LAST_PLAN.hits == before + 1


@pytest.fixture(autouse=True)
def forget() -> None:
    LAST_PLAN.clear()


def test_equal_loads_reuse_and_changes_do_not(tmp_path: Path) -> None:
    path = write_safetensors(tmp_path / "a.safetensors", values(1))
    want = values(1)
    assert not hit(meta(), path, want)  # the first load plans
    assert hit(meta(), path, want)  # the same file, layout, adapter and options
    assert hit(TinyTransformer(), path, want)  # a materialised model of the same layout

    # the file rewritten (other values, a new inode and mtime): planned again, the new values loaded
    os.replace(write_safetensors(tmp_path / "b.safetensors", values(2)), path)
    assert not hit(meta(), path, values(2))
    assert hit(meta(), path, values(2))

    # the model: another layout (the checkpoint then does not fit: refused, strictly), another class name
    with pytest.raises(PlanError):
        sdadapt.load(meta(vocab=38), path)
    assert not hit(meta(), path, values(2))
    assert not hit(meta(OtherName), path, values(2))
    assert not hit(meta(), path, values(2))

    # the options that change a plan
    assert not hit(meta(), path, values(2), allow_missing=["nothing.*"])
    assert not hit(meta(), path, values(2))


def test_the_adapter_is_compared_by_its_rules(tmp_path: Path) -> None:
    sd = values(3)
    path = write_safetensors(tmp_path / "renamed.safetensors", {("model." + k): v for k, v in sd.items()})
    strip = sdadapt.Adapter([sdadapt.strip_prefix("model.")], name="strip")
    assert not hit(meta(), path, sd, strip)
    assert hit(meta(), path, sd, sdadapt.Adapter([sdadapt.strip_prefix("model.")], name="strip"))  # equal, not the same object
    assert not hit(meta(), path, sd, sdadapt.Adapter([sdadapt.strip_prefix("model.")], name="other name"))
    # an adapter changed in place after it was used is another adapter
    strip.rules[0] = sdadapt.strip_prefix("model.", optional=True)
    assert not hit(meta(), path, sd, strip)


def test_one_plan_is_kept(tmp_path: Path) -> None:
    a = write_safetensors(tmp_path / "a.safetensors", values(4))
    b = write_safetensors(tmp_path / "b.safetensors", values(5))
    assert not hit(meta(), a, values(4))
    assert not hit(meta(), b, values(5))
    assert not hit(meta(), a, values(4))  # b's plan replaced a's


def test_plans_with_problems_and_pipeline_stages_are_not_kept(tmp_path: Path) -> None:
    sd = values(6)
    del sd["norm.bias"]
    path = write_safetensors(tmp_path / "lacking.safetensors", sd)
    model = TinyTransformer()
    assert not hit(model, path, sd, strict=False)  # loads what lines up, logs the problem
    assert not hit(TinyTransformer(), path, sd, strict=False)  # planned (and judged) again
    assert not hit(TinyTransformer(), path, sd, allow_missing=["norm.bias"], pipeline_stage=True)
    assert not hit(TinyTransformer(), path, sd, allow_missing=["norm.bias"], pipeline_stage=True)


def test_an_open_source_is_planned_every_time(tmp_path: Path) -> None:
    path = write_safetensors(tmp_path / "a.safetensors", values(7))
    for _ in range(2):
        with sdadapt.sources.open_source(path) as source:
            assert not hit(meta(), source, values(7))
