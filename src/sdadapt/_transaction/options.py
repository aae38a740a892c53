"""What a public call asked for, as one typed, frozen object built at the public edge.

``load``, ``plan_load``, ``load_state``, ``diff`` and ``dry_run`` take their options as keywords
(the public signature users read); each builds one :class:`Options` from them and hands it down
as it is. No step below re-spells ``allow_missing``, ``allow_unexpected``, ``dtype``... as
arguments of its own: a step reads the field it needs from the object.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .._plan.adapter import Adapter
from ..sources import Source
from .materialize import InitFn, MissingInitFn


@dataclass(frozen=True, eq=False)
class Options:
    """The options of one public call about opening, planning and checking a checkpoint.

    ``adapter`` is the call's spec as given (a name, a path, an :class:`Adapter` or ``None``);
    ``name`` the checkpoint as reports and messages name it. The other fields are the public
    keywords of the same names (see :func:`sdadapt.load`)."""

    name: str
    adapter: Adapter | str | os.PathLike[str] | None = None
    subtree: str | None = None
    allow_missing: tuple[str, ...] = ()
    allow_unexpected: tuple[str, ...] = ()
    allow_resized: tuple[str, ...] = ()
    pipeline_stage: bool = False
    dtype: str | torch.dtype | None = None
    lora: str | os.PathLike[str] | None = None
    strict: bool = True
    init_buffers: InitFn | None = None
    init_missing: MissingInitFn | None = None
    checksums: bool = False

    @classmethod
    def of(cls, src: str | os.PathLike[str] | Source, **given: object) -> Options:
        """The options of a call on checkpoint ``src`` from its keywords (``None`` patterns: none)."""
        for patterns in ("allow_missing", "allow_unexpected", "allow_resized"):
            value = given.get(patterns)
            given[patterns] = tuple(value) if isinstance(value, Sequence) and not isinstance(value, str) else ()
        name = (src.remote_url() or src.path) if isinstance(src, Source) else os.fspath(src)  # an open source: its URL, else its path
        return cls(name=name, **given)  # type: ignore[arg-type]

    @property
    def shipped(self) -> bool:
        """Whether ``adapter`` names a shipped adapter (our documented layout, aimed at the model's names)."""
        if not isinstance(self.adapter, str):
            return False  # an Adapter, a path or none: no registry lookup (a plain load never imports it)
        from .._plan.registry import is_shipped  # noqa: PLC0415 - only for an adapter given by name

        return is_shipped(self.adapter)

