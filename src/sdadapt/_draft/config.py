"""What a checkpoint's ``config.json`` tells the draft that shapes cannot: head counts (for
rotary rules), the family (``model_type``: Gemma's ``1 + w`` norms, GPT-OSS's gate/up rows that
alternate) and quantization (FP8 block scales need dequantisation, never a plain cast).

The file is read from the checkpoint's folder (the folder itself, or a file's folder); a
checkpoint without one gives :data:`NO_CONFIG`, and the draft then asks instead of filling in.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from .._plan.registry import config_folder
from .._recipes.quant import FP8_SCALE_SUFFIX
from ..errors import SourceError
from ..sources import embedded_config, read_json

log = logging.getLogger(__name__)

GEMMA_TYPES = frozenset({"gemma", "gemma2", "gemma3", "gemma3_text"})
"""Families whose RMSNorm computes ``x_hat * (1 + w)`` and stores ``w``."""
INTERLEAVED_ROTARY_TYPES = frozenset({"cohere", "cohere2", "glm", "glm4", "glm4_moe", "helium", "gptj", "chatglm"})
"""Families whose transformers code already rotates interleaved row pairs (``x[..., ::2]``),
not HF's usual "half" split: a Meta-style target needs no rotary rule for them."""
INTERLEAVED_GATE_UP_TYPES = frozenset({"gpt_oss"})
"""Families whose fused expert ``gate_up`` tensors alternate gate and up element by element along
the fused dim (gate = ``[..., ::2]``, up = ``[..., 1::2]``)."""


@dataclass(frozen=True)
class Facts:
    """The ``config.json`` fields the draft uses; ``None`` where the file or the field is absent."""

    path: str | None = None
    model_type: str | None = None
    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    quantization: str | None = None
    block: tuple[int, int] | None = None  # FP8 weight_block_size
    hidden: int | None = None
    rotary_fraction: float | None = None  # partial rotary: partial_rotary_factor / rotary_pct below 1
    config: dict[str, Any] | None = None  # the whole config.json (for a reference model built from it)

    @property
    def head_rows(self) -> int | None:
        """Rows of one attention head: ``head_dim``, else ``hidden_size / heads``."""
        if self.head_dim:
            return self.head_dim
        if self.hidden and self.heads and self.hidden % self.heads == 0:
            return self.hidden // self.heads
        return None

    @property
    def norm_offset(self) -> bool:
        """Norm weights are stored as ``w`` for a norm that multiplies by ``1 + w``."""
        return self.model_type in GEMMA_TYPES

    @property
    def interleaved_rotary(self) -> bool:
        return self.model_type in INTERLEAVED_ROTARY_TYPES

    @property
    def interleaved_gate_up(self) -> bool:
        return self.model_type in INTERLEAVED_GATE_UP_TYPES

    def heads_of(self, role: str) -> int | None:
        """Head count of a q (``"#q"``) or k (``"#k"``) projection."""
        return self.heads if role == "#q" else self.kv_heads

    def describe(self) -> str:
        if self.path is None:
            return "no config.json beside the checkpoint"
        bits = [f"model_type {self.model_type!r}"]
        if self.heads:
            bits.append(f"{self.heads} heads, {self.kv_heads} kv heads" + (f", head_dim {self.head_dim}" if self.head_dim else ""))
        if self.rotary_fraction:
            bits.append(f"partial rotary {self.rotary_fraction:g} of each head")
        if self.quantization:
            bits.append(f"quantization {self.quantization!r}")
        return f"{short_path(self.path)}: " + ", ".join(bits)


def short_path(path: str) -> str:
    """``path`` relative to the working directory when it lies under it, else as
    ``config.json beside the checkpoint`` (the draft's first line names the checkpoint)."""
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive
        rel = os.pardir
    if rel != os.pardir and not rel.startswith(os.pardir + os.sep):
        return rel
    return f"{os.path.basename(path)} beside the checkpoint"


NO_CONFIG = Facts()


def _quantization(cfg: dict[str, Any], keys: list[str]) -> str | None:
    qc = cfg.get("quantization_config")
    if isinstance(qc, dict) and qc.get("quant_method"):
        return str(qc["quant_method"])
    if any(k.endswith(FP8_SCALE_SUFFIX) for k in keys):
        return "fp8"
    return None


def _int(cfg: dict[str, Any], *names: str) -> int | None:
    for n in names:
        v = cfg.get(n)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def read_facts(source: str | os.PathLike[str] | None, keys: list[str]) -> Facts:
    """The facts of the ``config.json`` beside ``source`` (quantization also from key names)."""
    folder = config_folder(source) if source is not None else None
    path = os.path.join(folder, "config.json") if folder else None
    if path is None or not os.path.isfile(path):
        embedded = embedded_config(source)  # a GGUF file's metadata
        if embedded is None:
            return Facts(quantization=_quantization({}, keys))
        path, cfg = f"{source} (its metadata)", embedded
    else:
        try:
            cfg = read_json(path, None, what="config.json")
        except SourceError as e:
            log.warning("draft: %s; drafting from shapes alone", e)
            return Facts(quantization=_quantization({}, keys))
    if not isinstance(cfg, dict):
        return Facts(quantization=_quantization({}, keys))
    text = cfg.get("text_config")
    if isinstance(text, dict) and "num_attention_heads" not in cfg:
        cfg = {**text, "quantization_config": cfg.get("quantization_config")}
    heads = _int(cfg, "num_attention_heads", "n_heads")
    kv = _int(cfg, "num_key_value_heads", "n_kv_heads") or heads
    qc = cfg.get("quantization_config")
    block = None
    size = qc.get("weight_block_size") if isinstance(qc, dict) else None
    if isinstance(size, list) and len(size) == 2 and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in size):
        block = (size[0], size[1])
    rope_value = cfg.get("rope_parameters")
    rope: dict[str, Any] = rope_value if isinstance(rope_value, dict) else {}
    frac = next((d[n] for d in (cfg, rope) for n in ("partial_rotary_factor", "rotary_pct")
                 if isinstance(d.get(n), (int, float))), None)
    facts = Facts(
        path=path,
        hidden=_int(cfg, "hidden_size", "dim", "d_model"),
        rotary_fraction=float(frac) if frac is not None and 0 < float(frac) < 1 else None,
        config=cfg,
        model_type=str(cfg.get("model_type")) if cfg.get("model_type") else None,
        heads=heads,
        kv_heads=kv,
        head_dim=_int(cfg, "head_dim"),
        quantization=_quantization(cfg, keys),
        block=block,
    )
    log.info("draft: %s", facts.describe())
    return facts
