"""Turning a meta-device model into real (uninitialised) memory, and its buffers into values.

``to_empty`` gives parameters and buffers memory but no values. Parameters are then filled
by the load; non-persistent buffers (rotary ``inv_freq``/``freqs_cis``...) are not in the state
dict, so something must compute them: the ``init_buffers`` callback, or the model's own
``init_weights()`` (torchtitan's convention). We check this before touching the model.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .._plan.target import is_meta
from ..errors import ModelError

InitFn = Callable[[nn.Module], None]
# ``init_missing(model, keys)``: give the state-dict ``keys`` the checkpoint lacks their values
MissingInitFn = Callable[[nn.Module, list[str]], None]

log = logging.getLogger(__name__)

_SMALL = 1 << 20  # the CUDA caching allocator serves requests up to 1 MiB from a pool of its own


def has_meta(model: nn.Module | Iterable[torch.Tensor]) -> bool:
    """Whether any parameter or buffer of ``model`` is on meta (a DTensor by its local shard),
    or any of the tensors given instead where a caller already listed them: stops at the first
    (a load asks this several times of a meta model, whose first parameter answers it). The one
    answer to that question for load, save and draft."""
    tensors = itertools.chain(model.parameters(), model.buffers()) if isinstance(model, nn.Module) else model
    return any(is_meta(t) for t in tensors)


def own_tensors(model: nn.Module, modules: list[nn.Module] | None = None) -> list[torch.Tensor]:
    """Every parameter, then every buffer, of ``model``'s modules: what ``model.parameters()``
    then ``model.buffers()`` give, in their order, from one walk over the modules (a tensor two
    modules hold comes twice: for the questions asked of it, whether any or which comes first).
    ``modules``: ``list(model.modules())``, where the caller has it."""
    modules = list(model.modules()) if modules is None else modules
    return [p for m in modules for p in m._parameters.values() if p is not None] + [
        b for m in modules for b in m._buffers.values() if b is not None
    ]


def meta_non_persistent_buffers(model: nn.Module) -> list[str]:
    out = []
    for mod_name, mod in model.named_modules():
        for name in getattr(mod, "_non_persistent_buffers_set", ()):
            buf = mod._buffers.get(name)
            if buf is not None and is_meta(buf):
                out.append(f"{mod_name}.{name}" if mod_name else name)
    return out


def choose_device(model: nn.Module, device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    for p in model.parameters():
        if isinstance(p, DTensor):
            kind = p.device_mesh.device_type
            if kind == "cpu":
                return torch.device("cpu")
            mod = getattr(torch, kind, None)
            index = mod.current_device() if mod is not None and hasattr(mod, "current_device") else 0
            return torch.device(kind, index)
    return torch.device("cpu")


def check_buffers(model: nn.Module, init_buffers: InitFn | None) -> None:
    """Raise (before any change) if materialising would leave buffers without values."""
    if init_buffers is not None or callable(getattr(model, "init_weights", None)):
        return
    bufs = meta_non_persistent_buffers(model)
    if bufs:
        from .._base.keyruns import compress

        raise ModelError(
            f"non-persistent buffers {', '.join(compress(bufs))} are on the meta device and not in "
            "the state dict, so nothing would give them values after materialising. Pass "
            "init_buffers=fn (called after to_empty, before reading; `--init-buffers module:function` "
            "on the command line), or give the model an init_weights() method that computes them."
        )


def _owner(model: nn.Module, key: str) -> nn.Module | None:
    """The module that holds state-dict ``key`` directly (``a.b.weight`` -> ``a.b``)."""
    path = key.rpartition(".")[0]
    try:
        return model.get_submodule(path) if path else model
    except AttributeError:
        return None


def missing_values(
    model: nn.Module, keys: list[str], init_buffers: InitFn | None, init_missing: MissingInitFn | None
) -> tuple[str, InitFn | None]:
    """What gives the state-dict ``keys`` that the load will not write (allowed missing) their
    values, as ``(said, step)``: ``said`` for the report, ``step(model)`` to run after
    materialising (``None``: nothing to run). A materialised model keeps its own values; a meta
    model gets ``init_missing(model, keys)``, else the model's ``init_weights()`` (when it runs:
    no ``init_buffers``), else ``reset_parameters()`` of each key's module. Raises
    :class:`ModelError` (before anything changes) when none would, since ``to_empty`` leaves
    uninitialised memory."""
    from .._base.keyruns import compress

    if not keys:
        return "", None
    if not has_meta(model):
        return "kept the values the model holds", None
    if init_missing is not None:
        fn = init_missing
        return "given by init_missing=", lambda m: fn(m, list(keys))
    if init_buffers is None and callable(getattr(model, "init_weights", None)):
        return "initialised by the model's init_weights()", None
    owners: dict[int, Callable[[], object]] = {}
    lacking: list[str] = []
    for key in keys:
        mod = _owner(model, key)
        init = getattr(mod, "reset_parameters", None) if mod is not None else None
        if callable(init):
            owners[id(mod)] = init
        else:
            lacking.append(key)
    if lacking:
        why = "init_buffers= is given, so init_weights() does not run" if init_buffers is not None else "the model has no init_weights()"
        raise ModelError(
            f"allowed-missing key(s) {', '.join(compress(lacking))} would hold uninitialised memory after "
            f"materialising the meta model: the checkpoint lacks them, {why}, and their modules have no "
            "reset_parameters(). Pass init_missing=fn(model, keys) to give them values, or load into a "
            "materialised model (its values are kept)."
        )

    def reset(_: nn.Module) -> None:
        with torch.no_grad():
            for init in owners.values():
                init()

    return "initialised by reset_parameters() of their modules", reset


# the id of each parameter and buffer a model held before materialising -> (that tensor, the one in its place now)
Renewed = dict[int, tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Materialized:
    """What :func:`materialize` did to a model that was on meta.

    Attributes:
        renewed: each parameter and buffer the model held before (by id, kept alive here) and
            the tensor in its place now, where that is the whole story: :func:`to_empty`'s own
            walk made them (a parameter keeps its object, a buffer held by one module gets a new
            tensor) and no hook ran after it; ``None`` where it is not known (``Module._apply``
            ran, a buffer is held by several modules, a hook may have replaced tensors).

    Example::

        done = materialize(model, torch.device("cpu"), None)
        targets = done.current(before) if done is not None else before
    """

    renewed: Renewed | None = None

    def current(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """``tensors`` (the model's own parameters and buffers, taken before materialising) with
        each value the tensor in its place now: what :func:`~sdadapt._plan.target.load_targets`
        would give now, without walking the model again. ``None`` where that is not known
        (:attr:`renewed` is ``None``, or a value is not one of the model's own tensors)."""
        if self.renewed is None:
            return None
        out: dict[str, torch.Tensor] = {}
        for key, t in tensors.items():
            entry = self.renewed.get(id(t))
            if entry is None or entry[0] is not t:
                return None
            out[key] = entry[1]
        return out


def materialize(
    model: nn.Module,
    device: torch.device,
    init_buffers: InitFn | None,
    reserved: Reservation | None = None,
    then: InitFn | None = None,
    modules: list[nn.Module] | None = None,
) -> Materialized | None:
    """``to_empty`` on ``device`` if anything is on meta, then run the buffer hook (or the
    model's ``init_weights()``), then ``then(model)`` (the allowed-missing keys' values, see
    :func:`missing_values`). Returns what was done (:class:`Materialized`), ``None`` where the
    model was not materialised (nothing on meta). ``reserved``: the model's memory, asked for
    earlier (:class:`Reservation`); else it is asked for now. ``modules``: ``list(model.modules())``,
    where the caller has it."""
    if not has_meta(model):
        return None
    if reserved is not None:
        reserved.wait()
    else:
        _reserve(model, device)
    renewed = to_empty(model, device, modules)
    if init_buffers is not None:
        renewed = None  # a hook may replace any tensor
        init_buffers(model)
    elif callable(init_weights := getattr(model, "init_weights", None)):
        renewed = None
        with torch.no_grad(), quiet_random_ops():
            init_weights()
    if then is not None:
        renewed = None
        with quiet_random_ops():
            then(model)
    return Materialized(renewed)


@contextlib.contextmanager
def quiet_random_ops() -> Iterator[None]:
    """Without torch's warning that a DTensor random op runs with no seed set by hand (every rank
    prints it once per process): the load overwrites the values those ops give, except those of
    allowed-missing keys, whose initialisation the report names."""
    rng_log = logging.getLogger("torch.distributed.tensor._random")
    quiet = _DropRngSync()
    rng_log.addFilter(quiet)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
            yield
    finally:
        rng_log.removeFilter(quiet)


class _DropRngSync(logging.Filter):
    """Drops DTensor's "synchronizing RNG states of every rank" record (a GPU mesh's first random op)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "synchronizing RNG states" not in record.getMessage()


def to_empty(model: nn.Module, device: torch.device, modules: list[nn.Module] | None = None) -> Renewed | None:
    """``model.to_empty(device=device)``, with :func:`_empty_like` for each tensor. Where every
    parameter is a DTensor (what TP and FSDP2 make) and no module has an ``_apply`` of its own
    beyond FSDP2's (:func:`_plain_apply`), the same outcome is reached without ``Module._apply``,
    which costs several times more per parameter (its per-module loop, and ``nn.Parameter``
    detaching each new DTensor through DTensor's operator dispatch):

    - every parameter keeps its object: ``_apply`` swaps a DTensor's new value in
      (``torch.utils.swap_tensors``, as here), a parameter whose new value is a DTensor marked as
      a parameter (``_is_param``, what ``nn.Parameter`` sets on a tensor subclass) with the old
      one's ``requires_grad``; a parameter two modules share is swapped once (``_apply`` swaps it
      twice, each time for new uninitialised memory);
    - every buffer gets a new tensor in each module that holds it, as ``_apply`` gives it;
    - FSDP2's modules are resharded first and their parameters' sharded data reset after
      (``reset_sharded_param``: what ``FSDPModule._apply`` does around ``Module._apply``), so that
      FSDP2's state holds the new local tensors (padded where its shards are uneven).

    Returns, where its own walk ran, every parameter and buffer before (by id) with the tensor
    in its place now (:class:`Materialized`); ``None`` where ``Module._apply`` ran, or a buffer
    is held by several modules (each got a tensor of its own). ``modules``: ``list(model.modules())``,
    where the caller has it.
    """
    modules = list(model.modules()) if modules is None else modules
    if not _plain_apply(modules):
        model._apply(lambda t: _empty_like(t, device))
        return None
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415 - imported by fully_shard already, where one is used

    fsdp = [f for f in modules if isinstance(f, FSDPModule)]
    for f in fsdp:
        f.reshard()
    renewed: Renewed = {}
    shared = False  # a buffer held by several modules
    with torch.no_grad():
        for m in modules:
            for p in m._parameters.values():
                if p is None or id(p) in renewed:
                    continue
                renewed[id(p)] = (p, p)
                fresh = _empty_like(p, device, p.requires_grad)
                fresh._is_param = True
                torch.utils.swap_tensors(p, fresh)
            for name, b in m._buffers.items():
                if b is not None:
                    m._buffers[name] = new = _empty_like(b, device)
                    shared = shared or id(b) in renewed
                    renewed[id(b)] = (b, new)
        for f in reversed(fsdp):  # inner modules first, as _apply's recursion resets them
            for group in _param_groups(f) or ():
                for fsdp_param in group.fsdp_params:
                    fsdp_param.reset_sharded_param()
    return None if shared else renewed


def _param_groups(module: nn.Module) -> list[Any] | None:
    """The FSDP2 parameter groups of ``module`` (an ``FSDPModule``), what its ``_apply`` resets:
    a list in torch releases that let one module hold several groups (``_fsdp_param_groups``),
    one optional group in earlier ones (``_fsdp_param_group``); ``None``
    where the state has neither, so that :func:`to_empty` leaves the work to ``Module._apply``."""
    state = module._get_fsdp_state()  # type: ignore[operator]
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    if hasattr(state, "_fsdp_param_group"):
        group = state._fsdp_param_group
        return [] if group is None else [group]
    return None


def _plain_apply(modules: list[nn.Module]) -> bool:
    """Whether :func:`to_empty`'s own walk gives what ``Module._apply`` would: torch's default
    conversion flags (``torch.__future__``), no module class with an ``_apply`` but
    ``nn.Module``'s and FSDP2's, FSDP2's state in a layout :func:`_param_groups` knows, every
    parameter a DTensor (not a subclass of it) over a plain local tensor, without a gradient."""
    if torch.__future__.get_overwrite_module_params_on_conversion() or torch.__future__.get_swap_module_params_on_conversion():
        return False
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415

    allowed = (nn.Module.__dict__["_apply"], FSDPModule.__dict__["_apply"])
    classes: set[type] = set()
    for m in modules:
        if isinstance(m, FSDPModule) and _param_groups(m) is None:
            return False
        cls = type(m)
        if cls not in classes:
            if any("_apply" in c.__dict__ and c.__dict__["_apply"] not in allowed for c in cls.__mro__):
                return False
            classes.add(cls)
        for p in m._parameters.values():
            if p is not None and (not _is_dtensor(p) or type(getattr(p, "_local_tensor", None)) is not torch.Tensor or p.grad is not None):
                return False
    return True


def _is_dtensor(p: object) -> bool:
    return type(p) is DTensor


def _empty_like(t: torch.Tensor, device: torch.device, requires_grad: bool = False) -> torch.Tensor:
    """What ``Module.to_empty(device=device)`` makes of ``t``: uninitialised memory of its
    shape, strides and dtype on ``device``. A DTensor gets its local tensor that way and keeps
    its spec (mesh, placements, global shape): ``torch.empty_like`` on a DTensor reaches the
    same result through DTensor's operator dispatch, which costs several times more for each of
    a model's hundreds of parameters. ``t`` is a leaf (a parameter or a buffer), so building the
    DTensor from its parts leaves no autograd history to keep. ``requires_grad``: the new
    tensor's (what ``nn.Parameter`` sets on a parameter's new value)."""
    if isinstance(t, DTensor) and t.device_mesh.device_type == device.type:
        local = t._local_tensor
        fresh = torch.empty_strided(local.shape, local.stride(), dtype=local.dtype, device=device)
        return DTensor(fresh, t._spec, requires_grad=requires_grad)
    return torch.empty_like(t, device=device).requires_grad_(requires_grad)


def _reserve_bytes(model: nn.Module, device: torch.device, tensors: list[torch.Tensor] | None = None) -> int:
    """How much :func:`_reserve` asks for: the model's large (> 1 MiB) local tensors on meta,
    rounded as the allocator rounds blocks; 0 where it is skipped (not a GPU, allocator settings
    ``max_split_size_mb`` or ``expandable_segments``, which change how cached blocks are reused
    so that the memory could be stranded instead, under 64 MiB, or ``SDADAPT_RESERVE=0``).
    ``tensors``: :func:`own_tensors` of ``model``, where the caller has them."""
    if device.type != "cuda" or os.environ.get("SDADAPT_RESERVE", "1") == "0":
        return 0
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
    if "max_split_size" in conf or "expandable_segments" in conf:
        return 0
    total = 0
    seen: set[int] = set()
    for t in own_tensors(model) if tensors is None else tensors:  # each tensor once, as model.parameters() and buffers() give it
        if id(t) in seen:
            continue
        seen.add(id(t))
        local = t._local_tensor if isinstance(t, DTensor) else t
        n = local.numel() * local.element_size()
        if local.is_meta and n > _SMALL:
            total += -(-n // 512) * 512
    return total if total >= 64 * _SMALL else 0


def _reserve(model: nn.Module, device: torch.device, total: int | None = None) -> None:
    """Ask the GPU driver once for all the memory ``to_empty`` is about to take (``total`` bytes,
    by default :func:`_reserve_bytes`): one allocation, freed at once. PyTorch's caching allocator
    keeps that segment and cuts the parameters out of it, instead of one ``cudaMalloc`` per
    parameter. Skipped when it does not fit."""
    if total is None:
        total = _reserve_bytes(model, device)
    if not total:
        return
    try:
        torch.empty(total, dtype=torch.uint8, device=device)
    except torch.OutOfMemoryError:
        log.debug("not reserving %d bytes on %s at once: they do not fit in one piece", total, device)


class Reservation:
    """:func:`_reserve` on a thread of its own, started before a load plans: the driver maps the
    model's memory (a wait that grows with the model) while the plan is made.
    The allocation is made on the stream current where the reservation is started, so that
    ``to_empty`` there reuses the cached segment. A load whose plan fails leaves the segment in
    the caching allocator, free for the process's next allocations.

    Args:
        model: the model about to be materialised.
        device: where it will be (``sdadapt.load``'s ``device=``: ``None`` for its mesh's device).
        tensors: :func:`own_tensors` of ``model``, where the caller has them (else walked here).
    """

    def __init__(self, model: nn.Module, device: torch.device | str | None, tensors: list[torch.Tensor] | None = None):
        self._thread: threading.Thread | None = None
        try:
            where = choose_device(model, device)
            total = _reserve_bytes(model, where, tensors)  # 0 off a GPU, and for a model with nothing on meta
            stream = torch.cuda.current_stream(where) if total else None
        except Exception:  # noqa: BLE001 - a bad device= is reported by materialising, agreed on every rank
            return
        if total:
            self._thread = threading.Thread(target=self._run, args=(model, where, total, stream), name="sdadapt-reserve", daemon=True)
            self._thread.start()

    @staticmethod
    def _run(model: nn.Module, device: torch.device, total: int, stream: torch.cuda.Stream) -> None:
        try:
            with torch.cuda.stream(stream):
                _reserve(model, device, total)
        except Exception as e:  # noqa: BLE001 - only an optimisation: to_empty then allocates per tensor
            log.debug("reserving the model's memory on %s failed: %s", device, e)

    def wait(self) -> None:
        """Return once the reservation has been made (or given up)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
