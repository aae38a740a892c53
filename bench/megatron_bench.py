"""A Megatron-Core checkpoint into FSDP2 on 2 gloo ranks: sdadapt against Megatron-Bridge's HF conversion.

    python bench/megatron_bench.py [--workdir /tmp/sdadapt-megatron-bench] [--keep]

1. **The checkpoint**: a Llama-shaped ``GPTModel`` (24 layers, hidden 1536, 12 heads in 4 query
   groups, SwiGLU 4096, vocab 32000, bf16: 1.31 GiB) built and saved by megatron-core 0.16.1 itself
   (``tests/support/megatron_fixtures.py --bench bench_1g`` in the megatron venv: its own
   initialisation, ``dist_checkpointing.save``, ``torch_dist``). Written once, kept in ``--workdir``.
2. **Megatron-Bridge's conversion** (``tests/support/megatron_bridge.py`` in the Megatron-Bridge
   0.3.1 venv, one process as its own ``export_ckpt`` runs on CPU): Megatron's
   ``dist_checkpointing.load`` into a ``GPTModel`` built from the checkpoint's args, then Bridge's
   ``save_hf_weights`` (its mapping, its safetensors writer) into an HF folder.
3. **The HF folder into FSDP2** (2 gloo ranks): transformers' ``from_pretrained`` on each rank,
   then ``fully_shard`` per layer and at the root: what a user does with the converted folder.
4. **sdadapt** (2 gloo ranks): a transformers ``LlamaForCausalLM`` on meta in bf16, ``fully_shard``
   the same way, ``sdadapt.load(model, ckpt, "megatron_gpt", dtype="model")`` straight from the
   Megatron folder (Megatron keeps the norms in float32: cast to the model's bf16, as step 3's
   ``from_pretrained(dtype=bfloat16)`` casts them). After the timing, every rank's shards are
   compared bit for bit with Bridge's HF folder (its float32 norms cast the same way first).

Each step runs in fresh processes; the checkpoint's file is read once before each (page cache
warm for all). Times are wall seconds of the step's call, slowest rank; memory is each process's
peak RSS (``ru_maxrss``), which includes its imports (torch, transformers; Megatron for step 2).
Prints a Markdown table and writes ``results.json`` in the workdir.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import socket
import subprocess
import sys
import time
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUPPORT = os.path.join(ROOT, "tests", "support")
GiB = 2**30


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _warm(folder: str) -> None:
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                while f.read(64 << 20):
                    pass


def _venv(bridge: bool) -> str:
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "megatron_venv.py"), *(["--bridge"] if bridge else [])]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]


def _llama_config(ckpt: str) -> Any:
    from transformers import LlamaConfig

    import sdadapt

    a = sdadapt.sources.read_megatron_common(ckpt)["args"]
    return LlamaConfig(
        vocab_size=a["padded_vocab_size"], hidden_size=a["hidden_size"], intermediate_size=a["ffn_hidden_size"],
        num_hidden_layers=a["num_layers"], num_attention_heads=a["num_attention_heads"],
        num_key_value_heads=a["num_query_groups"], head_dim=a["kv_channels"], rms_norm_eps=a["norm_epsilon"],
        rope_theta=a["rotary_base"], tie_word_embeddings=not a["untie_embeddings_and_output_weights"],
        max_position_embeddings=a["max_position_embeddings"], torch_dtype="bfloat16",
    )  # fmt: skip


def _shard(model: Any, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def rank_sdadapt(ckpt: str, bridge_out: str) -> dict[str, Any]:
    """Step 4 on one rank: the load, then its shards against Bridge's folder."""
    import torch.distributed as dist
    from safetensors import safe_open
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from transformers import LlamaForCausalLM

    import sdadapt

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("meta"):
        model = LlamaForCausalLM(_llama_config(ckpt))
    torch.set_default_dtype(torch.float32)
    _shard(model, mesh)
    before = _peak()
    dist.barrier()
    t0 = time.perf_counter()
    report = sdadapt.load(model, ckpt, "megatron_gpt", dtype="model")  # Megatron's norms are float32
    seconds = time.perf_counter() - t0
    peak = _peak()
    unequal, cast, compared = [], [], 0
    with safe_open(os.path.join(bridge_out, "model.safetensors"), "pt") as f:
        for name, value in model.state_dict().items():
            shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
            want = f.get_slice(name)[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
            local = value.to_local()
            compared += local.numel() * local.element_size()
            if want.dtype != local.dtype:  # cast as from_pretrained(dtype=bfloat16) casts it
                cast.append(f"{name} ({want.dtype})")
                want = want.to(local.dtype)
            if not torch.equal(local, want):
                unequal.append(name)
    return {"load_s": seconds, "rss_before_load": before, "peak_rss": peak, "bytes_read": report.bytes_read,
            "unequal_to_bridge": unequal, "cast_to_bf16": cast, "bytes_compared": compared}  # fmt: skip


def rank_hf(bridge_out: str) -> dict[str, Any]:
    """Step 3 on one rank: transformers' from_pretrained of Bridge's folder, then FSDP2."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    before = _peak()
    dist.barrier()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(bridge_out, dtype=torch.bfloat16)
    _shard(model, mesh)
    dist.barrier()
    return {"load_s": time.perf_counter() - t0, "rss_before_load": before, "peak_rss": _peak()}


def _rank_main(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world, init_method=f"tcp://127.0.0.1:{args.port}")
    out = rank_sdadapt(args.ckpt, args.bridge_out) if args.step == "sdadapt" else rank_hf(args.bridge_out)
    dist.barrier()
    dist.destroy_process_group()
    with open(args.result, "w") as f:
        json.dump(out, f)


def _ranks(step: str, ckpt: str, bridge_out: str, work: str, world: int = 2) -> list[dict[str, Any]]:
    port = _free_port()
    results = [os.path.join(work, f"{step}-rank{r}.json") for r in range(world)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, __file__, "--step", step, "--rank", str(r), "--world", str(world), "--port",
                          str(port), "--ckpt", ckpt, "--bridge-out", bridge_out, "--result", results[r]], env=env)
        for r in range(world)
    ]  # fmt: skip
    for p in procs:
        if p.wait(timeout=1800) != 0:
            raise SystemExit(f"{step}: a rank failed (exit {p.returncode})")
    out = []
    for path in results:
        with open(path) as f:
            out.append(json.load(f))
    return out


def _bridge(ckpt: str, work: str) -> dict[str, Any]:
    out = os.path.join(work, "bridge-hf")
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(out + ".template", ignore_errors=True)
    config = os.path.join(work, "hf-config")
    _llama_config(ckpt).save_pretrained(config)
    job = {"ckpt": ckpt, "hf_config": config, "out": out, "result": os.path.join(work, "bridge.json")}
    with open(os.path.join(work, "bridge-jobs.json"), "w") as f:
        json.dump([job], f)
    py = _venv(bridge=True)
    t0 = time.perf_counter()
    subprocess.run([py, os.path.join(SUPPORT, "megatron_bridge.py"), os.path.join(work, "bridge-jobs.json")], check=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True)  # fmt: skip
    wall = time.perf_counter() - t0
    shutil.rmtree(out + ".template", ignore_errors=True)
    with open(job["result"]) as f:
        return {**json.load(f), "process_wall_s": wall, "out": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "sdadapt-megatron-bench"))
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and Bridge's folder")
    ap.add_argument("--step", choices=["sdadapt", "hf"], help=argparse.SUPPRESS)
    for name in ("--rank", "--world", "--port"):
        ap.add_argument(name, type=int, help=argparse.SUPPRESS)
    for name in ("--ckpt", "--bridge-out", "--result"):
        ap.add_argument(name, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.step:
        _rank_main(args)
        return
    work = args.workdir
    os.makedirs(work, exist_ok=True)
    ckpt = os.path.join(work, "megatron_ckpt")
    written_s = None
    if not os.path.isfile(os.path.join(ckpt, "metadata.json")):
        t0 = time.perf_counter()
        subprocess.run([_venv(bridge=False), os.path.join(SUPPORT, "megatron_fixtures.py"), ckpt, "--bench", "bench_1g"],
                       check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True)  # fmt: skip
        written_s = time.perf_counter() - t0
    size = sum(os.path.getsize(os.path.join(ckpt, n)) for n in os.listdir(ckpt))
    _warm(ckpt)
    bridge = _bridge(ckpt, work)
    _warm(ckpt)
    _warm(bridge["out"])
    hf = _ranks("hf", ckpt, bridge["out"], work)
    _warm(ckpt)
    ours = _ranks("sdadapt", ckpt, bridge["out"], work)
    result = {"machine": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__, "checkpoint_bytes": size,
              "checkpoint_written_s": written_s, "bridge": bridge, "hf_fsdp2": hf, "sdadapt": ours}  # fmt: skip
    with open(os.path.join(work, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(table(result))
    if not args.keep:
        shutil.rmtree(bridge["out"], ignore_errors=True)


def table(r: dict[str, Any]) -> str:
    """The Markdown table of one run."""
    g = lambda n: f"{n / GiB:.2f}"  # noqa: E731
    b, hf, ours = r["bridge"], r["hf_fsdp2"], r["sdadapt"]
    conv = b["megatron_load_s"] + b["bridge_export_s"]
    lines = [
        f"checkpoint: {r['checkpoint_bytes'] / GiB:.2f} GiB torch_dist (bf16), machine {r['machine']} ({r['cpus']} CPUs), "
        f"torch {r['torch']}",
        "",
        "| path | step | seconds | peak RSS GiB per process |",
        "|---|---|---|---|",
        f"| Bridge | Megatron load + Bridge export to HF (1 process) | {conv:.1f} (load {b['megatron_load_s']:.1f} + "
        f"export {b['bridge_export_s']:.1f}; process {b['process_wall_s']:.1f}) | {g(b['peak_rss'])} |",
        f"| Bridge | HF folder into FSDP2 (transformers from_pretrained + fully_shard, 2 ranks) | "
        f"{max(x['load_s'] for x in hf):.1f} | {' / '.join(g(x['peak_rss']) for x in hf)} |",
        f"| Bridge | total | {conv + max(x['load_s'] for x in hf):.1f} | |",
        f"| sdadapt | load straight into FSDP2 (2 ranks) | {max(x['load_s'] for x in ours):.1f} | "
        f"{' / '.join(g(x['peak_rss']) for x in ours)} (before load: {' / '.join(g(x['rss_before_load']) for x in ours)}) |",
        "",
        f"Bridge: building the GPTModel (Megatron's initialisation) {b['build_s']:.1f} s, its HF template "
        f"{b['template_s']:.1f} s (in the process time, not the step's).",
        f"sdadapt bytes read per rank: {' / '.join(g(x['bytes_read']) for x in ours)} GiB; shards equal to Bridge's "
        f"HF folder: {all(not x['unequal_to_bridge'] for x in ours)} ({sum(x['bytes_compared'] for x in ours) / GiB:.2f} GiB "
        "compared)",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
