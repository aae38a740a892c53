"""The compatibility cases one installed transformers (and torch) must pass, run by
``scripts/compat_matrix.py`` inside each small venv of its matrix (and by hand: ``python
tests/support/compat_cases.py``, which prints one JSON line per case).

For each tiny model (llama untied and tied, qwen3_moe where the installed transformers has it,
mixtral): build it from its config, put random values in every parameter, write it with
``save_pretrained`` and read it back with ``from_pretrained`` (the reference). Then, on two
gloo ranks, a fresh meta model sharded with FSDP2 is loaded with ``sdadapt.load(model,
folder)`` (no adapter: the one derived from transformers' own mapping) and compared with the
reference bit for bit (and, for llama, the shipped ``llama`` adapter loads the same checkpoint
into the Meta-layout reference model, whose logits must match transformers'); ``sdadapt diff
FOLDER --target`` must exit 0; the loaded model is exported (``sdadapt.export``) and the
written folder must open with that transformers' ``from_pretrained``, equal to the reference
bit for bit.

Where the installed transformers is outside the range sdadapt declares, the expected outcome is
the up-front error naming the version: the case passes when that error is raised.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Any

import torch

COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
)
# case -> (model_type, config overrides)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {"tie_word_embeddings": False}),
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
    "qwen3_moe": ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24, "decoder_sparse_step": 1}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
}


TOKENS = torch.tensor([[3, 17, 42, 5, 88, 61, 7, 29], [1, 2, 3, 4, 5, 6, 7, 8]])


def _has(model_type: str) -> bool:
    import transformers

    return model_type in transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES


def write_checkpoints(root: str) -> list[str]:
    """Each case's checkpoint (``root/<case>``) and its reference state (``root/<case>.ref.pt``)."""
    import transformers

    transformers.logging.set_verbosity_error()
    quiet = getattr(transformers.logging, "disable_progress_bar", None)
    if quiet is not None:
        quiet()
    written = []
    for i, (case, (model_type, overrides)) in enumerate(CASES.items()):
        if not _has(model_type):
            continue
        cfg = transformers.AutoConfig.for_model(model_type, **{**COMMON, **overrides})
        torch.manual_seed(i)
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        folder = os.path.join(root, case)
        model.save_pretrained(folder)
        ref = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        state: dict[str, Any] = dict(ref.state_dict())
        if case == "llama":  # the shipped adapter's check compares logits
            with torch.no_grad():
                state["__logits__"] = ref(TOKENS).logits
        torch.save(state, os.path.join(root, f"{case}.ref.pt"))
        written.append(case)
    return written


def _meta_model(folder: str) -> Any:
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg)


def _differing(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> list[str]:
    from torch.distributed.tensor import DTensor

    bad = sorted(set(state) ^ set(ref))
    for k, v in state.items():
        full = v.full_tensor() if isinstance(v, DTensor) else v
        if k in ref and not torch.equal(full, ref[k]):
            bad.append(k)
    return bad


def load_worker(root: str, cases: list[str]) -> dict[str, Any]:
    """On every rank: each case's meta model, FSDP2 over the ranks, ``sdadapt.load``, compared
    with the reference; then rank 0's export of it opened with ``from_pretrained``."""
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import sdadapt

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out: dict[str, Any] = {}
    for case in cases:
        folder = os.path.join(root, case)
        ref = torch.load(os.path.join(root, f"{case}.ref.pt"), weights_only=True)
        logits = ref.pop("__logits__", None)
        model = _meta_model(folder)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        res: dict[str, Any] = {}
        try:
            sdadapt.load(model, folder)
        except sdadapt.SdadaptError as e:
            res["load"] = f"{type(e).__name__}: {e}"
        else:
            bad = _differing(model.state_dict(), ref)
            res["load"] = "ok" if not bad else f"differs: {bad[:4]}"
            dst = os.path.join(root, f"{case}.export.r{dist.get_rank()}")
            try:
                sdadapt.export(model, dst)
            except sdadapt.SdadaptError as e:
                res["export"] = f"{type(e).__name__}: {e}"
            else:
                res["export"] = _reopen(dst, ref) if dist.get_rank() == 0 else "ok"
        if logits is not None:  # also where the derived adapter is refused: the way out it names
            res["shipped"] = _shipped_llama(folder, logits, mesh)
        out[case] = res
        dist.barrier()
    return out


def _shipped_llama(folder: str, logits: torch.Tensor, mesh: Any) -> str:
    """The shipped ``llama`` adapter: the HF checkpoint into the Meta-layout reference model
    (tests/support/reference_models.py, FSDP2), its logits against transformers' own (fp32, 1e-5)."""
    import transformers
    from torch.distributed.tensor import DTensor

    import sdadapt
    from support.reference_models import MetaLlama, parallelize_meta_llama

    cfg = transformers.AutoConfig.from_pretrained(folder)
    rope = getattr(cfg, "rope_parameters", None) or {}
    spec = dict(dim=cfg.hidden_size, n_layers=cfg.num_hidden_layers, n_heads=cfg.num_attention_heads,
                n_kv_heads=cfg.num_key_value_heads, vocab_size=cfg.vocab_size, hidden_dim=cfg.intermediate_size,
                norm_eps=cfg.rms_norm_eps, rope_theta=rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    with torch.device("meta"):
        model = MetaLlama(spec)
    parallelize_meta_llama(model.eval(), mesh)
    try:
        sdadapt.load(model, folder, sdadapt.get_adapter("llama", source=folder))
    except sdadapt.SdadaptError as e:
        return f"{type(e).__name__}: {e}"
    with torch.no_grad():
        got = model(TOKENS)
    got = got.full_tensor() if isinstance(got, DTensor) else got
    diff = (got.float() - logits).abs().max().item()
    return "ok" if torch.allclose(got.float(), logits, rtol=1e-5, atol=2e-5) else f"logits differ by {diff:.3g}"


def _reopen(dst: str, ref: dict[str, torch.Tensor]) -> str:
    import transformers

    try:
        back = transformers.AutoModelForCausalLM.from_pretrained(dst)
    except Exception as e:  # noqa: BLE001 - the cell records whatever failed
        return f"from_pretrained failed: {type(e).__name__}: {e}"
    bad = _differing(back.state_dict(), ref)
    return "ok" if not bad else f"reopened differs: {bad[:4]}"


def _diff_cli(root: str, case: str) -> str:
    folder = os.path.join(root, case)
    build = os.path.join(root, f"{case}_build.py")
    with open(build, "w") as f:
        f.write(
            "import torch, transformers\n"
            "def build():\n"
            f"    cfg = transformers.AutoConfig.from_pretrained({folder!r})\n"
            "    with torch.device('meta'):\n"
            "        return transformers.AutoModelForCausalLM.from_config(cfg)\n"
        )
    import contextlib
    import io

    from sdadapt.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["diff", folder, "--target", f"{build}:build"])  # the CLI in this process: its exit status
    return "ok" if code == 0 else f"exit {code}: {(err.getvalue() or out.getvalue()).strip()[:600]}"


def run(root: str, world_size: int = 2) -> dict[str, dict[str, str]]:
    """Every case in the running environment: ``{case: {check: "ok" | what failed}}``."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import transformers

    from sdadapt._base.env import transformers_supported
    from support.dist_helper import run_distributed

    problem = transformers_supported()
    t0 = time.monotonic()
    cases = write_checkpoints(root)
    t1 = time.monotonic()
    results: dict[str, dict[str, str]] = {c: {} for c in CASES if c not in cases}
    for c in results:
        results[c] = {"load": "absent", "diff": "absent", "export": "absent"}  # not in this transformers
    from support import compat_cases  # the workers import the function by its module's name, not __main__

    ranks = run_distributed(compat_cases.load_worker, world_size, root, cases, timeout=600)
    t2 = time.monotonic()
    for case in cases:
        res = {**ranks[0][case]}
        other = [r[case]["load"] for r in ranks[1:] if r[case]["load"] != res["load"]]
        if other:
            res["load"] += f" (other ranks: {other})"
        res["diff"] = _diff_cli(root, case)
        if problem is not None:  # outside the declared range: the up-front error is the pass
            expected = f"transformers {transformers.__version__} is installed"
            res.setdefault("export", res["load"])  # not reached: export derives the same adapter
            for k, v in res.items():
                if k == "shipped":  # a shipped adapter needs no derived one: no refusal there
                    continue
                res[k] = "refused up front" if expected in v and "pass an adapter" in v else f"no up-front error: {v}"
        results[case] = res
    print(json.dumps({"seconds_checkpoints": round(t1 - t0, 1), "seconds_ranks": round(t2 - t1, 1),
                      "seconds_diff_cli": round(time.monotonic() - t2, 1)}), file=sys.stderr)
    return results


def main() -> int:
    import transformers

    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sdadapt-compat-") as root:
        results = run(root)
    failed = 0
    for case, res in results.items():
        ok = all(v in ("ok", "absent", "refused up front") for v in res.values())
        failed += not ok
        print(json.dumps({"case": case, "ok": ok, **res}))
    print(json.dumps({"transformers": transformers.__version__, "torch": torch.__version__,
                      "seconds": round(time.monotonic() - start, 1), "failed": failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
