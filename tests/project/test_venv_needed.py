"""The rule for a third-party venv that cannot be made: a failure under CI, a skip elsewhere,
both saying what failed and how to make it."""

from __future__ import annotations

import pytest
from support.venv_needed import venv_missing


def test_a_missing_venv_fails_under_ci_and_skips_elsewhere_saying_how(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=r"scripts/x_venv.py could not make the x venv: no network"):
        venv_missing("scripts/x_venv.py", "x", "no network")
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match=r"run `python scripts/x_venv.py` where the package registry"):
        venv_missing("scripts/x_venv.py", "x", "no network")
