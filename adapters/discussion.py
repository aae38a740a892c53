"""Split ``q_proj``/``k_proj``/``v_proj`` -> the fused ``qkv`` of the discussion's model.

The model of ``shared/seed/discussion.txt`` (``tests/support/models.py`` ``TinyTransformer``) has one
fused ``layers.{i}.attn.qkv`` projection (``[q; k; v]`` rows, weight and bias); checkpoints
from the same family with separate projections name them ``layers.{i}.attn.q_proj|k_proj|v_proj``.
``adapter.inverse()`` splits ``qkv`` again (equal thirds, as the model's ``chunk(3)``).

The model's attention views the (local) projection with its full head count, so it computes
correctly unsharded and under FSDP2, not under a column-wise TP of ``qkv``: this adapter keeps
the plain ``[q; k; v]`` row order the model's code expects.
"""

from __future__ import annotations

from typing import Any

import sdadapt
from sdadapt import Adapter

SUMMARY = "split q_proj/k_proj/v_proj -> the fused qkv of the discussion's SimpleTransformer (tests/support/models.py)"


def build() -> Adapter:
    """The adapter; it takes no options."""
    return Adapter(
        [
            sdadapt.fuse(
                ["layers.{i}.attn.q_proj.{p}", "layers.{i}.attn.k_proj.{p}", "layers.{i}.attn.v_proj.{p}"],
                "layers.{i}.attn.qkv.{p}",
            )
        ],
        name="discussion",
        description="split q/k/v -> fused qkv (shared/seed/discussion.txt)",
    )


def options_from_config(folder: str) -> dict[str, Any]:
    return {}  # nothing to read: the adapter has no options
