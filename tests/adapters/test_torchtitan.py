"""sdadapt.torchtitan: the state-dict-adapter bridge, driven the way torchtitan's checkpoint code drives it.

The real torchtitan (its model classes and ``CheckpointManager``) drives the bridge in
tests/adapters/test_torchtitan_real.py; this file keeps a stand-in beside it for what the real one does
not cover here: our documented layout (names of older torchtitan releases), the reader-first
order, and dtype conversion. :class:`StandInCheckpointManager` repeats the calls of
``torchtitan/components/checkpoint.py`` (``CheckpointManager.dcp_load`` with ``from_hf=True``,
``CheckpointManager.dcp_save`` with ``to_hf=True`` and ``ModelWrapper.state_dict`` /
``load_state_dict``) line for line. The checkpoint is a tiny transformers Llama saved sharded;
the model is the Meta-layout reference Llama (torchtitan's names) under FSDP2 or TP on 2 gloo
ranks, materialised and initialised before the load as in torchtitan's trainer.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from support.checkpoints import read_safetensors_folder
from support.dist_helper import run_distributed
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

import sdadapt
from sdadapt.torchtitan import HFStateDict, SdadaptStateDictAdapter

DIM, L, H, KV, FFN, VOCAB = 32, 2, 4, 2, 64, 96


class StandInCheckpointManager:
    """The HF paths of torchtitan's ``CheckpointManager`` (torchtitan/components/checkpoint.py)."""

    def __init__(self, model: torch.nn.Module, sd_adapter: Any):
        self.model = model
        self.sd_adapter = sd_adapter

    def _model_state_dict(self) -> dict[str, Any]:  # ModelWrapper.state_dict
        return dict(get_model_state_dict(self.model))

    def dcp_load(self, checkpoint_id: str, from_quantized: bool = False) -> None:
        """``CheckpointManager.dcp_load``, ``from_hf=True`` branch."""
        state_dict = self._model_state_dict()
        hf_state_dict = self.sd_adapter.to_hf(state_dict)
        hf_storage_reader = self.sd_adapter.get_hf_storage_reader(checkpoint_id, from_quantized)
        dcp.load(hf_state_dict, storage_reader=hf_storage_reader)
        state_dict = self.sd_adapter.from_hf(hf_state_dict)
        # ModelWrapper.load_state_dict
        set_model_state_dict(self.model, model_state_dict=state_dict, options=StateDictOptions(strict=False))

    def reader_first_load(self, checkpoint_id: str) -> None:
        """The order some torchtitan-based trainers use: the reader first, then ``to_hf``."""
        storage_reader = self.sd_adapter.get_hf_storage_reader(checkpoint_id)
        hf_state_dict = self.sd_adapter.to_hf(self._model_state_dict())
        dcp.load(hf_state_dict, storage_reader=storage_reader)
        set_model_state_dict(self.model, self.sd_adapter.from_hf(hf_state_dict), options=StateDictOptions(strict=True))

    def dcp_save_hf(self, checkpoint_id: str) -> None:
        """``CheckpointManager.dcp_save``, ``to_hf=True`` branch (synchronous)."""
        from torch.distributed.checkpoint import HuggingFaceStorageWriter
        from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files_on_every_rank

        state_dict = self.sd_adapter.to_hf(self._model_state_dict())
        fqn_to_index_mapping = self.sd_adapter.fqn_to_index_mapping
        if fqn_to_index_mapping:
            storage_writer = HuggingFaceStorageWriter(
                path=os.path.join(checkpoint_id, "sharded"),
                save_distributed=True,
                fqn_to_index_mapping=fqn_to_index_mapping,
                enable_consolidation=False,
            )
        else:
            storage_writer = HuggingFaceStorageWriter(path=checkpoint_id, save_distributed=True, enable_consolidation=True)
        dcp.save(state_dict, storage_writer=storage_writer)
        if fqn_to_index_mapping:
            consolidate_safetensors_files_on_every_rank(
                input_dir=os.path.join(checkpoint_id, "sharded"),
                output_dir=checkpoint_id,
                fqn_to_index_mapping=fqn_to_index_mapping,
                num_threads=5,
            )


def _write_hf_llama(root: str) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(hidden_size=DIM, intermediate_size=FFN, num_hidden_layers=L, num_attention_heads=H,
                      num_key_value_heads=KV, vocab_size=VOCAB, tie_word_embeddings=False)  # fmt: skip
    hf = LlamaForCausalLM(cfg)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    path = os.path.join(root, "hf_llama")
    hf.save_pretrained(path, max_shard_size="20KB")
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json")), "expected a sharded checkpoint"
    return path


def _meta_llama(mesh: Any, init_seed: int) -> torch.nn.Module:
    """torchtitan's order: meta init, parallelise, ``to_empty``, ``init_weights`` (here: random)."""
    from support.reference_models import MetaLlama, parallelize_meta_llama

    with torch.device("meta"):
        model = MetaLlama(dict(dim=DIM, n_layers=L, n_heads=H, n_kv_heads=KV, vocab_size=VOCAB, hidden_dim=FFN,
                               norm_eps=1e-6, rope_theta=10000.0))  # fmt: skip
    model = parallelize_meta_llama(model, mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(init_seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in get_model_state_dict(model).items()}


def _dist_cases(hf_path: str, out_root: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    results: dict[str, Any] = {}
    for mesh_name in ("fsdp", "tp"):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=(mesh_name,))
        reference = _meta_llama(mesh, init_seed=1)
        sdadapt.load(reference, hf_path, sdadapt.get_adapter("llama", source=hf_path))
        want = _full(reference)

        bridge_cls = SdadaptStateDictAdapter.using("llama")
        bridge = bridge_cls({"unused": "model_config"}, hf_path)  # torchtitan: Cls(model_config, hf_assets_path)
        model = _meta_llama(mesh, init_seed=2)
        manager = StandInCheckpointManager(model, bridge)
        manager.dcp_load(hf_path)
        got = _full(model)
        differ = sorted(k for k in want if not torch.equal(want[k], got[k]))

        model2 = _meta_llama(mesh, init_seed=4)
        StandInCheckpointManager(model2, bridge).reader_first_load(hf_path)
        got2 = _full(model2)
        differ2 = sorted(k for k in want if not torch.equal(want[k], got2[k]))

        out = os.path.join(out_root, f"export_{mesh_name}")
        manager.dcp_save_hf(out)
        dist.barrier()
        results[mesh_name] = dict(differ=differ, differ_reader_first=differ2, keys=len(want), export=out)
    return results


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _write_hf_llama(str(tmp_path_factory.mktemp("tt")))


def test_bridge_matches_sdadapt_load_and_exports_hf_layout(hf_llama: str, tmp_path: Any) -> None:
    results = run_distributed(_dist_cases, 2, hf_llama, str(tmp_path), timeout=300)
    original = read_safetensors_folder(hf_llama)
    with open(os.path.join(hf_llama, "model.safetensors.index.json")) as f:
        original_map = json.load(f)["weight_map"]
    for r in results:
        for mesh_name, res in r.items():
            assert res["keys"] == 3 + 9 * L  # embeddings, norm, output + 9 per layer
            assert res["differ"] == [], f"{mesh_name}: bridge load differs from sdadapt.load in {res['differ']}"
            assert res["differ_reader_first"] == [], f"{mesh_name}: reader-first order differs in {res['differ_reader_first']}"
    for mesh_name in ("fsdp", "tp"):
        out = results[0][mesh_name]["export"]
        exported = read_safetensors_folder(out)
        assert sorted(exported) == sorted(original), f"{mesh_name}: exported keys differ from the HF checkpoint's"
        wrong = sorted(k for k in original if exported[k].dtype != original[k].dtype or not torch.equal(exported[k], original[k]))
        assert wrong == [], f"{mesh_name}: exported tensors differ from the HF checkpoint in {wrong}"
        with open(os.path.join(out, "model.safetensors.index.json")) as f:
            out_map = json.load(f)["weight_map"]
        assert set(out_map) == set(original_map)
        # torchtitan's fqn_to_index_mapping puts every key in the shard of the same number
        assert {k: int(v.split("-")[1]) for k, v in out_map.items()} == {k: int(v.split("-")[1]) for k, v in original_map.items()}


def test_views_and_eager_from_hf(hf_llama: str) -> None:
    from support.reference_models import MetaLlama

    model = MetaLlama(dict(dim=DIM, n_layers=L, n_heads=H, n_kv_heads=KV, vocab_size=VOCAB, hidden_dim=FFN,
                           norm_eps=1e-6, rope_theta=10000.0))  # fmt: skip
    sdadapt.load(model, hf_llama, sdadapt.get_adapter("llama", source=hf_llama))
    bridge = SdadaptStateDictAdapter(None, hf_llama, adapter="llama")
    original = read_safetensors_folder(hf_llama)
    assert bridge.fqn_to_index_mapping is not None and set(bridge.fqn_to_index_mapping) == set(original)

    # export view: HF names and layout, bit-exact
    hf = bridge.to_hf(model.state_dict())
    assert isinstance(hf, HFStateDict) and hf.view is None
    assert sorted(hf) == sorted(original) and hf.view == "export"
    assert all(torch.equal(hf[k], original[k]) for k in original)

    # from_hf of a plain dict of HF tensors: the adapter applied in memory, equal to the loaded model
    native = bridge.from_hf(dict(original))
    sd = model.state_dict()
    assert sorted(native) == sorted(sd)
    assert all(torch.equal(native[k], sd[k]) for k in sd)


def test_plan_errors_before_dcp_load(hf_llama: str) -> None:
    from support.reference_models import MetaLlama

    model = MetaLlama(dict(dim=DIM, n_layers=L + 1, n_heads=H, n_kv_heads=KV, vocab_size=VOCAB, hidden_dim=FFN,
                           norm_eps=1e-6, rope_theta=10000.0))  # fmt: skip
    bridge = SdadaptStateDictAdapter(None, hf_llama, adapter="llama")
    bridge.to_hf(model.state_dict())  # torchtitan's order: to_hf, then the reader (which plans)
    with pytest.raises(sdadapt.errors.PlanError, match="layers.2"):
        bridge.get_hf_storage_reader(hf_llama)
    with pytest.raises(sdadapt.errors.AdapterError, match="needs an adapter"):
        SdadaptStateDictAdapter(None, hf_llama)


def test_a_bf16_release_into_torchtitans_float32_parameters_with_dtype(hf_llama: str, tmp_path: Any) -> None:
    """torchtitan keeps float32 parameters; HF releases are bf16. Without ``dtype`` the exact
    widening plans as it is (a narrowing would be a plan error); with ``dtype="model"`` bound by ``using``,
    torchtitan's load gives what ``sdadapt.load(..., dtype="model")`` gives; the export view
    is the adapter's inverse, untouched by the conversion."""
    from safetensors.torch import save_file
    from support.reference_models import MetaLlama

    bf16 = tmp_path / "hf_llama_bf16"
    bf16.mkdir()
    for name in os.listdir(hf_llama):
        src = os.path.join(hf_llama, name)
        if name.endswith(".safetensors"):
            save_file({k: v.to(torch.bfloat16) for k, v in load_file(src).items()}, str(bf16 / name), metadata={"format": "pt"})
        else:
            (bf16 / name).write_bytes(open(src, "rb").read())

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return MetaLlama(dict(dim=DIM, n_layers=L, n_heads=H, n_kv_heads=KV, vocab_size=VOCAB, hidden_dim=FFN,
                              norm_eps=1e-6, rope_theta=10000.0))  # fmt: skip

    strict = SdadaptStateDictAdapter(None, str(bf16), adapter="llama")
    strict.to_hf(model().state_dict())
    strict.get_hf_storage_reader(str(bf16))  # bf16 -> float32 widens exactly: no PlanError

    want = model()
    sdadapt.load(want, str(bf16), "llama", dtype="model")
    got = model()
    bridge = SdadaptStateDictAdapter.using("llama", dtype="model")(None, str(bf16))
    assert bridge.dtype == "model" and "dtype" not in bridge.options
    # the bridge's old keyword is refused by name, bound or passed, with the one the others use
    for call in (lambda: SdadaptStateDictAdapter.using("llama", to_dtype="model"),
                 lambda: SdadaptStateDictAdapter(None, str(bf16), adapter="llama", to_dtype="model")):  # fmt: skip
        with pytest.raises(sdadapt.errors.UsageError, match=r"to_dtype= is now dtype= .*dtype='model'"):
            call()
    StandInCheckpointManager(got, bridge).dcp_load(str(bf16))
    sd, ref = got.state_dict(), want.state_dict()
    assert all(sd[k].dtype == torch.float32 and torch.equal(sd[k], ref[k]) for k in ref)
    assert torch.equal(sd["tok_embeddings.weight"], read_safetensors_folder(str(bf16))["model.embed_tokens.weight"].float())
    exported = bridge.to_hf(got.state_dict())
    assert sorted(exported) == sorted(read_safetensors_folder(str(bf16)))
