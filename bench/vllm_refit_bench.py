"""Refit into a live vLLM engine: the sdadapt backend against vLLM's ``load_weights`` path.

Run in the vLLM venv (``python scripts/vllm_venv.py`` prints its python):

    VLLM_CPU_KVCACHE_SPACE=1 $VLLM_PY bench/vllm_refit_bench.py --sizes 256x2 1024x8 --runs 5 --out rows.jsonl

For each size (``hidden x layers``; head_dim 64, 4 KV heads at most, vocabulary 32000 for the
larger) one engine (TP ``--tp``, default 1, bfloat16; each engine rank's bytes and the slowest
rank's worker time are reported) starts with ``weight_transfer_config={"backend": "sdadapt"}``; the
trainer is transformers' Llama in float32 in this process (world 1), its weights changed in place
before each run. Per run:

- ``sdadapt``: ``sdadapt.vllm.connect(...)`` once, then each ``refit()``: the trainer's move into the
  engine's shared-memory staging (cast to bfloat16 on the way; ``RefitReport.seconds``) and the
  engine's update (``start_weight_update`` / ``update_weights`` / ``finish_weight_update``: vLLM's
  layerwise reload with its post-processing), timed apart;
- ``load_weights``: what verl and OpenRLHF do without a weight-transfer backend: the full HF tensors
  (bfloat16) handed to the worker (here serialized with ``torch.save`` through ``collective_rpc``:
  a colocated trainer hands them over in-process or by CUDA IPC, so ``step_s`` includes copies they
  do not pay; ``engine_update_s`` is the worker's part alone), then vLLM's layerwise reload and
  ``model.load_weights`` over them.

vLLM's own backends (``nccl``, ``ipc``, ``sparse_nccl``, ``sharded_rdt``, ``nccl_m2n``) need CUDA and
do not run on a CPU machine. Prints one JSON line per size and path (median seconds, bytes per
engine rank) to ``--out``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import tempfile
import time

import torch


def worker_load_weights(self, blob: bytes) -> float:
    """In the worker: vLLM's layerwise reload around ``model.load_weights`` of full HF tensors
    (``blob``: ``torch.save`` of them, unpacked here)."""
    import io

    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    weights = list(torch.load(io.BytesIO(blob)).items())
    t0 = time.perf_counter()
    model = self.model_runner.get_model()
    with set_current_vllm_config(self.vllm_config), torch.no_grad():
        initialize_layerwise_reload(model)
        model.load_weights(iter(weights))
        finalize_layerwise_reload(model, self.vllm_config.model_config)
    return time.perf_counter() - t0


def bench_size(hidden: int, layers: int, runs: int, tp: int = 1) -> list[dict]:
    import transformers
    from sdadapt.adapters import vllm_llama
    from vllm import LLM

    import sdadapt.vllm

    heads = hidden // 64
    kv = min(4, heads)
    vocab = 300 if hidden <= 256 else 32000
    inter = hidden * 2 if hidden <= 256 else int(hidden * 2.75)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                                      num_attention_heads=heads, num_key_value_heads=kv, head_dim=64, max_position_embeddings=256,
                                      tie_word_embeddings=False)  # fmt: skip
    folder = tempfile.mkdtemp(prefix="sdadapt-vllm-bench-")
    torch.manual_seed(0)
    trainer = transformers.LlamaForCausalLM(config)
    trainer.to(torch.bfloat16).save_pretrained(folder)
    trainer.float()
    llm = LLM(model=folder, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, max_model_len=128,
              tensor_parallel_size=tp, gpu_memory_utilization=0.05, weight_transfer_config={"backend": "sdadapt"})  # fmt: skip
    adapter = vllm_llama.from_config(config, tp=tp)
    size = sum(p.numel() for p in trainer.parameters())

    def nudge() -> None:
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(1e-3)

    base, post = [], []
    for _ in range(runs):
        nudge()
        t0 = time.perf_counter()
        buf = io.BytesIO()
        torch.save({k: v.detach().bfloat16() for k, v in trainer.state_dict().items()}, buf)
        inside = max(llm.collective_rpc(worker_load_weights, args=(buf.getvalue(),)))
        base.append(time.perf_counter() - t0)
        post.append(inside)
    rows = []
    rows.append(dict(path="load_weights", tp=tp, hidden=hidden, layers=layers, params=size, step_s=round(statistics.median(base), 3),
                     engine_update_s=round(statistics.median(post), 3),
                     bytes_per_engine_rank=sum(v.numel() * 2 for v in trainer.state_dict().values())))  # fmt: skip
    t0 = time.perf_counter()
    refit = sdadapt.vllm.connect(trainer, llm, adapter, vllm_llama.layout)
    connect_s = time.perf_counter() - t0

    total, move, engine_s, moved = [], [], [], 0
    for _ in range(runs):
        nudge()
        t0 = time.perf_counter()
        reps = refit()
        total.append(time.perf_counter() - t0)
        move.append(sum(r.seconds for r in reps))
        engine_s.append(total[-1] - move[-1])
        moved = max(r.bytes_received + r.bytes_local for r in reps)
    rows.append(dict(path="sdadapt", tp=tp, hidden=hidden, layers=layers, params=size, connect_s=round(connect_s, 3),
                     step_s=round(statistics.median(total), 3), trainer_move_s=round(statistics.median(move), 3),
                     engine_update_s=round(statistics.median(engine_s), 3), bytes_per_engine_rank=moved))  # fmt: skip
    del llm
    shutil.rmtree(folder, ignore_errors=True)  # the checkpoint the engine started from
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["256x2", "1024x8"], help="hidden x layers")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tp", type=int, default=1, help="the engine's TP degree (the trainer, one process, writes every rank)")
    ap.add_argument("--out", required=True, help="append the JSON rows here (vLLM logs to stdout)")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the load_weights path ships a function to the worker
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # TP > 1 on a machine of one NUMA node
    for s in args.sizes:
        hidden, layers = (int(x) for x in s.split("x"))
        rows = bench_size(hidden, layers, args.runs, args.tp)
        with open(args.out, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)


if __name__ == "__main__":
    main()
