"""transformers models as targets: ``sdadapt.load(hf_model, folder)`` with no adapter.

For each family (dense and MoE, tiny configs), the test process builds the model from its
config, puts random values in every parameter (HF's ones/zeros norms would hide a misplaced
slice), writes it with ``save_pretrained`` (sharded for some) and loads it back with
``from_pretrained``: that model's state dict and logits are the reference. One launched gloo
group of 4 ranks then, for every family and on each mesh in turn (FSDP2 x TP on a 2x2 mesh, then
FSDP2 on ranks 0-2, uneven shards, while rank 3 waits): builds a fresh model on meta, parallelises
it, ``sdadapt.load(model, folder)``, and compares every parameter's full tensor with the reference
bit for bit and the logits with the reference's.

TP plans: each family's own ``config.base_model_tp_plan`` (transformers' TP plan), its
``colwise`` / ``rowwise`` / ``colwise_gather_output`` / ``rowwise_split_input`` entries on
decoder-layer ``nn.Linear`` modules applied with torch's ``ColwiseParallel`` /
``RowwiseParallel`` (the last two with a replicated output / input): attention and dense or
shared-expert MLPs of 11 families, Phi-3's and GPT-NeoX's fused qkv included. GPT-2 has no plan
and GPT-OSS's covers only its embedding; entries on parameters (fused experts'
``packed_colwise``), embeddings and norms are left to FSDP. MoE experts' fused ``gate_up_proj``
``[E, 2F, D]`` is sharded by FSDP2 along dim 1 where that divides (``shard_placement_fn``), so
shards cut across the stacked and concatenated parts. Logits: bit-equal where no TP applies
(FSDP2 gathers the exact parameters and the computation is the reference's, both on one
thread); with TP the row-wise projections sum partial products across ranks in another order,
so they agree to 1e-5 (measured: at most 9e-7).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from support.compat_cases import COMMON  # noqa: E402  (the tiny config the compat venvs' cases use too)
from support.dist_helper import run_distributed  # noqa: E402

import sdadapt  # noqa: E402

MOE = dict(num_experts_per_tok=2, moe_intermediate_size=24)

# family -> (model_type, config overrides, save_pretrained shard size)
FAMILIES: dict[str, tuple[str, dict[str, Any], str | None]] = {
    "llama": ("llama", {}, "20KB"),
    "mistral": ("mistral", {}, None),
    "qwen2": ("qwen2", {}, None),
    "qwen3": ("qwen3", {}, "30KB"),
    "gemma2": ("gemma2", {"tie_word_embeddings": True}, None),
    "phi3": ("phi3", {"pad_token_id": 0}, None),
    "gpt_neox": ("gpt_neox", {"rotary_pct": 0.5, "tie_word_embeddings": False}, None),
    "gpt2": ("gpt2", {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64}, None),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}, "40KB"),
    "qwen3_moe": ("qwen3_moe", {"num_experts": 4, **MOE, "decoder_sparse_step": 1}, None),
    "olmoe": ("olmoe", {"num_experts": 4, "num_experts_per_tok": 2}, None),
    "deepseek_v3": (
        "deepseek_v3",
        {
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            **MOE,
            "first_k_dense_replace": 1,
            "num_key_value_heads": 4,
            "n_group": 1,
            "topk_group": 1,
            "q_lora_rank": 16,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 8,
        },
        None,
    ),
    "gpt_oss": ("gpt_oss", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8}, None),
}
FAMILY_NAMES = list(FAMILIES)
NO_TP_PLAN = ("gpt2", "gpt_oss")  # no decoder-layer entries in config.base_model_tp_plan
MOE_FAMILIES = ("mixtral", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")
INPUT = torch.tensor([[3, 17, 42, 5, 88, 61, 7, 29], [1, 2, 3, 4, 5, 6, 7, 8]])


def _config(family: str) -> Any:
    model_type, overrides, _ = FAMILIES[family]
    kw: dict[str, Any] = dict(COMMON) if family != "gpt2" else {"vocab_size": COMMON["vocab_size"]}
    kw.update(overrides)
    cfg = transformers.AutoConfig.for_model(model_type, **kw)
    cfg._attn_implementation = "eager"
    return cfg


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("hf_models"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers compute on one thread: the same reductions, the same bits
    try:
        for i, family in enumerate(FAMILY_NAMES):
            torch.manual_seed(i)
            model = transformers.AutoModelForCausalLM.from_config(_config(family))
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.1)
            folder = os.path.join(root, family)
            shard = FAMILIES[family][2]
            model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
            ref = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
            with torch.no_grad():
                logits = ref(INPUT).logits
            torch.save({"state": ref.state_dict(), "logits": logits}, os.path.join(root, f"{family}.ref.pt"))
    finally:
        torch.set_num_threads(threads)
    return root


# ----------------------------------------------------------------------------------------------
# worker side
# ----------------------------------------------------------------------------------------------
# transformers' own TP plan styles (``config.base_model_tp_plan``) as torch's parallel styles
TP_STYLES = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input")


def _tp_styles(model: Any) -> dict[str, Any]:
    """The model's own ``base_model_tp_plan`` entries for decoder-layer ``nn.Linear`` modules, as
    torch's ``ColwiseParallel`` / ``RowwiseParallel`` (``*_gather_output``: the output
    replicated; ``*_split_input``: the input replicated). Entries on parameters (fused experts:
    ``packed_colwise``), embeddings and norms are left to FSDP."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    make = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    }
    plan = getattr(model.config, "base_model_tp_plan", None) or {}
    return {k.removeprefix("layers.*."): make[v] for k, v in plan.items() if k.startswith("layers.*.") and v in make}


def _parallelize(model: Any, family: str, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module

    dp = mesh["dp"] if mesh.ndim == 2 else mesh
    styles = _tp_styles(model) if mesh.ndim == 2 else {}
    layers = model.base_model.h if family == "gpt2" else model.base_model.layers
    for layer in layers:
        here = {k: make() for k, make in styles.items() if isinstance(_get(layer, k), torch.nn.Linear)}
        if here:
            parallelize_module(layer, mesh["tp"], here)

        def placement(p: torch.nn.Parameter) -> Shard:
            # experts' stacked and fused [E, 2F, D] / [E, D, F] sharded across their parts (FSDP2
            # shards dims other than 0 only evenly)
            return Shard(1) if p.ndim == 3 and p.shape[1] % dp.size() == 0 else Shard(0)

        fully_shard(layer, mesh=dp, shard_placement_fn=placement)
    fully_shard(model, mesh=dp)


def _is_tp(module: Any) -> bool:
    """``module`` is an ``nn.Linear`` whose weight parallelize_module sharded over the TP mesh."""
    from torch.distributed.tensor import DTensor

    w = getattr(module, "weight", None)
    return isinstance(module, torch.nn.Linear) and isinstance(w, DTensor) and w.device_mesh.ndim == 2


def _get(module: Any, path: str) -> Any:
    for part in path.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def hf_worker(root: str) -> dict[str, Any]:
    """On 4 ranks: every family on the 2x2 (dp, tp) mesh, then on the 3-rank mesh of ranks 0-2
    (rank 3 waits), with the failing derivation there. Returns ``{"2x2": ..., "3": ...}``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    out = {"2x2": _families(root, init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")), None)}
    mesh3 = DeviceMesh("cpu", torch.arange(3), mesh_dim_names=("dp",))  # every rank takes part in creating it
    if dist.get_rank() < 3:
        out["3"] = _families(root, mesh3, mesh3.get_group())
        out["3"]["one_rank_unmapped"] = _one_rank_unmapped(root, mesh3, mesh3.get_group())
    dist.barrier()
    return out


def _families(root: str, mesh: Any, group: Any) -> dict[str, Any]:
    """Every family loaded on ``mesh`` (whose ranks form ``group``; None: all of them)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {}
    for family in FAMILY_NAMES:
        folder = os.path.join(root, family)
        ref = torch.load(os.path.join(root, f"{family}.ref.pt"), weights_only=True)
        cfg = transformers.AutoConfig.from_pretrained(folder)
        cfg._attn_implementation = "eager"
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
        _parallelize(model, family, mesh)
        report = sdadapt.load(model, folder, process_group=group)
        bad = []
        for k, v in model.state_dict().items():
            full = v.full_tensor() if isinstance(v, DTensor) else v
            if not torch.equal(full, ref["state"][k]):
                bad.append(k)
        placements = sorted({str(tuple(v.placements)) for v in model.state_dict().values() if isinstance(v, DTensor)})
        model.eval()
        with torch.no_grad():
            logits = model(INPUT).logits
        logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
        diff = (logits - ref["logits"]).abs().max().item()
        out[family] = {
            "tp_modules": sum(_is_tp(m) for m in model.modules()),
            "bad": bad,
            "keys": report.keys_loaded,
            "rules": len(sdadapt.hf_adapter(model, folder).rules),
            "logits_equal": bool(torch.equal(logits, ref["logits"])),
            "logits_diff": diff,
            "placements": placements,
        }
        dist.barrier(group=group)
    return out


def _one_rank_unmapped(root: str, mesh: Any, group: Any) -> tuple[str, str, bool]:
    """Rank 0 alone has a mapping with an operation sdadapt cannot map: every rank raises,
    none hangs, and the model is left on meta."""
    import torch.distributed as dist
    from transformers import conversion_mapping as cm
    from transformers.core_model_loading import PermuteForRope, WeightConverter

    folder = os.path.join(root, "llama")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder))
    _parallelize(model, "llama", mesh)
    if dist.get_rank() == 0:
        converter = WeightConverter("self_attn.q_proj.weight", "self_attn.q_proj.weight", [PermuteForRope()])
        cm.register_checkpoint_conversion_mapping("LlamaForCausalLM", [converter], overwrite=True)
    try:
        sdadapt.load(model, folder, process_group=group)
    except sdadapt.SdadaptError as e:
        return type(e).__name__, str(e), all(p.to_local().is_meta for p in model.parameters())
    return "", "no error", False


@pytest.fixture(scope="module")
def results(checkpoints: str) -> list[dict[str, Any]]:
    ranks = run_distributed(hf_worker, 4, checkpoints, timeout=600)
    assert "3" not in ranks[3]  # rank 3 is outside the 3-rank mesh
    return ranks


@pytest.fixture(scope="module")
def results_2x2(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r["2x2"] for r in results]


@pytest.fixture(scope="module")
def results_3(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r["3"] for r in results[:3]]


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_fsdp_tp_2x2(results_2x2: list[dict[str, Any]], family: str) -> None:
    for rank, res in enumerate(results_2x2):
        r = res[family]
        assert r["bad"] == [], f"rank {rank}: {r['bad']}"
        # TP's row-wise partial sums are added in another order than the one-process matmul
        tp = r["tp_modules"] > 0
        assert tp == (family not in NO_TP_PLAN), r  # the family's own plan was applied
        assert r["logits_equal"] or (tp and r["logits_diff"] < 1e-5), r
        assert r["keys"] > 0
        _check_layout(family, r["placements"], tp)


def _check_layout(family: str, placements: list[str], tp: bool) -> None:
    """The mesh cut what the test means it to cut: TP shards under FSDP (``_StridedShard``),
    experts across their fused parts (``Shard(dim=1)``)."""
    if tp:
        assert any("_StridedShard" in p for p in placements), placements
    if family in MOE_FAMILIES:
        assert any("Shard(dim=1)" in p for p in placements), placements


def test_one_rank_failing_to_derive_stops_all(results_3: list[dict[str, Any]]) -> None:
    kinds = [res["one_rank_unmapped"][0] for res in results_3]
    assert kinds == ["AdapterError", "RemoteRankError", "RemoteRankError"], results_3
    for _, message, still_meta in (res["one_rank_unmapped"] for res in results_3):
        assert "PermuteForRope" in message and "LlamaForCausalLM" in message, message
        assert still_meta


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_fsdp_3_uneven(results_3: list[dict[str, Any]], family: str) -> None:
    for rank, res in enumerate(results_3):
        r = res[family]
        assert r["bad"] == [], f"rank {rank}: {r['bad']}"
        assert r["logits_equal"], r  # FSDP gathers the exact parameters: the same computation
        _check_layout(family, r["placements"], False)


# ----------------------------------------------------------------------------------------------
# one process: the operations, prefixes and errors, with transformers' own loading as the oracle
# ----------------------------------------------------------------------------------------------
@pytest.fixture
def registered() -> Any:
    """Register conversion mappings for this test only (transformers keeps them globally)."""
    from transformers import conversion_mapping as cm

    names: list[str] = []

    def register(name: str, transforms: list[Any]) -> None:
        cm.register_checkpoint_conversion_mapping(name, transforms, overwrite=True)
        names.append(name)

    yield register
    cache = cm._checkpoint_conversion_mapping_cache
    for name in names:
        cache.pop(name, None)
        cm.USER_REGISTERED_MAPPINGS.discard(name)


def _tiny_llama(tmp: str, **overrides: Any) -> tuple[Any, str]:
    cfg = transformers.AutoConfig.for_model("llama", **{**COMMON, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    folder = os.path.join(tmp, "llama")
    model.save_pretrained(folder)
    return model, folder


def _meta(folder: str, cls: Any = None) -> Any:
    cfg = transformers.AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg) if cls is None else cls(cfg)


def test_operations_match_transformers(tmp_path: Any, registered: Any) -> None:
    """A checkpoint with an interleaved fused gate|up (``Interleave`` + ``Chunk``), a transposed
    down projection (``Transpose``) and a fused q|k|v (``Concatenate`` inverse: ``Split`` by the
    model's sizes): sdadapt's load equals ``from_pretrained`` with the same registered mapping."""
    from safetensors.torch import load_file, save_file
    from transformers.core_model_loading import Chunk, Interleave, Split, Transpose, WeightConverter

    _, folder = _tiny_llama(str(tmp_path))
    path = os.path.join(folder, "model.safetensors")
    sd = load_file(path)
    out = {}
    for k, v in sd.items():
        if k.endswith("mlp.gate_proj.weight"):
            up = sd[k.replace("gate_proj", "up_proj")]
            out[k.replace("gate_proj", "w13")] = torch.stack([v, up], 1).reshape(-1, v.shape[1])  # g0,u0,g1,u1..
        elif k.endswith("mlp.down_proj.weight"):
            out[k.replace("down_proj", "down_t")] = v.t().contiguous()
        elif k.endswith("self_attn.q_proj.weight"):
            parts = [sd[k.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
            out[k.replace("q_proj", "qkv")] = torch.cat(parts)
        elif not k.endswith(("mlp.up_proj.weight", "k_proj.weight", "v_proj.weight")):
            out[k] = v
    save_file(out, path, metadata={"format": "pt"})
    registered(
        "LlamaForCausalLM",
        [
            WeightConverter("mlp.w13.weight", ["mlp.gate_proj.weight", "mlp.up_proj.weight"], [Interleave(dim=0), Chunk(dim=0)]),
            WeightConverter("mlp.down_t.weight", "mlp.down_proj.weight", [Transpose(0, 1)]),
            WeightConverter(
                "self_attn.qkv.weight",
                ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
                [Split(dim=0)],
            ),
        ],
    )
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder)
    model = _meta(folder)
    adapter = sdadapt.hf_adapter(model, folder)
    kinds = {r.kind for r in adapter.rules}
    assert {"deinterleave", "split", "transpose"} <= kinds, adapter.describe()
    assert sdadapt.hf_adapter(model).rules == adapter.rules  # from the keys save_pretrained writes
    sdadapt.load(model, folder)
    want = ref.state_dict()
    assert [k for k, v in model.state_dict().items() if not torch.equal(v, want[k])] == []
    assert sorted(want) == sorted(model.state_dict())


def test_unmapped_operation_is_named(tmp_path: Any, registered: Any) -> None:
    from transformers.core_model_loading import PermuteForRope, WeightConverter

    _, folder = _tiny_llama(str(tmp_path))
    registered("LlamaForCausalLM", [WeightConverter("self_attn.q_proj.weight", "self_attn.q_proj.weight", [PermuteForRope()])])
    model = _meta(folder)
    with pytest.raises(sdadapt.errors.AdapterError, match=r"LlamaForCausalLM \(model_type 'llama'\).*PermuteForRope"):
        sdadapt.load(model, folder)
    assert all(p.is_meta for p in model.parameters())  # nothing happened to the model


def test_base_model_prefix_and_tied_embeddings(tmp_path: Any) -> None:
    """A ``*ForCausalLM`` with tied embeddings from a base-model checkpoint (no ``model.``
    prefix, no ``lm_head.weight``), as ``from_pretrained`` loads it; and the base model from a
    ``*ForCausalLM`` checkpoint (the prefix stripped)."""
    model, folder = _tiny_llama(str(tmp_path), tie_word_embeddings=True)
    base = os.path.join(str(tmp_path), "base")
    model.model.save_pretrained(base)
    lm = _meta(base)
    adapter = sdadapt.hf_adapter(lm, base)
    assert {r.kind for r in adapter.rules} == {"rename", "tie"}, adapter.describe()
    assert sdadapt.rules.Tie(dst="lm_head.weight", src="model.embed_tokens.weight") in adapter.rules
    sdadapt.load(lm, base)
    ref = transformers.AutoModelForCausalLM.from_pretrained(base)
    for k, v in ref.state_dict().items():
        assert torch.equal(lm.state_dict()[k], v), k
    assert torch.equal(lm.lm_head.weight, lm.model.embed_tokens.weight)

    only_base = _meta(folder, transformers.LlamaModel)
    assert sdadapt.diff(only_base, folder).ok
    sdadapt.load(only_base, folder)
    for k, v in only_base.state_dict().items():
        assert torch.equal(v, model.state_dict()["model." + k]), k


def test_not_a_transformers_model() -> None:
    with pytest.raises(sdadapt.errors.AdapterError, match="PreTrainedModel"):
        sdadapt.hf_adapter(torch.nn.Linear(2, 2))


def test_doc_example_runs(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The example at the top of docs/transformers-models.md runs as written."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "transformers-models.md").read_text()
    section = text.split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", section, re.S)
    monkeypatch.chdir(tmp_path)
    scope: dict[str, Any] = {}
    exec(compile(block, "docs/transformers-models.md", "exec"), scope)
    assert scope["report"].keys_loaded == len(scope["model"].state_dict())
    assert [r.kind for r in sdadapt.hf_adapter(scope["model"], "tiny-qwen3-moe").rules] == ["stack", "stack", "stack", "fuse"]


def test_cli_diff_uses_the_derived_adapter(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """``sdadapt diff SRC --target file.py:build`` with a transformers model and no adapter."""
    from sdadapt.cli import main

    cfg = transformers.AutoConfig.for_model("mixtral", **{**COMMON, "num_local_experts": 4})
    folder = str(tmp_path / "mixtral")
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    build = tmp_path / "build.py"
    build.write_text(
        "import torch, transformers\n"
        "def build():\n"
        f"    cfg = transformers.AutoConfig.from_pretrained({folder!r})\n"
        "    with torch.device('meta'):\n"
        "        return transformers.AutoModelForCausalLM.from_config(cfg)\n"
    )
    assert main(["diff", folder, "--target", f"{build}:build"]) == 0
    out = capsys.readouterr().out
    assert "hf:MixtralForCausalLM" in out and "OK" in out, out


def test_export_back_to_the_hub_layout(tmp_path: Any) -> None:
    """``export(model, dst, hf_adapter(model))`` writes what ``save_pretrained`` wrote: the
    per-expert keys and tensors of a Mixtral checkpoint, bit for bit."""
    from safetensors.torch import load_file

    cfg = transformers.AutoConfig.for_model("mixtral", **{**COMMON, "num_local_experts": 4})
    torch.manual_seed(0)
    folder = str(tmp_path / "mixtral")
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    model = _meta(folder)
    adapter = sdadapt.hf_adapter(model)  # from the keys save_pretrained writes
    sdadapt.load(model, folder, adapter)
    out = str(tmp_path / "out")
    sdadapt.export(model, out, adapter)
    written = {}
    for name in os.listdir(out):
        if name.endswith(".safetensors"):
            written.update(load_file(os.path.join(out, name)))
    original = load_file(os.path.join(folder, "model.safetensors"))
    assert sorted(written) == sorted(original)
    assert [k for k in original if not torch.equal(written[k], original[k])] == []


def test_index_dependent_renames_stay_per_key(tmp_path: Any, registered: Any) -> None:
    """A renaming that changes a layer index (checkpoint ``layers.{i+1}.mlp`` -> model
    ``layers.{i}.mlp``) cannot be a pattern: those keys get one rule each, and the load equals
    ``from_pretrained`` with the same mapping."""
    from safetensors.torch import load_file, save_file
    from transformers.core_model_loading import Inkling2IndexOffsetWeightRename

    _, folder = _tiny_llama(str(tmp_path))
    path = os.path.join(folder, "model.safetensors")
    sd = load_file(path)

    def shifted(k: str) -> str:
        parts = k.split(".")
        if len(parts) > 3 and parts[1] == "layers" and parts[3] == "mlp":
            parts[2] = str(int(parts[2]) + 1)
        return ".".join(parts)

    save_file({shifted(k): v for k, v in sd.items()}, path, metadata={"format": "pt"})
    registered("LlamaForCausalLM", [Inkling2IndexOffsetWeightRename(r"layers\.(\d+)\.mlp\.", r"layers.\1.mlp.", offset=-1)])
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder)
    model = _meta(folder)
    adapter = sdadapt.hf_adapter(model, folder)
    renames = [r for r in adapter.rules if r.kind == "rename"]
    assert len(renames) == 2 * 3 and all("{" not in r.src for r in renames), adapter.describe()
    sdadapt.load(model, folder)
    want = ref.state_dict()
    assert [k for k, v in model.state_dict().items() if not torch.equal(v, want[k])] == []


def test_bf16_release_into_float32_model(tmp_path: Any) -> None:
    """``dtype="model"`` composes with the derived adapter: a bf16 Qwen3-MoE release into a
    float32 model (FSDP2's master weights) equals ``from_pretrained(..., dtype=torch.float32)``."""
    cfg = transformers.AutoConfig.for_model("qwen3_moe", **{**COMMON, "num_experts": 4, **MOE})
    torch.manual_seed(0)
    folder = str(tmp_path / "bf16")
    transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(folder)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model = _meta(folder)
    model.to(torch.float32)
    report = sdadapt.diff(model, folder)  # bf16 -> float32 widens exactly: it plans, and says so
    assert report.ok and len(report.widened) == report.matched, report.format()
    sdadapt.load(model, folder, dtype="model")
    want = ref.state_dict()
    assert [k for k, v in model.state_dict().items() if v.dtype != torch.float32 or not torch.equal(v, want[k])] == []
    model = _meta(folder)
    model.to(torch.float32)
    sdadapt.load(model, folder)  # without dtype=: the same values
    assert [k for k, v in model.state_dict().items() if v.dtype != torch.float32 or not torch.equal(v, want[k])] == []
