"""Whole-key patterns: captures, anchoring, output formatting, errors."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import sdadapt
from sdadapt.errors import AdapterError
from sdadapt.rules._patterns import KeyPattern, check_output_pattern, compile_pattern, matches_any


@pytest.mark.parametrize(
    "pattern, key, expected",
    [
        # {name}: one dotted segment
        ("layers.{i}.wq.weight", "layers.3.wq.weight", {"i": "3"}),
        ("layers.{i}.wq.weight", "layers.abc.wq.weight", {"i": "abc"}),
        ("layers.{i}.wq.weight", "layers.3.4.wq.weight", None),
        ("layers.{i}.wq.weight", "layers..wq.weight", None),
        # {name:int}: digits only
        ("layers.{i:int}.w", "layers.12.w", {"i": "12"}),
        ("layers.{i:int}.w", "layers.x1.w", None),
        ("layers.{i:int}.w", "layers.1.2.w", None),
        # {name:*}: any text, dots included (at least one character)
        ("{pre:*}.weight", "model.layers.0.q.weight", {"pre": "model.layers.0.q"}),
        ("{pre:*}.weight", ".weight", None),
        # *: one segment, not captured; **: anything, not captured
        ("layers.*.w", "layers.7.w", {}),
        ("layers.*.w", "layers.7.8.w", None),
        ("layers.**.w", "layers.7.8.w", {}),
        ("**", "anything.at.all", {}),
        ("**.bias", "a.b.c.bias", {}),
        ("**.bias", "a.b.c.weight", None),
        # several captures
        ("blk.{i}.{name}.{p}", "blk.0.attn.weight", {"i": "0", "name": "attn", "p": "weight"}),
        # literal characters that are regex-special are literal
        ("a+b.(c)", "a+b.(c)", {}),
        ("a+b.(c)", "aab.(c)", None),
        ("w.weight", "wxweight", None),
    ],
)
def test_match(pattern, key, expected):
    assert compile_pattern(pattern).match(key) == expected


@pytest.mark.parametrize(
    "pattern, key",
    [
        ("layers.{i}.wq.weight", "model.layers.0.wq.weight"),  # no match as a suffix
        ("layers.{i}.wq.weight", "layers.0.wq.weight_scale"),  # no match as a prefix
        ("layers.{i}.wq.weight", "layers.0.wq.weight\n"),  # \Z, not $: no trailing newline
        ("w", "xw"),
        ("w", "wx"),
        ("*", "a.b"),
    ],
)
def test_anchored_on_whole_keys(pattern, key):
    assert compile_pattern(pattern).match(key) is None


def test_literal_flag_and_cache():
    assert compile_pattern("a.b.weight").is_literal
    assert not compile_pattern("a.*.weight").is_literal
    assert not compile_pattern("a.{i}.weight").is_literal
    assert compile_pattern("a.{i}") is compile_pattern("a.{i}")
    assert compile_pattern("x.{a}.{b:int}.{c:*}").names == ("a", "b", "c")


def test_format_output():
    p = compile_pattern("layers.{i}.attention.{w}.weight")
    assert p.format({"i": "5", "w": "wq"}) == "layers.5.attention.wq.weight"
    # typed placeholders format the same way
    assert compile_pattern("x.{i:int}.{rest:*}").format({"i": "2", "rest": "a.b"}) == "x.2.a.b"
    # extra captures are ignored
    assert compile_pattern("y.{i}").format({"i": "1", "j": "2"}) == "y.1"


def test_round_trip_match_then_format():
    inp = compile_pattern("model.layers.{i:int}.self_attn.{proj}.weight")
    out = compile_pattern("layers.{i}.attention.{proj}.weight")
    caps = inp.match("model.layers.17.self_attn.q_proj.weight")
    assert out.format(caps) == "layers.17.attention.q_proj.weight"


@pytest.mark.parametrize(
    "bad",
    [
        "layers.{i.w",
        "layers.i}.w",
        "layers.{}.w",
        "layers.{1x}.w",
        "layers.{i:float}.w",
        "{i",
        "}",
        # a bad brace before a valid capture is caught too (it was compiled as a literal)
        "layers.{i:float}.{j}",
        "a.{x.{i}",
        "a}.{i}",
    ],
)
def test_unbalanced_or_invalid_braces(bad):
    with pytest.raises(AdapterError, match="braces") as e:
        KeyPattern(bad)
    assert repr(bad) in str(e.value)


@pytest.mark.parametrize("bad", ["", None, 3])
def test_empty_or_non_string(bad):
    with pytest.raises(AdapterError, match="non-empty string"):
        KeyPattern(bad)


def test_same_capture_twice():
    with pytest.raises(AdapterError, match=r"captures \{i\} twice"):
        KeyPattern("a.{i}.b.{i}")


def test_output_needs_uncaptured_name():
    with pytest.raises(AdapterError, match=r"\{j\}.*do not capture"):
        check_output_pattern("layers.{i}.w", "layers.{j}.w")
    with pytest.raises(AdapterError, match=r"\{j\}.*does not capture"):
        compile_pattern("layers.{j}.w").format({"i": "0"})
    # captures from any of several inputs count
    check_output_pattern(["a.{i}", "b.{i}"], "c.{i}")


@pytest.mark.parametrize("out", ["layers.*.w", "layers.**.w"])
def test_output_may_not_have_wildcards(out):
    with pytest.raises(AdapterError, match="may not contain"):
        check_output_pattern("layers.{i}.w", out)
    with pytest.raises(AdapterError, match="may not contain"):
        compile_pattern(out).format({})


def test_matches_any():
    assert matches_any(["a.*", "b.{i}.c"], "b.3.c")
    assert not matches_any(["a.*", "b.{i}.c"], "b.3.d")
    assert not matches_any([], "x")


_PIECES = st.sampled_from(["a", "b", "0", "12", "{i}", "{j:int}", "{r:*}", "*", "**"])
_KEY_SEGMENTS = st.sampled_from(["a", "b", "0", "12", "a0", "x.y"])


@given(st.lists(st.lists(_PIECES, min_size=1, max_size=4).map(".".join), max_size=4), st.lists(_KEY_SEGMENTS, min_size=1, max_size=5))
def test_matches_any_is_any_single_match_even_with_shared_capture_names(texts, segments):
    """One regex for a list of patterns (their captures anonymous: two patterns may both
    capture ``{i}``) matches exactly the keys one of them matches."""
    key = ".".join(segments)
    try:
        pats = [compile_pattern(t) for t in texts]
    except AdapterError:  # a pattern that captures one name twice
        return
    assert matches_any(texts, key) == any(p.match(key) is not None for p in pats)


def test_inverse_keeps_capture_types():
    """An output placeholder takes its input capture's type, so the inverse matches the same keys."""
    from sdadapt.rules._patterns import typed_like

    assert typed_like("transformer.h.{i}.{rest}", "h.{i:int}.{rest:*}") == "transformer.h.{i:int}.{rest:*}"
    inv = sdadapt.Adapter([sdadapt.rename("h.{i}.{rest:*}", "transformer.h.{i}.{rest}")]).inverse()
    assert inv.rules[0].src == "transformer.h.{i}.{rest:*}"
    from sdadapt.rules._patterns import compile_pattern

    assert compile_pattern(inv.rules[0].src).match("transformer.h.3.attn.c_attn.weight") == {
        "i": "3",
        "rest": "attn.c_attn.weight",
    }
