"""The engine side of sdadapt's vLLM weight-transfer backend: a ``WeightTransferEngine`` that each
vLLM worker creates when the engine runs with ``weight_transfer_config={"backend": "sdadapt"}``.

Its life, driven by the trainer through vLLM's weight-transfer calls:

- ``init_transfer_engine({"staging": folder})``: the worker lays its raw parameters out in
  shared memory (:mod:`.vllm_staging`): vLLM's names with the shapes and dtypes its layers created,
  as vLLM recorded them for reloading (``record_metadata_for_reloading``), before any
  post-processing. The trainer ranks map those files and refit into them.
- ``start_weight_update``: vLLM's layerwise reload begins (each layer restored to its loading
  format, its weight loaders wrapped so that a layer is processed once all its weights are in).
- ``update_weights({"names": [...] | None})``: every named parameter (``None``: all), and the other
  parameters of the layers they belong to, is loaded from the staging file through that path: a
  loader that copies the rank's shard whole (it is already vLLM's shard), after which vLLM runs
  the layer's own post-processing (``process_weights_after_loading``: repacking, quantization) and
  copies the result into the tensors the engine serves from.
- ``finish_weight_update``: vLLM finalizes the reload (layers that received nothing keep what they
  served; attention layers are processed last).

The class is made by :func:`engine_class` inside vLLM's process: this module imports vLLM only
there, so sdadapt never depends on it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import RefitError
from . import vllm_staging

log = logging.getLogger(__name__)

BACKEND = "sdadapt"
"""The name of the backend in vLLM's ``WeightTransferEngineFactory`` (``weight_transfer_config``)."""

_CLASS: list[type] = []

LIVE = frozenset({"bias", "e_score_correction_bias"})
"""Checkpoint tensors of a layer vLLM records for reloading that vLLM keeps live instead of
recording them: a linear layer's ``bias`` (made after its weights, never post-processed; loaded
through the layer's loader) and a MoE router's ``e_score_correction_bias`` (DeepSeek-V3's
``noaux_tc`` routing; one of vLLM's ``SKIP_LOAD_TENSORS``, which its layerwise reload neither
records nor waits for: its loader copies it into place)."""


def engine_class() -> type:
    """vLLM's ``WeightTransferEngine`` subclass of the sdadapt backend (made once, in a process
    that has vLLM)."""
    if _CLASS:
        return _CLASS[0]
    try:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
        from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO, make_online_process_loader
        from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS
    except ImportError as e:
        raise RefitError(f"the sdadapt weight-transfer engine runs inside vLLM (0.32 or later), which does not import here: {e}") from e

    @dataclass
    class SdadaptInitInfo(WeightTransferInitInfo):
        """Where the trainer wants the staging: a folder on this host (shared memory)."""

        staging: str

    @dataclass
    class SdadaptUpdateInfo(WeightTransferUpdateInfo):
        """The parameters the trainer wrote since the last update (``None``: all of them)."""

        names: list[str] | None = None

    class SdadaptWeightTransferEngine(WeightTransferEngine[SdadaptInitInfo, SdadaptUpdateInfo]):
        """sdadapt's backend: the trainer ranks write this rank's shards into shared memory,
        this engine loads them through vLLM's layerwise reload (its post-processing included)."""

        init_info_cls = SdadaptInitInfo
        update_info_cls = SdadaptUpdateInfo
        supports_draft_weight_update = False
        unwatched = frozenset(SKIP_LOAD_TENSORS) & LIVE

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.folder: str | None = None
            self.rank = 0
            self.staged: dict[str, torch.Tensor] = {}
            self.overridden: list[tuple[torch.nn.Module, str, Any]] = []  # (layer, parameter, vLLM's own loader)
            self.loaded: list[torch.nn.Module] = []  # the layers this update loads

        def init_transfer_engine(self, init_info: SdadaptInitInfo) -> None:
            pc = self.parallel_config
            if pc.pipeline_parallel_size != 1 or pc.data_parallel_size != 1:
                raise RefitError(
                    f"the sdadapt backend serves tensor (and expert) parallel engines; this one has pipeline_parallel_size="
                    f"{pc.pipeline_parallel_size}, data_parallel_size={pc.data_parallel_size}"
                )
            self.rank, world = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
            if self.folder is not None:
                vllm_staging.remove(self.folder, self.rank)
            raw = staged_parameters(self.model)
            manifest = vllm_staging.layout_params(self.rank, world, raw)
            self.folder = init_info.staging
            self.staged = vllm_staging.create(init_info.staging, manifest)
            log.info("sdadapt staging of rank %d: %d parameters, %d bytes in %s", self.rank, len(self.staged), manifest.nbytes,
                     init_info.staging)  # fmt: skip

        def start_weight_update(self) -> None:
            initialize_layerwise_reload(self.model)

        def receive_weights(self, update_info: SdadaptUpdateInfo) -> None:
            if not self.staged:
                raise RefitError("update_weights before init_weight_transfer_engine: the sdadapt staging is not laid out")
            unknown = sorted(set(update_info.names or ()) - set(self.staged))
            if unknown:
                raise RefitError(f"update_weights names parameters this engine does not hold: {unknown[:8]}")
            modules = dict(self.model.named_modules())
            touched = {n.rpartition(".")[0] for n in (update_info.names if update_info.names is not None else self.staged)}
            self.loaded = [modules[owner] for owner in sorted(touched)]
            try:
                with torch.no_grad():
                    for name, shard in self.staged.items():
                        owner, _, attr = name.rpartition(".")
                        if owner not in touched:
                            continue
                        if attr in self.unwatched:  # live, outside the layerwise reload: vLLM's loader copies it in place too
                            getattr(modules[owner], attr).data.copy_(shard)
                        else:
                            self.overridden.append(load_whole(modules[owner], attr, shard, name, make_online_process_loader))
            except BaseException:
                self.restore_loaders()
                raise

        def finish_weight_update(self) -> None:
            try:
                finalize_layerwise_reload(self.model, self.model_config)
                repack_cpu_experts(self.loaded)
            finally:
                self.restore_loaders()
                self.loaded = []

        def restore_loaders(self) -> None:
            """vLLM's own loaders back on the parameters vLLM recorded for reloading (its own
            reloads, ``load_weights`` included, use them later)."""
            for layer, attr, loader in self.overridden:
                info = LAYERWISE_INFO.get(layer)
                held: list[Any] = [getattr(layer, attr, None)]
                if info is not None:
                    kernel: dict[str, Any] = (info.kernel_tensors or ({}, {}))[0]
                    held += [info.restore_metadata[0].get(attr), kernel.get(attr)]
                for param in held:
                    if param is None or not _ours(getattr(param, "weight_loader", None)):
                        continue
                    if loader is None:  # it had none: vLLM's default loader serves it
                        param.__dict__.pop("weight_loader", None)
                    else:
                        setattr(param, "weight_loader", loader)  # noqa: B010 - an attribute torch's Tensor does not declare
            self.overridden = []

        def shutdown(self) -> None:
            if self.folder is not None:
                vllm_staging.remove(self.folder, self.rank)
            self.folder, self.staged = None, {}

    _CLASS.append(SdadaptWeightTransferEngine)
    return SdadaptWeightTransferEngine


def staged_parameters(model: torch.nn.Module) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """:func:`raw_parameters` of a vLLM model (in vLLM's process): what the sdadapt staging of
    its rank holds."""
    try:
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS
    except ImportError as e:
        raise RefitError(f"the sdadapt staging is read inside vLLM (0.32 or later), which does not import here: {e}") from e

    return raw_parameters(model, LAYERWISE_INFO, frozenset(SKIP_LOAD_TENSORS), is_deferred_attention_layer)


def raw_parameters(
    model: torch.nn.Module, infos: Any, skip: frozenset[str] = frozenset(), attention: Any = None
) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """Every parameter of ``model`` that vLLM reloads, with the shape and dtype its layer created
    (before post-processing): ``(name, dtype, shape)``, in ``named_parameters()`` order (tied
    parameters once). Those vLLM recorded for reloading (``restore_metadata``) take the recorded
    shape; a checkpoint tensor of a recorded layer that vLLM keeps live instead (``LIVE``) takes
    its own shape and the dtype it was created in. ``skip``: names vLLM's layerwise reload never
    loads (its ``SKIP_LOAD_TENSORS``: expert maps, and the router's correction bias, which is
    live). ``attention(layer)``: whether a layer is an attention layer, whose parameters (an FP8
    engine's KV-cache and activation scales: calibration, not training) are left as the engine
    has them."""
    modules = dict(model.named_modules())
    out = []
    for name, param in model.named_parameters():
        owner, _, attr = name.rpartition(".")
        info = infos.get(modules[owner])
        if info is None or (attr in skip and attr not in LIVE) or (attention is not None and attention(modules[owner])):
            continue
        meta = None if attr in skip else info.restore_metadata[0].get(attr)
        if meta is not None:
            out.append((name, meta.dtype, tuple(meta.shape)))
        elif attr in LIVE:
            out.append((name, _created_dtype(modules[owner], attr, param), tuple(param.shape)))
    return out


def _created_dtype(layer: torch.nn.Module, attr: str, param: torch.Tensor) -> torch.dtype:
    """The dtype a live parameter was created in, which vLLM's own loading rounds to: a linear
    layer's ``bias`` in the layer's ``params_dtype`` (its post-processing may widen the live one:
    vLLM's CPU kernels for AMX keep it in float32), anything else its own."""
    dtype = getattr(layer, "params_dtype", None) if attr == "bias" else None
    return dtype if isinstance(dtype, torch.dtype) else param.dtype


def repack_cpu_experts(layers: list[torch.nn.Module]) -> int:
    """Pack again the weights of the CPU MoE layers among ``layers`` (those an update loaded);
    returns how many. vLLM 0.32's unquantized MoE runs its CPU experts' packing
    (``CPUUnquantizedExperts.process_weights_after_loading``) on the first load only
    (``UnquantizedFusedMoEMethod._setup_kernel`` skips it on a weight update), so any reload, its
    own ``reload_weights`` included, leaves the raw weights where the CPU kernel reads packed
    ones and the engine serves garbage from its MoE layers. Elsewhere (GPUs) nothing matches."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return 0
    done = 0
    for layer in layers:
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(layer)
            done += 1
    return done


def load_whole(layer: torch.nn.Module, attr: str, shard: torch.Tensor, name: str, wrap: Any) -> tuple[torch.nn.Module, str, Any]:
    """Load ``shard`` (this rank's whole parameter ``name``) into ``layer.attr`` through vLLM's
    layerwise path: the parameter's loader becomes a plain copy, wrapped as vLLM wraps loaders (the
    copy is replayed, and the layer processed, once all its parameters are in). Returns the layer,
    the parameter's name and vLLM's own loader, to be put back once the update is finished (the
    parameters vLLM recorded for reloading outlive this update)."""
    param = getattr(layer, attr)
    if tuple(param.shape) != tuple(shard.shape):
        raise RefitError(f"{name}: the engine's parameter is {list(param.shape)} but its staging {list(shard.shape)}")
    original = getattr(param, "weight_loader", None)
    while original is not None and getattr(original, "__name__", "") == "online_process_loader":
        original = original.__wrapped__  # vLLM's layerwise wrapper around its own loader

    def sdadapt_copy_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        param.data.copy_(loaded_weight)

    param.weight_loader = sdadapt_copy_loader
    param.weight_loader = wrap(layer, attr)
    param.weight_loader(param, shard)
    return layer, attr, original


def _ours(loader: Any) -> bool:
    """Whether ``loader`` is, or wraps, the copy loader of :func:`load_whole`."""
    while loader is not None:
        if getattr(loader, "__name__", "") == "sdadapt_copy_loader":
            return True
        loader = getattr(loader, "__wrapped__", None)
    return False


__all__ = ["BACKEND", "engine_class", "raw_parameters", "staged_parameters"]
