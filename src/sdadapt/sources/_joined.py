"""One source made of a base source and other sources whose keys appear under a namespace."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._base.regions import Box
from .._base.schema import TensorLocation
from ..errors import SourceError
from ._base import Source


class JoinedSource(Source):
    """``base``'s tensors under their own keys, and each ``extra[namespace]``'s tensors under
    ``namespace + key`` (a LoRA adapter beside its base model: ``"lora:"`` +
    ``"base_model.model....lora_A.weight"``), so that one plan and one read see both.

    Every capability (:meth:`locate`, :meth:`locate_region`, :meth:`files`...) is delegated to
    the source that holds the key, so the I/O engine keeps its direct-read paths for both. A
    base key that starts with a namespace would be ambiguous: a :class:`SourceError`. The
    joined source owns its parts: :meth:`close` closes them all.
    """

    def __init__(self, base: Source, extra: dict[str, Source]):
        self.base = base
        self.extra = dict(extra)
        self.path = base.path
        for ns in self.extra:
            if not ns:
                raise SourceError("a joined source needs a non-empty namespace for each extra source", path=base.path)
            clash = next((k for k in [*base.schema, *base.non_tensor] if k.startswith(ns)), None)
            if clash is not None:
                raise SourceError(f"holds {clash!r}, which starts with the namespace {ns!r} of a joined source; "
                                  "the keys would be ambiguous", path=base.path)  # fmt: skip
        self.schema = dict(base.schema)
        self.non_tensor = list(base.non_tensor)
        for ns, src in self.extra.items():
            self.schema.update({ns + k: info for k, info in src.schema.items()})
            self.non_tensor += [ns + k for k in src.non_tensor]

    def _route(self, key: str) -> tuple[Source, str]:
        """The source that holds ``key`` and the key's name there."""
        for ns, src in self.extra.items():
            if key.startswith(ns):
                return src, key[len(ns) :]
        return self.base, key

    def read(self, key: str, box: Box) -> torch.Tensor:
        src, inner = self._route(key)
        return src.read(inner, box)

    def locate(self, key: str) -> TensorLocation | None:
        src, inner = self._route(key)
        return src.locate(inner)

    def locate_region(self, key: str, box: Box) -> list[tuple[Box, TensorLocation]] | None:
        src, inner = self._route(key)
        return src.locate_region(inner, box)

    def region_bytes(self, key: str, box: Box) -> list[tuple[str, int, int]] | None:
        src, inner = self._route(key)
        return src.region_bytes(inner, box)

    def remote_url(self) -> str | None:
        urls = [u for u in (s.remote_url() for s in (self.base, *self.extra.values())) if u]
        return urls[0] if urls else None

    def prefetch(self, regions: Sequence[tuple[str, Box | None]], *, engine: bool = False) -> tuple[int, int]:
        routed: dict[int, tuple[Source, list[tuple[str, Box | None]]]] = {}
        for key, box in regions:
            src, inner = self._route(key)
            routed.setdefault(id(src), (src, []))[1].append((inner, box))
        done = [src.prefetch(part, engine=engine) for src, part in routed.values()]
        return sum(d[0] for d in done), sum(d[1] for d in done)

    def file_of(self, key: str) -> str:
        src, inner = self._route(key)
        return src.file_of(inner)

    def stored_key(self, key: str) -> str:
        src, inner = self._route(key)
        stored = src.stored_key(inner)
        return stored if src is self.base else key[: len(key) - len(inner)] + stored

    def files(self) -> list[str]:
        out: list[str] = []
        for src in (self.base, *self.extra.values()):
            out += [f for f in src.files() if f not in out]
        return out

    @property
    def kind(self) -> str:
        return "+".join([self.base.kind, *(s.kind for s in self.extra.values())])

    def close(self) -> None:
        for src in (self.base, *self.extra.values()):
            src.close()
