"""Refit into a live vLLM engine, run alone in the vLLM venv (scripts/vllm_venv.py) by
tests/transaction/test_vllm_live.py:

    python tests/support/vllm_live.py llama OUT.json

One engine per run (``LLM(..., weight_transfer_config={"backend": "sdadapt"})``, TP 1, bfloat16) in
this process, which is also trainer rank 0 of 2 gloo ranks (rank 1 is this script started again
with RANK=1). The trainer is transformers' model of the family, under FSDP2 over the 2 ranks,
trained with AdamW; ``sdadapt.vllm.connect`` plans the refit once. Cases, all against the one
engine, each written as a JSON line to OUT:

- ``shapes``: the engine's raw parameters (vLLM's, before post-processing) have the shapes the
  layout module's ``parameter_shapes()`` gives;
- ``oracle``: refit from the untrained trainer, the staged shards equal what vLLM's own
  ``load_weights`` made of the same HF checkpoint (the engine's weights right after it started,
  read through a fresh model built by vLLM's loader in the worker);
- ``step1``: one AdamW step, refit; vLLM's greedy tokens equal transformers' with the trained
  weights (bfloat16), and its prompt logprobs are within ``TOL`` of transformers';
- ``step2``: delta mode: a second step (every tensor resent), then one norm changed in place
  (only its engine tensor sent), then nothing changed (nothing sent, the engine not called);
- ``mismatch``: a wrong adapter (another head count): RefitError on both ranks before anything
  moves, and the engine still serves the previous weights (the same tokens and logprobs).
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import traceback

import torch

TOL = (0.02, 0.05)
"""Prompt logprobs: vLLM's bfloat16 one may differ from transformers' bfloat16 one by ``0.02 *
|logprob| + 0.05`` (the frameworks' bfloat16 kernels round differently; transformers' own bfloat16
and float32 forwards differ as much, reported as ``ref_bf16_vs_fp32``); a tensor missed or
misplaced by a refit moves logprobs by whole units."""
PROMPTS = [[5, 17, 42, 7, 99, 3], [250, 11, 64, 128, 2], [77, 78, 79, 80, 81, 82, 83]]
NEW_TOKENS = 6


def family_config(family: str):
    import transformers

    common = dict(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=256, tie_word_embeddings=False,
                  initializer_range=0.1)  # fmt: skip
    if family == "llama":
        return transformers.LlamaConfig(**common), "LlamaForCausalLM"
    if family == "qwen3":
        return transformers.Qwen3Config(**common), "Qwen3ForCausalLM"
    raise SystemExit(f"unknown family {family}")


def adapter_and_layout(family: str, n_kv_heads: int = 2):
    from sdadapt.adapters import vllm_llama

    # Qwen3's q_norm / k_norm keep their names in vLLM; the attention and MLP fuse as Llama's
    return vllm_llama.build(n_heads=4, n_kv_heads=n_kv_heads, head_dim=64, hidden_dim=512), vllm_llama.layout


def expected_shapes(family: str) -> dict[str, tuple[int, ...]]:
    from sdadapt.adapters import vllm_llama

    shapes = vllm_llama.parameter_shapes(n_layers=2, vocab_size=300, dim=256, n_heads=4, n_kv_heads=2, head_dim=64, hidden_dim=512)
    if family == "qwen3":
        for i in range(2):
            shapes |= {f"model.layers.{i}.self_attn.q_norm.weight": (64,), f"model.layers.{i}.self_attn.k_norm.weight": (64,)}
    return shapes


def vllm_loaded(self, folder: str) -> dict[str, object]:
    """In the worker: vLLM's own loader run on the engine's HF checkpoint into a fresh model (raw
    parameters, before post-processing), compared with the sdadapt staging."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model

    from sdadapt._refit.vllm_staging import read

    cfg = self.vllm_config
    with set_current_vllm_config(cfg), torch.device("cpu"):
        model = initialize_model(vllm_config=cfg, prefix="oracle")
        loader = get_model_loader(cfg.load_config)
        loader.load_weights(model, cfg.model_config)
    staged = read(folder, 0)[1]
    own = dict(model.named_parameters())
    return {"keys_equal": sorted(own) == sorted(staged),
            "differ": sorted(n for n in own if n in staged and not torch.equal(own[n].data, staged[n]))}  # fmt: skip


def run_engine_cases(family: str, out_path: str, rank: int, world: int) -> None:
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import sdadapt.vllm
    from sdadapt.errors import RefitError

    config, _ = family_config(family)
    folder = os.environ["SDADAPT_LIVE_DIR"]
    ckpt = os.path.join(folder, "ckpt")
    llm = None
    out = open(out_path, "a") if rank == 0 else None

    def emit(**row: object) -> None:
        if out is not None:
            out.write(json.dumps(row) + "\n")
            out.flush()

    if rank == 0:
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(ckpt)
        from vllm import LLM

        # the oracle case ships a function to the worker (collective_rpc), which vLLM pickles only so
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        llm = LLM(model=ckpt, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, max_model_len=128,
                  gpu_memory_utilization=0.05, weight_transfer_config={"backend": "sdadapt"})  # fmt: skip
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['SDADAPT_LIVE_PORT']}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=900))  # fmt: skip
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    trainer = transformers.AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32)
    fully_shard(trainer, mesh=mesh)
    opt = torch.optim.AdamW(trainer.parameters(), lr=0.02)
    tokens = torch.tensor([[1, 5, 9, 33, 70, 120, 200, 7, 8, 9]])

    def step() -> None:
        trainer(tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad()

    def reference(compute: torch.dtype = torch.bfloat16) -> tuple[list[list[int]], list[list[float]]]:
        """transformers with the trainer's current weights rounded to bfloat16 (computing in
        ``compute``): greedy tokens, prompt logprobs."""
        full = {k: v.full_tensor() for k, v in trainer.state_dict().items()}
        ref = transformers.AutoModelForCausalLM.from_config(config).to(compute)
        ref.load_state_dict({k: v.bfloat16().to(compute) for k, v in full.items()})
        ref.eval()
        toks, lps = [], []
        with torch.no_grad():
            for p in PROMPTS:
                ids = torch.tensor([p])
                logits = ref(ids).logits.float()
                lp = torch.log_softmax(logits, -1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
                lps.append(lp.tolist())
                gen = ref.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
                toks.append(gen[0, len(p):].tolist())
        return toks, lps

    def served() -> tuple[list[list[int]], list[list[float]]]:
        from vllm import SamplingParams

        assert llm is not None
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, prompt_logprobs=0, detokenize=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        toks = [list(o.outputs[0].token_ids) for o in outs]
        lps = [[next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]] for o in outs]
        return toks, lps

    def compare(case: str, extra: dict | None = None) -> tuple[list, list]:
        want, want32 = reference(), reference(torch.float32)
        got = served() if rank == 0 else None
        if rank == 0:
            assert got is not None

            def diff(a: list, b: list) -> float:
                return max(abs(p - q) for x, y in zip(a, b, strict=True) for p, q in zip(x, y, strict=True))

            within = all(abs(p - q) <= TOL[0] * abs(q) + TOL[1] for x, y in zip(got[1], want[1], strict=True)
                         for p, q in zip(x, y, strict=True))  # fmt: skip
            emit(case=case, tokens_equal=got[0] == want[0], got=got[0], want=want[0], logprob_diff=diff(got[1], want[1]),
                 logprob_within=within, tol=list(TOL),
                 tokens_equal_fp32=got[0] == want32[0], logprob_diff_fp32=diff(got[1], want32[1]),
                 ref_bf16_vs_fp32=diff(want[1], want32[1]), lp=got[1][0][:4], lp_want=want[1][0][:4], **(extra or {}))  # fmt: skip
        return got or ([], [])

    adapter, layout = adapter_and_layout(family)
    before = served() if rank == 0 else None
    refit = sdadapt.vllm.connect(trainer, llm, adapter, layout, bucket_bytes=1 << 20, delta=True)
    if rank == 0:
        from sdadapt._refit.vllm_staging import read

        manifest = read(refit.staging, 0)[0]
        got = {n: list(s) for n, _, s, _ in manifest.params}
        emit(case="shapes", equal=got == {k: list(v) for k, v in expected_shapes(family).items()}, got=got)
    compare("step0")
    reports = refit()  # the untrained weights: the staging equals vLLM's own loading of the checkpoint
    if rank == 0:
        assert llm is not None
        oracle = llm.collective_rpc(vllm_loaded, args=(refit.staging,))[0]
        emit(case="oracle", **oracle, bytes=[r.bytes_received + r.bytes_local for r in reports])
        after = served()
        emit(case="unchanged_serves_same", tokens_equal=after[0] == (before or ([], []))[0])

    step()
    reps = refit()
    compare("step1", {"bytes": [r.bytes_received + r.bytes_local for r in reps], "seconds": [r.seconds for r in reps]})

    step()
    reps = refit()
    compare("step2_all", {"updated": sum(len(r.updated) for r in reps)})
    with torch.no_grad():
        trainer.model.norm.weight.mul_(1.5)
    reps = refit()
    last = compare("step2_norm", {"updated": sorted({k for r in reps for k in r.updated})})
    reps = refit()
    emit(case="step2_nothing", updated=sorted({k for r in reps for k in r.updated}), bytes=sum(r.bytes_sent for r in reps))

    wrong, _ = adapter_and_layout(family, n_kv_heads=4)
    try:
        sdadapt.vllm.connect(trainer, llm, wrong, layout, bucket_bytes=1 << 20)
        emit(case="mismatch", raised=False)
    except RefitError as e:
        still = served() if rank == 0 else None
        emit(case="mismatch", raised=True, message=str(e)[:600], still_serving=still == last)
    dist.barrier()
    dist.destroy_process_group()
    if out is not None:
        out.close()


def main() -> int:
    family, out_path = sys.argv[1], sys.argv[2]
    rank = int(os.environ.get("RANK", "0"))
    world = 2
    if rank == 0:
        folder = tempfile.mkdtemp(prefix="sdadapt-vllm-live-")
        port = str(29500 + os.getpid() % 2000)
        # the trainer's group meets on its own port (named so that vLLM's processes do not read it)
        os.environ.update(SDADAPT_LIVE_PORT=port, SDADAPT_LIVE_DIR=folder)
        env = dict(os.environ, RANK="1")
        other = subprocess.Popen([sys.executable, __file__, family, out_path + ".rank1"], env=env)
    try:
        return _run(family, out_path, rank, world, other if rank == 0 else None)
    finally:
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)  # the trainer's group's files, once both ranks are done


def _run(family: str, out_path: str, rank: int, world: int, other: subprocess.Popen[bytes] | None) -> int:
    try:
        run_engine_cases(family, out_path, rank, world)
    except BaseException:
        with open(out_path, "a") as f:
            f.write(json.dumps({"case": "(run)", "rank": rank, "error": traceback.format_exc()[-3000:]}) + "\n")
        if other is not None:
            other.kill()
            other.wait(timeout=60)
        return 1
    return other.wait(timeout=300) if other is not None else 0


if __name__ == "__main__":
    sys.exit(main())
