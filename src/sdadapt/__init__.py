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
    from ._draft import Draft, draft
    from ._engine import EngineConfig, release_pinned_memory
    from ._plan.adapter import Adapter
    from ._plan.hf_models import hf_adapter
    from ._plan.plan import Plan, build_plan
    from ._plan.registry import get_adapter, list_adapters
    from ._plan.report import Report
    from ._plan.resolve import resolve_adapter, resolve_target
    from ._recipes.nodes import Compute, Node, emit
    from ._transaction.diff import diff
    from ._transaction.export import ExportReport, convert, export, export_iter
    from ._transaction.load import LoadReport, load, plan_load
    from ._transaction.shrink import ShrinkReport, shrink
    from ._transaction.state import StateLoadReport, load_state, save_state
    from ._transaction.verify import VerifyReport, verify
    from .rules import (
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
    from .rules._dequant import DequantFP8, DequantMXFP4, QuantizeFP8, QuantizeMXFP4
    from .rules._dequant_scaled import DequantScaled, QuantizeScaled
    from .rules._functions import (
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
    from .rules._quant_detect import dequant_rules
    from .sources import Source, TensorInfo, open_source
    from .sources._integrity import write_checksums

from ._base.version import VERSION as __version__  # noqa: F401 - the package version
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

_RULE_CLASSES = (
    "AddPrefix Affine Cast Deinterleave Drop Fuse Interleave Pad Rename Rotary Rule RuleBase Split Stack StripPrefix "
    "Tie Transpose Trim Unstack ValueRule register_rule"
)
_CONSTRUCTORS = (
    "add_prefix affine cast deinterleave dequant_fp8 dequant_mxfp4 dequant_scaled drop fuse interleave pad rename rotary split "
    "stack strip_prefix tie transpose trim unstack"
)
_LAZY: dict[str, str] = {
    **dict.fromkeys(["Adapter"], "_plan.adapter"),
    **dict.fromkeys(_CONSTRUCTORS.split(), "rules._functions"),
    **dict.fromkeys(["diff"], "_transaction.diff"),
    **dict.fromkeys(["Draft", "draft"], "_draft"),
    **dict.fromkeys(["EngineConfig", "release_pinned_memory"], "_engine"),
    **dict.fromkeys(["ExportReport", "convert", "export", "export_iter"], "_transaction.export"),
    **dict.fromkeys(["hf_adapter"], "_plan.hf_models"),
    **dict.fromkeys(["write_checksums"], "sources._integrity"),
    **dict.fromkeys(["LoadReport", "load", "plan_load"], "_transaction.load"),
    **dict.fromkeys(["Compute", "Node", "emit"], "_recipes.nodes"),
    **dict.fromkeys(["Plan", "build_plan"], "_plan.plan"),
    **dict.fromkeys(["DequantFP8", "DequantMXFP4", "QuantizeFP8", "QuantizeMXFP4"], "rules._dequant"),
    **dict.fromkeys(["dequant_rules"], "rules._quant_detect"),
    **dict.fromkeys(["DequantScaled", "QuantizeScaled"], "rules._dequant_scaled"),
    **dict.fromkeys(["get_adapter", "list_adapters"], "_plan.registry"),
    **dict.fromkeys(["Report"], "_plan.report"),
    **dict.fromkeys(["resolve_adapter", "resolve_target"], "_plan.resolve"),
    **dict.fromkeys(_RULE_CLASSES.split(), "rules"),
    **dict.fromkeys(["ShrinkReport", "shrink"], "_transaction.shrink"),
    **dict.fromkeys(["StateLoadReport", "load_state", "save_state"], "_transaction.state"),
    **dict.fromkeys(["VerifyReport", "verify"], "_transaction.verify"),
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
