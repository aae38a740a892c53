"""Small venvs for third-party stacks the tests and benches run beside the base venv.

Each lives under ``${TMPDIR:-/tmp}/sdadapt-compat/<name>`` and sees the base venv's packages
(torch 2.13.0, transformers, obstore, sdadapt) through a ``.pth`` file written on every call (a
cached venv outlives the checkout, and its .venv, that made it); only its own packages are
installed into it, with torch held at the base's version by a constraint so pip never fetches
another build. ``scripts/megatron_venv.py``, ``scripts/quant_venv.py`` and ``bench/object_store_peers.py`` make
theirs here.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable


def make_venv(
    name: str,
    packages: list[str],
    check: str,
    root: str | None = None,
    base_site: str | None = None,
    *,
    pins: tuple[str, ...] = (),
    no_deps: tuple[str, ...] = (),
) -> str:
    """Make the venv ``name`` (once; reused while ``check`` runs there) and return its python.

    Args:
        name: the venv's folder under ``root``.
        packages: what pip installs into it.
        check: Python code that exits 0 only where the packages are installed as wanted.
        root: where the small venvs live (default ``${TMPDIR:-/tmp}/sdadapt-compat``).
        base_site: the site-packages it sees (default this interpreter's).
        pins: constraints held beside torch's (``"transformers==4.51.3"``) for both installs.
        no_deps: packages installed after ``packages`` without their dependencies (a tool whose
            declared dependencies cannot install here, its imports served by ``packages``).

    Returns:
        The path of the venv's python.
    """
    root = root or default_root()
    base_site = base_site or sysconfig.get_paths()["purelib"]
    venv = os.path.join(root, name)
    py = os.path.join(venv, "bin", "python")
    if not os.path.exists(py):
        os.makedirs(root, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
    line = f"import site; site.addsitedir({base_site!r})\n"
    pth = os.path.join(site, "_sdadapt_base.pth")
    if not os.path.exists(pth) or open(pth).read() != line:
        with open(pth, "w") as f:
            f.write(line)
    if not runs(py, check):
        import torch

        constraint = os.path.join(venv, "torch-constraint.txt")
        with open(constraint, "w") as f:
            f.write("".join(f"{pin}\n" for pin in (f"torch=={torch.__version__.split('+')[0]}", *pins)))
        quiet = ["--disable-pip-version-check", "--no-warn-conflicts", "-q"]
        subprocess.run([py, "-m", "pip", "install", *quiet, "-c", constraint, *packages], check=True)
        if no_deps:
            subprocess.run([py, "-m", "pip", "install", *quiet, "-c", constraint, "--no-deps", *no_deps], check=True)
    return py


def default_root() -> str:
    """``${TMPDIR:-/tmp}/sdadapt-compat``."""
    return os.path.join(tempfile.gettempdir(), "sdadapt-compat")


def runs(py: str, check: str) -> bool:
    """Whether ``check`` exits 0 under ``py``."""
    return os.path.exists(py) and subprocess.run([py, "-c", check], capture_output=True).returncode == 0


def main(doc: str, name: str, check: str, make: Callable[[str | None], str]) -> int:
    """The command line of a venv script: print the venv's python (made once by ``make``), or
    with ``--check`` exit 0 only where ``check`` runs there."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--root", default=None, help="where the small venvs live")
    ap.add_argument("--check", action="store_true", help="only say whether it is made")
    args = ap.parse_args()
    if args.check:
        return 0 if runs(os.path.join(args.root or default_root(), name, "bin", "python"), check) else 1
    print(make(args.root))
    return 0

