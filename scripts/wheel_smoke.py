"""Smoke checks of an installed sdadapt wheel, run by .ci/run in a venv that holds nothing but
``pip install <wheel>`` (and torch): the declared dependencies must be enough.

    python scripts/wheel_smoke.py [--skip-demo]

It imports only the wheel's declared dependencies (torch, pydantic, tqdm, numpy) and the
standard library: no pytest, no safetensors. Checks:

- ``sdadapt`` comes from site-packages (not the source tree) and the ``sdadapt`` command runs;
- the demo (examples/demo.py: CLI diff, then 4 processes loading into a 2x2 FSDP2 x TP model);
- on 2 gloo processes (FSDP2): a load through an adapter, bit-exact against the eager fuse; a
  PlanError arriving as :class:`sdadapt.errors.PlanError` on both ranks; ``save_state`` then
  ``load_state`` into a fresh model and optimizer (values and optimizer state equal); ``export``
  to safetensors and to torch, read back into a fresh sharded model (equal).

Exit status 0 when every check passed; each failure is printed with its rank.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD = 2
DIM, LAYERS = 16, 2
CASES = ["load", "plan_error", "save_state/load_state", "export safetensors", "export torch"]


# --- the 2-rank part (runs in each worker process) ------------------------------------------------


def _model(meta: bool):
    import torch
    from torch import nn

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.Module()
            self.attn.qkv = nn.Linear(DIM, 3 * DIM)  # q, k, v fused
            self.mlp = nn.Linear(DIM, DIM)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.mlp(self.attn.qkv(x)[..., :DIM])

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    with torch.device("meta" if meta else "cpu"):
        return Model()


def _checkpoint() -> dict:
    import torch

    g = torch.Generator().manual_seed(0)
    sd = {}
    for i in range(LAYERS):
        for p in "qkv":
            sd[f"layers.{i}.attn.{p}_proj.weight"] = torch.randn(DIM, DIM, generator=g)
            sd[f"layers.{i}.attn.{p}_proj.bias"] = torch.randn(DIM, generator=g)
        sd[f"layers.{i}.mlp.weight"] = torch.randn(DIM, DIM, generator=g)
        sd[f"layers.{i}.mlp.bias"] = torch.randn(DIM, generator=g)
    return sd


def _adapter():
    import sdadapt

    qkv = [f"layers.{{i}}.attn.{p}_proj.{{t}}" for p in "qkv"]
    return sdadapt.Adapter([sdadapt.fuse(qkv, "layers.{i}.attn.qkv.{t}")], name="split-qkv")


def _expected() -> dict:
    import torch

    sd = _checkpoint()
    out = {}
    for i in range(LAYERS):
        for t in ("weight", "bias"):
            out[f"layers.{i}.attn.qkv.{t}"] = torch.cat([sd[f"layers.{i}.attn.{p}_proj.{t}"] for p in "qkv"])
            out[f"layers.{i}.mlp.{t}"] = sd[f"layers.{i}.mlp.{t}"]
    return out


def _sharded(mesh, meta: bool = True):
    from torch.distributed.fsdp import fully_shard

    model = _model(meta)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full(model) -> dict:
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()}


def _same(got: dict, want: dict, what: str) -> None:
    import torch

    assert sorted(got) == sorted(want), (what, sorted(got), sorted(want))
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"{what}: values differ for {bad}"


def _worker(rank: int, folder: str) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import sdadapt
    from sdadapt.errors import PlanError

    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("fsdp",))
    ckpt = os.path.join(folder, "pretrained.pt")
    results: dict[str, str] = {}

    def case(name, fn) -> None:
        # the cases share collectives: after a failure the ranks are out of step, so stop there
        if any(v != "ok" for v in results.values()):
            return
        try:
            fn()
            results[name] = "ok"
        except BaseException as e:  # noqa: BLE001 - every failure is reported with its rank
            results[name] = f"{type(e).__module__}.{type(e).__name__}: {e}\n{traceback.format_exc()}"
        with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)

    state: dict = {}

    def load() -> None:
        model = _sharded(mesh)
        report = sdadapt.load(model, ckpt, _adapter())
        assert report.keys_loaded == 4 * LAYERS, report
        _same(_full(model), _expected(), "load")
        state["model"] = model

    def plan_error() -> None:
        model = _sharded(mesh)
        try:
            sdadapt.load(model, ckpt)  # no adapter: q/k/v and qkv do not line up
        except PlanError as e:
            assert "layers.{0..1}.attn.qkv" in e.report.format(), e.report.format()  # rank 0: in str(e) too
            assert next(iter(model.parameters())).is_meta  # nothing was touched
        else:
            raise AssertionError("no PlanError")

    def save_and_load_state() -> None:
        model = state["model"]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = torch.randn(3, DIM)
        for _ in range(2):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        dst = os.path.join(folder, "state")
        sdadapt.save_state(model, dst, opt, extra={"step": 2})
        fresh = _sharded(mesh, meta=False)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        extra = {"step": 0}
        sdadapt.load_state(fresh, dst, fresh_opt, extra=extra)
        assert extra["step"] == 2, extra
        _same(_full(fresh), _full(model), "load_state: model")
        for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
            a, b = opt.state[p], fresh_opt.state[q]
            for k in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(a[k].full_tensor() if hasattr(a[k], "full_tensor") else a[k],
                                   b[k].full_tensor() if hasattr(b[k], "full_tensor") else b[k]), k

    def export(fmt: str) -> None:
        model = state["model"]
        dst = os.path.join(folder, "export" if fmt == "safetensors" else "export.pt")
        report = sdadapt.export(model, dst, _adapter(), format=fmt)
        assert report.tensors == 8 * LAYERS, report  # q, k, v, mlp: weight and bias
        back = _sharded(mesh)
        sdadapt.load(back, dst, _adapter())
        _same(_full(back), _full(model), fmt)

    case("load", load)
    case("plan_error", plan_error)
    case("save_state/load_state", save_and_load_state)
    case("export safetensors", lambda: export("safetensors"))
    case("export torch", lambda: export("torch"))
    if any(v != "ok" for v in results.values()):
        return 1  # no barrier: the other rank may be stuck in another collective
    dist.barrier()
    dist.destroy_process_group()
    return 0


# --- the driver -----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_workers(folder: str, timeout: float) -> list[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    procs = [
        subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", str(r), folder], env=env)
        for r in range(WORLD)
    ]
    failures = []
    deadline = time.monotonic() + timeout
    for r, p in enumerate(procs):
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            failures.append(f"rank {r}: did not finish within {timeout:.0f} s (a hang)")
            for q in procs:
                q.kill()
                q.wait()
            break
        if p.returncode != 0:
            failures.append(f"rank {r}: exit status {p.returncode}")
    for r in range(WORLD):
        path = os.path.join(folder, f"rank{r}.json")
        if not os.path.exists(path):
            failures.append(f"rank {r}: wrote no results")
            continue
        with open(path) as f:
            results = json.load(f)
        for name in CASES:
            outcome = results.get(name, "not run (an earlier case failed)")
            print(f"rank {r}: {name}: {outcome.splitlines()[0]}")
            if outcome != "ok" and name in results:
                failures.append(f"rank {r}: {name}: {outcome}")
        if set(results) != set(CASES) and all(v == "ok" for v in results.values()):
            failures.append(f"rank {r}: ran only {sorted(results)}")
    return failures


def _check_installed() -> list[str]:
    import sdadapt

    where = os.path.realpath(sdadapt.__file__)
    site = os.path.realpath(sysconfig.get_paths()["purelib"])
    if not where.startswith(site + os.sep):
        return [f"sdadapt was imported from {where}, not from the venv's site-packages {site}"]
    print(f"sdadapt {sdadapt.__version__ if hasattr(sdadapt, '__version__') else ''} from {where}")
    exe = shutil.which("sdadapt", path=os.path.dirname(sys.executable))
    if exe is None:
        return ["the `sdadapt` command is not installed next to the venv's python"]
    r = subprocess.run([exe, "adapters"], capture_output=True, text=True, timeout=120)
    if r.returncode != 0 or "llama" not in r.stdout:
        return [f"`sdadapt adapters` failed ({r.returncode}):\n{r.stdout}{r.stderr}"]
    print("sdadapt adapters: ok")
    return []


def _run_demo(timeout: float) -> list[str]:
    cmd = [sys.executable, os.path.join(ROOT, "examples", "demo.py"), "--steps", "2"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    try:
        r = subprocess.run(cmd, env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [f"the demo did not finish within {timeout:.0f} s"]
    out = r.stdout + r.stderr
    if r.returncode != 0 or "demo finished" not in out:
        return [f"the demo failed (exit status {r.returncode}):\n{out[-6000:]}"]
    print("demo: " + [line for line in out.splitlines() if line.startswith("demo finished")][0])
    return []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", nargs=2, metavar=("RANK", "DIR"), help=argparse.SUPPRESS)
    ap.add_argument("--skip-demo", action="store_true", help="skip examples/demo.py")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds for the 2-rank part (a hang fails)")
    args = ap.parse_args(argv)
    if args.worker:
        rank = int(args.worker[0])
        code = 1
        try:
            code = _worker(rank, args.worker[1])
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)  # after destroy_process_group: avoids gloo's abort at interpreter exit
    t0 = time.perf_counter()
    failures = _check_installed()
    with tempfile.TemporaryDirectory(prefix="sdadapt-wheel-smoke-") as folder:
        import torch

        torch.save(_checkpoint(), os.path.join(folder, "pretrained.pt"))
        failures += _run_workers(folder, args.timeout)
    if not args.skip_demo:
        failures += _run_demo(300.0)
    for f in failures:
        print("FAIL " + f, file=sys.stderr)
    print(f"wheel smoke: {'FAILED' if failures else 'passed'} in {time.perf_counter() - t0:.1f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
