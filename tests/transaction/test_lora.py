"""LoRA merge on load (``sdadapt.load(..., lora=peft_folder)``), single process.

The reference is peft's own ``merge_and_unload()`` on a tiny transformers model whose LoRA
``B`` matrices are random (peft initialises them to zero, which would merge nothing). Checked
here: merged weights and logits equal peft's (plain, rsLoRA with an ``alpha_pattern``, GPT-2's
``Conv1D`` with ``fan_in_fan_out``); a region of a :class:`MergedLora` equals the same region of
its eager ``full()`` bit for bit and reads only the box's rows of ``B`` and columns of ``A``;
every unsupported PEFT feature and every mismatched LoRA key fails while planning, naming the
field or key, with the model left on the meta device. The 2x2 FSDP2+TP load is in
``test_lora_dist.py``.
"""

from __future__ import annotations

import json
import os
import random
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.checkpoints import DictIO
from support.lora_cases import LLAMA, TARGETS, VOCAB, llama, spread, transformers, write_peft_case

import sdadapt
from sdadapt._base.regions import full_box
from sdadapt._plan.plan import build_plan
from sdadapt._recipes.lora import MergedLora
from sdadapt._recipes.nodes import Leaf
from sdadapt.errors import AdapterError, PlanError, SourceError
from sdadapt.rules._lora import LORA_NAMESPACE, MergeLora
from sdadapt.sources import SafetensorsFile
from sdadapt.sources._joined import JoinedSource

MERGE_TOL = dict(rtol=1e-6, atol=1e-6)  # peft sums B @ A in float32, sdadapt in float64
LOGIT_TOL = dict(rtol=1e-5, atol=2e-5)


def _load_hf(case: dict[str, Any], build: Any, **kw: Any) -> torch.nn.Module:
    """``build()`` (fresh random values, rotary buffers computed by its own init) loaded in place
    from the case's base + LoRA with the identity adapter."""
    torch.manual_seed(99)
    model = build().eval()
    rep = sdadapt.load(model, case["base"], lora=case["lora"], **kw)
    assert rep.report.ok, rep.report.format()
    # the report names the LoRA folder, its ranks and the weights the merge changed
    pairs = {k: v for k, v in load_file(os.path.join(case["lora"], "adapter_model.safetensors")).items() if ".lora_A." in k}
    assert rep.lora is not None and rep.lora.folder == case["lora"], rep.lora
    assert rep.lora.pairs == rep.lora.keys == len(pairs), rep.lora
    assert rep.lora.ranks == sorted({a.shape[0] for a in pairs.values()}), rep.lora
    assert f"merged LoRA {case['lora']} (r=" in str(rep) and f"into {len(pairs)} model keys" in str(rep)
    return model


# --- the merged values equal peft's ----------------------------------------------------------------


@pytest.mark.parametrize(
    "lora",
    [
        dict(r=4, lora_alpha=8, target_modules=TARGETS),
        dict(r=4, lora_alpha=8, target_modules=TARGETS, use_rslora=True),
        dict(r=4, lora_alpha=8, target_modules=TARGETS, rank_pattern={"o_proj": 2}, alpha_pattern={"v_proj": 3}),
    ],
    ids=["plain", "rslora", "patterns"],
)
def test_llama_merge_matches_peft(tmp_path: Any, lora: dict[str, Any]) -> None:
    case = write_peft_case(str(tmp_path), llama(3), 3, **lora)
    model = _load_hf(case, lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)))
    got = model.state_dict()
    assert set(got) == set(case["merged"])
    for key, want in case["merged"].items():
        torch.testing.assert_close(got[key], want, **MERGE_TOL, msg=key)
    lora_keys = load_file(os.path.join(case["lora"], "adapter_model.safetensors"))
    merged_into = {k.removeprefix("base_model.model.").split(".lora_")[0] + ".weight" for k in lora_keys}
    base = load_file(os.path.join(case["base"], "model.safetensors"))
    for key in merged_into:  # the merge changed exactly the targeted weights
        assert not torch.equal(got[key], base[key]), key
    for key in set(base) - merged_into:
        assert torch.equal(got[key], base[key]), key
    with torch.no_grad():
        torch.testing.assert_close(model(case["tokens"]).logits.float(), case["logits"], **LOGIT_TOL)


def test_gpt2_fan_in_fan_out_matches_peft(tmp_path: Any) -> None:
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=16,
                                  attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip
    torch.manual_seed(4)
    base = transformers.GPT2LMHeadModel(cfg)
    spread(base, 4)
    case = write_peft_case(str(tmp_path), base, 4, r=4, lora_alpha=16, target_modules=["c_attn", "c_proj"],
                           fan_in_fan_out=True)  # fmt: skip
    model = _load_hf(case, lambda: transformers.GPT2LMHeadModel(cfg), allow_missing=["lm_head.weight"])  # tied to wte
    for key, want in case["merged"].items():
        torch.testing.assert_close(model.state_dict()[key], want, **MERGE_TOL, msg=key)
    with torch.no_grad():
        torch.testing.assert_close(model(case["tokens"]).logits.float(), case["logits"], **LOGIT_TOL)


# --- a region is the same region of the eager merge, reading only its rows/cols --------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("transposed", [False, True])
def test_region_equals_full_and_reads_only_its_rows_and_cols(dtype: torch.dtype, transposed: bool) -> None:
    rng = random.Random(7)
    gen = torch.Generator().manual_seed(7)
    out, inp, r = 37, 23, 5
    w_shape = (inp, out) if transposed else (out, inp)
    tensors = {"w": torch.randn(w_shape, generator=gen).to(dtype), "a": torch.randn(r, inp, generator=gen),
               "b": torch.randn(out, r, generator=gen)}  # fmt: skip
    node = MergedLora(Leaf("w", w_shape, dtype), Leaf("a", (r, inp), torch.float32), Leaf("b", (out, r), torch.float32),
                     scale=1.7, transposed=transposed)  # fmt: skip
    whole = node.full(DictIO(tensors))
    delta = tensors["b"].double() @ tensors["a"].double()
    expected = (tensors["w"].double() + 1.7 * (delta.T if transposed else delta)).to(dtype)
    assert torch.equal(whole, expected)
    assert node.read(full_box(w_shape), DictIO(tensors)).equal(whole)
    for _ in range(60):
        box = tuple(sorted(rng.sample(range(n + 1), 2)) for n in w_shape)
        box = tuple((a, b) for a, b in box)
        io = DictIO(tensors)
        got = node.read(box, io)
        assert torch.equal(got, whole[tuple(slice(a, b) for a, b in box)]), box
        rows, cols = box if not transposed else box[::-1]  # (out span, in span)
        reads = {key: bx for key, bx in io.reads}
        assert reads == {"w": box, "b": (rows, (0, r)), "a": ((0, r), cols)}, (box, io.reads)


def test_region_is_computed_in_bounded_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    import sdadapt._recipes.lora as lora_mod

    monkeypatch.setattr(lora_mod, "_ROWS_PER_CHUNK_ELEMENTS", 16)  # 16 elements: a few rows per chunk
    gen = torch.Generator().manual_seed(8)
    tensors = {"w": torch.randn(20, 7, generator=gen), "a": torch.randn(3, 7, generator=gen),
               "b": torch.randn(20, 3, generator=gen)}  # fmt: skip
    node = MergedLora(Leaf("w", (20, 7), torch.float32), Leaf("a", (3, 7), torch.float32),
                     Leaf("b", (20, 3), torch.float32), scale=0.5)  # fmt: skip
    io = DictIO(tensors)
    assert torch.equal(node.read(((1, 19), (2, 6)), io), node.full(DictIO(tensors))[1:19, 2:6])
    b_rows = [bx[0] for key, bx in io.reads if key == "b"]
    assert b_rows == [(1, 5), (5, 9), (9, 13), (13, 17), (17, 19)]  # 4 rows of 4 columns per chunk


# --- strict: unsupported features and mismatched keys fail while planning -----------------------


@pytest.fixture(scope="module")
def llama_case(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("lora_llama"))
    return write_peft_case(root, llama(5), 5, r=4, lora_alpha=8, target_modules=TARGETS)


def _copy_lora(case: dict[str, Any], dst: str, config: dict[str, Any] | None = None,
               edit: Any = None) -> str:  # fmt: skip
    os.makedirs(dst)
    with open(os.path.join(case["lora"], "adapter_config.json")) as f:
        cfg = json.load(f)
    cfg.update(config or {})
    with open(os.path.join(dst, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    tensors = load_file(os.path.join(case["lora"], "adapter_model.safetensors"))
    if edit is not None:
        edit(tensors)
    save_file(tensors, os.path.join(dst, "adapter_model.safetensors"))
    return dst


def _meta_llama_hf() -> torch.nn.Module:
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ({"use_dora": True}, "use_dora=True is not supported: DoRA"),
        ({"bias": "lora_only"}, "bias='lora_only'"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save=['lm_head'] is not supported"),
        ({"lora_bias": True}, "lora_bias=True"),
        ({"peft_type": "IA3"}, "peft_type is 'IA3'"),
        ({"lora_alpha": "eight"}, "field lora_alpha: Input should be a valid number"),
        ({"alpha_pattern": ["v_proj", 3]}, "field alpha_pattern: Input should be a valid dictionary"),
        ({"alpha_pattern": {"(": 2}}, "alpha_pattern key '(' is not a regular expression"),
    ],
)
def test_unsupported_peft_features_are_clear_errors(llama_case: dict, tmp_path: Any, config: dict, says: str) -> None:
    lora = _copy_lora(llama_case, str(tmp_path / "lora"), config)
    model = _meta_llama_hf()
    with pytest.raises(AdapterError, match=r"adapter_config\.json") as e:
        sdadapt.load(model, llama_case["base"], lora=lora)
    assert says in str(e.value)
    assert all(p.is_meta for p in model.parameters())


P = "base_model.model.model.layers.0."


def _rename(old: str, new: str) -> Any:
    return lambda t: t.__setitem__(new, t.pop(old))


@pytest.mark.parametrize(
    ("edit", "key", "says"),
    [
        (_rename(P + "self_attn.q_proj.lora_A.weight", P + "self_attn.qq_proj.lora_A.weight"),
         P + "self_attn.qq_proj.lora_A.weight", "has no lora_B partner"),
        (lambda t: [t.__setitem__(P + f"self_attn.x_proj.lora_{w}.weight", t[P + f"self_attn.q_proj.lora_{w}.weight"].clone())
                    for w in "AB"], P + "self_attn.x_proj.lora_A.weight",
         "targets 'model.layers.0.self_attn.x_proj.weight', which the checkpoint does not have"),
        (lambda t: t.__setitem__(P + "self_attn.q_proj.lora_magnitude_vector", torch.ones(32)),
         P + "self_attn.q_proj.lora_magnitude_vector", "is not a LoRA weight"),
        (lambda t: t.__setitem__(P + "self_attn.q_proj.lora_B.weight", torch.zeros(31, 4)),
         P + "self_attn.q_proj.lora_A.weight", "A must be [r, 32] and B [32, r]; got A [4, 32], B [31, 4]"),
        (lambda t: t.__setitem__("lm_head.lora_A.weight", torch.zeros(4, 32)), "lm_head.lora_A.weight",
         "is not a LoRA weight 'base_model.model.<module>.lora_A.weight'"),
    ],
    ids=["half-pair", "targets-nothing", "dora-magnitude", "shape", "outside-prefix"],
)  # fmt: skip
def test_mismatched_lora_keys_are_plan_errors(llama_case: dict, tmp_path: Any, edit: Any, key: str, says: str) -> None:
    lora = _copy_lora(llama_case, str(tmp_path / "lora"), edit=edit)
    model = _meta_llama_hf()
    with pytest.raises(PlanError) as e:
        sdadapt.load(model, llama_case["base"], lora=lora)
    issues = [i for i in e.value.report.rule_issues if i.key == key]
    assert issues and says in issues[0].message, e.value.report.format()
    assert issues[0].rule.startswith("merge_lora(")
    assert all(p.is_meta for p in model.parameters())


def test_missing_lora_files_are_clear_errors(llama_case: dict, tmp_path: Any) -> None:
    with pytest.raises(AdapterError, match="not a folder"):
        sdadapt.load(_meta_llama_hf(), llama_case["base"], lora=str(tmp_path / "nope"))
    lora = _copy_lora(llama_case, str(tmp_path / "lora"))
    os.remove(os.path.join(lora, "adapter_model.safetensors"))
    torch.save({}, os.path.join(lora, "adapter_model.bin"))
    with pytest.raises(AdapterError, match="no adapter_model.safetensors .*safe_serialization=True"):
        sdadapt.load(_meta_llama_hf(), llama_case["base"], lora=lora)
    os.remove(os.path.join(lora, "adapter_config.json"))
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        sdadapt.load(_meta_llama_hf(), llama_case["base"], lora=lora)


def test_plan_shows_the_merge_and_the_rule_round_trips(llama_case: dict) -> None:
    _, plan = sdadapt.plan_load(_meta_llama_hf(), llama_case["base"], lora=llama_case["lora"])
    recipe = plan.recipes["model.layers.1.self_attn.v_proj.weight"].describe()
    assert recipe == (f"merge_lora(model.layers.1.self_attn.v_proj.weight, {LORA_NAMESPACE}{P[:-2]}1.self_attn.v_proj."
                      f"lora_A.weight, {LORA_NAMESPACE}{P[:-2]}1.self_attn.v_proj.lora_B.weight, scale=2)")  # fmt: skip
    adapter = sdadapt.Adapter([MergeLora(alpha=8, alpha_pattern={"v_proj": 3.0}, rslora=True)], name="x")
    assert sdadapt.Adapter.from_json(adapter.to_json()) == adapter
    assert adapter.inverse().rules == []


def test_joined_source_delegates_and_refuses_ambiguous_keys(llama_case: dict) -> None:
    base = SafetensorsFile(os.path.join(llama_case["base"], "model.safetensors"))
    lora = SafetensorsFile(os.path.join(llama_case["lora"], "adapter_model.safetensors"))
    joined = JoinedSource(base, {"x:": lora})
    key = P + "self_attn.q_proj.lora_B.weight"
    assert joined.schema["x:" + key] == lora.schema[key]
    assert torch.equal(joined.read("x:" + key, ((3, 9), (0, 4))), lora.read(key, ((3, 9), (0, 4))))
    assert joined.locate("x:" + key) == lora.locate(key) and joined.locate("lm_head.weight") == base.locate("lm_head.weight")
    assert joined.files() == [base.path, lora.path] and joined.file_of("x:" + key) == lora.path
    with pytest.raises(SourceError, match="starts with the namespace 'model.'"):
        JoinedSource(base, {"model.": lora})
    joined.close()


def test_per_expert_lora_merges_then_stacks() -> None:
    """LoRA pairs on per-expert weights merge in the checkpoint's key space, then a stack rule
    makes ``[E, out, in]`` of the merged values; regions of the stack read only their experts'
    and rows' parts of each pair."""
    gen = torch.Generator().manual_seed(9)
    E, out, inp, r = 3, 6, 5, 2
    tensors: dict[str, torch.Tensor] = {}
    for e in range(E):
        tensors[f"experts.{e}.w1.weight"] = torch.randn(out, inp, generator=gen)
        tensors[f"{LORA_NAMESPACE}base_model.model.experts.{e}.w1.lora_A.weight"] = torch.randn(r, inp, generator=gen)
        tensors[f"{LORA_NAMESPACE}base_model.model.experts.{e}.w1.lora_B.weight"] = torch.randn(out, r, generator=gen)
    schema = {k: sdadapt.sources.TensorInfo(tuple(v.shape), v.dtype) for k, v in tensors.items()}
    adapter = sdadapt.Adapter([MergeLora(alpha=4), sdadapt.stack("experts.{e}.w1.weight", "w1")])
    plan = build_plan(schema, {"w1": sdadapt.sources.TensorInfo((E, out, inp), torch.float32)}, adapter)
    assert plan.report.ok, plan.report.format()
    node = plan.recipes["w1"]
    expected = torch.stack([
        tensors[f"experts.{e}.w1.weight"]
        + 2.0 * (tensors[f"{LORA_NAMESPACE}base_model.model.experts.{e}.w1.lora_B.weight"].double()
                 @ tensors[f"{LORA_NAMESPACE}base_model.model.experts.{e}.w1.lora_A.weight"].double()).float()
        for e in range(E)
    ])  # fmt: skip
    torch.testing.assert_close(node.full(DictIO(tensors)), expected, rtol=1e-6, atol=1e-6)
    io = DictIO(tensors)
    assert torch.equal(node.read(((1, 3), (2, 5), (0, 4)), io), node.full(DictIO(tensors))[1:3, 2:5, 0:4])
    b_reads = sorted((k, box) for k, box in io.reads if k.endswith("lora_B.weight"))
    assert b_reads == [(f"{LORA_NAMESPACE}base_model.model.experts.{e}.w1.lora_B.weight", ((2, 5), (0, r))) for e in (1, 2)]


def test_a_merge_cast_to_float32_is_rounded_once_into_float32() -> None:
    """bfloat16 base weights, a float32 model: the cast hands the merge (then the stack) float32
    to compute in, so each value is ``w + s * B @ A`` rounded once from float64 to float32, not
    rounded to bfloat16 first."""
    gen = torch.Generator().manual_seed(11)
    E, out, inp, r = 2, 6, 5, 2
    tensors: dict[str, torch.Tensor] = {}
    for e in range(E):
        tensors[f"experts.{e}.w1.weight"] = torch.randn(out, inp, generator=gen).to(torch.bfloat16)
        tensors[f"{LORA_NAMESPACE}base_model.model.experts.{e}.w1.lora_A.weight"] = torch.randn(r, inp, generator=gen)
        tensors[f"{LORA_NAMESPACE}base_model.model.experts.{e}.w1.lora_B.weight"] = torch.randn(out, r, generator=gen)
    schema = {k: sdadapt.sources.TensorInfo(tuple(v.shape), v.dtype) for k, v in tensors.items()}
    adapter = sdadapt.Adapter([MergeLora(alpha=4), sdadapt.stack("experts.{e}.w1.weight", "w1"), sdadapt.cast("w1", "model")])
    plan = build_plan(schema, {"w1": sdadapt.sources.TensorInfo((E, out, inp), torch.float32)}, adapter)
    assert plan.report.ok, plan.report.format()
    node = plan.recipes["w1"]
    assert "cast(" not in node.describe() and "dtype=float32" in node.describe()
    expected = torch.stack([
        (tensors[f"experts.{e}.w1.weight"].double()
         + 2.0 * (tensors[f"{LORA_NAMESPACE}base_model.model.experts.{e}.w1.lora_B.weight"].double()
                  @ tensors[f"{LORA_NAMESPACE}base_model.model.experts.{e}.w1.lora_A.weight"].double())).float()
        for e in range(E)
    ])  # fmt: skip
    assert torch.equal(node.full(DictIO(tensors)), expected)
    assert torch.equal(node.read(((0, 2), (1, 6), (2, 5)), DictIO(tensors)), expected[:, 1:6, 2:5])
    assert not torch.equal(expected, expected.to(torch.bfloat16).float())  # the bf16 detour would differ
