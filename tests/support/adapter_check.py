"""Checks a shipped adapter against the model code that wrote its checkpoints, on real process groups.

A family's test module writes its cases once (checkpoints plus the original model's outputs) in a
module-scoped folder, then calls :func:`check_on_meshes` with its own model builder::

    cases_root = cases_fixture("adapters_qwen", write_cases)  # write_cases(folder) -> list of cases

    def test_loads(cases_root):
        check_on_meshes(cases_root, build_target)

That launches 4 gloo ranks (:mod:`dist_helper`). Each rank loads every case with ``sdadapt.load``
into ``build(case, mesh)`` (the counterpart model on the meta device, parallelised) on a 2x2
FSDP2+TP mesh, then on a 3-rank FSDP mesh of ranks 0-2 (uneven shards; rank 3 waits): one launch
for both, process start being the cost. Per case and rank it records whether every target key
loaded, the output's distance to ``case["expected"]`` and the export check: the loaded model's
state dict (sharded schema, gathered values) back through ``adapter.inverse()`` must give the
checkpoint's tensors byte for byte. :func:`check_results` then asserts all of it on every rank.

A case is a dict: ``name``, ``path`` (a checkpoint folder, ``.safetensors`` or ``torch.save``
file), ``adapter`` (a registered name) with optional ``options``, ``tokens`` (the model input),
``expected`` (the original model's output, float32); optional ``export_unexpected`` and
``export_missing`` (patterns the export may leave out or add) and ``export_skip`` (key prefixes of
the checkpoint the adapter drops, left out of the export check). Families whose adapter or call
differ pass ``adapter`` or ``forward`` hooks: module-level functions, as they travel to the ranks.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import sdadapt
from sdadapt._plan.plan import build_plan
from support.dist_helper import run_distributed

MESHES = (("fsdp2+tp-2x2", range(4)), ("fsdp-3-uneven", range(3)))
"""The meshes every case loads on, with the ranks that take part."""
TOL: dict[str, Any] = dict(rtol=1e-5, atol=2e-5)
"""How close the loaded model's output must be to the original model's (fp32)."""

Build = Callable[[dict, Any], torch.nn.Module]
AdapterOf = Callable[[dict], sdadapt.Adapter]
Forward = Callable[[torch.nn.Module, dict], torch.Tensor]


# ----------------------------------------------------------------------------------------------
# cases and checkpoints
# ----------------------------------------------------------------------------------------------
def save_cases(root: str, cases: list[dict]) -> str:
    """Store ``cases`` as ``root/cases.pt``, where the ranks read them; returns ``root``."""
    torch.save(cases, os.path.join(root, "cases.pt"))
    return root


def cases_fixture(prefix: str, write: Callable[[str], list[dict]]) -> Any:
    """A module-scoped ``cases_root`` fixture: a fresh folder named after ``prefix`` holding the
    checkpoints ``write(folder)`` writes and, in ``cases.pt``, the cases it returns."""

    @pytest.fixture(scope="module")
    def cases_root(tmp_path_factory: pytest.TempPathFactory) -> str:
        root = str(tmp_path_factory.mktemp(prefix))
        return save_cases(root, write(root))

    return cases_root


def load_cases(root: str) -> list[dict]:
    return torch.load(os.path.join(root, "cases.pt"), weights_only=False)


def case_named(root: str, name: str) -> dict:
    return next(c for c in load_cases(root) if c["name"] == name)


def checkpoint_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint: a folder's shards as its ``model.safetensors.index.json``
    names them, or its one ``model.safetensors``; a ``.safetensors`` file; a ``torch.save`` file."""
    if not os.path.isdir(path):
        return load_file(path) if path.endswith(".safetensors") else torch.load(path, weights_only=True)
    index = os.path.join(path, "model.safetensors.index.json")
    if not os.path.exists(index):
        return load_file(os.path.join(path, "model.safetensors"))
    with open(index) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    return {k: v for name in files for k, v in load_file(os.path.join(path, name)).items()}


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (bit-exact, NaNs and float8 included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def plan_error(model: torch.nn.Module, path: str, adapter: sdadapt.Adapter) -> str:
    """The :class:`sdadapt.errors.PlanError` that loading ``path`` into the meta ``model`` raises; the
    model must still be on the meta device (nothing read)."""
    with pytest.raises(sdadapt.errors.PlanError) as info:
        sdadapt.load(model, path, adapter)
    assert all(p.is_meta for p in model.parameters()), "the model was changed although planning failed"
    return str(info.value)


# ----------------------------------------------------------------------------------------------
# on the ranks: load, compare outputs, export
# ----------------------------------------------------------------------------------------------
def registered_adapter(case: dict) -> sdadapt.Adapter:
    """The default ``adapter`` hook: ``case["adapter"]`` with options from the checkpoint and ``case["options"]``."""
    return sdadapt.get_adapter(case["adapter"], source=case["path"], **case.get("options", {}))


def forward_tokens(model: torch.nn.Module, case: dict) -> torch.Tensor:
    """The default ``forward`` hook: the model called on ``case["tokens"]``."""
    return model(case["tokens"])


def _export_check(model: torch.nn.Module, case: dict, adapter: sdadapt.Adapter) -> dict[str, Any]:
    """The loaded state dict through ``adapter.inverse()`` against the checkpoint's tensors."""
    from torch.distributed.tensor import DTensor

    from sdadapt._plan.target import model_state_dict, schema_of
    from support.checkpoints import DictIO

    sd = model_state_dict(model)
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu() for k, v in sd.items()}
    skip = tuple(case.get("export_skip", ()))
    original = {k: v for k, v in checkpoint_tensors(case["path"]).items() if not k.startswith(skip)}
    plan = build_plan(
        schema_of(sd),
        {k: sdadapt.sources.TensorInfo(tuple(v.shape), v.dtype) for k, v in original.items()},
        adapter.inverse(),
        allow_unexpected=case.get("export_unexpected", []),
        allow_missing=case.get("export_missing", []),
    )
    io = DictIO(full)
    exported = {k: node.full(io) for k, node in plan.recipes.items()}
    differ = {k: v for k, v in exported.items() if not same_bytes(v, original[k])}
    allowed_missing = set(plan.report.allowed_missing)
    # differing tensors go back as bytes: float8 tensors do not survive the pickle to the parent
    return dict(
        target_keys=len(sd), export_ok=plan.report.ok, export_report=plan.report.format(), exported=sorted(plan.recipes),
        original=sorted(k for k in original if k not in allowed_missing), differ=sorted(differ),
        differ_bytes={k: v.contiguous().view(torch.uint8) for k, v in differ.items()},
    )  # fmt: skip


def _run_cases(root: str, mesh: Any, group: Any, build: Build, adapter_of: AdapterOf, forward: Forward) -> dict[str, dict]:
    """Every case of ``root`` on ``mesh``: keys loaded, output error, export check."""
    from torch.distributed.tensor import DTensor

    results: dict[str, dict] = {}
    for case in load_cases(root):
        model = build(case, mesh)
        adapter = adapter_of(case)
        rep = sdadapt.load(model, case["path"], adapter, process_group=group)
        with torch.no_grad():
            out = forward(model, case)
        out = (out.full_tensor() if isinstance(out, DTensor) else out).float()
        results[case["name"]] = dict(
            keys=rep.keys_loaded, err=(out - case["expected"]).abs().max().item(),
            close=torch.allclose(out, case["expected"], **TOL), **_export_check(model, case, adapter),
        )  # fmt: skip
        del model
    return results


def load_on_meshes(
    root: str, build: Build, adapter_of: AdapterOf = registered_adapter, forward: Forward = forward_tokens
) -> dict[str, dict[str, dict]]:
    """Worker on 4 ranks: every case on the 2x2 (fsdp, tp) mesh, then on the 3-rank FSDP mesh of
    ranks 0-2 (uneven shards; rank 3 waits). Returns ``{mesh name: {case name: result}}``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    assert dist.get_world_size() == 4, "the cases run on one 4-rank launch"
    mesh2x2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
    out = {MESHES[0][0]: _run_cases(root, mesh2x2, None, build, adapter_of, forward)}
    mesh3 = DeviceMesh("cpu", torch.arange(3), mesh_dim_names=("fsdp",))  # every rank takes part in creating it
    if dist.get_rank() < 3:
        out[MESHES[1][0]] = _run_cases(root, mesh3, mesh3.get_group(), build, adapter_of, forward)
    dist.barrier()
    return out


# ----------------------------------------------------------------------------------------------
# in the parent: launch and assert
# ----------------------------------------------------------------------------------------------
def check_results(results: list[dict], names: list[str], may_differ: dict[str, list[str]] | None = None) -> None:
    """Every case on every rank of both meshes: all keys, outputs, byte-exact export (but for the
    keys ``may_differ[name]`` lists, which must differ; the caller checks their values)."""
    for mesh, ranks in MESHES:
        for name in names:
            for rank in ranks:
                r = results[rank][mesh][name]
                where = f"{name} on {mesh}, rank {rank}"
                assert r["keys"] == r["target_keys"], (where, r)
                assert r["close"], f"{where}: outputs differ from the original model's by {r['err']:.3g}"
                assert r["export_ok"], f"{where}: export report\n{r['export_report']}"
                assert r["exported"] == r["original"], (where, r["exported"], r["original"])
                expected = sorted((may_differ or {}).get(name, []))
                assert r["differ"] == expected, f"{where}: exported tensors differ from the checkpoint: {r['differ']}"
    assert MESHES[1][0] not in results[3]


def check_on_meshes(root: str, build: Build, adapter_of: AdapterOf = registered_adapter, forward: Forward = forward_tokens) -> list[dict]:
    """Launch :func:`load_on_meshes` on 4 gloo ranks and :func:`check_results` every case of
    ``root`` (none may differ); returns the per-rank results."""
    results = run_distributed(load_on_meshes, 4, root, build, adapter_of, forward, timeout=300)
    check_results(results, [c["name"] for c in load_cases(root)])
    return results
