"""The venv of the older-torch slice of CI: torch 2.11.0 from the registry, sdadapt from this checkout.

    python scripts/torch_venv.py                 # make it (or reuse it), print its python
    python scripts/torch_venv.py --root DIR      # somewhere else than ${TMPDIR:-/tmp}/sdadapt-torch

sdadapt declares torch>=2.8 and runs on GPU machines with torch 2.11, while the base venv holds
torch 2.13: FSDP2, DTensor, DCP, gloo and the async stager differ between them. The venv
(``--root``/torch-<version>) holds ``torch==<version>`` with what the tests of the slice import
(:data:`PACKAGES`), every install held at that torch by a constraint file so that pip never
fetches another build, and sdadapt installed from this checkout, editable and without
dependencies (``scripts/own_venv.py``: the stamp, the constraint, another checkout's sdadapt). The
registry holds no CPU build of torch 2.11.0: pip installs its CUDA build with the CUDA libraries
it depends on (about 4.7 GB, made once), which runs on CPU. Exit status 1, with pip's words,
where the venv cannot be made.
"""

from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # own_venv, beside this script
from own_venv import QUIET, ROOT, Step, main, own_venv  # noqa: E402

TORCH_VERSION = "2.11.0"
PACKAGES = ["numpy", "pytest", "hypothesis", "safetensors", "pydantic", "tqdm"]
"""sdadapt's other dependencies and what the slice's tests import beside torch."""
STAMP = "sdadapt-torch-venv.json"


def default_root() -> str:
    """``${TMPDIR:-/tmp}/sdadapt-torch``."""
    return os.path.join(tempfile.gettempdir(), "sdadapt-torch")


def ensure_venv(root: str | None = None) -> str:
    """The venv's python, made when missing, with sdadapt from this checkout. Raises
    ``subprocess.CalledProcessError`` where pip fails."""

    def install(step: Step, py: str, constraints: str) -> None:
        step(py, "-m", "pip", "install", *QUIET, "-c", constraints, f"torch=={TORCH_VERSION}", *PACKAGES)

    return own_venv(os.path.join(root or default_root(), f"torch-{TORCH_VERSION}"), {"torch": TORCH_VERSION, "packages": PACKAGES},
                    STAMP, "torch-venv", install, probe="import os, sdadapt; print(os.path.dirname(sdadapt.__file__))",
                    expect=os.path.join(ROOT, "src", "sdadapt"))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main(__doc__ or "", "torch-venv", ensure_venv, default_root()))
