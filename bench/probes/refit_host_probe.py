"""Probe: the host's work in one refit run into a quantized engine, with the GPU kernels faked.

    python bench/probes/refit_host_probe.py --quant fp8_block          # also nvfp4, mxfp8, fp8_channel, fp8_tensor
    python bench/probes/refit_host_probe.py --quant nvfp4 --repeat 11 --cprofile 30

On a GPU a refit's run is its host work (Python, torch's dispatch, the launches) beside the
device's, and the device waits wherever the host is the slower. The refit bench on the device
gives the sum; this gives the host's part on any machine, without a GPU: the quantization
kernels' launches (``quant_fused``'s Triton kernels) are replaced by calls that do nothing, on
CPU tensors that the fused path is made to take (its device and exactness checks answer yes),
so every step of the fused path but the launch itself and the kernel's work runs. The model is
Llama 8B's structure (32 layers, vLLM's TP 1 layout, fused q|k|v and gate|up) at the small
width, so the tensors' own CPU work (casts of embeddings and norms, NVFP4's global scale, which
is not a fused kernel) stays small. Printed: the process's CPU time per run (``time.process_time``:
what a loaded machine's waits for a core leave out), median and least of ``--repeat`` runs after
one first run. What it does not say: the launches' own cost (Triton's launcher) and any wait for
the device.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "bench"), os.path.join(ROOT, "src"), os.path.join(ROOT, "tests")]

import refit_bench  # noqa: E402
from support.refit_eager import quant_engine  # noqa: E402

import sdadapt  # noqa: E402
from sdadapt._recipes import quant_fused  # noqa: E402


class _NoKernel:
    """``kernel[grid](*args)`` that launches nothing."""

    def __getitem__(self, grid: object) -> object:
        return lambda *args, **kwargs: None


def fake_kernels() -> None:
    """The fused path taken on CPU tensors, its kernels doing nothing."""
    kernels = (_NoKernel(), _NoKernel(), _NoKernel())
    quant_fused._device_ok = lambda x: x.dim() >= 2 and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    quant_fused.writable = lambda t, dtype=torch.float8_e4m3fn: t.dtype == dtype and t.dim() in (2, 3) and t.stride(-1) == 1
    quant_fused._exact = lambda *args, **kwargs: True
    quant_fused._checked_already = lambda *args: True
    quant_fused.build = lambda: kernels
    torch.cuda.device = lambda device: contextlib.nullcontext()  # type: ignore[assignment,misc]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quant", choices=["fp8_block", "fp8_channel", "fp8_tensor", "mxfp8", "nvfp4"], default="fp8_block")
    p.add_argument("--repeat", type=int, default=11)
    p.add_argument("--layers", type=int, default=32, help="decoder layers (Llama 8B's 32 by default)")
    p.add_argument("--cprofile", type=int, default=0, help="print the N costliest functions of one more run")
    args = p.parse_args()
    torch.set_num_threads(1)
    fake_kernels()
    s = dict(refit_bench.SIZES["small"], layers=args.layers, vocab=1024)
    full = refit_bench.weights("llama", s, "cpu")
    adapter = refit_bench.adapter("llama", s, 1, args.quant == "fp8_block", args.quant)
    if args.quant == "fp8_block":
        engine = refit_bench.engine_of("llama", s, 1, torch.bfloat16, "cpu", True)
        layout = refit_bench.layout_of("llama", 1, 0, True)
    else:
        engine, layout = quant_engine(refit_bench.trainer_schema("llama", s), adapter, torch.bfloat16), None
    refit = sdadapt.refit_plan(full, engine, adapter, engine_layout=layout)
    refit()
    runs = []
    for _ in range(args.repeat):
        t0 = time.process_time()
        refit()
        runs.append(time.process_time() - t0)
    print(f"{args.quant}: host CPU per run {statistics.median(runs) * 1e3:.1f} ms median, {min(runs) * 1e3:.1f} ms least "
          f"of {args.repeat} ({len(engine)} engine tensors, {args.layers} layers)")  # fmt: skip
    if args.cprofile:
        prof = cProfile.Profile()
        prof.enable()
        refit()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.cprofile)


if __name__ == "__main__":
    main()
