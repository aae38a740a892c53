"""What a plain load imports: a rename adapter and a bf16 safetensors file pull in neither the
quantized formats, nor the LoRA merge, the Hub, export, drafting or the command line; the rule
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

import torch
from safetensors.torch import save_file

import sdadapt.rules
from sdadapt.rules import _custom

NOT_ON_THE_PLAIN_PATH = [
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
    "sdadapt.sources._dcp_dir",
    "sdadapt.sources._inventory",
    "sdadapt._plan.hf_models",
    "sdadapt._export",
    "sdadapt._state",
    "sdadapt._tools",
    "sdadapt._refit",
    "sdadapt._dry_run",
    "sdadapt._draft",
    "sdadapt.cli",
    "sdadapt.torchtitan",
    # third-party packages of optional paths
    "peft",
    "transformers",
    "huggingface_hub",
]

CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    from torch import nn
    import sdadapt

    model = nn.Sequential(nn.Linear(4, 3))
    report = sdadapt.load(model, sys.argv[1], sdadapt.Adapter([sdadapt.rename("layer.{p}", "0.{p}")]))
    loaded = sorted(sys.modules)

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
                      "clash": clash, "read_back": read_back, "kinds": kinds}))
    """
)


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


def test_plain_load_imports_no_optional_module_and_lazy_kinds_still_work(tmp_path):
    for name in NOT_ON_THE_PLAIN_PATH:  # a renamed module must be renamed here too, not silently pass
        assert importlib.util.find_spec(name) is not None, f"{name} does not exist; update NOT_ON_THE_PLAIN_PATH"
    result = _run_plain_load(tmp_path)
    loaded = set(result["modules"])
    pulled = [n for n in NOT_ON_THE_PLAIN_PATH if n in loaded or any(m.startswith(n + ".") for m in loaded)]
    assert pulled == [], f"a plain rename + bf16 safetensors load imported {pulled}"
    # the kinds registered on first use: found when read back, and when a user's kind clashes
    assert result["read_back"] == ["DequantFP8", "MergeLora"]
    assert result["clash"] is not None and "sdadapt.rules._dequant_scaled.DequantScaled" in result["clash"], result["clash"]
    kinds = result["kinds"]
    assert set(_custom._IMPORTED_ON_USE) <= set(kinds)
    assert kinds[-1] == "mine", kinds  # built-in kinds first, though "mine" was registered before some of them


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
