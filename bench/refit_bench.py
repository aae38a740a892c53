"""Refit benchmark: ``sdadapt.refit_plan`` against gather-then-cut (``export_iter`` + slicing).

    python bench/refit_bench.py [--model llama|qwen3_moe] [--scenario disaggregated|colocated|single]
                                [--size small|8b] [--repeat 3] [--bucket-mib 64] [--engine-dtype bfloat16]
                                [--device cpu|cuda] [--fp8 | --quant FORMAT] [--layers N] [--no-baseline]
                                [--baseline-repeat N] [--hang-s 300] [--profile N [--trace FILE]] [--cprofile N]

Scenarios (CPU, gloo, one process per rank, started here):

- ``disaggregated``: 4 processes; ranks 0,1 hold the trainer (float32, ``Shard(0)`` over a mesh of
  the two, FSDP2's placements), ranks 2,3 a vLLM-layout engine with TP 2 (``--engine-dtype``).
  Baseline: the trainer ranks run ``export_iter`` over their group (every tensor gathered whole on
  both), rank 0 casts each to the engine's dtype and sends it whole to each engine rank, which
  cuts its shard with the adapter's recipe.
- ``colocated``: 2 processes, each a trainer shard (FSDP over both) and an engine TP rank.
  Baseline: ``export_iter`` on both, each rank cuts its shard from the whole tensors.
- ``single``: 1 process (a world of 1: NCCL with ``--device cuda``, else gloo), trainer float32
  and engine TP 1 on the same device; with ``--device cuda``, also against a device-to-device
  copy of the same bytes.

On a GPU machine without sdadapt installed, its dependencies (pydantic, pydantic_core,
annotated_types, typing_inspection) must be importable there (wheels installed with ``pip
install --no-index --target``); ``sdadapt.adapters`` is found beside ``src/`` without installing.

``--fp8``: the engine serves vLLM's block-quantized FP8 (``vllm_fp8``: e4m3 weights and float32
``weight_scale_inv`` per 128 x 128 block, quantized on the engine ranks; embeddings, head and
norms in ``--engine-dtype``). ``--quant FORMAT``: the engine's linear weights in one of
``tests/support/refit_eager.py``'s ``QUANT_FORMATS`` (``fp8_block``, the same as ``--fp8``;
``fp8_channel``, ``fp8_tensor``, ``mxfp8``, ``nvfp4``: compressed-tensors' arithmetic, Llama and
``--scenario single`` only). ``--layers``: fewer decoder layers than the size has (a quick
run). ``--profile N``: one more refit under torch's profiler; rank 0 prints its N costliest
operations (by GPU time, then by CPU time); ``--trace FILE`` also writes its Chrome trace.
``--cprofile N``: one more refit under Python's ``cProfile`` (the host's work, which the GPU
waits on where it is the larger); rank 0 prints its N costliest functions by own time. Rank 0
prints each phase's start on stderr with the time since launch; a phase that hangs dumps every
thread's stack after ``--hang-s`` seconds.

Each refit is planned once, then run ``--repeat`` times (the median and every run are printed);
the baseline likewise. After each, every engine tensor is compared bit for bit with the other
method's. Bytes: what each rank sent and received (refit: its report; baseline: the gathers'
bytes received, ``(W - 1) / W`` of each tensor, plus the whole tensors sent). Prints a Markdown
table and one JSON line per scenario.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "src"), os.path.join(ROOT, "tests")]

from support.models import module_of  # noqa: E402

import sdadapt  # noqa: E402

if not os.path.isdir(os.path.join(os.path.dirname(sdadapt.__file__), "adapters")):
    try:
        import sdadapt.adapters  # noqa: F401 - installed (setup.py maps adapters/ to it)
    except ModuleNotFoundError:  # src/ on the path, not installed: adapters/ beside it is the package
        sdadapt.__path__.append(ROOT)

SIZES = {
    "small": dict(layers=4, dim=512, heads=8, kv=4, head_dim=64, hidden=1408, vocab=32000, experts=8, moe_hidden=256),
    "8b": dict(layers=32, dim=4096, heads=32, kv=8, head_dim=128, hidden=14336, vocab=128256, experts=8, moe_hidden=1024),
}


def weights(model: str, s: dict[str, int], device: str) -> dict[str, torch.Tensor]:
    """The trainer's full weights (float32): HF layout for llama, torchtitan layout for qwen3_moe;
    on the meta device: the shapes only."""
    if device == "meta":
        r = lambda *shape: torch.empty(*shape, device="meta")  # noqa: E731
    else:
        g = torch.Generator(device=device).manual_seed(0)
        r = lambda *shape: torch.randn(*shape, generator=g, device=device) * 0.02  # noqa: E731
    d, q, kv, h = s["dim"], s["heads"] * s["head_dim"], s["kv"] * s["head_dim"], s["hidden"]
    if model == "llama":
        sd = {"model.embed_tokens.weight": r(s["vocab"], d), "model.norm.weight": r(d), "lm_head.weight": r(s["vocab"], d)}
        for i in range(s["layers"]):
            p = f"model.layers.{i}."
            sd |= {p + "self_attn.q_proj.weight": r(q, d), p + "self_attn.k_proj.weight": r(kv, d),
                   p + "self_attn.v_proj.weight": r(kv, d), p + "self_attn.o_proj.weight": r(d, q),
                   p + "mlp.gate_proj.weight": r(h, d), p + "mlp.up_proj.weight": r(h, d), p + "mlp.down_proj.weight": r(d, h),
                   p + "input_layernorm.weight": r(d), p + "post_attention_layernorm.weight": r(d)}  # fmt: skip
        return sd
    e, m = s["experts"], s["moe_hidden"]
    sd = {"tok_embeddings.weight": r(s["vocab"], d), "norm.weight": r(d), "output.weight": r(s["vocab"], d)}
    for i in range(s["layers"]):
        p = f"layers.{i}."
        sd |= {p + "attention.wq.weight": r(q, d), p + "attention.wk.weight": r(kv, d), p + "attention.wv.weight": r(kv, d),
               p + "attention.wo.weight": r(d, q), p + "attention.q_norm.weight": r(s["head_dim"]),
               p + "attention.k_norm.weight": r(s["head_dim"]), p + "attention_norm.weight": r(d), p + "ffn_norm.weight": r(d),
               p + "moe.router.gate.weight": r(e, d), p + "moe.experts.w1": r(e, m, d), p + "moe.experts.w3": r(e, m, d),
               p + "moe.experts.w2": r(e, d, m)}  # fmt: skip
    return sd


def adapter(model: str, s: dict[str, int], tp: int, fp8: bool = False, quant: str = "") -> sdadapt.Adapter:
    from sdadapt.adapters import vllm_fp8, vllm_llama, vllm_qwen3_moe
    from support.refit_eager import quant_adapter

    if model == "llama":
        ad = vllm_llama.build(n_heads=s["heads"], n_kv_heads=s["kv"], head_dim=s["head_dim"], hidden_dim=s["hidden"], tp=tp)
    else:
        to_hf = sdadapt.get_adapter("qwen3_moe", n_experts=s["experts"]).inverse()
        ad = to_hf + vllm_qwen3_moe.build(n_heads=s["heads"], n_kv_heads=s["kv"], head_dim=s["head_dim"],
                                          moe_hidden_dim=s["moe_hidden"], n_experts=s["experts"], tp=tp)  # fmt: skip
    if quant and quant != "fp8_block":
        return ad + quant_adapter(quant)
    return ad + vllm_fp8.build() if fp8 else ad


def engine_of(model: str, s: dict[str, int], tp: int, dtype: torch.dtype, device: str, fp8: bool = False) -> dict[str, torch.Tensor]:
    from sdadapt.adapters import vllm_fp8, vllm_llama, vllm_qwen3_moe

    common = dict(n_layers=s["layers"], vocab_size=s["vocab"], dim=s["dim"], n_heads=s["heads"], n_kv_heads=s["kv"],
                  head_dim=s["head_dim"], tp=tp)  # fmt: skip
    if model == "llama":
        shapes = vllm_llama.parameter_shapes(hidden_dim=s["hidden"], **common)
    else:
        shapes = vllm_qwen3_moe.parameter_shapes(moe_hidden_dim=s["moe_hidden"], n_experts=s["experts"], **common)
    if not fp8:
        return {k: torch.zeros(v, dtype=dtype, device=device) for k, v in shapes.items()}
    shapes = vllm_fp8.parameter_shapes(shapes)
    q = vllm_fp8.quantized(shapes)
    out = {}
    for k, v in shapes.items():
        d = torch.float8_e4m3fn if k in q else torch.float32 if k.endswith(vllm_fp8.SCALE_SUFFIX) else dtype
        out[k] = torch.zeros(v, dtype=d, device=device)
    return out


def layout_of(model: str, tp: int, rank: int, fp8: bool = False):  # noqa: ANN201
    from sdadapt.adapters import vllm_fp8, vllm_llama, vllm_qwen3_moe

    base = (vllm_llama if model == "llama" else vllm_qwen3_moe).layout(tp, rank)
    return vllm_fp8.layout(base) if fp8 else base  # FP8: scales cut as their weights, whole blocks per rank


class _Dict:
    def __init__(self, sd: dict[str, torch.Tensor]):
        self.sd = sd

    def read(self, key, box):  # noqa: ANN001, ANN201
        return self.sd[key][tuple(slice(a, b) for a, b in box)]


def cut(recipes, layout, engine, whole: dict[str, torch.Tensor], done: set[str]) -> None:  # noqa: ANN001
    """The baseline's receiving side: every engine tensor whose inputs are all in ``whole`` is cut
    from them (its recipe read over its box) and its inputs no later tensor needs are dropped."""
    io = _Dict(whole)
    for k, node in recipes.items():
        if k in done or k not in engine or not set(node.leaves()) <= set(whole):
            continue
        _, box = layout(k, engine[k])
        engine[k].copy_(node.read(box, io))
        done.add(k)
    needed = {leaf for k, n in recipes.items() if k not in done and k in engine for leaf in n.leaves()}
    for key in [k for k in whole if k not in needed]:
        del whole[key]


T0 = time.time()


def worker(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    def say(what: str) -> None:  # progress on stderr, rank 0; a phase that hangs dumps the stacks
        faulthandler.dump_traceback_later(args.hang_s, exit=False)
        if rank == 0:
            mem = f", GPU {torch.cuda.memory_allocated() / 2**30:.1f} GiB" if gpu else ""
            print(f"[{time.time() - args.t0:7.1f} s] {what}{mem}", file=sys.stderr, flush=True)

    torch.set_num_threads(1 if world > 1 else min(8, os.cpu_count() or 1))  # one process per core when several share 2 cores
    gpu = args.device == "cuda"
    device = args.device
    say("worker started")
    if gpu:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if gpu else "gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", 0) if gpu else None)  # fmt: skip
    say("process group up")
    res: dict = {}
    if gpu:
        res["d2d_gibs"] = d2d_rate(args.repeat)
        say(f"device-to-device copy: {res['d2d_gibs']:.1f} GiB/s")
    s = dict(SIZES[args.size])
    if args.layers:
        s["layers"] = args.layers
    dtype = getattr(torch, args.engine_dtype)
    disagg = args.scenario == "disaggregated"
    trainers = [0, 1] if disagg else list(range(world))
    mesh = DeviceMesh(device, trainers, mesh_dim_names=("dp",))
    tgroup = dist.new_group(trainers)
    is_trainer, is_engine = rank in trainers, (rank >= 2 if disagg else True)
    tp = 1 if args.scenario == "single" else 2
    erank = rank - 2 if disagg else rank
    full = weights(args.model, s, device)
    say(f"trainer weights made: {sum(v.numel() for v in full.values()) / 1e9:.2f} G values")
    trainer = {k: distribute_tensor(v, mesh, [Shard(0)], src_data_rank=None) for k, v in full.items()} if is_trainer else None
    del full
    ad = adapter(args.model, s, tp, args.fp8, args.quant)
    layout = layout_of(args.model, tp, erank, args.fp8) if is_engine else None
    if args.quant and args.quant != "fp8_block":  # the adapter's outputs, as it makes them: TP 1, whole tensors
        from support.refit_eager import quant_engine

        engine = quant_engine(trainer_schema(args.model, s), ad, dtype, device) if is_engine else None
        layout = lambda k, t: (tuple(t.shape), tuple((0, n) for n in t.shape))  # noqa: E731
    else:
        engine = engine_of(args.model, s, tp, dtype, device, args.fp8) if is_engine else None
    sync = (lambda: torch.cuda.synchronize()) if gpu else (lambda: None)  # noqa: E731
    say("trainer sharded, engine allocated; planning")

    dist.barrier()  # the plan's time, not the slowest rank's setup
    t0 = time.perf_counter()
    refit = sdadapt.refit_plan(trainer, engine, ad, engine_layout=layout, bucket_bytes=args.bucket_mib << 20)
    plan_s = time.perf_counter() - t0
    say(f"planned in {plan_s:.2f} s")
    runs, reports = [], []
    for i in range(args.repeat):
        dist.barrier()
        t0 = time.perf_counter()
        rep = refit()
        sync()
        runs.append(time.perf_counter() - t0)
        reports.append(rep)
        say(f"refit {i + 1}: {runs[-1]:.3f} s")
    if args.profile:  # one more refit (every rank) under torch's profiler: where its time goes
        from torch.profiler import ProfilerActivity, profile

        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])) as prof:
            refit()
            sync()
        for key in ("self_cuda_time_total", "cpu_time_total") if gpu and rank == 0 else ("cpu_time_total",) if rank == 0 else ():
            print(prof.key_averages().table(sort_by=key, row_limit=args.profile), file=sys.stderr, flush=True)
        if args.trace and rank == 0:
            prof.export_chrome_trace(args.trace)
    if args.cprofile:  # one more refit under cProfile: the host's share, function by function
        import cProfile
        import pstats

        dist.barrier()
        cp = cProfile.Profile()
        cp.enable()
        refit()
        sync()
        cp.disable()
        if rank == 0:
            pstats.Stats(cp, stream=sys.stderr).sort_stats("tottime").print_stats(args.cprofile)
    got = {k: v.clone() for k, v in engine.items()} if engine is not None and args.baseline else {}

    # baseline: gather whole (export_iter) then cut
    recipes = refit.recipes
    wire = torch.float32 if args.fp8 or args.quant else dtype  # FP8 is quantized from the trainer's values, not from a cast
    base_runs: list[float] = []
    gathered = sent = 0
    for _ in range((args.baseline_repeat or args.repeat) if args.baseline else 0):
        if engine is not None:
            for v in engine.values():
                v.zero_()
        dist.barrier()
        t0 = time.perf_counter()
        done: set[str] = set()
        whole: dict[str, torch.Tensor] = {}
        gathered = sent = 0
        if is_trainer:
            model = module_of(trainer)
            for name, t in sdadapt.export_iter(model, None, process_group=tgroup):
                local = trainer[name]._local_tensor
                gathered += (t.numel() - local.numel()) * t.element_size()
                t = t.to(device=device, dtype=wire)
                if disagg and rank == 0:
                    for dst in (2, 3):
                        dist.send(t, dst)
                        sent += t.numel() * t.element_size()
                if engine is not None:
                    whole[name] = t
                    cut(recipes, layout, engine, whole, done)
        elif engine is not None:
            for name, v in trainer_schema(args.model, s).items():
                t = torch.empty(v, dtype=wire, device=device)
                dist.recv(t, 0)
                gathered += t.numel() * t.element_size()
                whole[name] = t
                cut(recipes, layout, engine, whole, done)
        sync()
        base_runs.append(time.perf_counter() - t0)
        say(f"gather-then-cut: {base_runs[-1]:.3f} s")
    bits = lambda t: t.contiguous().view(torch.uint8)  # noqa: E731 - float8 has no equal on every device
    same = all(torch.equal(bits(got[k]), bits(engine[k])) for k in got) if engine is not None and got else None
    shard_bytes = sum(v.numel() * v.element_size() for v in engine.values()) if engine is not None else 0
    res |= dict(rank=rank, plan_s=plan_s, runs=runs, base_runs=base_runs, sent=reports[-1].bytes_sent,
               received=reports[-1].bytes_received, local=reports[-1].bytes_local, buffer=reports[-1].buffer_bytes,
               rounds=reports[-1].rounds, base_received=gathered, base_sent=sent, shard_bytes=shard_bytes, same=same,
               staged=reports[-1].staged_bytes)  # fmt: skip
    faulthandler.cancel_dump_traceback_later()
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def d2d_rate(repeat: int, nbytes: int = 4 << 30) -> float:
    """GiB/s of a device-to-device copy of ``nbytes`` (written; the read is as much again)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeat):
        dst.copy_(src)
    torch.cuda.synchronize()
    rate = nbytes / 2**30 / ((time.perf_counter() - t0) / repeat)
    del src, dst
    torch.cuda.empty_cache()
    return rate


def trainer_schema(model: str, s: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """The trainer's keys and shapes in export_iter's order, without building the weights."""
    return {k: tuple(v.shape) for k, v in module_of(weights(model, s, "meta")).state_dict().items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=["llama", "qwen3_moe"], default="llama")
    p.add_argument("--scenario", choices=["disaggregated", "colocated", "single"], default="colocated")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--bucket-mib", type=int, default=64)
    p.add_argument("--engine-dtype", default="bfloat16")
    p.add_argument("--fp8", action="store_true", help="the engine serves vLLM's block-quantized FP8")
    p.add_argument("--quant", choices=["fp8_block", "fp8_channel", "fp8_tensor", "mxfp8", "nvfp4"], default="",
                   help="the engine's linear weights in this format (fp8_block: --fp8)")  # fmt: skip
    p.add_argument("--layers", type=int, default=0, help="decoder layers (default: the size's)")
    p.add_argument("--baseline-repeat", type=int, default=0, help="gather-then-cut runs (default: --repeat)")
    p.add_argument("--no-baseline", dest="baseline", action="store_false", help="skip gather-then-cut")
    p.add_argument("--profile", type=int, default=0, help="print the N costliest operations of one more refit")
    p.add_argument("--trace", default="", help="with --profile: write that refit's Chrome trace (rank 0) to this file")
    p.add_argument("--cprofile", type=int, default=0, help="print the N costliest Python functions of one more refit")
    p.add_argument("--hang-s", type=float, default=300.0, help="dump the stacks of a phase that takes longer")
    args = p.parse_args()
    args.t0 = T0
    args.fp8 = args.fp8 or args.quant == "fp8_block"
    if args.quant not in ("", "fp8_block") and (args.model != "llama" or args.scenario != "single"):
        p.error(f"--quant {args.quant} runs with --model llama --scenario single (the engine is TP 1)")
    world = {"disaggregated": 4, "colocated": 2, "single": 1}[args.scenario]
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="sdadapt-refit-bench-") as tmp:
        mp.spawn(worker, args=(world, os.path.join(tmp, "store"), args, tmp), nprocs=world, join=True)
        rows = [json.load(open(os.path.join(tmp, f"{r}.json"))) for r in range(world)]
    med = lambda xs: statistics.median(xs)  # noqa: E731
    refit_s = max(med(r["runs"]) for r in rows)
    base_s = max(med(r["base_runs"]) for r in rows) if args.baseline else float("nan")
    out = f"{args.engine_dtype}" + (" + FP8 e4m3 block 128x128" if args.fp8 else f" + {args.quant}" if args.quant else "")
    size = f"{args.size} ({args.layers} layers)" if args.layers else args.size
    print(f"\n{args.model} {size}, {args.scenario}, engine {out}, bucket {args.bucket_mib} MiB")
    steady = max(med(r["runs"][1:] or r["runs"]) for r in rows)
    least = max(min(r["runs"][1:] or r["runs"]) for r in rows)
    print(f"refit {refit_s:.3f} s (median of {args.repeat}, slowest rank; plan {max(r['plan_s'] for r in rows):.2f} s), "
          f"gather-then-cut {base_s:.3f} s; identical results: {[r['same'] for r in rows]}")  # fmt: skip
    print(f"refit after the first run (which builds the kernels): median {steady:.3f} s, min {least:.3f} s "
          f"of {max(len(rows[0]['runs']) - 1, 1)}")  # fmt: skip
    print(
        "\n| rank | engine shard MiB | refit sent MiB | refit received MiB | refit local MiB | buffer MiB | rounds | "
        "baseline sent MiB | baseline received MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rank']} | {r['shard_bytes'] / 2**20:.2f} | {r['sent'] / 2**20:.2f} | {r['received'] / 2**20:.2f} | "
              f"{r['local'] / 2**20:.2f} | {r['buffer'] / 2**20:.2f} | {r['rounds']} | {r['base_sent'] / 2**20:.2f} | "
              f"{r['base_received'] / 2**20:.2f} |")  # fmt: skip
    if args.device == "cuda":
        r = rows[0]
        gib = r["shard_bytes"] / 2**30
        print(f"\nGPU: {gib:.2f} GiB of engine shards, refit {refit_s:.3f} s = {gib / refit_s:.1f} GiB/s written; "
              f"a device-to-device copy of 4 GiB writes {r['d2d_gibs']:.1f} GiB/s")  # fmt: skip
    print(json.dumps(dict(args={k: v for k, v in vars(args).items() if k != "t0"}, refit_s=refit_s, baseline_s=base_s, ranks=rows)))


if __name__ == "__main__":
    main()
