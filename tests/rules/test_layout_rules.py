"""Layout rules of issue 3: transpose, rotary, stack/unstack, pad/trim, interleave, prefixes.

Every node is checked with hypothesis on random shapes and boxes: ``read(box)`` equals
``full()[box]`` bit-exactly and reads no more than it should (the box's volume for box-to-box
maps and interleave; whole heads for rotary; only the real rows for pad). Every rule is
checked against an independent computation with plain torch ops written here, and
``adapter.inverse()`` planned on the outputs gives back the source tensors bit-exactly.
"""

from __future__ import annotations

import itertools
import math
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.checkpoints import DictIO

import sdadapt
from sdadapt._base.schema import MeshDim, TensorInfo
from sdadapt._plan.plan import build_plan
from sdadapt._recipes import interleave as interleave_module
from sdadapt._recipes import moves as MV
from sdadapt._recipes import nodes as N
from sdadapt._recipes.interleave import Interleaved
from sdadapt.errors import AdapterError
from sdadapt.rules import rotary_perm, tp_degree
from sdadapt.rules._base import unwrap_key

SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.float16]


def _tensor(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1000, 1000, tuple(shape), generator=g).to(dtype)


@st.composite
def boxes(draw, shape):
    out = []
    for n in shape:
        a = draw(st.integers(0, n))
        b = draw(st.integers(a, n))
        out.append((a, b))
    return tuple(out)


def _volume(box, itemsize):
    return math.prod(b - a for a, b in box) * itemsize


def _check_reads(node, io, data, exact=True, bound=None):
    """read(box) == full()[box] for a few random boxes; bytes read == box volume (or <= bound)."""
    full = node.full(io)
    assert tuple(full.shape) == node.shape and full.dtype == node.dtype
    for _ in range(4):
        box = data.draw(boxes(node.shape))
        io.bytes_read = 0
        got = node.read(box, io)
        want = full[tuple(slice(a, b) for a, b in box)]
        assert got.dtype == want.dtype and got.shape == want.shape, (box, got.shape, want.shape)
        assert torch.equal(got, want), box
        if exact:
            assert io.bytes_read == _volume(box, full.element_size()), (box, io.bytes_read)
        if bound is not None:
            assert io.bytes_read <= bound(box), (box, io.bytes_read, bound(box))
    return full


# --- nodes: read(box) == full()[box] -----------------------------------------------------------


@SETTINGS
@given(data=st.data())
def test_transpose_node(data):
    nd = data.draw(st.integers(2, 4))
    shape = data.draw(st.lists(st.integers(1, 5), min_size=nd, max_size=nd))
    d0, d1 = data.draw(st.integers(0, nd - 1)), data.draw(st.integers(0, nd - 1))
    dtype = data.draw(st.sampled_from(DTYPES))
    t = _tensor(shape, dtype, data.draw(st.integers(0, 99)))
    io = DictIO({"x": t})
    node = MV.Transposed(N.Leaf("x", tuple(shape), dtype), d0, d1)
    full = _check_reads(node, io, data)
    assert torch.equal(full, t.transpose(d0, d1))


@SETTINGS
@given(data=st.data())
def test_rotary_node_reads_whole_heads_only(data):
    heads = data.draw(st.integers(1, 4))
    hd = 2 * data.draw(st.integers(1, 4))
    nd = data.draw(st.integers(1, 3))
    dim = data.draw(st.integers(0, nd - 1))
    shape = data.draw(st.lists(st.integers(1, 4), min_size=nd, max_size=nd))
    shape[dim] = heads * hd
    to = data.draw(st.sampled_from(["half", "interleaved"]))
    dtype = data.draw(st.sampled_from(DTYPES))
    t = _tensor(shape, dtype, data.draw(st.integers(0, 99)))
    io = DictIO({"x": t})
    rd = 2 * data.draw(st.integers(1, hd // 2))  # partial rotary: the first rd rows of each head rotate
    node = MV.UnitPermuted(N.Leaf("x", tuple(shape), dtype), dim, hd, rotary_perm(hd, to, rd))

    def whole_heads(box):
        a, b = box[dim]
        if a >= b:
            return 0
        rows = (-(-b // hd) - a // hd) * hd
        return math.prod((rows if i == dim else hi - lo) for i, (lo, hi) in enumerate(box)) * t.element_size()

    full = _check_reads(node, io, data, exact=False, bound=whole_heads)
    # independent: HF's conversion script (Meta -> HF) and its inverse, on dim moved to the front
    w = t.movedim(dim, 0).reshape(heads, hd, -1)
    rot, rest = w[:, :rd], w[:, rd:]
    if to == "half":
        rot = rot.reshape(heads, rd // 2, 2, -1).transpose(1, 2).reshape(rot.shape)
    else:
        rot = rot.reshape(heads, 2, rd // 2, -1).transpose(1, 2).reshape(rot.shape)
    ref = torch.cat([rot, rest], 1)
    moved = t.movedim(dim, 0).shape
    assert torch.equal(full, ref.reshape(moved).movedim(0, dim))


@SETTINGS
@given(data=st.data())
def test_stack_and_select_nodes(data):
    nd = data.draw(st.integers(0, 3))
    shape = tuple(data.draw(st.lists(st.integers(1, 4), min_size=nd, max_size=nd)))
    e = data.draw(st.integers(1, 4))
    dim = data.draw(st.integers(0, nd))
    dtype = data.draw(st.sampled_from(DTYPES))
    seed = data.draw(st.integers(0, 99))
    parts = {f"e{i}": _tensor(shape, dtype, seed + i) for i in range(e)}
    io = DictIO(parts)
    node = MV.Stacked(tuple(N.Leaf(k, shape, dtype) for k in parts), dim)
    full = _check_reads(node, io, data)
    assert torch.equal(full, torch.stack(list(parts.values()), dim))
    # select (unstack) of a stacked source tensor
    io2 = DictIO({"s": full})
    for i in range(e):
        sel = MV.Selected(N.Leaf("s", tuple(full.shape), dtype), dim, i)
        assert torch.equal(_check_reads(sel, io2, data), parts[f"e{i}"])


@SETTINGS
@given(data=st.data())
def test_pad_node_reads_only_real_rows(data):
    nd = data.draw(st.integers(1, 3))
    dim = data.draw(st.integers(0, nd - 1))
    shape = data.draw(st.lists(st.integers(1, 4), min_size=nd, max_size=nd))
    size = shape[dim] + data.draw(st.integers(0, 5))
    value = data.draw(st.sampled_from([0.0, -1.0, 7.0]))
    dtype = data.draw(st.sampled_from(DTYPES))
    t = _tensor(shape, dtype, data.draw(st.integers(0, 99)))
    io = DictIO({"x": t})
    node = MV.Padded(N.Leaf("x", tuple(shape), dtype), dim, size, value)
    n = shape[dim]

    def real(box):
        a, b = box[dim]
        rows = max(0, min(b, n) - a)
        return math.prod((rows if i == dim else hi - lo) for i, (lo, hi) in enumerate(box)) * t.element_size()

    full = _check_reads(node, io, data, exact=False, bound=real)
    extra = list(shape)
    extra[dim] = size - n
    assert torch.equal(full, torch.cat([t, torch.full(extra, value, dtype=dtype)], dim))


def _interleave_ref(t, sizes, tp, dim):
    parts = t.split(sizes, dim)
    return torch.cat([p.chunk(tp, dim)[r] if p.shape[dim] else p for r in range(tp) for p in parts], dim)


@SETTINGS
@given(data=st.data())
def test_interleave_node_reads_exactly_the_box(data):
    tp = data.draw(st.integers(1, 4))
    sizes = [tp * s for s in data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=4))]
    if sum(sizes) == 0:
        sizes[0] = tp
    nd = data.draw(st.integers(1, 3))
    dim = data.draw(st.integers(0, nd - 1))
    shape = data.draw(st.lists(st.integers(1, 3), min_size=nd, max_size=nd))
    shape[dim] = sum(sizes)
    dtype = data.draw(st.sampled_from(DTYPES))
    t = _tensor(shape, dtype, data.draw(st.integers(0, 99)))
    # blocks read one by one (exactly the box), or picked out of covering reads (every block
    # here is deemed short): at most (number of parts) x the box, in few computations
    pick = data.draw(st.booleans())
    parts = sum(1 for s in sizes if s)
    itemsize = t.element_size()
    reads = {"exact": not pick, "bound": (lambda box: parts * _volume(box, itemsize)) if pick else None}
    with mock.patch.object(interleave_module, "PICK_ROWS", 100 if pick else 0):
        io = DictIO({"x": t})
        fwd = Interleaved(N.Leaf("x", tuple(shape), dtype), dim, tuple(sizes), tp)
        full = _check_reads(fwd, io, data, **reads)
        assert torch.equal(full, _interleave_ref(t, sizes, tp, dim))
        # each of tp equal slices along dim is [p0_r; p1_r; ...]
        for r, local in enumerate(full.chunk(tp, dim) if tp <= full.shape[dim] else []):
            assert torch.equal(local, torch.cat([p.chunk(tp, dim)[r] for p in t.split(sizes, dim) if p.shape[dim]], dim))
        io2 = DictIO({"y": full})
        back = Interleaved(N.Leaf("y", tuple(shape), dtype), dim, tuple(sizes), tp, inverse=True)
        assert torch.equal(_check_reads(back, io2, data, **reads), t)


@SETTINGS
@given(data=st.data())
def test_interleave_node_with_replicas(data):
    """Parts shared by several ranks (vLLM's KV heads fewer than TP): rank r's slice holds block
    r // replicas[p] of each part p, read exactly; the inverse takes each block back once."""
    tp = data.draw(st.sampled_from([2, 4, 8]))
    divisors = [n for n in (1, 2, 4, 8) if tp % n == 0]
    reps = data.draw(st.lists(st.sampled_from(divisors), min_size=1, max_size=3))
    sizes = [tp // n * data.draw(st.integers(1, 2)) for n in reps]
    nd = data.draw(st.integers(1, 2))
    dim = data.draw(st.integers(0, nd - 1))
    shape = data.draw(st.lists(st.integers(1, 3), min_size=nd, max_size=nd))
    shape[dim] = sum(sizes)
    dtype = data.draw(st.sampled_from(DTYPES))
    t = _tensor(shape, dtype, data.draw(st.integers(0, 99)))
    with mock.patch.object(interleave_module, "PICK_ROWS", 0):
        fwd = Interleaved(N.Leaf("x", tuple(shape), dtype), dim, tuple(sizes), tp, replicas=tuple(reps))
        full = _check_reads(fwd, DictIO({"x": t}), data)
        parts = t.split(sizes, dim)
        for r, local in enumerate(full.chunk(tp, dim)):
            want = torch.cat([p.chunk(tp // n, dim)[r // n] for p, n in zip(parts, reps, strict=True)], dim)
            assert torch.equal(local, want), r
        back = Interleaved(N.Leaf("y", tuple(full.shape), dtype), dim, tuple(sizes), tp, inverse=True, replicas=tuple(reps))
        assert torch.equal(_check_reads(back, DictIO({"y": full}), data), t)


def test_interleave_rule_with_replicas() -> None:
    """vLLM's qkv with 2 KV heads on TP 4: each KV head on two ranks; the inverse gives q/k/v
    back; replicas that do not divide the degree are refused naming the rule."""
    q, k, v = (torch.arange(n * 3, dtype=torch.float32).reshape(n, 3) + 100 * i for i, n in enumerate((8, 4, 4)))
    adapter = sdadapt.Adapter([sdadapt.fuse(["q", "k", "v"], "qkv", sizes=[8, 4, 4]),
                               sdadapt.interleave("qkv", [8, 4, 4], tp=4, replicas=[1, 2, 2])])  # fmt: skip
    want = torch.cat([torch.cat([q[2 * r : 2 * r + 2], k[r // 2 * 2 : r // 2 * 2 + 2], v[r // 2 * 2 : r // 2 * 2 + 2]]) for r in range(4)])
    _run(adapter, {"q": q, "k": k, "v": v}, {"qkv": want})
    with pytest.raises(sdadapt.errors.AdapterError, match="replicas"):
        sdadapt.interleave("qkv", [8, 4, 4], tp=4, replicas=[1, 3, 3])


# --- rules through build_plan: independent expectations, inverse identity ----------------------


def _run(adapter, src, target_tensors):
    """Plan src -> target (ok, exact shapes/dtypes), compare full() with the expectation; then
    plan the inverse on the outputs and get src back. Returns both plans."""
    io = DictIO(src)
    target = {k: TensorInfo(tuple(v.shape), v.dtype) for k, v in target_tensors.items()}
    plan = build_plan(io.schema(), target, adapter)
    assert plan.report.ok, plan.report.format()
    for k, want in target_tensors.items():
        got = plan.recipes[k].full(io)
        assert got.dtype == want.dtype and torch.equal(got, want), k
    back_io = DictIO({k: plan.recipes[k].full(io) for k in target_tensors})
    inv = adapter.inverse()
    back = build_plan(back_io.schema(), io.schema(), inv)
    assert back.report.ok, back.report.format()
    for k, t in src.items():
        assert torch.equal(back.recipes[k].full(back_io), t), k
    # serialisable both ways
    assert sdadapt.Adapter.from_json(adapter.to_json()) == adapter
    assert sdadapt.Adapter.from_json(inv.to_json()) == inv
    return plan, back


@SETTINGS
@given(data=st.data())
def test_rules_forward_and_inverse(data):
    seed = data.draw(st.integers(0, 10_000))
    dtype = data.draw(st.sampled_from(DTYPES))
    layers = data.draw(st.integers(1, 2))
    heads, kv = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 2))
    hd = 2 * data.draw(st.integers(1, 3))
    dim = data.draw(st.integers(1, 5))
    experts = data.draw(st.integers(1, 4))
    stack_dim = data.draw(st.integers(-3, 2))
    vocab = data.draw(st.integers(1, 9))
    multiple = data.draw(st.integers(1, 4))
    tp = data.draw(st.integers(1, 3))
    parts = [tp * data.draw(st.integers(1, 2)) for _ in range(3)]
    prefix = data.draw(st.sampled_from(["", "model.", "_orig_mod.model."]))
    src: dict[str, torch.Tensor] = {}
    want: dict[str, torch.Tensor] = {}
    s = itertools.count(seed)
    for i in range(layers):
        q = _tensor((heads * hd, dim), dtype, next(s))
        k = _tensor((kv * hd, dim), dtype, next(s))
        src[f"{prefix}layers.{i}.q.weight"], src[f"{prefix}layers.{i}.k.weight"] = q, k
        want[f"layers.{i}.wq.weight"] = q.view(heads, 2, hd // 2, dim).transpose(1, 2).reshape(q.shape)
        want[f"layers.{i}.wk.weight"] = k.view(kv, 2, hd // 2, dim).transpose(1, 2).reshape(k.shape)
        ex = [_tensor((dim, 3), dtype, next(s)) for _ in range(experts)]
        for e, x in enumerate(ex):
            src[f"{prefix}layers.{i}.experts.{e}.w1"] = x
        want[f"layers.{i}.moe.w1"] = torch.stack(ex, stack_dim)
        c = _tensor((dim, 2 * dim), dtype, next(s))
        src[f"{prefix}layers.{i}.c_fc.weight"] = c
        want[f"layers.{i}.c_fc.weight"] = c.t().contiguous()
        qkv = _tensor((sum(parts), 2), dtype, next(s))
        src[f"{prefix}layers.{i}.qkv.weight"] = qkv
        want[f"layers.{i}.qkv.weight"] = _interleave_ref(qkv, parts, tp, 0)
    emb = _tensor((vocab, dim), dtype, next(s))
    src[f"{prefix}emb.weight"] = emb
    padded = -(-vocab // multiple) * multiple
    want["emb.weight"] = torch.cat([emb, torch.zeros(padded - vocab, dim, dtype=dtype)])
    rules = [sdadapt.strip_prefix("model.")] if "model." in prefix else []
    rules += [
        sdadapt.rename("layers.{i}.q.weight", "layers.{i}.wq.weight"),
        sdadapt.rename("layers.{i}.k.weight", "layers.{i}.wk.weight"),
        sdadapt.rotary("layers.{i}.wq.weight", heads),
        sdadapt.rotary("layers.{i}.wk.weight", kv),
        sdadapt.stack("layers.{i}.experts.{e}.w1", "layers.{i}.moe.w1", dim=stack_dim, count=experts),
        sdadapt.transpose("layers.{i}.c_fc.weight"),
        sdadapt.interleave("layers.{i}.qkv.weight", parts, tp=tp),
        sdadapt.pad("emb.weight", multiple_of=multiple),
    ]
    adapter = sdadapt.Adapter(rules, name="layout")
    # the inverse maps back to the unwrapped names (the _orig_mod. segment is not restored)
    src_clean = {unwrap_key(k): v for k, v in src.items()}
    if prefix.startswith("_orig_mod."):
        io = DictIO(src)
        target = {k: TensorInfo(tuple(v.shape), v.dtype) for k, v in want.items()}
        plan = build_plan(io.schema(), target, adapter)
        assert plan.report.ok, plan.report.format()
        for k, v in want.items():
            assert torch.equal(plan.recipes[k].full(io), v), k
    _run(adapter, src_clean, want)


def test_rotary_matches_meta_and_hf_rope():
    """HF's q/k with rotate_half RoPE give the same attention scores as Meta's interleaved
    (complex) RoPE on the weights converted by rotary(to="interleaved"); GQA with 2 kv heads."""
    torch.manual_seed(0)
    dim, heads, kv, hd, seq = 24, 4, 2, 6, 5
    wq, wk = torch.randn(heads * hd, dim, dtype=torch.float64), torch.randn(kv * hd, dim, dtype=torch.float64)
    io = DictIO({"wq": wq, "wk": wk})
    a = sdadapt.Adapter([sdadapt.rotary("wq", heads), sdadapt.rotary("wk", kv)])
    plan = build_plan(io.schema(), io.schema(), a)
    mq, mk = plan.recipes["wq"].full(io), plan.recipes["wk"].full(io)
    x = torch.randn(seq, dim, dtype=torch.float64)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    freqs = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq)  # [seq, hd/2]

    def hf(w, n):  # transformers: cat(freqs, freqs), x * cos + rotate_half(x) * sin
        y = (x @ w.T).view(seq, n, hd).transpose(0, 1)
        emb = torch.cat([freqs, freqs], -1)
        half = torch.cat([-y[..., hd // 2 :], y[..., : hd // 2]], -1)
        return y * emb.cos() + half * emb.sin()

    def meta(w, n):  # Meta: view_as_complex of row pairs times polar(1, freqs)
        y = (x @ w.T).view(seq, n, hd // 2, 2)
        z = torch.view_as_complex(y.contiguous()) * torch.polar(torch.ones_like(freqs), freqs)[:, None, :]
        return torch.view_as_real(z).reshape(seq, n, hd).transpose(0, 1)

    rep = heads // kv
    s_hf = hf(wq, heads) @ hf(wk, kv).repeat_interleave(rep, 0).transpose(-1, -2)
    s_meta = meta(mq, heads) @ meta(mk, kv).repeat_interleave(rep, 0).transpose(-1, -2)
    assert torch.allclose(s_hf, s_meta, rtol=1e-12, atol=1e-12)
    # the other direction does not match (guards against an inverted permutation)
    wrong = sdadapt.Adapter([sdadapt.rotary("wq", heads, to="half"), sdadapt.rotary("wk", kv, to="half")])
    wp = build_plan(io.schema(), io.schema(), wrong)
    s_wrong = meta(wp.recipes["wq"].full(io), heads) @ meta(wp.recipes["wk"].full(io), kv).repeat_interleave(
        rep, 0
    ).transpose(-1, -2)
    assert not torch.allclose(s_hf, s_wrong)


def test_partial_rotary_matches_hf_partial_rope():
    """Partial rotary (``partial_rotary_factor``): HF rotates the first ``rotary_dim`` rows of each
    head with rotate_half and passes the rest; Meta's complex RoPE on the same rows of the weights
    converted by ``rotary(..., rotary_dim=)`` gives the same scores. The fraction and the row
    count are the same rule; the inverse gives the checkpoint back; whole-head rotary is wrong here."""
    torch.manual_seed(0)
    dim, heads, hd, rd, seq = 16, 3, 8, 4, 5
    wq = torch.randn(heads * hd, dim, dtype=torch.float64)
    bias = torch.randn(heads * hd, dtype=torch.float64)
    io = DictIO({"wq": wq, "bq": bias})
    x = torch.randn(seq, dim, dtype=torch.float64)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd))
    freqs = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq)  # [seq, rd/2]

    def hf(w, b):  # transformers (Phi, StableLM, GPT-NeoX): rotate_half on q[..., :rd], the rest passes
        y = (x @ w.T + b).view(seq, heads, hd).transpose(0, 1)
        rot, rest = y[..., :rd], y[..., rd:]
        emb = torch.cat([freqs, freqs], -1)
        half = torch.cat([-rot[..., rd // 2 :], rot[..., : rd // 2]], -1)
        return torch.cat([rot * emb.cos() + half * emb.sin(), rest], -1)

    def meta(w, b):  # complex RoPE on interleaved pairs of the first rd rows
        y = (x @ w.T + b).view(seq, heads, hd)
        pairs = y[..., :rd].reshape(seq, heads, rd // 2, 2)
        z = torch.view_as_complex(pairs.contiguous()) * torch.polar(torch.ones_like(freqs), freqs)[:, None, :]
        return torch.cat([torch.view_as_real(z).reshape(seq, heads, rd), y[..., rd:]], -1).transpose(0, 1)

    want = hf(wq, bias) @ hf(wq, bias).transpose(-1, -2)
    for rotary_dim in (rd, rd / hd):
        a = sdadapt.Adapter([sdadapt.rotary(["wq", "bq"], heads, rotary_dim=rotary_dim)])
        plan = build_plan(io.schema(), io.schema(), a)
        mq, mb = plan.recipes["wq"].full(io), plan.recipes["bq"].full(io)
        got = meta(mq, mb) @ meta(mq, mb).transpose(-1, -2)
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12), rotary_dim
        assert torch.equal(mq.view(heads, hd, dim)[:, rd:], wq.view(heads, hd, dim)[:, rd:])  # the rest stays
        back = build_plan(DictIO({"wq": mq, "bq": mb}).schema(), io.schema(), a.inverse())
        assert torch.equal(back.recipes["wq"].full(DictIO({"wq": mq, "bq": mb})), wq)
        assert sdadapt.Adapter.from_json(a.to_json()) == a
        assert "rotary_dim=4" in plan.recipes["wq"].describe()
    whole = build_plan(io.schema(), io.schema(), sdadapt.Adapter([sdadapt.rotary(["wq", "bq"], heads)]))
    wm, wb = whole.recipes["wq"].full(io), whole.recipes["bq"].full(io)
    assert not torch.allclose(meta(wm, wb) @ meta(wm, wb).transpose(-1, -2), want)
    # rows that do not fit: an issue naming the key, or an error at once
    bad = build_plan(io.schema(), io.schema(), sdadapt.Adapter([sdadapt.rotary("wq", heads, rotary_dim=0.3)]))
    assert any("not a whole number" in i.message for i in bad.report.rule_issues), bad.report.format()
    with pytest.raises(AdapterError, match="even row count"):
        sdadapt.rotary("wq", heads, rotary_dim=3)
    with pytest.raises(AdapterError, match=r"in \(0, 1\]"):
        sdadapt.rotary("wq", heads, rotary_dim=1.5)
    with pytest.raises(AdapterError, match="at most the head"):
        sdadapt.rotary("wq", head_dim=4, rotary_dim=8)


def test_unstack_and_trim_with_explicit_sizes():
    t = _tensor((3, 4, 2), torch.float32, 1)
    emb = _tensor((8, 2), torch.float32, 2)
    a = sdadapt.Adapter(
        [
            sdadapt.unstack("l.{i}.experts", "l.{i}.experts.{e}.w", dim=1, count=4),
            sdadapt.trim("emb", size=5),
        ]
    )
    want = {f"l.0.experts.{e}.w": t[:, e] for e in range(4)} | {"emb": emb[:5]}
    io = DictIO({"l.0.experts": t, "emb": emb})
    plan = build_plan(io.schema(), {k: TensorInfo(tuple(v.shape), v.dtype) for k, v in want.items()}, a)
    assert plan.report.ok, plan.report.format()
    for k, v in want.items():
        assert torch.equal(plan.recipes[k].full(io), v)
    # the inverse pads back to the model's (here: the source's) size with zeros
    inv = build_plan(DictIO(want).schema(), io.schema(), a.inverse())
    assert inv.report.ok, inv.report.format()
    assert torch.equal(inv.recipes["l.0.experts"].full(DictIO(want)), t)
    assert inv.recipes["emb"].shape == (8, 2)


def test_pad_to_target_size_and_value():
    emb = _tensor((5, 3), torch.bfloat16, 3)
    io = DictIO({"emb": emb})
    plan = build_plan(io.schema(), {"emb": TensorInfo((8, 3), torch.bfloat16)}, sdadapt.Adapter([sdadapt.pad("emb", value=-2.0)]))
    assert plan.report.ok
    out = plan.recipes["emb"].full(io)
    assert torch.equal(out[:5], emb) and bool((out[5:] == -2).all())
    assert "pad(emb" in plan.recipes["emb"].describe()


def test_interleave_tp_from_target_placements_and_deinterleave_from_source():
    qkv = _tensor((12, 2), torch.float32, 4)
    io = DictIO({"qkv": qkv})
    mesh = (MeshDim("fsdp", 2, "_StridedShard(dim=0, sf=2)", 0, True), MeshDim("tp", 2, "Shard(dim=0)", 0))
    info = TensorInfo((12, 2), torch.float32, "(...)", mesh)
    plan = build_plan(io.schema(), {"qkv": info}, sdadapt.Adapter([sdadapt.interleave("qkv", [4, 4, 4])]))
    assert plan.report.ok, plan.report.format()
    assert torch.equal(plan.recipes["qkv"].full(io), _interleave_ref(qkv, [4, 4, 4], 2, 0))
    # export: the source is the parallelised model's schema, so deinterleave finds tp=2 there
    out = plan.recipes["qkv"].full(io)
    back = build_plan({"qkv": info}, io.schema(), sdadapt.Adapter([sdadapt.interleave("qkv", [4, 4, 4])]).inverse())
    assert back.report.ok, back.report.format()
    assert torch.equal(back.recipes["qkv"].full(DictIO({"qkv": out})), qkv)
    # a plain target tensor (no TP): nothing moves
    plain = build_plan(io.schema(), io.schema(), sdadapt.Adapter([sdadapt.interleave("qkv", [4, 4, 4])]))
    assert plain.report.ok and isinstance(plain.recipes["qkv"], N.Leaf)


def test_tp_degree():
    shape = (12, 4)
    t = lambda *dims: TensorInfo(shape, torch.float32, "(..)", tuple(dims))  # noqa: E731
    assert tp_degree(TensorInfo(shape, torch.float32), 0) == 1
    assert tp_degree(t(MeshDim("fsdp", 2, "S", 0, True), MeshDim("tp", 2, "S", 0)), 0) == 2
    assert tp_degree(t(MeshDim("dp", 2, "S", 0), MeshDim("tp", 3, "S", 1)), 0) == 1
    assert tp_degree(t(MeshDim("dp", 2, "S", 0), MeshDim("tp", 3, "S", 1)), 1) == 3
    assert tp_degree(t(MeshDim("dp_shard", 4, "S", 0)), 0) == 1
    assert tp_degree(t(MeshDim("tp", 4, "R", None)), 0) == 1
    msg = tp_degree(t(MeshDim(None, 2, "Shard(dim=0)", 0)), 0)
    assert isinstance(msg, str) and "unnamed mesh dim 0" in msg and "tp=" in msg
    msg = tp_degree(t(MeshDim("weird", 2, "Shard(dim=0)", 0)), 0)
    assert isinstance(msg, str) and "'weird'" in msg


# --- bad input: plan-time issues naming the rule, the key and the numbers ------------------------


def _issues(src_shapes, adapter, target=None):
    io = DictIO({k: torch.zeros(s) for k, s in src_shapes.items()})
    plan = build_plan(io.schema(), target if target is not None else {}, adapter)
    assert io.bytes_read == 0
    return [f"{i.rule} {i.key}: {i.message}" for i in plan.report.rule_issues], plan.report


@pytest.mark.parametrize(
    "shapes, rule, needles",
    [
        ({"l.0.wq": (10, 4)}, sdadapt.rotary("l.{i}.wq", 4), ["l.0.wq", "10 rows", "heads=4", "rotary"]),
        ({"l.0.wq": (12, 4)}, sdadapt.rotary("l.{i}.wq", 4), ["l.0.wq", "head_dim 3", "odd"]),
        ({"l.0.wq": (12,)}, sdadapt.rotary("l.{i}.wq", 2, dim=1), ["dim 1 is out of range"]),
        ({"e.0.w": (2, 3), "e.2.w": (2, 3)}, sdadapt.stack("e.{e}.w", "w"), ["missing e=[1]"]),
        ({"e.0.w": (2, 3), "e.1.w": (2, 4)}, sdadapt.stack("e.{e}.w", "w"), ["'e.1.w' is [2, 4]"]),
        ({"e.0.w": (2, 3), "e.1.w": (2, 3)}, sdadapt.stack("e.{e}.w", "w", count=8), ["found 2 entries", "count=8"]),
        ({"e.x.w": (2, 3)}, sdadapt.stack("e.{e}.w", "w"), ["must be an integer", "'e.x.w'"]),
        ({"w": (4, 3)}, sdadapt.unstack("w", "e.{e}.w", count=8), ["has 4 entries", "count=8"]),
        ({"qkv": (10, 2)}, sdadapt.interleave("qkv", [4, 4, 4], tp=2), ["qkv", "add up to 12", "dim 0 has 10"]),
        ({"qkv": (12, 2)}, sdadapt.interleave("qkv", [4, 4, 4]), ["qkv", "pass tp="]),
        ({"emb": (9, 2)}, sdadapt.pad("emb", size=5), ["from 9 down to 5"]),
        ({"emb": (9, 2)}, sdadapt.pad("emb"), ["give size= or multiple_of="]),
        ({"emb": (9, 2)}, sdadapt.trim("emb", size=12), ["from 9 up to 12"]),
        ({"emb": (9, 2)}, sdadapt.trim("emb"), ["give size="]),
        ({"w": (9, 2)}, sdadapt.transpose("w", 0, 2), ["dim1 2 is out of range", "'w'"]),
    ],
)
def test_plan_time_issues(shapes, rule, needles):
    issues, report = _issues(shapes, sdadapt.Adapter([rule]))
    assert issues, report.format()
    text = "\n".join(issues)
    for n in needles:
        assert n in text, (n, text)
    assert not report.ok
    assert "rule problems" in report.format()


def test_interleave_issues_with_target():
    mesh = (MeshDim(None, 3, "Shard(dim=0)", 0),)
    issues, _ = _issues({"qkv": (12, 2)}, sdadapt.Adapter([sdadapt.interleave("qkv", [4, 4, 4])]),
                        {"qkv": TensorInfo((12, 2), torch.float32, "(Shard(dim=0),)", mesh)})  # fmt: skip
    assert any("unnamed mesh dim 0" in i for i in issues), issues
    mesh = (MeshDim("tp", 3, "Shard(dim=0)", 0),)
    issues, _ = _issues({"qkv": (12, 2)}, sdadapt.Adapter([sdadapt.interleave("qkv", [4, 4, 4])]),
                        {"qkv": TensorInfo((12, 2), torch.float32, "(Shard(dim=0),)", mesh)})  # fmt: skip
    assert any("do not all divide by the TP degree 3" in i for i in issues), issues


def test_bad_rule_arguments():
    with pytest.raises(AdapterError, match="must capture"):
        sdadapt.stack("e.{x}.w", "w")
    with pytest.raises(AdapterError, match="must not use"):
        sdadapt.stack("e.{e}.w", "w.{e}")
    with pytest.raises(AdapterError, match="every capture"):
        sdadapt.stack("l.{i}.e.{e}.w", "w")
    with pytest.raises(AdapterError, match="must capture"):
        sdadapt.unstack("w", "e.w")
    with pytest.raises(AdapterError, match="not both"):
        sdadapt.pad("w", size=4, multiple_of=2)
    with pytest.raises(AdapterError, match="divide by tp=2"):
        sdadapt.interleave("w", [4, 3], tp=2)
    with pytest.raises(AdapterError, match="literal text"):
        sdadapt.strip_prefix("model.{x}")
    with pytest.raises(AdapterError, match="invalid adapter rule .rotary."):
        sdadapt.rotary("w", 0)
    with pytest.raises(AdapterError, match="give heads= .* or head_dim="):
        sdadapt.rotary("w", None)


# --- prefixes -------------------------------------------------------------------------------------


def test_wrapper_segments_are_removed_before_rules():
    t = {
        "_orig_mod.layers.0._checkpoint_wrapped_module.attn.w": _tensor((2, 2), torch.float32, 1),
        "layers.1._checkpoint_wrapped_module.attn.w": _tensor((2, 2), torch.float32, 2),
        "_orig_mod.norm": _tensor((2,), torch.float32, 3),
        "_fsdp_wrapped_module.head": _tensor((2,), torch.float32, 4),
    }
    io = DictIO(t)
    target = {
        "layers.0.attn.w": TensorInfo((2, 2), torch.float32),
        "layers.1.attn.w": TensorInfo((2, 2), torch.float32),
        "final.norm": TensorInfo((2,), torch.float32),
        "head": TensorInfo((2,), torch.float32),
    }
    plan = build_plan(io.schema(), target, sdadapt.Adapter([sdadapt.rename("norm", "final.norm")]))
    assert plan.report.ok, plan.report.format()
    assert plan.recipes["layers.0.attn.w"].leaves() == ["_orig_mod.layers.0._checkpoint_wrapped_module.attn.w"]
    assert torch.equal(plan.recipes["final.norm"].full(io), t["_orig_mod.norm"])
    assert unwrap_key("_orig_mod") == "_orig_mod" and unwrap_key("a._orig_mod_x.b") == "a._orig_mod_x.b"


def test_wrapper_collision_is_reported_with_both_keys_unless_a_rule_takes_it():
    t = {"_orig_mod.w": torch.zeros(2), "w": torch.ones(2)}
    io = DictIO(t)
    target = {"w": TensorInfo((2,), torch.float32)}
    plan = build_plan(io.schema(), target)
    text = plan.report.format()
    assert not plan.report.ok
    assert "'_orig_mod.w' and 'w' both become 'w'" in text, text
    assert torch.equal(plan.recipes["w"].full(io), t["w"])  # the clean key keeps the name
    ok = build_plan(io.schema(), target, sdadapt.Adapter([sdadapt.drop("_orig_mod.w")]))
    assert ok.report.ok, ok.report.format()


def test_strip_prefix():
    t = {"model.a": torch.zeros(1), "model.b.c": torch.ones(1), "lm_head": torch.ones(3)}
    io = DictIO(t)
    target = {k: TensorInfo((1,), torch.float32) for k in ("a", "b.c")} | {"lm_head": TensorInfo((3,), torch.float32)}
    a = sdadapt.Adapter([sdadapt.strip_prefix("model.")])
    plan = build_plan(io.schema(), target, a)
    assert plan.report.ok, plan.report.format()
    assert plan.recipes["b.c"].leaves() == ["model.b.c"]
    # inverse puts the prefix on every key
    back = build_plan(DictIO({k: torch.zeros(s.shape) for k, s in target.items()}).schema(), {}, a.inverse())
    assert sorted(back.report.unexpected) == ["model.a", "model.b.c", "model.lm_head"]
    # a prefix that matches nothing is an unused rule, unless optional
    none = build_plan(io.schema(), {}, sdadapt.Adapter([sdadapt.strip_prefix("x.")]))
    assert none.report.unused_rules == ["#0 strip_prefix(prefix='x.', optional=False)"]
    opt = build_plan(io.schema(), {}, sdadapt.Adapter([sdadapt.strip_prefix("x.", optional=True)]))
    assert opt.report.unused_rules == []
    # strip + rename of the stripped names; renames that take prefixed keys first are no conflict
    a2 = sdadapt.Adapter([sdadapt.rename("lm_head", "output"), sdadapt.strip_prefix("model."), sdadapt.rename("b.c", "d")])
    p2 = build_plan(io.schema(), {"a": target["a"], "d": target["a"], "output": target["lm_head"]}, a2)
    assert p2.report.ok, p2.report.format()
