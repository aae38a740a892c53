"""Shipped adapters, addressable by name: ``sdadapt.get_adapter("llama", "ckpt_dir/")``.

Each adapter is a module ``sdadapt.adapters.<name>`` that exposes

- ``SUMMARY: str``: one line for ``sdadapt adapters``;
- ``build(**options) -> Adapter``: the adapter from the checkpoint's layout to the model's
  (``.inverse()`` gives the other direction). Options are keyword parameters (head counts,
  ``tied=...``); a required option is a parameter without a default;
- optionally ``MODEL_TYPES: tuple[str, ...]``: the ``model_type`` values of ``config.json`` whose
  checkpoints it maps (default: its own name), for the suggestion :func:`shipped_hint` makes;
- optionally ``FORMAT: str``: the format its checkpoints are saved in when it is not
  ``"safetensors"`` (``megatron_gpt``: ``"torch_dist"``), what :func:`sdadapt.export` writes when
  no ``format`` is given (:func:`checkpoint_format`);
- optionally ``options_from_config(folder: str) -> dict``: options read from the checkpoint
  folder's ``config.json`` / ``params.json`` (``{}`` when it has none); a reader that takes a
  second parameter, ``options_from_config(folder, source)``, also gets the checkpoint (to read
  its key names and stored dtypes): the open :class:`~sdadapt.sources.Source` when the caller
  opened it (``load``, ``diff``, ``convert``... open the checkpoint once per call and hand the
  source on; read its ``schema``, do not close it), else the path as given.

:func:`get_adapter` merges options: the config's first, explicit keyword arguments over them
(an explicit value that differs from the config's is logged). It checks the merged options
against ``build``'s signature before calling it: an unknown or missing option raises
:class:`~sdadapt.errors.AdapterError` naming it; ``build`` itself raises for inconsistent values.

An engine adapter (``sdadapt.adapters.vllm_*``: an inference engine's parameters as the target of
a refit) also follows :class:`EngineAdapter`: ``layout(...)`` gives the :data:`EngineLayout` that
``refit_plan(..., engine_layout=)`` takes, ``parameter_shapes(...)`` the shapes the engine's
layers create on one rank.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import json
import logging
import os
import pkgutil
import re
import tempfile
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ..errors import AdapterError, SdadaptError
from .adapter import Adapter

if TYPE_CHECKING:
    import torch

    from ..sources import Source

log = logging.getLogger(__name__)

PACKAGE = "sdadapt.adapters"
"""Where adapters live (tests may point this at another package)."""

EngineLayout = Callable[[str, "torch.Tensor"], tuple[tuple[int, ...], tuple[tuple[int, int], ...]]]
"""``layout(key, local_tensor) -> (global shape, box)``: where an engine rank's plain tensor lies
in the whole tensor (``sdadapt.adapters.vllm_llama.layout(tp, rank)`` gives vLLM's)."""


@runtime_checkable
class EngineAdapter(Protocol):
    """The engine-layout protocol: what a shipped engine adapter module (``vllm_llama``,
    ``vllm_qwen3_moe``, ``vllm_fp8``, ``vllm_deepseek_v3``) offers beside ``SUMMARY``. Each
    function takes the keyword options of its family (head counts, ``tp``, ``rank``...)."""

    def build(self, *args: Any, **kwargs: Any) -> Adapter:
        """The adapter from the HF layout to the engine's parameters (also ``get_adapter(name, ...)``)."""
        ...

    def layout(self, *args: Any, **kwargs: Any) -> EngineLayout:
        """Where one rank's parameters lie in the whole tensors the adapter makes, for ``engine_layout=``."""
        ...

    def parameter_shapes(self, *args: Any, **kwargs: Any) -> dict[str, tuple[int, ...]]:
        """The shape of each engine parameter on one rank, as the engine's layers create them."""
        ...


def _package() -> ModuleType | None:
    try:
        return importlib.import_module(PACKAGE)
    except ModuleNotFoundError as e:
        if e.name == PACKAGE:
            return None
        raise


def adapter_names() -> list[str]:
    """Names of the shipped adapter modules (no import of the modules themselves)."""
    pkg = _package()
    if pkg is None:
        return []
    return sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_"))


ALIASES = {
    "llama2": "llama", "llama3": "llama", "llama31": "llama", "llama32": "llama", "llama33": "llama",
    "metallama": "llama", "deepseekr1": "deepseek_v3", "kimik2": "deepseek_v3",
}
"""Other names of shipped adapters, spelled as :func:`_plain` leaves them: the family names other
tools use (torchtitan's ``llama3``, a release's ``Llama-3.1``) and releases of the same layout."""


def _plain(name: str) -> str:
    """``name`` lower-cased without ``-``, ``_``, ``.`` and spaces: ``Llama-3.1`` -> ``llama31``."""
    return re.sub(r"[-_.\s]", "", name.lower())


def canonical_name(name: object) -> str | None:
    """The shipped adapter ``name`` means: itself, the same name spelled otherwise (``Qwen-3``,
    ``deepseek-v3``) or a common alias (``llama3`` -> ``llama``, :data:`ALIASES`); ``None`` when
    it names none."""
    if not isinstance(name, str) or not name:
        return None
    names = adapter_names()
    if name in names:
        return name
    plain = _plain(name)
    for n in names:
        if _plain(n) == plain:
            return n
    alias = ALIASES.get(plain)
    return alias if alias in names else None


def is_shipped(adapter: object) -> bool:
    """Whether ``adapter`` names a shipped adapter, by its name or an alias (our documented
    layout, which load, diff and export aim at the names the model holds)."""
    return canonical_name(adapter) is not None


def checkpoint_format(adapter: object) -> str | None:
    """The format the checkpoints of the shipped adapter ``adapter`` names are saved in (its
    module's ``FORMAT``): ``adapter`` is a name or an adapter :func:`get_adapter` built (its name,
    or the first part of ``a + b``); ``None`` when it declares none or names no shipped adapter."""
    name = adapter if isinstance(adapter, str) else getattr(adapter, "name", None)
    shipped = canonical_name(name.split("+")[0]) if isinstance(name, str) else None
    if shipped is None:
        return None
    fmt = getattr(adapter_module(shipped), "FORMAT", None)
    return fmt if isinstance(fmt, str) else None


def _no_such_adapter(name: str) -> str:
    """The message for a name no shipped adapter has: the nearest names first, then the list,
    then how to pass an adapter of one's own (Python's spelling; the CLI re-spells it)."""
    names = adapter_names()
    by_plain = {_plain(n): n for n in names}
    near = difflib.get_close_matches(_plain(name), list(by_plain), n=2, cutoff=0.6)
    guess = f"did you mean {' or '.join(repr(by_plain[p]) for p in near)}? " if near else ""
    return (
        f"no adapter named {name!r}; {guess}shipped adapters: {', '.join(names) or 'none'} {OWN_ADAPTER[False]}"
    )


OWN_ADAPTER = {
    False: "(one of your own: an sdadapt.Adapter, or adapter='my_adapters.py:ADAPTER')",
    True: "(one of your own: --adapter my_adapters.py:ADAPTER)",
}
"""How a message names an adapter of one's own: in Python's spelling, or the command line's
(``cli``), which :func:`spelled_for_cli` puts in its place."""


def spelled_for_cli(message: str) -> str:
    """An error message raised in Python's spelling, as the command line prints it (its options
    where Python names keywords)."""
    return message.replace(OWN_ADAPTER[False], OWN_ADAPTER[True])


def adapter_module(name: str) -> ModuleType:
    """Import ``sdadapt.adapters.<name>`` (``name`` or an alias of it, :func:`canonical_name`)
    and check that it is an adapter module."""
    given = name
    name = canonical_name(name) or name
    if name != given:
        log.info("adapter %r is the shipped adapter %r", given, name)
    if not isinstance(name, str) or not name.isidentifier():
        raise AdapterError(_no_such_adapter(str(name)))
    full = f"{PACKAGE}.{name}"
    try:
        mod = importlib.import_module(full)
    except ModuleNotFoundError as e:
        if e.name in (PACKAGE, full):
            raise AdapterError(_no_such_adapter(name)) from None
        raise AdapterError(f"adapter {name!r} needs the package {e.name!r}, which is not installed") from e
    if not callable(getattr(mod, "build", None)) or not isinstance(getattr(mod, "SUMMARY", None), str):
        raise AdapterError(f"module {full} is not an adapter: it needs SUMMARY (str) and build(**options)")
    return mod


def config_folder(source: str | os.PathLike[str] | Source) -> str | None:
    """The folder whose config files describe ``source`` (the folder itself, or a file's folder;
    for an open source, that of its path)."""
    path = os.fspath(source) if isinstance(source, (str, os.PathLike)) else source.path
    if os.path.isdir(path):
        return path
    if os.path.isfile(path):
        return os.path.dirname(os.path.abspath(path))
    return None


def options_of(name: str) -> dict[str, str]:
    """``option -> "required"`` or ``"default <value>"`` from the adapter's ``build`` signature."""
    out = {}
    for p in inspect.signature(adapter_module(name).build).parameters.values():
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            out[p.name] = "required" if p.default is p.empty else f"default {p.default!r}"
    return out


def _read_options(name: str, reader: Any, folder: str, source: str | Source) -> dict[str, Any]:
    try:
        # a reader with a second parameter also gets the checkpoint itself, open or as a path (a
        # file in a folder of several files: its key names tell what the config files cannot)
        two = len(inspect.signature(reader).parameters) >= 2
        return dict(reader(folder, source) if two else reader(folder))
    except AdapterError as e:
        raise AdapterError(f"{e} (reading the options in {_config_file(folder) or folder})") from None
    except SdadaptError:
        raise
    except Exception as e:  # noqa: BLE001 - a bad config file: name it
        raise AdapterError(f"adapter {name!r}: cannot read options from the config in {folder}: {e}") from e


def options_from_model_config(name: str, config: dict[str, Any]) -> dict[str, Any]:
    """The options adapter ``name`` reads from ``config`` (a model's configuration with HF
    ``config.json`` keys), as its ``options_from_config`` reads them from a folder holding that
    ``config.json`` and no weights."""
    reader = getattr(adapter_module(name), "options_from_config", None)
    if not callable(reader):
        return {}
    with tempfile.TemporaryDirectory(prefix="sdadapt-config-") as folder:
        with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, default=str)
        return _read_options(name, reader, folder, folder)


def get_adapter(
    name: str, source: str | os.PathLike[str] | Source | None = None, *, config: dict[str, Any] | None = None, **options: Any
) -> Adapter:
    """The shipped adapter ``name`` built with ``options``; with ``source`` (a checkpoint folder
    or a file inside one), options the keyword arguments leave out come from its config files;
    without one, from ``config`` (a model's configuration with HF ``config.json`` keys, as
    ``model.config.to_dict()`` gives it) when given.

    Args:
        name: a shipped adapter's name (``sdadapt.list_adapters()``).
        source: a checkpoint folder or file whose config files supply the options left out (or
            the open :class:`~sdadapt.sources.Source` of one: its schema is used as it is).
        config: a model's configuration with HF ``config.json`` keys, used without ``source``.
        **options: the adapter's options (``n_heads=32``, ``tp=2``, ...).

    Returns:
        The :class:`Adapter`.

    Raises:
        AdapterError: no such adapter, or an option it needs is missing or wrong.

    Example::

        adapter = sdadapt.get_adapter("llama", "path/to/llama")
        adapter = sdadapt.get_adapter("gpt2", prefix="")
    """
    mod = adapter_module(name)
    from_config: dict[str, Any] = {}
    folder = config_folder(source) if source is not None else None
    reader = getattr(mod, "options_from_config", None)
    if source is not None and folder is not None and callable(reader):
        checkpoint = os.fspath(source) if isinstance(source, (str, os.PathLike)) else source  # an open Source as it is
        from_config = _read_options(name, reader, folder, checkpoint)
    elif source is None and config is not None:
        from_config = options_from_model_config(name, config)
        folder = None
    for k, v in options.items():
        if k in from_config and from_config[k] != v:
            where = folder or "the model's config"
            log.warning("adapter %s: option %s=%r overrides %r from the config in %s", name, k, v, from_config[k], where)
    sig = inspect.signature(mod.build)
    params = {
        p.name: p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }
    takes_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    if not takes_any:
        unknown = sorted(set(options) - set(params))
        if unknown:
            raise AdapterError(
                f"adapter {name!r} has no option {', '.join(map(repr, unknown))}; its options: "
                f"{', '.join(params) or 'none'}"
            )
        ignored = sorted(set(from_config) - set(params))
        if ignored:
            log.debug("adapter %s: config options %s are not build options; ignored", name, ignored)
        from_config = {k: v for k, v in from_config.items() if k in params}
    merged = {**from_config, **options}
    missing = [p.name for p in params.values() if p.default is p.empty and p.name not in merged]
    if missing:
        if folder:
            where = f"the config in {folder} does not give it"
        elif config is not None:
            where = "the model's config does not give it"
        else:
            where = "no checkpoint folder was given to read it from (nor a model config)"
        raise AdapterError(
            f"adapter {name!r} needs option {', '.join(map(repr, missing))} and {where}; pass the adapter built "
            f"with it, sdadapt.get_adapter({name!r}, {missing[0]}=...), or the checkpoint folder it was loaded from, "
            f"sdadapt.get_adapter({name!r}, source='ckpt_dir/') (command line: --option {missing[0]}=...)"
        )
    try:
        adapter = mod.build(**merged)
    except AdapterError as e:
        given = [k for k in from_config if k not in options]
        config_path = _config_file(folder)
        if not given or config_path is None:
            raise
        raise AdapterError(f"{e} (options {', '.join(given)} were read from {config_path})") from None
    except SdadaptError:
        raise
    except Exception as e:  # noqa: BLE001 - a bad option value: name the options
        shown = ", ".join(f"{k}={v!r}" for k, v in merged.items())
        raise AdapterError(f"adapter {name!r} cannot be built with {shown}: {type(e).__name__}: {e}") from e
    if not isinstance(adapter, Adapter):
        raise AdapterError(f"adapter module {mod.__name__}: build() returned a {type(adapter).__name__}, not an Adapter")
    log.info("adapter %s: %d rules, options %s", name, len(adapter.rules), merged)
    return adapter


def _config_file(folder: str | None) -> str | None:
    """The config file shipped adapters read options from in ``folder`` (``config.json``, else
    ``params.json``), or ``None``."""
    for name in ("config.json", "params.json"):
        if folder and os.path.isfile(os.path.join(folder, name)):
            return os.path.join(folder, name)
    return None


def list_adapters() -> list[tuple[str, str]]:
    """``(name, SUMMARY)`` of every shipped adapter; one that cannot be imported says why.

    Returns:
        ``[(name, summary), ...]`` sorted by name.

    Example::

        summaries = dict(sdadapt.list_adapters())  # name -> one line
    """
    out = []
    for name in adapter_names():
        try:
            out.append((name, adapter_module(name).SUMMARY))
        except SdadaptError as e:
            out.append((name, f"(unavailable: {e})"))
    return out


def family_adapter(source: str | os.PathLike[str] | None) -> tuple[str, str] | None:
    """``(shipped adapter name, model_type)`` when the ``config.json`` beside ``source`` (a
    checkpoint folder or a file in one) names a family a shipped adapter maps (its name, or one
    of its ``MODEL_TYPES``); ``None`` otherwise (no such file, no such adapter)."""
    folder = config_folder(source) if isinstance(source, (str, os.PathLike)) else None
    path = os.path.join(folder, "config.json") if folder else None
    if path is None or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if not isinstance(model_type, str) or not model_type:
        return None
    names = adapter_names()
    if model_type in names:
        return model_type, model_type
    for name in names:
        try:
            types = getattr(adapter_module(name), "MODEL_TYPES", ())
        except SdadaptError:
            continue
        if model_type in types:
            return name, model_type
    return None


def shipped_hint(source: str | os.PathLike[str] | None, fits: bool | None = None) -> str | None:
    """One line suggesting the shipped adapter for the family ``source``'s ``config.json`` names
    (:func:`family_adapter`), for a report made without an adapter; ``fits``: whether a plan
    with it lines everything up (``None``: not checked). ``None`` when no shipped adapter fits
    the family."""
    found = family_adapter(source)
    if found is None:
        return None
    name, model_type = found
    how = f"pass adapter={name!r} (command line: --adapter {name})"
    if fits is True:
        return f"config.json says model_type {model_type!r}: the shipped adapter {name!r} fits; {how}"
    if fits is False:
        return (f"config.json says model_type {model_type!r}, the family of the shipped adapter {name!r}; problems "
                f"remain with it too: {how} and read that report")
    return f"config.json says model_type {model_type!r}, the family of the shipped adapter {name!r}: {how}"


_HOW = re.compile(r"pass adapter='(\w+)' \(command line: --adapter \w+\)")


def spelled(hint: str, cli: bool) -> str:
    """A :func:`shipped_hint` line spelled for Python (``adapter='llama'``) or the command line
    (``--adapter llama``) only."""
    return _HOW.sub(lambda m: f"pass --adapter {m.group(1)}" if cli else f"pass adapter={m.group(1)!r}", hint)
