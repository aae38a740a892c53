"""One GPT-OSS MoE layer's experts (MXFP4, gate/up rows alternating) loaded with the shipped
``gpt_oss`` expert rules into a plain bf16 module on the CPU: first load in this process, then
steady repeats (torch.distributed.checkpoint and sdadapt's loading modules imported before
anything is timed), next to the whole-tensor dequantisation of the same bytes (the arithmetic alone).

    python bench/gpt_oss_bench.py --experts 4 --intermediate 2880 --hidden 2880

(GPT-OSS-20B's layer: 32 experts of 2880 x 2880; 4 experts is one rank's FSDP shard of 8.)
"""

from __future__ import annotations

import argparse
import importlib
import os
import tempfile
import time

import torch
from safetensors.torch import load_file, save_file
from sdadapt.adapters import gpt_oss

import sdadapt
from sdadapt._recipes.quant import dequantize_mxfp4, quantize_mxfp4

PREFIX = "model.layers.0.mlp.experts."


def write_layer(path: str, experts: int, f: int, d: int) -> None:
    g = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in (("gate_up_proj", (experts, 2 * f, d)), ("down_proj", (experts, d, f))):
        blocks, scales = quantize_mxfp4(torch.randn(*shape, generator=g))
        tensors[PREFIX + name + "_blocks"], tensors[PREFIX + name + "_scales"] = blocks, scales
    tensors[PREFIX + "gate_up_proj_bias"] = torch.randn(experts, 2 * f, generator=g).bfloat16()
    tensors[PREFIX + "down_proj_bias"] = torch.randn(experts, d, generator=g).bfloat16()
    save_file(tensors, path)


class Experts(torch.nn.Module):
    def __init__(self, experts: int, f: int, d: int):
        super().__init__()

        def p(*shape: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.empty(*shape, dtype=torch.bfloat16))

        self.w1, self.w3, self.w2 = p(experts, f, d), p(experts, f, d), p(experts, d, f)
        self.b1, self.b3, self.b2 = p(experts, f), p(experts, f), p(experts, d)


class Model(torch.nn.Module):
    """``layers.0.moe.experts.*``, as the adapter's target names them."""

    def __init__(self, experts: int, f: int, d: int):
        super().__init__()
        layer = torch.nn.Module()
        layer.moe = torch.nn.Module()
        layer.moe.experts = Experts(experts, f, d)
        self.layers = torch.nn.ModuleList([layer])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=2880)
    p.add_argument("--hidden", type=int, default=2880)
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        write_layer(os.path.join(tmp, "model.safetensors"), a.experts, a.intermediate, a.hidden)
        adapter = sdadapt.Adapter(gpt_oss.expert_rules(a.intermediate, "mxfp4", "bfloat16"))
        model = Model(a.experts, a.intermediate, a.hidden)
        importlib.import_module("torch.distributed.checkpoint")  # the libraries, imported before anything is timed
        assert callable(sdadapt.load)  # sdadapt imports its loading modules on first use
        print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {torch.get_num_threads()} intra-op threads")
        print(f"experts {a.experts}, intermediate {a.intermediate}, hidden {a.hidden}")
        for i in range(1 + a.repeat):
            t = time.perf_counter()
            report = sdadapt.load(model, tmp, adapter)
            label = "first load" if i == 0 else f"steady {i}"
            print(f"{label}: {time.perf_counter() - t:.3f} s ({report.items_read} regions, {report.bytes_read / 2**20:.1f} MiB read)")
        raw = load_file(os.path.join(tmp, "model.safetensors"))
        t = time.perf_counter()
        for name in ("gate_up_proj", "down_proj"):
            dequantize_mxfp4(raw[PREFIX + name + "_blocks"], raw[PREFIX + name + "_scales"], torch.bfloat16)
        print(f"whole-tensor dequantisation alone (already in memory): {time.perf_counter() - t:.3f} s")


if __name__ == "__main__":
    main()
