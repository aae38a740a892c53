"""The demo (``bash scripts/demo.sh``): a checkpoint whose layout differs from the model's,
what ``sdadapt diff`` says about it without and with an adapter, then 4 CPU processes loading
it into a 2x2 FSDP2 x TP model (examples/pipeline.py) and training a few steps.

    python examples/demo.py [--steps N] [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import pipeline  # noqa: E402 - examples/pipeline.py, next to this file

from sdadapt.cli import main as sdadapt_cli  # noqa: E402


def show(argv: list[str]) -> int:
    print(f"\n$ sdadapt {shlex.join(argv)}", flush=True)
    rc = sdadapt_cli(argv)
    print(f"(exit status {rc})", flush=True)
    return rc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5, help="training steps")
    ap.add_argument("--keep", metavar="DIR", help="write the checkpoint here (default: a temporary folder)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    folder = args.keep or tempfile.mkdtemp(prefix="sdadapt-demo-")
    os.makedirs(folder, exist_ok=True)
    ckpt = os.path.join(folder, "pretrained.pt")
    pipeline.write_checkpoint(ckpt, pipeline.Config())
    rel = os.path.relpath(os.path.join(HERE, "pipeline.py"))
    print(f"A 'pretrained' torch.save file with q_proj/k_proj/v_proj; the model ({rel}) fuses them into qkv.")

    ok = show(["inspect", ckpt]) == 0
    ok &= show(["diff", ckpt, "--target", f"{rel}:build_model"]) == 1  # the mismatch, named
    ok &= show(["diff", ckpt, "--target", f"{rel}:build_model", "--adapter", f"{rel}:qkv_adapter"]) == 0

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", rel]
    cmd += ["--mesh", "2x2", "--ckpt", ckpt, "--steps", str(args.steps), "--check"]
    print(f"\n$ torchrun --nproc-per-node 4 {shlex.join(cmd[6:])}", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        rc = subprocess.run(cmd, env=env, timeout=300).returncode
    except subprocess.TimeoutExpired:
        print("the pipeline did not finish within 300 s", file=sys.stderr)
        rc = 124
    ok &= rc == 0
    print(f"\ndemo {'finished' if ok else 'FAILED'} in {time.perf_counter() - t0:.1f} s" + (f"; files in {folder}" if args.keep else ""))
    if not args.keep:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
