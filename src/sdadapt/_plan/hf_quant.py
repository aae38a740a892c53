"""A GPTQ or AWQ release into a transformers model with no adapter given, as ``from_pretrained``
needs none: the release's dequant rules (:func:`sdadapt.dequant_rules` of its ``config.json``),
then the model's own :func:`hf_adapter` on the names that gives, then a cast of every tensor to
the dtype the model holds (the tools write float16; ``from_pretrained(..., dtype=)`` casts the
same way). A ``quant_method`` sdadapt does not know is refused here, naming the file.
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from ..rules import cast, dequant_rules
from ..sources import Source, checkpoint_schema, read_config_file
from .adapter import Adapter
from .hf_gguf import adapted_schema

KNOWN_ELSEWHERE = ("fp8", "mxfp4", "mxfp8", "compressed-tensors", "modelopt")
"""Methods whose releases keep the plain path (a plan problem whose hint names the dequant rules)."""


def config_path(source: object) -> str | None:
    """The ``config.json`` beside a local checkpoint (a path or an open source), if there is one."""
    path = source.path if isinstance(source, Source) else source
    if not isinstance(path, (str, os.PathLike)):
        return None
    p = os.fspath(path)
    folder = p if os.path.isdir(p) else os.path.dirname(os.path.abspath(p))
    cfg = os.path.join(folder, "config.json")
    return cfg if os.path.isfile(cfg) else None


def quant_method(source: object) -> str | None:
    """The ``quantization_config.quant_method`` of the release ``source`` when it is one this
    path reads or refuses (not one of :data:`KNOWN_ELSEWHERE`), else ``None``."""
    path = config_path(source)
    if path is None:
        return None
    qc = read_config_file(path).get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") in KNOWN_ELSEWHERE:
        return None
    return str(qc.get("quant_method"))


def release_dequant(source: Any, schema: dict[str, Any], target_keys: list[str]) -> Adapter | None:
    """The dequant rules of the GPTQ / AWQ release ``source`` (its headers ``schema``) as an
    adapter that runs first, for a target holding no packed layers; ``None`` for any other
    checkpoint, and for a target holding ``qweight`` tensors (the packed ones line up as stored)."""
    method = quant_method(source)
    if method is None or any(k.endswith(".qweight") for k in target_keys):
        return None
    rules = dequant_rules(config_path(source) or source, schema=schema)
    return Adapter(list(rules), name=f"dequant_{method}",
                   description=f"the release's quantization_config ({method}) dequantised")


def quantized_hf_adapter(model: nn.Module, source: Any) -> Adapter:
    """The adapter from the GPTQ / AWQ release ``source`` (a path or an open source) to ``model``."""
    from .hf_models import hf_adapter

    schema = checkpoint_schema(source)
    rules = dequant_rules(config_path(source) or source, schema=schema)
    deq = Adapter(list(rules), name="dequant")
    hf = hf_adapter(model, adapted_schema(schema, deq))
    return Adapter.composed(
        [list(rules), list(hf.rules), [cast("**", "model")]],
        name=f"dequant+{hf.name}",
        description=f"the release's quantization_config dequantised; then {hf.description or hf.name}; cast to the model's dtypes",
    )
