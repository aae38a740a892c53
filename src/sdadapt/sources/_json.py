"""Every JSON file that a user or a release hands us, read in one place and one way.

:func:`read_json` refuses a file before it is parsed when it is larger than its limit, is not
UTF-8, or nests deeper than :data:`MAX_DEPTH` (checked on the bytes, so ``json.loads`` never
recurses that far); then it validates the value with a pydantic model in strict mode (no
``"2"`` for ``2``, no ``1`` for ``true``). Every failure is a :class:`~sdadapt.errors.SourceError`
naming the file and, for a value of the wrong type, the field (``weight_map.'x'``), with what the
field must hold.

The models describe only the fields sdadapt reads; other fields pass through untouched
(``extra="allow"``), so a release with fields of its own is fine:

- :class:`ShardIndex`: ``model.safetensors.index.json`` (``weight_map``: key -> file name);
- the config files' models, in :mod:`._configs` (imported where a config file is read: a plain
  load reads none): ``HFConfig``, ``PeftConfig``, ``QuantConfigFile``.

Example:
    >>> from sdadapt.sources._json import ShardIndex, read_json
    >>> index = read_json("ckpt/model.safetensors.index.json", ShardIndex, what="index")  # doctest: +SKIP
    >>> sorted(set(index.weight_map.values()))  # doctest: +SKIP
    ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors']
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, ValidationError

from ..errors import SourceError
from . import _headers

CONFIG_LIMIT = 16 << 20
"""Bytes of a ``config.json``, ``adapter_config.json`` or ``hf_quant_config.json`` (real ones: KBs)."""
INDEX_LIMIT = 64 << 20
"""Bytes of a shard index (real ones: KBs to a few MBs)."""
MAX_DEPTH = 64
"""Nesting of arrays and objects (real configs: under 6)."""

M = TypeVar("M", bound=BaseModel)

_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = bytes(range(256)).translate(None, b"[]{}")  # every byte but the brackets: deleted


class Lenient(BaseModel):
    """A JSON object some of whose fields sdadapt reads: those strictly typed, the rest kept."""

    model_config = ConfigDict(strict=True, extra="allow", defer_build=True)


class ShardIndex(Lenient):
    """``model.safetensors.index.json``: which file holds each key."""

    weight_map: dict[str, str]
    metadata: dict[str, Any] | None = None


def depth_of(data: bytes) -> int:
    """The deepest nesting of arrays and objects in JSON text ``data`` (brackets inside strings
    do not count); linear in ``len(data)``, no recursion."""
    brackets = _STRINGS.sub(b"", data).translate(None, _BRACKETS)
    if not brackets:
        return 0
    if brackets.count(b"[") + brackets.count(b"{") <= 1:  # common case: at most one opener
        return 1
    steps = torch.frombuffer(bytearray(brackets), dtype=torch.uint8)
    delta = torch.where((steps == ord("[")) | (steps == ord("{")), 1, -1).to(torch.int64)
    return int(delta.cumsum(0).max().item())


def loads(data: bytes, path: str, what: str, *, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON value of ``data`` read from ``path``: UTF-8 (a BOM is allowed), nesting at most
    ``max_depth``; a :class:`SourceError` naming ``what`` and the file otherwise."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise SourceError(
            f"{what} is not UTF-8 text (byte {e.start}: {data[e.start : e.start + 4]!r}); JSON files are UTF-8", path=path
        ) from None
    # nesting can only exceed max_depth when there are more openers than that (a C-speed count:
    # a 9 MB shard index costs milliseconds); only then are strings stripped and depths summed
    openers = data.count(b"[") + data.count(b"{")
    depth = depth_of(data) if openers > max_depth else 0
    if depth > max_depth:
        raise SourceError(f"{what} nests {depth} levels deep, more than the {max_depth} sdadapt accepts", path=path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise SourceError(f"{what} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}", path=path) from None
    except (RecursionError, ValueError) as e:
        raise SourceError(f"{what} cannot be parsed as JSON: {type(e).__name__}: {e}", path=path) from None


def read_bytes(path: str, limit: int, what: str) -> bytes:
    """The bytes of file ``path``, refused (:class:`SourceError`) when over ``limit`` bytes or
    unreadable; the recorded bytes where another rank read them for the job (:mod:`._headers`)."""
    given = _headers.recorded(path)
    if given is not None:
        if given[1] > limit or len(given[0]) != given[1]:
            raise SourceError(f"{what} of {given[1]} bytes exceeds the limit of {limit} bytes", path=path)
        return given[0]
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise SourceError(f"{what} of {size} bytes exceeds the limit of {limit} bytes", path=path)
            data = f.read(limit + 1)
    except OSError as e:
        raise SourceError(f"cannot read {what}: {e.strerror or e}", path=path) from None
    if len(data) > limit:
        raise SourceError(f"{what} grew past the limit of {limit} bytes while being read", path=path)
    _headers.note(path, data, len(data))
    return data


def field_name(loc: tuple[Any, ...]) -> str:
    """A pydantic error location as a dotted field path: ``("weight_map", "a.b")`` -> ``weight_map.'a.b'``."""
    parts = []
    for p in loc:
        if isinstance(p, int):
            parts.append(f"[{p}]")
        elif isinstance(p, str) and p.isidentifier():
            parts.append(("." if parts else "") + p)
        else:
            parts.append(("." if parts else "") + repr(p))
    return "".join(parts) or "(the whole value)"


def validate(value: Any, model: type[M], path: str, what: str, *, at: tuple[str | int, ...] = ()) -> M:
    """``value`` (parsed JSON) checked against ``model``: a :class:`SourceError` naming the file
    and the first fields that are wrong (at most three), with what each must hold. ``at``: where
    ``value`` sits in the file, prefixed to the field names (``("quantization_config",)`` for a
    model of that object alone: ``field quantization_config.weight_block_size``)."""
    if not isinstance(value, dict):
        where = f"field {field_name(at)}" if at else what
        raise SourceError(f"{where} must be a JSON object, not {type(value).__name__}", path=path)
    try:
        return model.model_validate(value)
    except ValidationError as e:
        rows = []
        for err in e.errors()[:3]:
            got = repr(err.get("input"))
            got = got if len(got) <= 60 else got[:57] + "..."
            rows.append(f"field {field_name((*at, *err['loc']))}: {err['msg']} (got {got})")
        more = f" (and {e.error_count() - 3} more)" if e.error_count() > 3 else ""
        raise SourceError(f"{what}: " + "; ".join(rows) + more, path=path) from None


def read_json(
    path: str | os.PathLike[str],
    model: type[M] | None = None,
    *,
    what: str = "JSON file",
    limit: int = CONFIG_LIMIT,
    max_depth: int = MAX_DEPTH,
) -> Any:
    """Read the JSON file ``path`` and validate it with ``model``.

    Args:
        path: the file.
        model: a pydantic model (one of this module's, or a caller's ``extra="allow"`` model);
            ``None`` returns the parsed value unchecked (a file whose every field the caller
            checks itself).
        what: what the file is, for messages (``"index"``, ``"config.json"``).
        limit: refuse files larger than this many bytes before reading them.
        max_depth: refuse values nested deeper (checked before parsing).

    Returns:
        The validated model (``model.model_extra`` holds the fields it does not describe), or
        the parsed value when ``model`` is ``None``.

    Raises:
        SourceError: naming the file (and the field): too large, unreadable, not UTF-8, too
            deep, not JSON, or a field of the wrong type.

    Example:
        >>> cfg = read_json("ckpt/config.json", HFConfig, what="config.json")  # doctest: +SKIP
        >>> cfg.num_hidden_layers  # doctest: +SKIP
        32
    """
    p = os.fspath(path)
    value = loads(read_bytes(p, limit, what), p, what, max_depth=max_depth)
    return value if model is None else validate(value, model, p, what)


def read_json_dict(path: str | os.PathLike[str], model: type[BaseModel], *, what: str, limit: int = CONFIG_LIMIT) -> dict[str, Any]:
    """:func:`read_json` with ``model``, returning the file's object itself (every field, those
    ``model`` describes checked): for callers that read a config as a dict."""
    p = os.fspath(path)
    value = loads(read_bytes(p, limit, what), p, what)
    validate(value, model, p, what)
    return dict(value)
