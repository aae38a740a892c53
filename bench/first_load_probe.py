"""What a first load pays once per process on a GPU: pinned host buffers (as the engine's two
pools allocate them, and as one slab), device buffers, and the first launch of the FP8
dequantisation kernels; each timed in this fresh process, then again (the steady cost)."""

from __future__ import annotations

import argparse
import time

import torch

from sdadapt._recipes.quant import dequantize_fp8_into

MiB = 1 << 20


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--staging-mb", type=float, default=256)
    p.add_argument("--threads", type=int, default=12)
    p.add_argument("--band-mb", type=float, default=32)
    a = p.parse_args()
    torch.cuda.init()
    torch.empty(1, device="cuda")
    chunk = int(a.staging_mb * MiB) // (2 * a.threads)
    band = int(a.band_mb * MiB) + int(a.band_mb * MiB) // 16 + 128
    nband = int(a.staging_mb // a.band_mb)
    for name, size, count in (("staging", chunk, int(a.staging_mb * MiB) // chunk), ("bands", band, nband)):
        for round_ in ("first", "again"):  # again: out of torch's cache of freed pinned blocks
            t = time.perf_counter()
            bufs = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(count)]
            s = time.perf_counter() - t
            print(f"pinned {name} {count} x {size / MiB:.1f} MiB ({round_}): {s * 1e3:.1f} ms")
            del bufs
    torch._C._host_emptyCache()
    slab: list[torch.Tensor] = []
    s = timed(lambda: slab.append(torch.empty(int(a.staging_mb * MiB), dtype=torch.uint8, pin_memory=True)))
    print(f"pinned one slab {a.staging_mb:.0f} MiB: {s * 1e3:.1f} ms")
    reg = torch.empty(int(a.staging_mb * MiB), dtype=torch.uint8)
    s = timed(lambda: torch.cuda.cudart().cudaHostRegister(reg.data_ptr(), reg.numel(), 0))
    print(f"cudaHostRegister {a.staging_mb:.0f} MiB (pages untouched): {s * 1e3:.1f} ms")
    land: list[torch.Tensor] = []
    s = timed(lambda: land.extend(torch.empty(band, dtype=torch.uint8, device="cuda") for _ in range(nband)))
    print(f"device landing {nband} x {band / MiB:.1f} MiB: {s * 1e3:.1f} ms")
    rows, cols = 2048, 4096
    w = torch.randn(rows, cols, device="cuda").to(torch.float8_e4m3fn)
    sc = torch.rand(rows // 128, cols // 128, device="cuda")
    dest = torch.empty(rows, cols, dtype=torch.bfloat16, device="cuda")
    for round_ in ("first", "again", "again"):
        s = timed(lambda: dequantize_fp8_into(dest, w, sc, (128, 128), "float32"))
        print(f"dequantize_fp8_into {rows}x{cols} ({round_}): {s * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
