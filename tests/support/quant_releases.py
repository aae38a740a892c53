"""GPTQ and AWQ releases written by the tools themselves (auto-gptq, AutoAWQ), for the tests.

:func:`quant_releases` makes the quant venv (``scripts/quant_venv.py``) and runs
``quant_oracle.py`` there once per :data:`RELEASES_VERSION` (cached beside the venv, under
``${TMPDIR:-/tmp}/sdadapt-compat``): ``NAME/`` is the release, ``NAME.oracle/`` the tools' own
dequantisation of it as a plain float16 release. The tests skip, saying why, only where the
tools cannot be installed (and fail in CI).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from support.venv_needed import venv_missing

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("quant_oracle.py")
NAMES = ("gptq4_g32_sym", "gptq4_g32_asym_act", "gptq8_gall_sym", "gptq8_g32_asym_act", "gptq2_g64_asym",
         "awq4_g32", "awq4_g64")
RELEASES_VERSION = 1
"""Bumped whenever quant_oracle.py writes other releases: the cached ones are then written again."""


def quant_python() -> str:
    """The quant venv's python; a failure in CI where it cannot be made, elsewhere a skip quoting pip."""
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "quant_venv.py")], capture_output=True, text=True)
    if p.returncode != 0:
        venv_missing("scripts/quant_venv.py", "GPTQ / AWQ tools'", p.stderr.strip()[-600:])
    return p.stdout.strip().splitlines()[-1]


def quant_releases() -> str:
    """The folder holding each release ``NAME/`` and its oracle ``NAME.oracle/`` (written once: the
    tools are imported only when it is missing)."""
    folder = os.path.join(tempfile.gettempdir(), "sdadapt-compat", f"quant-releases-v{RELEASES_VERSION}")
    if all(os.path.isfile(os.path.join(folder, f"{n}.oracle", "model.safetensors")) for n in NAMES):
        return folder
    py = quant_python()
    work = tempfile.mkdtemp(prefix="releases-", dir=os.path.dirname(folder))
    p = subprocess.run([py, str(SCRIPT), work, *NAMES], capture_output=True, text=True, timeout=900,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    if p.returncode != 0:
        shutil.rmtree(work, ignore_errors=True)
        raise RuntimeError(f"auto-gptq / AutoAWQ could not write the releases:\n{p.stderr[-4000:]}")
    try:
        os.rename(work, folder)
    except OSError:  # another process made it first
        shutil.rmtree(work, ignore_errors=True)
    return folder


def copy_release(folder: str, name: str, dst: str) -> str:
    """A copy of release ``name`` in ``dst`` (to break it), its path."""
    out = os.path.join(dst, name)
    shutil.copytree(os.path.join(folder, name), out)
    return out
