"""Refit into a live vLLM engine, run alone in the vLLM venv (scripts/vllm_venv.py) by
tests/transaction/test_vllm_live.py:

    python tests/support/vllm_live.py llama OUT.json       # or qwen2_tp2, qwen3_moe, deepseek_v3

One engine per run (``LLM(..., weight_transfer_config={"backend": "sdadapt"})``, bfloat16, the
family's TP degree: ``FAMILIES``) in this process, which is also trainer rank 0 of 2 gloo ranks
(rank 1 is this script started again with RANK=1). The trainer is transformers' model of the
family, under FSDP2 over the 2 ranks, trained with AdamW; the adapter comes from its config
(``from_config``'s reading); ``sdadapt.vllm.connect`` plans the refit once. Cases, all against the one
engine, each written as a JSON line to OUT:

- ``shapes``: the engine's raw parameters (vLLM's, before post-processing) have the shapes the
  layout module's ``parameter_shapes()`` gives;
- ``oracle``: refit from the untrained trainer, the staged shards equal what vLLM's own
  ``load_weights`` made of the same HF checkpoint (the engine's weights right after it started,
  read through a fresh model built by vLLM's loader in the worker);
- ``step0``: before any refit, the engine's own load of the checkpoint against transformers:
  greedy tokens and prompt logprobs (within ``TOL``);
- ``step1``: one AdamW step, refit; against vLLM's own path for the trained weights (saved, as
  bfloat16, as an HF checkpoint): the staging equals what vLLM's loader makes of it (dtype and
  bits), and the engine serves exactly what it serves once its own ``reload_weights`` has loaded
  it (the engine is left so); transformers' tokens and logprobs are reported beside;
- ``step2``: delta mode: a second step (every tensor resent), then one norm changed in place
  (only its engine tensor sent), each against vLLM's own path as ``step1``, then nothing
  changed (nothing sent, the engine not called);
- ``mismatch``: a wrong adapter (another head count): RefitError on both ranks before anything
  moves, and the engine still serves the previous weights (the same tokens and logprobs);
- ``vllm_reload``: vLLM's own ``reload_weights`` (``load_weights`` of the checkpoint, through its
  layerwise reload) on the engine sdadapt updated serves the checkpoint again, and
  ``after_vllm_reload``: sdadapt connected anew refits the trainer into it again (against vLLM's
  own path as ``step1``).
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


FAMILIES = {
    # Llama, TP 1: 2 layers, untied head, 2 KV heads
    "llama": dict(cls="LlamaConfig", tp=1, vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False),
    # unlike the others: Qwen2 (q/k/v biases), tied embeddings, 3 layers, hidden 384 (6 heads of 64), an odd vocabulary
    # (padded to 384 by vLLM), one KV head on a TP 2 engine (each rank holds a copy of it)
    "qwen2_tp2": dict(cls="Qwen2Config", tp=2, vocab_size=333, hidden_size=384, intermediate_size=640, num_hidden_layers=3,
                      num_attention_heads=6, num_key_value_heads=1, tie_word_embeddings=True),
    # Qwen3-MoE, TP 1: q_norm / k_norm, 4 experts (top 2) in each layer, the router
    "qwen3_moe": dict(cls="Qwen3MoeConfig", tp=1, vocab_size=300, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                      num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[]),
    # DeepSeek-V3, TP 1 (by hand): MLA (the CPU's MLA kernel takes kv_lora_rank 512 + rope 64 only), a dense layer, then
    # a MoE layer of 4 routed experts (top 2) and a shared one, routed by noaux_tc (the router's correction bias). Its
    # step cases fail: vLLM 0.32's CPU MLA serves other logits than transformers' from its own load (step0, before any
    # refit; all-dense and with V3's head dims too); the refit cases (shapes, oracle, delta, mismatch) are what it shows
    "deepseek_v3": dict(cls="DeepseekV3Config", tp=1, vocab_size=300, hidden_size=256, intermediate_size=512,
                        moe_intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, q_lora_rank=128,
                        kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, n_routed_experts=4,
                        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                        topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True, tie_word_embeddings=False),
}  # fmt: skip


def family_config(family: str):
    import transformers

    if family not in FAMILIES:
        raise SystemExit(f"unknown family {family}; known: {sorted(FAMILIES)}")
    spec = dict(FAMILIES[family])
    cls, tp = spec.pop("cls"), spec.pop("tp")
    return getattr(transformers, cls)(max_position_embeddings=256, initializer_range=0.1, **spec), tp


def adapter_and_layout(family: str, config, tp: int, wrong: bool = False):
    """The adapter from the family's HF config (``wrong``: as if the model had as many KV heads as
    query heads; DeepSeek-V3's: as if its routers had no correction bias), and the layout
    module's ``layout``."""
    from sdadapt.adapters import vllm_deepseek_v3, vllm_llama, vllm_qwen3_moe

    module = {"qwen3_moe": vllm_qwen3_moe, "deepseek_v3": vllm_deepseek_v3}.get(family, vllm_llama)
    shape = module.config_shape(config)
    if wrong and family == "deepseek_v3":
        shape["correction_bias"] = False
    elif wrong:
        shape["n_kv_heads"] = shape["n_heads"]
    return module.build(tp=tp, **shape), module.layout


def expected_shapes(family: str, config, tp: int) -> dict[str, tuple[int, ...]]:
    """What the family's layout module says vLLM's raw parameters on each rank are."""
    from sdadapt.adapters import vllm_deepseek_v3, vllm_llama, vllm_qwen3_moe

    common = dict(n_layers=config.num_hidden_layers, vocab_size=config.vocab_size, dim=config.hidden_size, tp=tp)
    if family == "deepseek_v3":
        shape = vllm_deepseek_v3.config_shape(config)
        del shape["stacked_experts"]
        return vllm_deepseek_v3.parameter_shapes(**common, n_dense_layers=config.first_k_dense_replace, v_head_dim=config.v_head_dim,
                                                 qk_nope_head_dim=config.qk_nope_head_dim, **shape)  # fmt: skip
    if family == "qwen3_moe":
        shape = vllm_qwen3_moe.config_shape(config)
        drop = ("hidden_dim", "stacked_experts", "qkv_bias")
        return vllm_qwen3_moe.parameter_shapes(**common, **{k: v for k, v in shape.items() if k not in drop})
    return vllm_llama.parameter_shapes(**common, **vllm_llama.config_shape(config))


def vllm_loaded(self, folder: str, checkpoint: str | None = None) -> dict[str, object]:
    """In the worker: vLLM's own loader run on an HF checkpoint (``None``: the engine's) into a
    fresh model (raw parameters, before post-processing), compared with the sdadapt staging: the
    parameters whose dtype or bits differ."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import get_tensor_model_parallel_rank
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    from sdadapt._refit.vllm_staging import read

    cfg = self.vllm_config
    served_from = cfg.model_config.model
    cfg.model_config.model = checkpoint or served_from  # for the loader only, put back below
    try:
        with set_current_vllm_config(cfg), set_default_torch_dtype(cfg.model_config.dtype), torch.device("cpu"):
            model = initialize_model(vllm_config=cfg, prefix=f"oracle-{os.path.basename(checkpoint or '')}")  # names its own
            loader = get_model_loader(cfg.load_config)
            loader.load_weights(model, cfg.model_config)
    finally:
        cfg.model_config.model = served_from
    rank = get_tensor_model_parallel_rank()
    staged = read(folder, rank)[1]
    own = dict(model.named_parameters())
    return {"rank": rank, "keys_equal": sorted(own) == sorted(staged),
            "differ": sorted(n for n in own if n in staged and (own[n].dtype != staged[n].dtype
                                                                or not torch.equal(own[n].data, staged[n])))}  # fmt: skip


def repack_experts(self) -> int:
    """In the worker: the CPU MoE layers' packing run again (``repack_cpu_experts``), which vLLM
    0.32's own reload omits (see ``vllm_reload`` in ``check_family``)."""
    from sdadapt._refit.vllm_worker import repack_cpu_experts

    return repack_cpu_experts(list(self.model_runner.get_model().modules()))


def sdadapt_loaders(self) -> list[str]:
    """In the worker: the parameters (live, and as vLLM recorded them for reloading) whose weight
    loader is still, or wraps, sdadapt's copy loader: none may be once an update is finished."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    from sdadapt._refit.vllm_worker import _ours

    left = []
    for name, module in self.model_runner.get_model().named_modules():
        info = LAYERWISE_INFO.get(module)
        recorded = info.restore_metadata[0] if info is not None else {}
        for attr, param in [*module.named_parameters(recurse=False), *recorded.items()]:
            if _ours(getattr(param, "weight_loader", None)):
                left.append(f"{name}.{attr}")
    return left


def run_engine_cases(family: str, out_path: str, rank: int, world: int) -> None:
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import sdadapt.vllm
    from sdadapt.errors import RefitError

    config, tp = family_config(family)
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
        # vLLM's CPU backend binds each TP worker's threads to a NUMA node of its own by default; a
        # machine of one node (this one) serves TP > 1 only with the binding off
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        llm = LLM(model=ckpt, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, max_model_len=128,
                  tensor_parallel_size=tp, gpu_memory_utilization=0.05, weight_transfer_config={"backend": "sdadapt"})  # fmt: skip
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['SDADAPT_LIVE_PORT']}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=900))  # fmt: skip
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    trainer = transformers.AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32)
    fully_shard(trainer, mesh=mesh)
    opt = torch.optim.AdamW(trainer.parameters(), lr=0.005)
    tokens = torch.tensor([[1, 5, 9, 33, 70, 120, 200, 7, 8, 9]])

    def step() -> None:
        trainer(tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():  # DeepSeek-V3's routers: the correction bias moves by load balancing, not by gradients
            for name, buf in trainer.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buf.add_(torch.linspace(-0.01, 0.01, buf.numel()))

    def reference_model(full: dict[str, torch.Tensor], compute: torch.dtype) -> torch.nn.Module:
        """transformers with the trainer's weights rounded to bfloat16, computing in ``compute``."""
        ref = transformers.AutoModelForCausalLM.from_config(config).to(compute)
        ref.load_state_dict({k: v.bfloat16().to(compute) for k, v in full.items()})
        return ref.eval()

    def reference(ref: torch.nn.Module) -> tuple[list[list[int]], list[list[float]]]:
        """``ref``'s greedy tokens and prompt logprobs."""
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

    def near_greedy(ref: torch.nn.Module, toks: list[list[int]]) -> list[float]:
        """Per prompt, how far below ``ref``'s best logprob the worst of ``toks`` is, each scored
        against ``TOL`` (<= 1: every token is ``ref``'s greedy pick up to bfloat16's rounding, as
        where two candidates tie within it and the two frameworks pick differently)."""
        worst = []
        with torch.no_grad():
            for p, t in zip(PROMPTS, toks, strict=True):
                lp = torch.log_softmax(ref(torch.tensor([p + t])).logits.float()[0], -1)
                rows = lp[len(p) - 1 : len(p) - 1 + len(t)]
                best = rows.max(-1).values
                gap = best - rows.gather(-1, torch.tensor(t)[:, None])[:, 0]
                worst.append(float((gap / (TOL[0] * best.abs() + TOL[1])).max()))
        return worst

    def diff(a: list, b: list) -> float:
        return max(abs(p - q) for x, y in zip(a, b, strict=True) for p, q in zip(x, y, strict=True))

    def vllm_own(case: str, ref16: torch.nn.Module, got: tuple[list, list], staging: str) -> dict[str, object]:
        """vLLM's own path for the weights just refit: the trainer's, rounded to bfloat16 as the refit
        rounds them, saved as an HF checkpoint, which vLLM's loader turns into raw parameters
        (compared with the staging, dtype and bits) and its ``reload_weights`` into the engine's
        (whose greedy tokens and prompt logprobs are then compared with the refit's ``got``). The
        engine then holds what the refit wrote, so delta mode goes on from there."""
        assert llm is not None
        path = os.path.join(folder, case)
        ref16.save_pretrained(path)
        oracle = llm.collective_rpc(vllm_loaded, args=(staging, path))
        llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
        llm.collective_rpc(repack_experts)
        own = served()
        return dict(own_differ=sorted({n for o in oracle for n in o["differ"]}),
                    own_keys_equal=all(o["keys_equal"] for o in oracle), own_tokens_equal=own[0] == got[0],
                    own_logprobs_equal=own[1] == got[1], own_logprob_diff=diff(own[1], got[1]))  # fmt: skip

    def compare(case: str, extra: dict | None = None, staging: str | None = None) -> tuple[list, list]:
        """The engine's greedy tokens and prompt logprobs against transformers' with the trainer's
        weights; ``staging``: the refit's staging, for a comparison with vLLM's own path too
        (``vllm_own``)."""
        # collective: every rank (buffers, DeepSeek-V3's correction biases, are plain tensors on each)
        full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in trainer.state_dict().items()}
        got = served() if rank == 0 else None
        if rank == 0:
            assert got is not None
            ref16, ref32 = reference_model(full, torch.bfloat16), reference_model(full, torch.float32)
            want, want32 = reference(ref16), reference(ref32)
            within = all(abs(p - q) <= TOL[0] * abs(q) + TOL[1] for x, y in zip(got[1], want[1], strict=True)
                         for p, q in zip(x, y, strict=True))  # fmt: skip
            own = vllm_own(case, ref16, got, staging) if staging is not None else {}
            emit(case=case, tokens_equal=got[0] == want[0], got=got[0], want=want[0], logprob_diff=diff(got[1], want[1]),
                 logprob_within=within, tol=list(TOL),
                 tokens_equal_fp32=got[0] == want32[0], logprob_diff_fp32=diff(got[1], want32[1]),
                 ref_bf16_vs_fp32=diff(want[1], want32[1]), lp=got[1][0][:4], lp_want=want[1][0][:4],
                 near_greedy=max(near_greedy(ref32, got[0])), **own, **(extra or {}))  # fmt: skip
        return got or ([], [])

    adapter, layout = adapter_and_layout(family, config, tp)
    before = served() if rank == 0 else None
    refit = sdadapt.vllm.connect(trainer, llm, adapter, layout, bucket_bytes=1 << 20, delta=True)
    if rank == 0:
        from sdadapt._refit.vllm_staging import read

        want = {k: list(v) for k, v in expected_shapes(family, config, tp).items()}
        got = [{n: list(s) for n, _, s, _ in read(refit.staging, j)[0].params} for j in range(tp)]
        emit(case="shapes", equal=all(g == want for g in got), tp=refit.tp, got=got[0])
    compare("step0")
    reports = refit()  # the untrained weights: the staging equals vLLM's own loading of the checkpoint
    if rank == 0:
        assert llm is not None
        oracle = llm.collective_rpc(vllm_loaded, args=(refit.staging,))  # each engine rank's
        emit(case="oracle", ranks=[o["rank"] for o in oracle], keys_equal=all(o["keys_equal"] for o in oracle),
             differ=sorted({n for o in oracle for n in o["differ"]}),
             bytes=[r.bytes_received + r.bytes_local for r in reports])  # fmt: skip
        after = served()
        emit(case="unchanged_serves_same", tokens_equal=after[0] == (before or ([], []))[0])

    step()
    reps = refit()
    compare("step1", {"bytes": [r.bytes_received + r.bytes_local for r in reps], "seconds": [r.seconds for r in reps]}, refit.staging)

    step()
    reps = refit()
    compare("step2_all", {"updated": sum(len(r.updated) for r in reps)}, refit.staging)
    with torch.no_grad():
        trainer.model.norm.weight.mul_(1.5)
    reps = refit()
    last = compare("step2_norm", {"updated": sorted({k for r in reps for k in r.updated})}, refit.staging)
    reps = refit()
    if rank == 0:
        assert llm is not None
        emit(case="loaders_restored", left=sorted({n for got in llm.collective_rpc(sdadapt_loaders) for n in got}))
    emit(case="step2_nothing", updated=sorted({k for r in reps for k in r.updated}), bytes=sum(r.bytes_sent for r in reps))

    wrong, _ = adapter_and_layout(family, config, tp, wrong=True)
    try:
        sdadapt.vllm.connect(trainer, llm, wrong, layout, bucket_bytes=1 << 20)
        emit(case="mismatch", raised=False)
    except RefitError as e:
        still = served() if rank == 0 else None
        emit(case="mismatch", raised=True, message=str(e)[:600], still_serving=still == last)

    # vLLM's own reload (its load_weights from the checkpoint) on the engine sdadapt updated: it
    # serves the checkpoint again; then sdadapt, connected anew, refits the trainer into it again
    if rank == 0:
        assert llm is not None
        try:
            llm.collective_rpc("reload_weights", kwargs={"weights_path": ckpt})
            emit(case="vllm_reload", raised=False, serves_checkpoint=served() == before)
        except Exception as e:  # noqa: BLE001 - reported as the case's outcome
            emit(case="vllm_reload", raised=True, message=f"{type(e).__name__}: {e}"[:1500])
    again = sdadapt.vllm.connect(trainer, llm, adapter, layout, bucket_bytes=1 << 20)
    again()
    compare("after_vllm_reload", staging=again.staging)
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
