"""The compatibility matrix: tests/support/compat_cases.py run under each transformers release, each in
a small venv of its own, and the table of docs/compatibility.md printed from the results.

    python scripts/compat_matrix.py                       # the default releases (below)
    python scripts/compat_matrix.py 4.57.6 5.25.0         # these
    python scripts/compat_matrix.py --pytest tests/plan/test_hf_models.py 4.57.6   # a test file there
    python scripts/compat_matrix.py --torchtitan 0.2.2    # the bridge under torchtitan 0.2.2 (only)

Each small venv (``--root``/tf-<version>) holds only that transformers and what it depends on;
torch, sdadapt and the rest come from the venv running this script (``--base``, by default this
interpreter's), which it sees through a ``.pth`` file (``site.addsitedir``): its own packages
come first, so its transformers (and, e.g., the huggingface_hub that transformers needs) shadow
the base's. Nothing large is downloaded: transformers is pure Python. Exit status 1 if any case
failed. The torch floor (2.8 .. 2.12, multi-GB CUDA wheels) is not run here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 4.45.2 is below the supported floor: its row must show the up-front refusal
DEFAULT = ["4.45.2", "4.57.6", "5.0.0", "5.5.4", "5.10.4", "5.13.1", "5.17.0", "5.21.1", "5.25.0"]


def make_venv(root: str, version: str, base_site: str, package: str = "transformers") -> str:
    """The small venv for ``package==version`` (made once; reused while it has it). Its
    dependencies that the base lacks go into the small venv, torch never (the base's stays):
    torchtitan 0.2.2's models import tensorboard, datasets and torchdata, which the base's
    test-titan extra leaves out (torchtitan 0.3.0 needs none of them)."""
    venv = os.path.join(root, f"{'tf' if package == 'transformers' else package}-{version}")
    py = os.path.join(venv, "bin", "python")
    if not os.path.exists(py):
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
        site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, capture_output=True, text=True).stdout.strip()
        with open(os.path.join(site, "_sdadapt_base.pth"), "w") as f:
            f.write(f"import site; site.addsitedir({base_site!r})\n")
    have = subprocess.run([py, "-c", f"import importlib.metadata as m; print(m.version({package!r}))"],
                          capture_output=True, text=True).stdout.strip()
    if have != version:
        # the base's pip, run by the small venv's python: it installs into the small venv and sees
        # the base's packages (torch stays the base's: transformers does not depend on it)
        torch_version = subprocess.run([py, "-c", "import torch; print(torch.__version__.split('+')[0])"],
                                       check=True, capture_output=True, text=True).stdout.strip()
        constraint = os.path.join(venv, "torch-constraint.txt")
        with open(constraint, "w") as f:
            f.write(f"torch=={torch_version}\n")
        # (--no-warn-conflicts: the base's other packages, e.g. diffusers, may want another huggingface_hub)
        quiet = ["--disable-pip-version-check", "--no-warn-conflicts", "-q"]
        subprocess.run([py, "-m", "pip", "install", *quiet, "-c", constraint, f"{package}=={version}"], check=True)
    return py


def run_cases(py: str, timeout: float) -> tuple[list[dict], float]:
    start = time.monotonic()
    p = subprocess.run([py, os.path.join(ROOT, "tests", "support", "compat_cases.py")], capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    if not rows or "failed" not in rows[-1]:
        rows.append({"case": "(run)", "ok": False, "load": f"exit {p.returncode}: {p.stderr.strip()[-800:]}"})
    return rows, time.monotonic() - start


def table(results: dict[str, list[dict]]) -> str:
    cases = ["llama", "llama_tied", "qwen3_moe", "mixtral"]
    head = ["transformers", *cases, "diff exit 0", "export reopens", "shipped llama adapter"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for version, rows in results.items():
        by = {r["case"]: r for r in rows if "case" in r}

        def cell(case: str, check: str, by: dict = by) -> str:
            r = by.get(case)
            if r is None:
                return "not run"
            v = r.get(check, "?")
            return {"ok": "pass", "absent": "n/a", "refused up front": "refused"}.get(v, "FAIL")

        def column(check: str) -> str:
            got = {cell(c, check) for c in cases} - {"n/a"}
            return "pass" if got == {"pass"} else ("refused" if got == {"refused"} else "FAIL")

        row = [version, *(cell(c, "load") for c in cases), column("diff"), column("export"), cell("llama", "shipped")]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("versions", nargs="*", help="transformers releases (default: the table's; none with --torchtitan)")
    ap.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "sdadapt-compat"), help="where the small venvs live")
    ap.add_argument("--base", default=sysconfig.get_paths()["purelib"], help="site-packages the small venvs see (torch, sdadapt)")
    ap.add_argument("--pytest", nargs="+", metavar="ARG", help="run pytest with these arguments in each venv instead of the cases")
    ap.add_argument("--torchtitan", action="append", default=[], metavar="VERSION",
                    help="also run tests/support/titan_compat.py under this torchtitan release (repeatable; the base must hold "
                    "the test-titan extra)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if not args.versions and not args.torchtitan:
        args.versions = DEFAULT
    os.makedirs(args.root, exist_ok=True)
    results: dict[str, list[dict]] = {}
    failed = False
    for version in args.versions:
        t0 = time.monotonic()
        py = make_venv(args.root, version, args.base)
        setup = time.monotonic() - t0
        if args.pytest:
            start = time.monotonic()
            p = subprocess.run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args.pytest], cwd=ROOT, timeout=args.timeout,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
            print(f"[compat] transformers {version}: pytest exit {p.returncode} in {time.monotonic() - start:.0f}s "
                  f"(venv {setup:.0f}s)", file=sys.stderr, flush=True)
            failed |= p.returncode != 0
            continue
        rows, seconds = run_cases(py, args.timeout)
        results[version] = rows
        bad = [r for r in rows if not r.get("ok", True)]
        failed |= bool(bad) or rows[-1].get("failed", 1) != 0
        print(f"[compat] transformers {version}: {'FAIL' if bad else 'pass'} in {seconds:.0f}s (venv {setup:.0f}s)",
              file=sys.stderr, flush=True)
        for r in bad:
            print("   ", json.dumps(r)[:1500], file=sys.stderr)
    for version in args.torchtitan:
        py = make_venv(args.root, version, args.base, "torchtitan")
        p = subprocess.run([py, os.path.join(ROOT, "tests", "support", "titan_compat.py")], capture_output=True, text=True,
                           timeout=args.timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
        line = (p.stdout.strip().splitlines() or [p.stderr.strip()[-800:]])[-1]
        print(f"[compat] torchtitan {version}: {'pass' if p.returncode == 0 else 'FAIL'}: {line}", file=sys.stderr, flush=True)
        failed |= p.returncode != 0
    if results:
        print(table(results))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
