"""The hostile corpus of the newer doors (Hub ids, JSON configs, LoRA folders, quantized scales and
blocks, the ``shrink`` / ``convert`` / ``verify`` CLI), beside the checkpoint corpus of
:mod:`corpus`:

    cases = build_door_cases(folder)    # list[DoorCase], every file written under ``folder``
    hub_cache = os.path.join(folder, "hub")   # HF_HUB_CACHE for the Hub cases (HF_HUB_OFFLINE=1)

Each case is one action that must fail with one of sdadapt's errors naming a file:

- ``load``: ``sdadapt.load(model, path, adapter, lora=...)`` into the model ``model_kind`` names
  (``corpus``: :func:`corpus.corpus_model`; ``mx``: one ``[4, 32]`` weight for MXFP4 blocks);
- ``cli``: ``sdadapt.cli.main(argv)`` must return 2 and print ``error: ...`` naming the file.

The Hub cases read a cache laid out as ``huggingface_hub`` lays it out
(``models--org--name/{blobs,refs,snapshots}``, snapshot files symlinked into ``blobs``); they
include ids and revisions that must be refused before anything is read, and caches whose files
lead out of the repository's folder. Every JSON file is a real file written with damage:
not UTF-8, nested deeper than any config, wrong field types, too large.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from safetensors.torch import save_file

import sdadapt
from sdadapt.rules._dequant import DequantFP8, DequantMXFP4
from support.checkpoints import write_hf_sharded, write_safetensors
from support.corpus import KEY, good_state_dict

COMMIT = hashlib.sha1(b"doors-v1").hexdigest()
INDEX = "model.safetensors.index.json"
DEEP = b"[" * 100_000 + b"]" * 100_000  # deeper than json.loads' recursion limit


@dataclass
class DoorCase:
    name: str
    door: str  # hub | config | index | lora | quant | shrink | convert | verify
    action: str  # load | cli
    error: str  # the SdadaptError subclass's name
    file: str  # what the message must contain (a path, or the hf:// id)
    path: str = ""  # load: the source
    adapter: str | None = None  # load: an adapter spec (a name, a .json file)
    kwargs: dict[str, Any] = field(default_factory=dict)  # load: lora=, check_finite=...
    model_kind: str = "corpus"
    argv: list[str] = field(default_factory=list)  # cli
    fragments: tuple[str, ...] = ()
    phase: str = "open"  # open: before the model is touched; read: rolled back / marked

    def payload(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------------------------
# a Hub cache, as huggingface_hub lays it out
# --------------------------------------------------------------------------------------------
def hub_repo(cache: str, repo: str, files: dict[str, Any], refs: dict[str, str] | None = None, commit: str = COMMIT) -> str:
    """``cache/models--org--name``: each of ``files`` (name -> bytes, or ``("link", target)``
    for a symlink written as is) stored as a blob linked from ``snapshots/<commit>``; ``refs``
    (default ``{"main": commit}``)."""
    root = os.path.join(cache, "models--" + repo.replace("/", "--"))
    snap = os.path.join(root, "snapshots", commit)
    for sub in ("blobs", "refs", snap):
        os.makedirs(os.path.join(root, sub), exist_ok=True)
    for name, value in (refs or {"main": commit}).items():
        os.makedirs(os.path.dirname(os.path.join(root, "refs", name)), exist_ok=True)
        with open(os.path.join(root, "refs", name), "w") as f:
            f.write(value)
    for name, data in files.items():
        link = os.path.join(snap, name)
        os.makedirs(os.path.dirname(link), exist_ok=True)
        if isinstance(data, tuple):
            os.symlink(data[1], link)
            continue
        digest = hashlib.sha256(data).hexdigest()
        with open(os.path.join(root, "blobs", digest), "wb") as f:
            f.write(data)
        os.symlink(os.path.relpath(os.path.join(root, "blobs", digest), os.path.dirname(link)), link)
    return root


def _st(path: str, sd: dict[str, torch.Tensor]) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_safetensors(path, sd)
    return path


def _st_bytes(sd: dict[str, torch.Tensor], tmp: str) -> bytes:
    save_file({k: v.contiguous() for k, v in sd.items()}, tmp)
    with open(tmp, "rb") as f:
        data = f.read()
    os.remove(tmp)
    return data


def _w(path: str, data: bytes | str) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    return path


def _j(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def _folder_with_config(root: str, name: str, config: bytes, sd: dict[str, torch.Tensor]) -> str:
    folder = os.path.join(root, name)
    _st(os.path.join(folder, "model.safetensors"), sd)
    _w(os.path.join(folder, "config.json"), config)
    return folder


# --------------------------------------------------------------------------------------------
# the cases
# --------------------------------------------------------------------------------------------
def build_door_cases(root: str) -> list[DoorCase]:
    sd = good_state_dict()
    cases: list[DoorCase] = []
    add = cases.append
    good_st = os.path.join(root, "good", "model.safetensors")
    _st(good_st, sd)
    _hub_cases(root, sd, add)
    _config_cases(root, sd, add)
    _index_cases(root, sd, add)
    _lora_cases(root, good_st, add)
    _quant_cases(root, sd, add)
    _cli_cases(root, sd, add)
    names = [c.name for c in cases]
    assert len(names) == len(set(names)), "case names must be unique"
    return cases


def _hub_cases(root: str, sd: dict[str, torch.Tensor], add: Any) -> None:
    cache = os.path.join(root, "hub")
    tmp = os.path.join(root, "tmp.safetensors")
    config = _j({"architectures": ["Tiny"], "num_hidden_layers": 1})
    shard = _st_bytes(sd, tmp)
    index = _j({"metadata": {}, "weight_map": dict.fromkeys(sd, "model-00001-of-00001.safetensors")})
    hub_repo(cache, "org/tiny", {"config.json": config, INDEX: index, "model-00001-of-00001.safetensors": shard},
             refs={"main": COMMIT, "v1": COMMIT})  # fmt: skip
    outside = _w(os.path.join(root, "outside", "model.safetensors"), shard)
    _w(os.path.join(root, "outside", "config.json"), config)
    # a shard that is a symlink out of the cache (to a file the user never named)
    hub_repo(cache, "org/leak", {"config.json": config, INDEX: index, "model-00001-of-00001.safetensors": ("link", outside)})
    # a whole snapshot folder that is a symlink out of the cache
    leak_dir = hub_repo(cache, "org/leakdir", {"config.json": config})
    snap = os.path.join(leak_dir, "snapshots", COMMIT)
    for n in os.listdir(snap):
        os.remove(os.path.join(snap, n))
    os.rmdir(snap)
    os.symlink(os.path.join(root, "outside"), snap)
    # an index naming a shard outside the snapshot, an index that is not JSON, one too deep
    hub_repo(cache, "org/escape", {"config.json": config, INDEX: _j({"weight_map": {KEY: "../../../outside/model.safetensors"}})})
    hub_repo(cache, "org/badindex", {"config.json": config, INDEX: b'{"weight_map": {'})
    hub_repo(cache, "org/deepindex", {"config.json": config, INDEX: DEEP})
    hub_repo(cache, "org/typedindex", {"config.json": config, INDEX: _j({"weight_map": {KEY: 7}})})
    # refs/main names a commit whose snapshot is not there
    hub_repo(cache, "org/noref", {"config.json": config, "model.safetensors": shard}, refs={"main": "f" * 40})
    # a config.json that is not UTF-8, read by a shipped adapter
    hub_repo(cache, "org/badconfig", {"config.json": b"\xff\xfe{}", "model.safetensors": shard})

    def hub(name: str, spec: str, fragments: tuple[str, ...] = (), file: str | None = None, adapter: str | None = None) -> None:
        add(DoorCase(name, "hub", "load", "SourceError", file or spec, path=spec, adapter=adapter, fragments=fragments))

    hub("hub_rev_dotdot", "hf://org/tiny@../../x", ("cannot contain '..'",))
    hub("hub_rev_reads_outside", "hf://org/tiny@../../../outside", ("cannot contain '..'",))  # root/outside holds a checkpoint
    hub("hub_rev_dotdot_inside", "hf://org/tiny@refs/../main", ("cannot contain '..'",))
    hub("hub_rev_trailing_slash", "hf://org/tiny@main/", ("'/'",))
    hub("hub_rev_empty", "hf://org/tiny@", ("1-256 characters",))
    hub("hub_rev_space", "hf://org/tiny@ma in", ("spaces",))
    hub("hub_rev_lock", "hf://org/tiny@main.lock", (".lock",))
    hub("hub_rev_dot_part", "hf://org/tiny@.hidden", ("start with '.'",))
    hub("hub_rev_at_brace", "hf://org/tiny@main@{1}", ("'@{'",))
    hub("hub_rev_unknown_tag", "hf://org/tiny@v2", ("not in the local Hub cache",))
    hub("hub_rev_unknown_commit", f"hf://org/tiny@{'0' * 40}", ("not in the local Hub cache",))
    hub("hub_repo_double_dash", "hf://org/ti--ny", ("not a Hub repository id",))
    hub("hub_repo_dot_git", "hf://org/tiny.git", ("not a Hub repository id",))
    hub("hub_repo_leading_dash", "hf://-org/tiny", ("not a Hub repository id",))
    hub("hub_repo_three_parts", "hf://org/tiny/extra", ("not a Hub repository id",))
    hub("hub_repo_no_namespace", "hf://tiny", ("hf://org/name",))
    hub("hub_repo_unicode", "hf://org/tïny", ("not a Hub repository id",))
    hub("hub_repo_absent", "hf://org/absent", ("not in the local Hub cache",))
    hub("hub_shard_symlink_out", "hf://org/leak", ("outside the checkpoint folder",), file=INDEX)
    hub("hub_snapshot_symlink_out", "hf://org/leakdir", ("outside the repository's cache folder",))
    hub("hub_index_escapes", "hf://org/escape", ("not a plain file name",), file=INDEX)
    hub("hub_index_not_json", "hf://org/badindex", ("not valid JSON",), file=INDEX)
    hub("hub_index_too_deep", "hf://org/deepindex", ("levels deep",), file=INDEX)
    hub("hub_index_wrong_type", "hf://org/typedindex", (f"field weight_map.'{KEY}'",), file=INDEX)
    hub("hub_ref_to_missing_snapshot", "hf://org/noref", ())
    hub("hub_config_not_utf8", "hf://org/badconfig", ("not UTF-8",), file="config.json", adapter="llama")


def _config_cases(root: str, sd: dict[str, torch.Tensor], add: Any) -> None:
    def case(name: str, config: bytes, fragments: tuple[str, ...], adapter: str = "llama", error: str = "SourceError") -> None:
        folder = _folder_with_config(os.path.join(root, "config"), name, config, sd)
        add(DoorCase(name, "config", "load", error, os.path.join(folder, "config.json"), path=folder,
                     adapter=adapter, fragments=fragments))  # fmt: skip

    case("config_not_utf8", b'{"num_attention_heads": "\xe9"}', ("not UTF-8",))
    case("config_too_deep", DEEP, ("levels deep",))
    case("config_deep_in_field", b'{"rope_scaling": ' + b"[" * 5000 + b"]" * 5000 + b"}", ("levels deep",))
    case("config_truncated", b'{"num_attention_heads": 4, ', ("not valid JSON",))
    case("config_array", b"[1, 2]", ("must be a JSON object",))
    case("config_heads_string", _j({"num_attention_heads": "4"}), ("field num_attention_heads",))
    case("config_heads_negative", _j({"num_attention_heads": -4}), ("field num_attention_heads",))
    case("config_heads_float", _j({"num_attention_heads": 4.0}), ("field num_attention_heads",))
    case("config_tie_string", _j({"tie_word_embeddings": "yes"}), ("field tie_word_embeddings",))
    case("config_layers_nan", b'{"num_hidden_layers": NaN}', ("field num_hidden_layers",))
    case("config_quant_list", _j({"quantization_config": ["fp8"]}), ("field quantization_config",))
    case("config_quant_string", _j({"quantization_config": "fp8"}), ("field quantization_config",), adapter="qwen3")
    case("config_quant_block_string", _j({"quantization_config": {"quant_method": "fp8", "weight_block_size": "128"}}),
         ("weight_block_size",), adapter="qwen3", error="AdapterError")  # fmt: skip
    case("config_quant_method_unknown", _j({"quantization_config": {"quant_method": "gguf"}}), ("gguf",),
         adapter="deepseek_v3", error="AdapterError")  # fmt: skip
    case("config_architectures_dict", _j({"architectures": {"a": 1}}), ("field architectures",))
    case("config_too_large", b'{"pad": "' + b"x" * (17 << 20) + b'"}', ("exceeds the limit",))


def _index_cases(root: str, sd: dict[str, torch.Tensor], add: Any) -> None:
    def case(name: str, index: bytes, fragments: tuple[str, ...]) -> None:
        folder = os.path.join(root, "index", name)
        write_hf_sharded(folder, sd)
        path = _w(os.path.join(folder, INDEX), index)
        add(DoorCase(name, "index", "load", "SourceError", path, path=folder, fragments=fragments))

    case("index_too_deep", b'{"weight_map": ' + DEEP + b"}", ("levels deep",))
    case("index_not_utf8", b'{"weight_map": {"\xff": "a"}}', ("not UTF-8",))
    case("index_value_list", _j({"weight_map": {KEY: ["a.safetensors"]}}), (f"field weight_map.'{KEY}'",))


def _lora_cases(root: str, good_st: str, add: Any) -> None:
    module = "base_model.model." + KEY.removesuffix(".weight")
    a, b = torch.randn(2, 8, generator=torch.Generator().manual_seed(3)), torch.randn(12, 2, generator=torch.Generator().manual_seed(4))
    base_cfg = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["0"], "bias": "none"}

    def case(name: str, config: bytes | None, tensors: dict[str, torch.Tensor] | None, error: str, file: str,
             fragments: tuple[str, ...] = ()) -> None:  # fmt: skip
        folder = os.path.join(root, "lora", name)
        os.makedirs(folder)
        if config is not None:
            _w(os.path.join(folder, "adapter_config.json"), config)
        if tensors is not None:
            _st(os.path.join(folder, "adapter_model.safetensors"), tensors)
        add(DoorCase(name, "lora", "load", error, os.path.join(folder, file) if file else folder, path=good_st, kwargs={"lora": folder},
                     fragments=fragments))  # fmt: skip

    pair = {f"{module}.lora_A.weight": a, f"{module}.lora_B.weight": b}
    cfg = _j(base_cfg)
    case("lora_rank_zero", cfg, {f"{module}.lora_A.weight": torch.zeros(0, 8), f"{module}.lora_B.weight": torch.zeros(12, 0)},
         "SourceError", "adapter_model.safetensors", ("rank 0",))  # fmt: skip
    case("lora_alpha_pattern_list", _j({**base_cfg, "alpha_pattern": ["0", 3]}), pair, "AdapterError", "adapter_config.json",
         ("field alpha_pattern",))  # fmt: skip
    case("lora_alpha_pattern_value", _j({**base_cfg, "alpha_pattern": {"0": "three"}}), pair, "AdapterError",
         "adapter_config.json", ("field alpha_pattern",))  # fmt: skip
    case("lora_alpha_pattern_regex", _j({**base_cfg, "alpha_pattern": {"(": 3}}), pair, "AdapterError", "adapter_config.json",
         ("not a regular expression",))  # fmt: skip
    case("lora_alpha_missing", _j({k: v for k, v in base_cfg.items() if k != "lora_alpha"}), pair, "AdapterError",
         "adapter_config.json", ("field lora_alpha",))  # fmt: skip
    case("lora_alpha_bool", _j({**base_cfg, "lora_alpha": True}), pair, "AdapterError", "adapter_config.json", ("field lora_alpha",))
    case("lora_r_zero", _j({**base_cfg, "r": 0}), pair, "AdapterError", "adapter_config.json", ("field r",))
    case("lora_config_not_utf8", b'{"lora_alpha": 4, "x": "\xff"}', pair, "SourceError", "adapter_config.json", ("not UTF-8",))
    case("lora_config_too_deep", DEEP, pair, "SourceError", "adapter_config.json", ("levels deep",))
    case("lora_config_array", b"[]", pair, "AdapterError", "adapter_config.json", ("not a JSON object",))
    case("lora_use_dora", _j({**base_cfg, "use_dora": True}), pair, "AdapterError", "adapter_config.json", ("DoRA",))
    case("lora_no_weights", cfg, None, "AdapterError", "", ("adapter_model.safetensors",))
    case("lora_a_wrong_shape", cfg, {**pair, f"{module}.lora_A.weight": torch.randn(2, 5)}, "PlanError", "",
         ("A must be [r, 8]",))  # fmt: skip
    case("lora_b_missing", cfg, {f"{module}.lora_A.weight": a}, "PlanError", "", ("no lora_B partner",))


def _quant_cases(root: str, sd: dict[str, torch.Tensor], add: Any) -> None:
    fp8 = sd[KEY].clamp(-400, 400).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 2, generator=torch.Generator().manual_seed(5)) + 0.5
    adapter = os.path.join(root, "quant", "fp8_adapter.json")
    _w(adapter, sdadapt.Adapter([DequantFP8(keys=KEY, block=[4, 4], dtype="float32")], name="fp8").to_json())

    def fp8_case(name: str, tensors: dict[str, torch.Tensor], error: str, fragments: tuple[str, ...], phase: str = "open",
                 **kwargs: Any) -> None:  # fmt: skip
        path = os.path.join(root, "quant", name, "model.safetensors")
        _st(path, {**{k: v for k, v in sd.items() if k != KEY}, **tensors})
        add(DoorCase(name, "quant", "load", error, path, path=path, adapter=adapter, kwargs=kwargs, fragments=fragments,
                     phase=phase))  # fmt: skip

    s = KEY + "_scale_inv"
    fp8_case("fp8_scale_missing", {KEY: fp8}, "PlanError", ())
    fp8_case("fp8_scale_wrong_shape", {KEY: fp8, s: scale[:2]}, "PlanError", (s,))
    fp8_case("fp8_scale_int_dtype", {KEY: fp8, s: scale.to(torch.int32)}, "PlanError", (s,))
    fp8_case("fp8_scale_3d", {KEY: fp8, s: scale[None]}, "PlanError", (s,))
    fp8_case("fp8_weight_not_fp8", {KEY: sd[KEY].half(), s: scale}, "PlanError", (KEY,))
    fp8_case("fp8_scale_nan", {KEY: fp8, s: torch.full((3, 2), float("nan"))}, "LoadError", ("NaN",), phase="read",
             check_finite=True)  # fmt: skip
    bad_adapter = _w(os.path.join(root, "quant", "bad_block_adapter.json"),
                     _j({"rules": [{"kind": "dequant_fp8", "keys": KEY, "block": [0, 4]}]}))  # fmt: skip
    path = os.path.join(root, "quant", "fp8_scale_missing", "model.safetensors")
    add(DoorCase("fp8_adapter_block_zero", "quant", "load", "AdapterError", bad_adapter, path=path, adapter=bad_adapter))

    mx_adapter = _w(os.path.join(root, "quant", "mx_adapter.json"),
                    sdadapt.Adapter([DequantMXFP4(keys="weight", dtype="float32")], name="mx").to_json())  # fmt: skip
    blocks = torch.randint(0, 255, (4, 1, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(6))
    scales = torch.full((4, 1), 127, dtype=torch.uint8)

    def mx_case(name: str, tensors: dict[str, torch.Tensor], fragments: tuple[str, ...]) -> None:
        path = os.path.join(root, "quant", name, "model.safetensors")
        _st(path, tensors)
        add(DoorCase(name, "quant", "load", "PlanError", path, path=path, adapter=mx_adapter, model_kind="mx",
                     fragments=fragments))  # fmt: skip

    mx_case("mx_scales_missing", {"weight_blocks": blocks}, ("no scales",))
    mx_case("mx_scales_wrong_shape", {"weight_blocks": blocks, "weight_scales": scales[:2]}, ("weight_scales",))
    mx_case("mx_blocks_wrong_width", {"weight_blocks": blocks[..., :8].contiguous(), "weight_scales": scales}, ("weight_blocks",))
    mx_case("mx_blocks_float", {"weight_blocks": blocks.float(), "weight_scales": scales}, ("weight_blocks",))


def _cli_cases(root: str, sd: dict[str, torch.Tensor], add: Any) -> None:
    out = os.path.join(root, "cli_out")  # stays empty: every command fails before writing
    os.makedirs(out, exist_ok=True)
    layered = {k: v for k, v in sd.items()}

    def cli(name: str, door: str, argv: list[str], error_file: str, fragments: tuple[str, ...] = (), error: str = "") -> None:
        add(DoorCase(name, door, "cli", error, error_file, argv=argv, fragments=fragments))

    for tag, config, frag in (
        ("not_json", b'{"num_hidden_layers": 1,', "not valid JSON"),
        ("not_utf8", b'{"model_type": "\xff"}', "not UTF-8"),
        ("wrong_type", _j({"num_hidden_layers": "1"}), "field num_hidden_layers"),
        ("too_deep", DEEP, "levels deep"),
    ):
        folder = _folder_with_config(os.path.join(root, "cli"), f"shrink_{tag}", config, layered)
        cli(f"shrink_config_{tag}", "shrink", ["shrink", folder, os.path.join(out, f"shrink_{tag}"), "--layers", "1"],
            os.path.join(folder, "config.json"), (frag,))  # fmt: skip
    cli("shrink_hub_dotdot", "shrink", ["shrink", "hf://org/tiny@../../x", os.path.join(out, "s_hub"), "--layers", "1"],
        "hf://org/tiny@../../x", ("'..'",))  # fmt: skip
    folder = _folder_with_config(os.path.join(root, "cli"), "convert_config", b"\xff", layered)
    cli("convert_adapter_config_not_utf8", "convert", ["convert", folder, os.path.join(out, "c1"), "-a", "llama", "--to", "torch"],
        os.path.join(folder, "config.json"), ("not UTF-8",))  # fmt: skip
    bad_index = os.path.join(root, "cli", "convert_index")
    write_hf_sharded(bad_index, sd)
    _w(os.path.join(bad_index, INDEX), b'{"weight_map": {"a": 1}}')
    cli("convert_index_wrong_type", "convert", ["convert", bad_index, os.path.join(out, "c2"), "--to", "torch"],
        os.path.join(bad_index, INDEX), ("field weight_map.a",))  # fmt: skip
    cli("convert_hub_bad_repo", "convert", ["convert", "hf://org/ti--ny", os.path.join(out, "c3"), "--to", "torch"], "hf://org/ti--ny",
        ("not a Hub repository id",))  # fmt: skip
    folder = _folder_with_config(os.path.join(root, "cli"), "verify_config", DEEP, layered)
    cli("verify_config_too_deep", "verify", ["verify", folder, "--model", "support.corpus:corpus_model"],
        os.path.join(folder, "config.json"), ("levels deep",))  # fmt: skip
    folder = _folder_with_config(os.path.join(root, "cli"), "verify_arch", _j({"architectures": "Llama"}), layered)
    cli("verify_config_architectures_string", "verify", ["verify", folder, "--model", "support.corpus:corpus_model"],
        os.path.join(folder, "config.json"), ("field architectures",))  # fmt: skip
    cli("verify_hub_dotdot", "verify", ["verify", "hf://org/tiny@a/../../b", "--model", "support.corpus:corpus_model"],
        "hf://org/tiny@a/../../b", ("'..'",))  # fmt: skip
