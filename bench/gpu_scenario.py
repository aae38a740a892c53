"""The user discussion's scenario on GPUs (nccl): meta init -> TP/FSDP2 -> sdadapt.load, bit-exact.

    torchrun --nproc-per-node 2 bench/gpu_scenario.py            # 2 GPUs, nccl
    torchrun --nproc-per-node 2 bench/gpu_scenario.py --cpu      # the same on gloo

The logic of tests/dist/test_dist_smoke.py (the model of shared/seed/discussion.txt, fused qkv under
ColwiseParallel), on every mesh two ranks allow (FSDP only, TP only) and from three sources:
a plain ``torch.save`` file, a ``torch.save`` file with split q/k/v (through a fuse rule) and
an HF sharded safetensors folder. Each loaded shard is compared bit-exactly with the reference
model's tensors. Sizes: the tests' tiny model and a larger one (so that reads take every path
of the I/O engine: direct, staged, coalesced, strided). Prints one line per case.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

from support.models import TinyTransformer, parallelize, split_qkv  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import sdadapt  # noqa: E402

QKV = sdadapt.Adapter(
    [
        sdadapt.fuse(
            ["layers.{i}.attn.q_proj.{p}", "layers.{i}.attn.k_proj.{p}", "layers.{i}.attn.v_proj.{p}"],
            "layers.{i}.attn.qkv.{p}",
        )
    ],
    name="split-qkv",
)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true")
    args = ap.parse_args()
    backend = "gloo" if args.cpu else "nccl"
    dev_type = "cpu" if args.cpu else "cuda"
    if not args.cpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    folder = [tempfile.mkdtemp(prefix="sdadapt-gpu-") if rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    tmp = folder[0]
    failures = 0
    sizes = {"tiny": {}, "large": dict(layers=2, dim=512, heads=8, ffn=1536, vocab=32003)}
    meshes = {"fsdp": (world, 1), "tp": (1, world)}
    for size_name, kw in sizes.items():
        torch.manual_seed(0)
        ref = TinyTransformer(**kw)
        files = {
            "torch.save": os.path.join(tmp, f"{size_name}.pt"),
            "torch.save split-qkv": os.path.join(tmp, f"{size_name}-split.pt"),
            "hf-sharded": os.path.join(tmp, f"{size_name}-hf"),
        }
        if rank == 0:
            from safetensors.torch import save_file

            torch.save(ref.state_dict(), files["torch.save"])
            torch.save({"model": split_qkv(ref.state_dict()), "step": 3}, files["torch.save split-qkv"])
            os.makedirs(files["hf-sharded"])
            sd = {k: v.contiguous() for k, v in ref.state_dict().items()}
            keys = list(sd)
            half = len(keys) // 2
            import json

            wm = {}
            for i, part in enumerate((keys[:half], keys[half:])):
                name = f"model-{i + 1:05d}-of-00002.safetensors"
                save_file({k: sd[k] for k in part}, os.path.join(files["hf-sharded"], name))
                wm.update(dict.fromkeys(part, name))
            with open(os.path.join(files["hf-sharded"], "model.safetensors.index.json"), "w") as f:
                json.dump({"weight_map": wm}, f)
        dist.barrier()
        expected = ref.state_dict()
        for mesh_name, mesh_shape in meshes.items():
            for src_name, path in files.items():
                t0 = time.perf_counter()
                try:
                    mesh = init_device_mesh(dev_type, mesh_shape, mesh_dim_names=("fsdp", "tp"))
                    with torch.device("meta"):
                        model = TinyTransformer(**kw)
                    parallelize(model, mesh)
                    if "split" in src_name:
                        rep = sdadapt.load(model, path, QKV, subtree="model")
                    else:
                        rep = sdadapt.load(model, path)
                    bad = []
                    n = 0
                    for k, v in model.state_dict().items():
                        local = v.to_local() if isinstance(v, DTensor) else v
                        if local.device.type != dev_type:
                            bad.append(f"{k} on {local.device}")
                        full = v.full_tensor() if isinstance(v, DTensor) else v
                        if not torch.equal(full.cpu(), expected[k]):
                            bad.append(k)
                        n += 1
                    ok = not bad and rep.bytes_read <= rep.local_bytes
                    msg = (f"{n} tensors bit-exact, read {rep.bytes_read} B for {rep.local_bytes} B of local shards"
                           if ok else f"MISMATCH {bad[:5]} bytes {rep.bytes_read}/{rep.local_bytes}")
                except Exception as e:  # noqa: BLE001 - reported per case
                    ok, msg = False, f"{type(e).__name__}: {e}"
                flags = torch.tensor([0 if ok else 1], device=dev_type)
                dist.all_reduce(flags)
                if rank == 0 or not ok:
                    status = "PASS" if flags.item() == 0 else "FAIL"
                    print(f"[rank {rank}] {status} {backend} {size_name:5s} mesh={mesh_name}{mesh_shape} src={src_name:22s} "
                          f"{time.perf_counter() - t0:.2f} s: {msg}", flush=True)
                failures += int(flags.item() != 0)
    dist.barrier()
    if rank == 0:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        print(f"gpu_scenario: {'all passed' if failures == 0 else f'{failures} case(s) failed'} "
              f"(torch {torch.__version__}, {world} ranks, {backend})", flush=True)
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
