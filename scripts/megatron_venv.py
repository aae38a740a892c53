"""The small venv that holds Megatron-Core for the Megatron tests, fixtures and bench.

    python scripts/megatron_venv.py            # make it (once) and print its python
    python scripts/megatron_venv.py --check    # exit 0 only if megatron-core imports there

A small venv of ``scripts/small_venv.py`` (under ``${TMPDIR:-/tmp}/sdadapt-compat``, seeing the base
venv's packages): only ``megatron-core==0.16.1`` (the last release for Python 3.11) and ``psutil``
(its checkpoint writer asks for it) are installed into it, torch held at the base's version.
"""

from __future__ import annotations

import argparse
import os

from small_venv import default_root, make_venv, runs

MEGATRON_CORE = "0.16.1"
PACKAGES = [f"megatron-core=={MEGATRON_CORE}", "psutil"]
CHECK = f"import importlib.metadata as m, psutil, megatron.core; raise SystemExit(m.version('megatron-core') != {MEGATRON_CORE!r})"


def venv_python(root: str | None = None, base_site: str | None = None) -> str:
    """Make the venv (once; reused while megatron-core imports there) and return its python.

    Args:
        root: where the small venvs live (default ``${TMPDIR:-/tmp}/sdadapt-compat``).
        base_site: the site-packages it sees (default this interpreter's).

    Returns:
        The path of the venv's python.
    """
    return make_venv(f"megatron-core-{MEGATRON_CORE}", PACKAGES, CHECK, root, base_site)


def importable(py: str) -> bool:
    """Whether megatron-core (the pinned release) and psutil import under ``py``."""
    return runs(py, CHECK)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=None, help="where the small venvs live")
    ap.add_argument("--check", action="store_true", help="only say whether it is made")
    args = ap.parse_args()
    if args.check:
        root = args.root or default_root()
        return 0 if importable(os.path.join(root, f"megatron-core-{MEGATRON_CORE}", "bin", "python")) else 1
    print(venv_python(args.root))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
