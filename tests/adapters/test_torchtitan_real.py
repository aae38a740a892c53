"""The torchtitan bridge against the real torchtitan (installed from the registry, test-titan extra):
torchtitan's own model classes for every family it ships that we ship an adapter for, from tiny
configs, driven by torchtitan's own ``CheckpointManager`` (initial load from HF, last save to HF).

Each load equals torchtitan's own path (its ``StateDictAdapter.to_hf`` -> ``dcp.load`` with its HF
reader -> ``from_hf``) bit for bit; where that path cannot load a tensor (torchtitan 0.3.0's GPT-OSS
adapter names ``mlp1_weight`` while its model holds ``mlp1_weight_EGD``), the tensor equals the
checkpoint's own values in torchtitan's layout. The logits equal transformers' for the same
checkpoint (GPT-OSS excepted: torchtitan's flex attention with sinks does not run on CPU). The HF
export equals the checkpoint bit for bit. tests/adapters/test_torchtitan.py drives the same bridge with a
stand-in of torchtitan's checkpoint code and our reference Meta-layout Llama (our documented names).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is not installed (scripts/test.sh installs it: the test-titan extra, "
                    "then pip install --no-deps torchtitan==0.3.0)")

import torch.distributed.checkpoint as dcp  # noqa: E402
from support.checkpoints import read_safetensors_folder  # noqa: E402
from support.dist_helper import run_distributed  # noqa: E402
from support.titan_models import FAMILIES, VOCAB, titan_logits, titan_model, write_hf  # noqa: E402

import sdadapt  # noqa: E402
from sdadapt.torchtitan import SdadaptStateDictAdapter  # noqa: E402


def _initialised(family: Any, seed: int) -> torch.nn.Module:
    """torchtitan's order: meta init, ``to_empty``, ``init_states`` (random values before the load)."""
    model = titan_model(family)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_states()
    return model


def _titans_own_load(family: Any, path: str) -> dict[str, torch.Tensor]:
    """What torchtitan's own state dict adapter and HF reader load (CheckpointManager.dcp_load)."""
    model = _initialised(family, seed=1)
    adapter = family.titan_adapter(family.titan_config, path)
    hf = adapter.to_hf(model.state_dict())
    dcp.load(hf, storage_reader=adapter.get_hf_storage_reader(path))
    model.load_state_dict(adapter.from_hf(hf), strict=False)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _gpt_oss_experts(hf: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    """GPT-OSS experts in torchtitan's layout, from the checkpoint (transformers' ``[E, in, out]``;
    torchtitan's ``[E, out, in]`` with gate and up rows alternating, as transformers' columns do)."""
    hf_e, tt = f"model.layers.{i}.mlp.experts.", f"layers.{i}.moe.routed_experts.inner_experts."
    return {
        tt + "mlp1_weight_EGD": hf[hf_e + "gate_up_proj"].transpose(1, 2),
        tt + "mlp1_bias_EG": hf[hf_e + "gate_up_proj_bias"],
        tt + "mlp2_weight_EDF": hf[hf_e + "down_proj"].transpose(1, 2),
        tt + "mlp2_bias_ED": hf[hf_e + "down_proj_bias"],
    }


def _manager(model: torch.nn.Module, bridge: Any, hf_path: str, folder: str) -> Any:
    from torchtitan.components.checkpoint import CheckpointManager

    config = CheckpointManager.Config(enable=True, folder=folder, initial_load_path=hf_path, initial_load_in_hf=True,
                                      last_save_in_hf=True)  # fmt: skip
    return CheckpointManager(config, dataloader=None, model_parts=[model], optimizers=None, lr_schedulers=None, states={},
                             sd_adapter=bridge)  # fmt: skip


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_checkpoint_manager_loads_and_exports_each_family(name: str, tmp_path: Any) -> None:
    family = FAMILIES[name]()
    hf_path, hf_model = write_hf(family, str(tmp_path))
    original = read_safetensors_folder(hf_path)
    want = _titans_own_load(family, hf_path)
    if name == "gpt_oss":
        for i in range(2):
            want.update(_gpt_oss_experts(original, i))

    model = _initialised(family, seed=2)
    bridge = SdadaptStateDictAdapter.using(family.name)(family.titan_config, hf_path)  # how torchtitan builds it
    manager = _manager(model, bridge, hf_path, str(tmp_path / "ckpt"))
    assert manager.load() is True
    got = model.state_dict()
    assert sorted(got) == sorted(want)
    # torchtitan's training state (expert_bias_E: no HF checkpoint of these families holds it) keeps its init
    state = [k for k in got if k.endswith("expert_bias_E")] if name in ("qwen3_moe", "gpt_oss") else []
    differ = [k for k in want if k not in state and not torch.equal(got[k], want[k])]
    assert differ == [], f"{name}: the bridge's load differs from torchtitan's own in {differ}"

    if family.logits:
        tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            torch.testing.assert_close(titan_logits(model, tokens), hf_model(tokens).logits, rtol=0, atol=1e-3)

    manager.save(curr_step=1, last_step=True)  # last_save_in_hf: the adapter's inverse, HF's sharding
    exported = read_safetensors_folder(str(tmp_path / "ckpt" / "step-1"))
    assert sorted(exported) == sorted(original)
    wrong = [k for k in original if not torch.equal(exported[k], original[k])]
    assert wrong == [], f"{name}: the HF export differs from the checkpoint in {wrong}"


def test_torchtitan_names_with_sdadapt_load_and_the_documented_layout(tmp_path: Any) -> None:
    """``sdadapt.load`` with a shipped adapter composed with ``torchtitan_names(model)``, or by
    the adapter's name alone, gives torchtitan's own load; a model with our documented layout
    gets no renames."""
    from support.reference_models import MetaLlama

    from sdadapt.torchtitan import torchtitan_names

    family = FAMILIES["llama3"]()
    hf_path, _ = write_hf(family, str(tmp_path))
    want = _titans_own_load(family, hf_path)
    model = _initialised(family, seed=3)
    names = torchtitan_names(model)
    assert names is not None and {r.dst for r in names.rules if hasattr(r, "dst")} >= {"lm_head.weight"}
    sdadapt.load(model, hf_path, sdadapt.get_adapter("llama", source=hf_path) + names)
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
    by_name = _initialised(family, seed=5)
    assert sdadapt.diff(by_name, hf_path, "llama").ok  # diff says what load will do
    sdadapt.load(by_name, hf_path, "llama")  # a shipped name: aimed at the model's names by itself
    assert all(torch.equal(v, want[k]) for k, v in by_name.state_dict().items())

    ours = MetaLlama(dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, hidden_dim=64, norm_eps=1e-5,
                          rope_theta=10000.0))  # fmt: skip
    assert torchtitan_names(ours) is None
    bridge = SdadaptStateDictAdapter.using("llama")(None, hf_path)
    bridge.to_hf(ours.state_dict())
    bridge.get_hf_storage_reader(hf_path)  # plans against our documented names: no PlanError


def test_from_hf_of_a_plain_dict_uses_the_model_configs_names(tmp_path: Any) -> None:
    """Without a ``to_hf`` first, ``from_hf`` learns the model's names from ``model_config``."""
    family = FAMILIES["qwen3"]()
    hf_path, _ = write_hf(family, str(tmp_path))
    bridge = SdadaptStateDictAdapter.using("qwen3")(family.titan_config, hf_path)
    native = bridge.from_hf(read_safetensors_folder(hf_path))
    want = _titans_own_load(family, hf_path)
    assert sorted(native) == sorted(want)
    assert all(torch.equal(native[k], want[k]) for k in want)


@pytest.mark.parametrize("name", ["llama3", "qwen3_moe"])
def test_export_by_adapter_name_from_a_torchtitan_model(name: str, tmp_path: Any) -> None:
    """``export_iter(model, "llama")`` on a torchtitan model that sdadapt did not load: the
    options come from torchtitan's model config, the names from the model's keys (training
    state left out); ``export(..., assets=hf)`` writes a folder transformers opens, logits equal."""
    from transformers import AutoModelForCausalLM

    family = FAMILIES[name]()
    hf_path, hf_model = write_hf(family, str(tmp_path))
    model = _initialised(family, seed=4)
    if name == "llama3":
        _manager(model, SdadaptStateDictAdapter.using(family.name)(family.titan_config, hf_path), hf_path,
                 str(tmp_path / "ckpt")).load()  # fmt: skip
    else:  # by name: aimed at torchtitan's names, its expert_bias_E (no checkpoint holds it) left as initialised
        report = sdadapt.load(model, hf_path, family.name)
        assert sorted(report.report.allowed_missing) == ["layers.0.moe.expert_bias_E", "layers.1.moe.expert_bias_E"]
    original = read_safetensors_folder(hf_path)
    if name == "llama3":  # qwen3_moe needs options its model config does not hold (from the folder below)
        streamed = dict(sdadapt.export_iter(model, family.name))
        assert sorted(streamed) == sorted(original)
        assert all(torch.equal(streamed[k], original[k]) for k in original)
    out = str(tmp_path / "exported")
    sdadapt.export(model, out, family.name, assets=hf_path)
    assert sorted(read_safetensors_folder(out)) == sorted(original)
    reopened = AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(reopened(tokens).logits, hf_model(tokens).logits)


# ---------------------------------------------------------------------------------------- distributed
def _parallelize(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    """TP (when the mesh has ``tp``) + FSDP2 with torch's own ``parallelize_module`` /
    ``fully_shard``: torchtitan's ``parallelize_*`` functions build their meshes through
    ``ParallelDims`` on ``torchtitan.tools.utils.device_type``, which is ``"cuda"`` on a machine
    without an accelerator, so they do not run on CPU; the test places the modules itself
    (attention and dense MLP column/row-wise, experts FSDP only)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    names = mesh.mesh_dim_names
    if "tp" in names:
        plan: dict[str, Any] = {}
        for i, block in model.layers.items():
            attn = block.attention
            if hasattr(attn, "qkv_linear"):
                qkv = attn.qkv_linear
                for w in ("wqkv", "wq", "wk", "wv"):
                    if hasattr(qkv, w):
                        plan[f"layers.{i}.attention.qkv_linear.{w}"] = ColwiseParallel(use_local_output=False)
                plan[f"layers.{i}.attention.wo"] = RowwiseParallel()
            if getattr(block, "feed_forward", None) is not None:
                plan.update({f"layers.{i}.feed_forward.w1": ColwiseParallel(), f"layers.{i}.feed_forward.w3": ColwiseParallel(),
                             f"layers.{i}.feed_forward.w2": RowwiseParallel()})  # fmt: skip
        parallelize_module(model, mesh["tp"], plan)
    dp = mesh["dp"] if "tp" in names else mesh
    for block in model.layers.values():
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    return model


def _dist_cases(paths: dict[str, str], shape: tuple[int, ...], root: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp") if len(shape) == 2 else ("dp",))
    results: dict[str, Any] = {}
    for name, hf_path in paths.items():
        family = FAMILIES[name]()
        want = _titans_own_load(family, hf_path)
        if name == "gpt_oss":  # experts torchtitan 0.3.0's own adapter does not map: the checkpoint's values
            for i in range(2):
                want.update(_gpt_oss_experts(read_safetensors_folder(hf_path), i))
        model = _parallelize(titan_model(family), mesh)
        model.to_empty(device="cpu")
        torch.manual_seed(7)
        model.init_states()
        bridge = SdadaptStateDictAdapter.using(family.name)(family.titan_config, hf_path)
        manager = _manager(model, bridge, hf_path, os.path.join(root, f"{name}-{len(shape)}d"))
        manager.load()
        got = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
        differ = [k for k in want if not k.endswith("expert_bias_E") and not torch.equal(got[k], want[k])]
        manager.save(curr_step=1, last_step=True)
        dist.barrier()
        results[name] = dict(differ=differ, keys=len(want), export=os.path.join(root, f"{name}-{len(shape)}d", "step-1"))
    return results


@pytest.mark.parametrize(("world", "shape", "names"), [(4, (2, 2), ("llama3", "qwen3_moe")),
                                                       (3, (3,), ("llama3", "qwen3_moe", "deepseek_v3", "gpt_oss"))])  # fmt: skip
def test_checkpoint_manager_on_fsdp_tp_and_uneven_meshes(world: int, shape: tuple[int, ...], names: tuple[str, ...],
                                                         tmp_path: Any) -> None:  # fmt: skip
    """2x2 FSDP2 x TP and 3 ranks (FSDP2 shards of uneven sizes: 32 rows over 3 ranks): each rank
    loads its shards through the bridge; the gathered tensors equal torchtitan's own load, and the
    HF export equals the checkpoint."""
    paths = {n: write_hf(FAMILIES[n](), str(tmp_path / "hf"))[0] for n in names}
    results = run_distributed(_dist_cases, world, paths, shape, str(tmp_path / "out"), timeout=600)
    for rank, res in enumerate(results):
        for name, r in res.items():
            assert r["differ"] == [], f"rank {rank}, {name}: differs from torchtitan's own load in {r['differ']}"
    for name, hf_path in paths.items():
        original, exported = read_safetensors_folder(hf_path), read_safetensors_folder(results[0][name]["export"])
        assert sorted(exported) == sorted(original)
        assert [k for k in original if not torch.equal(exported[k], original[k])] == []
