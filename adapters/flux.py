"""Black Forest Labs' original Flux single-file layout -> diffusers ``FluxTransformer2DModel``.

The mapping follows the one diffusers applies when it loads a single-file Flux checkpoint
(``convert_flux_transformer_checkpoint_to_diffusers``), written here as typed rules so that it
runs lazily, per shard, and inverts for export:

- ``double_blocks.{i}.img_attn.qkv`` -> ``transformer_blocks.{i}.attn.to_q|to_k|to_v``;
  ``txt_attn.qkv`` -> ``attn.add_q_proj|add_k_proj|add_v_proj`` (weights and biases);
- ``single_blocks.{i}.linear1`` -> ``single_transformer_blocks.{i}.attn.to_q|to_k|to_v`` and
  ``proj_mlp`` (sizes ``[inner, inner, inner, mlp_hidden]``, taken from the model unless
  ``inner_dim``/``mlp_hidden_dim`` are given); ``linear2`` -> ``proj_out``;
- ``final_layer.adaLN_modulation.1`` -> ``norm_out.linear`` with its two halves swapped
  (BFL computes ``shift, scale``; diffusers' ``AdaLayerNormContinuous`` ``scale, shift``);
- the modulation, embedder, qk-norm, MLP and output projections are renamed.

Keys may sit under ``model.diffusion_model.`` (ComfyUI-style files): see ``prefix``.
Flux-dev has a guidance embedder (``guidance_in``), Flux-schnell does not: ``guidance=``.
"""

from __future__ import annotations

from typing import Any

from sdadapt.adapters._common import checkpoint_keys, positive

import sdadapt
from sdadapt import Adapter
from sdadapt.sources import Source

SUMMARY = (
    "Black Forest Labs Flux single file (double_blocks/single_blocks, optional model.diffusion_model.) "
    "-> diffusers FluxTransformer2DModel"
)

PREFIX = "model.diffusion_model."
D = "double_blocks.{i}."
DT = "transformer_blocks.{i}."
S = "single_blocks.{i}."
ST = "single_transformer_blocks.{i}."


def build(
    *,
    guidance: bool = True,
    prefix: bool | None = None,
    inner_dim: int | None = None,
    mlp_hidden_dim: int | None = None,
) -> Adapter:
    """``guidance``: the checkpoint has ``guidance_in`` (Flux-dev; False for schnell).
    ``prefix``: keys start with ``model.diffusion_model.`` (True), do not (False), or may
    (None: stripped where present; the inverse then writes it). ``inner_dim`` (heads x head dim,
    3072 for Flux.1) and ``mlp_hidden_dim`` (4 x inner_dim) fix the split sizes; without them
    the sizes come from the model."""
    qkv_sizes = None
    linear1_sizes = None
    if inner_dim is not None:
        inner = positive("inner_dim", inner_dim, "flux")
        mlp = positive("mlp_hidden_dim", mlp_hidden_dim if mlp_hidden_dim is not None else 4 * inner, "flux")
        qkv_sizes = [inner] * 3
        linear1_sizes = [inner] * 3 + [mlp]
    rules: list[Any] = []
    if prefix is not False:
        rules.append(sdadapt.strip_prefix(PREFIX, optional=prefix is None))
    embedders = [("time_in", "timestep_embedder"), ("vector_in", "text_embedder")]
    if guidance:
        embedders.append(("guidance_in", "guidance_embedder"))
    for bfl, hf in embedders:
        rules += [
            sdadapt.rename(f"{bfl}.in_layer.{{p}}", f"time_text_embed.{hf}.linear_1.{{p}}"),
            sdadapt.rename(f"{bfl}.out_layer.{{p}}", f"time_text_embed.{hf}.linear_2.{{p}}"),
        ]
    rules += [
        sdadapt.rename("txt_in.{p}", "context_embedder.{p}"),
        sdadapt.rename("img_in.{p}", "x_embedder.{p}"),
        # double-stream blocks
        sdadapt.rename(D + "img_mod.lin.{p}", DT + "norm1.linear.{p}"),
        sdadapt.rename(D + "txt_mod.lin.{p}", DT + "norm1_context.linear.{p}"),
        sdadapt.split(D + "img_attn.qkv.{p}", [DT + "attn.to_q.{p}", DT + "attn.to_k.{p}", DT + "attn.to_v.{p}"], sizes=qkv_sizes),
        sdadapt.split(
            D + "txt_attn.qkv.{p}",
            [DT + "attn.add_q_proj.{p}", DT + "attn.add_k_proj.{p}", DT + "attn.add_v_proj.{p}"],
            sizes=qkv_sizes,
        ),
        sdadapt.rename(D + "img_attn.norm.query_norm.scale", DT + "attn.norm_q.weight"),
        sdadapt.rename(D + "img_attn.norm.key_norm.scale", DT + "attn.norm_k.weight"),
        sdadapt.rename(D + "txt_attn.norm.query_norm.scale", DT + "attn.norm_added_q.weight"),
        sdadapt.rename(D + "txt_attn.norm.key_norm.scale", DT + "attn.norm_added_k.weight"),
        sdadapt.rename(D + "img_mlp.0.{p}", DT + "ff.net.0.proj.{p}"),
        sdadapt.rename(D + "img_mlp.2.{p}", DT + "ff.net.2.{p}"),
        sdadapt.rename(D + "txt_mlp.0.{p}", DT + "ff_context.net.0.proj.{p}"),
        sdadapt.rename(D + "txt_mlp.2.{p}", DT + "ff_context.net.2.{p}"),
        sdadapt.rename(D + "img_attn.proj.{p}", DT + "attn.to_out.0.{p}"),
        sdadapt.rename(D + "txt_attn.proj.{p}", DT + "attn.to_add_out.{p}"),
        # single-stream blocks
        sdadapt.rename(S + "modulation.lin.{p}", ST + "norm.linear.{p}"),
        sdadapt.split(
            S + "linear1.{p}",
            [ST + "attn.to_q.{p}", ST + "attn.to_k.{p}", ST + "attn.to_v.{p}", ST + "proj_mlp.{p}"],
            sizes=linear1_sizes,
        ),
        sdadapt.rename(S + "norm.query_norm.scale", ST + "attn.norm_q.weight"),
        sdadapt.rename(S + "norm.key_norm.scale", ST + "attn.norm_k.weight"),
        sdadapt.rename(S + "linear2.{p}", ST + "proj_out.{p}"),
        # final layer: (shift, scale) -> (scale, shift)
        sdadapt.rename("final_layer.linear.{p}", "proj_out.{p}"),
        sdadapt.split(
            "final_layer.adaLN_modulation.1.{p}",
            ["final_layer.adaLN_modulation.1.shift.{p}", "final_layer.adaLN_modulation.1.scale.{p}"],
        ),
        sdadapt.fuse(
            ["final_layer.adaLN_modulation.1.scale.{p}", "final_layer.adaLN_modulation.1.shift.{p}"],
            "norm_out.linear.{p}",
        ),
    ]
    return Adapter(
        rules,
        name="flux",
        description="BFL Flux single file -> diffusers FluxTransformer2DModel"
        + ("" if guidance else " (no guidance embedder)")
        + (f" (under {PREFIX})" if prefix else ""),
    )


def options_from_config(folder: str, source: str | Source | None = None) -> dict[str, Any]:
    """``guidance`` and ``prefix`` from the checkpoint's key names (headers only): BFL files
    carry no config."""
    keys = checkpoint_keys(source or folder)
    if not keys:
        return {}
    prefix = any(k.startswith(PREFIX) for k in keys)
    return {"prefix": prefix, "guidance": any(k.startswith((PREFIX if prefix else "") + "guidance_in.") for k in keys)}
