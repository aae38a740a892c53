"""Probe: what the first launch of each device op of a dequantisation costs in a fresh process.

    python bench/first_kernel_probe.py            # on a GPU machine; PYTHONPATH=src

A kernel's first launch in a process loads its module into the device (CUDA's lazy loading), so
a load whose first computation meets a new kernel waits for that. The engine warms its kernels
up on a thread while the model materialises (``EngineConfig.warm_kernels``); a warm-up longer
than that still holds up the first load. This times, in one fresh process, each op of the NVFP4
path (:func:`sdadapt._recipes.quant_scaled.dequantize_into`) and of per-row FP8 twice (first
launch, then again), each bracketed by a device synchronisation; and the e2m1 table built with
device ops (a dozen kernels, :func:`sdadapt._recipes.quant.e2m1_pair_table` on the device)
against :func:`sdadapt._recipes.quant.fp4_pairs`, which builds it on the host and copies it.
Prints one line per op and call.
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    a = ap.parse_args()
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    t = time.perf_counter()
    torch.zeros(1, device=dev)
    sync()
    print(f"device init {time.perf_counter() - t:.3f} s")

    from sdadapt._recipes import quant_scaled as S
    from sdadapt._recipes.quant import e2m1_pair_table, fp4_pairs

    R, C = a.rows, a.cols
    raw = torch.randint(0, 255, (R, C // 2), dtype=torch.uint8, device=dev)
    scale = torch.rand(R, C // 16, device=dev).to(torch.float8_e4m3fn)
    glob = torch.tensor([448.0 * 6], device=dev)
    dest = torch.empty(R, C, dtype=torch.bfloat16, device=dev)
    w8 = torch.randn(R, C, device=dev).to(torch.float8_e4m3fn)
    s8 = torch.rand(R, 1, device=dev)

    def timed(name: str, fn) -> None:
        for call in (1, 2):
            sync()
            t = time.perf_counter()
            fn()
            sync()
            print(f"{name}: call {call} {1000 * (time.perf_counter() - t):.1f} ms")

    timed("e2m1 table with device ops", lambda: e2m1_pair_table(dev))
    timed("fp4_pairs (host table, one copy)", lambda: fp4_pairs(dev, torch.bfloat16))
    idx = raw.reshape(-1).to(torch.int32)
    timed("uint8 -> int32", lambda: raw.reshape(-1).to(torch.int32))
    timed("index_select into dest", lambda: torch.index_select(fp4_pairs(dev, torch.bfloat16), 0, idx, out=dest.view(-1, 2)))
    timed("e4m3 scales -> float32", lambda: scale.to(torch.float32))
    s = scale.to(torch.float32)
    timed("divide by global scale", lambda: s / glob.reshape(()))
    timed("multiply groups in place", lambda: dest.unflatten(-1, (C // 16, 16)).mul_(s.unsqueeze(-1)))
    timed("e4m3 -> bf16 copy", lambda: dest.copy_(w8))
    timed("multiply rows in place", lambda: dest.mul_(s8))
    timed("NVFP4 dequantize_into", lambda: S.dequantize_into(dest, raw, "e2m1", S.scale_multipliers(scale, glob, "divide"), (1, 16), 0))


if __name__ == "__main__":
    main()
