"""A torchtitan state-dict adapter backed by an sdadapt :class:`~sdadapt.Adapter`.

torchtitan's checkpoint manager talks to a model family through its state-dict-adapter
protocol (``torchtitan/protocols/state_dict_adapter.py``: ``BaseStateDictAdapter(model_config,
hf_assets_path)`` with ``to_hf``, ``from_hf``, ``get_hf_storage_reader`` and
``fqn_to_index_mapping``). :class:`SdadaptStateDictAdapter` implements that protocol with any
sdadapt adapter (HF checkpoint layout -> torchtitan's layout, as for :func:`sdadapt.load`)::

    from sdadapt.torchtitan import SdadaptStateDictAdapter
    LlamaBridge = SdadaptStateDictAdapter.using("llama")        # options from config.json
    model_spec.state_dict_adapter = LlamaBridge                 # torchtitan builds it itself

The shipped adapters produce our documented layout (``attention.wq``, ``output``,
``moe.experts.w1`` ...). The bridge takes them on to the names the model holds, decided from its
own keys (the state dict ``to_hf`` is given, else ``model_config.build()`` on the meta device):
torchtitan 0.3's ``attention.qkv_linear.wq``, ``lm_head``,
``moe.routed_experts.inner_experts.w1_EFD``, ``moe.expert_bias_E`` and GPT-OSS's interleaved
``mlp1_weight_EGD`` (:mod:`sdadapt._plan.titan_names`); a model with our layout gets no rename.
torchtitan's training state that the checkpoint does not hold (``moe.expert_bias_E`` of
families without one) keeps its values on load and is left out of the export, as torchtitan's
own adapters do. :func:`sdadapt.load` and :func:`sdadapt.export` do the same for a shipped
adapter given by name; :func:`torchtitan_names` gives the renames for an adapter object.

How torchtitan uses it (``CheckpointManager.dcp_load`` with ``from_hf=True``)::

    hf_sd = sd_adapter.to_hf(model_sd)                          # model_sd: sharded DTensors
    dcp.load(hf_sd, storage_reader=sd_adapter.get_hf_storage_reader(path, from_quantized))
    model.load_state_dict(sd_adapter.from_hf(hf_sd))

and for the HF export (``dcp_save`` with ``to_hf=True``) ``to_hf(model_sd)`` followed by
``dcp.save`` with a ``HuggingFaceStorageWriter`` (sharded by ``fqn_to_index_mapping``).

The load is lazy: ``to_hf`` returns an :class:`HFStateDict`, which becomes whichever view the
next step needs. Once ``get_hf_storage_reader`` has been called for it (before or after
``to_hf``, as torchtitan's callers differ), it holds the model's own tensors under the model's
keys, and the reader is sdadapt's :class:`~sdadapt._engine.reader.AdaptedStorageReader`: ``dcp.load``
writes each rank's shards directly, reading only the source regions they need (rotary
permutes, fusions, TP interleaving included), and ``from_hf`` hands the same tensors back.
The plan is checked on headers (strict: a missing, unexpected or mismatched key raises
:class:`~sdadapt.errors.PlanError` on every rank before ``dcp.load`` starts). Otherwise (the export,
or any caller that reads it without asking for our reader) it holds the checkpoint layout:
the adapter's inverse applied to the model's tensors. A key that is only renamed keeps its
tensor (a DTensor stays sharded); one that needs a whole tensor (rotary order, fused or
interleaved rows) is gathered with ``full_tensor()`` on every rank, in the same order, and
all of those stay in memory until ``dcp.save`` has written them. ``from_hf`` of a plain dict
of HF tensors applies the adapter in memory (the protocol's eager meaning).

Unlike :func:`sdadapt.load`, the values are written into the model's tensors in place (that
is what torchtitan's flow does): a read failure leaves the model partly overwritten, and
torchtitan's ``dcp.load`` raises DCP's ``CheckpointException``.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch.distributed.checkpoint import Metadata, StorageReader
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.tensor import DTensor
from torch.futures import Future

from ._engine.reader import AdaptedStorageReader
from ._export import CachedIO, plan_outputs
from ._plan.adapter import Adapter, with_dtype
from ._plan.plan import Plan, build_plan
from ._plan.resolve import resolve_adapter
from ._plan.target import schema_of
from ._plan.titan_names import for_export, for_load, native_names
from ._recipes.nodes import Leaf
from ._transaction import renamed_keywords
from .errors import AdapterError, ExportError, PlanError, SourceError
from .sources import INDEX_LIMIT, INDEX_NAME, ShardIndex, Source, TensorInfo, open_source, read_json

log = logging.getLogger(__name__)

DTYPE_WHY = "'model' or a dtype every tensor is converted to, as sdadapt.load(..., dtype=) and the CLI's --dtype"

__all__ = ["HFStateDict", "SdadaptStateDictAdapter", "apply_adapter", "torchtitan_names"]


def apply_adapter(adapter: Adapter, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` through ``adapter``, in memory: a new dict of the keys and layouts it yields.

    A key that is only renamed keeps its tensor (a DTensor stays sharded); any other output is
    computed from whole tensors (a DTensor input is gathered with ``full_tensor()``, a
    collective: call on every rank). Raises :class:`~sdadapt.errors.AdapterError` if the adapter does
    not apply cleanly to these keys.

    Args:
        adapter: the adapter.
        tensors: ``key -> tensor`` (DTensors allowed).

    Returns:
        A new ``key -> tensor`` dict in the adapter's output layout.

    Raises:
        AdapterError: the adapter does not apply cleanly to these keys.

    Example::

        hf = apply_adapter(sdadapt.get_adapter("llama", n_heads=32, n_kv_heads=8).inverse(), model.state_dict())
    """
    try:
        outputs, _ = plan_outputs(schema_of(tensors), adapter, what=f"adapter {adapter.name!r} on {len(tensors)} tensors")
    except ExportError as e:  # planning without a target reports as an export: here it is the adapter
        raise AdapterError(str(e)) from e

    def fetch(key: str) -> torch.Tensor:
        t = tensors[key]
        return t.full_tensor() if isinstance(t, DTensor) else t.detach()

    io = CachedIO(outputs, fetch, lambda t: None)
    out: dict[str, torch.Tensor] = {}
    for key, node in outputs.items():
        out[key] = tensors[node.key] if isinstance(node, Leaf) else io.whole(node).contiguous()
    io.flush()
    return out


def torchtitan_names(model: torch.nn.Module | dict[str, Any]) -> Adapter | None:
    """The renames from our documented layout (``attention.wq``, ``output``, ``moe.experts.w1``
    ...) to the names ``model`` uses, decided from its own state-dict keys; ``None`` when it uses
    ours (an older torchtitan, a model of one's own). :class:`SdadaptStateDictAdapter` adds them by
    itself, as :func:`sdadapt.load` does for an adapter given by name; add them after an adapter
    object that produces our layout.

    Args:
        model: the model, or its state dict (tensors, DTensors or meta tensors).

    Returns:
        An :class:`~sdadapt.Adapter` (renames; GPT-OSS experts also fuse gate and up and
        interleave their rows, as torchtitan's ``mlp1_weight_EGD`` holds them), or ``None``.

    Example (a fragment: ``model`` is a torchtitan model)::

        adapter = sdadapt.get_adapter("llama", source="Llama-3-8B/")
        names = torchtitan_names(model)
        sdadapt.load(model, "Llama-3-8B/", adapter if names is None else adapter + names)
    """
    state = model.state_dict() if isinstance(model, torch.nn.Module) else model
    return native_names(schema_of({k: v for k, v in state.items() if isinstance(v, torch.Tensor)}))


class HFStateDict(dict):
    """What :meth:`SdadaptStateDictAdapter.to_hf` returns: a ``dict`` whose content is decided
    on first use (see the module docstring). ``view`` is ``None`` until then, ``"load"`` (the
    model's keys and tensors, filled by our reader) or ``"export"`` (checkpoint keys and layout).

    Args:
        bridge: the :class:`SdadaptStateDictAdapter` that made it.
        native: the model's state dict it stands for.

    Example::

        hf = bridge.to_hf(model.state_dict())  # torchtitan passes it to dcp.load or save
    """

    def __init__(self, bridge: SdadaptStateDictAdapter, native: dict[str, torch.Tensor]):
        super().__init__()
        self._bridge = bridge
        self._native = native
        self.load_plan: tuple[Plan, Source] | None = None  # set once our reader is asked for
        self.view: str | None = None

    def _resolve(self) -> None:
        if self.view is not None:
            return
        if self.load_plan is not None:
            self.view = "load"
            dict.update(self, {k: self._native[k] for k in self.load_plan[0].recipes})
        else:
            self.view = "export"
            # the model's names -> ours first, then the adapter's inverse; training state left out
            adapter, native = for_export(self._bridge.adapter_for(None), self._native)
            dict.update(self, apply_adapter(adapter.inverse(), native))
        self._native = {}

    def __getitem__(self, key: str) -> Any:
        self._resolve()
        return dict.__getitem__(self, key)

    def __iter__(self) -> Iterator[str]:
        self._resolve()
        return dict.__iter__(self)

    def __len__(self) -> int:
        self._resolve()
        return dict.__len__(self)

    def __contains__(self, key: object) -> bool:
        self._resolve()
        return dict.__contains__(self, key)

    def keys(self) -> Any:
        self._resolve()
        return dict.keys(self)

    def values(self) -> Any:
        self._resolve()
        return dict.values(self)

    def items(self) -> Any:
        self._resolve()
        return dict.items(self)

    def get(self, key: str, default: Any = None) -> Any:
        self._resolve()
        return dict.get(self, key, default)

    def copy(self) -> dict[str, Any]:
        self._resolve()
        return dict(dict.items(self))

    def __repr__(self) -> str:
        return f"HFStateDict(view={self.view}, {dict.__len__(self)} keys)"


class _BridgeReader(StorageReader):
    """The storage reader ``get_hf_storage_reader`` returns: sdadapt's
    :class:`AdaptedStorageReader` for the plan of the :class:`HFStateDict` being loaded, made
    once that plan exists (the call order of ``to_hf`` and ``get_hf_storage_reader`` varies
    between torchtitan's callers). The source is closed once the data is read."""

    def __init__(self, path: str, target: HFStateDict | None):
        super().__init__()
        self.path = path
        self.target = target  # the state dict it fills (set by to_hf when the reader came first)
        self.inner: AdaptedStorageReader | None = None

    def _reader(self) -> AdaptedStorageReader:
        if self.inner is None:
            if self.target is None or self.target.load_plan is None:
                raise SourceError(
                    "dcp.load with this reader needs the state dict that to_hf() returned for the model; "
                    "call to_hf(model_state_dict) before dcp.load",
                    path=self.path,
                )
            self.target._resolve()
            self.inner = AdaptedStorageReader(*self.target.load_plan)
        return self.inner

    def reset(self, checkpoint_id: object = None) -> None:
        pass

    def read_metadata(self, *args: object, **kwargs: object) -> Metadata:
        return self._reader().read_metadata()

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: object, **kwargs: object) -> None:
        self._reader().set_up_storage_reader(metadata, is_coordinator)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return self._reader().prepare_local_plan(plan)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return self._reader().prepare_global_plan(plans)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        inner = self._reader()
        try:
            return inner.read_data(plan, planner)
        finally:
            inner.source.close()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: object) -> bool:
        return False


class SdadaptStateDictAdapter:
    """torchtitan's state-dict-adapter protocol over an sdadapt adapter (see the module docstring).

    ``adapter`` maps the HF checkpoint's layout to the model's: an :class:`~sdadapt.Adapter`, or a
    spec as the CLI's ``--adapter`` takes (a shipped name such as ``"llama"``, ``file.py:ATTR``,
    ``module:ATTR``, ``.json``); a shipped name reads the options ``options`` leaves out from the
    ``config.json`` beside the checkpoint being loaded (``hf_assets_path`` for the export).
    ``allow_missing`` / ``allow_unexpected`` are key patterns as for :func:`sdadapt.load`.
    ``dtype`` is :func:`sdadapt.load`'s ``dtype``: ``"model"`` converts every tensor to the
    dtype the model holds (torchtitan keeps float32 parameters and trains in bf16 through
    FSDP2's mixed precision, while HF releases are bf16 or FP8; an FP8 release is then
    dequantised straight into float32); without it exact widenings (bf16 into float32) load as
    they are and any other dtype mismatch is a plan error, as everywhere in sdadapt. torchtitan
    builds the adapter itself from ``(model_config, hf_assets_path)``: bind the other arguments
    with :meth:`using`. ``model_config`` is kept as
    ``self.model_config``; when ``from_hf`` gets a plain dict before any ``to_hf``, a torchtitan
    config (one with ``build()``) is built on the meta device to learn the model's names.

    Args:
        model_config: torchtitan's model config (kept as ``self.model_config``).
        hf_assets_path: the HF checkpoint folder (config.json, index).
        adapter: an :class:`~sdadapt.Adapter` or a spec string.
        allow_missing: key patterns the checkpoint may lack.
        allow_unexpected: key patterns the model may lack.
        dtype: ``"model"`` or a dtype, as :func:`sdadapt.load`'s ``dtype`` (the old name
            ``to_dtype=`` is refused with a :class:`~sdadapt.errors.UsageError` naming it).
        **options: a shipped adapter's options (``dtype`` is the bridge's own, above).

    Example::

        from sdadapt.torchtitan import SdadaptStateDictAdapter

        spec.state_dict_adapter = SdadaptStateDictAdapter.using("llama", dtype="model")
    """

    default_adapter: ClassVar[Adapter | str | None] = None
    default_options: ClassVar[dict[str, Any]] = {}

    @renamed_keywords("SdadaptStateDictAdapter", {"to_dtype": ("dtype", DTYPE_WHY)})
    def __init__(
        self,
        model_config: Any = None,
        hf_assets_path: str | None = None,
        *,
        adapter: Adapter | str | None = None,
        allow_missing: list[str] | None = None,
        allow_unexpected: list[str] | None = None,
        dtype: str | torch.dtype | None = None,
        **options: Any,
    ):
        self.model_config = model_config
        self.hf_assets_path = hf_assets_path
        spec = adapter if adapter is not None else self.default_adapter
        if spec is None:
            raise AdapterError("SdadaptStateDictAdapter needs an adapter: pass adapter=... or use SdadaptStateDictAdapter.using(...)")
        self.spec: Adapter | str = spec
        merged = {**self.default_options, **options}
        self.allow_missing = allow_missing if allow_missing is not None else merged.pop("allow_missing", None)
        self.allow_unexpected = allow_unexpected if allow_unexpected is not None else merged.pop("allow_unexpected", None)
        self.dtype = dtype if dtype is not None else merged.pop("dtype", None)
        for bound in ("allow_missing", "allow_unexpected", "dtype"):
            merged.pop(bound, None)
        self.options = merged
        self.fqn_to_index_mapping: dict[str, int] | None = _index_mapping(hf_assets_path)
        self._adapters: dict[str | None, Adapter] = {}
        self._pending: HFStateDict | None = None
        self._waiting: _BridgeReader | None = None  # a reader asked for before to_hf
        self._seen: dict[str, TensorInfo] | None = None  # the model's keys (see _model_schema)

    @classmethod
    @renamed_keywords("SdadaptStateDictAdapter.using", {"to_dtype": ("dtype", DTYPE_WHY)})
    def using(cls, adapter: Adapter | str, **options: Any) -> type[SdadaptStateDictAdapter]:
        """A subclass that torchtitan can build as ``Cls(model_config, hf_assets_path)``, with
        ``adapter`` and ``options`` (including ``allow_missing=`` / ``allow_unexpected=`` /
        ``dtype=``) bound."""
        name = adapter if isinstance(adapter, str) else adapter.name
        return type(f"SdadaptStateDictAdapter[{name}]", (cls,), {"default_adapter": adapter, "default_options": dict(options)})

    def adapter_for(self, path: str | None, source: Source | None = None) -> Adapter:
        """The adapter for the checkpoint at ``path`` (``None``: ``hf_assets_path``); a shipped
        name reads its options from that folder's config once (and its key names from
        ``source``, the checkpoint already open, when given)."""
        where = path if path is not None else self.hf_assets_path
        if where not in self._adapters:
            self._adapters[where] = resolve_adapter(self.spec, source=source or where, **self.options)
        return self._adapters[where]

    # ------------------------------------------------------------------ the protocol
    def to_hf(self, state_dict: dict[str, Any]) -> HFStateDict:
        """The model's state dict as torchtitan hands it over; returns an :class:`HFStateDict`
        (the load view if our reader is asked for, else the checkpoint layout)."""
        tensors = {k: v for k, v in state_dict.items() if isinstance(v, torch.Tensor)}
        skipped = sorted(set(state_dict) - set(tensors))
        if skipped:
            log.warning("to_hf: %d non-tensor entries are left out: %s", len(skipped), ", ".join(skipped[:8]))
        hf = HFStateDict(self, tensors)
        self._seen = schema_of(tensors)
        self._pending = hf
        if self._waiting is not None:
            reader, self._waiting = self._waiting, None
            hf.load_plan = self._plan(hf, reader.path)
            reader.target = hf
        return hf

    def get_hf_storage_reader(self, path: str, from_quantized: bool = False) -> StorageReader:
        """A DCP storage reader for the HF checkpoint at ``path`` that fills the model's shards
        through the adapter. ``from_quantized`` is accepted for the protocol: dequantisation,
        where a checkpoint needs it, is the adapter's job (its rules name the scale tensors)."""
        path = os.fspath(path)
        if from_quantized:
            log.info("get_hf_storage_reader(from_quantized=True): the adapter's rules decide how scales are applied")
        pending = self._pending
        if pending is not None and pending.view is None and pending.load_plan is None:
            pending.load_plan = self._plan(pending, path)
            return _BridgeReader(path, pending)
        self._waiting = _BridgeReader(path, None)
        return self._waiting

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        """The model's state dict: for the dict ``to_hf`` returned and our reader filled, its
        tensors (already the model's); for a plain dict of HF tensors, the adapter applied in
        memory."""
        if isinstance(hf_state_dict, HFStateDict) and hf_state_dict.view == "load":
            hf_state_dict.load_plan = None
            if self._pending is hf_state_dict:
                self._pending = None
            return dict(dict.items(hf_state_dict))
        tensors = {k: v for k, v in hf_state_dict.items() if isinstance(v, torch.Tensor)}
        adapter = self.adapter_for(None)
        model = self._model_schema()
        if model is not None:
            adapter, _ = for_load(adapter, schema_of(tensors), [], model)
        return dict(apply_adapter(adapter, tensors))

    def _model_schema(self) -> dict[str, TensorInfo] | None:
        """The model's keys and shapes: from the state dict ``to_hf`` last saw, else from
        ``model_config.build()`` on the meta device (a torchtitan model config), else ``None``."""
        if self._seen is None and callable(getattr(self.model_config, "build", None)):
            try:
                with torch.device("meta"):
                    model = self.model_config.build()
                self._seen = schema_of(dict(model.state_dict()))
            except Exception as e:  # noqa: BLE001 - any config: fall back to our documented names
                log.info("model_config.build() on meta failed (%s: %s): keeping the adapter's names", type(e).__name__, e)
                self._seen = {}
        return self._seen or None

    # ------------------------------------------------------------------ planning
    def _plan(self, hf: HFStateDict, path: str) -> tuple[Plan, Source]:
        """Plan ``hf``'s load from ``path`` now (headers only), so that a plan error is raised
        here, identically on every rank, and not from inside ``dcp.load``."""
        source = open_source(path)
        try:
            model = schema_of(hf._native)
            adapter, state = for_load(self.adapter_for(path, source), source.schema, source.non_tensor, model)
            if state:
                log.info("torchtitan bridge: %d keys of training state stay as initialised: %s", len(state), ", ".join(state[:4]))
            adapter = with_dtype(adapter, self.dtype)
            plan = build_plan(
                source.schema,
                model,
                adapter,
                non_tensor=source.non_tensor,
                allow_missing=[*(self.allow_missing or []), *state],
                allow_unexpected=self.allow_unexpected,
                source_name=path,
                target_name="torchtitan model",
            )
            if not plan.report.ok:
                raise PlanError(plan.report)
        except BaseException:
            source.close()
            raise
        log.info("torchtitan bridge: %d keys planned from %s with adapter %r", len(plan.recipes), path, adapter.name)
        return plan, source


def _index_mapping(hf_assets_path: str | None) -> dict[str, int] | None:
    """HF key -> shard number, from ``model.safetensors.index.json`` (torchtitan's
    ``StateDictAdapter`` reads it the same way: the first number of each file name); ``None``
    without an index (torchtitan then writes one file)."""
    if not hf_assets_path:
        return None
    path = os.path.join(hf_assets_path, INDEX_NAME)
    if not os.path.isfile(path):
        log.info("%s not found: an HF export is written as one file", path)
        return None
    weight_map = read_json(path, ShardIndex, what="index", limit=INDEX_LIMIT).weight_map
    out: dict[str, int] = {}
    for key, fname in weight_map.items():
        m = re.search(r"\d+", str(fname))
        if m is None:
            raise SourceError(f"file name {fname!r} of key {key!r} has no shard number", path=path)
        out[key] = int(m.group(0))
    return out
