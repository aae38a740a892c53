"""Copies of sdadapt with a recorder patched in, for load_bench variants (``src=OUT/src``): the
command line that bench/probes/engine_trace.py and bench/probes/gpu_timeline.py share."""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Callable


def write_overlay(src: str, out: str, module: str, patch: str, tool: str) -> str:
    """Copy the sdadapt package under ``src`` (a ``src`` folder) to ``out/src``, with ``patch``
    as its module ``module``, imported at the end of sdadapt's ``__init__``; returns the copy's
    ``src`` folder."""
    dest = os.path.join(out, "src")
    if os.path.exists(dest):
        shutil.rmtree(dest)
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__"))
    pkg = os.path.join(dest, "sdadapt")
    with open(os.path.join(pkg, f"{module}.py"), "w") as f:
        f.write(patch)
    with open(os.path.join(pkg, "__init__.py"), "a") as f:
        f.write(f"\nfrom . import {module}  # noqa: E402,F401  ({tool})\n")
    return dest


def overlay_main(doc: str | None, overlay: Callable[[str, str], None], summary: Callable[[str], None]) -> None:
    """``overlay SRC OUT`` or ``summary FOLDER``, run by ``overlay`` or ``summary``."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    o = sub.add_parser("overlay", help="copy SRC's sdadapt with the recorder to OUT/src")
    o.add_argument("src")
    o.add_argument("out")
    s = sub.add_parser("summary", help="summarise the records in a folder")
    s.add_argument("folder")
    a = p.parse_args()
    if a.cmd == "overlay":
        overlay(a.src, a.out)
    else:
        summary(a.folder)
