"""torchtitan's parameter names, as an adapter placed after a shipped one.

The shipped adapters produce our documented layout (torchtitan's older names: ``attention.wq``,
``output``, ``moe.experts.w1`` ...). torchtitan 0.3 renamed several of them
(``attention.qkv_linear.wq``, ``lm_head``, ``moe.routed_experts.inner_experts.w1_EFD``,
``moe.expert_bias_E``) and keeps GPT-OSS's gate and up rows interleaved in one tensor
(``mlp1_weight_EGD``). :func:`native_names` looks at the model's own keys (and, when given, at the
keys the adapter yields) and returns the rules that take each of our names to the model's,
only where the model holds the new name and not ours: a model with our documented layout (an
older torchtitan, a model of one's own) gets no rule at all. Every rule inverts, so the same
adapter exports back.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from typing import Any

from ..rules import KeyPattern, PlanContext, Rename, Tie, fuse, interleave, rename, tie
from .adapter import Adapter

__all__ = [
    "RENAMES", "TRAINING_STATE", "for_export", "for_load", "native_names", "retarget_ties", "training_state", "unexported_state",
]

log = logging.getLogger(__name__)

_EXPERTS = "layers.{i}.moe.routed_experts.inner_experts."

RENAMES: tuple[tuple[str, str], ...] = (
    ("layers.{i}.attention.wq.{p}", "layers.{i}.attention.qkv_linear.wq.{p}"),
    ("layers.{i}.attention.wk.{p}", "layers.{i}.attention.qkv_linear.wk.{p}"),
    ("layers.{i}.attention.wv.{p}", "layers.{i}.attention.qkv_linear.wv.{p}"),
    ("output.weight", "lm_head.weight"),
    ("layers.{i}.moe.experts.w1", _EXPERTS + "w1_EFD"),
    ("layers.{i}.moe.experts.w2", _EXPERTS + "w2_EDF"),
    ("layers.{i}.moe.experts.w3", _EXPERTS + "w3_EFD"),
    ("layers.{i}.moe.expert_bias", "layers.{i}.moe.expert_bias_E"),
    ("layers.{i}.moe.experts.w2", _EXPERTS + "mlp2_weight_EDF"),
    ("layers.{i}.moe.experts.b2", _EXPERTS + "mlp2_bias_ED"),
)
"""(our name, torchtitan 0.3's name) pairs that differ only by name."""

INTERLEAVED: tuple[tuple[str, str, str], ...] = (
    ("layers.{i}.moe.experts.w1", "layers.{i}.moe.experts.w3", _EXPERTS + "mlp1_weight_EGD"),
    ("layers.{i}.moe.experts.b1", "layers.{i}.moe.experts.b3", _EXPERTS + "mlp1_bias_EG"),
)
"""(gate, up, torchtitan's name): GPT-OSS's gate and up rows alternate along dim 1 of one tensor."""

TRAINING_STATE: tuple[str, ...] = ("layers.{i}.moe.expert_bias_E",)
"""Model keys that torchtitan keeps as training state (load-balancing bias, zero at the start)
and HF checkpoints of most families lack: allowed missing when nothing produces them."""


def _shape(info: Any) -> tuple[int, ...]:
    return tuple(info.shape)


def _count(pattern: KeyPattern, model: Mapping[str, Any]) -> int:
    return sum(1 for k in model if pattern.match(k))


def native_names(model: Mapping[str, Any], produced: Collection[str] | None = None) -> Adapter | None:
    """The rules from our documented layout to the names ``model`` uses, or ``None`` when it
    uses ours.

    Args:
        model: the model's state-dict keys, each with something that has a ``shape`` (tensors, or
            sdadapt's ``TensorInfo``).
        produced: the keys the adapter before these rules yields; given, a rule is made only for
            names it yields (so no rule goes unused). ``None``: decided from the model's keys.

    Returns:
        An :class:`~sdadapt.Adapter` named ``"torchtitan names"`` (renames, and for GPT-OSS experts
        a fuse + interleave), or ``None``.

    Example:
        >>> import torch
        >>> sd = {"lm_head.weight": torch.empty(8, 4), "tok_embeddings.weight": torch.empty(8, 4)}
        >>> [(r.src, r.dst) for r in native_names(sd).rules]
        [('output.weight', 'lm_head.weight')]
    """
    rules: list[Any] = []
    for ours_text, theirs_text in RENAMES:
        ours, theirs = KeyPattern(ours_text), KeyPattern(theirs_text)
        pairs: list[tuple[str, str]] = []
        for key in model:
            caps = theirs.match(key)
            if caps is None:
                continue
            mine = ours.format(caps)
            if mine in model or (produced is not None and mine not in produced):
                continue
            pairs.append((mine, key))
        if pairs and len(pairs) == _count(theirs, model):
            rules.append(rename(ours_text, theirs_text))  # every such key: one rule on the pattern
        else:
            rules += [rename(mine, key) for mine, key in pairs]
    for gate_text, up_text, theirs_text in INTERLEAVED:
        gate, up, theirs = KeyPattern(gate_text), KeyPattern(up_text), KeyPattern(theirs_text)
        by_size: dict[int, list[tuple[str, str, str]]] = {}
        for key, info in model.items():
            caps = theirs.match(key)
            shape = _shape(info)
            if caps is None or len(shape) < 2 or shape[1] % 2:
                continue
            g, u = gate.format(caps), up.format(caps)
            if g in model or u in model or (produced is not None and not (g in produced and u in produced)):
                continue
            by_size.setdefault(shape[1] // 2, []).append((g, u, key))
        whole = len(by_size) == 1 and len(next(iter(by_size.values()))) == _count(theirs, model)
        for f, triples in sorted(by_size.items()):
            if whole:
                triples = [(gate_text, up_text, theirs_text)]
            for g, u, t in triples:
                rules += [fuse([g, u], t, dim=1), interleave(t, sizes=[f, f], tp=f, dim=1)]
    if not rules:
        return None
    return Adapter(rules, name="torchtitan names", description="our documented layout -> the names torchtitan's model uses")


def training_state(model: Mapping[str, Any], produced: Collection[str]) -> list[str]:
    """Keys of ``model`` that are torchtitan's training state (:data:`TRAINING_STATE`) and that
    nothing in ``produced`` fills: the loads allow them missing, as torchtitan's own adapters do."""
    patterns = [KeyPattern(p) for p in TRAINING_STATE]
    return sorted(k for k in model if k not in produced and any(p.match(k) for p in patterns))


def unexported_state(model: Collection[str], adapter: Adapter) -> list[str]:
    """Keys of ``model`` that are torchtitan's training state and that ``adapter`` (the one that
    loads the model, our names) does not make from the checkpoint: an export leaves them out, as
    torchtitan's own adapters do (the checkpoint format has no place for them)."""
    patterns = [KeyPattern(p) for p in TRAINING_STATE]
    back = [(KeyPattern(t), KeyPattern(o)) for o, t in RENAMES]
    outputs = [KeyPattern(p) for r in adapter.inverse().rules if r.moves_keys for p in r.input_patterns()]
    out = []
    for key in model:
        if not any(p.match(key) for p in patterns):
            continue
        ours = next((o.format(c) for t, o in back if (c := t.match(key)) is not None), key)
        if not any(p.match(ours) for p in outputs):
            out.append(key)
    return sorted(out)


def _their_name(ours: str) -> list[str]:
    """The names :data:`RENAMES` gives the literal key ``ours``."""
    out = []
    for o, t in RENAMES:
        caps = KeyPattern(o).match(ours)
        if caps is not None:
            out.append(KeyPattern(t).format(caps))
    return out


def retarget_ties(adapter: Adapter, model: Collection[str]) -> Adapter:
    """``adapter`` with each tie (``output.weight`` filled from the embeddings) aimed at the name
    ``model`` holds instead (``lm_head.weight``): a tie fills only a key the model has."""
    rules: list[Any] = []
    changed = False
    for r in adapter.rules:
        if isinstance(r, Tie) and r.dst not in model:
            theirs = [t for t in _their_name(r.dst) if t in model]
            if theirs:
                rules.append(tie(theirs[0], r.src))
                changed = True
                continue
        rules.append(r)
    return Adapter(rules, name=adapter.name, description=adapter.description) if changed else adapter


def for_export(adapter: Adapter, state: dict[str, Any]) -> tuple[Adapter, dict[str, Any]]:
    """``adapter`` (our documented layout) followed by the renames to the names in ``state`` (a
    model's state dict: torchtitan's current names), and ``state`` without what the checkpoint
    has no place for: torchtitan's training state (:func:`unexported_state`) and the output a tie
    fills (a tied checkpoint holds no ``lm_head.weight``; torchtitan's own adapters skip it too)."""
    tied = {k for r in adapter.rules if isinstance(r, Tie) for k in (r.dst, *_their_name(r.dst))}
    left = set(unexported_state(state, adapter)) | (tied & set(state))
    if left:
        log.info("not exported: %d keys the checkpoint has no place for (%s)", len(left), ", ".join(sorted(left)[:4]))
        state = {k: v for k, v in state.items() if k not in left}
    names = native_names(state)
    if names is not None:  # a name the adapter yields itself (an adapter onto HF names: lm_head) needs no rename
        yields = [KeyPattern(p) for r in adapter.inverse().rules if r.moves_keys for p in r.input_patterns()]
        kept = [r for r in names.rules if not (isinstance(r, Rename) and any(p.match(r.dst) is not None for p in yields))]
        names = Adapter(kept, name=names.name, description=names.description) if kept else None
    return (adapter if names is None else adapter + names), state


def _outputs(schema: Mapping[str, Any], non_tensor: list[str], adapter: Adapter) -> set[str] | None:
    """The keys ``adapter`` yields from ``schema`` with no target, or ``None`` when it does not
    apply cleanly (the plan then reports why, against the model's keys)."""
    ctx = PlanContext(dict(schema), list(non_tensor), None, adapter.rules, adapter.stage_of)
    for i, rule in enumerate(adapter.rules):
        rule.apply(ctx, i)
    return None if ctx.issues else set(ctx.env)


def for_plan(
    adapter: Adapter | None, shipped: bool, source: Mapping[str, Any], non_tensor: list[str], model: Mapping[str, Any]
) -> tuple[Adapter | None, list[str]]:
    """What ``load``, ``plan_load`` and ``diff`` plan with: a ``shipped`` adapter aimed at the
    model's names (:func:`for_load`); returns ``(adapter, the model keys of its training state
    that nothing fills)``, to allow missing."""
    if shipped and adapter is not None:
        return for_load(adapter, source, non_tensor, model)
    return adapter, []


def for_load(
    adapter: Adapter, source: Mapping[str, Any], non_tensor: list[str], model: Mapping[str, Any]
) -> tuple[Adapter, list[str]]:
    """``adapter`` (our documented layout) aimed at the names ``model`` holds: ties retargeted
    (:func:`retarget_ties`), renames for the keys it yields from ``source`` (:func:`native_names`);
    and the model keys that are torchtitan's training state nothing fills (allowed missing).
    A model with our layout gets ``adapter`` as it is."""
    adapter = retarget_ties(adapter, model)
    produced = _outputs(source, non_tensor, adapter)
    if produced is None:
        return adapter, []
    names = native_names(model, produced)
    if names is not None:
        log.info("%d rules to the model's names after adapter %r", len(names.rules), adapter.name)
        adapter = adapter + names
        produced = _outputs(source, non_tensor, adapter) or produced
    return adapter, training_state(model, produced)
