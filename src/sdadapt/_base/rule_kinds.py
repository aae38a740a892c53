"""The built-in rule kinds, listed once.

Each row: the rule class, the module of :mod:`sdadapt.rules` that defines it, its kind, and
whether the public function of :mod:`sdadapt` named like the kind builds it. :mod:`sdadapt.rules` registers and shows the classes
from this table, :mod:`sdadapt` shows the functions and refuses the classes' old top-level
spellings from it; their ``if TYPE_CHECKING:`` imports mirror it for type checkers (a test
compares them). Plain data, so that ``import sdadapt`` reads it without importing torch.
"""

from __future__ import annotations

BUILT_IN: tuple[tuple[str, str, str, bool], ...] = (
    ("Rename", "_keys", "rename", True),
    ("Fuse", "_key_moves", "fuse", True),
    ("Split", "_key_moves", "split", True),
    ("Cast", "_values", "cast", True),
    ("Drop", "_key_moves", "drop", True),
    ("Tie", "_key_moves", "tie", True),
    ("Transpose", "_values", "transpose", True),
    ("Rotary", "_values", "rotary", True),
    ("Affine", "_values", "affine", True),
    ("Stack", "_stacking", "stack", True),
    ("Unstack", "_stacking", "unstack", True),
    ("Pad", "_values", "pad", True),
    ("Trim", "_values", "trim", True),
    ("Interleave", "_tensor_parallel", "interleave", True),
    ("Deinterleave", "_tensor_parallel", "deinterleave", True),
    ("StripPrefix", "_key_moves", "strip_prefix", True),
    ("AddPrefix", "_key_moves", "add_prefix", True),
    # the quantized formats: their public functions are in their own module (they import the kernels)
    ("DequantFP8", "_dequant", "dequant_fp8", True),
    ("DequantMXFP4", "_dequant", "dequant_mxfp4", True),
    ("DequantScaled", "_dequant_scaled", "dequant_scaled", True),
    # no public function builds these by the kind's name: an export's ``quantize=``,
    # :func:`sdadapt.dequant_rules` and LoRA merging do
    ("QuantizeFP8", "_dequant", "quantize_fp8", False),
    ("QuantizeMXFP4", "_dequant", "quantize_mxfp4", False),
    ("QuantizeScaled", "_dequant_scaled", "quantize_scaled", False),
    ("DequantGPTQ", "_dequant_gptq", "dequant_gptq", False),
    ("MergeLora", "_lora", "merge_lora", False),
)
"""Every built-in rule kind. Those without a public function have their modules imported when a
kind of theirs is first used."""

RULE_KINDS = tuple((cls, module, kind) for cls, module, kind, public in BUILT_IN if public)
"""The kinds that a public function builds: class, module, function."""

QUANTIZED = ("_dequant", "_dequant_scaled")
"""The modules of the quantized formats' kinds, whose public functions live in
:mod:`sdadapt.rules._quant_functions` (the others' in :mod:`sdadapt.rules._functions`)."""

ON_USE = ("_key_moves", "_values", "_stacking", "_tensor_parallel", *QUANTIZED)
"""The modules of :data:`RULE_KINDS` imported when a kind of theirs is first used, not with
:mod:`sdadapt.rules`: an adapter of renames imports only :mod:`sdadapt.rules._keys`."""

EAGER_KINDS = tuple((cls, module, fn) for cls, module, fn in RULE_KINDS if module not in ON_USE)
"""The kinds registered when :mod:`sdadapt.rules` is imported, in their order."""
