"""One part of a source as a source of its own: its keys under a fixed namespace."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._base.regions import Box
from .._base.schema import TensorLocation
from ._base import Source


class NamespacedSource(Source):
    """A view of a source where key ``k`` means the stored entry ``fmt.format(k)`` (the model's
    part of a training state: ``"model.{}"``).

    Every capability of :class:`Source` is forwarded through that mapping, byte locations
    included, so the I/O engine reads a resume load's regions with ``preadv`` straight from the
    ``.distcp`` files instead of through :meth:`read`."""

    def __init__(self, base: Source, fmt: str):
        self.base = base
        self.fmt = fmt
        self.path = base.path
        head, tail = fmt.split("{}")
        self.schema = {
            k[len(head) : len(k) - len(tail)]: info
            for k, info in base.schema.items()
            if len(k) > len(head) + len(tail) and k.startswith(head) and k.endswith(tail)
        }
        self.non_tensor = []

    def read(self, key: str, box: Box) -> torch.Tensor:
        return self.base.read(self.fmt.format(key), box)

    def locate(self, key: str) -> TensorLocation | None:
        return self.base.locate(self.fmt.format(key))

    def locate_region(self, key: str, box: Box) -> list[tuple[Box, TensorLocation]] | None:
        return self.base.locate_region(self.fmt.format(key), box)

    def region_bytes(self, key: str, box: Box) -> list[tuple[str, int, int]] | None:
        return self.base.region_bytes(self.fmt.format(key), box)

    def file_of(self, key: str) -> str:
        return self.base.file_of(self.fmt.format(key))

    def remote_url(self) -> str | None:
        return self.base.remote_url()

    def prefetch(self, regions: Sequence[tuple[str, Box | None]], *, engine: bool = False) -> tuple[int, int]:
        return self.base.prefetch([(self.fmt.format(k), box) for k, box in regions], engine=engine)

    def files(self) -> list[str]:
        return self.base.files()

    def stored_key(self, key: str) -> str:
        return self.base.stored_key(self.fmt.format(key))

    @property
    def kind(self) -> str:
        return self.base.kind
