"""Fuzzing (hypothesis): hostile safetensors headers, HF index files, adapter JSON, config.json and
adapter_config.json files, raw JSON bytes and Hub ids give
sdadapt errors or work, never an unhandled exception (struct.error, KeyError, TypeError,
RecursionError, ValueError...).

Each input is opened (and, if it opens, every tensor read whole; an adapter is also planned
against a schema and, where that works, inverted). The only exceptions allowed are
``SdadaptError`` subclasses.

CI runs a bounded number of examples per property (default 40). For a longer run:

    SDADAPT_FUZZ_EXAMPLES=5000 .venv/bin/python -m pytest tests/sources/test_fuzz.py -q
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from typing import Any

import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from support.checkpoints import INDEX_NAME, write_safetensors

from sdadapt import Adapter
from sdadapt._plan.plan import build_plan
from sdadapt.errors import SdadaptError
from sdadapt.sources import TensorInfo, open_source

EXAMPLES = int(os.environ.get("SDADAPT_FUZZ_EXAMPLES", "40"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=EXAMPLES <= 40,  # CI: the same examples every run; longer runs explore
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)

DTYPES = ["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2", "F8_E8M0", "U16", "U32",
          "U64"]  # fmt: skip

# any JSON value, deep and wide enough to hit odd types everywhere
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
small_ints = st.integers(-3, 40) | st.sampled_from([0, 1, 2**31, 2**63 - 1, 2**64, -(2**63)])


def _reads_everything(path: str) -> None:
    """Open, then read every tensor whole; only SdadaptError may escape."""
    try:
        src = open_source(path)
    except SdadaptError:
        event("refused at open")
        return
    event(f"opened, {len(src.schema)} tensors")
    try:
        for key, info in src.schema.items():
            t = src.read(key, tuple((0, n) for n in info.shape))
            assert tuple(t.shape) == tuple(info.shape) and t.dtype == info.dtype
            t.clone()  # touch every byte
    except SdadaptError:
        pass
    finally:
        src.close()


# --------------------------------------------------------------------------------------------
# safetensors headers
# --------------------------------------------------------------------------------------------
entry = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(DTYPES) | st.text(max_size=5) | json_values,
        "shape": st.lists(small_ints, max_size=4) | json_values,
        "data_offsets": st.lists(small_ints, min_size=0, max_size=3) | json_values,
    },
    optional={"extra": json_values},
)
headers = st.dictionaries(st.text(max_size=10), entry | json_values, max_size=5) | json_values


def _consistent(tensors: list[tuple[str, str, list[int]]]) -> tuple[dict[str, Any], int]:
    from sdadapt.sources._safetensors_file import DTYPES as KNOWN

    header: dict[str, Any] = {}
    off = 0
    for key, dt, shape in tensors:
        n = KNOWN[dt].itemsize
        for s in shape:
            n *= s
        header[key] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    return header, off


tensor_specs = st.lists(
    st.tuples(st.text(max_size=6), st.sampled_from(DTYPES), st.lists(st.integers(0, 5), max_size=3)),
    max_size=4,
    unique_by=lambda t: t[0],
)
mutations = st.lists(
    st.tuples(
        st.sampled_from(["offset0", "offset1", "dtype", "shape", "drop_field", "swap", "data_len"]),
        st.integers(-40, 40),
    ),
    max_size=3,
)


def test_fuzzed_dtypes_are_the_readers_dtypes() -> None:
    """The fuzzers draw every dtype name the safetensors reader accepts, and only those."""
    from sdadapt.sources._safetensors_file import DTYPES as KNOWN

    assert sorted(DTYPES) == sorted(KNOWN)


@FUZZ
@given(specs=tensor_specs, muts=mutations)
def test_fuzz_safetensors_near_valid(specs: list[tuple[str, str, list[int]]], muts: list[tuple[str, int]]) -> None:
    """Valid headers with a few small lies: offsets off by some bytes, dtype or shape changed,
    a field missing, offsets swapped, data area shorter or longer."""
    header, total = _consistent(specs)
    keys = list(header)
    for what, delta in muts:
        if what == "data_len":
            total = max(0, total + delta)
            continue
        if not keys:
            continue
        e = header[keys[abs(delta) % len(keys)]]
        if len(e) < 3:  # a field was dropped already: leave this entry alone
            continue
        if what == "offset0":
            e["data_offsets"][0] += delta
        elif what == "offset1":
            e["data_offsets"][1] += delta
        elif what == "dtype":
            e["dtype"] = DTYPES[abs(delta) % len(DTYPES)]
        elif what == "shape" and e["shape"]:
            e["shape"][abs(delta) % len(e["shape"])] += delta
        elif what == "drop_field":
            e.pop(["dtype", "shape", "data_offsets"][abs(delta) % 3])
        elif what == "swap":
            e["data_offsets"].reverse()
    raw = json.dumps(header).encode()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "f.safetensors")
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw + bytes(i % 251 for i in range(total)))
        _reads_everything(path)


@FUZZ
@given(
    header=headers,
    metadata=st.none() | json_values,
    data_len=st.integers(0, 300),
    header_len=st.none() | small_ints.filter(lambda n: 0 <= n < 2**64) | st.integers(0, 400),
)
def test_fuzz_safetensors_header(header: Any, metadata: Any, data_len: int, header_len: int | None) -> None:
    if isinstance(header, dict) and metadata is not None:
        header = {**header, "__metadata__": metadata}
    raw = json.dumps(header).encode()
    n = len(raw) if header_len is None else header_len
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "f.safetensors")
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", n) + raw + bytes(range(256)) * (data_len // 256) + bytes(data_len % 256))
        _reads_everything(path)


_GOOD: dict[str, bytes] = {}


def _good_file() -> bytes:
    if not _GOOD:
        with tempfile.TemporaryDirectory() as d:
            p = write_safetensors(
                os.path.join(d, "g.safetensors"),
                {"a": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5, dtype=torch.int16), "c": torch.zeros(())},
            )
            _GOOD["st"] = open(p, "rb").read()
    return _GOOD["st"]


@FUZZ
@given(
    flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), max_size=6),
    cut=st.none() | st.integers(0, 10**6),
)
def test_fuzz_safetensors_bytes(flips: list[tuple[int, int]], cut: int | None) -> None:
    """Random byte flips (mostly in the header, which comes first) and truncations of a good file."""
    data = bytearray(_good_file())
    for at, mask in flips:
        data[at % min(len(data), 200)] ^= mask
    if cut is not None:
        data = data[: cut % (len(data) + 1)]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "f.safetensors")
        with open(path, "wb") as f:
            f.write(bytes(data))
        _reads_everything(path)


# --------------------------------------------------------------------------------------------
# HF index files
# --------------------------------------------------------------------------------------------
shard_names = st.sampled_from(
    ["a.safetensors", "b.safetensors", "missing.safetensors", "../a.safetensors", "/etc/passwd", "", ".", "..",
     "sub/a.safetensors", "link.safetensors", "a.safetensors/", "\x00", "a.safetensors\x00x"]
) | json_values
weight_maps = st.dictionaries(st.sampled_from(["x", "y", "z", "w", ""]) | st.text(max_size=6), shard_names, max_size=5)
indexes = st.fixed_dictionaries({"weight_map": weight_maps}, optional={"metadata": json_values}) | json_values


@FUZZ
@given(index=indexes, raw_tail=st.binary(max_size=8))
def test_fuzz_hf_index(index: Any, raw_tail: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        folder = os.path.join(d, "hf")
        os.mkdir(folder)
        write_safetensors(os.path.join(folder, "a.safetensors"), {"x": torch.ones(2), "y": torch.arange(3.0)})
        write_safetensors(os.path.join(folder, "b.safetensors"), {"z": torch.zeros(2, 2), "x": torch.ones(2)})
        outside = os.path.join(d, "outside.safetensors")
        shutil.copy(os.path.join(folder, "a.safetensors"), outside)
        os.symlink(outside, os.path.join(folder, "link.safetensors"))
        with open(os.path.join(folder, INDEX_NAME), "wb") as f:
            f.write(json.dumps(index).encode() + raw_tail)
        _reads_everything(folder)


# --------------------------------------------------------------------------------------------
# adapter JSON
# --------------------------------------------------------------------------------------------
KINDS = ["rename", "fuse", "split", "cast", "drop", "tie", "transpose", "rotary", "stack", "unstack", "pad", "trim",
         "interleave", "deinterleave", "strip_prefix", "add_prefix", "nope"]
patterns = st.sampled_from(["layers.0.w", "layers.1.w", "layers.0.b", "e.{e}.w", "layers.{i}.w", "w", "b", "layers.{i}.w",
                            "layers.{i}.b", "**", "*", "{x:int}", "layers.{i:int}.*", "q", "k", "v",
                            "qkv", "e.{e}.w", "experts.w", "{", "}", "a..b", "", "layers.{i}.{i}"]) | st.text(max_size=8)
fields = {
    "src": patterns, "dst": patterns, "srcs": st.lists(patterns, max_size=3), "dsts": st.lists(patterns, max_size=3),
    "keys": patterns, "dim": small_ints, "dim0": small_ints, "dim1": small_ints, "sizes": st.none() | st.lists(small_ints, max_size=3),
    "dtype": st.sampled_from(["float32", "bfloat16", "int8", "float", "nope"]), "from_dtype": st.none() | st.sampled_from(["float16", "x"]),
    "heads": small_ints, "to": st.sampled_from(["interleaved", "half", "x"]), "over": st.sampled_from(["e", "i", "zz"]),
    "count": st.none() | small_ints, "size": st.none() | small_ints, "multiple_of": st.none() | small_ints,
    "value": st.floats(allow_nan=True) | small_ints, "tp": st.none() | small_ints, "prefix": st.sampled_from(["model.", "", "x"]),
    "optional": st.booleans(),
}
def _typed_rule(cls: Any) -> st.SearchStrategy[dict[str, Any]]:
    names = [n for n in cls.model_fields if n != "kind"]
    required = [n for n in names if cls.model_fields[n].is_required()]
    kind = cls.model_fields["kind"].default
    return st.fixed_dictionaries(
        {"kind": st.just(kind), **{n: fields.get(n, json_values) for n in required}},
        optional={n: fields.get(n, json_values) for n in names if n not in required},
    )


def _rule_classes() -> list[Any]:
    from sdadapt import rules as R

    out, todo = [], list(R.RuleBase.__subclasses__())
    while todo:
        c = todo.pop()
        todo += c.__subclasses__()
        if "kind" in c.model_fields:
            out.append(c)
    return sorted(out, key=lambda c: c.__name__)


typed_rules = st.one_of([_typed_rule(c) for c in _rule_classes()])
rules = typed_rules | typed_rules | st.builds(
    lambda kind, picked: {"kind": kind, **picked},
    st.sampled_from(KINDS),
    st.dictionaries(st.sampled_from(sorted(fields)), st.just(None), max_size=6).flatmap(
        lambda ks: st.fixed_dictionaries({k: fields[k] for k in ks})
    ),
) | json_values
adapters = (
    st.fixed_dictionaries({"rules": st.lists(typed_rules, max_size=4)})
    | st.fixed_dictionaries({"rules": st.lists(rules, max_size=4)}, optional={"name": json_values, "extra": json_values})
    | json_values
)

SOURCE = {
    "layers.0.w": TensorInfo((4, 6), torch.float32), "layers.1.w": TensorInfo((4, 6), torch.float32),
    "layers.0.b": TensorInfo((4,), torch.float32), "q": TensorInfo((4, 6), torch.bfloat16), "k": TensorInfo((2, 6), torch.bfloat16),
    "v": TensorInfo((2, 6), torch.bfloat16), "e.0.w": TensorInfo((3, 2), torch.float16), "e.1.w": TensorInfo((3, 2), torch.float16),
}
TARGET = {
    "layers.0.w": TensorInfo((6, 4), torch.float32), "layers.1.w": TensorInfo((4, 6), torch.float32),
    "layers.0.b": TensorInfo((8,), torch.float32), "qkv": TensorInfo((8, 6), torch.float32),
    "experts.w": TensorInfo((2, 3, 2), torch.float16),
}


@FUZZ
@given(adapter=adapters, text_tail=st.text(max_size=3))
def test_fuzz_adapter_json(adapter: Any, text_tail: str) -> None:
    text = json.dumps(adapter) + text_tail
    try:
        a = Adapter.from_json(text)
    except SdadaptError:
        event("adapter refused")
        return
    event(f"adapter with {len(a.rules)} rules parsed")
    try:
        plan = build_plan(SOURCE, TARGET, a)
        plan.report.format()
        event(f"planned, {len(plan.recipes)} recipes")
        a.inverse()
        Adapter.from_json(a.to_json())
    except SdadaptError:
        pass


# --------------------------------------------------------------------------------------------
# JSON configs: config.json through the shipped adapters, adapter_config.json through a LoRA
# load, raw bytes through the one JSON reader, Hub ids
# --------------------------------------------------------------------------------------------
CONFIG_FIELDS = ["num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size", "head_dim",
                 "intermediate_size", "vocab_size", "tie_word_embeddings", "attention_bias", "num_local_experts",
                 "num_experts", "n_routed_experts", "first_k_dense_replace", "num_nextn_predict_layers", "q_lora_rank",
                 "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "rope_interleave", "decoder_sparse_step",
                 "mlp_only_layers", "architectures", "model_type", "quantization_config", "text_config", "n_layers",
                 "n_heads", "dim"]  # fmt: skip
quant_configs = st.fixed_dictionaries(
    {"quant_method": st.sampled_from(["fp8", "mxfp4", "compressed-tensors", "x"]) | json_values},
    optional={"weight_block_size": st.lists(small_ints, max_size=3) | json_values, "scale_fmt": st.sampled_from(["ue8m0", "x"]),
              "modules_to_not_convert": st.lists(st.text(max_size=6), max_size=3) | json_values},
) | json_values  # fmt: skip
config_values = {n: small_ints | json_values for n in CONFIG_FIELDS} | {"quantization_config": quant_configs}
configs = st.fixed_dictionaries({}, optional=config_values) | json_values
# damage applied to the encoded JSON: none, a byte flipped, cut, not UTF-8, deep nesting, a BOM
damage = st.sampled_from(["none", "flip", "cut", "latin1", "deep", "bom"])
ADAPTER_NAMES = ["llama", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "gpt2"]


def _damaged(data: bytes, how: str, at: int) -> bytes:
    if how == "flip" and data:
        i = at % len(data)
        return data[:i] + bytes([data[i] ^ 0x80]) + data[i + 1 :]
    if how == "cut":
        return data[: at % (len(data) + 1)]
    if how == "latin1":
        return data.replace(b'"', b'"\xe9', 1)
    if how == "deep":
        return b"[" * (64 + at % 4000) + data + b"]" * (64 + at % 4000)
    if how == "bom":
        return b"\xef\xbb\xbf" + data
    return data


@FUZZ
@given(config=configs, how=damage, at=st.integers(0, 1 << 16), name=st.sampled_from(ADAPTER_NAMES))
def test_fuzz_config_json(config: Any, how: str, at: int, name: str) -> None:
    """A shipped adapter reading options from a hostile config.json beside a small checkpoint:
    an adapter, or an SdadaptError naming config.json when the file itself is at fault."""
    import sdadapt

    with tempfile.TemporaryDirectory() as d:
        write_safetensors(os.path.join(d, "model.safetensors"), {"model.layers.0.mlp.gate_proj.weight": torch.ones(2, 2)})
        with open(os.path.join(d, "config.json"), "wb") as f:
            f.write(_damaged(json.dumps(config).encode(), how, at))
        try:
            sdadapt.get_adapter(name, d)
            event("adapter built")
        except SdadaptError as e:
            event(f"refused: {type(e).__name__}")
        from sdadapt._tools.shrinking import shrink_config
        from sdadapt.sources._configs import HFConfig
        from sdadapt.sources._json import read_json_dict

        try:
            shrink_config(read_json_dict(os.path.join(d, "config.json"), HFConfig, what="config.json"), 1)
        except SdadaptError as e:
            assert "config.json" in str(e)


peft_configs = st.fixed_dictionaries(
    {"lora_alpha": st.integers(-4, 64) | st.floats(allow_nan=True) | json_values},
    optional={"r": small_ints | json_values, "alpha_pattern": st.dictionaries(st.text(max_size=4), json_values, max_size=3)
              | json_values, "peft_type": st.sampled_from(["LORA", "IA3"]) | json_values, "bias": json_values,
              "use_rslora": json_values, "fan_in_fan_out": json_values, "use_dora": json_values,
              "target_modules": json_values},
) | json_values  # fmt: skip


@FUZZ
@given(config=peft_configs, how=damage, at=st.integers(0, 1 << 16), rank=st.integers(0, 3))
def test_fuzz_peft_config(config: Any, how: str, at: int, rank: int) -> None:
    """A LoRA folder with a hostile adapter_config.json (and a pair of rank ``rank``) merged into
    a small checkpoint: a plan, or an SdadaptError."""
    from torch import nn

    import sdadapt

    with tempfile.TemporaryDirectory() as d:
        base = os.path.join(d, "model.safetensors")
        write_safetensors(base, {"0.weight": torch.ones(4, 6), "0.bias": torch.zeros(4)})
        lora = os.path.join(d, "lora")
        os.mkdir(lora)
        write_safetensors(os.path.join(lora, "adapter_model.safetensors"), {
            "base_model.model.0.lora_A.weight": torch.ones(rank, 6), "base_model.model.0.lora_B.weight": torch.ones(4, rank)})  # fmt: skip
        with open(os.path.join(lora, "adapter_config.json"), "wb") as f:
            f.write(_damaged(json.dumps(config).encode(), how, at))
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(6, 4))
        try:
            sdadapt.load(model, base, lora=lora)
            event("merged")
        except SdadaptError as e:
            event(f"refused: {type(e).__name__}")


@FUZZ
@given(data=st.binary(max_size=64) | json_values.map(lambda v: json.dumps(v).encode()), how=damage, at=st.integers(0, 1 << 16))
def test_fuzz_json_reader(data: bytes, how: str, at: int) -> None:
    """Any bytes through the one JSON reader: a value, or a SourceError naming the file."""
    from sdadapt.errors import SourceError
    from sdadapt.sources._configs import HFConfig, PeftConfig
    from sdadapt.sources._json import ShardIndex, read_json

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "f.json")
        with open(path, "wb") as f:
            f.write(_damaged(data, how, at))
        for model in (None, HFConfig, ShardIndex, PeftConfig):
            try:
                read_json(path, model, what="file")
            except SourceError as e:
                assert path in str(e)


hub_ids = st.text(max_size=40) | st.builds(
    lambda repo, rev: f"{repo}@{rev}" if rev is not None else repo,
    st.sampled_from(["org/tiny", "org/ti--ny", "o/t.git", "-o/t", "org/a/b", "org"]) | st.text(max_size=12),
    st.none() | st.sampled_from(["main", "v1", "../../x", "a/../b", "refs/pr/1", "a//b", "/a", "a/", ".a", "a.lock", "@", "a@{1}",
                                 "a b", "0" * 40, "~1", ""]) | st.text(max_size=16),
)  # fmt: skip


@FUZZ
@given(text=hub_ids)
def test_fuzz_hub_ids(text: str) -> None:
    """A Hub id is parsed or refused with a SourceError; one that parses never names a path
    that leaves the cache's ``refs`` / ``snapshots`` folders."""
    from sdadapt.errors import SourceError
    from sdadapt.sources._hub import parse_hub_id

    try:
        repo, rev = parse_hub_id("hf://" + text)
    except SourceError:
        event("refused")
        return
    event("parsed")
    assert repo.count("/") == 1 and ".." not in repo
    for sub in ("refs", "snapshots"):
        where = os.path.normpath(os.path.join("/cache/models--x", sub, rev or "main"))
        assert where.startswith(f"/cache/models--x/{sub}/"), (text, where)
