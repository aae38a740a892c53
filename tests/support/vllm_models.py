"""The shipped vLLM layouts against vLLM's own model code, run alone in the vLLM venv
(scripts/vllm_venv.py) by tests/transaction/test_vllm_live.py:

    python tests/support/vllm_models.py OUT.json [CASE ...]

No engine is started: for each case (``CASES``: a tiny HF config, the layout module, the TP
degree, FP8 or not) and each TP rank, vLLM's model class is built on the CPU by vLLM's own
``initialize_model``, with vLLM's tensor-parallel group of one process standing in for rank ``r``
of ``tp`` (its size and rank are all the layers read while they create their weights and load
them). Then, one JSON line per case and rank:

- ``created``: the parameters vLLM's layers created (``named_parameters()`` before any
  post-processing), names and shapes, against the layout module's ``parameter_shapes()``;
- ``staged``: what the sdadapt backend would lay out in its staging on a live engine of this model
  (``raw_parameters``, from what vLLM recorded for reloading), against the same, and its dtypes
  against those of the parameters vLLM's layers created;
- ``loaded``: vLLM's own ``load_weights`` fed the HF checkpoint of a random transformers model of
  the config (for FP8, each tensor block-quantized as DeepSeek-V3's releases are), against
  ``sdadapt.refit_plan`` with the layout module's adapter and layout writing the same rank's
  tensors from the same checkpoint: the tensors whose bits differ.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

BLOCK = (128, 128)
FLOAT32 = "e_score_correction_bias"
"""The tensors DeepSeek-V3's release holds in float32 (its routers' correction biases), as vLLM does."""
LLAMA = dict(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64)
DSV3 = dict(vocab_size=300, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=64,
            v_head_dim=64, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
            n_group=1, topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True)


class Case(NamedTuple):
    config: str  # the transformers config class
    fields: dict[str, Any]
    module: str  # the layout module
    tp: int = 2
    fp8: bool = False  # served block-quantized (quant_method fp8, block 128 x 128)
    ep: bool = False  # vLLM's enable_expert_parallel: the experts spread whole over the TP ranks


MOE = dict(LLAMA, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[])
CASES = {
    "llama": Case("LlamaConfig", LLAMA, "vllm_llama"),
    "llama_bias": Case("LlamaConfig", dict(LLAMA, attention_bias=True, mlp_bias=True), "vllm_llama"),
    "qwen2_kv1": Case("Qwen2Config", dict(LLAMA, num_key_value_heads=1, tie_word_embeddings=True), "vllm_llama"),
    "qwen3": Case("Qwen3Config", LLAMA, "vllm_llama"),
    "mistral": Case("MistralConfig", LLAMA, "vllm_llama"),
    "qwen3_moe": Case("Qwen3MoeConfig", MOE, "vllm_qwen3_moe"),
    "qwen3_moe_ep": Case("Qwen3MoeConfig", MOE, "vllm_qwen3_moe", ep=True),
    "deepseek_v3": Case("DeepseekV3Config", DSV3, "vllm_deepseek_v3"),
    "deepseek_v3_ep": Case("DeepseekV3Config", DSV3, "vllm_deepseek_v3", ep=True),
    "llama_fp8": Case("LlamaConfig", dict(LLAMA, num_key_value_heads=4, intermediate_size=1024), "vllm_llama", fp8=True),
    "deepseek_v3_fp8": Case("DeepseekV3Config", dict(DSV3, moe_intermediate_size=256), "vllm_deepseek_v3", fp8=True),
}


def hf_checkpoint(case: str, folder: str) -> dict[str, torch.Tensor]:
    """A random transformers model of the case's config saved in ``folder`` (config.json, with
    vLLM's FP8 ``quantization_config`` where the case is FP8); returns its checkpoint's tensors
    (float32: the keys and layout of the HF files, per-expert weights included)."""
    import safetensors.torch
    import transformers

    case_ = CASES[case]
    config = getattr(transformers, case_.config)(max_position_embeddings=256, initializer_range=0.1, **case_.fields)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # a correction bias of zeros would not show a misplaced one
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_()
    model.save_pretrained(folder)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            tensors |= safetensors.torch.load_file(os.path.join(folder, f))
    if case_.fp8:
        with open(os.path.join(folder, "config.json")) as f:
            cfg = json.load(f)
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                      "weight_block_size": list(BLOCK)}  # fmt: skip
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(cfg, f)
    return {k: v.float() for k, v in tensors.items()}


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` (2-D) as a block-quantized FP8 release holds it: e4m3 values and float32 scales per
    ``BLOCK``, each scale the block's largest magnitude over 448 (1 for a block of zeros)."""
    rows, cols = w.shape
    br, bc = BLOCK
    nr, nc = -(-rows // br), -(-cols // bc)
    padded = torch.zeros(nr * br, nc * bc, dtype=torch.float32)
    padded[:rows, :cols] = w
    blocks = padded.view(nr, br, nc, bc)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.view(nr * br, nc * bc)[:rows, :cols].contiguous(), scale


def fp8_checkpoint(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's decoder-layer linear weights block-quantized (``<name>_scale_inv`` beside
    each), the MoE routers, norms, embeddings and head as they are: DeepSeek-V3's FP8 release."""
    out = {}
    for k, v in hf.items():
        if k.startswith("model.layers.") and v.dim() == 2 and not k.endswith("mlp.gate.weight"):
            out[k], out[k + "_scale_inv"] = quantize_blocks(v)
        else:
            out[k] = v if k.endswith(FLOAT32) else v.bfloat16()
    return out


def adapter_and_shapes(case: str, config, tp: int, rank: int):
    """The layout module's adapter, this rank's layout and its ``parameter_shapes()`` for the
    case's HF config (read as a user would: ``from_config`` / ``config_shape``)."""
    from sdadapt.adapters import vllm_deepseek_v3, vllm_fp8, vllm_llama, vllm_qwen3_moe

    name, fp8, ep = CASES[case].module, CASES[case].fp8, CASES[case].ep
    common = dict(n_layers=config.num_hidden_layers, vocab_size=config.vocab_size, dim=config.hidden_size, tp=tp)
    if name == "vllm_llama":
        shape = vllm_llama.config_shape(config)
        adapter, layout = vllm_llama.build(tp=tp, **shape), vllm_llama.layout(tp, rank)
        shapes = vllm_llama.parameter_shapes(**common, **shape)
    elif name == "vllm_qwen3_moe":
        shape = vllm_qwen3_moe.config_shape(config, stacked_experts=False)
        adapter, layout = vllm_qwen3_moe.build(tp=tp, expert_parallel=ep, **shape), vllm_qwen3_moe.layout(tp, rank, expert_parallel=ep)
        drop = ("hidden_dim", "stacked_experts", "qkv_bias")
        shapes = vllm_qwen3_moe.parameter_shapes(**common, expert_parallel=ep, **{k: v for k, v in shape.items() if k not in drop})
    else:
        shape = vllm_deepseek_v3.config_shape(config, stacked_experts=False)
        adapter, layout = vllm_deepseek_v3.build(tp=tp, expert_parallel=ep, **shape), vllm_deepseek_v3.layout(tp, rank, expert_parallel=ep)
        del shape["stacked_experts"]
        shapes = vllm_deepseek_v3.parameter_shapes(**common, n_dense_layers=config.first_k_dense_replace, expert_parallel=ep,
                                                   qk_nope_head_dim=config.qk_nope_head_dim, v_head_dim=config.v_head_dim,
                                                   **shape)  # fmt: skip
    if fp8:
        adapter, layout = adapter + vllm_fp8.build(block=BLOCK), vllm_fp8.layout(layout, BLOCK)
        shapes = vllm_fp8.parameter_shapes(shapes, block=BLOCK)
    return adapter, layout, shapes


@contextlib.contextmanager
def tp_rank(tp: int, rank: int) -> Iterator[None]:
    """vLLM's tensor-parallel group, of this one process, answering as rank ``rank`` of ``tp``
    while vLLM's layers create their weights and load them (their loaders ask it which shard to
    take); a world of one process is set up on first use, its expert-parallel group included."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    if parallel_state._TP is None:
        port = 29000 + os.getpid() % 3000
        with set_current_vllm_config(VllmConfig()):  # no model config: the EP group is made too
            parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                                        distributed_init_method=f"tcp://127.0.0.1:{port}")  # fmt: skip
            parallel_state.ensure_model_parallel_initialized(1, 1)
        ONE_RANK.append(parallel_state._TP)
    group = copy.copy(ONE_RANK[0])
    group.world_size, group.rank_in_group = tp, rank
    parallel_state._TP = group
    try:
        yield
    finally:
        parallel_state._TP = ONE_RANK[0]


ONE_RANK: list[object] = []


def vllm_config(folder: str, ep: bool):
    """vLLM's engine configuration for the checkpoint in ``folder`` (``ep``: expert parallel)."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=folder, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, max_model_len=128,
                      load_format="dummy", enable_expert_parallel=ep).create_engine_config()  # fmt: skip


def vllm_model(cfg, tag: str) -> torch.nn.Module:
    """vLLM's model of ``cfg``'s checkpoint, built (not loaded) as vLLM's loader builds it
    in a worker (``initialize_model`` under the model's dtype): its parameters as its layers created them, vLLM's reload metadata
    recorded. Its FP8 linear layers' kernel choice is skipped: on a CPU without AMX vLLM has no
    block-FP8 kernel and refuses at that point, after the weights' shapes are fixed (no kernel
    runs here)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.quantization import fp8
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    kernel = fp8.init_fp8_linear_kernel
    fp8.init_fp8_linear_kernel = lambda *args, **kwargs: None
    try:
        with set_current_vllm_config(cfg), set_default_torch_dtype(cfg.model_config.dtype), torch.device("cpu"):
            return initialize_model(vllm_config=cfg, prefix=tag)  # a prefix of its own: vLLM names each attention layer once
    finally:
        fp8.init_fp8_linear_kernel = kernel


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def diff_shapes(got: dict[str, tuple[int, ...]], want: dict[str, tuple[int, ...]]) -> dict[str, object]:
    return {"missing": sorted(set(want) - set(got)), "extra": sorted(set(got) - set(want)),
            "shape": {k: [list(got[k]), list(want[k])] for k in sorted(set(got) & set(want)) if got[k] != want[k]}}  # fmt: skip


def check_case(case: str, tmp: str) -> list[dict[str, object]]:
    """The case's rows, one per TP rank."""
    import transformers

    tp, fp8 = CASES[case].tp, CASES[case].fp8
    folder = os.path.join(tmp, case)
    hf = hf_checkpoint(case, folder)
    config = transformers.AutoConfig.from_pretrained(folder)
    files = fp8_checkpoint(hf) if fp8 else {k: v if k.endswith(FLOAT32) else v.bfloat16() for k, v in hf.items()}
    trainer = dict(hf)
    if config.tie_word_embeddings:  # the trainer holds the head, tied (the files do not)
        trainer["lm_head.weight"] = trainer["model.embed_tokens.weight"]
    cfg = vllm_config(folder, CASES[case].ep)
    rows = []
    for rank in range(tp):
        with tp_rank(tp, rank):
            rows.append(check_rank(case, cfg, config, files, trainer, rank))
    return rows


def check_rank(case: str, cfg, config, files: dict[str, torch.Tensor], trainer: dict[str, torch.Tensor],
               rank: int) -> dict[str, object]:  # fmt: skip
    """One TP rank: vLLM's model built and loaded by vLLM from ``files``, sdadapt's refit of
    ``trainer`` into tensors shaped as the sdadapt staging would be, compared."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    import sdadapt
    from sdadapt._refit.vllm_worker import staged_parameters

    tp = CASES[case].tp
    adapter, layout, want = adapter_and_shapes(case, config, tp, rank)
    model = vllm_model(cfg, f"{case}{rank}")
    attention = {n for n, m in model.named_modules() if is_deferred_attention_layer(m)}
    created = {n: tuple(p.shape) for n, p in model.named_parameters() if n.rpartition(".")[0] not in attention}
    params = dict(model.named_parameters())
    staged = {n: s for n, _, s in staged_parameters(model)}
    dtypes = sorted(n for n, dt, _ in staged_parameters(model) if n in params and dt != params[n].dtype)

    def blank(t: torch.Tensor) -> torch.Tensor:  # NaN where floats hold one (a value nobody wrote shows)
        return t.fill_(float("nan")) if t.is_floating_point() and t.element_size() > 1 else t.zero_()

    with torch.no_grad():
        for p in params.values():
            blank(p.data)
        engine = {n: blank(torch.empty_like(params[n])) for n in staged if n in params}
        model.load_weights(iter(files.items()))
    sdadapt.refit_plan(trainer, engine, adapter, engine_layout=layout)()
    differ = sorted(n for n in engine if not torch.equal(bits(engine[n]), bits(params[n].data)))
    return {"case": case, "rank": rank, "tp": tp, "created": diff_shapes(created, want), "staged": diff_shapes(staged, want),
            "staged_dtype_differ": dtypes, "loaded_differ": differ, "n": len(staged)}  # fmt: skip


def main() -> int:
    out_path, cases = sys.argv[1], sys.argv[2:] or list(CASES)
    tmp = tempfile.mkdtemp(prefix="sdadapt-vllm-models-")
    failed = 0
    try:
        with open(out_path, "w") as out:
            for case in cases:
                try:
                    start = time.perf_counter()
                    rows = check_case(case, tmp)
                    print(f"{case}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
                except Exception:  # noqa: BLE001 - reported as the case's outcome
                    rows, failed = [{"case": case, "error": traceback.format_exc()[-3000:]}], failed + 1
                for row in rows:
                    out.write(json.dumps(row) + "\n")
                    out.flush()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
