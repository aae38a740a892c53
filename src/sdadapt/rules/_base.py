"""What every rule shares: the :class:`RuleBase` protocol, dtype names, and the helpers rules
use to find, move and size the keys of a plan's working set."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, ValidationError

from .._recipes.nodes import Node
from ..errors import AdapterError
from ._patterns import compile_pattern

if TYPE_CHECKING:
    from .._plan.plan import PlanContext
    from ..sources._base import TensorInfo


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"``, ``"torch.bfloat16"`` or ``torch.bfloat16`` -> ``torch.bfloat16``.

    Args:
        name: a dtype name (``"bfloat16"``, ``"torch.bfloat16"``) or a ``torch.dtype``.

    Returns:
        The ``torch.dtype``.

    Raises:
        AdapterError: no torch dtype has that name.

    Example::

        assert sdadapt.rules.parse_dtype("bfloat16") is torch.bfloat16
    """
    if isinstance(name, torch.dtype):
        return name
    dt = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise AdapterError(f"unknown dtype {name!r}; use a torch dtype name such as 'bfloat16' or 'float32'")
    return dt


def dtype_str(v: object) -> str:
    """The canonical name a rule stores for a dtype given as a name or a ``torch.dtype``
    (``torch.bfloat16`` -> ``"bfloat16"``); anything else is read as its ``str()``."""
    return str(parse_dtype(v if isinstance(v, torch.dtype) else str(v))).removeprefix("torch.")


class RuleBase(BaseModel):
    """One step of an adapter. A subclass declares its fields and a ``kind`` literal (the JSON
    discriminator), and implements :meth:`input_patterns`, :meth:`apply` and :meth:`inverse`.

    ``moves_keys``: a key-moving rule (rename, fuse, ...) takes the keys it matches away, and a
    key may be taken by one such rule only; a value rule (cast, pad, ...) keeps the key and
    replaces its node.

    Args:
        **fields: the subclass's own fields (pydantic), with ``kind`` its JSON name.

    Example::

        @sdadapt.rules.register_rule
        class DropAll(sdadapt.rules.RuleBase):
            kind: Literal["drop_all"] = "drop_all"
            moves_keys: ClassVar[bool] = True

            def input_patterns(self) -> list[str]:
                return ["**"]

            def apply(self, ctx, index) -> None:
                for key in list(ctx.keys()):
                    ctx.take(key, index)

            def inverse(self) -> list[RuleBase]:
                return []
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    moves_keys: ClassVar[bool] = True

    def __init__(self, **data: Any):
        try:
            super().__init__(**data)
        except ValidationError as e:  # a bad argument is an AdapterError naming the rule
            kind = type(self).model_fields["kind"].default
            raise AdapterError(f"invalid adapter rule {kind!r}: {e}") from None

    def input_patterns(self) -> list[str]:
        """The key patterns this rule reads (for the one-rule-per-key check)."""
        raise NotImplementedError

    def apply(self, ctx: PlanContext, index: int) -> None:
        """Replace the matched entries of ``ctx`` with new nodes; ``index`` is this rule's position."""
        raise NotImplementedError

    def inverse(self) -> list[RuleBase]:
        """The rules that undo this one (for export), in the order they run."""
        raise NotImplementedError

    def for_optimizer_state(self, name: str) -> list[RuleBase]:
        """The rules that map optimizer state ``name`` (``exp_avg``, ``exp_avg_sq``...) of the
        parameters this rule maps, when training state is resumed through the adapter. Keys,
        layouts and dtypes follow the parameter's, so by default the rule itself; a rule that
        changes values (:class:`.values.Affine`) says how each kind of moment changes, or
        raises :class:`~sdadapt.errors.AdapterError` for state it cannot map."""
        return [self]

    def key_after(self, key: str) -> str | None:
        """The name ``key`` has once this rule has run: ``None`` if the rule takes it into
        something else (fuse, split, stack, drop...), else its (possibly new) name. Value rules
        keep every key; rules that rename override this."""
        if not self.moves_keys:
            return key
        return None if any(compile_pattern(p).match(key) is not None for p in self.input_patterns()) else key

    def label(self) -> str:
        """``kind(field=value, ...)``: how reports and errors name this rule."""
        fields = ", ".join(f"{k}={v!r}" for k, v in self.model_dump(exclude={"kind"}).items() if v is not None)
        return f"{getattr(self, 'kind', type(self).__name__)}({fields})"


Keys = str | list[str]
"""The ``keys`` of a value rule: one pattern, or several (a weight and its bias) that the rule
treats alike."""


def key_patterns(keys: Keys) -> list[str]:
    """``keys`` as a list of patterns."""
    return [keys] if isinstance(keys, str) else list(keys)


def check_keys(keys: Keys) -> Keys:
    """``keys`` if it names at least one pattern (a validator of rules' ``keys`` fields)."""
    if not isinstance(keys, str) and not keys:
        raise AdapterError("keys must be a pattern or a non-empty list of patterns")
    return keys


def matching(ctx: PlanContext, keys: Keys) -> Iterator[tuple[str, Node]]:
    """``(key, node)`` for each key present when the rule starts that matches ``keys`` (one
    pattern or a list of them), in the working set's order."""
    pats = [compile_pattern(k) for k in key_patterns(keys)]
    for key in ctx.keys():
        if any(p.match(key) is not None for p in pats):
            yield key, ctx.get(key)


def move(ctx: PlanContext, index: int, moved: list[tuple[str, str]]) -> None:
    """Rule ``index`` renames each ``(old, new)``: all are taken first, then put, so that a new
    name may be an old name of another pair."""
    for old, _ in moved:
        ctx.take(old, index)
    for old, new in moved:
        ctx.put(new, ctx.taken[old], index, origin=old)


def dim_of(ctx: PlanContext, index: int, key: str, node: Node, dim: int, what: str = "dim") -> int | None:
    """``dim`` made non-negative for ``node``; out of range: an issue of rule ``index`` and ``None``."""
    nd = len(node.shape)
    if not -nd <= dim < nd:
        ctx.issue(index, key, f"{what} {dim} is out of range for {key!r} of shape {list(node.shape)}")
        return None
    return dim % nd


def matching_dim(ctx: PlanContext, index: int, keys: Keys, dim: int) -> Iterator[tuple[str, Node, int]]:
    """:func:`matching` with ``dim`` made non-negative for each key; a key for which ``dim`` is
    out of range is reported as an issue of rule ``index`` and skipped."""
    for key, node in matching(ctx, keys):
        d = dim_of(ctx, index, key, node, dim)
        if d is not None:
            yield key, node, d


def final_key(ctx: PlanContext, key: str, index: int) -> str | None:
    """The name ``key`` will have once the rules after rule ``index`` have run (each rule's
    :meth:`RuleBase.key_after`): renames and prefix rules are followed; ``None`` if another
    key-moving rule (fuse, split, stack...) takes it. Value rules that read the target (pad,
    trim, interleave) look the key up under this name, so they work before renames too (as in
    an inverted adapter)."""
    k = key
    for rule in ctx.adapter.rules[index + 1 :]:
        after = rule.key_after(k)
        if after is None:
            return None
        k = after
    return k


def target_info(ctx: PlanContext, key: str, index: int) -> TensorInfo | None:
    """The target's TensorInfo for what ``key`` becomes (see :func:`final_key`), if any."""
    if ctx.target is None:
        return None
    final = final_key(ctx, key, index)
    return None if final is None else ctx.target.get(final)


def target_size(ctx: PlanContext, key: str, index: int, d: int, nd: int) -> int | None:
    """The target's size along dim ``d`` for what ``key`` becomes, if the target has it with ``nd`` dims."""
    info = target_info(ctx, key, index)
    if info is None or len(info.shape) != nd:
        return None
    return info.shape[d]
