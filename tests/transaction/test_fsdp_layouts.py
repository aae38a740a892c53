"""``to_empty``'s own walk reads FSDP2's parameter groups in each torch layout it may meet.

torch releases differ in how an ``FSDPModule``'s state holds its groups: a list
(``_fsdp_param_groups``) where one module may hold several, one optional group
(``_fsdp_param_group``) before that. The walk resets every group's sharded parameters as
``FSDPModule._apply`` does, and leaves the work to ``Module._apply`` where it knows neither
layout. The walk itself is compared with ``Module._apply`` on real FSDP2 meshes in
``tests/dist/test_dist_load.py::test_to_empty_matches_module_apply``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from sdadapt._transaction.materialize import _param_groups


class _Module:
    """An object with ``_get_fsdp_state``, what ``_param_groups`` asks of an FSDPModule."""

    def __init__(self, state: Any) -> None:
        self._state = state

    def _get_fsdp_state(self) -> Any:
        return self._state


def test_a_list_of_groups() -> None:
    a, b = object(), object()
    assert _param_groups(_Module(SimpleNamespace(_fsdp_param_groups=[a, b]))) == [a, b]  # type: ignore[arg-type]
    assert _param_groups(_Module(SimpleNamespace(_fsdp_param_groups=[]))) == []  # type: ignore[arg-type]


def test_one_optional_group() -> None:
    g = object()
    assert _param_groups(_Module(SimpleNamespace(_fsdp_param_group=g))) == [g]  # type: ignore[arg-type]
    assert _param_groups(_Module(SimpleNamespace(_fsdp_param_group=None))) == []  # type: ignore[arg-type]


def test_an_unknown_layout_is_left_to_module_apply() -> None:
    assert _param_groups(_Module(SimpleNamespace())) is None  # type: ignore[arg-type]
