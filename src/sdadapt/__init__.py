"""sdadapt: load checkpoints of any layout into models parallelised with torch-native tools.

    report = sdadapt.load(model, "ckpt.pt", sdadapt.Adapter([sdadapt.fuse([...], "...")]))

Data flow: source headers -> SourceSchema; model -> TargetSchema; Adapter + schemas -> Plan +
Report (strict: raise on every rank, nothing read); ``dcp.load`` with a reader that presents
the target schema and reads, per shard, only the source regions the recipe needs.

The names below are imported when first used (module ``__getattr__``), so that ``import
sdadapt`` (and with it the command line's ``--help``) does not import torch; type checkers see
them through the ``TYPE_CHECKING`` imports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._adapter import Adapter
    from ._constructors import (
        add_prefix,
        affine,
        cast,
        deinterleave,
        dequant_fp8,
        dequant_mxfp4,
        dequant_scaled,
        drop,
        fuse,
        interleave,
        pad,
        rename,
        rotary,
        split,
        stack,
        strip_prefix,
        tie,
        transpose,
        trim,
        unstack,
    )
    from ._diff import diff
    from ._draft import Draft, draft
    from ._engine import EngineConfig, release_pinned_memory
    from ._export import ExportReport, convert, export, export_iter
    from ._hf_models import hf_adapter
    from ._integrity import write_checksums
    from ._load import LoadReport, load, plan_load
    from ._nodes import Compute, Node, emit
    from ._plan import Plan, build_plan
    from ._quant_rules import DequantFP8, DequantMXFP4, QuantizeFP8, QuantizeMXFP4, dequant_rules
    from ._quant_scaled_rules import DequantScaled, QuantizeScaled
    from ._registry import get_adapter, list_adapters
    from ._report import Report
    from ._resolve import resolve_adapter, resolve_target
    from ._rules import (
        AddPrefix,
        Affine,
        Cast,
        Deinterleave,
        Drop,
        Fuse,
        Interleave,
        Pad,
        Rename,
        Rotary,
        Rule,
        RuleBase,
        Split,
        Stack,
        StripPrefix,
        Tie,
        Transpose,
        Trim,
        Unstack,
        ValueRule,
        register_rule,
    )
    from ._shrink import ShrinkReport, shrink
    from ._state import StateLoadReport, load_state, save_state
    from ._verify import VerifyReport, verify
    from .sources import Source, TensorInfo, open_source

from .errors import (
    AdapterError,
    ExportError,
    LoadError,
    ModelError,
    PlanError,
    RemoteRankError,
    ResolveError,
    SdadaptError,
    ShrinkError,
    SourceError,
    StateError,
    UsageError,
    VerifyError,
)

__version__ = "0.1.0"

_RULE_CLASSES = (
    "AddPrefix Affine Cast Deinterleave Drop Fuse Interleave Pad Rename Rotary Rule RuleBase Split Stack StripPrefix "
    "Tie Transpose Trim Unstack ValueRule register_rule"
)
_CONSTRUCTORS = (
    "add_prefix affine cast deinterleave dequant_fp8 dequant_mxfp4 dequant_scaled drop fuse interleave pad rename rotary split "
    "stack strip_prefix tie transpose trim unstack"
)
_LAZY: dict[str, str] = {
    **dict.fromkeys(["Adapter"], "_adapter"),
    **dict.fromkeys(_CONSTRUCTORS.split(), "_constructors"),
    **dict.fromkeys(["diff"], "_diff"),
    **dict.fromkeys(["Draft", "draft"], "_draft"),
    **dict.fromkeys(["EngineConfig", "release_pinned_memory"], "_engine"),
    **dict.fromkeys(["ExportReport", "convert", "export", "export_iter"], "_export"),
    **dict.fromkeys(["hf_adapter"], "_hf_models"),
    **dict.fromkeys(["write_checksums"], "_integrity"),
    **dict.fromkeys(["LoadReport", "load", "plan_load"], "_load"),
    **dict.fromkeys(["Compute", "Node", "emit"], "_nodes"),
    **dict.fromkeys(["Plan", "build_plan"], "_plan"),
    **dict.fromkeys(["DequantFP8", "DequantMXFP4", "QuantizeFP8", "QuantizeMXFP4", "dequant_rules"], "_quant_rules"),
    **dict.fromkeys(["DequantScaled", "QuantizeScaled"], "_quant_scaled_rules"),
    **dict.fromkeys(["get_adapter", "list_adapters"], "_registry"),
    **dict.fromkeys(["Report"], "_report"),
    **dict.fromkeys(["resolve_adapter", "resolve_target"], "_resolve"),
    **dict.fromkeys(_RULE_CLASSES.split(), "_rules"),
    **dict.fromkeys(["ShrinkReport", "shrink"], "_shrink"),
    **dict.fromkeys(["StateLoadReport", "load_state", "save_state"], "_state"),
    **dict.fromkeys(["VerifyReport", "verify"], "_verify"),
    **dict.fromkeys(["Source", "TensorInfo", "open_source"], "sources"),
}


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use and cache the name in this module."""
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'sdadapt' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{where}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    # loading, planning, reporting
    "LoadReport",
    "Plan",
    "Report",
    "build_plan",
    "diff",
    "load",
    "plan_load",
    # training state, export, integrity
    "ExportReport",
    "StateLoadReport",
    "convert",
    "export",
    "export_iter",
    "load_state",
    "save_state",
    "write_checksums",
    # checking and trimming checkpoints
    "ShrinkReport",
    "VerifyReport",
    "shrink",
    "verify",
    # sources and engine settings
    "EngineConfig",
    "Source",
    "TensorInfo",
    "open_source",
    "release_pinned_memory",
    # adapters: the registry, spec resolution, drafting
    "Adapter",
    "Draft",
    "draft",
    "get_adapter",
    "hf_adapter",
    "list_adapters",
    "resolve_adapter",
    "resolve_target",
    # rules and their constructors
    "AddPrefix",
    "Affine",
    "Cast",
    "Deinterleave",
    "Drop",
    "Fuse",
    "Interleave",
    "Pad",
    "Rename",
    "Rotary",
    "Rule",
    "Split",
    "Stack",
    "StripPrefix",
    "Tie",
    "Transpose",
    "Trim",
    "Unstack",
    "add_prefix",
    "affine",
    "cast",
    "deinterleave",
    "drop",
    "fuse",
    "interleave",
    "pad",
    "rename",
    "rotary",
    "split",
    "stack",
    "strip_prefix",
    "tie",
    "transpose",
    "trim",
    "unstack",
    # quantized sources
    "DequantFP8",
    "DequantMXFP4",
    "DequantScaled",
    "QuantizeFP8",
    "QuantizeMXFP4",
    "QuantizeScaled",
    "dequant_fp8",
    "dequant_mxfp4",
    "dequant_scaled",
    "dequant_rules",
    # rules of one's own: the rule protocol, the registry, and the node building blocks
    "Compute",
    "Node",
    "RuleBase",
    "ValueRule",
    "emit",
    "register_rule",
    # errors
    "AdapterError",
    "ExportError",
    "LoadError",
    "ModelError",
    "PlanError",
    "RemoteRankError",
    "ResolveError",
    "SdadaptError",
    "ShrinkError",
    "SourceError",
    "StateError",
    "UsageError",
    "VerifyError",
]
