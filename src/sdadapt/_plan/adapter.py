"""An Adapter: an ordered list of typed rules, from a checkpoint's layout to a model's."""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable, Iterable
from typing import Any, overload

import torch
from pydantic import BaseModel, ConfigDict, SerializeAsAny, ValidationError, field_validator, model_validator

from ..errors import AdapterError
from ..rules import RuleBase, cast, rule_from_data


class Adapter(BaseModel):
    """Rules applied in order to the checkpoint's keys; keys no rule matches pass unchanged.

    ``Adapter([rename(...), fuse(...)], name="mymodel")``; ``adapter.inverse()`` maps the other
    way (for export); ``adapter.to_json()`` / ``Adapter.from_json(text)`` serialise it.

    ``a + b`` composes sequentially: ``b``'s rules see the keys ``a`` produced, as if ``a``'s
    output were the checkpoint. Within one adapter a key may be taken by one key-moving rule
    only (two rules matching the same key are an error, since which one was meant is unclear);
    across a ``+`` a rule of ``b`` may take a name a rule of ``a`` took and re-created.
    ``stages`` holds the index of the first rule of each composed part after the first.

    Args:
        rules: the rules, in order (built by ``sdadapt.rename(...)`` and friends, or rule classes
            of one's own registered with :func:`sdadapt.rules.register_rule`).
        name: a name for messages and the registry.
        description: free text, kept in the JSON.
        stages: set by ``+``; leave it out.

    Example::

        adapter = sdadapt.Adapter(
            [sdadapt.strip_prefix("model."), sdadapt.rename("layers.{i}.mlp.up_proj.weight", "layers.{i}.w3.weight")],
            name="mymodel",
        )
        assert sdadapt.Adapter.from_json(adapter.to_json()) == adapter
    """

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    rules: list[SerializeAsAny[RuleBase]] = []
    name: str = "custom"
    description: str = ""
    stages: list[int] = []

    @field_validator("rules", mode="before")
    @classmethod
    def _rules(cls, v: Any) -> Any:
        # each rule by its ``kind`` from the registry (built-in and registered user rules)
        if not isinstance(v, list | tuple):
            return v
        out = []
        for i, r in enumerate(v):
            try:
                out.append(rule_from_data(r))
            except AdapterError as e:
                raise AdapterError(f"invalid adapter rule #{i}: {e}") from None
        return out

    def __init__(self, rules: Iterable[Any] | None = None, /, **data: Any):
        if rules is not None:
            if "rules" in data:
                raise AdapterError("pass the rules once, positionally or as rules=")
            data["rules"] = list(rules)
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise AdapterError(f"invalid adapter: {e}") from None

    @model_validator(mode="after")
    def _no_duplicate_inputs(self) -> Adapter:
        if self.stages != sorted(set(self.stages)) or any(not 0 < s < len(self.rules) for s in self.stages):
            raise AdapterError(f"adapter {self.name!r}: stages {self.stages} must be increasing rule indices in 1..{len(self.rules) - 1}")
        seen: dict[tuple[int, str], int] = {}
        for i, r in enumerate(self.rules):
            if not r.moves_keys:
                continue
            for pat in r.input_patterns():
                p = (self.stage_of(i), pat)
                if p in seen:
                    raise AdapterError(
                        f"rules #{seen[p]} {self.rules[seen[p]].label()} and #{i} {r.label()} both take "
                        f"keys matching {pat!r}; a key may be taken by one rule only (compose adapters with "
                        "`a + b` for a rule that takes a name an earlier rule re-created)"
                    )
                seen[p] = i
        return self

    def stage_of(self, index: int) -> int:
        """Which composed part (0, 1, ...) rule ``index`` belongs to."""
        return bisect.bisect_right(self.stages, index)

    def parts(self) -> list[list[RuleBase]]:
        """The rules of each composed part, in order."""
        cuts = [0, *self.stages, len(self.rules)]
        return [list(self.rules[a:b]) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]

    @classmethod
    def composed(cls, parts: list[list[Any]], **data: Any) -> Adapter:
        """An adapter applying ``parts`` one after the other (each sees the keys the previous made)."""
        rules: list[Any] = []
        stages: list[int] = []
        for part in parts:
            if part and rules:
                stages.append(len(rules))
            rules += part
        return cls(rules, stages=stages, **data)

    def _map_parts(self, fn: Callable[[RuleBase], list[RuleBase]], reverse: bool) -> list[list[RuleBase]]:
        parts = self.parts()
        if reverse:
            return [[x for r in reversed(p) for x in fn(r)] for p in reversed(parts)]
        return [[x for r in p for x in fn(r)] for p in parts]

    def for_optimizer_state(self, name: str) -> Adapter:
        """The adapter that maps optimizer state ``name`` (``exp_avg``...) of the parameters
        this adapter maps (see :meth:`RuleBase.for_optimizer_state`)."""
        parts = self._map_parts(lambda r: r.for_optimizer_state(name), reverse=False)
        return Adapter.composed(parts, name=f"{self.name}[{name}]", description=self.description)

    def inverse(self) -> Adapter:
        """The adapter from the model's layout back to the checkpoint's (composed parts in reverse)."""
        parts = self._map_parts(lambda r: r.inverse(), reverse=True)
        return Adapter.composed(parts, name=f"{self.name}.inverse", description=f"inverse of {self.name}")

    def __add__(self, other: Adapter) -> Adapter:
        """Sequential composition: ``other``'s rules apply to the keys this adapter produces."""
        return Adapter.composed([*self.parts(), *other.parts()], name=f"{self.name}+{other.name}")

    def to_json(self, indent: int | None = 2) -> str:
        return self.model_dump_json(indent=indent)

    @classmethod
    def from_json(cls, text: str | bytes) -> Adapter:
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise AdapterError(f"adapter JSON is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise AdapterError("adapter JSON must be an object with a 'rules' list")
        return cls(**data)

    def __len__(self) -> int:
        return len(self.rules)

    def describe(self) -> str:
        lines = [f"adapter {self.name}: {len(self.rules)} rules"]
        for i, r in enumerate(self.rules):
            if i in self.stages:
                lines.append("  then, on the keys the rules above produced:")
            lines.append(f"  #{i} {r.label()}")
        return "\n".join(lines)


@overload
def with_dtype(adapter: Adapter, dtype: str | torch.dtype | None) -> Adapter: ...


@overload
def with_dtype(adapter: None, dtype: str | torch.dtype | None) -> Adapter | None: ...


def with_dtype(adapter: Adapter | None, dtype: str | torch.dtype | None) -> Adapter | None:
    """``adapter`` followed by ``cast("**", dtype)`` (``dtype=None``: ``adapter`` as it is):
    what ``load``, ``plan_load`` and ``diff`` run for their ``dtype`` argument."""
    if dtype is None:
        return adapter
    to_dtype = Adapter([cast("**", dtype)], name=f"dtype={dtype}")
    return to_dtype if adapter is None else adapter + to_dtype
