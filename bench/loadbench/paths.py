"""The load paths compared, each as a model to prepare (untimed) and a load to time:

- ``sdadapt`` (rename-only adapter into torchtitan names), ``sdadapt-fused`` (q/k/v -> ``wqkv``,
  gate/up -> ``w13``), ``sdadapt-torchsave`` and ``sdadapt-dcp`` (other sources), ``sdadapt-shared``
  (``share_reads=True``);
- ``rank0-broadcast``: rank 0 ``safetensors.torch.load_file`` + ``set_model_state_dict(
  full_state_dict=True, broadcast_from_rank0=True)``;
- ``sdadapt-fp8ch`` / ``sdadapt-nvfp4``: the compressed-tensors twins (FP8 per output channel with
  bf16 ``weight_scale``; NVFP4 ``weight_packed`` + e4m3 ``weight_scale`` + ``weight_global_scale``)
  through ``sdadapt.dequant_rules``;
- ``sdadapt-fp8``: the FP8 twin (e4m3 + float32 128x128 ``weight_scale_inv``) through
  ``sdadapt.dequant_rules`` + the rename adapter, dequantised on load into the same bf16 model;
- ``hf-reader``: ``dcp.load`` + ``HuggingFaceStorageReader(thread_count=8)`` (names 1:1);
- ``hf-fp8-reader``: ``dcp.load`` of the FP8 twin + torch's ``QuantizedHuggingFaceStorageReader(
  thread_count=8, target_dtype=bfloat16, block_size=128)`` (names 1:1);
- ``dcp-native``: ``dcp.load`` of the DCP folder (names 1:1; a reference for resumes);
- ``torchsave-broadcast`` / ``-meta``: ``BroadcastingTorchSaveReader`` + ``DynamicMetaLoadPlanner``
  (the user discussion's path), model materialised without values first / left on meta.

Two flows: ``meta`` (the model is built on meta and parallelised; whatever the path needs to
materialise it is timed) and ``materialized`` (the model holds values before the timed load:
``to_empty`` + init, as torchtitan's flow does)."""

from __future__ import annotations

import importlib
import json
import os
import time
from dataclasses import dataclass
from typing import Any

from .common import BenchError
from .models import build_model, materialize_with_values, parallelize
from .shapes import Shape, adapter_for

ALL_PATHS = ["sdadapt", "sdadapt-fused", "sdadapt-torchsave", "sdadapt-dcp", "sdadapt-fp8", "sdadapt-fp8ch", "sdadapt-nvfp4",
             "rank0-broadcast", "hf-reader",
             "hf-fp8-reader", "dcp-native"]
FP8_PATHS = ("sdadapt-fp8", "hf-fp8-reader")  # they read the FP8 twin
QUANT_FORMATS = {"sdadapt-fp8": "safetensors-fp8", "hf-fp8-reader": "safetensors-fp8",
                 "sdadapt-fp8ch": "safetensors-fp8ch", "sdadapt-nvfp4": "safetensors-nvfp4"}
"""Paths that read a quantized twin, and which: FP8 block scales, compressed-tensors FP8 per
channel (``FP8_DYNAMIC``), compressed-tensors NVFP4."""
TP_PATHS = ["sdadapt", "hf-reader"]
MATERIALIZED_PATHS = ["sdadapt", "hf-reader"]
DISCUSSION_PATHS = {"materialized": "torchsave-broadcast", "meta": "torchsave-broadcast-meta"}
FLOWS = ("meta", "materialized")

# imported by every worker before anything is timed, so that no path's first load pays for an
# import that another path's process already made
LIBRARIES = [
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.checkpoint.format_utils",
    "torch.distributed.fsdp",
    "torch.distributed.tensor.parallel",
    "safetensors.torch",
    "sdadapt",
]


@dataclass(frozen=True)
class Job:
    """One row of the results: a path, on a layout, in a flow, under a variant (``--variant``:
    other engine settings or another sdadapt tree; ``""``, the run's own)."""

    layout: str
    path: str
    flow: str = "meta"
    variant: str = ""

    @property
    def tag(self) -> str:
        return f"{self.layout}-{self.path}" + ("-materialized" if self.flow == "materialized" else "") + \
            (f"@{self.variant}" if self.variant else "")


def import_libraries() -> list[str]:
    """Import :data:`LIBRARIES`; returns their names. sdadapt imports its public names on first
    use, so every one of them is touched here: the timed loads then measure loading, not imports."""
    for name in LIBRARIES:
        mod = importlib.import_module(name)
        for public in getattr(mod, "__all__", []) if name == "sdadapt" else []:
            getattr(mod, public)
    return list(LIBRARIES)


def naming_of(path: str) -> str:
    """Key naming of the model a path loads into: ``fused``, ``titan`` (sdadapt) or ``hf`` (1:1 loaders)."""
    if path == "sdadapt-fused":
        return "fused"
    return "titan" if path.startswith("sdadapt") else "hf"


def source_format(path: str) -> str:
    """The checkpoint format a path reads: ``safetensors-fp8`` (the FP8 twin), ``torch.save``,
    ``dcp`` or ``safetensors``."""
    if path in QUANT_FORMATS:
        return QUANT_FORMATS[path]
    return {"sdadapt-torchsave": "torch.save", "sdadapt-dcp": "dcp", "dcp-native": "dcp"}.get(path, "safetensors")


def adapter_of(path: str, files: dict[str, str]) -> Any:
    """The sdadapt adapter that maps what ``path`` reads to the model it loads into (with the
    dequant rules for the FP8 twin); also the eager reference's recipe."""
    return adapter_for(naming_of(path), files[QUANT_FORMATS[path]] if path in QUANT_FORMATS else None)


def prepare(job: Job, shape: Shape, dev: Any, seed: int = 1) -> Any:
    """The model ``job`` loads into, built on meta and parallelised, with values in the
    ``materialized`` flow. Untimed."""
    if job.flow not in FLOWS:
        raise BenchError(f"unknown flow {job.flow!r}")
    naming = naming_of(job.path)
    model, blocks = build_model(shape, naming)
    parallelize(model, blocks, naming, job.layout, dev.type)
    if job.flow == "materialized":
        materialize_with_values(model, dev, seed)
    return model


def model_sd(model: Any) -> dict[str, Any]:
    """The model's state dict as DCP sees it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model)


def local_of(t: Any) -> tuple[Any, tuple[int, ...]]:
    """(local tensor, global offsets) of a DTensor or a plain tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        chunks = t.__create_chunk_list__()
        return t.to_local(), tuple(chunks[0].offsets) if chunks else (0,) * t.dim()
    return t, (0,) * t.dim()


def timed_load(model: Any, job: Job, files: dict[str, str], dev: Any) -> dict[str, Any]:
    """Load the checkpoint into ``model`` by ``job.path``, timed from here (all ranks start
    together) to the last byte on the device. Returns facts, ``wall`` among them."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import sdadapt

    path, meta = job.path, job.flow == "meta"
    facts: dict[str, Any] = {}
    dist.barrier()
    t0 = time.perf_counter()
    if path.startswith("sdadapt"):
        rep = sdadapt.load(model, files[source_format(path)], adapter_of(path, files), share_reads=path == "sdadapt-shared")
        facts.update(bytes_read=rep.bytes_read, plan_seconds=rep.plan_seconds, read_seconds=rep.read_seconds,
                     phases={**rep.phase_seconds, **{f"threads_{k}": v for k, v in rep.engine_thread_seconds.items()}},
                     local_bytes=rep.local_bytes)
    elif path == "rank0-broadcast":
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        if meta:
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

        if meta:
            model.to_empty(device=dev)
        dcp.load(model_sd(model), storage_reader=HuggingFaceStorageReader(files["safetensors"], thread_count=8))
    elif path == "hf-fp8-reader":
        from torch.distributed.checkpoint import QuantizedHuggingFaceStorageReader

        if meta:
            model.to_empty(device=dev)
        reader = QuantizedHuggingFaceStorageReader(files["safetensors-fp8"], thread_count=8, target_dtype=torch.bfloat16,
                                                   block_size=128)
        dcp.load(model_sd(model), storage_reader=reader)
    elif path == "dcp-native":
        if meta:
            model.to_empty(device=dev)
        dcp.load(model_sd(model), checkpoint_id=files["dcp"])
    elif path in DISCUSSION_PATHS.values():
        from torch.distributed.checkpoint.format_utils import BroadcastingTorchSaveReader, DynamicMetaLoadPlanner
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        if path == "torchsave-broadcast" and meta:
            model.to_empty(device=dev)  # materialised first; the discussion's script did not
        sd = model_sd(model)
        dcp.load(sd, storage_reader=BroadcastingTorchSaveReader(files["torch.save"]), planner=DynamicMetaLoadPlanner())
        set_model_state_dict(model, sd)
    else:
        raise BenchError(f"unknown path {path!r}")
    if dev.type == "cuda":
        torch.cuda.synchronize()
    facts["wall"] = time.perf_counter() - t0
    return facts


def verify_against_source(model: Any, path: str, files: dict[str, str]) -> int:
    """Every local shard equals the recipe applied eagerly to the full source tensors (bit-exact):
    for the FP8 twin, the whole-tensor dequantisation ``float(w) * scale_inv`` in float32, rounded
    once to bf16, which is what each FP8 path computes; returns the number of shards checked."""
    import torch

    import sdadapt
    from sdadapt._target import model_state_dict, schema_of

    src = sdadapt.open_source(files[QUANT_FORMATS.get(path, "safetensors")])
    threads = torch.get_num_threads()  # 1 (OMP_NUM_THREADS) while timing; the check is untimed
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    try:
        plan = sdadapt.build_plan(src.schema, schema_of(model_state_dict(model)), adapter_of(path, files))
        checked = 0
        for k, t in model_sd(model).items():
            local, off = local_of(t)
            full = plan.recipes[k].full(src)
            want = full[tuple(slice(o, o + n) for o, n in zip(off, local.shape, strict=True))]
            if not torch.equal(local.cpu().view(torch.int16), want.view(torch.int16)):
                raise AssertionError(f"{k}: loaded shard differs from the source")
            checked += 1
        return checked
    finally:
        torch.set_num_threads(threads)
        src.close()
