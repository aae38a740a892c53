"""Typed rules: the steps an :class:`~sdadapt.Adapter` applies to a checkpoint's keys.

A rule is plain data (a pydantic model, serialisable to JSON). Applied to a plan's working
set of ``key -> Node`` it matches whole keys with :mod:`sdadapt.rules._patterns` and replaces the
matched entries with new nodes, so that shapes, dtypes and region mappings follow from the
nodes (see :mod:`sdadapt._recipes.nodes`). Each rule also states its inverse, so one adapter serves
both loading and exporting.

Two kinds of rules:

- *key-moving* rules (rename, fuse, split, drop, stack, ...) take keys away. A key may be taken
  by one such rule only: if a later key-moving rule would also match it, the plan reports the
  two rules as ambiguous instead of silently letting the first win;
- *value* rules (cast, transpose, rotary, affine, pad, interleave, ...) keep the key and change
  its value; they apply in order.

Modules, one family each:

- :mod:`._base`: :class:`RuleBase` (the protocol every rule implements) and the helpers rules
  share (matching keys, moving them, reading the target's size under a key's final name);
- :mod:`._keys`: rename, fuse/split, drop, tie, strip_prefix/add_prefix;
- :mod:`._values`: cast, transpose, rotary (row order inside heads), affine, pad/trim;
- :mod:`._stacking`: stack/unstack (per-expert keys <-> one tensor);
- :mod:`._tensor_parallel`: interleave/deinterleave (fused parts laid out per TP rank) and
  :func:`tp_degree`;
- :mod:`._custom`: :func:`register_rule` (the registry of rule kinds an adapter's JSON is read
  with) and :class:`ValueRule`, the short way to write a value rule of one's own.

Adding a rule kind, built in or a user's: a :class:`RuleBase` subclass with a ``kind`` literal,
registered with :func:`register_rule`. A built-in kind is one row of the table of rule kinds
(:data:`sdadapt._base.rule_kinds.RULE_KINDS`: its class, its module, its public function in
:mod:`sdadapt`), from which this package registers it and shows its class, :data:`Rule` (the
discriminated union pydantic reads) includes it, and :mod:`sdadapt` shows its function.
Nothing else dispatches on rule types: planning calls ``apply``, inversion calls ``inverse``,
resuming optimizer state calls ``for_optimizer_state``, and :func:`final_key` asks each later
rule's ``key_after``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .._base.lazy import attach
from .._base.rule_kinds import EAGER_KINDS, ON_USE, RULE_KINDS
from ._base import Keys as Keys

# What the layers above use of the rule machinery: they import it from here, never from the
# private modules (tests/project/test_layers.py checks that). Not public API: the public names are ``__all__``.
from ._base import PlanContext as PlanContext
from ._base import RuleBase as RuleBase
from ._base import RuleIssue as RuleIssue
from ._base import final_key as final_key
from ._base import parse_dtype as parse_dtype
from ._base import target_info as target_info
from ._base import unwrap_key as unwrap_key
from ._custom import ValueRule as ValueRule
from ._custom import register_rule as register_rule
from ._custom import registered_rules as registered_rules
from ._custom import rule_from_data as rule_from_data
from ._functions import cast as cast
from ._functions import fuse as fuse
from ._functions import interleave as interleave
from ._functions import rename as rename
from ._functions import tie as tie
from ._patterns import KeyPattern as KeyPattern
from ._patterns import compile_pattern as compile_pattern
from ._patterns import matches_any as matches_any

BUILTIN_RULES: tuple[type[RuleBase], ...] = tuple(
    getattr(importlib.import_module(f"{__name__}.{module}"), cls) for cls, module, _ in EAGER_KINDS
)
"""The built-in rule classes registered with the package, in :data:`~sdadapt._base.rule_kinds.RULE_KINDS`' order."""
for _cls in BUILTIN_RULES:
    register_rule(_cls)


# The public names: the rule classes (for ``isinstance`` and JSON; build them with the functions
# of ``sdadapt``), the rule protocol and registry, and what a rule of one's own builds its nodes
# from. The other names imported above serve the rule modules and the plan.
_EAGER = [cls for cls, _, _ in EAGER_KINDS] + (
    "RuleBase ValueRule register_rule registered_rules rule_from_data Keys parse_dtype".split()
)
_PUBLIC: dict[str, str] = {
    **{cls: f".{module}" for cls, module, _ in EAGER_KINDS},
    **dict.fromkeys(_EAGER[len(EAGER_KINDS) :], __name__),
    # the value, stacking and TP kinds, and the quantized formats (which import their kernels): imported on first use
    **{cls: f".{module}" for cls, module, _ in RULE_KINDS if module in ON_USE},
    "QuantizeFP8": "._dequant",
    "QuantizeMXFP4": "._dequant",
    "QuantizeScaled": "._dequant_scaled",
    "DequantGPTQ": "._dequant_gptq",
    **dict.fromkeys(["ScaleFormat", "SCALE_DTYPES", "FP8_SCALE_SUFFIX", "MX_BLOCKS_SUFFIX"], "sdadapt._recipes.quant"),
    "ignored_modules": "._quant_config",
    # a rule of one's own: the node it puts under a key, and the steps a node produces
    **dict.fromkeys(["Node", "Compute", "emit"], "sdadapt._recipes.nodes"),
    "Rule": "._union",
}
"""The one table of :mod:`sdadapt.rules`' public names -> the module that defines each."""
_INTERNAL = {
    "open_peft_lora": "._lora", "merged_lora": "._lora", "dequant_rules": "._quant_detect",
    "tp_degree": "._tensor_parallel", "DP_MESH_NAMES": "._tensor_parallel", "TP_MESH_NAMES": "._tensor_parallel",
    "rotary_perm": "._values",
}  # fmt: skip
"""Names the layers above use, imported on first use (a load that merges a LoRA, reads a
quantized release, plans a TP interleave or a rotary order)."""
_LAZY = {**{name: where for name, where in _PUBLIC.items() if where != __name__}, **_INTERNAL}

if TYPE_CHECKING:
    from .._recipes.nodes import Compute as Compute
    from .._recipes.nodes import Node as Node
    from .._recipes.nodes import emit as emit
    from .._recipes.quant import FP8_SCALE_SUFFIX as FP8_SCALE_SUFFIX
    from .._recipes.quant import MX_BLOCKS_SUFFIX as MX_BLOCKS_SUFFIX
    from .._recipes.quant import SCALE_DTYPES as SCALE_DTYPES
    from .._recipes.quant import ScaleFormat as ScaleFormat
    from ._dequant import DequantFP8 as DequantFP8
    from ._dequant import DequantMXFP4 as DequantMXFP4
    from ._dequant import QuantizeFP8 as QuantizeFP8
    from ._dequant import QuantizeMXFP4 as QuantizeMXFP4
    from ._dequant_gptq import DequantGPTQ as DequantGPTQ
    from ._dequant_scaled import DequantScaled as DequantScaled
    from ._dequant_scaled import QuantizeScaled as QuantizeScaled
    from ._key_moves import AddPrefix as AddPrefix
    from ._key_moves import Drop as Drop
    from ._key_moves import Fuse as Fuse
    from ._key_moves import Split as Split
    from ._key_moves import StripPrefix as StripPrefix
    from ._key_moves import Tie as Tie
    from ._keys import Rename as Rename
    from ._lora import merged_lora as merged_lora
    from ._lora import open_peft_lora as open_peft_lora
    from ._quant_config import ignored_modules as ignored_modules
    from ._quant_detect import dequant_rules as dequant_rules
    from ._stacking import Stack as Stack
    from ._stacking import Unstack as Unstack
    from ._tensor_parallel import DP_MESH_NAMES as DP_MESH_NAMES
    from ._tensor_parallel import TP_MESH_NAMES as TP_MESH_NAMES
    from ._tensor_parallel import Deinterleave as Deinterleave
    from ._tensor_parallel import Interleave as Interleave
    from ._tensor_parallel import tp_degree as tp_degree
    from ._union import Rule as Rule
    from ._values import Affine as Affine
    from ._values import Cast as Cast
    from ._values import Pad as Pad
    from ._values import Rotary as Rotary
    from ._values import Transpose as Transpose
    from ._values import Trim as Trim
    from ._values import rotary_perm as rotary_perm

__getattr__, _lazy_dir, _ = attach(__name__, _LAZY)
__all__ = list(_PUBLIC)


def __dir__() -> list[str]:
    return sorted({*_lazy_dir(), *_PUBLIC})
