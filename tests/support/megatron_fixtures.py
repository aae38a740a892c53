"""Megatron-Core checkpoints written by Megatron-Core itself, and what the tests check them against.

Run in the megatron venv (``scripts/megatron_venv.py``), never imported by the suite::

    python tests/support/megatron_fixtures.py OUT [NAME ...]

Each fixture ``NAME`` is a ``GPTModel`` built on CPU (``get_gpt_layer_local_spec``,
``use_cpu_initialization``), its parameters set from a seeded generator, and saved with
Megatron's own ``dist_checkpointing.save`` and the ``torch_dist`` strategy into ``OUT/NAME``,
with the state Megatron-LM's training loop saves beside the model (``args``, ``iteration``,
``checkpoint_version``, the content metadata). ``OUT/NAME.oracle.pt`` holds the model's own
``state_dict()`` (at TP 1: for a TP 2 fixture, Megatron's ``dist_checkpointing.load`` of the
written files into a TP 1 model) and, where it runs, Megatron's forward logits on fixed tokens.

Three things Megatron-Core 0.16.1 needs to run here without a GPU: ``torch.cuda.synchronize`` is a
no-op for the writer (its async writer calls it unconditionally); ``torch.cuda.current_device``
answers "cpu" and the dropout RNG tracker's ``fork`` is a null context for the forward; the forward
gets an explicit causal mask (its default mask is made on "cuda"). The CUDA call after the files are
written is ``save_state_dict_async_finalize``'s all-reduce of the failure count, on a tensor made on
``torch.cuda.current_device()``: answered "cpu" too. Without Transformer Engine its router
refers to a ``te_general_gemm`` that was never defined (``moe_utils.router_gating_linear``): set to
``None`` there, it takes its torch path. The legacy ``GroupedMLP`` asserts
that the ``grouped_gemm`` kernels are importable although saving never calls them: an empty module
stands in for them in ``grouped_gemm_util`` for the ``grouped`` fixture (whose oracle holds
no logits for that reason).

``verify_load`` (``python ... --load JOBS.json``, a list of ``{ckpt, tp, oracle, result}``) is the
other direction: Megatron's ``dist_checkpointing.load`` of checkpoints sdadapt wrote, each into a
``GPTModel`` at its TP degree (one group of gloo processes per degree, for all its jobs); each
rank's parameters compared bit for bit with its part of the oracle's state, and the logits with
the oracle's; the ranks' reports as JSON in ``result``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import types
from typing import Any

import torch
import torch.nn.functional as F

VOCAB, SEQ = 256, 64

FIXTURES: dict[str, dict[str, Any]] = {
    # Llama-shaped: GQA (4 heads, 2 query groups), SwiGLU, RMSNorm, rotary, untied output
    "dense": dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96, tied=False,
                  qk_layernorm=False, tp=1),
    # Qwen3-shaped dense (q/k norms), tied embeddings, written by 2 tensor-parallel ranks
    "dense_tp2": dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96, tied=True,
                      qk_layernorm=True, tp=2),
    # Qwen3-MoE-shaped: 4 experts, top 2, SequentialMLP, each expert under its own key (singleton_local_shards)
    "moe_sequential": dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96, tied=False,
                           qk_layernorm=True, tp=1, num_moe_experts=4, moe_ffn_hidden_size=32, grouped=False, singleton=True),
    # the legacy GroupedMLP (experts stacked under one key), a sigmoid router with its expert bias
    "moe_grouped": dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96, tied=False,
                        qk_layernorm=True, tp=1, num_moe_experts=4, moe_ffn_hidden_size=32, grouped=True, singleton=False,
                        expert_bias=True),
}

BENCH: dict[str, dict[str, Any]] = {
    # Llama-shaped, bf16, 1.31 GiB (bench/megatron_bench.py): Megatron's own initialisation, no oracle
    "bench_1g": dict(num_layers=24, hidden_size=1536, num_attention_heads=12, num_query_groups=4, ffn_hidden_size=4096,
                     tied=False, qk_layernorm=False, tp=1, vocab=32000, dtype="bfloat16"),
}


def _cpu_patches() -> None:
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # set only where Transformer Engine imports
        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]


def _fake_grouped_gemm() -> None:
    from megatron.core.transformer.moe import grouped_gemm_util

    if grouped_gemm_util.grouped_gemm is None:
        grouped_gemm_util.grouped_gemm = types.ModuleType("grouped_gemm")


def _dtype(spec: dict[str, Any]) -> torch.dtype:
    return getattr(torch, spec.get("dtype", "float32"))


def megatron_args(spec: dict[str, Any]) -> argparse.Namespace:
    """The model options as Megatron-LM's ``args`` names them (what its checkpoints record)."""
    moe = spec.get("num_moe_experts")
    return argparse.Namespace(
        num_layers=spec["num_layers"], hidden_size=spec["hidden_size"], ffn_hidden_size=spec["ffn_hidden_size"],
        num_attention_heads=spec["num_attention_heads"], group_query_attention=True, num_query_groups=spec["num_query_groups"],
        kv_channels=spec["hidden_size"] // spec["num_attention_heads"], padded_vocab_size=spec.get("vocab", VOCAB),
        max_position_embeddings=SEQ,
        normalization="RMSNorm", norm_epsilon=1e-6, swiglu=True, add_bias_linear=False, add_qkv_bias=False,
        untie_embeddings_and_output_weights=not spec["tied"], position_embedding_type="rope", rotary_base=10000,
        rotary_percent=1.0, rotary_interleaved=False, qk_layernorm=spec["qk_layernorm"],
        num_experts=moe, moe_ffn_hidden_size=spec.get("moe_ffn_hidden_size"), moe_router_topk=2 if moe else None,
        moe_grouped_gemm=bool(spec.get("grouped")), moe_router_enable_expert_bias=bool(spec.get("expert_bias")),
        moe_router_score_function="sigmoid" if spec.get("expert_bias") else "softmax", moe_layer_freq=1,
        tensor_model_parallel_size=spec["tp"], pipeline_model_parallel_size=1, expert_model_parallel_size=1,
        params_dtype=_dtype(spec), bf16=_dtype(spec) == torch.bfloat16, fp16=False,
    )


def build(spec: dict[str, Any]) -> Any:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = spec.get("num_moe_experts")
    extra: dict[str, Any] = {}
    if moe:
        if spec.get("grouped"):
            _fake_grouped_gemm()
        extra = dict(num_moe_experts=moe, moe_ffn_hidden_size=spec["moe_ffn_hidden_size"], moe_router_topk=2,
                     moe_grouped_gemm=bool(spec.get("grouped")), moe_use_legacy_grouped_gemm=bool(spec.get("grouped")),
                     moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0,
                     moe_router_enable_expert_bias=bool(spec.get("expert_bias")),
                     moe_router_score_function="sigmoid" if spec.get("expert_bias") else "softmax")
    config = TransformerConfig(
        num_layers=spec["num_layers"], hidden_size=spec["hidden_size"], num_attention_heads=spec["num_attention_heads"],
        num_query_groups=spec["num_query_groups"], ffn_hidden_size=spec["ffn_hidden_size"], normalization="RMSNorm",
        layernorm_epsilon=1e-6, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        qk_layernorm=spec["qk_layernorm"], use_cpu_initialization=True, bias_activation_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=_dtype(spec),
        tensor_model_parallel_size=spec["tp"], sequence_parallel=False, **extra,
    )
    layer_spec = get_gpt_layer_local_spec(num_experts=moe, moe_grouped_gemm=bool(spec.get("grouped")),
                                          qk_layernorm=spec["qk_layernorm"], normalization="RMSNorm",
                                          moe_use_legacy_grouped_gemm=bool(spec.get("grouped")))
    return GPTModel(config, layer_spec, vocab_size=spec.get("vocab", VOCAB), max_sequence_length=SEQ, position_embedding_type="rope",
                    rotary_base=10000, share_embeddings_and_output_weights=spec["tied"])


def randomize(model: Any, seed: int) -> None:
    """Every parameter and the router's expert bias from one seeded generator (norms around 1), the
    same on every TP rank for the full tensor, each rank keeping its own rows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in sorted(model.state_dict(keep_vars=True).items()):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                continue
            full = _full_shape(model, name, t)
            value = torch.randn(full, generator=g) * (0.1 if "norm" in name else 0.05)
            if "norm" in name:
                value += 1.0
            t.copy_(_local_part(model, name, value, t))


def _full_shape(model: Any, name: str, t: torch.Tensor) -> tuple[int, ...]:
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    mod = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
    shape = list(t.shape)
    if tp > 1 and name.endswith("weight") and hasattr(mod, "partition_dim") is False:
        pass
    axis = _tp_axis(mod, name)
    if axis is not None:
        shape[axis] *= tp
    return tuple(shape)


def _tp_axis(mod: Any, name: str) -> int | None:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    if not name.endswith(".weight"):
        return None
    if isinstance(mod, (ColumnParallelLinear, VocabParallelEmbedding)):
        return 0
    if isinstance(mod, RowParallelLinear):
        return 1
    return None


def _local_part(model: Any, name: str, value: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state

    mod = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
    axis = _tp_axis(mod, name)
    if axis is None:
        return value
    rank = parallel_state.get_tensor_model_parallel_rank()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    n = value.shape[axis] // tp
    if name.endswith("linear_fc1.weight") and value.shape[axis] % 2 == 0 and "router" not in name:
        # gate and up each split per rank ([gate_r; up_r] on rank r)
        gate, up = value.chunk(2, axis)
        h = gate.shape[axis] // tp
        return torch.cat([gate.narrow(axis, rank * h, h), up.narrow(axis, rank * h, h)], axis)
    if name.endswith("linear_qkv.weight"):
        pass  # query groups are contiguous blocks of rows: a plain split gives each rank its groups
    return value.narrow(axis, rank * n, n)


def logits_of(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.get_cuda_rng_tracker()
    tracker.fork = lambda *a, **k: contextlib.nullcontext()  # type: ignore[method-assign]
    s = tokens.shape[1]
    mask = torch.triu(torch.ones(s, s), 1).bool()[None, None]
    pos = torch.arange(s)[None].expand_as(tokens)
    model.eval()
    with torch.no_grad():
        out = model(tokens, pos, mask)
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    return gather_from_tensor_model_parallel_region(out).contiguous()


def _init(rank: int, world: int, port: int, tp: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(tp, 1)
    try:
        model_parallel_cuda_manual_seed(0)
    except Exception:  # noqa: BLE001 - its CUDA generator is not needed on CPU
        pass


def state_of(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor) and "_extra_state" not in k}


def save_megatron(model: Any, spec: dict[str, Any], dst: str) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    metadata = {"singleton_local_shards": bool(spec.get("singleton"))}
    state = {"model": model.sharded_state_dict(metadata=metadata), "args": megatron_args(spec), "iteration": 7,
             "checkpoint_version": 3.0}
    os.makedirs(dst, exist_ok=True)
    dist_checkpointing.save(state, dst, sharded_strategy=TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1),
                            content_metadata=metadata)


def load_megatron(model: Any, spec: dict[str, Any], src: str) -> None:
    from megatron.core import dist_checkpointing

    metadata = {"singleton_local_shards": bool(spec.get("singleton"))}
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict(metadata=metadata)}, src)
    model.load_state_dict(loaded["model"], strict=False)


def _write_rank(rank: int, world: int, port: int, name: str, out: str) -> None:
    spec = FIXTURES[name]
    _cpu_patches()
    _init(rank, world, port, spec["tp"])
    model = build(spec)
    randomize(model, seed=sum(map(ord, name)))
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    logits = None if spec.get("grouped") else logits_of(model, tokens)
    save_megatron(model, spec, os.path.join(out, name))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    if rank == 0:
        oracle: dict[str, Any] = {"tokens": tokens, "logits": logits, "spec": spec}
        if spec["tp"] == 1:
            oracle["state"] = state_of(model)
        torch.save(oracle, os.path.join(out, f"{name}.oracle.pt"))


def write_bench(out: str, name: str) -> None:
    """The bench's checkpoint ``BENCH[name]``, saved by Megatron into ``out`` from one process."""
    spec = BENCH[name]
    _cpu_patches()
    _init(0, 1, _free_port(), 1)
    model = build(spec)
    save_megatron(model, spec, out)
    torch.distributed.destroy_process_group()


def _oracle_tp1(rank: int, world: int, port: int, name: str, out: str) -> None:
    """A TP 1 model loaded by Megatron from a TP 2 fixture: its state is the oracle's."""
    spec = dict(FIXTURES[name], tp=1)
    _cpu_patches()
    _init(0, 1, port, 1)
    model = build(spec)
    load_megatron(model, spec, os.path.join(out, name))
    path = os.path.join(out, f"{name}.oracle.pt")
    oracle = torch.load(path, weights_only=False)
    oracle["state"] = state_of(model)
    oracle["logits_tp1"] = logits_of(model, oracle["tokens"])
    torch.save(oracle, path)
    torch.distributed.destroy_process_group()


def _spawned(rank: int, world: int, port: int, fn: Any, *args: Any) -> None:
    fn(rank, world, port, *args)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PRELOAD = ("megatron.core.models.gpt", "megatron.core.models.gpt.gpt_layer_specs", "megatron.core.parallel_state",
            "megatron.core.transformer.transformer_config", "megatron.core.dist_checkpointing",
            "megatron.core.dist_checkpointing.strategies.torch", "megatron.core.tensor_parallel")
"""Megatron-Core's modules the ranks use, imported before they are forked."""


def _group(fn: Any, world: int, *args: Any) -> None:
    """``fn(rank, world, port, *args)`` on ``world`` new gloo ranks, forked from this process with
    torch and Megatron-Core already imported (an import each costs seconds of CPU); this process
    itself never joins a process group, so the ranks start from a clean state."""
    import torch.multiprocessing as mp

    _cpu_patches()
    for name in _PRELOAD:
        importlib.import_module(name)
    mp.start_processes(_spawned, args=(world, _free_port(), fn, *args), nprocs=world, join=True, start_method="fork")


def write(out: str, names: list[str]) -> None:
    for name in names:
        tp = FIXTURES[name]["tp"]
        _group(_write_rank, tp, name, out)
        if tp > 1:
            _group(_oracle_tp1, 1, name, out)


def _verify_rank(rank: int, world: int, port: int, jobs: list[list[str]]) -> None:
    """Every job of this TP degree in one group of processes: Megatron's load of ``ckpt`` into a
    fresh ``GPTModel`` of the oracle's shape, compared with the oracle."""
    _cpu_patches()
    _init(rank, world, port, world)
    for ckpt, oracle_path, result in jobs:
        oracle = torch.load(oracle_path, weights_only=False)
        spec = dict(oracle["spec"], tp=world)
        model = build(spec)
        with torch.no_grad():
            for t in model.parameters():
                t.zero_()
        load_megatron(model, spec, ckpt)
        logits = None if spec.get("grouped") else logits_of(model, oracle["tokens"])
        got = state_of(model)
        want = {k: _local_part(model, k, v, got[k]) if k in got else v for k, v in oracle["state"].items()}
        report: dict[str, Any] = {
            "keys_equal": sorted(got) == sorted(want),
            "unequal": sorted(k for k in want if k not in got or not torch.equal(got[k], want[k])),
        }
        if logits is not None:
            ref = oracle.get("logits_tp1", oracle["logits"])
            report["logits_max_diff"] = float((logits - ref).abs().max())
        reports: list[Any] = [None] * world
        torch.distributed.all_gather_object(reports, report)
        if rank == 0:
            with open(result, "w") as f:
                json.dump(reports, f)
    torch.distributed.destroy_process_group()


def verify_load(jobs: list[dict[str, Any]]) -> None:
    """Megatron's load of each job's ``ckpt`` at its ``tp``; one group of processes per TP degree."""
    for tp in sorted({int(j["tp"]) for j in jobs}):
        _group(_verify_rank, tp, [[j["ckpt"], j["oracle"], j["result"]] for j in jobs if int(j["tp"]) == tp])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?")
    ap.add_argument("names", nargs="*")
    ap.add_argument("--load", metavar="JOBS_JSON", help="[{ckpt, tp, oracle, result}, ...]: Megatron loads each ckpt")
    ap.add_argument("--bench", metavar="NAME", help="write BENCH[NAME] into OUT (the checkpoint folder itself)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.bench:
        write_bench(args.out, args.bench)
        return
    if args.load:
        with open(args.load) as f:
            verify_load(json.load(f))
        return
    write(args.out, args.names or list(FIXTURES))


if __name__ == "__main__":
    main()
