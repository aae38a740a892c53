"""LoRA merge on load: an HF PEFT adapter folded into the base weights, per region.

``sdadapt.load(model, base, adapter, lora="path/to/peft_adapter")`` reads a PEFT folder
(``adapter_config.json`` + ``adapter_model.safetensors``) and:

1. joins its tensors to the base checkpoint as a second source, under the namespace
   :data:`LORA_NAMESPACE` (:class:`~sdadapt.sources._joined.JoinedSource`): the pair of
   ``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and ``lora_B.weight`` ``[out, r]``
   becomes two more keys of the plan, read lazily like any other;
2. puts a :class:`MergeLora` rule before the adapter's own rules. It acts in the checkpoint's
   key space: ``<module>.weight`` becomes a :class:`MergedLora` node over the weight and the pair,
   so the base adapter's rules (fuse q/k/v, interleave for TP, stack experts, rotary order...)
   then move the merged values as they would move the stored ones.

The merged value is ``W + s * B @ A`` with ``s = alpha / r`` (``alpha / sqrt(r)`` for rsLoRA),
computed per region by the node :class:`~sdadapt._recipes.lora.MergedLora`; the folder is read by
:mod:`sdadapt.sources._peft`.

Strict, like the rest of a load: a LoRA pair whose weight the checkpoint lacks, half a pair,
shapes that do not agree, or a tensor that is not a ``lora_A``/``lora_B`` weight are plan
problems naming the key; PEFT features that are not a plain low-rank sum (DoRA, LoRA biases,
``modules_to_save``, trainable tokens, ...) are refused while the config is read. A merge has
no inverse: exporting a model loaded this way writes the merged weights.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch

from .._base.schema import dtype_name
from .._recipes.lora import MergedLora
from .._recipes.nodes import Node
from ..errors import AdapterError, SourceError
from ..sources import CONFIG_NAME, JoinedSource, LoraMerged, PeftConfig, Source, open_peft_weights, read_peft_config, validate
from ._base import RuleBase
from ._custom import register_rule

if TYPE_CHECKING:
    from ._base import PlanContext

LORA_NAMESPACE = "lora:"
"""The prefix a PEFT adapter's tensor keys get in the joined source (no checkpoint key has it)."""
PEFT_PREFIX = "base_model.model."
"""What PEFT puts before a module name of the base model in ``adapter_model.safetensors``."""
_PAIR = re.compile(r"(?P<module>.+)\.lora_(?P<which>[AB])\.weight")
_MERGEABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_NOT_PLAIN = "this LoRA variant is not a plain W + s * B @ A; merge with peft's merge_and_unload()"
# config fields whose non-default values change what a merge means (refused rather than merged
# wrongly); each with what to do instead
_UNSUPPORTED: dict[str, str] = {
    "use_dora": "DoRA rescales each merged column by a magnitude vector; merge it with peft's merge_and_unload()",
    "lora_bias": "LoRA biases add to the layers' biases; merge with peft's merge_and_unload()",
    "modules_to_save": "the adapter replaces whole modules; merge with peft's merge_and_unload() and load that",
    "trainable_token_indices": "trainable tokens replace embedding rows; merge with peft's merge_and_unload()",
    "layer_replication": "the adapter duplicates layers; merge with peft's merge_and_unload()",
    "target_parameters": "LoRA on nn.Parameter targets is not supported; merge with peft's merge_and_unload()",
    "use_qalora": "QA-LoRA pools inputs before A; merge with peft's merge_and_unload()",
    "megatron_config": "Megatron-parallel LoRA layers are not supported",
    "alora_invocation_tokens": "activated LoRA applies only after its invocation tokens; it cannot be merged",
    "arrow_config": "Arrow routes between several LoRAs per token; it cannot be merged into one weight",
    "use_bdlora": _NOT_PLAIN,
    "kasa_config": _NOT_PLAIN,
    "velora_config": _NOT_PLAIN,
    "monteclora_config": _NOT_PLAIN,
}


# --- the rule ------------------------------------------------------------------------------------


def lora_scale(alpha: float, r: int, rslora: bool) -> float:
    """PEFT's scaling of ``B @ A``: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA."""
    return alpha / math.sqrt(r) if rslora else alpha / r


def pattern_key(patterns: Mapping[str, Any], module: str) -> str | None:
    """The first key of ``patterns`` (PEFT's ``rank_pattern`` / ``alpha_pattern``) that matches
    ``module``'s name or a dotted suffix of it, as PEFT matches them; ``None`` if none does."""
    for pat in patterns:
        if re.match(rf"(.*\.)?({pat})$", module):
            return pat
    return None


@register_rule
class MergeLora(RuleBase):
    """Merge the LoRA pairs found under ``namespace`` + ``module_prefix`` into the weights they
    target: ``<module>.weight`` becomes ``W + s * B @ A``. ``alpha`` (``lora_alpha``),
    ``alpha_pattern``, ``rslora`` and ``fan_in_fan_out`` are the PEFT config's; each pair's
    rank is the rows of its ``A``. A value rule: put it first, it acts in the checkpoint's key
    space. Built by :func:`open_peft_lora` from ``adapter_config.json``."""

    kind: Literal["merge_lora"] = "merge_lora"
    moves_keys: ClassVar[bool] = False
    namespace: str = LORA_NAMESPACE
    module_prefix: str = PEFT_PREFIX
    alpha: float
    alpha_pattern: dict[str, float] = {}
    rslora: bool = False
    fan_in_fan_out: bool = False

    def input_patterns(self) -> list[str]:
        return [self.namespace + "**"]

    def inverse(self) -> list[RuleBase]:
        return []  # the merged weights are exported as they are; the pair is not recovered

    def apply(self, ctx: PlanContext, index: int) -> None:
        pairs: dict[str, dict[str, str]] = {}
        start = self.namespace + self.module_prefix
        for key in ctx.keys():
            if not key.startswith(self.namespace):
                continue
            name = key[len(self.namespace) :]
            m = _PAIR.fullmatch(key[len(start) :]) if key.startswith(start) else None
            if m is None:
                ctx.issue(index, name, f"is not a LoRA weight '{self.module_prefix}<module>.lora_A.weight' / "
                          "'.lora_B.weight'; sdadapt merges plain lora_A/lora_B pairs only (no DoRA magnitudes, "
                          "embedding LoRA or LoRA biases)")  # fmt: skip
                continue
            pairs.setdefault(m["module"], {})[m["which"]] = key
        for module, pair in pairs.items():
            self._merge(ctx, index, module, pair)

    def _merge(self, ctx: PlanContext, index: int, module: str, pair: dict[str, str]) -> None:
        ns = len(self.namespace)
        if len(pair) != 2:
            have = next(iter(pair.values()))
            other = "B" if "A" in pair else "A"
            ctx.issue(index, have[ns:], f"has no lora_{other} partner; the adapter file is incomplete")
            return
        akey, bkey = pair["A"], pair["B"]
        target = module + ".weight"
        if not ctx.has(target):
            ctx.issue(index, akey[ns:], f"targets {target!r}, which the checkpoint does not have; is this adapter "
                      "for another base model (or another module_prefix)?")  # fmt: skip
            return
        w, a, b = ctx.get(target), ctx.get(akey), ctx.get(bkey)
        problem = self._problem(w, a, b)
        if problem:
            ctx.issue(index, akey[ns:], f"cannot merge into {target!r}: {problem}")
            return
        alpha_key = pattern_key(self.alpha_pattern, module)
        alpha = self.alpha if alpha_key is None else self.alpha_pattern[alpha_key]
        scale = lora_scale(alpha, a.shape[0], self.rslora)
        merged = MergedLora(w, ctx.absorb(akey, index), ctx.absorb(bkey, index), scale, self.fan_in_fan_out)
        ctx.replace(target, merged)

    def _problem(self, w: Node, a: Node, b: Node) -> str | None:
        if len(w.shape) != 2 or len(a.shape) != 2 or len(b.shape) != 2:
            return f"weight {list(w.shape)}, A {list(a.shape)}, B {list(b.shape)}: LoRA merges into 2-d weights only"
        if w.dtype not in _MERGEABLE:
            return (f"the weight is stored as {dtype_name(w.dtype)}; a LoRA merges into float weights only "
                    "(dequantise first: sdadapt merges before the adapter's rules)")  # fmt: skip
        out, inp = (w.shape[1], w.shape[0]) if self.fan_in_fan_out else tuple(w.shape)
        r = a.shape[0]
        if r == 0:
            return "A has no rows: a LoRA of rank 0 changes nothing and has no scale (alpha / r); re-save the adapter"
        if tuple(a.shape) != (r, inp) or tuple(b.shape) != (out, r):
            layout = "[in, out] (fan_in_fan_out)" if self.fan_in_fan_out else "[out, in]"
            return (f"the weight {list(w.shape)} is {layout}, so A must be [r, {inp}] and B [{out}, r]; got "
                    f"A {list(a.shape)}, B {list(b.shape)}")  # fmt: skip
        return None


# --- a PEFT folder -------------------------------------------------------------------------------


@dataclass(frozen=True)
class PeftLora:
    """An opened PEFT LoRA folder: its tensors (``source``) and the rule that merges them."""

    path: str
    source: Source
    rule: MergeLora

    def join(self, base: Source) -> JoinedSource:
        """``base`` with this adapter's tensors under :data:`LORA_NAMESPACE` (owns both)."""
        try:
            return JoinedSource(base, {self.rule.namespace: self.source})
        except BaseException:
            self.source.close()
            raise


def lora_rule(config: Mapping[str, Any], *, where: str = CONFIG_NAME) -> MergeLora:
    """The :class:`MergeLora` rule for a PEFT ``adapter_config.json`` dict; an
    :class:`AdapterError` naming the field for what a plain merge cannot express."""
    try:
        cfg = validate(dict(config), PeftConfig, where, "PEFT adapter config")
    except SourceError as e:
        raise AdapterError(str(e)) from None
    if cfg.peft_type != "LORA":
        raise AdapterError(f"{where}: peft_type is {cfg.peft_type!r}; sdadapt merges LoRA adapters ('LORA') only")
    if cfg.bias != "none":
        raise AdapterError(f"{where}: bias={cfg.bias!r} trains the base layers' biases too; only bias='none' is "
                           "supported (merge with peft's merge_and_unload())")  # fmt: skip
    for name, why in _UNSUPPORTED.items():
        if config.get(name):
            raise AdapterError(f"{where}: {name}={config[name]!r} is not supported: {why}")
    for pat in cfg.alpha_pattern:
        try:
            re.compile(pat)
        except re.error as e:
            raise AdapterError(f"{where}: alpha_pattern key {pat!r} is not a regular expression: {e}") from None
    try:
        return MergeLora(
            alpha=cfg.lora_alpha, alpha_pattern=cfg.alpha_pattern, rslora=cfg.use_rslora, fan_in_fan_out=cfg.fan_in_fan_out
        )
    except AdapterError as e:
        raise AdapterError(f"{where}: {e}") from None


def open_peft_lora(path: str | os.PathLike[str]) -> PeftLora:
    """Open a PEFT LoRA folder (what ``PeftModel.save_pretrained`` writes): read
    ``adapter_config.json`` and the header of ``adapter_model.safetensors``; nothing else."""
    config_path, config = read_peft_config(path)
    rule = lora_rule(config, where=config_path)
    return PeftLora(os.fspath(path), open_peft_weights(path), rule)


def merged_lora(folder: str | os.PathLike[str], recipes: Mapping[str, Node]) -> LoraMerged:
    """What the plan's ``recipes`` merge from the LoRA folder: the keys holding a
    :class:`MergedLora` anywhere in their recipe, and the ranks of the pairs merged."""
    keys, pairs, ranks = 0, set(), set()
    for node in recipes.values():
        found, todo = False, [node]
        while todo:
            n = todo.pop()
            if isinstance(n, MergedLora):
                found = True
                pairs.add(id(n))
                ranks.add(int(n.a.shape[0]))
            todo.extend(n.children())
        keys += found
    return LoraMerged(folder=os.fspath(folder), keys=keys, pairs=len(pairs), ranks=sorted(ranks))
