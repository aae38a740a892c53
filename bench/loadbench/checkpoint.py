"""The synthetic checkpoint on disk: refuse a size that cannot fit, write it once in every format
asked for (HF sharded safetensors, one ``torch.save`` file, a DCP folder, and the quantized twins:
the same values quantized as each release ships them, here the FP8 twin with float32 128x128
block scales and compressed-tensors' FP8 per channel and NVFP4, the other formats in
:mod:`loadbench.twins`), warm or drop the page cache."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path

from .common import BenchError, GiB, MiB, meminfo
from .references import parallel_read
from .shapes import CT_QUANTIZATION_CONFIGS, FP8_QUANTIZATION_CONFIG, Shape
from .twins import TWINS, nbytes, quantized_twin, write_twin

QUANTIZED_BYTES_PER_VALUE = {
    "safetensors-fp8": 1 + 4 / (128 * 128), "safetensors-fp8ch": 1.01, "safetensors-nvfp4": 0.5 + 1 / 16,
    "safetensors-fp8tensor": 1.0, "safetensors-int8ch": 1.01, "safetensors-w4a16": 0.5 + 2 / 128,
    "safetensors-w4a16asym": 0.5 + 2.5 / 128, "safetensors-mxfp8": 1 + 1 / 32, "safetensors-fp8block": 1 + 2 / (128 * 128),
    "safetensors-w8a16": 1 + 2 / 128, "safetensors-mxfp8e8m0": 1 + 1 / 32, "safetensors-fp8static": 1.0,
    "safetensors-nvfp4modelopt": 0.5 + 1 / 16, "safetensors-fp8modelopt": 1.0,
}  # fmt: skip
"""Bytes stored per quantized value (values and their scales, zero points) of each quantized twin."""


def format_nbytes(shape: Shape, fmt: str) -> int:
    """About how many bytes ``fmt`` stores for ``shape``: the whole checkpoint, or for a quantized
    twin its quantized matrices at their bytes per value and the other tensors as they are."""
    size = shape.nbytes()
    per_value = QUANTIZED_BYTES_PER_VALUE.get(fmt)
    if per_value is None:
        return size
    sizes = dict(shape.hf_keys())
    values = sum(math.prod(sizes[k]) for k in shape.fp8_keys())
    return int(size - values * shape.itemsize() + values * per_value)


def check_fits(folder: Path, shape: Shape, formats: list[str], nproc: int, assume_ram_gib: float | None) -> dict[str, float]:
    """Refuse (before writing anything) a checkpoint that cannot fit the disk or the memory."""
    size = shape.nbytes()
    need_disk = int(sum(format_nbytes(shape, f) for f in formats) * 1.05) + 64 * MiB  # headers, rounding
    probe = folder
    while not probe.exists():
        probe = probe.parent
    free_disk = shutil.disk_usage(probe).free
    # writing holds the whole state dict once; the rank-0 baseline holds it again next to its
    # shard; every rank holds its shard (and, on GPU runs, nothing more on the host)
    need_ram = int(size * 2.2) + nproc * 512 * MiB
    ram = assume_ram_gib * GiB if assume_ram_gib else meminfo().get("MemAvailable", 0)
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


def stamp(shape: Shape, shard_gb: float, formats: list[str]) -> str:
    """A name for a checkpoint folder written with these settings (``--keep`` reuses it)."""
    return hashlib.sha1(json.dumps([asdict(shape), shard_gb, sorted(formats), 2]).encode()).hexdigest()[:12]


def checkpoint_paths(folder: Path) -> dict[str, str]:
    """Where each format of the checkpoint lies under ``folder`` (format -> path)."""
    return {"safetensors": str(folder / "hf"), "torch.save": str(folder / "model.pt"), "dcp": str(folder / "dcp"),
            "safetensors-fp8": str(folder / "hf-fp8"), "safetensors-fp8ch": str(folder / "hf-fp8ch"),
            "safetensors-nvfp4": str(folder / "hf-nvfp4"), **{f"safetensors-{t}": str(folder / f"hf-{t}") for t in TWINS}}


def write_checkpoint(folder: Path, shape: Shape, shard_gb: float, formats: list[str], seed: int = 0) -> dict[str, str]:
    """Write the checkpoint in each format under ``folder``; return format -> path."""
    import torch

    dtype = getattr(torch, shape.dtype)
    paths = checkpoint_paths(folder)
    # a pool of random values; each tensor is a window of it at its own offset (cheap, and no
    # two tensors alike)
    pool_n = 32 * MiB + 7
    if torch.cuda.is_available():
        pool = torch.randn(pool_n, generator=torch.Generator("cuda").manual_seed(seed), device="cuda").to(dtype).cpu()
    else:
        pool = torch.empty(pool_n, dtype=dtype).normal_(generator=torch.Generator().manual_seed(seed))
    sd: dict[str, torch.Tensor] = {}
    for idx, (k, s) in enumerate(shape.hf_keys()):
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
        _write_hf_shards(paths["safetensors"], sd, shard_gb, shape.nbytes())
    if "torch.save" in formats:
        torch.save(sd, paths["torch.save"])
    if "dcp" in formats:
        import torch.distributed.checkpoint as dcp

        dcp.save(sd, storage_writer=dcp.FileSystemWriter(paths["dcp"], thread_count=4))
    if "safetensors-fp8" in formats:
        _write_fp8_twin(paths["safetensors-fp8"], sd, shape, shard_gb)
    for fmt in ("safetensors-fp8ch", "safetensors-nvfp4"):
        if fmt in formats:
            _write_ct_twin(paths[fmt], sd, shape, shard_gb, fmt.removeprefix("safetensors-"))
    for twin in TWINS:
        if f"safetensors-{twin}" in formats:
            write_twin(paths[f"safetensors-{twin}"], sd, set(shape.fp8_keys()), shape.dtype, twin,
                       lambda folder, tensors, total: _write_hf_shards(folder, tensors, shard_gb, total))
    del sd
    return {f: paths[f] for f in formats}


def _write_fp8_twin(folder: str, sd: dict, shape: Shape, shard_gb: float) -> None:
    """The FP8 release of ``sd``: :meth:`Shape.fp8_keys` as ``float8_e4m3fn`` + float32
    ``weight_scale_inv`` (sdadapt's quantizer, on the GPU when there is one), the rest as is,
    ``config.json`` with its ``quantization_config``."""
    import torch

    from sdadapt._recipes import quant as Q

    block = tuple(FP8_QUANTIZATION_CONFIG["weight_block_size"])

    def stored_of(x: torch.Tensor) -> dict[str, torch.Tensor]:
        w, s = Q.quantize_fp8(x, block, "float32")  # type: ignore[arg-type]
        return {"weight": w, "weight" + Q.FP8_SCALE_SUFFIX: s}

    twin = quantized_twin(sd, set(shape.fp8_keys()), stored_of)
    _write_hf_shards(folder, twin, shard_gb, nbytes(twin))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "torch_dtype": shape.dtype, "quantization_config": FP8_QUANTIZATION_CONFIG}, f)


def _write_ct_twin(folder: str, sd: dict, shape: Shape, shard_gb: float, kind: str) -> None:
    """A compressed-tensors release of ``sd`` (the layout llm-compressor writes): ``kind="fp8ch"``,
    FP8 per output channel (``FP8_DYNAMIC``: e4m3 ``weight`` + bf16 ``weight_scale [R, 1]``);
    ``"nvfp4"``, NVFP4 (``weight_packed`` uint8, e4m3 ``weight_scale`` per 16 values,
    ``weight_global_scale``). The layers' matrices are quantized (sdadapt's quantizers, on the GPU
    when there is one), the rest kept; ``config.json`` carries the compressed-tensors config."""
    import torch

    from sdadapt._recipes import quant_scaled as S

    def stored_of(x: torch.Tensor) -> dict[str, torch.Tensor]:
        if kind == "fp8ch":
            w, s = S.quantize_fp8_scaled(x, (1, x.shape[-1]), torch.bfloat16)
            return {"weight": w, "weight_scale": s}
        glob = (S.E4M3_MAX * S.E2M1_MAX / x.float().abs().amax()).reshape(1)
        packed, s = S.quantize_nvfp4(x, glob, "divide")
        return {"weight_packed": packed, "weight_scale": s, "weight_global_scale": glob}

    twin = quantized_twin(sd, set(shape.fp8_keys()), stored_of)
    _write_hf_shards(folder, twin, shard_gb, nbytes(twin))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "torch_dtype": shape.dtype, "quantization_config": CT_QUANTIZATION_CONFIGS[kind]}, f)


def _write_hf_shards(folder: str, sd: dict, shard_gb: float, total: int) -> None:
    """HF sharded safetensors of at most ``shard_gb`` GB each, with ``model.safetensors.index.json``."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    limit = int(shard_gb * 1e9)
    shards: list[dict] = [{}]
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
        save_file(shard, os.path.join(folder, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)


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
    parallel_read([(f, 0, os.path.getsize(f)) for f in files], threads)
    return total / GiB / max(1e-9, time.perf_counter() - start)


def drop_caches() -> None:
    """Empty the page cache (root only): the next reads come from the disk."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as e:
        raise BenchError(f"--cold needs to drop the page cache, which this machine does not allow ({e})") from None
