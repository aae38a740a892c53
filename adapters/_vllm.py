"""What the vLLM layouts share: where each vLLM parameter's shard lies on its TP (or EP) rank.

vLLM's parallel layers hold plain tensors, each rank its shard: a column-parallel layer
(``QKVParallelLinear``, ``MergedColumnParallelLinear``, ``VocabParallelEmbedding``,
``ParallelLMHead``) rows ``[r * n, (r + 1) * n)`` of its whole weight, a row-parallel one
(``RowParallelLinear``) those columns, ``FusedMoE`` ``w13_weight`` / ``w2_weight`` their
intermediate dim (or, with expert parallelism, a contiguous run of experts); every other weight
is whole on each rank. :class:`ShardLayout` gives :func:`sdadapt.refit_plan` each one's global
shape and box, from the tensor the rank holds. A block-quantized FP8 weight's scales
(``<weight>_scale_inv``, one per 128 x 128 block) are cut along the same dim as the weight.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from sdadapt.errors import AdapterError

SCALE_SUFFIX = "_scale_inv"
"""vLLM's name for a block-quantized FP8 weight's scales: ``<weight>_scale_inv``."""


@dataclass(frozen=True)
class ShardLayout:
    """``layout(key, tensor) -> (global shape, box)`` of one rank of ``size``: ``dims`` lists
    ``(key suffix, dim)`` of the sharded weights (the first suffix that ends the key counts);
    any other key is whole."""

    dims: tuple[tuple[str, int], ...]
    size: int
    rank: int
    block: tuple[int, int] | None = None  # FP8 block scales: a cut weight's share must be whole blocks

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise AdapterError(f"rank {self.rank} is not a rank of a group of {self.size}")

    def dim_of(self, key: str) -> int | None:
        """The dim ``key`` is sharded along, or ``None`` (whole on every rank); a weight's block
        scales (``<weight>_scale_inv``) along its weight's."""
        key = key.removesuffix(SCALE_SUFFIX)
        return next((d for suffix, d in self.dims if key.endswith(suffix)), None)

    def __call__(self, key: str, tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
        shape = tuple(tensor.shape)
        d = self.dim_of(key)
        if d is None:
            return shape, tuple((0, n) for n in shape)
        n = shape[d]
        quantized = tensor.dtype == torch.float8_e4m3fn  # the embeddings, head and router stay as they are
        if self.block is not None and quantized and len(shape) >= 2 and d >= len(shape) - 2:
            b = self.block[d - len(shape) + 2]
            if n % b and self.size > 1:
                raise AdapterError(
                    f"{key!r}: each of the {self.size} ranks holds {n} along dim {d}, not a multiple of the FP8 block's "
                    f"{b}; vLLM's block-quantized layers need whole blocks per rank (another block, or another TP degree)"
                )
        whole = shape[:d] + (n * self.size,) + shape[d + 1 :]
        box = tuple((0, m) for m in shape)
        return whole, box[:d] + ((self.rank * n, (self.rank + 1) * n),) + box[d + 1 :]


def config_reader(config: Any) -> Callable[..., Any]:
    """``get(name, default=None)`` over an HF config: a ``transformers`` config object or its
    ``config.json`` read as a dict."""
    if isinstance(config, dict):
        return config.get
    return lambda name, default=None: getattr(config, name, default)


def divides(what: str, n: int, by: int, adapter: str) -> None:
    if by < 1 or n % by:
        raise AdapterError(f"the {adapter} adapter: {what} {n} does not divide by {by}; vLLM splits it evenly over the ranks")


def stacks_experts(stacked_experts: bool | None) -> bool:
    """``stacked_experts``, or where ``None`` whether the installed transformers holds a model's
    MoE experts stacked in memory (``mlp.experts.gate_up_proj`` / ``down_proj``, from
    transformers 5 on) rather than one tensor per expert as the checkpoint files do."""
    if stacked_experts is not None:
        return stacked_experts
    try:  # the installed release, read without importing it (transformers is not a dependency)
        return int(importlib.metadata.version("transformers").split(".")[0]) >= 5
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(
            "config_shape(stacked_experts=None) follows the installed transformers, and none is installed: "
            "pass stacked_experts=True for experts stacked in one tensor, False for one tensor per expert"
        ) from None
