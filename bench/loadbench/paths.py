"""The load paths compared, each as a model to prepare (untimed) and a load to time:

- ``sdadapt`` (rename-only adapter into torchtitan names), ``sdadapt-fused`` (q/k/v -> ``wqkv``,
  gate/up -> ``w13``), ``sdadapt-torchsave`` and ``sdadapt-dcp`` (other sources), ``sdadapt-shared``
  (``share_reads=True``);
- ``rank0-broadcast``: rank 0 ``safetensors.torch.load_file`` + ``set_model_state_dict(
  full_state_dict=True, broadcast_from_rank0=True)``;
- ``sdadapt-fp8ch`` / ``sdadapt-nvfp4``: the compressed-tensors twins (FP8 per output channel with
  bf16 ``weight_scale``; NVFP4 ``weight_packed`` + e4m3 ``weight_scale`` + ``weight_global_scale``)
  through ``sdadapt.dequant_rules``;
- :data:`QUANT_TWIN_PATHS`, the twins of :mod:`loadbench.twins`, each in the layout its tool
  writes: ``sdadapt-fp8tensor`` (compressed-tensors FP8, one scale per tensor),
  ``sdadapt-int8ch`` (compressed-tensors ``int-quantized`` int8 per channel),
  ``sdadapt-w4a16`` / ``sdadapt-w4a16asym`` (compressed-tensors ``pack-quantized`` int4, scales
  per group of 128, the second with zero points), ``sdadapt-mxfp8`` (e4m3 + one e8m0 exponent per
  32), ``sdadapt-fp8block`` (compressed-tensors FP8 in 128x128 blocks), ``sdadapt-w8a16``
  (compressed-tensors ``pack-quantized`` int8, scales per group of 128), ``sdadapt-mxfp8e8m0``
  (MXFP8 with its exponents stored as ``F8_E8M0``), ``sdadapt-fp8static`` (``quant_method: fp8``,
  one ``weight_scale_inv`` per tensor), ``sdadapt-nvfp4modelopt`` (ModelOpt NVFP4,
  ``hf_quant_config.json``), ``sdadapt-fp8modelopt`` (ModelOpt FP8, one ``weight_scale`` per tensor), through
  ``sdadapt.dequant_rules`` + the rename adapter;
- ``sdadapt-fp8``: the FP8 twin (e4m3 + float32 128x128 ``weight_scale_inv``) through
  ``sdadapt.dequant_rules`` + the rename adapter, dequantised on load into the same bf16 model;
- ``hf-reader``: ``dcp.load`` + ``HuggingFaceStorageReader(thread_count=8)`` (names 1:1);
- ``hf-fp8-reader``: ``dcp.load`` of the FP8 twin + torch's ``QuantizedHuggingFaceStorageReader(
  thread_count=8, target_dtype=bfloat16, block_size=128)`` (names 1:1);
- ``dcp-native``: ``dcp.load`` of the DCP folder (names 1:1; a reference for resumes);
- ``torchsave-broadcast`` / ``-meta``: ``BroadcastingTorchSaveReader`` + ``DynamicMetaLoadPlanner``
  (the user discussion's path), model materialised without values first / left on meta;
- raw loaders (:data:`RAW_PATHS`, layout ``raw``, no model): every tensor of the bf16 checkpoint
  to the rank's device as a dict, the reference for moving the bytes alone: ``instanttensor``
  (InstantTensor's ``safe_open`` over all shards in one call, buffered I/O: io_uring on the page
  cache), ``instanttensor-mmap`` (its ``MMAP`` backend), ``instanttensor-direct`` (its default
  backend for disk files: O_DIRECT io_uring/AIO, which bypasses the page cache),
  ``safetensors-gpu`` (``safetensors.safe_open(device="cuda:N")`` + ``get_tensor`` per key), and
  ``kvikio`` (every tensor's bytes read by ``kvikio.CuFile.pread`` straight into its own device
  tensor, all reads queued at once, with the pool size and task size sdadapt gives kvikio: the
  rank's CPUs, 16 MiB).

Two flows: ``meta`` (the model is built on meta and parallelised; whatever the path needs to
materialise it is timed) and ``materialized`` (the model holds values before the timed load:
``to_empty`` + init, as torchtitan's flow does)."""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from .common import BenchError
from .memory import GcClock
from .models import build_model, materialize_with_values, parallelize
from .shapes import Shape, adapter_for
from .twins import TWINS, FormatReference

QUANT_TWIN_PATHS = [f"sdadapt-{t}" for t in TWINS]
"""The paths of ``twins``' quantized twins, one per format."""
ALL_PATHS = ["sdadapt", "sdadapt-fused", "sdadapt-torchsave", "sdadapt-dcp", "sdadapt-fp8", "sdadapt-fp8ch", "sdadapt-nvfp4",
             *QUANT_TWIN_PATHS, "rank0-broadcast", "hf-reader", "hf-fp8-reader", "dcp-native"]
FP8_PATHS = ("sdadapt-fp8", "hf-fp8-reader")  # they read the FP8 twin
# raw loaders -> InstantTensor's backend argument (None: its default; safetensors-gpu: not InstantTensor)
RAW_PATHS: dict[str, str | None] = {"instanttensor": "BUFFERED", "instanttensor-mmap": "MMAP", "instanttensor-direct": None,
                                    "safetensors-gpu": None, "kvikio": None}
QUANT_FORMATS = {"sdadapt-fp8": "safetensors-fp8", "hf-fp8-reader": "safetensors-fp8",
                 "sdadapt-fp8ch": "safetensors-fp8ch", "sdadapt-nvfp4": "safetensors-nvfp4",
                 **{f"sdadapt-{t}": f"safetensors-{t}" for t in TWINS}}
"""Paths that read a quantized twin, and which: FP8 block scales, compressed-tensors FP8 per
channel (``FP8_DYNAMIC``), compressed-tensors NVFP4, and each twin of :mod:`loadbench.twins`
(compressed-tensors FP8 per tensor and in 128x128 blocks, int8 per channel, int4 W4A16 with and
without zero points, packed int8 W8A16, MXFP8 with U8 and F8_E8M0 exponents; per-tensor FP8
``quant_method: fp8``; ModelOpt NVFP4 and FP8)."""
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
# ``--import-in-load``: only what a job imports to build and shard its model is imported before
# timing; each loader's own import (sdadapt and what it needs, InstantTensor, safetensors, DCP)
# then happens inside the timed first load, as a user's first call sees it
USER_LIBRARIES = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor.parallel"]


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


def import_libraries(in_load: bool = False, path: str = "") -> list[str]:
    """Import :data:`LIBRARIES` (and InstantTensor for its rows); returns their names. sdadapt
    imports its public names on first use, so every one of them is touched here: the timed loads
    then measure loading, not imports. ``in_load``: only :data:`USER_LIBRARIES` (the loaders'
    imports are then timed with their first load)."""
    names = list(USER_LIBRARIES if in_load else LIBRARIES)
    if path.startswith("instanttensor") and not in_load:
        names.append("instanttensor")
    for name in names:
        mod = importlib.import_module(name)
        for public in getattr(mod, "__all__", []) if name == "sdadapt" else []:
            getattr(mod, public)
    return names


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
    return adapter_for(naming_of(path), files[QUANT_FORMATS[path]] if path in QUANT_FORMATS else None, files["safetensors"])


def prepare(job: Job, shape: Shape, dev: Any, seed: int = 1) -> Any:
    """The model ``job`` loads into, built on meta and parallelised, with values in the
    ``materialized`` flow (``None`` for a raw loader, which loads into a dict). Untimed."""
    if job.path in RAW_PATHS:
        return None
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
    together) to the last byte on the device. Returns facts, ``wall`` among them, and the cycle
    collector's runs inside (``gc``; ``import_gc``: those inside sdadapt's imports)."""
    import torch.distributed as dist

    facts: dict[str, Any] = {}
    dist.barrier()
    with GcClock() as clock:
        t0 = time.perf_counter()
        _timed(model, job, files, dev, facts, t0)
        facts["wall"] = time.perf_counter() - t0
    facts["gc"] = clock.summary()  # collections inside the timed load, a loader's imports included
    if "import_end" in facts:
        facts["import_gc"] = clock.summary(facts.pop("import_end"))
    return facts


def _timed(model: Any, job: Job, files: dict[str, str], dev: Any, facts: dict[str, Any], t0: float) -> None:
    """:func:`timed_load`'s timed region: the load by ``job.path``, to the last byte on the device."""
    import torch
    import torch.distributed as dist

    path, meta = job.path, job.flow == "meta"
    if path in RAW_PATHS:
        facts["_loaded"] = _raw_load(path, files["safetensors"], dev, facts, t0)
    elif path.startswith("sdadapt"):
        c0 = time.process_time()
        import sdadapt  # inside the timing: with --import-in-load, the user's first import is part of the load

        load, adapter = sdadapt.load, adapter_of(path, files)
        facts["import_end"] = time.perf_counter()
        facts["import_s"] = facts["import_end"] - t0  # sdadapt's imports (and building the adapter)
        facts["import_cpu_s"] = time.process_time() - c0
        known = len(sys.modules)
        rep = load(model, files[source_format(path)], adapter, share_reads=path == "sdadapt-shared")
        facts["modules_imported_by_call"] = len(sys.modules) - known
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
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        if meta:
            model.to_empty(device=dev)
        dcp.load(model_sd(model), storage_reader=HuggingFaceStorageReader(files["safetensors"], thread_count=8))
    elif path == "hf-fp8-reader":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import QuantizedHuggingFaceStorageReader

        if meta:
            model.to_empty(device=dev)
        reader = QuantizedHuggingFaceStorageReader(files["safetensors-fp8"], thread_count=8, target_dtype=torch.bfloat16,
                                                   block_size=128)
        dcp.load(model_sd(model), storage_reader=reader)
    elif path == "dcp-native":
        import torch.distributed.checkpoint as dcp

        if meta:
            model.to_empty(device=dev)
        dcp.load(model_sd(model), checkpoint_id=files["dcp"])
    elif path in DISCUSSION_PATHS.values():
        import torch.distributed.checkpoint as dcp
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


def shard_files(folder: str) -> list[str]:
    """The HF sharded checkpoint's files, in order."""
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        return [os.path.join(folder, n) for n in sorted(set(json.load(f)["weight_map"].values()))]


def _raw_load(path: str, folder: str, dev: Any, facts: dict[str, Any], t0: float) -> dict[str, Any]:
    """Every tensor of the checkpoint in ``folder`` on ``dev`` (a dict), by raw loader ``path``.
    InstantTensor reads all shards in one ``safe_open`` (its fastest use: it plans reads across
    files), with the world's process group when there are several ranks (reads shared over
    NCCL, as it is meant to run on several GPUs); its yielded tensors own their memory (its
    default ``copy=True``)."""
    import torch
    import torch.distributed as dist

    names = shard_files(folder)
    out: dict[str, Any] = {}
    if path == "safetensors-gpu":
        from safetensors import safe_open

        facts["import_s"] = time.perf_counter() - t0
        where = f"cuda:{dev.index}" if dev.type == "cuda" else "cpu"
        for n in names:
            with safe_open(n, framework="pt", device=where) as f:
                for k in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    out[k] = f.get_tensor(k)
        return out
    if dev.type != "cuda":
        raise BenchError(f"{path} loads to a GPU only")
    if path == "kvikio":
        return _kvikio_load(names, dev, facts, t0)
    try:
        import instanttensor
    except ImportError as e:
        raise BenchError(f"{path}: InstantTensor is not installed ({e})") from None
    facts["import_s"] = time.perf_counter() - t0
    policy = RAW_PATHS[path]
    backend = None
    if policy == "BUFFERED":
        backend = instanttensor.BackendPolicy.BUFFERED
    elif policy is not None:
        backend = getattr(instanttensor.Backend, policy)
    group = dist.GroupMember.WORLD if dist.get_world_size() > 1 else None
    with instanttensor.safe_open(names, framework="pt", device=dev.index, backend=backend, process_group=group) as f:
        facts["backend"] = getattr(getattr(f, "backend", None), "name", str(policy))
        facts["io"] = {k: getattr(f, k, None) for k in ("chunk_size", "io_depth", "concurrency", "buffer_size")}
        for k, t in f.tensors():
            out[k] = t
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out


_ST_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I64": "int64", "I32": "int32",
              "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn"}


def _kvikio_load(names: list[str], dev: Any, facts: dict[str, Any], t0: float) -> dict[str, Any]:
    """The ``kvikio`` raw row: headers parsed here, every tensor made on ``dev`` and read by one
    ``CuFile.pread`` into its bytes; all reads queued before the first is waited for."""
    import torch
    import torch.distributed as dist

    try:
        import kvikio
        import kvikio.defaults
    except ImportError as e:
        raise BenchError(f"kvikio is not installed ({e})") from None
    facts["import_s"] = time.perf_counter() - t0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cpus // max(1, dist.get_world_size()))
    kvikio.defaults.set("num_threads", threads)
    kvikio.defaults.set("task_size", 16 << 20)
    facts["io"] = {"num_threads": threads, "task_size": 16 << 20, "compat_mode": str(kvikio.defaults.get("compat_mode")),
                   "gds": not kvikio.defaults.is_compat_mode_preferred()}
    out: dict[str, Any] = {}
    handles, futures = [], []
    torch.cuda.current_stream(dev).synchronize()  # nothing queued may still use the memory kvikio writes
    for n in names:
        with open(n, "rb") as f:
            head = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(head))
        base = 8 + head
        cf = kvikio.CuFile(n, "r")
        handles.append(cf)
        for k, info in header.items():
            if k == "__metadata__":
                continue
            a, b = info["data_offsets"]
            t = torch.empty(info["shape"], dtype=getattr(torch, _ST_DTYPES[info["dtype"]]), device=dev)
            out[k] = t
            if b > a:
                futures.append(cf.pread(t.reshape(-1).view(torch.uint8), b - a, base + a))
    for fut in futures:
        fut.get()
    for cf in handles:
        cf.close()
    return out


def verify_raw(loaded: dict[str, Any], folder: str) -> int:
    """Every tensor a raw loader returned equals the file's bytes, and every tensor is there;
    returns the number of tensors checked."""
    import torch
    from safetensors.torch import load_file

    checked = 0
    for n in shard_files(folder):
        for k, want in load_file(n).items():
            got = loaded.get(k)
            if got is None:
                raise AssertionError(f"{k}: not loaded")
            if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
                raise AssertionError(f"{k}: {got.dtype} {tuple(got.shape)} loaded, {want.dtype} {tuple(want.shape)} stored")
            if not torch.equal(got.cpu().reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)):
                raise AssertionError(f"{k}: loaded bytes differ from the file")
            checked += 1
    if checked != len(loaded):
        raise AssertionError(f"{len(loaded) - checked} tensors loaded that the files do not hold")
    return checked


def verify_against_source(model: Any, path: str, files: dict[str, str], device: Any = None) -> tuple[int, str]:
    """Every local shard equals the recipe applied eagerly to the full source tensors (bit-exact):
    for a quantized twin, the whole-tensor dequantisation that each path computes (FP8 block:
    ``float(w) * scale_inv`` in float32, rounded once to bf16). A quantized twin's dequantised
    weights are checked again against the format's own reference (:class:`FormatReference`:
    compressed-tensors' decompressors, or the published formula). Both are computed on ``device``
    (the rank's; the CPU when ``None``): dequantising a whole 8B release on the host takes about
    a minute per format. Returns (shards checked, what the quantized weights were also checked
    against, ``""`` for none)."""
    import torch

    import sdadapt
    from sdadapt._plan.plan import build_plan
    from sdadapt._plan.target import model_state_dict, schema_of

    folder = files[QUANT_FORMATS.get(path, "safetensors")]
    src = sdadapt.sources.open_source(folder)
    threads = torch.get_num_threads()  # 1 (OMP_NUM_THREADS) while timing; the check is untimed
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    try:
        plan = build_plan(src.schema, schema_of(model_state_dict(model)), adapter_of(path, files))
        ref = FormatReference(folder) if path in QUANT_FORMATS else None
        io = _OnDevice(src, device) if path in QUANT_FORMATS else src
        checked, by_format, skipped = 0, 0, set()
        for k, t in model_sd(model).items():
            local, off = local_of(t)
            node = plan.recipes[k]
            region = tuple(slice(o, o + n) for o, n in zip(off, local.shape, strict=True))
            if not torch.equal(_bits(local), _bits(node.full(io)[region])):
                raise AssertionError(f"{k}: loaded shard differs from the source")
            checked += 1
            if ref is not None and not ref.applies_to(local.dtype):
                skipped.add(str(local.dtype).removeprefix("torch."))
            elif ref is not None:
                want = ref.dequantize(_stored_weight(src, io, node.leaves()), local.dtype)
                if want is not None:
                    if not torch.equal(_bits(local), _bits(want.cpu()[region])):
                        raise AssertionError(f"{k}: loaded shard differs from {ref.name}")
                    by_format += 1
        if ref is None:
            return checked, ""
        if skipped:
            return checked, f"not against {ref.name}: a reference for bf16 models, not {'/'.join(sorted(skipped))}"
        if not by_format:
            raise AssertionError(f"no weight of {folder} was checked against {ref.name}")
        return checked, f"{by_format} weights also = {ref.name}"
    finally:
        torch.set_num_threads(threads)
        src.close()


class _OnDevice:
    """A source whose reads are copied to ``device`` (the eager reference then computes there)."""

    def __init__(self, src: Any, device: Any):
        self.src, self.device = src, device or "cpu"

    def read(self, key: str, box: Any) -> Any:
        return self.src.read(key, box).to(self.device)


def _bits(t: Any) -> Any:
    import torch

    return t.cpu().contiguous().view(torch.uint8)


def _stored_weight(src: Any, io: Any, leaves: list[str]) -> dict[str, Any]:
    """The stored ``weight*`` tensors of ``src``'s module whose keys ``leaves`` are, by field name
    (``weight``, ``weight_packed``, ``weight_scale``, ...), whole, as ``io`` reads them."""
    bases = {leaf.rpartition(".")[0] for leaf in leaves if leaf.rpartition(".")[2].startswith("weight")}
    if len(bases) != 1:
        raise AssertionError(f"one module's weight expected, read from {sorted(leaves)}")
    base = bases.pop()
    out = {}
    for key, info in src.schema.items():
        module, _, field = key.rpartition(".")
        if module == base and field.startswith("weight"):
            out[field] = io.read(key, tuple((0, n) for n in info.shape)).clone()
    return out
