"""What every rule shares: the :class:`RuleBase` protocol, dtype names, the helpers rules use to
find, move and size keys, and the working set they act on while a plan is built
(:class:`PlanContext`: current key -> recipe node, with the bookkeeping the report needs).

Also here: the wrapper segments that module wrappers add to keys, removed before any rule runs."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from .._recipes.nodes import Leaf, Node
from ..errors import AdapterError
from ._patterns import compile_pattern, latest_match, union_of

if TYPE_CHECKING:
    from .._base.schema import TensorInfo


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

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

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
        changes values (:class:`._values.Affine`) says how each kind of moment changes, or
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


T = TypeVar("T", bound=RuleBase)


def built_by(*call: str) -> Callable[[type[T]], type[T]]:
    """Class decorator of a built-in rule kind: its docstring gets the sections every such class
    shares, said once here. Its fields are the arguments of its public function (the one named
    like its ``kind``, :data:`~sdadapt._base.rule_kinds.RULE_KINDS`); ``call`` is the example's
    arguments to that function, one string each."""

    def complete(cls: type[T]) -> type[T]:
        kind = cls.model_fields["kind"].default
        sections = _BUILT_BY.format(role=":func:", kind=kind, call=", ".join(call), name=cls.__name__)
        cls.__doc__ = inspect.cleandoc(cls.__doc__ or "") + sections
        return cls

    return complete


_BUILT_BY = """

Args:
    **fields: the arguments of {role}`sdadapt.{kind}`, with the same names and meaning.

Example::

    rule = sdadapt.{kind}({call})
    assert isinstance(rule, sdadapt.rules.{name})
    assert rule.kind == "{kind}"  # its JSON: rule.model_dump_json()
"""


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


class InPlaceRule(RuleBase):
    """A rule that changes the tensors under the keys ``keys`` matches (one pattern or a list)
    and keeps their keys, so that it takes none away from the rules after it. The subclass
    declares ``keys`` after its ``kind``, which its JSON then starts with."""

    moves_keys: ClassVar[bool] = False
    if TYPE_CHECKING:
        keys: Keys

    @field_validator("keys", check_fields=False)
    @classmethod
    def _keys(cls, v: Keys) -> Keys:
        return check_keys(v)

    def input_patterns(self) -> list[str]:
        return key_patterns(self.keys)


def matching(ctx: PlanContext, keys: Keys) -> Iterator[tuple[str, Node]]:
    """``(key, node)`` for each key present when the rule starts that matches ``keys`` (one
    pattern or a list of them), in the working set's order."""
    match = union_of(tuple(key_patterns(keys))).match  # one C-level match per key, whatever the number of patterns
    for key in ctx.keys():
        if match(key) is not None:
            yield key, ctx.get(key)


def captured(ctx: PlanContext, pattern: str) -> Iterator[tuple[str, dict[str, str]]]:
    """``(key, captures)`` for each key present when the rule starts that ``pattern`` matches,
    in the working set's order."""
    match = compile_pattern(pattern).regex.match  # KeyPattern.match's regex, without a call more per key
    for key in ctx.keys():
        m = match(key)
        if m is not None:
            yield key, m.groupdict()


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
    for rule in ctx.rules[index + 1 :]:
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


WRAPPER_SEGMENTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
"""Key segments that module wrappers add (torch.compile, activation checkpointing, FSDP1) and
that ``get_model_state_dict`` leaves out: :func:`~sdadapt._plan.plan.build_plan` removes them from every source key,
wherever they appear, before the adapter's rules run."""


_MAY_WRAP = re.compile("|".join(WRAPPER_SEGMENTS))


def unwrap_key(key: str) -> str:
    """``"_orig_mod.layers.0._checkpoint_wrapped_module.w"`` -> ``"layers.0.w"``."""
    if _MAY_WRAP.search(key) is None:  # the common case, in one C-level scan
        return key
    parts = key.split(".")
    kept = [p for p in parts if p not in WRAPPER_SEGMENTS]
    return ".".join(kept) if kept and len(kept) != len(parts) else key


class RuleIssue(BaseModel):
    model_config = ConfigDict(defer_build=True)  # built when a rule first reports an issue

    rule: str
    index: int
    key: str | None = None
    message: str


class PlanContext:
    """The working set rules act on: current key -> Node, plus bookkeeping for the report."""

    def __init__(
        self,
        schema: dict[str, TensorInfo],
        non_tensor: list[str],
        target: dict[str, TensorInfo] | None,
        rules: Sequence[RuleBase],
        stage_of: Callable[[int], int],
    ):
        self.env: dict[str, Node] = {k: Leaf(k, i.shape, i.dtype) for k, i in schema.items()}
        self.source = schema  # the source's TensorInfo by original key (leaves keep that key)
        self.non_tensor: set[str] = set(non_tensor)
        self.target = target
        self.rules = rules
        self.stage_of = stage_of  # which composed part (``a + b``) rule ``index`` belongs to
        self.born: dict[str, int] = dict.fromkeys(self.env, -1)
        self.taken: dict[str, Node] = {}
        self.consumed: list[tuple[str, int]] = []  # (key, index of the rule that took it)
        self.matches = [0] * len(rules)
        self.issues: list[RuleIssue] = []
        self.dropped: list[str] = []

    # --- used by rules -------------------------------------------------------------
    def keys(self, include_non_tensor: bool = False) -> list[str]:
        ks = list(self.env)
        return ks + sorted(self.non_tensor) if include_non_tensor else ks

    def has(self, key: str) -> bool:
        return key in self.env

    def get(self, key: str) -> Node:
        return self.env[key]

    def mark(self, index: int) -> None:
        self.matches[index] += 1

    def take(self, key: str, index: int) -> Node:
        node = self.env.pop(key)
        self.taken[key] = node
        self.consumed.append((key, index))
        self.mark(index)
        return node

    def absorb(self, key: str, index: int) -> Node:
        """Remove ``key``, folded into another key's recipe by value rule ``index`` (a
        quantization scale). Not a move: later rules may match its name without ambiguity."""
        self.mark(index)
        return self.env.pop(key)

    def put(self, key: str, node: Node, index: int, origin: str | list[str]) -> None:
        if key in self.env:
            self.issue(index, key, f"would overwrite {key!r}, which already exists; the rules collide")
            return
        self.env[key] = node
        self.born[key] = index

    def replace(self, key: str, node: Node) -> None:
        self.env[key] = node

    def drop(self, key: str, index: int) -> None:
        if key in self.non_tensor:
            self.non_tensor.discard(key)
        else:
            self.env.pop(key)
        self.dropped.append(key)
        self.consumed.append((key, index))
        self.mark(index)

    def issue(self, index: int, key: str | None, message: str) -> None:
        self.issues.append(
            RuleIssue(rule=self.rules[index].label(), index=index, key=key, message=message)
        )
        self.mark(index)

    def unwrap_keys(self) -> list[tuple[str, str, str]]:
        """Remove wrapper segments (:data:`WRAPPER_SEGMENTS`) from every key, before any rule.

        Leaves keep reading their original key. When two keys become one, the key that was
        already clean (else the first) takes the name and the other keeps its original name;
        returns those collisions as ``(kept_key, winner_key, clean_name)``. A rule may then
        drop or rename the kept key; if none does, the plan reports the collision."""
        winner: dict[str, str] = {}
        keys = [*self.env, *sorted(self.non_tensor)]
        clean = {key: unwrap_key(key) for key in keys}
        for key, new in clean.items():
            if new not in winner or key == new:
                winner[new] = key
        renamed: dict[str, str] = {}
        collisions: list[tuple[str, str, str]] = []
        for key, new in clean.items():
            if winner[new] == key:
                renamed[key] = new
            else:
                renamed[key] = key
                collisions.append((key, winner[new], new))
        self.env = {renamed[k]: v for k, v in self.env.items()}
        self.born = dict.fromkeys(self.env, -1)
        self.non_tensor = {renamed[k] for k in self.non_tensor}
        return collisions

    def collision_issues(self, collisions: list[tuple[str, str, str]]) -> list[RuleIssue]:
        return [
            RuleIssue(
                rule="auto-unwrap",
                index=-1,
                key=key,
                message=f"{key!r} and {other!r} both become {new!r} once the wrapper segments "
                f"{', '.join(WRAPPER_SEGMENTS)} are removed; drop or rename {key!r}",
            )
            for key, other, new in collisions
            if key in self.env or key in self.non_tensor
        ]

    # --- after all rules -------------------------------------------------------------
    def check_ambiguity(self) -> None:
        """A key taken by rule i must not also match a later key-moving rule j of the same
        composed part (``a + b``: ``b`` sees ``a``'s outputs, not the keys ``a`` took).

        Each key is first tried against one regex for all the rules of its part, which names the
        last rule matching it (one C-level match instead of one Python call per rule: a MoE
        checkpoint has ~10^5 keys); only a key that a rule after its own matches is tried rule
        by rule, to name the rules."""
        rules = self.rules
        stage = self.stage_of
        later = [(j, [compile_pattern(p) for p in r.input_patterns()]) for j, r in enumerate(rules) if r.moves_keys]
        latest: dict[int, Callable[[str], int]] = {}
        # asked once per rule: a rule without the field answers through pydantic's failing __getattr__
        shadows = [bool(getattr(r, "shadows", False)) for r in rules]
        for key, i in self.consumed:
            if shadows[i]:
                continue  # taken first on purpose (Drop(shadows=True))
            screen = latest.get(stage(i))
            if screen is None:  # the rules of the same composed part: the next part sees only the outputs
                screen = latest[stage(i)] = latest_match([(j, pats) for j, pats in later if stage(j) == stage(i)])
            if screen(key) <= i:
                continue
            for j, pats in later:
                if j > i and stage(j) == stage(i) and any(p.match(key) is not None for p in pats):
                    self.issue(
                        j,
                        key,
                        f"also matches this key, which rule #{i} {rules[i].label()} took first; "
                        "make the patterns disjoint",
                    )
