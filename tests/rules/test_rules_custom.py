"""Rules these families need, and rules of one's own.

- ``affine``: Gemma's ``1 + w`` norms; values bit-exact against the eager formula, its exact
  inverse, its effect on optimizer moments, refusals;
- ``rotary`` over several keys (weight, bias, per-head norm weight with ``head_dim=``) and
  ``interleave`` over a weight and its bias;
- user rule kinds: a :class:`sdadapt.rules.ValueRule` and a key-moving :class:`sdadapt.rules.RuleBase`
  subclass defined here, registered with :func:`sdadapt.rules.register_rule`, round-tripped through
  JSON and loaded (through the engine) on a 2-rank gloo FSDP2 mesh, bit-exactly.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any, Literal

import pytest
import torch
import torch.distributed as dist
from support.checkpoints import write_safetensors
from support.dist_helper import run_distributed
from torch import nn

import sdadapt
from sdadapt._plan.plan import build_plan
from sdadapt.errors import AdapterError
from sdadapt.sources import TensorInfo

# --- a user's node and rules (what the guide shows) ----------------------------------------------


@dataclass(frozen=True, eq=False)
class NegNode(sdadapt.rules.Node):
    """``-child`` (``factor`` times it when given): a user node with produce, full, describe."""

    child: sdadapt.rules.Node
    factor: float = -1.0
    shape: tuple[int, ...] = field(init=False)
    dtype: torch.dtype = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", self.child.shape)
        object.__setattr__(self, "dtype", self.child.dtype)

    def produce(self, box, dest, out):
        out.append(sdadapt.rules.Compute(self, box, dest, functools.partial(self._region, box)))

    def _region(self, box, io):
        return self.child.read(box, io) * self.factor

    def full(self, io):
        return self.child.full(io) * self.factor

    def describe(self):
        return f"{self.factor:g} * {self.child.describe()}"


@sdadapt.rules.register_rule
class Negate(sdadapt.rules.ValueRule):
    """Negate the matched tensors (its own inverse)."""

    kind: Literal["test_negate"] = "test_negate"

    def transform(self, key, node):
        if not node.dtype.is_floating_point:
            return f"{key!r} is {node.dtype}; negate wants a floating tensor"
        return NegNode(node)

    def inverse(self):
        return [Negate(keys=self.keys)]


@sdadapt.rules.register_rule
class ScaleInto(sdadapt.rules.RuleBase):
    """Key ``src`` becomes key ``dst``, multiplied by ``factor`` (a key-moving user rule)."""

    kind: Literal["test_scale_into"] = "test_scale_into"
    src: str
    dst: str
    factor: float

    def input_patterns(self):
        return [self.src]

    def apply(self, ctx, index):
        if ctx.has(self.src):
            node = ctx.take(self.src, index)
            ctx.put(self.dst, NegNode(node, self.factor), index, origin=self.src)

    def inverse(self):
        return [ScaleInto(src=self.dst, dst=self.src, factor=1 / self.factor)]

    def key_after(self, key):
        return self.dst if key == self.src else key


# --- a small model and its checkpoint in another layout -------------------------------------------

HEADS, HEAD_DIM, DIM = 3, 4, 16


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(DIM, HEADS * HEAD_DIM, bias=True)
        self.q_norm = nn.RMSNorm(HEAD_DIM)
        self.norm = nn.RMSNorm(DIM)
        self.w_neg = nn.Linear(DIM, 5, bias=False)  # 5 rows: uneven shards on 2 ranks
        self.out = nn.Linear(DIM, 6, bias=False)


def _checkpoint(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "q_proj.weight": torch.randn(HEADS * HEAD_DIM, DIM, generator=g),
        "q_proj.bias": torch.randn(HEADS * HEAD_DIM, generator=g),
        "q_norm.weight": torch.randn(HEAD_DIM, generator=g),
        "norm.weight": torch.randn(DIM, generator=g).to(torch.bfloat16).float(),
        "neg.weight": torch.randn(5, DIM, generator=g),
        "o_src.weight": torch.randn(6, DIM, generator=g),
    }


def _adapter() -> sdadapt.Adapter:
    return sdadapt.Adapter(
        [
            sdadapt.rename("q_proj.{p}", "wq.{p}"),
            sdadapt.rotary(["wq.weight", "wq.bias", "q_norm.weight"], head_dim=HEAD_DIM),
            sdadapt.affine("norm.weight", shift=1.0),
            sdadapt.rename("neg.weight", "w_neg.weight"),
            Negate(keys="w_neg.weight"),
            ScaleInto(src="o_src.weight", dst="out.weight", factor=2.0),
        ],
        name="small",
    )


def _half_to_interleaved(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """HF "half" rows -> Meta interleaved rows, per head, written as HF's conversion script
    (independent of sdadapt's permutation table)."""
    rest = t.shape[1:]
    heads = t.shape[0] // head_dim
    return t.reshape(heads, 2, head_dim // 2, *rest).transpose(1, 2).reshape(t.shape)


def _expected(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        "wq.weight": _half_to_interleaved(sd["q_proj.weight"], HEAD_DIM),
        "wq.bias": _half_to_interleaved(sd["q_proj.bias"], HEAD_DIM),
        "q_norm.weight": _half_to_interleaved(sd["q_norm.weight"], HEAD_DIM),
        "norm.weight": sd["norm.weight"] + 1.0,
        "w_neg.weight": -sd["neg.weight"],
        "out.weight": sd["o_src.weight"] * 2.0,
    }


def _loaded(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in model.state_dict().items():
        out[k] = v.full_tensor() if hasattr(v, "full_tensor") else v
    return out


def test_user_rules_plan_load_and_round_trip_json(tmp_path):
    sd = _checkpoint()
    path = write_safetensors(tmp_path / "ckpt.safetensors", sd)
    adapter = _adapter()
    text = adapter.to_json()
    back = sdadapt.Adapter.from_json(text)
    assert back == adapter
    assert [type(r) for r in back.rules][-2:] == [Negate, ScaleInto]
    report = sdadapt.diff(Small(), path, back)
    assert report.ok, report.format()
    model = Small()
    sdadapt.load(model, path, back)
    want = _expected(sd)
    got = _loaded(model)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    # the inverse maps the model's layout back to the checkpoint's, bit-exactly here
    exported = tmp_path / "back.safetensors"
    sdadapt.convert(path, str(tmp_path / "model.safetensors"), adapter, "safetensors")
    sdadapt.convert(str(tmp_path / "model.safetensors"), str(exported), adapter.inverse(), "safetensors")
    with sdadapt.sources.open_source(exported) as src:
        for k, v in sd.items():
            assert torch.equal(src.read(k, tuple((0, n) for n in v.shape)), v), k


def test_unregistered_and_clashing_kinds_are_refused():
    data = '{"rules": [{"kind": "test_nobody", "keys": "x"}]}'
    with pytest.raises(AdapterError, match=r"rule #0: unknown rule kind 'test_nobody'.*register_rule"):
        sdadapt.Adapter.from_json(data)

    class Other(sdadapt.rules.ValueRule):
        kind: Literal["test_negate"] = "test_negate"

    with pytest.raises(AdapterError, match="taken by .*Negate"):
        sdadapt.rules.register_rule(Other)

    class NoKind(sdadapt.rules.ValueRule):
        pass

    with pytest.raises(AdapterError, match="needs a kind field"):
        sdadapt.rules.register_rule(NoKind)


def test_user_value_rule_reports_what_it_cannot_do(tmp_path):
    path = write_safetensors(tmp_path / "i.safetensors", {"w_neg.weight": torch.arange(5 * DIM).reshape(5, DIM)})
    report = sdadapt.diff({"w_neg.weight": TensorInfo((5, DIM), torch.int64)}, path, sdadapt.Adapter([Negate(keys="w_neg.weight")]))
    assert not report.ok
    assert "negate wants a floating tensor" in report.format()


# --- affine -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_affine_values_regions_and_inverse(tmp_path, dtype):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(7, 5, generator=g).to(dtype)
    path = write_safetensors(tmp_path / "a.safetensors", {"n.weight": w})
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    for scale, shift in ((1.0, 1.0), (0.5, -0.25), (3.0, 0.0)):
        adapter = sdadapt.Adapter([sdadapt.affine("n.weight", scale=scale, shift=shift)])
        model = {"n.weight": TensorInfo((7, 5), dtype)}
        plan = build_plan(sdadapt.sources.open_source(path).schema, model, adapter)
        node = plan.recipes["n.weight"]
        want = (w.to(compute) * scale + shift).to(dtype)
        with sdadapt.sources.open_source(path) as src:
            assert torch.equal(node.full(src), want)
            box = ((2, 6), (1, 4))
            assert torch.equal(node.read(box, src), want[2:6, 1:4])
        inv = adapter.inverse()
        assert inv.rules[0].invert and sdadapt.Adapter.from_json(inv.to_json()) == inv
        plan_back = build_plan({"n.weight": TensorInfo((7, 5), dtype)}, model, inv)
        back = plan_back.recipes["n.weight"].full(_Mem({"n.weight": want}))
        assert torch.equal(back, ((want.to(compute) - shift) / scale).to(dtype))


def test_affine_cast_to_float32_computes_in_float32(tmp_path):
    """Gemma's ``1 + w`` on bf16 norms into a float32 model: the cast has the affine round once
    to float32 (exact here), instead of rounding ``1 + w`` to bf16 first."""
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(64, generator=g) * 1e-2).to(torch.bfloat16)
    path = write_safetensors(tmp_path / "n.safetensors", {"n.weight": w})
    adapter = sdadapt.Adapter([sdadapt.affine("n.weight", shift=1.0), sdadapt.cast("**", "model")])
    plan = build_plan(sdadapt.sources.open_source(path).schema, {"n.weight": TensorInfo((64,), torch.float32)}, adapter)
    node = plan.recipes["n.weight"]
    assert node.dtype == torch.float32 and node.describe() == "n.weight * 1 + 1 as float32"
    want = w.float() + 1.0
    assert not torch.equal(want, want.to(torch.bfloat16).float())  # 1 + w in bf16 loses w's low bits
    with sdadapt.sources.open_source(path) as src:
        assert torch.equal(node.full(src), want)
        assert torch.equal(node.read(((3, 40),), src), want[3:40])


class _Mem:
    def __init__(self, sd: dict[str, torch.Tensor]) -> None:
        self.sd = sd

    def read(self, key, box):
        return self.sd[key][tuple(slice(a, b) for a, b in box)]


def test_affine_refusals():
    with pytest.raises(AdapterError, match="non-zero"):
        sdadapt.affine("w", scale=0.0)
    report = build_plan(
        {"w": TensorInfo((3,), torch.int32)}, {"w": TensorInfo((3,), torch.int32)},
        sdadapt.Adapter([sdadapt.affine("w", shift=1.0)]),
    ).report
    assert [i.message for i in report.rule_issues] == ["affine needs a floating tensor; 'w' is torch.int32: cast it first"]


def test_affine_on_optimizer_moments():
    """Model ``p = w * s + c`` computing what the checkpoint's model computed from ``w`` has
    ``dL/dp = dL/dw / s``: moments drop the shift and scale as the gradient (squared)."""
    rule = sdadapt.affine("w", scale=4.0, shift=1.0)
    adapter = sdadapt.Adapter([sdadapt.rename("v", "w"), rule])
    assert adapter.for_optimizer_state("exp_avg").rules[1:] == [sdadapt.rules.Affine(keys="w", scale=4.0, invert=True)]
    assert adapter.for_optimizer_state("exp_avg_sq").rules[1:] == [sdadapt.rules.Affine(keys="w", scale=16.0, invert=True)]
    assert adapter.inverse().for_optimizer_state("exp_avg_sq").rules[0] == sdadapt.rules.Affine(keys="w", scale=16.0)
    only_shift = sdadapt.Adapter([sdadapt.affine("w", shift=1.0)])
    assert only_shift.for_optimizer_state("momentum_buffer").rules == []
    with pytest.raises(AdapterError, match="optimizer state 'ema'"):
        adapter.for_optimizer_state("ema")
    # the gradient relation the factors rest on, checked with autograd (s a power of two: exact)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, generator=g).requires_grad_()
    x = torch.randn(6, generator=g)
    (torch.sin((w * 4.0 + 1.0) * x).sum()).backward()
    p = (w.detach() * 4.0 + 1.0).requires_grad_()
    torch.sin(p * x).sum().backward()
    assert w.grad is not None and p.grad is not None
    assert torch.equal(p.grad, w.grad / 4.0)


# --- several keys per rule ------------------------------------------------------------------------


def test_rotary_needs_head_dim_for_norm_weights():
    schema = {"q.weight": TensorInfo((8, 4), torch.float32), "q_norm.weight": TensorInfo((4,), torch.float32)}
    norm = torch.arange(4.0)
    io = _Mem({"q_norm.weight": norm, "q.weight": torch.zeros(8, 4)})
    # heads=2 cuts the [4] norm weight in two "heads" of 2 rows (it divides, so nothing can tell);
    # head_dim=4 permutes it as one head, as the weight's heads are
    by_heads = build_plan(schema, schema, sdadapt.Adapter([sdadapt.rotary(["q.weight", "q_norm.weight"], heads=2)]))
    plan = build_plan(schema, schema, sdadapt.Adapter([sdadapt.rotary(["q.weight", "q_norm.weight"], head_dim=4)]))
    assert not torch.equal(by_heads.recipes["q_norm.weight"].full(io), _half_to_interleaved(norm, 4))
    assert torch.equal(plan.recipes["q_norm.weight"].full(io), _half_to_interleaved(norm, 4))
    odd = build_plan(
        {"b": TensorInfo((9,), torch.float32)}, {"b": TensorInfo((9,), torch.float32)},
        sdadapt.Adapter([sdadapt.rotary("b", head_dim=4)]),
    ).report
    assert "9 rows along dim 0 do not divide into heads of head_dim=4" in odd.format()


def test_interleave_weight_and_bias_alike():
    sizes = [4, 2, 2]
    w = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
    b = torch.arange(8, dtype=torch.float32)
    schema = {"qkv.weight": TensorInfo((8, 3), torch.float32), "qkv.bias": TensorInfo((8,), torch.float32)}
    plan = build_plan(schema, schema, sdadapt.Adapter([sdadapt.interleave(["qkv.weight", "qkv.bias"], sizes, tp=2)]))
    io = _Mem({"qkv.weight": w, "qkv.bias": b})
    order = [0, 1, 4, 6, 2, 3, 5, 7]  # [q_r0; k_r0; v_r0; q_r1; k_r1; v_r1]
    assert torch.equal(plan.recipes["qkv.weight"].full(io), w[order])
    assert torch.equal(plan.recipes["qkv.bias"].full(io), b[order])


def test_deinterleave_alternating_rows():
    """GPT-OSS gate/up alternate along the last dim: deinterleave with one row per block."""
    f = 3
    t = torch.arange(2 * 4 * 2 * f, dtype=torch.float32).reshape(2, 4, 2 * f)
    schema = {"gate_up": TensorInfo(tuple(t.shape), torch.float32)}
    plan = build_plan(schema, schema, sdadapt.Adapter([sdadapt.deinterleave("gate_up", [f, f], tp=f, dim=-1)]))
    got = plan.recipes["gate_up"].full(_Mem({"gate_up": t}))
    assert torch.equal(got, torch.cat([t[..., ::2], t[..., 1::2]], dim=-1))


# --- the same on a 2-rank FSDP2 mesh --------------------------------------------------------------


def _fsdp_load(path: str, adapter_json: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    with torch.device("meta"):
        model = Small()
    for m in (model.wq, model.q_norm, model.norm, model.w_neg, model.out):
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    adapter = sdadapt.Adapter.from_json(adapter_json)  # this module's import registered the user kinds
    rep = sdadapt.load(model, path, adapter)
    got = _loaded(model)
    want = _expected(_checkpoint())
    local_rows = {k: tuple(v.to_local().shape) for k, v in model.state_dict().items()}
    return {
        "bad": sorted(k for k in want if not torch.equal(got[k], want[k])),
        "keys": rep.keys_loaded,
        "local": local_rows,
    }


def test_user_rules_on_a_2_rank_fsdp_mesh(tmp_path):
    path = write_safetensors(tmp_path / "ckpt.safetensors", _checkpoint())
    results = run_distributed(_fsdp_load, 2, os.fspath(path), _adapter().to_json(), timeout=180)
    for r in results:
        assert r["bad"] == [] and r["keys"] == 6
    assert {results[0]["local"]["w_neg.weight"], results[1]["local"]["w_neg.weight"]} == {(3, DIM), (2, DIM)}


class _Stored(nn.Module):
    """Holds ``w`` and computes with ``w * 4 + 1`` (as Gemma's norms compute with ``1 + w``)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, generator=torch.Generator().manual_seed(1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x * (self.w * 4.0 + 1.0)).sum()


class _Direct(nn.Module):
    """The same function of a parameter that holds ``w * 4 + 1`` itself."""

    def __init__(self, p: torch.Tensor | None = None) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.zeros(6) if p is None else p.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x * self.p).sum()


def _adam_step(model: nn.Module, x: torch.Tensor) -> torch.optim.Optimizer:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    model(x).backward()
    opt.step()
    return opt


def test_resume_through_affine_scales_moments_like_gradients(tmp_path):
    """A checkpoint trained one Adam step on ``w`` resumes into a model holding ``p = w * 4 + 1``:
    the moments loaded equal those the model itself gets from the same step (the shift does not
    reach them; exp_avg is divided by 4, exp_avg_sq by 16), bit for bit."""
    x = torch.randn(6, generator=torch.Generator().manual_seed(2))
    stored = _Stored()
    direct = _Direct(stored.w.detach() * 4.0 + 1.0)
    stored_opt, direct_opt = _adam_step(stored, x), _adam_step(direct, x)
    sdadapt.save_state(stored, str(tmp_path / "ck"), stored_opt)

    adapter = sdadapt.Adapter([sdadapt.rename("w", "p"), sdadapt.affine("p", scale=4.0, shift=1.0)])
    resumed = _Direct()
    opt = torch.optim.Adam(resumed.parameters(), lr=1e-2, foreach=False)
    sdadapt.load_state(resumed, str(tmp_path / "ck"), opt, adapter=adapter)
    assert torch.equal(resumed.p.detach(), stored.w.detach() * 4.0 + 1.0)
    got, want = opt.state_dict()["state"][0], direct_opt.state_dict()["state"][0]
    assert torch.equal(got["exp_avg"], want["exp_avg"])
    assert torch.equal(got["exp_avg_sq"], want["exp_avg_sq"])
    assert float(got["step"]) == 1.0


def test_load_dtype_model_casts_every_tensor_to_the_models_dtype(tmp_path):
    sd = {k: v.to(torch.float64) for k, v in _expected(_checkpoint()).items()}
    path = write_safetensors(tmp_path / "f64.safetensors", sd)
    model = Small()
    model.q_norm.to(torch.bfloat16)  # mixed: one module already holds bfloat16
    with pytest.raises(sdadapt.errors.PlanError, match=r'root cause: only dtypes differ.*sdadapt.cast\("\*\*", "model"\)'):
        sdadapt.load(model, path)  # float64 into float32 and bfloat16: narrowings
    sdadapt.load(model, path, dtype="model")
    for k, v in model.state_dict().items():
        assert v.dtype == (torch.bfloat16 if k.startswith("q_norm") else torch.float32), k
        assert torch.equal(v, sd[k].to(v.dtype)), k
