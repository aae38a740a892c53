"""An Adapter: an ordered list of typed rules, from a checkpoint's layout to a model's."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict, SerializeAsAny, ValidationError, field_validator, model_validator

from . import _quant_rules  # noqa: F401 - registers the quantization rule kinds
from ._rules import RuleBase, rule_from_data
from .errors import AdapterError


class Adapter(BaseModel):
    """Rules applied in order to the checkpoint's keys; keys no rule matches pass unchanged.

    ``Adapter([rename(...), fuse(...)], name="mymodel")``; ``adapter.inverse()`` maps the other
    way (for export); ``adapter.to_json()`` / ``Adapter.from_json(text)`` serialise it.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    rules: list[SerializeAsAny[RuleBase]] = []
    name: str = "custom"
    description: str = ""

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
        seen: dict[str, int] = {}
        for i, r in enumerate(self.rules):
            if not r.moves_keys:
                continue
            for p in r.input_patterns():
                if p in seen:
                    raise AdapterError(
                        f"rules #{seen[p]} {self.rules[seen[p]].label()} and #{i} {r.label()} both take "
                        f"keys matching {p!r}; a key may be taken by one rule only"
                    )
                seen[p] = i
        return self

    def for_optimizer_state(self, name: str) -> Adapter:
        """The adapter that maps optimizer state ``name`` (``exp_avg``...) of the parameters
        this adapter maps (see :meth:`RuleBase.for_optimizer_state`)."""
        rules = [r2 for r in self.rules for r2 in r.for_optimizer_state(name)]
        return Adapter(rules, name=f"{self.name}[{name}]", description=self.description)

    def inverse(self) -> Adapter:
        """The adapter from the model's layout back to the checkpoint's."""
        rules = [inv for r in reversed(self.rules) for inv in r.inverse()]
        return Adapter(rules, name=f"{self.name}.inverse", description=f"inverse of {self.name}")

    def __add__(self, other: Adapter) -> Adapter:
        return Adapter([*self.rules, *other.rules], name=f"{self.name}+{other.name}")

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
        lines += [f"  #{i} {r.label()}" for i, r in enumerate(self.rules)]
        return "\n".join(lines)
