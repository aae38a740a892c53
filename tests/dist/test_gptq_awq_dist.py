"""GPTQ and AWQ releases (written by auto-gptq and AutoAWQ, ``support.quant_releases``) on 2 gloo
ranks: transformers Llama models sharded with FSDP2 (``fully_shard``) load with no adapter, every
shard bit-equal to the tools' own dequantisation in bfloat16 and float32, each rank reading about
half of the packed file; the shipped ``llama`` adapter into a sharded Meta-layout model as on one
process; a ``g_idx`` out of range fails on both ranks naming it, nothing loaded, no hang. One
launched group runs every case."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from support.dist_helper import run_distributed, shard_of  # noqa: E402
from support.quant_releases import NAMES, copy_release, quant_releases  # noqa: E402

_RESULTS: dict[str, Any] = {}
BROKEN = "model.layers.0.self_attn.q_proj.g_idx"


def _model(folder: str, dtype: torch.dtype, mesh: Any) -> Any:
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=dtype)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _cases(folder: str, broken: str) -> dict[str, Any]:
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh

    import sdadapt
    from sdadapt.errors import SdadaptError

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out: dict[str, Any] = {}
    for name in NAMES:
        want = load_file(os.path.join(folder, name + ".oracle", "model.safetensors"))
        path = os.path.join(folder, name)
        for dtype in (torch.bfloat16, torch.float32):
            model = _model(path, dtype, mesh)
            rep = sdadapt.load(model, path)
            bad = []
            for k, v in model.state_dict().items():
                local, region = shard_of(v, want[k].to(dtype))
                if not torch.equal(local.contiguous().view(torch.uint8), region.contiguous().view(torch.uint8)):
                    bad.append(k)
            out[f"{name}/{dtype}"] = {"bad": bad, "read": rep.bytes_read,
                                      "size": os.path.getsize(os.path.join(path, "model.safetensors"))}
    out.update(_meta_layout(folder, mesh))
    model = _model(broken, torch.bfloat16, mesh)
    try:
        sdadapt.load(model, broken)
        out["broken"] = "loaded"
    except SdadaptError as e:
        out["broken"] = f"{type(e).__name__}: {e}"
    out["broken/meta"] = all(p.is_meta for p in model.parameters())
    return out


def _meta_layout(folder: str, mesh: Any) -> dict[str, Any]:
    """The shipped ``llama`` adapter into an FSDP2-sharded Meta-layout model (rotary rows permuted
    across the shards): every shard equal to the same adapter's load on one process, whose logits
    tests/rules/test_dequant_gptq.py checks against the tools' dequantised model."""
    import json

    from support.reference_models import MetaLlama
    from support.sharded_load import sharded_differs

    out: dict[str, Any] = {}
    for name in ("gptq4_g32_asym_act", "awq4_g64"):
        path = os.path.join(folder, name)
        cfg = json.load(open(os.path.join(path, "config.json")))
        spec = dict(dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"], n_heads=cfg["num_attention_heads"],
                    n_kv_heads=cfg["num_key_value_heads"], vocab_size=cfg["vocab_size"],
                    hidden_dim=cfg["intermediate_size"], norm_eps=cfg["rms_norm_eps"])  # fmt: skip
        bad = sharded_differs(lambda spec=spec: MetaLlama(spec).to(torch.bfloat16), path, "llama", mesh)
        out[f"{name}/llama"] = {"bad": bad}
    return out


def test_the_llama_adapter_into_a_sharded_meta_layout_model_equals_one_process(results: dict) -> None:
    for rank in (0, 1):
        for name in ("gptq4_g32_asym_act", "awq4_g64"):
            case = results[rank][f"{name}/llama"]
            assert case["bad"] == [], (rank, name, case)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = quant_releases()
    from safetensors.torch import load_file, save_file

    broken = copy_release(folder, "gptq4_g32_asym_act", str(tmp_path_factory.mktemp("gptq-broken")))
    f = os.path.join(broken, "model.safetensors")
    tensors = load_file(f)
    tensors[BROKEN][40] = -1
    save_file(tensors, f, metadata={"format": "pt"})
    if not _RESULTS:
        _RESULTS.update(enumerate(run_distributed(_cases, 2, folder, broken, timeout=600)))
    return _RESULTS


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", ["torch.bfloat16", "torch.float32"])
def test_fsdp2_shards_are_bit_equal_and_each_rank_reads_its_half(results: dict, name: str, dtype: str) -> None:
    for rank in (0, 1):
        case = results[rank][f"{name}/{dtype}"]
        assert case["bad"] == []
        assert case["read"] < 0.75 * case["size"], case  # its own rows' words and groups, not the file


def test_a_g_idx_out_of_range_fails_on_both_ranks_naming_it(results: dict) -> None:
    texts = [results[rank]["broken"] for rank in (0, 1)]
    assert all(t.startswith("LoadError") and BROKEN in t and "g_idx[40] = -1" in t for t in texts), texts
    assert all(results[rank]["broken/meta"] for rank in (0, 1))
