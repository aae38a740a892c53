"""Turn command-line specs into objects: a target model (or checkpoint path) and an adapter.

Shared by the CLI commands (``diff``, ``convert``, ...) and usable from Python:

- ``resolve_target("ckpt.pt")`` -> ``"ckpt.pt"`` (a checkpoint path, returned as is);
  ``resolve_target("mypkg.models:build")`` or ``resolve_target("train.py:build_model")`` ->
  the ``nn.Module`` the function returns (a meta-device model is fine: only its state dict's
  shapes and dtypes are used).
- ``resolve_adapter("llama")`` -> a shipped adapter by name (``sdadapt._plan.registry``);
  ``resolve_adapter("my_adapters.py:ADAPTER")`` / ``"mypkg.adapters:make"`` -> an
  :class:`~sdadapt.Adapter`, or a function returning one (called with ``**options``);
  ``resolve_adapter("adapter.json")`` -> ``Adapter.from_json``.

Failures raise :class:`ResolveError` (an :class:`~sdadapt.SdadaptError`; the CLI exits 2).
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import hashlib
import importlib
import importlib.util
import logging
import os
import re
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ..errors import AdapterError, ResolveError, SdadaptError

if TYPE_CHECKING:
    from torch import nn

    from ..sources import Source
    from .adapter import Adapter

log = logging.getLogger(__name__)

__all__ = ["ResolveError", "adapter_or_none", "load_object", "resolve_adapter", "resolve_target", "split_spec"]


def split_spec(spec: str) -> tuple[str, str] | None:
    """``"a.b:c"`` -> ``("a.b", "c")``; ``"dir/f.py:make"`` -> ``("dir/f.py", "make")``; a
    plain path or name (no attribute part) -> ``None``. A Windows drive (``C:\\x``) is no spec."""
    if ":" not in spec:
        return None
    where, attr = spec.rsplit(":", 1)
    if not where or not attr or "/" in attr or "\\" in attr:
        return None
    if not all(part.isidentifier() for part in attr.split(".")):
        return None
    return where, attr


def _import_file(path: str) -> ModuleType:
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise ResolveError(f"{path}: no such Python file")
    digest = hashlib.sha1(full.encode()).hexdigest()[:12]
    name = f"_sdadapt_spec_{os.path.splitext(os.path.basename(full))[0]}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, full)
    if spec is None or spec.loader is None:
        raise ResolveError(f"{path}: cannot be imported as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        # the file's own folder first, so it can import its neighbours (as `python file.py` would)
        with _importable_from(os.path.dirname(full)):
            spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # SystemExit: a script that parses argv at import
        sys.modules.pop(name, None)
        raise ResolveError(f"{path}: importing it failed: {type(e).__name__}: {e}") from e
    return module


@contextlib.contextmanager
def _importable_from(folder: str) -> Iterator[None]:
    """Modules in ``folder`` can be imported while this is open (``folder`` first on
    ``sys.path``, unless it is there already, or is the current folder and ``""`` is)."""
    there = folder in sys.path or (folder == os.getcwd() and "" in sys.path)
    if not there:
        sys.path.insert(0, folder)
    try:
        yield
    finally:
        if not there and folder in sys.path:
            sys.path.remove(folder)


def _import_module(name: str) -> ModuleType:
    try:  # like `python -m`, modules of the current folder are found (console scripts lack it)
        with _importable_from(os.getcwd()):
            return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and (name == e.name or name.startswith(e.name + ".")):
            raise ResolveError(
                f"no module named {name!r}: give an importable module (on PYTHONPATH or in the current "
                f"folder) or a file path such as path/to/{name.split('.')[-1]}.py"
            ) from e
        raise ResolveError(f"importing {name!r} failed: {type(e).__name__}: {e}") from e
    except Exception as e:  # noqa: BLE001 - any import-time failure becomes a usage error
        raise ResolveError(f"importing {name!r} failed: {type(e).__name__}: {e}") from e


def load_object(spec: str) -> Any:
    """The object named by ``module:attr`` or ``path/to/file.py:attr`` (``attr`` may be dotted)."""
    parts = split_spec(spec)
    if parts is None:
        raise ResolveError(f"{spec!r} is not of the form module:attr or path/to/file.py:attr")
    where, attr = parts
    is_file = where.endswith(".py") or os.path.sep in where or "/" in where
    module = _import_file(where) if is_file else _import_module(where)
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            have = sorted(n for n in dir(obj) if not n.startswith("_"))
            near = difflib.get_close_matches(part, have, n=1, cutoff=0.6)
            hint = f"; did you mean {where}:{attr.replace(part, near[0])}?" if near else ""
            raise ResolveError(f"{where} has no attribute {attr!r}{hint} (it has {have[:20]})") from None
    return obj


def _top_level_names(path: str) -> list[str]:
    """The functions and classes a Python file defines at top level (read, not run)."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return []
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return [n.name for n in tree.body if isinstance(n, kinds) and not n.name.startswith("_")]


_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def _is_module(name: str) -> bool:
    """``name`` is an importable module (looked up, its top-level package only imported)."""
    try:
        with _importable_from(os.getcwd()):
            if importlib.util.find_spec(name.split(".")[0]) is None:
                return False
            return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _spec_without_function(text: str) -> str | None:
    """Why ``text`` (no ``:function``) is not a target, when it names Python code: a ``.py``
    file or a dotted module path. ``None`` for anything that may be a checkpoint path."""
    if text.endswith(".py") and os.path.isfile(text):
        names = _top_level_names(text)
        example = names[0] if names else "build_model"
        listed = f" (it defines {', '.join(names[:12])})" if names else ""
        return (
            f"{text} is a Python file, not a checkpoint: give {text}:FUNCTION naming the function that "
            f"returns the model, e.g. {text}:{example}{listed}"
        )
    from ..sources import FILE_SUFFIXES

    if os.path.exists(text) or not _DOTTED.fullmatch(text) or text.lower().endswith(FILE_SUFFIXES):
        return None
    if _is_module(text):
        return (
            f"{text!r} is a module, not a checkpoint: give {text}:FUNCTION naming the function that returns "
            f"the model (module:function, or path/to/file.py:function)"
        )
    module, _, attr = text.rpartition(".")
    if module and _is_module(module):
        return f"{text!r} is no checkpoint path or module; did you mean {module}:{attr} (module:function)?"
    return None


def _call(spec: str, fn: Any, options: dict[str, Any]) -> Any:
    try:
        return fn(**options)
    except SdadaptError:
        raise
    except TypeError as e:
        raise ResolveError(f"{spec}: calling it with options {options} failed: {e}") from e
    except Exception as e:  # noqa: BLE001 - the user's function failed: name it
        raise ResolveError(f"{spec}: calling it failed: {type(e).__name__}: {e}") from e


def _made(text: str, obj: Any, cls: type, options: dict[str, Any], noun: str, label: str) -> Any:
    """``obj`` (named by ``text``) if it is a ``cls`` (then it takes no ``options``), else what
    calling it with ``options`` returns, which must be a ``cls``. ``noun`` (``"a model"``) and
    ``label`` (``"nn.Module"``) name the class in errors."""
    if isinstance(obj, cls):
        if options:
            raise ResolveError(f"{text} is {noun}, not a function: it takes no options ({sorted(options)})")
        return obj
    if not callable(obj):
        raise ResolveError(f"{text} is a {type(obj).__name__}, not an {label} or a function returning one")
    made = _call(text, obj, options)
    if not isinstance(made, cls):
        raise ResolveError(f"{text} returned a {type(made).__name__}, not an {label}")
    return made


def resolve_target(spec: str | os.PathLike[str] | nn.Module, **options: Any) -> nn.Module | str:
    """A checkpoint path (returned as a string) or the model that ``spec`` names.

    ``spec`` is an existing file or folder, or ``module:function`` / ``file.py:function``
    (called with ``**options``) / ``module:MODEL`` naming an ``nn.Module``. Anything else is
    returned as a path, so that opening it reports the missing file.
    """
    from torch import nn

    if isinstance(spec, nn.Module):
        return spec
    text = os.fspath(spec)
    if split_spec(text) is None:
        why = _spec_without_function(text)
        if why:
            raise ResolveError(why)
        return text
    if os.path.exists(text):
        return text
    model = _made(text, load_object(text), nn.Module, options, "a model", "nn.Module")
    log.info("target %s: %s", text, type(model).__name__)
    return model


def _real_tensors(model: nn.Module) -> tuple[int, list[str]]:
    """Bytes of ``model``'s parameters and buffers that are not on the meta device, and their devices."""
    seen: dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if not t.is_meta:
            seen[id(t)] = t
    return sum(t.numel() * t.element_size() for t in seen.values()), sorted({str(t.device) for t in seen.values()})


def resolve_target_on_meta(spec: str | os.PathLike[str] | nn.Module, **options: Any) -> tuple[nn.Module | str, str | None]:
    """:func:`resolve_target` for what needs only shapes and dtypes (``sdadapt diff`` and
    ``draft``'s ``--target``): the function or class is called under ``torch.device("meta")``,
    so a model built without a device costs no memory and no initialisation. Returns the target
    and a note for the user when the model holds real tensors all the same (the builder put
    them on a device itself, or failed on meta and was built again without it), else ``None``."""
    import torch

    if not isinstance(spec, (str, os.PathLike)) or split_spec(os.fspath(spec)) is None or os.path.exists(os.fspath(spec)):
        return resolve_target(spec, **options), None
    text = os.fspath(spec)
    retried = ""
    try:
        with torch.device("meta"):
            target = resolve_target(spec, **options)
    except ResolveError as e:
        # code that cannot run on meta (reads values: .item(), .tolist(), a file...), in the
        # builder or at its module's import: built as it is written (its own error if it fails so too)
        target = resolve_target(spec, **options)
        retried = f"building {text} under torch.device('meta') failed ({e}), so it was built without it"
    if isinstance(target, str):
        return target, None
    nbytes, devices = _real_tensors(target)
    if not nbytes:
        log.info("target %s: built on the meta device", text)
        return target, None
    from ..sources import human

    why = retried or f"{text} put its tensors on {', '.join(devices)} although it ran under torch.device('meta')"
    return target, (
        f"{why}: the model holds {human(nbytes)} of real tensors, of which only shapes and dtypes are used; "
        "a builder that creates its tensors on the meta device saves that memory and time"
    )


def resolve_adapter(
    spec: str | os.PathLike[str] | Adapter, *, source: str | os.PathLike[str] | Source | None = None, **options: Any
) -> Adapter:
    """The adapter ``spec`` names: an :class:`Adapter`, a shipped adapter name, a ``.json``
    file, or ``module:ATTR`` / ``file.py:ATTR`` (an Adapter, or a function returning one,
    called with ``**options``). ``source`` (the checkpoint: a path, an ``hf://`` Hub id, or an
    open :class:`~sdadapt.sources.Source`, whose schema is then used rather than the headers read
    again) lets a shipped adapter read the options not given here from the checkpoint folder's
    config files and key names."""
    from .adapter import Adapter

    if isinstance(spec, Adapter):
        if options:
            raise ResolveError(f"adapter {spec.name!r} is ready-made; it takes no options ({sorted(options)})")
        return spec
    text = os.fspath(spec)
    if text.endswith(".json"):
        if options:
            raise ResolveError(f"{text}: a JSON adapter takes no options ({sorted(options)})")
        try:
            with open(text, encoding="utf-8") as f:
                data = f.read()
        except OSError as e:
            raise ResolveError(f"{text}: cannot read adapter JSON: {e.strerror or e}") from None
        try:
            return Adapter.from_json(data)
        except AdapterError as e:
            raise AdapterError(f"{text}: {e}") from None
    if split_spec(text) is not None:
        return _made(text, load_object(text), Adapter, options, "an Adapter", "sdadapt.Adapter")
    if text.endswith(".py") or os.path.sep in text or os.path.exists(text):
        raise ResolveError(
            f"adapter {text!r}: give a name, a .json file, or file.py:ATTR naming an Adapter (or a function)"
        )
    try:
        registry = importlib.import_module("sdadapt._plan.registry")
    except ModuleNotFoundError as e:
        if e.name not in ("sdadapt._plan.registry",):
            raise
        raise ResolveError(
            f"adapter {text!r}: no adapters are shipped by name in this version; give a .json file or "
            "file.py:ATTR naming an Adapter"
        ) from None
    if isinstance(source, (str, os.PathLike)):
        from ..sources import local_path

        source = local_path(source)  # a Hub id: the snapshot folder, whose config the adapter reads
    return registry.get_adapter(text, source=source, **options)


def adapter_or_none(
    adapter: Adapter | str | os.PathLike[str] | None, source: object = None, model: nn.Module | None = None
) -> Adapter | None:
    """The ``adapter`` argument of ``load``, ``load_state``, ``export``, ``export_iter``,
    ``diff``, ``draft`` and ``convert``: ``None`` stays ``None`` (for a transformers ``model``
    and a ``source``: :func:`sdadapt.hf_adapter`), an :class:`Adapter` is used as is, and a
    string is resolved by :func:`resolve_adapter` (a shipped name, ``file.py:ATTR``,
    ``module:ATTR`` or a ``.json`` file). ``source`` is the checkpoint (a path or an open
    :class:`~sdadapt.sources.Source`): a shipped adapter reads the options it needs from the
    config files of its folder. Without a source, ``model`` (export, save_state) stands in: the
    checkpoint folder it was last loaded from by ``sdadapt.load``, else its own configuration
    (a transformers model's ``config``, torchtitan's model config) gives a shipped adapter's options.
    An open source is handed on as it is: nothing here reads its headers again."""
    from .adapter import Adapter

    if isinstance(adapter, Adapter):
        return adapter
    if adapter is None:
        from .hf_models import hf_adapter, is_hf_model

        if source is None or not is_hf_model(model):
            return None
        from .hf_gguf import gguf_hf_adapter, is_gguf

        if is_gguf(source):
            return gguf_hf_adapter(model, source)  # type: ignore[arg-type]
        from .hf_quant import quant_method, quantized_hf_adapter

        if model is not None and quant_method(source) is not None:
            return quantized_hf_adapter(model, source)
        return hf_adapter(model, source)  # type: ignore[arg-type]
    path = getattr(source, "path", source)
    where = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
    if where is None and model is not None and isinstance(adapter, str):
        from ..sources import loaded_from, model_config
        from . import registry

        where = loaded_from(model)
        if where is None and registry.is_shipped(adapter):
            config = model_config(model)
            if config is not None:
                return registry.get_adapter(adapter, config=config)
    from ..sources import Source

    return resolve_adapter(adapter, source=source if isinstance(source, Source) else where)
