"""Resume training state across meshes and a refactor (issue 4 acceptance).

Launch 1 (4 ranks): train a few steps on FSDP2+TP 2x2, ``save_state`` (the plain model with
fused ``qkv`` and a variant with split q/k/v), continue one step for reference losses, then
resume on FSDP 4. Launch 2 (3 ranks): resume on FSDP 3 (uneven shards) and the bad-input
cases. Launch 3 (2 ranks): resume on TP 2. Every resume must give the saved model and
optimizer state bit-exactly and the uninterrupted run's next losses within 1e-5.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from support.dist_helper import run_distributed
from support.models import TinyTransformer
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import sdadapt

# A TP plan that keeps the model's function (attention stays whole; see DESIGN.md on fused qkv).
TP_PLAN = {
    "layers.*.ffn.0": ColwiseParallel(),
    "layers.*.ffn.2": RowwiseParallel(),
    "head": ColwiseParallel(output_layouts=Replicate()),
}
QKV = sdadapt.Adapter(
    [
        sdadapt.fuse(
            ["layers.{i}.attn.q_proj.{p}", "layers.{i}.attn.k_proj.{p}", "layers.{i}.attn.v_proj.{p}"],
            "layers.{i}.attn.qkv.{p}",
        )
    ],
    name="split-qkv",
)
BATCH, SEQ, VOCAB, STEPS = 12, 6, 37, 3


class SplitAttention(nn.Module):
    """The same function as models.Attention with q, k, v as three projections."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.o_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = (t.reshape(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = torch.softmax(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5, dim=-1) @ v
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class Counter:
    """A user ``Stateful`` entry (like a dataloader position)."""

    def __init__(self, n: int = 0):
        self.n = n

    def state_dict(self) -> dict:
        return {"n": self.n, "seen": torch.full((4,), float(self.n))}  # DCP loads tensors in place

    def load_state_dict(self, sd: dict) -> None:
        self.n = sd["n"]
        assert torch.equal(sd["seen"], torch.full((4,), float(self.n)))


def make(kind: str, mesh_shape: tuple[int, ...], names: tuple[str, ...], seed: int):
    torch.manual_seed(seed)
    model = TinyTransformer(vocab=VOCAB)
    if kind == "split":
        for layer in model.layers:
            layer.attn = SplitAttention(16, 4)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    if "tp" in names:
        parallelize_module(model, mesh["tp"], TP_PLAN)
    if "fsdp" in names:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["fsdp"])
        fully_shard(model, mesh=mesh["fsdp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    dp = (mesh["fsdp"].get_local_rank(), mesh["fsdp"].size()) if "fsdp" in names else (0, 1)
    return model, opt, dp


def batch(step: int, dp: tuple[int, int]) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    r, n = dp
    return tokens[r * BATCH // n : (r + 1) * BATCH // n]


def loss_of(model: nn.Module, step: int, dp: tuple[int, int]) -> torch.Tensor:
    tokens = batch(step, dp)
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def global_value(loss: torch.Tensor) -> float:
    t = loss.detach().clone()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def train_step(model, opt, step: int, dp) -> float:
    loss = loss_of(model, step, dp)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return global_value(loss)


def continue_run(model, opt, dp) -> list[float]:
    """Step STEPS (train), then the loss at STEPS + 1 (forward only)."""
    first = train_step(model, opt, STEPS, dp)
    with torch.no_grad():
        second = global_value(loss_of(model, STEPS + 1, dp))
    return [first, second]


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def full_state(model, opt) -> dict:
    msd, osd = get_state_dict(model, opt)
    return {
        "model": {k: full(v) for k, v in msd.items()},
        "optim": {fqn: {n: full(v) for n, v in st.items()} for fqn, st in osd["state"].items()},
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in osd["param_groups"]],
    }


def fused(ref: dict) -> dict:
    """The split variant's saved state as the fused model should hold it."""

    def fuse(d: dict, stack) -> dict:
        out = {}
        for k, v in d.items():
            if ".attn.q_proj." in k:
                parts = [d[k.replace("q_proj", n)] for n in ("q_proj", "k_proj", "v_proj")]
                out[k.replace("q_proj", "qkv")] = stack(parts)
            elif ".attn.k_proj." not in k and ".attn.v_proj." not in k:
                out[k] = v
        return out

    optim = fuse(ref["optim"], lambda ps: {n: (ps[0][n] if n == "step" else torch.cat([p[n] for p in ps])) for n in ps[0]})
    return {"model": fuse(ref["model"], torch.cat), "optim": optim, "groups": ref["groups"]}


def compare(got: dict, want: dict) -> list[str]:
    bad = []
    if set(got["model"]) != set(want["model"]):
        bad.append(f"model keys {sorted(set(got['model']) ^ set(want['model']))}")
    bad += [f"model {k}" for k in want["model"] if k in got["model"] and not torch.equal(got["model"][k], want["model"][k])]
    if set(got["optim"]) != set(want["optim"]):
        bad.append(f"optim keys {sorted(set(got['optim']) ^ set(want['optim']))}")
    for fqn, st in want["optim"].items():
        for n, v in st.items():
            g = got["optim"].get(fqn, {}).get(n)
            if g is None or g.dtype != v.dtype or not torch.equal(g, v):
                bad.append(f"optim {fqn}.{n}")
    if got["groups"] != want["groups"]:
        bad.append(f"param groups {got['groups']} != {want['groups']}")
    return bad


def _train_and_save(folder: str) -> dict:
    out = {}
    for kind in ("plain", "split"):
        model, opt, dp = make(kind, (2, 2), ("fsdp", "tp"), seed=1)
        counter = Counter()
        for step in range(STEPS):
            train_step(model, opt, step, dp)
            counter.n += 1
        ckpt = os.path.join(folder, kind)
        sdadapt.save_state(model, ckpt, opt, extra={"step": STEPS, "data": counter}, adapter=QKV if kind == "plain" else None)
        ref = full_state(model, opt)
        if dist.get_rank() == 0:
            torch.save(ref, os.path.join(folder, f"{kind}.ref.pt"))
        out[kind] = continue_run(model, opt, dp)
    if dist.get_rank() == 0:
        torch.save(out, os.path.join(folder, "losses.pt"))
    dist.barrier()
    return out


def _resume(folder: str, mesh_shape: tuple[int, ...], names: tuple[str, ...]) -> dict:
    """Resume both checkpoints on this mesh; returns mismatches and losses per case."""
    losses = torch.load(os.path.join(folder, "losses.pt"))
    results = {}
    for kind in ("plain", "split"):
        ref = torch.load(os.path.join(folder, f"{kind}.ref.pt"))
        model, opt, dp = make("plain", mesh_shape, names, seed=2)  # always the fused model
        extra = {"step": 0, "data": Counter()}
        rep = sdadapt.load_state(model, os.path.join(folder, kind), opt, extra, adapter=QKV if kind == "split" else None)
        got = full_state(model, opt)
        want = fused(ref) if kind == "split" else ref
        results[kind] = {
            "bad": compare(got, want),
            "extra": (extra["step"], extra["data"].n),
            "optimizer_keys": rep.optimizer_keys,
            "losses": continue_run(model, opt, dp),
            "want_losses": losses[kind],
        }
    return results


def _launch_4(folder: str) -> dict:
    res = {"trained": _train_and_save(folder)}
    res["fsdp4"] = _resume(folder, (4,), ("fsdp",))
    # model only, no adapter: DCP folder as an sdadapt.load source (reshards 2x2 -> 4)
    ref = torch.load(os.path.join(folder, "plain.ref.pt"))
    with torch.device("meta"):
        model = TinyTransformer(vocab=VOCAB)
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("fsdp",))
    fully_shard(model, mesh=mesh)
    sdadapt.load(model, os.path.join(folder, "plain"))
    res["load_plain"] = [k for k, v in model.state_dict().items() if not torch.equal(full(v), ref["model"][k])]
    # model only, through the adapter, into a TP 2 x FSDP 2 mesh, from the split checkpoint
    split_ref = fused(torch.load(os.path.join(folder, "split.ref.pt")))
    model, _, _ = make("plain", (2, 2), ("fsdp", "tp"), seed=3)
    sdadapt.load(model, os.path.join(folder, "split"), QKV)
    res["load_split"] = [k for k, v in model.state_dict().items() if not torch.equal(full(v), split_ref["model"][k])]
    return res


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("resume")
    results = run_distributed(_launch_4, 4, str(folder), timeout=240)
    return str(folder), results


def _check(results: dict, key: str) -> None:
    for rank, r in enumerate(results):
        for kind, case in r[key].items():
            assert case["bad"] == [], (rank, kind, case["bad"])
            assert case["extra"] == (STEPS, STEPS), (rank, kind)
            assert case["losses"] == pytest.approx(case["want_losses"], rel=1e-5, abs=1e-6), (rank, kind)


def test_resume_fsdp_tp_2x2_to_fsdp_4(saved):
    _, results = saved
    _check(results, "fsdp4")
    # the refactored checkpoint has more (split) optimizer tensors than the fused model restores
    assert all(r["fsdp4"]["plain"]["optimizer_keys"] == r["fsdp4"]["split"]["optimizer_keys"] for r in results)


def test_dcp_folder_as_load_source_reshards(saved):
    _, results = saved
    assert all(r["load_plain"] == [] and r["load_split"] == [] for r in results)


def _bad_inputs(folder: str) -> dict:
    """Each bad input raises the same kind of error on every rank and changes nothing."""
    out = {}
    model, _, _ = make("plain", (3,), ("fsdp",), seed=4)
    before = {k: full(v) for k, v in model.state_dict().items()}

    def attempt(name, opt, path, adapter=None):
        try:
            sdadapt.load_state(model, path, opt, adapter=adapter)
            out[name] = "no error"
        except sdadapt.SdadaptError as e:
            out[name] = (type(e).__name__, str(e).splitlines()[0][:500])
        out[name + ".untouched"] = all(torch.equal(full(v), before[k]) for k, v in model.state_dict().items()) and (
            opt is None or len(opt.state) == 0
        )

    plain = os.path.join(folder, "plain")
    attempt("sgd", torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), plain)
    frozen = [p for n, p in model.named_parameters() if n != "head.bias"]
    attempt("lacks_param", torch.optim.AdamW(frozen, lr=1e-2, weight_decay=0.1), plain)
    attempt("refactor_without_adapter", torch.optim.AdamW(model.parameters(), lr=1e-2), os.path.join(folder, "split"))
    broken = os.path.join(folder, "interrupted")
    if dist.get_rank() == 0:
        os.makedirs(broken, exist_ok=True)
        open(os.path.join(broken, "__0_0.distcp"), "wb").close()
    dist.barrier()
    attempt("no_metadata", torch.optim.AdamW(model.parameters(), lr=1e-2), broken)
    return out


def _launch_3(folder: str) -> dict:
    return {"fsdp3": _resume(folder, (3,), ("fsdp",)), "bad": _bad_inputs(folder)}


def _launch_2(folder: str) -> dict:
    return {"tp2": _resume(folder, (2,), ("tp",))}


def test_resume_on_fsdp_3_uneven_and_bad_inputs(saved):
    folder, _ = saved
    results = run_distributed(_launch_3, 3, folder, timeout=240)
    _check(results, "fsdp3")
    for r in results:
        bad = r["bad"]
        assert bad["sgd"][0] == "StateError" and "another kind" in bad["sgd"][1], bad["sgd"]
        assert bad["lacks_param"][0] == "PlanError", bad["lacks_param"]
        assert bad["refactor_without_adapter"][0] == "PlanError", bad["refactor_without_adapter"]
        assert bad["no_metadata"][0] == "SourceError" and ".metadata" in bad["no_metadata"][1], bad["no_metadata"]
        assert all(v is True for k, v in bad.items() if k.endswith(".untouched")), bad


def test_resume_on_tp_2(saved):
    folder, _ = saved
    _check(run_distributed(_launch_2, 2, folder, timeout=240), "tp2")


def test_single_process_state_round_trip_and_record(tmp_path):
    """No process group: save_state/load_state with an LR scheduler, the sdadapt.json record,
    a missing extra, and an existing destination."""
    import json

    torch.manual_seed(0)
    model = TinyTransformer(vocab=VOCAB)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(2):
        loss_of(model, step, (0, 1)).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    dst = str(tmp_path / "ck")
    sdadapt.save_state(model, dst, opt, {"sched": sched, "step": 2}, adapter=QKV)
    record = json.loads((tmp_path / "ck" / "sdadapt.json").read_text())
    assert record["model_key"] == "model" and record["optim_key"] == "optim" and record["extra"] == ["sched", "step"]
    assert sdadapt.Adapter(**record["adapter"]) == QKV
    with pytest.raises(sdadapt.errors.StateError, match="not empty"):
        sdadapt.save_state(model, dst, opt)

    model2 = TinyTransformer(vocab=VOCAB)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    before = {k: v.clone() for k, v in model2.state_dict().items()}
    with pytest.raises(sdadapt.errors.StateError, match="no entry 'loader'"):
        sdadapt.load_state(model2, dst, opt2, {"loader": Counter()})
    assert all(torch.equal(v, before[k]) for k, v in model2.state_dict().items()) and len(opt2.state) == 0
    extra = {"sched": sched2, "step": 0}
    rep = sdadapt.load_state(model2, dst, opt2, extra)
    assert extra["step"] == 2 and sched2.state_dict() == sched.state_dict()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 2.5e-3
    assert rep.saved_with is not None and rep.optimizer_state_names == ["exp_avg", "exp_avg_sq", "step"]
    for k, v in model.state_dict().items():
        assert torch.equal(model2.state_dict()[k], v), k
    a, b = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert all(torch.equal(a[i][n], b[i][n]) for i in a for n in a[i])


class _Payload:
    """An object whose unpickling would run code (os.getcwd here, harmless but foreign)."""

    def __reduce__(self):
        import os

        return (os.getcwd, ())


class _Holder:
    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, sd):
        self.value = sd["value"]


def test_extras_are_never_unpickled_as_arbitrary_objects(tmp_path):
    """DCP's default planner restores non-tensor extras with weights_only=False; ours refuses
    anything but tensors and plain data, naming the entry."""
    model = TinyTransformer(vocab=VOCAB)
    dst = str(tmp_path / "ck")
    sdadapt.save_state(model, dst, None, {"evil": _Holder(_Payload()), "plain": _Holder({"lr": 0.5, "n": [1, 2]})})
    plain = _Holder({"lr": 0.0, "n": []})  # DCP loads into the leaves the current state has
    sdadapt.load_state(TinyTransformer(vocab=VOCAB), dst, None, {"plain": plain})
    assert plain.value == {"lr": 0.5, "n": [1, 2]}
    with pytest.raises(sdadapt.errors.LoadError, match="refusing to unpickle non-tensor entry 'evil"):
        sdadapt.load_state(TinyTransformer(vocab=VOCAB), dst, None, {"evil": _Holder(None)})
