"""What a plain load imports: a rename adapter and a bf16 safetensors file pull in neither the
quantized formats, nor the LoRA merge, the Hub, export, drafting, the command line or
``torch.distributed.checkpoint``; the rule
kinds whose modules are imported on first use still read back from JSON and still clash with a
user's kind of the same name. Asserted on ``sys.modules`` of a fresh process, never on timings."""

from __future__ import annotations

import importlib
import importlib.util
import json
import pkgutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import sdadapt.rules
from sdadapt.rules import _custom

NOT_ON_THE_PLAIN_PATH = [
    # the value, stacking and TP rules (their kinds are imported on first use)
    "sdadapt.rules._values",
    "sdadapt.rules._stacking",
    "sdadapt.rules._tensor_parallel",
    "sdadapt.rules._union",
    "sdadapt._recipes.arithmetic",
    # the quantized formats: rules, constructors, config detection, nodes and kernels
    "sdadapt.rules._dequant",
    "sdadapt.rules._dequant_scaled",
    "sdadapt.rules._quant_functions",
    "sdadapt.rules._quant_detect",
    "sdadapt.rules._quant_config",
    "sdadapt._recipes.quant",
    "sdadapt._recipes.quant_nodes",
    "sdadapt._recipes.quant_scaled",
    "sdadapt._recipes.quant_scaled_nodes",
    "sdadapt._recipes.quant_fused",
    "sdadapt._recipes.quant_kernels",
    "triton",
    # the LoRA merge
    "sdadapt.rules._lora",
    "sdadapt._recipes.lora",
    "sdadapt.sources._joined",
    # the Hub, other formats' and tools' modules
    "sdadapt.sources._hub",
    "sdadapt.sources._gguf_file",
    "sdadapt.sources._gguf_header",
    "sdadapt.sources._dcp_dir",
    "sdadapt.sources._inventory",
    "sdadapt.sources._object_writer",
    # object storage: its client, errors and local mirrors (a process that opened no URL has no mirror)
    "sdadapt.sources._object_store",
    "sdadapt.sources._object_errors",
    "sdadapt.sources._remote",
    "sdadapt.sources._namespaced",
    # the versions and optional features (sdadapt.env(), and a failed load's version check)
    "sdadapt._base.env",
    # the config files' models (a plain load reads no config.json)
    "sdadapt.sources._configs",
    # block checksums (checksums=True, and their writers)
    "sdadapt.sources._integrity",
    # the other key-moving rules (fuse, split, drop, tie, prefixes) and the nodes of fused and split keys
    "sdadapt.rules._key_moves",
    "sdadapt._recipes.moves",
    "sdadapt._recipes.interleave",
    # the torch.save reader (its format is declared in the table, its module imported to open one)
    "sdadapt.sources._torch_save",
    # reads shared between replicas and TP peers (share_reads=True) and the row rounds' block copies
    "sdadapt._engine.share",
    "sdadapt._engine.blockcopy",
    # the head start (EngineConfig.head_bytes, off unless asked for)
    "sdadapt._engine.head",
    # an adapter given by name: the registry of shipped adapters, the resolving of specs, torchtitan's names
    "sdadapt._plan.registry",
    "sdadapt._plan.resolve",
    "sdadapt._plan.titan_names",
    "sdadapt._plan.hf_models",
    "sdadapt._export",
    "sdadapt._state",
    "sdadapt._tools",
    "sdadapt._refit",
    "sdadapt._dry_run",
    "sdadapt._draft",
    "sdadapt.cli",
    "sdadapt.torchtitan",
    # DCP: a load into tensors and DTensors runs the engine without dcp.load (importing any of
    # torch.distributed.checkpoint imports the whole package, and torch.distributed.elastic)
    "sdadapt._engine.reader",
    "sdadapt._engine.safe_planner",
    "torch.distributed.checkpoint",
    "torch.distributed.elastic",
    # third-party packages of optional paths
    "peft",
    "transformers",
    "huggingface_hub",
]

IMPORT_SDADAPT = ["sdadapt", "sdadapt._base", "sdadapt._base.lazy", "sdadapt._base.rule_kinds", "sdadapt._base.version",
                  # the face's imports on first use pause the cycle collector as a load does (one pause per process)
                  "sdadapt._base.gc"]
"""Every module ``import sdadapt`` imports (after torch): its face only, which imports the rest on first use."""

PLAIN_LOAD = IMPORT_SDADAPT + [
    "sdadapt.errors",
    *(f"sdadapt._base.{m}" for m in "agreement distributed keyruns progress regions schema summary".split()),
    # the exit handler that ends process groups DTensor keeps, registered with _base.distributed:
    # every process that runs sdadapt's collectives needs it (tests/reports/teardown-abort-cpu2-2026-12-07.md)
    "sdadapt._base.teardown",
    # what a public call queues for after it returns (a first GPU load's kvikio start): every public call runs the queue
    "sdadapt._base.later",
    "sdadapt._engine",
    *(f"sdadapt._engine.{m}" for m in (
        "config device devread direct engine geometry lanes locate pinned planner prefetch staging syscalls "
        "tasks views workers").split()),
    "sdadapt._load", "sdadapt._load.loading",
    "sdadapt._plan", *(f"sdadapt._plan.{m}" for m in "adapter intent plan report target".split()),
    "sdadapt._recipes", "sdadapt._recipes.nodes",
    "sdadapt._transaction",
    *(f"sdadapt._transaction.{m}" for m in "args checks commit headers materialize options steps tidy transaction".split()),
    "sdadapt.rules",
    *(f"sdadapt.rules._{m}" for m in "base custom functions keys patterns".split()),
    "sdadapt.sources",
    *(f"sdadapt.sources._{m}" for m in (
        "assets base checks formats headers hf_sharded json peft safetensors_file").split()),
]  # fmt: skip
"""Every sdadapt module a plain load (a rename, a safetensors file, a CPU model) imports. Pinned
both ways: a module that joins the path must be justified here, and one that leaves it is
struck off, so that the list only shrinks (what each module costs: ``bench/probes/import_probe.py``)."""

PLAIN_LOAD_THIRD_PARTY = ["annotated_types", "pydantic", "pydantic_core", "typing_inspection"]
"""The packages besides torch and the standard library that a plain load imports: pydantic's
(the rules and the reports are pydantic models: ``LoadReport`` is one, so every load imports it)."""

CHILD = textwrap.dedent(
    """
    import json, sys
    import torch, torch.distributed, torch.distributed.fsdp, torch.distributed.tensor.parallel
    from torch import nn

    before = set(sys.modules)  # what a training job has imported
    import sdadapt
    face = sorted(set(sys.modules) - before)

    model = nn.Sequential(nn.Linear(4, 3))
    report = sdadapt.load(model, sys.argv[1], sdadapt.Adapter([sdadapt.rename("layer.{p}", "0.{p}")]))
    loaded = sorted(sys.modules)
    added = sorted(set(sys.modules) - before)
    # the load's reports were made without validating them (no validator built); they still dump and validate back
    unbuilt = [type(r).__name__ for r in (report, report.report) if not type(r).__pydantic_complete__]
    again = type(report).model_validate_json(report.model_dump_json())
    round_trip = again == report and again.report == report.report and again.report.ok and str(again) == str(report)

    class Clash(sdadapt.rules.RuleBase):  # a user's kind taken by a built-in whose module is not imported yet
        kind: str = "dequant_scaled"
    try:
        sdadapt.rules.register_rule(Clash)
        clash = None
    except sdadapt.errors.AdapterError as e:
        clash = str(e)

    @sdadapt.rules.register_rule
    class Mine(sdadapt.rules.ValueRule):
        kind: str = "mine"
    text = json.dumps({"rules": [{"kind": "dequant_fp8", "block": [128, 128]}, {"kind": "merge_lora", "alpha": 2.0}]})
    read_back = [type(r).__name__ for r in sdadapt.Adapter.from_json(text).rules]
    kinds = list(sdadapt.rules.registered_rules())
    print(json.dumps({"keys": report.keys_loaded, "weight": model[0].weight.tolist(), "modules": loaded,
                      "face": face, "added": added,
                      "clash": clash, "read_back": read_back, "kinds": kinds, "unbuilt": unbuilt, "round_trip": round_trip}))
    """
)


@pytest.fixture(scope="module")
def plain_load(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One fresh process's plain load, for every test of what it imported."""
    return _run_plain_load(tmp_path_factory.mktemp("plain"))


def _run_plain_load(tmp_path: Path) -> dict:
    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    save_file({"layer.weight": weight, "layer.bias": torch.zeros(3)}, str(tmp_path / "model.safetensors"))
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "model.safetensors")], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["keys"] == 2 and result["weight"] == weight.tolist()
    return result


def test_plain_load_imports_no_optional_module_and_lazy_kinds_still_work(plain_load):
    for name in NOT_ON_THE_PLAIN_PATH:  # a renamed module must be renamed here too, not silently pass
        assert importlib.util.find_spec(name) is not None, f"{name} does not exist; update NOT_ON_THE_PLAIN_PATH"
    result = plain_load
    loaded = set(result["modules"])
    pulled = [n for n in NOT_ON_THE_PLAIN_PATH if n in loaded or any(m.startswith(n + ".") for m in loaded)]
    assert pulled == [], f"a plain rename + bf16 safetensors load imported {pulled}"
    # the kinds registered on first use: found when read back, and when a user's kind clashes
    assert result["read_back"] == ["DequantFP8", "MergeLora"]
    assert result["clash"] is not None and "sdadapt.rules._dequant_scaled.DequantScaled" in result["clash"], result["clash"]
    kinds = result["kinds"]
    assert set(_custom._IMPORTED_ON_USE) <= set(kinds)
    assert kinds[-1] == "mine", kinds  # built-in kinds first, though "mine" was registered before some of them


def test_import_sdadapt_and_a_plain_load_import_the_pinned_modules_only(plain_load):
    """The import footprint, as module names (never timings): ``import sdadapt`` imports its face
    alone (no pydantic, no engine), and a plain load exactly :data:`PLAIN_LOAD` of sdadapt and
    :data:`PLAIN_LOAD_THIRD_PARTY` beside torch and the standard library."""
    result = plain_load
    assert result["face"] == sorted(IMPORT_SDADAPT), "import sdadapt imports more than its face: import the rest where used"
    ours = {m for m in result["added"] if m.split(".")[0] == "sdadapt"}
    grew, shrank = sorted(ours - set(PLAIN_LOAD)), sorted(set(PLAIN_LOAD) - ours)
    assert not grew, f"a plain load now imports {grew}: import it where it is used (or justify it in PLAIN_LOAD)"
    assert not shrank, f"a plain load no longer imports {shrank}: strike it off PLAIN_LOAD"
    std = set(sys.stdlib_module_names)
    others = sorted({m.split(".")[0] for m in result["added"]} - std - {"torch", "sdadapt"})
    assert [m for m in others if not m.startswith("_")] == PLAIN_LOAD_THIRD_PARTY, others


def test_kinds_imported_on_use_are_the_built_in_kinds_outside_the_rules_package_face():
    """Every built-in rule kind is registered by ``sdadapt.rules`` itself or named, with the module
    that registers it, in ``_IMPORTED_ON_USE`` (else an adapter's JSON holding it would not read back)."""
    for info in pkgutil.iter_modules(sdadapt.rules.__path__, "sdadapt.rules."):
        importlib.import_module(info.name)
    built_in = {k: c for k, c in sdadapt.rules.registered_rules().items() if c.__module__.startswith("sdadapt.rules.")}
    eager = {cls.model_fields["kind"].default for cls in sdadapt.rules.BUILTIN_RULES}
    assert set(built_in) == eager | set(_custom._IMPORTED_ON_USE)
    for kind, module in _custom._IMPORTED_ON_USE.items():
        assert built_in[kind].__module__ == module, kind


def test_compressed_tensors_and_modelopt_releases_do_not_import_the_fp8_block_and_mxfp4_rules():
    """The rules of the formats other tools write (``DequantScaled``) come without the module of the
    FP8 block and MXFP4 rules; a block-scaled FP8 release still gets its ``DequantFP8``."""
    child = textwrap.dedent(
        """
        import json, sys
        import sdadapt

        weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}
        ct = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
              "config_groups": {"g": {"targets": ["Linear"], "weights": weights}}}
        modelopt = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}
        kinds = [type(r).__name__ for qc in (ct, modelopt) for r in sdadapt.dequant_rules({"quantization_config": qc})]
        before = "sdadapt.rules._dequant" in sys.modules
        fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}
        kinds += [type(r).__name__ for r in sdadapt.dequant_rules({"quantization_config": fp8})]
        print(json.dumps({"kinds": kinds, "before": before}))
        """
    )
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"kinds": ["DequantScaled", "DequantScaled", "DequantFP8"], "before": False}, result


def test_the_rule_union_holds_every_plain_kind_though_their_modules_load_on_use():
    """``sdadapt.rules.Rule`` (built when first used) reads every built-in kind of plain adapters,
    the ones whose modules are imported on first use included."""
    from pydantic import TypeAdapter

    import sdadapt

    rules = [sdadapt.rename("a", "b"), sdadapt.cast("w", "bfloat16"), sdadapt.stack("e.{e}.w", "w"),
             sdadapt.interleave("qkv", [4, 2, 2], tp=2), sdadapt.rotary("wq", heads=2)]  # fmt: skip
    union = TypeAdapter(sdadapt.rules.Rule)
    for rule in rules:
        assert union.validate_python(rule.model_dump()) == rule


def test_a_load_validates_no_report_of_its_own_and_its_report_still_dumps(plain_load):
    """``Report`` and ``LoadReport`` are made with ``model_construct`` from the load's own values:
    their validators are not built by a load (the first built in a process pays pydantic's plugin
    scan), and the report still dumps to JSON and validates back equal."""
    assert plain_load["unbuilt"] == ["LoadReport", "Report"]
    assert plain_load["round_trip"] is True
