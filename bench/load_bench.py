"""Load benchmark: sdadapt against the loaders people use today, side by side in one run.

    python bench/load_bench.py --preset 2g --nproc 2                      # CPU, gloo
    python bench/load_bench.py --preset 8b --nproc 2 --backend nccl       # 2 GPUs

One synthetic Llama-shaped checkpoint (HF names, bf16) is written once as HF sharded
safetensors, one ``torch.save`` file and a DCP folder (a size that cannot fit the disk or RAM
is refused before anything is written; whatever was written is removed at the end unless
``--keep``). Then ``torchrun``-style worker groups load it into a model built on the meta device
and parallelised (FSDP2 over all ranks, or TP over all ranks), with:

- ``sdadapt`` (rename-only adapter into torchtitan-style names; fused ``wqkv``/``w13`` adapter;
  from safetensors, ``torch.save`` and DCP),
- ``rank0-broadcast``: rank 0 ``safetensors.torch.load_file`` + ``set_model_state_dict(
  full_state_dict=True, broadcast_from_rank0=True)``,
- ``hf-reader``: ``dcp.load`` + ``HuggingFaceStorageReader(thread_count=8)`` (names 1:1),
- ``dcp-native``: ``dcp.load`` of the DCP folder (names 1:1; a reference for resumes),
- ``torchsave-broadcast``: ``BroadcastingTorchSaveReader`` + ``DynamicMetaLoadPlanner`` (the
  user discussion's path), in its own process group with a timeout: as written there (meta
  model) and with the model materialised first. A hang or a failure is a result.

Per path and rank: wall time (the table shows the slowest rank), bytes read, peak RSS over the
path's start (anonymous and file-backed apart, sampled every few ms; VmHWM too), peak extra GPU
memory, GiB/s; plus the machine's own references measured in the same run (page-cache read
bandwidth with several threads per rank; pinned host-to-GPU copy). Every result is checked
bit-exactly: each sdadapt layout against the source (the recipe applied eagerly to full
tensors), the other paths against the sdadapt result on GPU, or against the source on CPU
(so that no reference copy inflates the RSS being measured). JSON and a markdown table out.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GiB = 1 << 30
MiB = 1 << 20


class BenchError(Exception):
    """The benchmark cannot run as asked (size does not fit, bad option...)."""


# --- model shape ------------------------------------------------------------------------------


@dataclass
class Shape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    dtype: str = "bfloat16"

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def hf_keys(self) -> list[tuple[str, tuple[int, ...]]]:
        h, i, kv = self.hidden, self.intermediate, self.kv_heads * self.head_dim
        out = [("model.embed_tokens.weight", (self.vocab, h))]
        for n in range(self.layers):
            p = f"model.layers.{n}."
            out += [
                (p + "self_attn.q_proj.weight", (h, h)),
                (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, h)),
                (p + "mlp.gate_proj.weight", (i, h)),
                (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i)),
                (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,)),
            ]
        out += [("model.norm.weight", (h,)), ("lm_head.weight", (self.vocab, h))]
        return out

    def itemsize(self) -> int:
        return {"bfloat16": 2, "float16": 2, "float32": 4}[self.dtype]

    def nbytes(self) -> int:
        total = 0
        for _, s in self.hf_keys():
            n = 1
            for d in s:
                n *= d
            total += n
        return total * self.itemsize()


PRESETS = {
    # Llama-3-8B: 15.0 GiB in bf16
    "8b": Shape(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256),
    # about 2.1 GiB in bf16 (the CPU figure: a checkpoint of at least 2 GiB)
    "2g": Shape(layers=22, hidden=2048, intermediate=5632, heads=16, kv_heads=4, vocab=32000),
    # tiny: the smoke test
    "tiny": Shape(layers=2, hidden=64, intermediate=160, heads=4, kv_heads=2, vocab=96),
}

# HF name -> torchtitan-style name (the rename-only adapter's job)
RENAMES = [
    ("model.embed_tokens.weight", "tok_embeddings.weight"),
    ("model.layers.{i}.self_attn.q_proj.weight", "layers.{i}.attention.wq.weight"),
    ("model.layers.{i}.self_attn.k_proj.weight", "layers.{i}.attention.wk.weight"),
    ("model.layers.{i}.self_attn.v_proj.weight", "layers.{i}.attention.wv.weight"),
    ("model.layers.{i}.self_attn.o_proj.weight", "layers.{i}.attention.wo.weight"),
    ("model.layers.{i}.mlp.gate_proj.weight", "layers.{i}.feed_forward.w1.weight"),
    ("model.layers.{i}.mlp.up_proj.weight", "layers.{i}.feed_forward.w3.weight"),
    ("model.layers.{i}.mlp.down_proj.weight", "layers.{i}.feed_forward.w2.weight"),
    ("model.layers.{i}.input_layernorm.weight", "layers.{i}.attention_norm.weight"),
    ("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.ffn_norm.weight"),
    ("model.norm.weight", "norm.weight"),
    ("lm_head.weight", "output.weight"),
]


def titan_name(hf: str) -> str:
    parts = hf.split(".")
    for src, dst in RENAMES:
        sp = src.split(".")
        if len(sp) == len(parts) and all(a == b or a == "{i}" for a, b in zip(sp, parts)):
            i = parts[sp.index("{i}")] if "{i}" in sp else None
            return dst.replace("{i}", i) if i is not None else dst
    raise KeyError(hf)


def adapters() -> dict[str, Any]:
    import sdadapt

    rename = sdadapt.Adapter([sdadapt.rename(s, d) for s, d in RENAMES], name="llama-hf-to-titan")
    fused_rules = [
        sdadapt.fuse(
            [
                "model.layers.{i}.self_attn.q_proj.weight",
                "model.layers.{i}.self_attn.k_proj.weight",
                "model.layers.{i}.self_attn.v_proj.weight",
            ],
            "layers.{i}.attention.wqkv.weight",
        ),
        sdadapt.fuse(
            ["model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"],
            "layers.{i}.feed_forward.w13.weight",
        ),
    ]
    fused_rules += [sdadapt.rename(s, d) for s, d in RENAMES if "q_proj" not in s and "k_proj" not in s
                    and "v_proj" not in s and "gate_proj" not in s and "up_proj" not in s]
    fused = sdadapt.Adapter(fused_rules, name="llama-hf-to-titan-fused")
    return {"rename": rename, "fused": fused, "identity": None}


# --- models (no forward pass: this is a load benchmark) -------------------------------------------


def build_model(shape: Shape, naming: str) -> tuple[Any, list[Any]]:
    """A Llama skeleton on the meta device with HF names (``hf``), torchtitan names (``titan``)
    or torchtitan names with fused ``wqkv``/``w13`` (``fused``). Returns (model, blocks)."""
    import torch
    from torch import nn

    dtype = getattr(torch, shape.dtype)
    h, i, kv = shape.hidden, shape.intermediate, shape.kv_heads * shape.head_dim

    def lin(o: int, n: int) -> nn.Linear:
        return nn.Linear(n, o, bias=False)

    class Norm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(h))

    with torch.device("meta"):
        if naming == "hf":
            model = nn.Module()
            model.model = nn.Module()
            model.model.embed_tokens = nn.Embedding(shape.vocab, h)
            blocks = nn.ModuleList()
            for _ in range(shape.layers):
                b = nn.Module()
                b.self_attn = nn.Module()
                b.self_attn.q_proj, b.self_attn.k_proj = lin(h, h), lin(kv, h)
                b.self_attn.v_proj, b.self_attn.o_proj = lin(kv, h), lin(h, h)
                b.mlp = nn.Module()
                b.mlp.gate_proj, b.mlp.up_proj, b.mlp.down_proj = lin(i, h), lin(i, h), lin(h, i)
                b.input_layernorm, b.post_attention_layernorm = Norm(), Norm()
                blocks.append(b)
            model.model.layers = blocks
            model.model.norm = Norm()
            model.lm_head = lin(shape.vocab, h)
        else:
            model = nn.Module()
            model.tok_embeddings = nn.Embedding(shape.vocab, h)
            blocks = nn.ModuleList()
            for _ in range(shape.layers):
                b = nn.Module()
                b.attention = nn.Module()
                if naming == "fused":
                    b.attention.wqkv = lin(h + 2 * kv, h)
                else:
                    b.attention.wq, b.attention.wk, b.attention.wv = lin(h, h), lin(kv, h), lin(kv, h)
                b.attention.wo = lin(h, h)
                b.feed_forward = nn.Module()
                if naming == "fused":
                    b.feed_forward.w13 = lin(2 * i, h)
                else:
                    b.feed_forward.w1, b.feed_forward.w3 = lin(i, h), lin(i, h)
                b.feed_forward.w2 = lin(h, i)
                b.attention_norm, b.ffn_norm = Norm(), Norm()
                blocks.append(b)
            model.layers = blocks
            model.norm = Norm()
            model.output = lin(shape.vocab, h)
    model.to(dtype)
    return model, list(blocks)


def tp_plan(naming: str) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if naming == "hf":
        return {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "model.layers.*.self_attn.q_proj": ColwiseParallel(),
            "model.layers.*.self_attn.k_proj": ColwiseParallel(),
            "model.layers.*.self_attn.v_proj": ColwiseParallel(),
            "model.layers.*.self_attn.o_proj": RowwiseParallel(),
            "model.layers.*.mlp.gate_proj": ColwiseParallel(),
            "model.layers.*.mlp.up_proj": ColwiseParallel(),
            "model.layers.*.mlp.down_proj": RowwiseParallel(),
            "lm_head": ColwiseParallel(output_layouts=Replicate()),
        }
    if naming != "titan":
        raise BenchError("TP layout is benchmarked for the rename-only and HF-named models")
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w3": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(),
        "output": ColwiseParallel(output_layouts=Replicate()),
    }


def parallelize(model: Any, blocks: list[Any], naming: str, layout: str, device_type: str) -> Any:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    world = dist.get_world_size()
    if layout == "fsdp":
        mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("fsdp",))
        for b in blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "tp":
        mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, tp_plan(naming))
    elif layout == "hsdp":  # every rank a replica (FSDP over 1 rank): each needs the whole model
        mesh = init_device_mesh(device_type, (world, 1), mesh_dim_names=("replicate", "fsdp"))
        for b in blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        raise BenchError(f"unknown layout {layout!r}")
    return model


# --- writing the checkpoint -------------------------------------------------------------------


def _meminfo() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            out[k] = int(v.split()[0]) * 1024
    return out


def check_fits(folder: Path, shape: Shape, formats: list[str], nproc: int, assume_ram_gib: float | None) -> dict[str, float]:
    """Refuse (before writing anything) a checkpoint that cannot fit the disk or the memory."""
    size = shape.nbytes()
    need_disk = int(size * len(formats) * 1.01) + 64 * MiB
    probe = folder
    while not probe.exists():
        probe = probe.parent
    free_disk = shutil.disk_usage(probe).free
    # writing holds the whole state dict once; the rank-0 baseline holds it again next to its
    # shard; every rank holds its shard (and, on GPU runs, nothing more on the host)
    need_ram = int(size * 2.2) + nproc * 512 * MiB
    ram = assume_ram_gib * GiB if assume_ram_gib else _meminfo().get("MemAvailable", 0)
    facts = {"checkpoint_gib": size / GiB, "disk_need_gib": need_disk / GiB, "disk_free_gib": free_disk / GiB,
             "ram_need_gib": need_ram / GiB, "ram_available_gib": ram / GiB}
    if need_disk > free_disk:
        raise BenchError(
            f"a {size / GiB:.1f} GiB checkpoint in {len(formats)} formats needs {need_disk / GiB:.1f} GiB of disk, "
            f"but {probe} has {free_disk / GiB:.1f} GiB free; choose a smaller --preset/--layers, fewer --formats, "
            "or another --dir. Nothing was written."
        )
    if need_ram > ram:
        raise BenchError(
            f"a {size / GiB:.1f} GiB checkpoint needs about {need_ram / GiB:.1f} GiB of RAM here (written from "
            f"memory; the rank-0 baseline holds it all), but {ram / GiB:.1f} GiB is available; choose a smaller "
            "size, or pass --assume-ram-gib on machines whose memory grows on demand. Nothing was written."
        )
    return facts


def _stamp(shape: Shape, shard_gb: float, formats: list[str]) -> str:
    return hashlib.sha1(json.dumps([asdict(shape), shard_gb, sorted(formats), 2]).encode()).hexdigest()[:12]


def write_checkpoint(folder: Path, shape: Shape, shard_gb: float, formats: list[str], seed: int = 0) -> dict[str, str]:
    """Write the checkpoint in each format under ``folder``; return format -> path."""
    import torch
    from safetensors.torch import save_file

    dtype = getattr(torch, shape.dtype)
    paths = {"safetensors": str(folder / "hf"), "torch.save": str(folder / "model.pt"), "dcp": str(folder / "dcp")}
    keys = shape.hf_keys()
    # a pool of random values; each tensor is a window of it at its own offset (cheap, and no
    # two tensors alike)
    gen = torch.Generator().manual_seed(seed)
    pool_n = 32 * MiB + 7
    if torch.cuda.is_available():
        pool = torch.randn(pool_n, generator=torch.Generator("cuda").manual_seed(seed), device="cuda").to(dtype).cpu()
    else:
        pool = torch.empty(pool_n, dtype=dtype).normal_(generator=gen)
    sd: dict[str, torch.Tensor] = {}
    for idx, (k, s) in enumerate(keys):
        n = 1
        for d in s:
            n *= d
        t = torch.empty(n, dtype=dtype)
        start = (idx * 1_000_003) % pool_n
        pos = 0
        while pos < n:
            take = min(n - pos, pool_n - start)
            t[pos : pos + take] = pool[start : start + take]
            pos += take
            start = 0
        sd[k] = t.view(s)
    if "safetensors" in formats:
        os.makedirs(paths["safetensors"], exist_ok=True)
        limit = int(shard_gb * 1e9)
        shards: list[dict[str, torch.Tensor]] = [{}]
        used = 0
        for k, t in sd.items():
            nb = t.numel() * t.element_size()
            if shards[-1] and used + nb > limit:
                shards.append({})
                used = 0
            shards[-1][k] = t
            used += nb
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(paths["safetensors"], name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
        with open(os.path.join(paths["safetensors"], "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": shape.nbytes()}, "weight_map": weight_map}, f)
    if "torch.save" in formats:
        torch.save(sd, paths["torch.save"])
    if "dcp" in formats:
        import torch.distributed.checkpoint as dcp

        dcp.save(sd, storage_writer=dcp.FileSystemWriter(paths["dcp"], thread_count=4))
    del sd
    return {f: paths[f] for f in formats}


def warm_cache(paths: list[str], threads: int = 8) -> float:
    """Read every file once (page cache); returns GiB/s of that first pass."""
    files = []
    for p in paths:
        if os.path.isdir(p):
            files += [os.path.join(p, f) for f in sorted(os.listdir(p))]
        else:
            files.append(p)
    total = sum(os.path.getsize(f) for f in files)
    start = time.perf_counter()
    _parallel_read([(f, 0, os.path.getsize(f)) for f in files], threads)
    return total / GiB / max(1e-9, time.perf_counter() - start)


def _parallel_read(ranges: list[tuple[str, int, int]], threads: int, block: int = 16 * MiB) -> int:
    """pread the byte ranges with ``threads`` threads into per-thread buffers; bytes read."""
    import queue

    work: queue.SimpleQueue = queue.SimpleQueue()
    for path, off, n in ranges:
        for o in range(off, off + n, block):
            work.put((path, o, min(block, off + n - o)))
    done = [0] * threads

    def run(i: int) -> None:
        buf = bytearray(block)
        mv = memoryview(buf)
        fds: dict[str, int] = {}
        try:
            while True:
                try:
                    path, o, n = work.get_nowait()
                except queue.Empty:
                    return
                fd = fds.get(path)
                if fd is None:
                    fd = fds[path] = os.open(path, os.O_RDONLY)
                got = 0
                while got < n:
                    r = os.preadv(fd, [mv[got:n]], o + got)
                    if r <= 0:
                        break
                    got += r
                done[i] += got
        finally:
            for fd in fds.values():
                os.close(fd)

    _run_threads(run, threads)
    return sum(done)


def _run_threads(fn: Any, n: int) -> None:
    """``fn(i)`` on ``n`` threads at once; returns when all are done."""
    ts = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def _pinned_pipeline(ranges: list[tuple[str, int, int]], threads: int, dev: Any, block: int = 8 * MiB) -> int:
    """The machine's limit for what the engine does on a GPU: ``threads`` threads ``pread`` the
    byte ranges into two pinned buffers each and copy every block to the GPU without waiting
    (one stream per thread), into one GPU buffer of the ranges' size. Bytes moved."""
    import ctypes
    import queue

    import torch

    total = sum(n for _, _, n in ranges)
    gpu = torch.empty(total, dtype=torch.uint8, device=dev)
    work: queue.SimpleQueue = queue.SimpleQueue()
    pos = 0
    for path, off, n in ranges:
        for o in range(off, off + n, block):
            work.put((path, o, min(block, off + n - o), pos + o - off))
        pos += n

    def run(i: int) -> None:
        torch.cuda.set_device(dev)
        bufs = [torch.empty(block, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        events: list[Any] = [None, None]
        stream = torch.cuda.Stream(dev)
        fds: dict[str, int] = {}
        k = 0
        try:
            with torch.cuda.stream(stream):
                while True:
                    try:
                        path, o, n, at = work.get_nowait()
                    except queue.Empty:
                        break
                    fd = fds.get(path)
                    if fd is None:
                        fd = fds[path] = os.open(path, os.O_RDONLY)
                    if events[k] is not None:
                        events[k].synchronize()
                    buf = bufs[k]
                    got = 0
                    while got < n:
                        r = os.preadv(fd, [(ctypes.c_char * (n - got)).from_address(buf.data_ptr() + got)], o + got)
                        if r <= 0:
                            raise OSError(f"{path}: short read")
                        got += r
                    gpu[at : at + n].copy_(buf[:n], non_blocking=True)
                    events[k] = torch.cuda.Event()
                    events[k].record(stream)
                    k ^= 1
            stream.synchronize()
        finally:
            for fd in fds.values():
                os.close(fd)

    _run_threads(run, threads)
    gpu = None  # the threads are done with it; give the memory back
    torch.cuda.empty_cache()
    return total


# --- per-rank measurement ---------------------------------------------------------------------


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon", "RssFile", "RssShmem", "VmHWM", "VmRSS")):
                k, v = line.split(":", 1)
                out[k] = int(v.split()[0]) * 1024
    return out


def _rchar() -> int:
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("rchar"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class RssSampler:
    """Peaks of RssAnon / RssFile / RssShmem over a region, sampled every ``interval`` s, and
    VmHWM (reset at the start through /proc/self/clear_refs where the kernel allows)."""

    def __init__(self, interval: float = 0.003):
        self.interval = interval
        self.start = _status()
        self.peak = dict(self.start)
        self.hwm_reset = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RssSampler:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.hwm_reset = True
        except OSError:
            pass
        self.start = _status()
        self.peak = dict(self.start)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._take()

    def _take(self) -> None:
        s = _status()
        for k, v in s.items():
            if v > self.peak.get(k, 0):
                self.peak[k] = v

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._take()

    def result(self) -> dict[str, float]:
        g = lambda k: (self.peak.get(k, 0) - self.start.get(k, 0)) / GiB  # noqa: E731
        return {
            "rss_anon_extra_gib": g("RssAnon"),
            "rss_file_extra_gib": g("RssFile"),
            "rss_shmem_extra_gib": g("RssShmem"),
            "rss_peak_gib": self.peak.get("VmHWM", 0) / GiB if self.hwm_reset else max(self.peak.get("VmRSS", 0), 0) / GiB,
            "rss_start_gib": self.start.get("VmRSS", 0) / GiB,
        }


def _local(t: Any) -> tuple[Any, tuple[int, ...]]:
    """(local tensor, global offsets) of a DTensor or a plain tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        chunks = t.__create_chunk_list__()
        return t.to_local(), tuple(chunks[0].offsets) if chunks else (0,) * t.dim()
    return t, (0,) * t.dim()


def _model_sd(model: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model)


def drop_caches() -> None:
    """Empty the page cache (root only): the next reads come from the disk."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as e:
        raise BenchError(f"--cold needs to drop the page cache, which this machine does not allow ({e})") from None


# --- the paths ------------------------------------------------------------------------------------


def run_path(path: str, cfg: dict[str, Any], layout: str, shape: Shape, dev: Any) -> tuple[Any, dict[str, Any], Any]:
    """Build the model for ``path``, parallelise it, then (timed) load it. Returns (model,
    extra facts, the naming of its keys)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import sdadapt

    files = cfg["files"]
    naming = {"sdadapt-fused": "fused"}.get(path, "titan" if path.startswith("sdadapt") else "hf")
    model, blocks = build_model(shape, naming)
    parallelize(model, blocks, naming, layout, dev.type)
    facts: dict[str, Any] = {}
    dist.barrier()
    t0 = time.perf_counter()
    if path.startswith("sdadapt"):
        src = {"sdadapt-torchsave": files.get("torch.save"), "sdadapt-dcp": files.get("dcp")}.get(path, files.get("safetensors"))
        adapter = adapters()["fused" if naming == "fused" else "rename"]
        rep = sdadapt.load(model, src, adapter, share_reads=path == "sdadapt-shared")
        facts.update(bytes_read=rep.bytes_read, plan_seconds=rep.plan_seconds, read_seconds=rep.read_seconds,
                     phases=rep.phase_seconds,
                     local_bytes=rep.local_bytes)
    elif path == "rank0-broadcast":
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        model.to_empty(device=dev)
        sd: dict[str, Any] = {}
        if dist.get_rank() == 0:
            folder = files["safetensors"]
            with open(os.path.join(folder, "model.safetensors.index.json")) as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
            for n in names:
                sd.update(load_file(os.path.join(folder, n)))
        set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        del sd
    elif path == "hf-reader":
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        model.to_empty(device=dev)
        dcp.load(_model_sd(model), storage_reader=HuggingFaceStorageReader(files["safetensors"], thread_count=8))
    elif path == "dcp-native":
        model.to_empty(device=dev)
        dcp.load(_model_sd(model), checkpoint_id=files["dcp"])
    elif path in ("torchsave-broadcast", "torchsave-broadcast-meta"):
        from torch.distributed.checkpoint.format_utils import BroadcastingTorchSaveReader, DynamicMetaLoadPlanner
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        if path == "torchsave-broadcast":
            model.to_empty(device=dev)  # materialised first; the discussion's script did not
        sd = _model_sd(model)
        dcp.load(sd, storage_reader=BroadcastingTorchSaveReader(files["torch.save"]), planner=DynamicMetaLoadPlanner())
        set_model_state_dict(model, sd)
    else:
        raise BenchError(f"unknown path {path!r}")
    if dev.type == "cuda":
        torch.cuda.synchronize()
    facts["wall"] = time.perf_counter() - t0
    return model, facts, naming


def verify_against_source(model: Any, naming: str, files: dict[str, str], shape: Shape) -> int:
    """Every local shard equals the recipe applied eagerly to the full source tensors."""
    import torch

    import sdadapt
    from sdadapt._target import model_state_dict, schema_of

    src = sdadapt.open_source(files["safetensors"])
    try:
        adapter = {"hf": None, "titan": adapters()["rename"], "fused": adapters()["fused"]}[naming]
        plan = sdadapt.build_plan(src.schema, schema_of(model_state_dict(model)), adapter)
        checked = 0
        for k, t in _model_sd(model).items():
            local, off = _local(t)
            full = plan.recipes[k].full(src)
            want = full[tuple(slice(o, o + n) for o, n in zip(off, local.shape))]
            if not torch.equal(local.cpu().view(torch.int16), want.view(torch.int16)):
                raise AssertionError(f"{k}: loaded shard differs from the source")
            checked += 1
        return checked
    finally:
        src.close()


def worker(config_path: str) -> None:
    import torch
    import torch.distributed as dist

    cfg = json.loads(Path(config_path).read_text())
    shape = Shape(**cfg["shape"])
    backend = cfg["backend"]
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if cfg.get("dump_after"):  # a hang leaves its stacks in the log
        import faulthandler

        faulthandler.dump_traceback_later(cfg["dump_after"], exit=False)
    kw = {"device_id": dev} if backend == "nccl" else {}
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.get("pg_timeout", 600)), **kw)
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {"rank": rank, "world": world, "runs": [], "refs": {}}
    try:
        _worker_body(cfg, shape, dev, rank, world, out)
    except BaseException as e:  # noqa: BLE001 - reported in the results
        import traceback

        out["fatal"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
    Path(cfg["out"], f"rank{rank}.json").write_text(json.dumps(out, indent=1))
    try:
        dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _best_rate(move: Any, tries: int = 2) -> float:
    """GiB/s of ``move()`` (which returns the bytes it moved), all ranks starting together; the
    best of ``tries``: the first also pays for fresh memory."""
    import torch.distributed as dist

    best = 0.0
    for _ in range(tries):
        dist.barrier()
        t0 = time.perf_counter()
        nb = move()
        best = max(best, nb / GiB / (time.perf_counter() - t0))
    return best


def _references(cfg: dict[str, Any], dev: Any, rank: int, world: int, out: dict[str, Any]) -> None:
    """The machine's own references, measured in the same run, after the timed paths (so that
    their threads, pinned buffers and GPU buffer cannot disturb the first path's timing)."""
    import torch
    import torch.distributed as dist

    from sdadapt._engine import default_threads

    files = cfg["files"]
    if cfg.get("references", True) and "safetensors" in files:
        folder = files["safetensors"]
        shard_files = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))
        ranges = []
        for f in shard_files:
            n = os.path.getsize(f)
            lo, hi = n * rank // world, n * (rank + 1) // world
            ranges.append((f, lo, hi - lo))
        threads = default_threads()
        out["refs"]["page_cache_read_gibps"] = _best_rate(lambda: _parallel_read(ranges, threads))
        out["refs"]["page_cache_read_threads"] = threads
        if dev.type == "cuda":
            out["refs"]["pinned_pipeline_gibps"] = _best_rate(lambda: _pinned_pipeline(ranges, threads, dev))
            host = torch.empty(GiB, dtype=torch.uint8, pin_memory=True)
            gpu = torch.empty(GiB, dtype=torch.uint8, device=dev)
            gpu.copy_(host, non_blocking=True)
            torch.cuda.synchronize()
            dist.barrier()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(5):
                gpu.copy_(host, non_blocking=True)
            e1.record()
            torch.cuda.synchronize()
            out["refs"]["pinned_h2d_gibps"] = 5 / (e0.elapsed_time(e1) / 1000)
            del host, gpu
            torch.cuda.empty_cache()


def _worker_body(cfg: dict[str, Any], shape: Shape, dev: Any, rank: int, world: int, out: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    files = cfg["files"]
    reps = int(cfg.get("repeat", 1))
    verify_mode = "ref" if dev.type == "cuda" else "source"
    # untimed warm-up loads of the first path: a fresh process pays once for its first pinned
    # buffers, CUDA streams and (on machines whose memory grows on demand) new memory; without
    # this the first path measured would pay it and the later ones would not
    layout0, paths0 = next(((lay, ps) for lay, ps in cfg["layouts"].items() if ps), ("fsdp", []))
    for _ in range(int(cfg.get("warmup", 0)) if paths0 else 0):
        model, _facts, _naming = run_path(paths0[0], cfg, layout0, shape, dev)
        model = None
        gc.collect()
        dist.barrier()
    # repeats go round-robin over the paths (every path's first load, then every path's second...):
    # whatever drifts during a run (the first seconds of a process are slower on the GPU machines,
    # even after the warm-up; bench/RESULTS.md) then falls on every path alike
    for layout, paths in cfg["layouts"].items():
        ref: dict[str, Any] | None = None  # source (HF) key -> local shard of the sdadapt result
        failed: set[str] = set()  # paths that failed on some rank: not run again
        for rep in range(reps):
            for path in paths:
                if path in failed:
                    continue
                gc.collect()
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(dev)
                    gpu0 = torch.cuda.memory_allocated(dev)
                if cfg.get("cold"):
                    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
                        drop_caches()
                    dist.barrier()
                rchar0 = _rchar()
                run: dict[str, Any] = {"path": path, "layout": layout, "repeat": rep}
                model = sd = None
                try:
                    with RssSampler() as sampler:
                        model, facts, naming = run_path(path, cfg, layout, shape, dev)
                    run.update(facts)
                    run.update(sampler.result())
                    run["load_avg"] = os.getloadavg()[0]
                    run["rchar_gib"] = (_rchar() - rchar0) / GiB
                    if dev.type == "cuda":
                        peak = torch.cuda.max_memory_allocated(dev)
                        now = torch.cuda.memory_allocated(dev)
                        run["gpu_extra_gib"] = (peak - now) / GiB
                        run["gpu_model_gib"] = (now - gpu0) / GiB
                    sd = _model_sd(model)
                    run["local_bytes"] = run.get("local_bytes") or sum(
                        _local(t)[0].numel() * _local(t)[0].element_size() for t in sd.values()
                    )
                    # correctness (not timed)
                    if rep == 0 and not cfg.get("verify", True):
                        run["checked"], run["check"] = 0, "not checked (--no-verify)"
                    elif rep == 0:
                        if path.startswith("sdadapt") and (ref is None or verify_mode == "source" or naming == "fused"):
                            run["checked"] = verify_against_source(model, naming, files, shape)
                            run["check"] = "= source"
                            if naming == "titan" and verify_mode == "ref" and ref is None:
                                hf_of = {titan_name(k): k for k, _ in shape.hf_keys()}
                                ref = {hf_of[k]: _local(t)[0].detach().clone() for k, t in sd.items()}
                        elif verify_mode == "ref" and ref is not None:
                            n = 0
                            for k, t in sd.items():
                                hk = k if naming == "hf" else {titan_name(x): x for x, _ in shape.hf_keys()}[k]
                                if not torch.equal(_local(t)[0].view(torch.int16), ref[hk].view(torch.int16)):
                                    raise AssertionError(f"{k}: differs from the sdadapt result")
                                n += 1
                            run["checked"], run["check"] = n, "= sdadapt"
                        else:
                            run["checked"] = verify_against_source(model, naming, files, shape)
                            run["check"] = "= source"
                    run["ok"] = True
                except BaseException as e:  # noqa: BLE001 - a failing path is a result
                    import traceback

                    run["ok"] = False
                    run["error"] = f"{type(e).__name__}: {e}"[:2000]
                    run["traceback"] = traceback.format_exc()[-3000:]
                    if not isinstance(e, Exception):
                        raise
                finally:
                    model = sd = None  # free this path's model before the next one is built
                    gc.collect()
                out["runs"].append(run)
                Path(cfg["out"], f"rank{rank}.json").write_text(json.dumps(out, indent=1))  # partial results survive a kill
                # keep ranks in step even after a failure on one of them
                flag = torch.tensor([0 if run["ok"] else 1], device=dev)
                dist.all_reduce(flag)
                if flag.item() and run["ok"]:
                    run["note"] = "another rank failed"
                if flag.item():
                    failed.add(path)
        del ref
    _references(cfg, dev, rank, world, out)
    Path(cfg["out"], f"rank{rank}.json").write_text(json.dumps(out, indent=1))


# --- the orchestrator -------------------------------------------------------------------------


def _launch(cfg: dict[str, Any], nproc: int, timeout: float, tag: str) -> dict[str, Any]:
    """Run a worker group (torch.distributed.run) with a timeout; return per-rank results."""
    out = Path(cfg["out"])
    out.mkdir(parents=True, exist_ok=True)
    cfg_path = out / "config.json"
    cfg_path.write_text(json.dumps(cfg))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(MALLOC_MODES[cfg.get("malloc", "default")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(Path(__file__).resolve()), "--worker", str(cfg_path)]
    log_path = out / "log.txt"
    start = time.perf_counter()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
            hung = False
        except subprocess.TimeoutExpired:
            hung = True
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    ranks = []
    for r in range(nproc):
        p = out / f"rank{r}.json"
        ranks.append(json.loads(p.read_text()) if p.exists() else None)
    tail = log_path.read_text(errors="replace")[-4000:]
    return {"tag": tag, "rc": rc, "hung": hung, "seconds": time.perf_counter() - start, "ranks": ranks, "log_tail": tail}


def summarize(groups: list[dict[str, Any]], nproc: int, timeouts: dict[str, float]) -> list[dict[str, Any]]:
    rows = []
    for g in groups:
        ranks = g["ranks"]
        if g["hung"] or any(r is None for r in ranks) or any("fatal" in (r or {}) for r in ranks):
            done = [r for r in ranks if r is not None]
            runs_by = {}
            for r in done:
                for run in r.get("runs", []):
                    runs_by.setdefault((run["layout"], run["path"]), []).append(run)
            paths = g.get("paths", [])
            for layout, path in paths:
                if (layout, path) in runs_by and len(runs_by[(layout, path)]) >= nproc:
                    continue
                why = (f"hang: no result within {timeouts.get(g['tag'], 0):.0f} s, killed" if g["hung"]
                       else "; ".join(r["fatal"].splitlines()[0] for r in done if "fatal" in r) or f"crash (exit {g['rc']})")
                rows.append({"path": path, "layout": layout, "ok": False, "error": why})
        per: dict[tuple[str, str], list[list[dict[str, Any]]]] = {}
        for r in ranks:
            if r is None:
                continue
            for run in r.get("runs", []):
                per.setdefault((run["layout"], run["path"]), [[] for _ in range(nproc)])[r["rank"]].append(run)
        for (layout, path), by_rank in per.items():
            if any(not x for x in by_rank):
                continue
            reps = min(len(x) for x in by_rank)
            ok = all(x[i]["ok"] for x in by_rank for i in range(reps))
            row: dict[str, Any] = {"path": path, "layout": layout, "ok": ok, "repeats": reps}
            if not ok:
                errs = [x[i].get("error") for x in by_rank for i in range(reps) if not x[i]["ok"] and x[i].get("error")]
                row["error"] = errs[0] if errs else "another rank failed"
                rows.append(row)
                continue
            walls = [max(x[i]["wall"] for x in by_rank) for i in range(reps)]
            row["wall_s"] = statistics.median(walls)
            row["wall_all_s"] = walls
            row["per_rank"] = []
            for rk, x in enumerate(by_rank):
                pr = {
                    "rank": rk,
                    "wall_s": statistics.median(y["wall"] for y in x[:reps]),
                    "bytes_read_gib": (x[0]["bytes_read"] / GiB) if "bytes_read" in x[0] else None,
                    "rchar_gib": x[0].get("rchar_gib"),
                    "local_gib": x[0]["local_bytes"] / GiB,
                    "rss_anon_extra_gib": max(y["rss_anon_extra_gib"] for y in x[:reps]),
                    "rss_file_extra_gib": max(y["rss_file_extra_gib"] for y in x[:reps]),
                    "rss_shmem_extra_gib": max(y["rss_shmem_extra_gib"] for y in x[:reps]),
                    "rss_peak_gib": max(y["rss_peak_gib"] for y in x[:reps]),
                    "gpu_extra_gib": max((y.get("gpu_extra_gib") or 0) for y in x[:reps]) if "gpu_extra_gib" in x[0] else None,
                }
                pr["gibps"] = pr["local_gib"] / pr["wall_s"]
                if x[0].get("phases"):
                    pr["phases"] = {k: statistics.median(y["phases"][k] for y in x[:reps]) for k in x[0]["phases"]}
                row["per_rank"].append(pr)
            row["check"] = f"{by_rank[0][0].get('check', '?')} ({sum(x[0].get('checked', 0) for x in by_rank)} shards)"
            rows.append(row)
    return rows


def markdown(result: dict[str, Any]) -> str:
    rows = result["rows"]
    lines = []
    m = result["machine"]
    lines.append(f"Checkpoint: {result['checkpoint']['gib']:.2f} GiB {result['shape']['dtype']} "
                 f"({result['shape']['layers']} layers, hidden {result['shape']['hidden']}, vocab {result['shape']['vocab']}); "
                 f"{result['nproc']} ranks, {result['backend']}; {m['torch']} on {m['host']} ({m['cpus']} CPUs"
                 + (f", {m['gpus']}" if m.get("gpus") else "") + f"); {result.get('cache', 'warm')} page cache; median of {result['repeat']} run(s) each, round-robin over the paths,"
                 + f" after {result.get('warmup', 0)} untimed warm-up load(s) of the first path"
                 + (f"; worker memory: {result['malloc']} (see MALLOC_MODES)." if result.get("malloc", "default") != "default" else "."))
    refs = result.get("refs", {})
    if refs:
        lines.append("References measured in the same run: " + "; ".join(f"{k} {v}" for k, v in refs.items()) + ".")
    lines.append("")
    hdr = ("| path | layout | wall s (slowest rank) | x sdadapt | GiB/s per rank | bytes read / rank GiB | "
           "peak extra RSS anon / file per rank GiB | peak RSS rank 0 GiB | peak extra GPU GiB | check |")
    lines.append(hdr)
    lines.append("|" + "|".join(["---"] * (hdr.count("|") - 1)) + "|")
    base = {r["layout"]: r["wall_s"] for r in rows if r.get("ok") and r["path"] == "sdadapt"}
    for r in rows:
        if not r.get("ok"):
            lines.append(f"| {r['path']} | {r['layout']} | FAILED | | | | | | | {r.get('error', '')[:160].replace('|', '/')} |")
            continue
        pr = r["per_rank"]
        def rng(vals: list[float | None], fmt: str = "{:.2f}") -> str:
            vs = [v for v in vals if v is not None]
            if not vs:
                return "-"
            lo, hi = min(vs), max(vs)
            return fmt.format(lo) if abs(hi - lo) < 0.005 else f"{fmt.format(lo)}-{fmt.format(hi)}"
        b = rng([p["bytes_read_gib"] if p["bytes_read_gib"] is not None else p["rchar_gib"] for p in pr])
        if pr[0]["bytes_read_gib"] is None:
            b += " (read())"
        rel = f"{r['wall_s'] / base[r['layout']]:.2f}" if r["layout"] in base else "-"
        lines.append(
            f"| {r['path']} | {r['layout']} | {r['wall_s']:.3f} | {rel} | {rng([p['gibps'] for p in pr])} | {b} | "
            f"{rng([p['rss_anon_extra_gib'] for p in pr])} / {rng([p['rss_file_extra_gib'] for p in pr])} | "
            f"{pr[0]['rss_peak_gib']:.2f} | {rng([p['gpu_extra_gib'] for p in pr])} | {r.get('check', '')} |"
        )
    split = [r for r in rows if r.get("ok") and r["per_rank"] and r["per_rank"][0].get("phases")]
    if split:
        names = list(split[0]["per_rank"][0]["phases"])
        lines += ["", "sdadapt's own split (`LoadReport.phase_seconds`, seconds, median over repeats, slowest rank; "
                  "`dcp_load` contains `engine`, the engine's planning and reading, which overlap; `engine_plan` is the planning part):", "",
                  "| path | layout | " + " | ".join(names) + " |", "|" + "|".join(["---"] * (len(names) + 2)) + "|"]
        for r in split:
            vals = [max(p["phases"].get(n, 0.0) for p in r["per_rank"]) for n in names]
            lines.append(f"| {r['path']} | {r['layout']} | " + " | ".join(f"{v:.3f}" for v in vals) + " |")
    return "\n".join(lines) + "\n"


def _machine() -> dict[str, Any]:
    import torch

    m = {"host": platform.node(), "cpus": len(os.sched_getaffinity(0)), "torch": f"torch {torch.__version__}",
         "ram_gib": round(_meminfo().get("MemTotal", 0) / GiB, 1)}
    if torch.cuda.is_available():
        m["gpus"] = f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    return m


# glibc settings for the worker processes. Which path of a run gets memory that an earlier path
# freed (already faulted in) and which gets fresh pages (one page fault per 4 KiB on first
# write, which costs more than reading from the page cache) otherwise depends on glibc's
# dynamic mmap/trim thresholds, i.e. on luck. "fresh": every tensor of 128 KiB or more is its
# own mapping, returned on free: every load writes into fresh pages, as a job's first load does.
# "reuse": memory is kept and reused (tensors over 32 MiB still get fresh pages).
MALLOC_MODES: dict[str, dict[str, str]] = {
    "default": {},
    "fresh": {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)},
    "reuse": {"MALLOC_MMAP_THRESHOLD_": str(32 * MiB), "MALLOC_TRIM_THRESHOLD_": str(64 * GiB)},
}

ALL_PATHS = ["sdadapt", "sdadapt-fused", "sdadapt-torchsave", "sdadapt-dcp", "rank0-broadcast", "hf-reader", "dcp-native"]
TP_PATHS = ["sdadapt", "hf-reader"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="2g")
    for f in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab"):
        ap.add_argument(f"--{f.replace('_', '-')}", type=int, help=f"override the preset's {f}")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--shard-gb", type=float, default=5.0, help="HF shard size (GB), like save_pretrained's max_shard_size")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--backend", default=None, help="gloo (CPU) or nccl (GPU); default: nccl when CUDA is available")
    ap.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temp folder)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint (and reuse one written with the same settings)")
    ap.add_argument("--paths", default=",".join(ALL_PATHS), help="comma list of FSDP paths")
    ap.add_argument("--tp-paths", default=",".join(TP_PATHS), help="comma list of TP paths ('' for none)")
    ap.add_argument("--hsdp-paths", default="", help="comma list of paths on an HSDP mesh of replicas only, "
                    "e.g. sdadapt,sdadapt-shared (share_reads=True),hf-reader ('' for none)")
    ap.add_argument("--discussion", default="materialized,meta", help="torchsave-broadcast variants to run ('' for none)")
    ap.add_argument("--discussion-timeout", type=float, default=300.0)
    ap.add_argument("--timeout", type=float, default=3000.0, help="timeout of the main worker group (s)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--malloc", choices=sorted(MALLOC_MODES), default="default",
                    help="glibc memory reuse between loads in the workers (see MALLOC_MODES); default: glibc's own")
    ap.add_argument("--warmup", type=int, default=1, help="untimed loads of the first path before timing (default 1)")
    ap.add_argument("--assume-ram-gib", type=float, default=None,
                    help="RAM to plan with (machines whose memory grows on demand report too little)")
    ap.add_argument("--no-references", action="store_true")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before every load (root only)")
    ap.add_argument("--no-verify", action="store_true", help="skip the bit-exact checks (tuning runs only)")
    ap.add_argument("--out", default=str(HERE / "out" / "load_bench"), help="output prefix: writes PREFIX.json and PREFIX.md")
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0

    import torch

    shape = PRESETS[args.preset]
    shape = Shape(**{**asdict(shape), **{k: v for k, v in vars(args).items() if k in asdict(shape) and v is not None}})
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and torch.cuda.device_count() < args.nproc:
        raise BenchError(f"--backend nccl needs {args.nproc} GPUs, found {torch.cuda.device_count()}")
    if str(ROOT / "src") not in sys.path:  # the workers get it on PYTHONPATH; this process checks imports
        sys.path.insert(0, str(ROOT / "src"))
    fsdp_paths = [p for p in args.paths.split(",") if p]
    tp_paths = [p for p in args.tp_paths.split(",") if p]
    variants = [v for v in args.discussion.split(",") if v]
    formats = ["safetensors"]
    if "sdadapt-torchsave" in fsdp_paths or variants:
        formats.append("torch.save")
    if "sdadapt-dcp" in fsdp_paths or "dcp-native" in fsdp_paths:
        formats.append("dcp")
    if "sdadapt-dcp" in fsdp_paths:
        try:
            import sdadapt.sources._dcp_dir  # noqa: F401
        except ImportError:
            print("sdadapt-dcp: the DCP source (sdadapt.sources._dcp_dir) is not available here; skipped", file=sys.stderr)
            fsdp_paths.remove("sdadapt-dcp")

    base = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    folder = base / f"sdadapt-bench-{_stamp(shape, args.shard_gb, formats)}"
    reuse = args.keep and (folder / "DONE").exists()
    facts = check_fits(base, shape, [] if reuse else formats, args.nproc, args.assume_ram_gib) if not reuse else {}
    created = False
    try:
        t0 = time.perf_counter()
        if reuse:
            files = json.loads((folder / "DONE").read_text())
            print(f"reusing {folder}", file=sys.stderr)
        else:
            if folder.exists():
                shutil.rmtree(folder)
            folder.mkdir(parents=True)
            created = True
            files = write_checkpoint(folder, shape, args.shard_gb, formats)
            (folder / "DONE").write_text(json.dumps(files))
            os.sync()  # no write-back of the new files during the timed loads
        write_s = time.perf_counter() - t0
        if args.cold:
            drop_caches()  # refuses here, before any worker starts, where it is not allowed
            warm = 0.0
        else:
            warm = warm_cache(list(files.values()))
        print(f"checkpoint {shape.nbytes() / GiB:.2f} GiB x {len(files)} formats ready in {write_s:.1f} s; "
              f"cache warmed at {warm:.1f} GiB/s", file=sys.stderr)
        out_prefix = Path(args.out)
        work = Path(tempfile.mkdtemp(prefix="sdadapt-bench-run-"))
        common = {"shape": asdict(shape), "backend": backend, "files": files, "repeat": args.repeat, "cold": args.cold,
                  "verify": not args.no_verify, "warmup": args.warmup, "malloc": args.malloc}
        layouts = {"fsdp": fsdp_paths}
        if tp_paths:
            layouts["tp"] = tp_paths
        hsdp_paths = [p for p in args.hsdp_paths.split(",") if p]
        if hsdp_paths:
            layouts["hsdp"] = hsdp_paths
        groups = []
        timeouts = {"main": args.timeout}
        main_cfg = {**common, "layouts": layouts, "out": str(work / "main"), "references": not args.no_references and not args.cold}
        g = _launch(main_cfg, args.nproc, args.timeout, "main")
        g["paths"] = [(lay, p) for lay, ps in layouts.items() for p in ps]
        groups.append(g)
        for v in variants:
            name = {"materialized": "torchsave-broadcast", "meta": "torchsave-broadcast-meta"}[v]
            tag = name
            timeouts[tag] = args.discussion_timeout
            cfg = {**common, "layouts": {"fsdp": [name]}, "out": str(work / tag), "repeat": 1, "references": False,
                   "pg_timeout": int(args.discussion_timeout) + 60,
                   "dump_after": max(1.0, args.discussion_timeout * 0.6)}
            g = _launch(cfg, args.nproc, args.discussion_timeout, tag)
            g["paths"] = [("fsdp", name)]
            groups.append(g)
        rows = summarize(groups, args.nproc, timeouts)
        refs: dict[str, str] = {}
        ranks0 = groups[0]["ranks"]
        if ranks0 and all(r is not None for r in ranks0) and ranks0[0].get("refs"):
            pc = [r["refs"].get("page_cache_read_gibps") for r in ranks0]
            refs["page-cache read (GiB/s per rank, all ranks at once)"] = "/".join(f"{x:.1f}" for x in pc) + \
                f" with {ranks0[0]['refs'].get('page_cache_read_threads')} threads each"
            if ranks0[0]["refs"].get("pinned_pipeline_gibps"):
                refs["pread into pinned buffers + host-to-GPU copy, overlapped (GiB/s per rank, all at once)"] = "/".join(
                    f"{r['refs']['pinned_pipeline_gibps']:.1f}" for r in ranks0) + \
                    f" with {ranks0[0]['refs'].get('page_cache_read_threads')} threads each"
            if ranks0[0]["refs"].get("pinned_h2d_gibps"):
                refs["pinned host-to-GPU (GiB/s per rank, all at once)"] = "/".join(
                    f"{r['refs']['pinned_h2d_gibps']:.1f}" for r in ranks0)
        if not args.cold:
            refs["first read of all files after writing (8 threads)"] = f"{warm:.1f} GiB/s"
        result = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": _machine(),
            "shape": asdict(shape),
            "checkpoint": {"gib": shape.nbytes() / GiB, "formats": formats, "shard_gb": args.shard_gb, **facts},
            "nproc": args.nproc,
            "backend": backend,
            "repeat": args.repeat,
            "warmup": args.warmup,
            "malloc": args.malloc,
            "cache": "cold (dropped before every load)" if args.cold else "warm",
            "refs": refs,
            "rows": rows,
            "groups": [{k: v for k, v in g.items() if k != "ranks"} | {"ranks": g["ranks"]} for g in groups],
        }
        out_prefix.parent.mkdir(parents=True, exist_ok=True)
        Path(f"{out_prefix}.json").write_text(json.dumps(result, indent=1, default=str))
        md = markdown(result)
        Path(f"{out_prefix}.md").write_text(md)
        print(md)
        shutil.rmtree(work, ignore_errors=True)
        return 0 if all(r.get("ok") for r in rows if not r["path"].startswith("torchsave-broadcast")) else 1
    finally:
        if (created or reuse) and not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as e:
        print(f"load_bench: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
