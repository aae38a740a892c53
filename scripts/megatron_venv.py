"""The small venv that holds Megatron-Core for the Megatron tests, fixtures and bench.

    python scripts/megatron_venv.py            # make it (once) and print its python
    python scripts/megatron_venv.py --check    # exit 0 only if megatron-core imports there
    python scripts/megatron_venv.py --path     # print where its python is (or would be): no making, no check
    python scripts/megatron_venv.py --bridge   # the same for the Megatron-Bridge venv

A small venv of ``scripts/small_venv.py`` (under ``${TMPDIR:-/tmp}/sdadapt-compat``, seeing the base
venv's packages): only ``megatron-core==0.16.1`` (the last release for Python 3.11) and ``psutil``
(its checkpoint writer asks for it) are installed into it, torch held at the base's version.

The Megatron-Bridge venv (``--bridge``; the second reference, ``tests/support/megatron_bridge.py``)
holds ``megatron-bridge==0.3.1`` (the last release for Python 3.11; 0.4 and later need >= 3.12)
installed without its dependencies, since two of them cannot install here: ``mamba-ssm`` fails
to build without ``nvcc`` and ``transformer-engine[core_cu13]`` is CUDA's. Beside it: megatron-core
0.16.1, the transformers release Bridge pins (< 5: 4.57.6) and what importing its conversion code
needs (:data:`BRIDGE_NEEDS`).
"""

from __future__ import annotations

import argparse
import os
import subprocess

from small_venv import default_root, make_venv, runs

MEGATRON_CORE = "0.16.1"
PACKAGES = [f"megatron-core=={MEGATRON_CORE}", "psutil"]
CHECK = f"import importlib.metadata as m, psutil, megatron.core; raise SystemExit(m.version('megatron-core') != {MEGATRON_CORE!r})"
BRIDGE = "0.3.1"
BRIDGE_NEEDS = [*PACKAGES, "transformers==4.57.6", "omegaconf", "hydra-core", "rich", "wandb", "tensorboard", "accelerate",
                "einops", "regex", "pyyaml", "tqdm"]  # fmt: skip
"""What ``megatron.bridge``'s conversion code imports, installed with their dependencies; Bridge
itself goes in without its own."""
NEEDS_CHECK = (f"{CHECK.split('; raise')[0]}, importlib.util as u; raise SystemExit(m.version('megatron-core') != "
               f"{MEGATRON_CORE!r} or m.version('transformers') != '4.57.6' or any(u.find_spec(n) is None for n in "
               "('omegaconf', 'hydra', 'rich', 'wandb', 'tensorboard', 'accelerate', 'einops', 'regex', 'yaml', 'tqdm')))")
"""Whether every one of ``BRIDGE_NEEDS`` is there, in the venv or in the base it sees (the base
changes with the checkout: a package found there once may be gone from the next)."""
BRIDGE_CHECK = f"import importlib.metadata as m; raise SystemExit(m.version('megatron-bridge') != {BRIDGE!r})"
"""Whether Bridge's pinned release is installed; run after :data:`NEEDS_CHECK`, which imported
megatron-core there already (an import of seconds, not repeated)."""


def venv_python(root: str | None = None, base_site: str | None = None, bridge: bool = False) -> str:
    """Make the venv (once; reused while megatron-core imports there) and return its python.

    Args:
        root: where the small venvs live (default ``${TMPDIR:-/tmp}/sdadapt-compat``).
        base_site: the site-packages it sees (default this interpreter's).
        bridge: the Megatron-Bridge venv instead.

    Returns:
        The path of the venv's python.
    """
    if not bridge:
        return make_venv(f"megatron-core-{MEGATRON_CORE}", PACKAGES, CHECK, root, base_site)
    py = make_venv(f"megatron-bridge-{BRIDGE}", BRIDGE_NEEDS, NEEDS_CHECK, root, base_site)
    if not runs(py, BRIDGE_CHECK):
        quiet = ["--disable-pip-version-check", "--no-warn-conflicts", "-q"]
        subprocess.run([py, "-m", "pip", "install", *quiet, "--no-deps", f"megatron-bridge=={BRIDGE}"], check=True)
    return py


def importable(py: str, bridge: bool = False) -> bool:
    """Whether megatron-core (the pinned release) and psutil import under ``py`` (and, for the
    bridge venv, megatron-bridge's pinned release is installed)."""
    return runs(py, NEEDS_CHECK) and runs(py, BRIDGE_CHECK) if bridge else runs(py, CHECK)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=None, help="where the small venvs live")
    ap.add_argument("--check", action="store_true", help="only say whether it is made")
    ap.add_argument("--bridge", action="store_true", help=f"the Megatron-Bridge {BRIDGE} venv")
    ap.add_argument("--path", action="store_true", help="only print where its python is or would be")
    args = ap.parse_args()
    if args.path:
        name = f"megatron-bridge-{BRIDGE}" if args.bridge else f"megatron-core-{MEGATRON_CORE}"
        print(os.path.join(args.root or default_root(), name, "bin", "python"))
        return 0
    if args.check:
        name = f"megatron-bridge-{BRIDGE}" if args.bridge else f"megatron-core-{MEGATRON_CORE}"
        return 0 if importable(os.path.join(args.root or default_root(), name, "bin", "python"), args.bridge) else 1
    print(venv_python(args.root, bridge=args.bridge))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
