"""The ``dequant_gptq`` rule: GPTQ and AWQ (GEMM) int4 / int8 linear layers as plain weights
(layouts in :mod:`sdadapt._recipes.quant_gptq`). :func:`sdadapt.dequant_rules` builds it from a
release's ``quantization_config`` (``quant_method: gptq`` or ``awq``).

For every module ``m`` matching ``keys`` (and no ``exclude`` pattern) that stores ``m.qweight``,
the rule folds in ``m.qzeros``, ``m.scales`` and GPTQ's ``m.g_idx`` and puts the dequantised
``m.weight``; where the model holds ``m.qweight`` itself (the same packed layer), ``m`` is left
alone and its tensors are read as stored. Strict, from the headers: a packed tensor that is not int32, a missing one, scales
or zero points whose group count or width disagree with ``bits`` / ``group_size`` (or with the
model's weight), a ``g_idx`` of another length: a plan problem naming the tensor and the config
field. A ``g_idx`` value out of range is found when its rows are read (it is data): a
:class:`~sdadapt.errors.LoadError` naming the tensor, on every rank. No inverse: sdadapt
does not write GPTQ or AWQ (export the dequantised values).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import model_validator

from .._base.schema import dtype_name
from .._recipes import quant_gptq as G
from ..errors import AdapterError
from ._base import target_info
from ._custom import register_rule
from ._patterns import compile_pattern, union_of
from ._quant_rule import QuantRule

if TYPE_CHECKING:
    from ._base import PlanContext

SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@register_rule
class DequantGPTQ(QuantRule):
    """GPTQ / AWQ packed int weights -> values.

    Args:
        keys: a pattern of module names (``"**"``: every module storing a ``qweight``).
        layout: ``"gptq"`` (AutoGPTQ's ``checkpoint_format: gptq``) or ``"awq"`` (AutoAWQ GEMM).
        bits: the code width (GPTQ 2, 4 or 8; AWQ 4).
        group_size: input features per scale group; ``-1``: one group (GPTQ).
        exclude: patterns of modules left alone.
        dtype: the values' dtype (``None``: the model's).

    Example::

        rule = sdadapt.dequant_rules({"quantization_config": {"quant_method": "gptq", "bits": 4,
                                                              "group_size": 128}})[0]
    """

    kind: Literal["dequant_gptq"] = "dequant_gptq"
    layout: G.Layout
    bits: int
    group_size: int
    exclude: list[str] = []

    @model_validator(mode="after")
    def _check(self) -> DequantGPTQ:
        if self.layout == "gptq" and self.bits not in G.GPTQ_BITS:
            raise ValueError(f"GPTQ bits={self.bits} is not read; sdadapt reads {', '.join(map(str, G.GPTQ_BITS))}-bit GPTQ")
        if self.layout == "awq" and self.bits != 4:
            raise ValueError(f"AWQ bits={self.bits} is not read; AutoAWQ's GEMM layout is 4-bit")
        if self.group_size == 0 or self.group_size < -1 or (self.layout == "awq" and self.group_size == -1):
            also = ", or -1" if self.layout == "gptq" else ""
            raise ValueError(f"group_size={self.group_size} is no group size (a positive count{also})")
        return self

    def input_patterns(self) -> list[str]:
        return [self.keys + ".qweight"]

    def apply(self, ctx: PlanContext, index: int) -> None:
        take, skip = compile_pattern(self.keys).regex.match, union_of(tuple(self.exclude)).match
        to, follows = self._values_dtype()
        for key in ctx.keys():
            if not key.endswith(".qweight"):
                continue
            module = key[: -len(".qweight")]
            if take(module) is None or skip(module) is not None:
                continue
            if target_info(ctx, key, index) is not None:
                ctx.mark(index)  # the model holds the same packed layer: its tensors are read as they are
                continue
            problem, group = self._problem(ctx, index, module)
            if problem:
                ctx.issue(index, module + ".qweight", problem)
                continue
            qweight, qzeros, scales = (ctx.absorb(f"{module}.{p}", index) for p in ("qweight", "qzeros", "scales"))
            g_idx = ctx.absorb(module + ".g_idx", index) if self.layout == "gptq" and ctx.has(module + ".g_idx") else None
            node = G.DequantizedGPTQ(qweight, qzeros, scales, g_idx, self.layout, self.bits, group, to, follows)
            ctx.put(module + ".weight", node, index, origin=module + ".qweight")
            ctx.mark(index)

    def _problem(self, ctx: PlanContext, index: int, module: str) -> tuple[str | None, int]:
        """Why ``module``'s tensors are no ``layout`` layer of ``bits`` / ``group_size``, and its group size."""
        p = G.per_word(self.bits)
        cfg = f"bits={self.bits}, group_size={self.group_size}"
        names = {n: f"{module}.{n}" for n in ("qweight", "qzeros", "scales")}
        for k in names.values():
            if not ctx.has(k):
                return f"{self.layout.upper()} layer {module!r} has no {k!r}", 0
        if ctx.has(module + ".weight"):
            return f"{module + '.weight'!r} exists already beside {names['qweight']!r}; the dequantised value would overwrite it", 0
        qw, qz, sc = (ctx.get(k) for k in names.values())
        for n, node in (("qweight", qw), ("qzeros", qz)):
            if node.dtype != torch.int32 or len(node.shape) != 2:
                return f"{names[n]!r} is {dtype_name(node.dtype)} {list(node.shape)}; {self.layout.upper()} packs it as 2-D int32", 0
        if sc.dtype not in SCALE_DTYPES or len(sc.shape) != 2:
            return f"{names['scales']!r} is {dtype_name(sc.dtype)} {list(sc.shape)}; scales are 2-D float16, bfloat16 or float32", 0
        groups, out = sc.shape
        cols = qw.shape[0] * p if self.layout == "gptq" else qw.shape[0]
        info = target_info(ctx, module + ".weight", index)
        if info is not None and len(info.shape) == 2 and tuple(info.shape) != (out, cols):
            return (f"{names['qweight']!r} unpacks with {cfg} to [{out}, {cols}], but the model's weight is "
                    f"{list(info.shape)}; check quantization_config's bits"), 0  # fmt: skip
        group = cols if self.group_size == -1 else self.group_size
        want_groups = G.cdiv(cols, group) if self.layout == "gptq" else cols // group
        if self.layout == "awq" and cols % group:
            return f"{names['qweight']!r} has {cols} input features, not a multiple of group_size={group}", 0
        if groups != want_groups:
            return (f"{names['scales']!r} has {groups} groups (rows), but {cols} input features in groups of {group} "
                    f"make {want_groups}; check quantization_config's group_size ({cfg})"), 0  # fmt: skip
        want_qw = (cols // p, out) if self.layout == "gptq" else (cols, G.cdiv(out, p))
        if self.layout == "awq" and tuple(qw.shape) != want_qw:
            return (f"{names['qweight']!r} is {list(qw.shape)}, but {out} outputs packed {p} per int32 need {list(want_qw)}; "
                    f"check quantization_config's bits ({cfg})"), 0  # fmt: skip
        if self.layout == "gptq" and qw.shape[1] != out:
            return f"{names['qweight']!r} has {qw.shape[1]} outputs, its scales {out}", 0
        want_qz = (groups, G.cdiv(out, p))
        if tuple(qz.shape) != want_qz:
            return (f"{names['qzeros']!r} is {list(qz.shape)}, but {groups} groups of {out} outputs packed {p} per int32 "
                    f"need {list(want_qz)}; check quantization_config's bits ({cfg})"), 0  # fmt: skip
        gk = module + ".g_idx"
        if self.layout == "gptq" and ctx.has(gk):
            gi = ctx.get(gk)
            if gi.dtype not in (torch.int32, torch.int64) or tuple(gi.shape) != (cols,):
                return (f"{gk!r} is {dtype_name(gi.dtype)} {list(gi.shape)}; it holds the group of each of the {cols} "
                        f"input features (int32 [{cols}])"), 0  # fmt: skip
        return None, group

    def inverse(self) -> list[Any]:
        raise AdapterError(f"{self.label()} cannot be inverted: sdadapt does not write {self.layout.upper()} "
                           "releases; export the dequantised values instead (an adapter without this rule)")  # fmt: skip
