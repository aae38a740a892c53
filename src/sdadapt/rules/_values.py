"""Value rules: they keep each matched key and replace its node (cast, transpose, rotary row
order, affine ``w * scale + shift``, pad/trim). They apply in order; rules that read the target (pad, trim) look a key up
under the name it will have after the later key-moving rules (:func:`._base.final_key`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

from pydantic import Field, field_validator, model_validator

from .._recipes import moves as MV
from .._recipes.arithmetic import AffineMapped
from .._recipes.moves import Narrowed
from .._recipes.nodes import Converted
from ..errors import AdapterError
from ._base import (
    InPlaceRule,
    Keys,
    RuleBase,
    built_by,
    dim_of,
    dtype_str,
    matching,
    matching_dim,
    parse_dtype,
    target_info,
    target_size,
)
from ._custom import register_rule

if TYPE_CHECKING:
    from ._base import PlanContext


MODEL_DTYPE = "model"
"""``Cast(dtype="model")``: each tensor goes to the dtype the model holds under its final key."""


@built_by('"**", "model"')
class Cast(InPlaceRule):
    """Convert matched tensors to ``dtype`` (optionally only those stored as ``from_dtype``).
    Dtype changes are never silent: without a cast rule a dtype mismatch is a problem.
    ``dtype="model"`` converts each tensor to the dtype the model holds for it (looked up under
    the key's final name), the one rule that fixes any dtype-only mismatch. A recipe that
    computes its values (a dequantisation of an FP8 release, a LoRA merge, an affine) is given
    ``dtype`` to compute in instead (:meth:`~sdadapt._recipes.nodes.Node.as_dtype`), so a float32 model
    gets float32 values, not bfloat16 ones widened."""

    kind: Literal["cast"] = "cast"
    keys: str = "**"
    dtype: str
    from_dtype: str | None = None

    @field_validator("dtype", "from_dtype", mode="before")
    @classmethod
    def _norm(cls, v: object) -> str | None:
        if v is None:
            return None
        return MODEL_DTYPE if v == MODEL_DTYPE else dtype_str(v)

    @field_validator("from_dtype")
    @classmethod
    def _from_concrete(cls, v: str | None) -> str | None:
        if v == MODEL_DTYPE:
            raise AdapterError('cast: from_dtype names a dtype; "model" applies to dtype only')
        return v

    def apply(self, ctx: PlanContext, index: int) -> None:
        only = parse_dtype(self.from_dtype) if self.from_dtype else None
        for key, node in matching(ctx, self.keys):
            if only is not None and node.dtype != only:
                continue
            if self.dtype == MODEL_DTYPE:
                info = target_info(ctx, key, index)
                if info is None:
                    continue  # the model does not hold this key: the report says so
                to = info.dtype
            else:
                to = parse_dtype(self.dtype)
            ctx.mark(index)
            if node.dtype != to:
                ctx.replace(key, node.as_dtype(to) or Converted(node, to))

    def inverse(self) -> list[RuleBase]:
        if self.from_dtype is None:
            raise AdapterError(
                f"{self.label()} cannot be inverted: it does not say which dtype it converts from; "
                "give from_dtype=..."
            )
        if self.dtype == MODEL_DTYPE:
            return [Cast(keys=self.keys, dtype=self.from_dtype)]
        return [Cast(keys=self.keys, dtype=self.from_dtype, from_dtype=self.dtype)]


@built_by('"h.{i}.attn.c_attn.weight"')
class Transpose(InPlaceRule):
    """Swap dims ``dim0`` and ``dim1`` of matched tensors, keeping their keys (GPT-2 ``Conv1D``
    ``[in, out]`` <-> ``nn.Linear`` ``[out, in]``). Its own inverse."""

    kind: Literal["transpose"] = "transpose"
    keys: str
    dim0: int = 0
    dim1: int = 1

    def apply(self, ctx: PlanContext, index: int) -> None:
        for key, node in matching(ctx, self.keys):
            d0 = dim_of(ctx, index, key, node, self.dim0, "dim0")
            d1 = dim_of(ctx, index, key, node, self.dim1, "dim1")
            if d0 is None or d1 is None:
                continue
            ctx.mark(index)
            if d0 != d1:
                ctx.replace(key, MV.Transposed(node, d0, d1))

    def inverse(self) -> list[RuleBase]:
        return [Transpose(keys=self.keys, dim0=self.dim0, dim1=self.dim1)]


def rotary_perm(head_dim: int, to: str, rotary_dim: int | None = None) -> tuple[int, ...]:
    """Row order inside one head: output row ``j`` is input row ``perm[j]``.

    ``to="half"`` (Meta -> HF transformers): HF row ``t * head_dim/2 + j`` is Meta row ``2j + t``
    (HF's conversion script: ``w.view(heads, head_dim // 2, 2, dim).transpose(1, 2)``);
    ``to="interleaved"`` (HF -> Meta) is its inverse. With ``rotary_dim`` (partial rotary, as
    transformers' ``partial_rotary_factor``) only the first ``rotary_dim`` rows of the head
    rotate and are reordered; the rest pass through in place."""
    r = head_dim if rotary_dim is None else rotary_dim
    h = r // 2
    if to == "half":
        rot = [2 * (i % h) + i // h for i in range(r)]
    else:
        rot = [(m % 2) * h + m // 2 for m in range(r)]
    return tuple(rot + list(range(r, head_dim)))


@built_by('"layers.{i}.attention.wq.weight", heads=32, rotary_dim=0.25')
class Rotary(InPlaceRule):
    """Reorder the rows inside each head between rotary layouts, for every tensor ``keys``
    matches (one pattern, or a list: q/k weights, their biases, per-head q/k norm weights).

    ``to="interleaved"``: from HF transformers' "half" layout (``rotate_half``: the first half of
    each head's rows are the real parts) to Meta's interleaved pairs; ``to="half"``: the other
    way. The unit permuted is one head along ``dim``: ``head_dim`` rows when given, else the
    rows of the tensor divided by ``heads`` (GQA: give k its own rule with the kv head count, or
    give ``head_dim``, which q and k share). A 1-D tensor has only dim 0: a bias ``[heads *
    head_dim]`` is cut in heads like the weight's rows, and a per-head norm weight
    ``[head_dim]`` (one head, shared by all) is a single unit; ``head_dim=`` covers all three
    in one rule, since ``heads`` would cut the norm weight wrongly. A region that cuts a head is
    read as whole heads, permuted, then narrowed.

    Partial rotary (transformers' ``partial_rotary_factor``, GPT-NeoX's ``rotary_pct``): only the
    first ``rotary_dim`` rows of each head rotate. ``rotary_dim`` is a row count (an int) or a
    fraction of the head (a float in (0, 1]); the rotating rows are reordered, the others stay."""

    kind: Literal["rotary"] = "rotary"
    keys: Keys
    heads: int | None = Field(default=None, gt=0)
    to: Literal["interleaved", "half"] = "interleaved"
    dim: int = 0
    head_dim: int | None = Field(default=None, gt=0)
    rotary_dim: int | float | None = None

    @model_validator(mode="after")
    def _check(self) -> Rotary:
        if self.heads is None and self.head_dim is None:
            raise AdapterError(f"rotary of {self.keys!r}: give heads= (heads of the matched tensors) or head_dim=")
        rd = self.rotary_dim
        if isinstance(rd, float) and not 0.0 < rd <= 1.0:
            raise AdapterError(f"rotary of {self.keys!r}: rotary_dim={rd} as a fraction of the head must be in (0, 1]")
        if isinstance(rd, int) and (rd < 2 or rd % 2):
            raise AdapterError(f"rotary of {self.keys!r}: rotary_dim={rd} must be an even row count >= 2 (or a fraction)")
        if self.head_dim is not None and rd is None and self.head_dim % 2:
            raise AdapterError(f"rotary of {self.keys!r}: head_dim={self.head_dim} is odd; rotary needs an even head_dim")
        if self.head_dim is not None and rd is not None and isinstance(self._rotating(self.head_dim), str):
            raise AdapterError(f"rotary of {self.keys!r}: {self._rotating(self.head_dim)}")
        return self

    def _rotating(self, hd: int) -> int | str:
        """Rows of a ``hd``-row head that rotate, or why ``rotary_dim`` does not fit it."""
        rd = self.rotary_dim
        if rd is None:
            return hd
        rows = rd if isinstance(rd, int) else round(rd * hd)
        if isinstance(rd, float) and abs(rows - rd * hd) > 1e-6:
            return f"rotary_dim={rd} of head_dim {hd} is {rd * hd:g} rows, not a whole number"
        if rows > hd or rows < 2 or rows % 2:
            return f"rotary_dim={rd} gives {rows} rotating rows of head_dim {hd}; they must be even and at most the head"
        return rows

    def _unit(self, rows: int, d: int) -> int | str:
        """Rows of one head along dim ``d`` (of ``rows``), or why the tensor cannot be cut in heads."""
        if self.head_dim is not None:
            if rows % self.head_dim:
                return f"{rows} rows along dim {d} do not divide into heads of head_dim={self.head_dim}"
            return self.head_dim
        assert self.heads is not None
        if rows % self.heads:
            return f"{rows} rows along dim {d} do not divide into heads={self.heads}; give head_dim= for per-head norm weights"
        if (rows // self.heads) % 2 and self.rotary_dim is None:
            return f"head_dim {rows // self.heads} (= {rows} rows / heads={self.heads}) is odd; rotary needs an even head_dim"
        return rows // self.heads

    def apply(self, ctx: PlanContext, index: int) -> None:
        for key, node, d in matching_dim(ctx, index, self.keys, self.dim):
            hd = self._unit(node.shape[d], d)
            rd = hd if isinstance(hd, str) else self._rotating(hd)
            if isinstance(rd, str):
                ctx.issue(index, key, rd)
                continue
            assert isinstance(hd, int)
            ctx.mark(index)
            part = f", rotary_dim={rd}" if rd != hd else ""
            label = f"rotary_{self.to}[head_dim={hd}{part}, dim={d}]"
            ctx.replace(key, MV.UnitPermuted(node, d, hd, rotary_perm(hd, self.to, rd), label))

    def inverse(self) -> list[RuleBase]:
        other: Literal["interleaved", "half"] = "half" if self.to == "interleaved" else "interleaved"
        return [Rotary(keys=self.keys, heads=self.heads, to=other, dim=self.dim, head_dim=self.head_dim,
                       rotary_dim=self.rotary_dim)]


GRADIENT_MOMENTS = frozenset({"exp_avg", "momentum_buffer", "grad_avg"})
"""Optimizer state that averages gradients (Adam(W)'s ``exp_avg``, SGD's ``momentum_buffer``,
centred RMSprop's ``grad_avg``): it scales as the gradient does."""
SQUARED_MOMENTS = frozenset({"exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum"})
"""Optimizer state that averages squared gradients (Adam(W)'s ``exp_avg_sq`` and AMSGrad's
``max_exp_avg_sq``, RMSprop's ``square_avg``, Adagrad's ``sum``): it scales as its square."""


@built_by('"**norm.weight"', "shift=1.0")
class Affine(InPlaceRule):
    """``w * scale + shift`` for every tensor ``keys`` matches (one pattern or a list): Gemma's
    norms store ``w`` and compute with ``1 + w``, so a model that multiplies by its weight
    directly loads them with ``affine("**norm.weight", shift=1.0)``. ``invert=True`` computes
    ``(w - shift) / scale`` instead (what :meth:`inverse` gives, exact where ``1 / scale`` is
    not). Floating tensors only; the arithmetic runs in float32 (float64 for float64 tensors)
    and the result is rounded once to the tensor's dtype.

    Resuming optimizer state (:func:`sdadapt.load_state`): a model that holds ``p = w * scale +
    shift`` and computes what the checkpoint's model computed from ``w`` has gradients
    ``dL/dp = dL/dw / scale``. So the shift never applies to moments; gradient averages
    (:data:`GRADIENT_MOMENTS`) are divided by ``scale`` and squared ones
    (:data:`SQUARED_MOMENTS`) by ``scale ** 2`` (multiplied, with ``invert``). Other optimizer
    state is refused by name, since its scaling is not known."""

    kind: Literal["affine"] = "affine"
    keys: Keys
    scale: float = 1.0
    shift: float = 0.0
    invert: bool = False

    @model_validator(mode="after")
    def _check(self) -> Affine:
        if self.scale == 0 or not math.isfinite(self.scale) or not math.isfinite(self.shift):
            raise AdapterError(f"affine of {self.keys!r}: scale must be finite and non-zero, shift finite")
        return self

    def apply(self, ctx: PlanContext, index: int) -> None:
        for key, node in matching(ctx, self.keys):
            if not node.dtype.is_floating_point:
                ctx.issue(index, key, f"affine needs a floating tensor; {key!r} is {node.dtype}: cast it first")
                continue
            ctx.mark(index)
            if self.scale != 1.0 or self.shift != 0.0:
                ctx.replace(key, AffineMapped(node, self.scale, self.shift, self.invert))

    def inverse(self) -> list[RuleBase]:
        return [Affine(keys=self.keys, scale=self.scale, shift=self.shift, invert=not self.invert)]

    def for_optimizer_state(self, name: str) -> list[RuleBase]:
        if name in GRADIENT_MOMENTS:
            power = 1
        elif name in SQUARED_MOMENTS:
            power = 2
        else:
            raise AdapterError(
                f"{self.label()}: cannot tell how optimizer state {name!r} changes under w * scale + shift "
                f"(known: {', '.join(sorted(GRADIENT_MOMENTS | SQUARED_MOMENTS))}); load the model alone "
                "(optimizer=None) or map the state with a rule of your own"
            )
        factor = self.scale**power
        if self.scale == 1.0:
            return []
        return [Affine(keys=self.keys, scale=factor, invert=not self.invert)]


@built_by('"embed_tokens.weight", multiple_of=64')
class Pad(InPlaceRule):
    """Extend matched tensors along ``dim`` with ``value`` up to ``size``, or to the next multiple
    of ``multiple_of``, or (neither given) to the target's size for that key (vocab padded for
    TP). The inverse is :class:`Trim` to the target's size: exporting needs a target (or a
    ``Trim`` with an explicit ``size``), since one rule may match tensors of several sizes."""

    kind: Literal["pad"] = "pad"
    keys: str
    dim: int = 0
    size: int | None = Field(default=None, ge=0)
    multiple_of: int | None = Field(default=None, gt=0)
    value: float = 0.0

    @model_validator(mode="after")
    def _check(self) -> Pad:
        if self.size is not None and self.multiple_of is not None:
            raise AdapterError(f"pad of {self.keys!r}: give size or multiple_of, not both")
        return self

    def apply(self, ctx: PlanContext, index: int) -> None:
        for key, node, d in matching_dim(ctx, index, self.keys, self.dim):
            n = node.shape[d]
            want = self._size(ctx, key, index, n, d, len(node.shape))
            if want is None:
                ctx.issue(index, key, "the model has no such key to take the size from; give size= or multiple_of=")
                continue
            if want < n:
                ctx.issue(index, key, f"cannot pad dim {d} from {n} down to {want}; use trim")
                continue
            ctx.mark(index)
            if want > n:
                ctx.replace(key, MV.Padded(node, d, want, self.value))

    def _size(self, ctx: PlanContext, key: str, index: int, n: int, d: int, nd: int) -> int | None:
        """The padded size along dim ``d`` (now ``n``): declared, rounded up, or the target's."""
        if self.size is not None:
            return self.size
        if self.multiple_of is not None:
            return -(-n // self.multiple_of) * self.multiple_of
        return target_size(ctx, key, index, d, nd)

    def inverse(self) -> list[RuleBase]:
        return [Trim(keys=self.keys, dim=self.dim)]


@built_by('"embed_tokens.weight", size=32000')
class Trim(InPlaceRule):
    """Keep the first ``size`` entries of matched tensors along ``dim`` (``size`` omitted: the
    target's size for that key; a plan without that key in its target reports it)."""

    kind: Literal["trim"] = "trim"
    keys: str
    dim: int = 0
    size: int | None = Field(default=None, ge=0)

    def apply(self, ctx: PlanContext, index: int) -> None:
        for key, node, d in matching_dim(ctx, index, self.keys, self.dim):
            n = node.shape[d]
            want = self.size if self.size is not None else target_size(ctx, key, index, d, len(node.shape))
            if want is None:
                ctx.issue(index, key, "the model has no such key to take the size from; give size= to trim")
                continue
            if want > n:
                ctx.issue(index, key, f"cannot trim dim {d} from {n} up to {want}; use pad")
                continue
            ctx.mark(index)
            if want < n:
                ctx.replace(key, Narrowed(node, d, 0, want))

    def inverse(self) -> list[RuleBase]:
        return [Pad(keys=self.keys, dim=self.dim)]


# imported on first use (sdadapt._base.rule_kinds.ON_USE): its kinds are registered here
for _cls in (Cast, Transpose, Rotary, Affine, Pad, Trim):
    register_rule(_cls)
