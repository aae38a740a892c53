"""GPU time of ways to dequantise one FP8 band (4096 x 4096 e4m3, float32 128x128 scales) into
bf16, all bit-exact against ``sdadapt._recipes.quant.dequantize_fp8``, and the host-to-device copy rate
out of pinned memory: the GPU side of an FP8 load, apart from reading the files.

    python bench/fp8_kernel_bench.py        # needs a CUDA device

Variants: ``inplace`` (what the engine runs on whole blocks: the weight converted into the
destination, then multiplied in place by the broadcast scales), ``f32-temp`` (float32 copy,
scaled, copied out), ``mul-out`` (bf16 copy times scales written into the destination),
``region`` (the general region kernel: float32 buffer aligned to the tiles).
"""

from __future__ import annotations

import torch

from sdadapt._recipes import quant as Q


def main() -> None:
    dev, rows, cols, b = "cuda", 4096, 4096, 128
    w, s = Q.quantize_fp8(torch.randn(rows, cols), (b, b), "float32")
    w, s = w.to(dev), s.to(dev)
    ref = Q.dequantize_fp8(w, s, (b, b), "float32", torch.bfloat16)
    dest = torch.empty(rows, cols, dtype=torch.bfloat16, device=dev)
    nr, nc = rows // b, cols // b
    blocks, sv = (nr, b, nc, b), s.view(nr, 1, nc, 1)

    def inplace() -> None:
        Q.dequantize_fp8_into(dest, w, s, (b, b), "float32")

    def f32_temp() -> None:
        wf = w.float()
        wf.view(blocks).mul_(sv)
        dest.copy_(wf)

    def mul_out() -> None:
        torch.mul(w.to(torch.bfloat16).view(blocks), sv, out=dest.view(blocks))

    def region() -> None:
        dest.copy_(Q.dequantize_fp8_region(w, s, (b, b), (0, 0), "float32", torch.bfloat16))

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for name, fn in [("inplace", inplace), ("f32-temp", f32_temp), ("mul-out", mul_out), ("region", region)]:
        fn()
        torch.cuda.synchronize()
        assert torch.equal(dest.view(torch.int16), ref.view(torch.int16)), name
        start.record()
        for _ in range(50):
            fn()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / 50
        print(f"{name}: {ms * 1000:.0f} us per 16 MiB band, {rows * cols / ms / 1e6:.0f} GB/s of FP8 bytes")
    pinned = torch.empty(rows * cols, dtype=torch.uint8, pin_memory=True)
    landing = torch.empty(rows * cols, dtype=torch.uint8, device=dev)
    torch.cuda.synchronize()
    start.record()
    for _ in range(20):
        landing.copy_(pinned, non_blocking=True)
    end.record()
    torch.cuda.synchronize()
    print(f"host-to-device from pinned memory: {rows * cols * 20 / start.elapsed_time(end) / 1e6:.1f} GB/s")


if __name__ == "__main__":
    main()
