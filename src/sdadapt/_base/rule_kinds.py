"""The built-in rule kinds, listed once.

Each row: the rule class, the module of :mod:`sdadapt.rules` that defines it, and the public
function of :mod:`sdadapt` that builds it. :mod:`sdadapt.rules` registers and shows the classes
from this table, :mod:`sdadapt` shows the functions and refuses the classes' old top-level
spellings from it; their ``if TYPE_CHECKING:`` imports mirror it for type checkers (a test
compares them). Plain data, so that ``import sdadapt`` reads it without importing torch.
"""

from __future__ import annotations

RULE_KINDS: tuple[tuple[str, str, str], ...] = (
    ("Rename", "_keys", "rename"),
    ("Fuse", "_keys", "fuse"),
    ("Split", "_keys", "split"),
    ("Cast", "_values", "cast"),
    ("Drop", "_keys", "drop"),
    ("Tie", "_keys", "tie"),
    ("Transpose", "_values", "transpose"),
    ("Rotary", "_values", "rotary"),
    ("Affine", "_values", "affine"),
    ("Stack", "_stacking", "stack"),
    ("Unstack", "_stacking", "unstack"),
    ("Pad", "_values", "pad"),
    ("Trim", "_values", "trim"),
    ("Interleave", "_tensor_parallel", "interleave"),
    ("Deinterleave", "_tensor_parallel", "deinterleave"),
    ("StripPrefix", "_keys", "strip_prefix"),
    ("AddPrefix", "_keys", "add_prefix"),
    # the quantized formats: their public functions are in their own module (they import the kernels)
    ("DequantFP8", "_dequant", "dequant_fp8"),
    ("DequantMXFP4", "_dequant", "dequant_mxfp4"),
    ("DequantScaled", "_dequant_scaled", "dequant_scaled"),
)

QUANTIZED = ("_dequant", "_dequant_scaled")
"""The modules of the quantized formats' kinds, whose public functions live in
:mod:`sdadapt.rules._quant_functions` (the others' in :mod:`sdadapt.rules._functions`)."""

ON_USE = ("_values", "_stacking", "_tensor_parallel", *QUANTIZED)
"""The modules of :data:`RULE_KINDS` imported when a kind of theirs is first used, not with
:mod:`sdadapt.rules`: a plain adapter (renames, fused keys) imports only :mod:`sdadapt.rules._keys`."""

WITHOUT_FUNCTION: tuple[tuple[str, str, str], ...] = (
    ("QuantizeFP8", "_dequant", "quantize_fp8"),
    ("QuantizeMXFP4", "_dequant", "quantize_mxfp4"),
    ("QuantizeScaled", "_dequant_scaled", "quantize_scaled"),
    ("DequantGPTQ", "_dequant_gptq", "dequant_gptq"),
    ("MergeLora", "_lora", "merge_lora"),
)
"""The other built-in kinds: class, module, kind. No public function builds them by the kind's
name (an export's ``quantize=``, :func:`sdadapt.dequant_rules` and LoRA merging do); their modules
are imported when a kind of theirs is first used."""

EAGER_KINDS = tuple((cls, module, fn) for cls, module, fn in RULE_KINDS if module not in ON_USE)
"""The kinds registered when :mod:`sdadapt.rules` is imported, in their order."""
