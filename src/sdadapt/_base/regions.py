"""Regions of tensors: a box is a tuple of ``(start, stop)`` pairs, one per dimension, in global
coordinates. Sources read boxes, recipes map boxes of their output to boxes of their inputs."""

from __future__ import annotations

Box = tuple[tuple[int, int], ...]


def full_box(shape: tuple[int, ...]) -> Box:
    """The box that covers a whole tensor of ``shape``."""
    return tuple((0, n) for n in shape)


def box_shape(box: Box) -> tuple[int, ...]:
    """The shape of the region ``box``."""
    return tuple(b - a for a, b in box)
