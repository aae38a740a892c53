"""Quantizing a Llama's decoder weights on one GPU: the eager functions against the one-pass kernels.

    python bench/quant_kernel_bench.py [--size 8b|1b] [--repeat 5] [--formats fp8_block,fp8_channel,...]

The decoder weights of the size (float32, vLLM's fused layout: qkv, o, gate_up, down per layer)
are quantized tensor by tensor, as a refit or an export does, in each format: ``fp8_block``
(e4m3, float32 128 x 128 scales, ``quant.quantize_fp8``: what ``vllm_fp8`` refits), ``fp8_channel``
and ``fp8_tensor`` (compressed-tensors FP8 per channel / per tensor), ``mxfp8`` (e8m0 per 32) and
``nvfp4`` (e2m1, e4m3 per 16, a global scale). ``eager`` times the eager functions, ``fused``
``quant_fused`` (which takes a kernel only where it gave the eager bytes on a sample), both as the
refit calls them: once for the codes, once for the scales alone. Every tensor's codes and scales
are compared byte for byte between the two. Prints a table; times are CUDA-synchronised wall
clock, median of ``--repeat`` (eager: of ``--eager-repeat``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from sdadapt._recipes import quant as Q  # noqa: E402
from sdadapt._recipes import quant_fused as QF  # noqa: E402
from sdadapt._recipes import quant_scaled as S  # noqa: E402

SIZES = {"8b": (32, 4096, 14336, 32, 8), "1b": (16, 2048, 8192, 32, 8)}  # layers, dim, hidden, heads, kv heads


def shapes(size: str) -> list[tuple[int, int]]:
    layers, dim, hidden, heads, kv = SIZES[size]
    hd = dim // heads
    one = [((heads + 2 * kv) * hd, dim), (dim, dim), (2 * hidden, dim), (dim, hidden)]
    return one * layers


def run_format(name: str, xs: list[torch.Tensor], globs: list[torch.Tensor], fused: bool) -> list[tuple[torch.Tensor | None, ...]]:
    out: list[tuple[torch.Tensor | None, ...]] = []
    for x, g in zip(xs, globs, strict=True):
        rows, cols = x.shape
        if name == "fp8_block":
            if fused:
                q, _ = QF.quantize_fp8(x, (128, 128), "float32")
                _, s = QF.quantize_fp8(x, (128, 128), "float32", values=False)
            else:
                q, _ = Q.quantize_fp8(x, (128, 128), "float32")
                _, s = Q.quantize_fp8(x, (128, 128), "float32")
            out.append((q, s))
            continue
        codec, block, sdt, glob = {
            "fp8_channel": ("e4m3", (1, cols), torch.float32, None),
            "fp8_tensor": ("e4m3", (rows, cols), torch.float32, None),
            "mxfp8": ("e4m3", (1, 32), torch.uint8, None),
            "nvfp4": ("e2m1", (1, 16), Q.FP8_DTYPE, g),
        }[name]
        if fused:
            q = QF.quantize_scaled(x, codec, block, sdt, glob=glob)[0]
            s = QF.quantize_scaled(x, codec, block, sdt, glob=glob, values=False)[1]
        else:
            q = S.quantize(x, codec, block, sdt, glob=glob)[0]
            s = S.quantize(x, codec, block, sdt, glob=glob)[1]
        out.append((q, s))
    return out


def timed(fn, repeat: int) -> tuple[float, list[float], object]:  # noqa: ANN001
    runs, res = [], None
    for _ in range(repeat):
        res = None
        torch.cuda.synchronize()
        t = time.perf_counter()
        res = fn()
        torch.cuda.synchronize()
        runs.append(time.perf_counter() - t)
    return statistics.median(runs), runs, res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="8b")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--eager-repeat", type=int, default=1)
    p.add_argument("--formats", default="fp8_block,fp8_channel,fp8_tensor,mxfp8,nvfp4")
    args = p.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    xs = [torch.randn(s, device=dev) * 0.02 for s in shapes(args.size)]
    globs = [(448.0 * 6.0 / x.abs().amax()).reshape(1) for x in xs]
    nbytes = sum(x.numel() * 4 for x in xs)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {len(xs)} float32 tensors, {nbytes / 2**30:.2f} GiB")
    print("| format | eager s | fused s (median) | fused runs | eager / fused | float32 read, GiB/s | bytes equal |")
    print("|---|---|---|---|---|---|---|")
    for name in args.formats.split(","):
        run_format(name, xs[:4], globs[:4], True)  # the kernels built and checked against the eager bits
        torch.cuda.synchronize()
        fm, fruns, fres = timed(lambda n=name: run_format(n, xs, globs, True), args.repeat)
        em, _, eres = timed(lambda n=name: run_format(n, xs, globs, False), args.eager_repeat)
        equal = all(QF._same(a, b) for fr, er in zip(fres, eres, strict=True) for a, b in zip(fr, er, strict=True))
        used = sorted({k[1] for k, ok in QF._checked.items() if ok})
        print(f"| {name} | {em:.4f} | {fm:.4f} | {', '.join(f'{r:.4f}' for r in fruns)} | {em / fm:.1f}x | "
              f"{nbytes / fm / 2**30:.0f} | {equal} (kernels used: {used}) |", flush=True)
        del fres, eres
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
