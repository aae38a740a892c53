"""What the ranks' agreement costs (issue 65): bytes per rank and time at 2, 4 and 8 gloo ranks.

Each rank builds the intent of a load of a Llama-like plan (``--layers`` decoder layers of 9
keys, the adapter of ``sdadapt.get_adapter("llama")``), then times, ``--repeat`` times, the
digest alone and one whole agreement (digests + the one all-reduce). Bytes per rank are the
all-reduce's tensor (``agreement_bytes``), whatever the world size.

    python bench/agreement_bench.py --ranks 2 4 8 --layers 32 --repeat 50
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sdadapt._base.agreement import agree_on, agreement_bytes, digest
from sdadapt._plan.intent import PARTS, intent
from sdadapt._recipes.nodes import Leaf


def _plan(layers: int) -> dict[str, Leaf]:
    keys = {"tok_embeddings.weight": (128256, 4096), "norm.weight": (4096,), "output.weight": (128256, 4096)}
    for i in range(layers):
        p = f"layers.{i}."
        keys |= {p + "attention.wq.weight": (4096, 4096), p + "attention.wk.weight": (1024, 4096),
                 p + "attention.wv.weight": (1024, 4096), p + "attention.wo.weight": (4096, 4096),
                 p + "feed_forward.w1.weight": (14336, 4096), p + "feed_forward.w2.weight": (4096, 14336),
                 p + "feed_forward.w3.weight": (14336, 4096), p + "attention_norm.weight": (4096,),
                 p + "ffn_norm.weight": (4096,)}  # fmt: skip
    return {k: Leaf(k, shape, torch.bfloat16) for k, shape in keys.items()}


def _rank(rank: int, world: int, init: str, layers: int, repeat: int, out: dict) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    import sdadapt

    adapter = sdadapt.get_adapter("llama", n_heads=32, n_kv_heads=8, dim=4096)
    plan = _plan(layers)
    digests, agreements = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        parts = intent(adapter, plan, strict=True)
        for n in PARTS:
            digest(parts[n])
        digests.append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        agree_on(intent(adapter, plan, strict=True), None, what="bench")
        agreements.append(time.perf_counter() - t0)
    if rank == 0:
        out[world] = (len(plan), statistics.median(digests), statistics.median(agreements))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=50)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"bytes per rank in the all-reduce: {agreement_bytes(len(PARTS))} (any world size)")
    print("| ranks | plan keys | digest (median) | whole agreement (median) |")
    print("|---|---|---|---|")
    with mp.Manager() as manager:
        out = manager.dict()
        for world in args.ranks:
            init = f"file://{tempfile.mktemp(prefix='sdadapt-agree-')}"
            mp.spawn(_rank, args=(world, init, args.layers, args.repeat, out), nprocs=world, join=True)
            keys, dig, whole = out[world]
            print(f"| {world} | {keys} | {dig * 1e3:.2f} ms | {whole * 1e3:.2f} ms |", flush=True)


if __name__ == "__main__":
    main()
