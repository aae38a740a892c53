"""The models of the config files users and releases hand us, read by :func:`._json.read_json`
(strict types for the fields sdadapt reads, the rest kept): imported where a config file is
read, which a plain load does not do.

- :class:`HFConfig`: an HF ``config.json`` (head counts, sizes, ``quantization_config`` as an
  object, handed on as the dict it is to the quantization rules, which check its fields);
- :class:`PeftConfig`: a PEFT LoRA ``adapter_config.json``;
- :class:`QuantConfigFile`: ModelOpt's ``hf_quant_config.json``.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from ._json import Lenient


class PeftConfig(Lenient):
    """The fields of a PEFT ``adapter_config.json`` that decide a LoRA merge (see ``sdadapt.rules._lora``)."""

    peft_type: str = "LORA"
    bias: str = "none"
    lora_alpha: float
    r: int | None = Field(default=None, ge=1)
    alpha_pattern: dict[str, float] = {}
    rank_pattern: dict[str, int] = {}
    use_rslora: bool = False
    fan_in_fan_out: bool = False
    target_modules: list[str] | str | None = None


Count = Annotated[int | None, Field(ge=0)]
"""A count of a ``config.json``: a non-negative integer, or absent."""


class HFConfig(Lenient):
    """The fields of an HF ``config.json`` that sdadapt's adapters, ``shrink`` and ``verify`` read.
    Counts are non-negative integers; ``quantization_config`` is an object (its fields are the
    quantization rules' to check)."""

    architectures: list[str] | None = None
    model_type: str | None = None
    num_hidden_layers: Count = None
    num_attention_heads: Count = None
    num_key_value_heads: Count = None
    hidden_size: Count = None
    head_dim: Count = None
    intermediate_size: Count = None
    vocab_size: int | None = None  # Meta params.json: -1 when the tokenizer decides
    tie_word_embeddings: bool | None = None
    attention_bias: bool | None = None
    num_local_experts: Count = None
    num_experts: Count = None
    n_routed_experts: Count = None
    first_k_dense_replace: Count = None
    num_nextn_predict_layers: Count = None
    q_lora_rank: Count = None
    kv_lora_rank: Count = None
    qk_nope_head_dim: Count = None
    qk_rope_head_dim: Count = None
    rope_interleave: bool | None = None
    decoder_sparse_step: Count = None
    mlp_only_layers: list[int] | None = None
    n_layers: Count = None  # Meta params.json
    n_heads: Count = None
    n_kv_heads: Count = None
    dim: Count = None
    quantization_config: dict[str, Any] | None = None
    text_config: dict[str, Any] | None = None


class QuantConfigFile(Lenient):
    """ModelOpt's ``hf_quant_config.json``: its ``quantization`` object."""

    quantization: dict[str, Any] | None = None
