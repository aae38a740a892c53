"""The small venv that holds Megatron-Core for the Megatron tests, fixtures and bench.

    python scripts/megatron_venv.py            # make it (once) and print its python
    python scripts/megatron_venv.py --check    # exit 0 only if megatron-core imports there

Like scripts/compat_matrix.py's venvs, it lives under ``${TMPDIR:-/tmp}/sdadapt-compat`` and sees
the base venv's packages (torch 2.13.0, transformers, sdadapt) through a ``.pth`` file: only
``megatron-core==0.16.1`` (the last release for Python 3.11) and ``psutil`` (its checkpoint writer
asks for it) are installed into it, with torch held at the base's version by a constraint so pip
never fetches another build.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import sysconfig
import tempfile

MEGATRON_CORE = "0.16.1"
PACKAGES = [f"megatron-core=={MEGATRON_CORE}", "psutil"]


def venv_python(root: str | None = None, base_site: str | None = None) -> str:
    """Make the venv (once; reused while megatron-core imports there) and return its python.

    Args:
        root: where the small venvs live (default ``${TMPDIR:-/tmp}/sdadapt-compat``).
        base_site: the site-packages it sees (default this interpreter's).

    Returns:
        The path of the venv's python.
    """
    root = root or os.path.join(tempfile.gettempdir(), "sdadapt-compat")
    base_site = base_site or sysconfig.get_paths()["purelib"]
    venv = os.path.join(root, f"megatron-core-{MEGATRON_CORE}")
    py = os.path.join(venv, "bin", "python")
    if not os.path.exists(py):
        os.makedirs(root, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    # the base it sees is the caller's, written on every call: a cached venv outlives the checkout
    # (and its .venv) that made it, and torch and pip come from that base
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    line = f"import site; site.addsitedir({base_site!r})\n"
    pth = os.path.join(site, "_sdadapt_base.pth")
    if not os.path.exists(pth) or open(pth).read() != line:
        with open(pth, "w") as f:
            f.write(line)
    if not importable(py):
        import torch

        constraint = os.path.join(venv, "torch-constraint.txt")
        with open(constraint, "w") as f:
            f.write(f"torch=={torch.__version__.split('+')[0]}\n")
        quiet = ["--disable-pip-version-check", "--no-warn-conflicts", "-q"]
        subprocess.run([py, "-m", "pip", "install", *quiet, "-c", constraint, *PACKAGES], check=True)
    return py


def importable(py: str) -> bool:
    """Whether megatron-core (the pinned release) and psutil import under ``py``."""
    code = ("import importlib.metadata as m, psutil, megatron.core; "
            f"raise SystemExit(m.version('megatron-core') != {MEGATRON_CORE!r})")
    return subprocess.run([py, "-c", code], capture_output=True).returncode == 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=None, help="where the small venvs live")
    ap.add_argument("--check", action="store_true", help="only say whether it is made")
    args = ap.parse_args()
    if args.check:
        root = args.root or os.path.join(tempfile.gettempdir(), "sdadapt-compat")
        return 0 if importable(os.path.join(root, f"megatron-core-{MEGATRON_CORE}", "bin", "python")) else 1
    print(venv_python(args.root))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
