"""Rules, Adapter and plan semantics, on schemas only (plus eager values where it matters)."""

from __future__ import annotations

import pytest
import torch
from support.checkpoints import DictIO

import sdadapt
from sdadapt._base.schema import TensorInfo
from sdadapt._plan.plan import build_plan
from sdadapt._recipes.moves import Concatenated, Narrowed
from sdadapt._recipes.nodes import Converted, Leaf
from sdadapt.errors import AdapterError

F32, BF16 = torch.float32, torch.bfloat16


def S(**spec):
    """Schema from ``key=(shape, dtype)``; dots in keys are written as ``__``."""
    return {k.replace("__", "."): TensorInfo(tuple(v[0]), v[1] if len(v) > 1 else F32) for k, v in spec.items()}


def schema(d):
    return {k: TensorInfo(tuple(v[0]), v[1] if len(v) > 1 else F32) for k, v in d.items()}


def plan(src, tgt, rules=(), **kw):
    return build_plan(schema(src), schema(tgt), sdadapt.Adapter(list(rules)), **kw)


# --- rename -------------------------------------------------------------------------------


def test_rename_with_captures():
    src = {f"model.layers.{i}.mlp.up_proj.weight": ((4, 3),) for i in range(3)} | {"model.norm.weight": ((3,),)}
    tgt = {f"layers.{i}.ffn.w3.weight": ((4, 3),) for i in range(3)} | {"norm.weight": ((3,),)}
    p = plan(
        src,
        tgt,
        [
            sdadapt.rename("model.layers.{i:int}.mlp.up_proj.weight", "layers.{i}.ffn.w3.weight"),
            sdadapt.rename("model.norm.{p}", "norm.{p}"),
        ],
    )
    assert p.report.ok, p.report.format()
    assert {k: n.leaves() for k, n in p.recipes.items()} == {
        **{f"layers.{i}.ffn.w3.weight": [f"model.layers.{i}.mlp.up_proj.weight"] for i in range(3)},
        "norm.weight": ["model.norm.weight"],
    }
    assert all(isinstance(n, Leaf) for n in p.recipes.values())


def test_rename_must_keep_captures_both_ways():
    with pytest.raises(AdapterError, match=r"\{j\}"):
        sdadapt.rename("a.{i}", "b.{j}")
    with pytest.raises(AdapterError, match=r"\{i\}"):  # not invertible: {i} would be lost
        sdadapt.rename("a.{i}", "b")


def test_rename_onto_existing_key_is_a_collision():
    p = plan({"a.w": ((2,),), "b.w": ((2,),)}, {"b.w": ((2,),)}, [sdadapt.rename("a.w", "b.w")])
    assert not p.report.ok
    assert any("would overwrite" in i.message and i.key == "b.w" for i in p.report.rule_issues)


def test_rename_may_not_use_wildcards():
    # many keys onto one (not invertible): name the capture instead
    with pytest.raises(AdapterError, match="may not contain"):
        sdadapt.rename("*.w", "x.w")
    with pytest.raises(AdapterError, match="may not contain"):
        sdadapt.rename("a.{i}", "**.{i}")


def test_specific_then_general_rename_is_ambiguous():
    rules = [sdadapt.rename("model.layers.{i}.w", "blocks.{i}.w"), sdadapt.rename("model.{rest:*}", "{rest}")]
    p = plan({"model.layers.0.w": ((2,),), "model.norm": ((2,),)}, {"blocks.0.w": ((2,),), "norm": ((2,),)}, rules)
    assert [(i.index, i.key) for i in p.report.rule_issues] == [(1, "model.layers.0.w")]
    assert set(p.recipes) == {"blocks.0.w", "norm"}


# --- fuse ---------------------------------------------------------------------------------

GQA_SRC = {
    "l.0.q.weight": ((8, 4),),
    "l.0.k.weight": ((2, 4),),
    "l.0.v.weight": ((2, 4),),
}
GQA_FUSE = sdadapt.fuse(["l.{i}.q.{p}", "l.{i}.k.{p}", "l.{i}.v.{p}"], "l.{i}.qkv.{p}", sizes=[8, 2, 2])


def test_fuse_of_unequal_parts_without_sizes_is_refused():
    """The inverse split (export) could only cut equal parts: the plan says which sizes to give."""
    p = plan(GQA_SRC, {"l.0.qkv.weight": ((12, 4),)}, [sdadapt.fuse(["l.{i}.q.{p}", "l.{i}.k.{p}", "l.{i}.v.{p}"], "l.{i}.qkv.{p}")])
    assert not p.report.ok
    assert "differ in size; pass sizes=[8, 2, 2]" in p.report.format()
    equal = {"l.0.q.weight": ((2, 4),), "l.0.k.weight": ((2, 4),), "l.0.v.weight": ((2, 4),)}
    p = plan(equal, {"l.0.qkv.weight": ((6, 4),)}, [sdadapt.fuse(["l.{i}.q.{p}", "l.{i}.k.{p}", "l.{i}.v.{p}"], "l.{i}.qkv.{p}")])
    assert p.report.ok, p.report.format()


def test_fuse_unequal_sizes_values():
    p = plan(GQA_SRC, {"l.0.qkv.weight": ((12, 4),)}, [GQA_FUSE])
    assert p.report.ok, p.report.format()
    node = p.recipes["l.0.qkv.weight"]
    assert isinstance(node, Concatenated) and node.leaves() == ["l.0.q.weight", "l.0.k.weight", "l.0.v.weight"]
    q, k, v = torch.randn(8, 4), torch.randn(2, 4), torch.randn(2, 4)
    io = DictIO({"l.0.q.weight": q, "l.0.k.weight": k, "l.0.v.weight": v})
    assert torch.equal(node.full(io), torch.cat([q, k, v]))
    # rows 6..10 straddle q and k: read only those rows
    io = DictIO(io.tensors)
    assert torch.equal(node.read(((6, 10), (1, 3)), io), torch.cat([q, k, v])[6:10, 1:3])
    assert io.reads == [("l.0.q.weight", ((6, 8), (1, 3))), ("l.0.k.weight", ((0, 2), (1, 3)))]


def test_fuse_along_last_dim_negative():
    p = plan(
        {"a.x": ((3, 2),), "a.y": ((3, 5),)},
        {"b": ((3, 7),)},
        [sdadapt.fuse(["a.x", "a.y"], "b", dim=-1, sizes=[2, 5])],
    )
    assert p.report.ok
    assert p.recipes["b"].dim == 1


def test_fuse_problems_are_reported_per_key():
    src = dict(GQA_SRC)
    src["l.1.q.weight"] = ((8, 4),)  # layer 1 lacks k and v
    src["l.2.q.weight"] = ((8, 4),)
    src["l.2.k.weight"] = ((2, 5),)  # does not fit
    src["l.2.v.weight"] = ((2, 4),)
    src["l.3.q.weight"] = ((8, 4),)
    src["l.3.k.weight"] = ((2, 4), BF16)  # dtype differs
    src["l.3.v.weight"] = ((2, 4),)
    tgt = {f"l.{i}.qkv.weight": ((12, 4),) for i in range(4)}
    p = plan(src, tgt, [GQA_FUSE])
    issues = {i.key: i.message for i in p.report.rule_issues}
    assert "not 'l.1.k.weight', 'l.1.v.weight'" in issues["l.1.qkv.weight"]
    assert "do not fit" in issues["l.2.qkv.weight"] and "l.2.k.weight[2, 5]" in issues["l.2.qkv.weight"]
    assert "dtypes differ" in issues["l.3.qkv.weight"] and "cast first" in issues["l.3.qkv.weight"]
    assert set(p.recipes) == {"l.0.qkv.weight"}
    assert sorted(p.report.missing) == ["l.1.qkv.weight", "l.2.qkv.weight", "l.3.qkv.weight"]
    assert not p.report.ok


def test_fuse_declared_sizes_checked():
    rule = sdadapt.fuse(["l.{i}.q.{p}", "l.{i}.k.{p}", "l.{i}.v.{p}"], "l.{i}.qkv.{p}", sizes=[8, 4, 4])
    p = plan(GQA_SRC, {"l.0.qkv.weight": ((12, 4),)}, [rule])
    assert any("declared sizes [8, 4, 4]" in i.message for i in p.report.rule_issues)
    with pytest.raises(AdapterError, match="2 sizes for 3 sources"):
        sdadapt.fuse(["a", "b", "c"], "d", sizes=[1, 2])
    with pytest.raises(AdapterError, match="at least two"):
        sdadapt.fuse(["a"], "d")
    with pytest.raises(AdapterError, match="same names"):
        sdadapt.fuse(["a.{i}", "b"], "d.{i}")


def test_fuse_and_split_must_be_invertible():
    # the inverse would need {p}, which the fused key does not carry
    with pytest.raises(AdapterError, match=r"\{p\}"):
        sdadapt.fuse(["a.{i}.q.{p}", "a.{i}.k.{p}"], "a.{i}.qkv")
    with pytest.raises(AdapterError, match=r"\{p\}"):
        sdadapt.split("x.{i}.{p}", ["y.{i}.a", "y.{i}.b"])


# --- split --------------------------------------------------------------------------------


def test_split_sizes_from_target_schema():
    rule = sdadapt.split("l.{i}.qkv.{p}", ["l.{i}.q.{p}", "l.{i}.k.{p}", "l.{i}.v.{p}"])
    p = plan({"l.0.qkv.weight": ((12, 4),)}, GQA_SRC, [rule])
    assert p.report.ok, p.report.format()
    got = {k: (n.start, n.length) for k, n in p.recipes.items() if isinstance(n, Narrowed)}
    assert got == {"l.0.q.weight": (0, 8), "l.0.k.weight": (8, 2), "l.0.v.weight": (10, 2)}
    qkv = torch.randn(12, 4)
    io = DictIO({"l.0.qkv.weight": qkv})
    assert torch.equal(p.recipes["l.0.k.weight"].full(io), qkv[8:10])
    assert torch.equal(p.recipes["l.0.v.weight"].read(((1, 2), (0, 4)), io), qkv[11:12])


def test_split_default_equal_and_declared():
    p = plan({"w": ((6, 2),)}, {"a": ((3, 2),), "b": ((3, 2),)}, [sdadapt.split("w", ["a", "b"])])
    assert p.report.ok
    # the target does not have every destination: equal parts
    p = plan({"w": ((6, 2),)}, {"a": ((3, 2),)}, [sdadapt.split("w", ["a", "b"])])
    assert p.report.unexpected == ["b"]
    # declared sizes win over the target's; a mismatch with the target is a shape mismatch
    p = plan({"w": ((6, 2),)}, {"a": ((3, 2),), "b": ((3, 2),)}, [sdadapt.split("w", ["a", "b"], sizes=[2, 4])])
    assert {m.key for m in p.report.shape_mismatch} == {"a", "b"}


def test_split_problems():
    p = plan({"w": ((7, 2),)}, {"x": ((1,),)}, [sdadapt.split("w", ["a", "b"])])
    assert any("pass sizes=" in i.message and i.key == "w" for i in p.report.rule_issues)
    p = plan({"w": ((7, 2),)}, {}, [sdadapt.split("w", ["a", "b"], sizes=[3, 3])])
    assert any("add up to 6, but dim 0 has 7" in i.message for i in p.report.rule_issues)
    p = plan({"w": ((7, 2),)}, {"a": ((3, 2),), "b": ((3, 2),)}, [sdadapt.split("w", ["a", "b"])])
    assert any("taken from the target" in i.message for i in p.report.rule_issues)
    p = plan({"w": ((6,),)}, {}, [sdadapt.split("w", ["a", "b"], dim=1)])
    assert any("out of range" in i.message for i in p.report.rule_issues)
    assert not p.report.ok
    with pytest.raises(AdapterError, match=">= 0"):
        sdadapt.split("w", ["a", "b"], sizes=[-1, 7])


# --- cast ---------------------------------------------------------------------------------


def test_dtype_change_without_cast_is_a_mismatch():
    """A narrowing (float32 -> bfloat16) needs a cast rule; the exact widening the other way
    loads as it is, listed as widened."""
    widened = plan({"w": ((2, 2), BF16)}, {"w": ((2, 2), F32)})
    assert widened.report.ok and widened.report.widened == ["w"]
    assert isinstance(widened.recipes["w"], Converted)
    p = plan({"w": ((2, 2), F32)}, {"w": ((2, 2), BF16)})
    assert not p.report.ok
    [mm] = p.report.dtype_mismatch
    assert (mm.key, mm.model, mm.checkpoint) == ("w", "bfloat16", "float32")
    assert 'sdadapt.cast("**", "model")' in p.report.format()
    assert p.recipes == {}


def test_cast_rule():
    p = plan({"w": ((2, 2), BF16), "n": ((2,), F32)}, {"w": ((2, 2), F32), "n": ((2,), F32)}, [sdadapt.cast("**", F32)])
    assert p.report.ok
    assert isinstance(p.recipes["w"], Converted) and isinstance(p.recipes["n"], Leaf)
    w = torch.randn(2, 2).to(BF16)
    got = p.recipes["w"].full(DictIO({"w": w}))
    assert got.dtype == F32 and torch.equal(got, w.float())


def test_cast_from_dtype_only_touches_that_dtype():
    rule = sdadapt.cast("**", "bfloat16", from_dtype="float16")
    p = plan({"a": ((2,), torch.float16), "b": ((2,), F32)}, {"a": ((2,), BF16), "b": ((2,), F32)}, [rule])
    assert p.report.ok
    assert isinstance(p.recipes["a"], Converted) and isinstance(p.recipes["b"], Leaf)
    assert rule.inverse() == [sdadapt.cast("**", "float16", from_dtype="bfloat16")]
    with pytest.raises(AdapterError, match="from_dtype"):
        sdadapt.cast("**", F32).inverse()
    with pytest.raises(AdapterError, match="unknown dtype"):
        sdadapt.cast("**", "float33")
    assert sdadapt.cast("**", torch.bfloat16).dtype == "bfloat16"


# --- drop, tie ----------------------------------------------------------------------------


def test_drop_tensors_and_non_tensors():
    p = build_plan(
        schema({"w": ((2,),), "rope.freqs": ((4,),)}),
        schema({"w": ((2,),)}),
        sdadapt.Adapter([sdadapt.drop("rope.*"), sdadapt.drop("step")]),
        non_tensor=["step"],
    )
    assert p.report.ok, p.report.format()
    assert p.report.dropped == ["rope.freqs", "step"]
    assert "dropped by rules: 2 key(s)" in p.report.format()


def test_non_tensor_entries_are_problems_unless_dropped_or_allowed():
    p = build_plan(schema({"w": ((2,),)}), schema({"w": ((2,),)}), None, non_tensor=["epoch"])
    assert p.report.non_tensor == ["epoch"] and not p.report.ok
    p = build_plan(schema({"w": ((2,),)}), schema({"w": ((2,),)}), None, non_tensor=["epoch"], allow_unexpected=["epoch"])
    assert p.report.ok and p.report.allowed_unexpected == ["epoch"]


def test_tie_only_when_checkpoint_lacks_dst():
    tie = sdadapt.tie("output.weight", "tok.weight")
    tgt = {"tok.weight": ((5, 3),), "output.weight": ((5, 3),)}
    p = plan({"tok.weight": ((5, 3),)}, tgt, [tie])
    assert p.report.ok
    assert p.recipes["output.weight"].leaves() == ["tok.weight"]
    assert p.recipes["tok.weight"].leaves() == ["tok.weight"]
    # the checkpoint holds its own output.weight: it is used, the tie does nothing (and is not "unused")
    p = plan({"tok.weight": ((5, 3),), "output.weight": ((5, 3),)}, tgt, [tie])
    assert p.report.ok
    assert p.recipes["output.weight"].leaves() == ["output.weight"]
    # the model does not want output.weight: nothing is made
    p = plan({"tok.weight": ((5, 3),)}, {"tok.weight": ((5, 3),)}, [tie])
    assert p.report.ok and set(p.recipes) == {"tok.weight"}
    assert tie.inverse() == []


# --- ambiguity, unused, allow lists ---------------------------------------------------------


def test_identical_input_patterns_rejected_at_construction():
    with pytest.raises(AdapterError, match="both take keys matching 'a.{i}'"):
        sdadapt.Adapter([sdadapt.rename("a.{i}", "b.{i}"), sdadapt.drop("a.{i}")])
    with pytest.raises(AdapterError, match="a key may be taken by one rule only"):
        sdadapt.Adapter([sdadapt.fuse(["x.{i}", "y.{i}"], "z.{i}"), sdadapt.split("y.{i}", ["p.{i}", "q.{i}"])])
    # value rules (cast) may share patterns with key-moving rules
    sdadapt.Adapter([sdadapt.cast("a.{i}", F32), sdadapt.rename("a.{i}", "b.{i}")])


def test_key_matched_by_two_key_moving_rules_is_reported():
    rules = [sdadapt.rename("layers.{i}.w", "blocks.{i}.w"), sdadapt.drop("layers.**")]
    p = plan({"layers.0.w": ((2,),), "layers.0.b": ((2,),)}, {"blocks.0.w": ((2,),)}, rules)
    amb = [i for i in p.report.rule_issues if "took first" in i.message]
    assert [(i.index, i.key) for i in amb] == [(1, "layers.0.w")]
    assert "#0 rename" in amb[0].message
    assert not p.report.ok
    assert "make the patterns disjoint" in p.report.format()


def test_unused_rules_reported():
    rules = [sdadapt.rename("nothing.{i}", "here.{i}"), sdadapt.cast("**", F32, from_dtype="int8"), sdadapt.drop("x")]
    p = plan({"x": ((2,),), "w": ((2,),)}, {"w": ((2,),)}, rules)
    assert p.report.unused_rules == [f"#0 {rules[0].label()}", f"#1 {rules[1].label()}"]
    assert not p.report.ok
    assert "rules that matched nothing (2)" in p.report.format()


def test_allow_missing_and_unexpected_patterns():
    src = {"w": ((2,),), "extra.0": ((1,),), "extra.1": ((1,),), "junk": ((1,),)}
    tgt = {"w": ((2,),), "buf.a": ((3,),), "buf.b": ((3,),), "needed": ((1,),)}
    p = plan(src, tgt, allow_missing=["buf.*"], allow_unexpected=["extra.{i:int}"])
    r = p.report
    assert r.missing == ["needed"] and r.unexpected == ["junk"]
    assert sorted(r.allowed_missing) == ["buf.a", "buf.b"] and sorted(r.allowed_unexpected) == ["extra.0", "extra.1"]
    assert sorted(p.skipped) == ["buf.a", "buf.b"]
    assert r.problems == 2
    p = plan(src, tgt, allow_missing=["buf.*", "needed"], allow_unexpected=["extra.**", "junk"])
    assert p.report.ok and set(p.recipes) == {"w"}


def test_shape_mismatch_through_rules_names_recipe():
    p = plan(GQA_SRC, {"l.0.qkv.weight": ((24, 4),)}, [GQA_FUSE])
    [mm] = p.report.shape_mismatch
    assert (mm.model, mm.checkpoint) == ("[24, 4]", "[12, 4]")
    assert mm.recipe == "cat([l.0.q.weight, l.0.k.weight, l.0.v.weight], dim=0)"


# --- adapter --------------------------------------------------------------------------------


def test_adapter_json_and_errors():
    a = sdadapt.Adapter(
        [GQA_FUSE, sdadapt.cast("**", "bfloat16", from_dtype="float32"), sdadapt.drop("x.*"), sdadapt.tie("o", "e")],
        name="demo",
        description="d",
    )
    b = sdadapt.Adapter.from_json(a.to_json())
    assert b == a and [type(r) for r in b.rules] == [sdadapt.rules.Fuse, sdadapt.rules.Cast, sdadapt.rules.Drop, sdadapt.rules.Tie]
    with pytest.raises(AdapterError, match="not valid JSON"):
        sdadapt.Adapter.from_json("{")
    with pytest.raises(AdapterError, match="must be an object"):
        sdadapt.Adapter.from_json("[]")
    with pytest.raises(AdapterError, match="invalid adapter"):
        sdadapt.Adapter.from_json('{"rules": [{"kind": "explode", "keys": "x"}]}')
    with pytest.raises(AdapterError, match="invalid adapter"):
        sdadapt.Adapter.from_json('{"rules": [{"kind": "rename", "src": "a", "dst": "b", "typo": 1}]}')
    with pytest.raises(AdapterError, match=r"\{j\}"):
        sdadapt.Adapter.from_json('{"rules": [{"kind": "rename", "src": "a.{i}", "dst": "b.{j}"}]}')
    with pytest.raises(AdapterError, match="once"):
        sdadapt.Adapter([], rules=[])


def test_adapter_inverse_and_add():
    a = sdadapt.Adapter([sdadapt.rename("a.{i}", "b.{i}"), GQA_FUSE, sdadapt.drop("junk")], name="fwd")
    inv = a.inverse()
    assert inv.name == "fwd.inverse"
    assert inv.rules == [
        sdadapt.split("l.{i}.qkv.{p}", ["l.{i}.q.{p}", "l.{i}.k.{p}", "l.{i}.v.{p}"], sizes=[8, 2, 2]),
        sdadapt.rename("b.{i}", "a.{i}"),
    ]
    both = a + sdadapt.Adapter([sdadapt.cast("**", F32)], name="c")
    assert len(both) == 4 and both.name == "fwd+c"
    assert "#1 fuse" in a.describe()


# --- sequential composition (a + b) ----------------------------------------------------------


def test_composition_sees_the_previous_parts_outputs():
    """``a + b``: ``b``'s rules apply to the keys ``a`` produced, even a name ``a`` took and
    re-created; the same rules in one adapter are refused. Values bit-exact; the inverse is the
    parts' inverses in reverse and gives the checkpoint back; JSON keeps the parts."""
    a = sdadapt.Adapter([sdadapt.rename("w", "w_old"), sdadapt.rename("v", "w")], name="a")  # v takes w's name
    b = sdadapt.Adapter([sdadapt.rename("w", "weight"), sdadapt.split("qkv", ["q", "k"])], name="b")
    with pytest.raises(AdapterError, match=r"a key may be taken by one rule only \(compose adapters with `a \+ b`"):
        sdadapt.Adapter([*a.rules, *b.rules])
    ab = a + b
    assert ab.stages == [2] and ab.stage_of(1) == 0 and ab.stage_of(2) == 1 and ab.name == "a+b"
    assert "then, on the keys the rules above produced:\n  #2 rename" in ab.describe()
    src = {"w": torch.arange(4.0), "v": torch.arange(4.0) + 10, "qkv": torch.arange(12.0).view(6, 2)}
    io = DictIO(src)
    tgt = schema({"w_old": ((4,),), "weight": ((4,),), "q": ((3, 2),), "k": ((3, 2),)})
    p = build_plan(io.schema(), tgt, ab)
    assert p.report.ok, p.report.format()
    assert torch.equal(p.recipes["weight"].full(io), src["v"]) and torch.equal(p.recipes["w_old"].full(io), src["w"])
    assert torch.equal(p.recipes["k"].full(io), src["qkv"][3:])
    out = {k: n.full(io) for k, n in p.recipes.items()}
    inv = ab.inverse()
    assert inv.stages == [2] and inv.parts()[0] == b.inverse().rules and inv.parts()[1] == a.inverse().rules
    back = build_plan(DictIO(out).schema(), io.schema(), inv)
    assert back.report.ok, back.report.format()
    assert all(torch.equal(back.recipes[k].full(DictIO(out)), v) for k, v in src.items())
    again = sdadapt.Adapter.from_json(ab.to_json())
    assert again == ab and again.stages == [2]
    assert ab.for_optimizer_state("exp_avg").stages == [2]
    # a part that is empty adds no boundary; three parts keep two boundaries
    assert (sdadapt.Adapter([]) + a).stages == [] and (a + b + a).stages == [2, 4]
    with pytest.raises(AdapterError, match="stages"):
        sdadapt.Adapter(a.rules, stages=[5])


def test_composition_still_checks_each_part():
    """Within one part the ambiguity check holds; across parts a key the earlier part took is gone."""
    a = sdadapt.Adapter([sdadapt.rename("layers.{i}.w", "blocks.{i}.w"), sdadapt.drop("layers.**")])
    p = build_plan(schema({"layers.0.w": ((2,),), "layers.0.b": ((2,),)}), schema({"blocks.0.w": ((2,),)}), a)
    assert any("took first" in i.message for i in p.report.rule_issues)
    split = sdadapt.Adapter([sdadapt.rename("layers.{i}.w", "blocks.{i}.w")]) + sdadapt.Adapter([sdadapt.drop("layers.**")])
    p = build_plan(schema({"layers.0.w": ((2,),), "layers.0.b": ((2,),)}), schema({"blocks.0.w": ((2,),)}), split)
    assert p.report.ok and p.report.dropped == ["layers.0.b"], p.report.format()


def test_composition_through_the_engine(tmp_path):
    """A shipped adapter composed with renames onto another naming (what a torchtitan user does),
    loaded by ``sdadapt.load``: values equal the composed transform applied eagerly."""
    from torch import nn

    w = {"model.a.weight": torch.randn(6, 4), "model.b.weight": torch.randn(6, 4)}
    from safetensors.torch import save_file

    save_file(w, str(tmp_path / "m.safetensors"))
    first = sdadapt.Adapter([sdadapt.strip_prefix("model."), sdadapt.rename("a.weight", "x.weight"),
                             sdadapt.rename("b.weight", "a.weight")])  # fmt: skip
    second = sdadapt.Adapter([sdadapt.rename("a.weight", "inner.b.weight"), sdadapt.rename("x.weight", "inner.a.weight")])

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.ModuleDict({"a": nn.Linear(4, 6, bias=False), "b": nn.Linear(4, 6, bias=False)})

    with torch.device("meta"):
        m = M()
    sdadapt.load(m, str(tmp_path / "m.safetensors"), first + second)
    assert torch.equal(m.inner["a"].weight, w["model.a.weight"]) and torch.equal(m.inner["b"].weight, w["model.b.weight"])


# --- per-head fused layouts ------------------------------------------------------------------


def test_split_and_fuse_per_head():
    """``split(..., heads=H)``: GPT-NeoX's ``query_key_value`` ``view(H, 3, head_dim, dim)`` gives
    q, k, v; Falcon's per-kv-group layout (each group's q heads, then k, then v) with the kv
    head count; ``fuse(..., heads=H)`` is the inverse; both bit-exact against eager views, every
    region of the fused tensor too; the contiguous split is different (what a user got wrong)."""
    heads, hd, dim = 4, 6, 5
    qkv = torch.randn(heads * 3 * hd, dim)
    bias = torch.randn(heads * 3 * hd)
    io = DictIO({"qkv.weight": qkv, "qkv.bias": bias})
    names = ["q.{p}", "k.{p}", "v.{p}"]
    a = sdadapt.Adapter([sdadapt.split("qkv.{p}", names, heads=heads)])
    tgt = schema({f"{n}.{p}": ((heads * hd, dim) if p == "weight" else (heads * hd,),) for n in "qkv" for p in ("weight", "bias")})
    p = build_plan(io.schema(), tgt, a)
    assert p.report.ok, p.report.format()
    view = qkv.view(heads, 3, hd, dim)
    bview = bias.view(heads, 3, hd)
    for j, n in enumerate("qkv"):
        assert torch.equal(p.recipes[f"{n}.weight"].full(io), view[:, j].reshape(heads * hd, dim))
        assert torch.equal(p.recipes[f"{n}.bias"].full(io), bview[:, j].reshape(heads * hd))
        for a0, b0 in ((0, 1), (5, 13), (7, 24)):  # regions that cut heads
            got = p.recipes[f"{n}.weight"].read(((a0, b0), (1, 4)), io)
            assert torch.equal(got, view[:, j].reshape(heads * hd, dim)[a0:b0, 1:4])
    contiguous = build_plan(io.schema(), tgt, sdadapt.Adapter([sdadapt.split("qkv.{p}", names)]))
    assert not torch.equal(contiguous.recipes["k.weight"].full(io), p.recipes["k.weight"].full(io))
    # fuse(heads=) gives the per-head tensor back; the inverse of the split is that fuse
    out = {k: n.full(io) for k, n in p.recipes.items()}
    inv = a.inverse()
    assert inv.rules[0] == sdadapt.fuse(["q.{p}", "k.{p}", "v.{p}"], "qkv.{p}", heads=heads)
    back = build_plan(DictIO(out).schema(), io.schema(), inv)
    assert torch.equal(back.recipes["qkv.weight"].full(DictIO(out)), qkv)
    assert torch.equal(back.recipes["qkv.bias"].full(DictIO(out)), bias)
    # grouped (Falcon): 2 kv groups, each [2 q heads; k; v]
    kv, rep = 2, 2
    fused = torch.randn(kv * (rep + 2) * hd, dim)
    g = fused.view(kv, rep + 2, hd, dim)
    io2 = DictIO({"w": fused})
    sizes = [kv * rep * hd, kv * hd, kv * hd]
    p2 = build_plan(io2.schema(), schema({"q": ((sizes[0], dim),), "k": ((sizes[1], dim),), "v": ((sizes[2], dim),)}),
                    sdadapt.Adapter([sdadapt.split("w", ["q", "k", "v"], heads=kv)]))  # fmt: skip
    assert torch.equal(p2.recipes["q"].full(io2), g[:, :rep].reshape(-1, dim))
    assert torch.equal(p2.recipes["k"].full(io2), g[:, rep].reshape(-1, dim))
    assert torch.equal(p2.recipes["v"].full(io2), g[:, rep + 1].reshape(-1, dim))
    # parts that do not divide into the heads: an issue naming the key
    bad = build_plan(io2.schema(), schema({"q": ((sizes[0], dim),), "k": ((sizes[1], dim),), "v": ((sizes[2], dim),)}),
                     sdadapt.Adapter([sdadapt.split("w", ["q", "k", "v"], heads=5)]))  # fmt: skip
    assert any(i.key == "w" and "heads=5" in i.message for i in bad.report.rule_issues), bad.report.format()
    with pytest.raises(AdapterError):
        sdadapt.split("w", ["q", "k"], heads=0)
