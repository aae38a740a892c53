"""A GGUF file into a transformers model with no adapter given, as ``from_pretrained(dir,
gguf_file=...)`` needs none: the shipped ``gguf`` adapter (llama.cpp's names -> transformers'
checkpoint names, Llama's q / k rows un-permuted), then the model's own :func:`hf_adapter` on
the names that gives, then a cast of every tensor to the dtype the model holds (a quantized
GGUF tensor is dequantized to float32, as ``from_pretrained`` dequantizes it before casting to
the model's dtype).
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from ..rules import PlanContext, cast
from ..sources import Source, TensorInfo, checkpoint_schema, format_of
from .adapter import Adapter


def is_gguf(source: object) -> bool:
    """``source`` is an open GGUF source or the path of a ``.gguf`` file."""
    if isinstance(source, Source):
        return source.kind == "GGUFFile"
    if isinstance(source, (str, os.PathLike)):
        fmt = format_of(os.fspath(source)) if os.path.exists(source) else None
        return fmt is not None and fmt.name == "gguf"
    return False


def adapted_schema(schema: dict[str, TensorInfo], adapter: Adapter) -> dict[str, TensorInfo]:
    """The keys, shapes and dtypes ``adapter``'s rules make of ``schema`` (no target)."""
    ctx = PlanContext(schema, [], None, adapter.rules, adapter.stage_of)
    ctx.unwrap_keys()
    for i, rule in enumerate(adapter.rules):
        rule.apply(ctx, i)
    return {k: TensorInfo(tuple(n.shape), n.dtype) for k, n in ctx.env.items()}


def gguf_hf_adapter(model: nn.Module, source: Any) -> Adapter:
    """The adapter from the GGUF file ``source`` (a path or an open source) to the transformers ``model``."""
    from . import registry
    from .hf_models import hf_adapter

    names = registry.get_adapter("gguf", source, to="hf")
    schema = checkpoint_schema(source)
    hf = hf_adapter(model, adapted_schema(schema, names))
    return Adapter.composed(
        [list(names.rules), list(hf.rules), [cast("**", "model")]],
        name=f"gguf+{hf.name}",
        description=f"{names.description}; then {hf.description or hf.name}; cast to the model's dtypes",
    )
