"""The ambiguity check of planning (a key taken by one key-moving rule must match no later one)
screens each key with one regex for all the rules of its part, which names the last rule
matching it: the same verdicts as trying every rule,
with later rules that capture the same names, literal patterns, ``**`` and typed captures; and
wrapper segments are still removed before the rules run."""

from __future__ import annotations

import torch

import sdadapt
from sdadapt._base.schema import TensorInfo
from sdadapt._plan.plan import build_plan
from sdadapt.rules._base import unwrap_key


def _schema(keys: list[str]) -> dict[str, TensorInfo]:
    return {k: TensorInfo((2,), torch.float32) for k in keys}


def test_later_rules_with_the_same_captures_are_each_named():
    rules = [
        sdadapt.rename("m.layers.{i}.a", "L.{i}.a"),  # 0 takes m.layers.{i}.a
        sdadapt.rename("m.layers.{i}.b", "L.{i}.b"),  # 1 takes m.layers.{i}.b
        sdadapt.rename("m.layers.{i}.c", "L.{i}.c"),  # 2: same capture name, disjoint: no issue
        sdadapt.rename("m.{j:int}.x", "X.{j}"),  # 3: typed capture, disjoint
        sdadapt.rename("m.layers.1.{rest:*}", "one.{rest}"),  # 4: also matches layer 1's a and b
        sdadapt.drop("**.b"),  # 5: also matches every b
        sdadapt.rename("m.norm", "norm"),  # 6: literal, last: nothing after it
    ]
    src = ["m.layers.0.a", "m.layers.0.b", "m.layers.1.a", "m.layers.1.b", "m.layers.0.c", "m.7.x", "m.norm"]
    tgt = ["L.0.a", "L.0.b", "L.1.a", "L.1.b", "L.0.c", "X.7", "norm"]
    p = build_plan(_schema(src), _schema(tgt), sdadapt.Adapter(rules))
    got = sorted((i.index, i.key) for i in p.report.rule_issues)
    # what trying every later rule one by one gives
    want = sorted([(4, "m.layers.1.a"), (4, "m.layers.1.b"), (5, "m.layers.0.b"), (5, "m.layers.1.b")])
    assert got == want
    assert all("took first" in i.message for i in p.report.rule_issues)


def test_no_issue_when_patterns_are_disjoint():
    rules = [sdadapt.rename("a.{i}.w", "x.{i}.w"), sdadapt.rename("b.{i}.w", "y.{i}.w"), sdadapt.drop("c.**")]
    src = ["a.0.w", "a.1.w", "b.0.w", "c.q.r"]
    p = build_plan(_schema(src), _schema(["x.0.w", "x.1.w", "y.0.w"]), sdadapt.Adapter(rules))
    assert p.report.ok, p.report.format()


def test_unwrap_key_removes_wrapper_segments_anywhere_and_leaves_the_rest():
    assert unwrap_key("_orig_mod.layers.0._checkpoint_wrapped_module.w") == "layers.0.w"
    assert unwrap_key("layers.0._fsdp_wrapped_module.w") == "layers.0.w"
    assert unwrap_key("layers.0.w") == "layers.0.w"
    assert unwrap_key("layers.my_orig_mod_x.w") == "layers.my_orig_mod_x.w"  # a segment, not a substring
    assert unwrap_key("_orig_mod") == "_orig_mod"  # nothing would be left


def test_latest_match_names_the_last_rule_whose_patterns_match():
    """The screen's one regex gives what trying each rule's patterns one by one gives: the largest
    index matching (several patterns per rule, the same capture names, ``**``, typed captures)."""
    from sdadapt.rules._patterns import compile_pattern, latest_match

    texts = [["m.layers.{i}.a", "m.layers.{i}.b"], ["m.{j:int}.x"], ["m.layers.1.{rest:*}"], ["**.b"], ["m.norm"], ["*"]]
    indexed = [(j * 2, [compile_pattern(t) for t in ts]) for j, ts in enumerate(texts)]  # indices need not be dense
    latest = latest_match(indexed)
    keys = ["m.layers.0.a", "m.layers.0.b", "m.layers.1.a", "m.layers.1.c", "m.7.x", "m.x.x", "m.norm", "norm", "q.b", ""]
    for key in keys:
        want = max((j for j, pats in indexed if any(p.match(key) is not None for p in pats)), default=-1)
        assert latest(key) == want, key
    assert latest_match([])("anything") == -1
