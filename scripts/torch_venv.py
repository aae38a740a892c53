"""The venv of the older-torch slice of CI: torch 2.11.0 from the registry, sdadapt from this checkout.

    python scripts/torch_venv.py                 # make it (or reuse it), print its python
    python scripts/torch_venv.py --root DIR      # somewhere else than ${TMPDIR:-/tmp}/sdadapt-torch

sdadapt declares torch>=2.8 and runs on GPU machines with torch 2.11, while the base venv holds
torch 2.13: FSDP2, DTensor, DCP, gloo and the async stager differ between them. The venv
(``--root``/torch-<version>) holds ``torch==<version>`` with what the tests of the slice import
(:data:`PACKAGES`), every install held at that torch by a constraint file so that pip never
fetches another build, and sdadapt installed from this checkout, editable and without
dependencies (re-pointed when the venv was made by another checkout). The registry holds no CPU
build of torch 2.11.0: pip installs its CUDA build with the CUDA libraries it depends on (about
4.7 GB, made once), which runs on CPU. A finished venv carries a stamp file naming what it holds;
one without it (an install cut short) is made again. Exit status 1, with pip's words, where the
venv cannot be made.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH_VERSION = "2.11.0"
PACKAGES = ["numpy", "pytest", "hypothesis", "safetensors", "pydantic", "tqdm"]
"""sdadapt's other dependencies and what the slice's tests import beside torch."""
STAMP = "sdadapt-torch-venv.json"


def default_root() -> str:
    """``${TMPDIR:-/tmp}/sdadapt-torch``."""
    return os.path.join(tempfile.gettempdir(), "sdadapt-torch")


def venv_python(root: str | None = None) -> str:
    """Where the venv's python is (or will be)."""
    return os.path.join(root or default_root(), f"torch-{TORCH_VERSION}", "bin", "python")


def _want() -> dict:
    return {"torch": TORCH_VERSION, "packages": PACKAGES}


def is_ready(root: str | None = None) -> bool:
    """Whether the venv exists, finished, holding what :func:`_want` names (its stamp file says so)."""
    py = venv_python(root)
    try:
        with open(os.path.join(os.path.dirname(os.path.dirname(py)), STAMP)) as f:
            return json.load(f) == _want() and os.path.exists(py)
    except (OSError, ValueError):
        return False


def ensure_venv(root: str | None = None) -> str:
    """The venv's python, made when missing, with sdadapt from this checkout. Raises
    ``subprocess.CalledProcessError`` where pip fails."""
    py = venv_python(root)
    venv = os.path.dirname(os.path.dirname(py))
    quiet = ["--disable-pip-version-check", "--no-warn-conflicts", "-q"]
    constraints = os.path.join(venv, "constraints.txt")

    def step(*cmd: str) -> None:
        print("[torch-venv]", " ".join(cmd), file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True)

    if not is_ready(root):
        if os.path.exists(venv):
            shutil.rmtree(venv)
        os.makedirs(os.path.dirname(venv), exist_ok=True)
        step(sys.executable, "-m", "venv", venv)
        with open(constraints, "w") as f:
            f.write(f"torch=={TORCH_VERSION}\n")
        step(py, "-m", "pip", "install", *quiet, "-c", constraints, f"torch=={TORCH_VERSION}", *PACKAGES)
        step(py, "-m", "pip", "install", *quiet, "-c", constraints, "--no-deps", "-e", ROOT)
        with open(os.path.join(venv, STAMP), "w") as f:
            json.dump(_want(), f)
    # the venv is shared by checkouts: sdadapt is re-pointed at this one when it is another's
    probe = "import os, sdadapt; print(os.path.dirname(sdadapt.__file__))"
    where = subprocess.run([py, "-c", probe], capture_output=True, text=True).stdout.strip()
    if where != os.path.join(ROOT, "src", "sdadapt"):
        step(py, "-m", "pip", "install", *quiet, "-c", constraints, "--no-deps", "-e", ROOT)
    return py


def main() -> int:
    from small_venv import own_main  # beside this script: importable when it runs as one

    return own_main(__doc__, "torch-venv", ensure_venv, default_root())


if __name__ == "__main__":
    sys.exit(main())
