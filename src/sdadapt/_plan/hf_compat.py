"""What :mod:`sdadapt._plan.hf_models` uses of transformers that differs between its releases,
each detected on the installed one, with the older releases' behaviour written here.

transformers' conversion mapping (``transformers.conversion_mapping`` and
``transformers.core_model_loading``) appeared in 5.0 and has grown since; the supported range
(``sdadapt._base.env.SUPPORTED``) starts at 4.57, which has neither module:

- ``core_model_loading.apply_renamings`` (5.21): every renaming's ``rename_source_key`` in turn,
  as ``from_pretrained`` did before it was a function of its own;
- ``PreTrainedModel.is_custom_code`` and ``conversion_mapping.USER_REGISTERED_MAPPINGS`` (5.13):
  before them, a model's mapping applied whatever module its class came from;
- ``core_model_loading.PrefixChange`` (5.10): before it, no transform changed a prefix;
- ``Transpose.check_dims`` (5.5): before it, ``Transpose`` always transposed;
- ``PreTrainedModel.get_expanded_tied_weights_keys`` (5.0): in 4.x, tied weights are one
  parameter under two names (``tie_weights`` makes ``lm_head.weight`` the embedding's
  parameter), which is what is read here.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .._base.env import transformers_supported
from ..errors import AdapterError


def check_supported() -> None:
    """The up-front :class:`AdapterError` for a transformers release outside the supported range."""
    problem = transformers_supported()
    if problem is not None:
        raise AdapterError(problem)


def modules() -> tuple[Any, Any] | None:
    """transformers' ``(conversion_mapping, core_model_loading)`` modules; ``None`` for a
    transformers without them (4.x: no conversion mapping, only the class attribute
    ``_checkpoint_conversion_mapping``)."""
    try:
        from transformers import conversion_mapping, core_model_loading
    except ImportError:
        return None
    return conversion_mapping, core_model_loading


def apply_renamings(cml: Any, key: str, renamings: list[Any]) -> str:
    """``key`` after every renaming in turn (``core_model_loading.apply_renamings``)."""
    own = getattr(cml, "apply_renamings", None)
    if own is not None:
        return str(own(key, renamings))
    for renaming in renamings:
        key, _ = renaming.rename_source_key(key)
    return key


def skips_custom_code(cm: Any, cls: type, model_type: str | None) -> bool:
    """transformers leaves the mapping of a model class of one's own (or from the Hub) unapplied
    unless it was registered for that class or model type (5.13 on; earlier releases applied it)."""
    is_custom = getattr(cls, "is_custom_code", None)
    if is_custom is None:
        return False
    registered: set[str] = getattr(cm, "USER_REGISTERED_MAPPINGS", set())
    return bool(is_custom()) and cls.__name__ not in registered and model_type not in registered


def is_prefix_change(cml: Any, transform: Any) -> bool:
    kind = getattr(cml, "PrefixChange", None)
    return kind is not None and isinstance(transform, kind)


def transposes_only_when_shapes_differ(op: Any) -> bool:
    """``Transpose(check_dims=True)``: transposed only where the shape is not the model's already."""
    return bool(getattr(op, "check_dims", False))


def tied_weights(model: nn.Module) -> dict[str, str]:
    """``{tied key: key it is tied to}``: transformers' ``get_expanded_tied_weights_keys`` (5.0
    on), else the parameters that are one tensor under several names (4.x), the later name tied
    to the first (``lm_head.weight`` -> ``model.embed_tokens.weight``)."""
    get = getattr(model, "get_expanded_tied_weights_keys", None)
    if callable(get):
        return dict(get(all_submodels=True))
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied[name] = first[id(p)]
        else:
            first[id(p)] = name
    return tied
