"""``sdadapt.shrink``: a real-weight checkpoint cut to its first N layers, for CI fixtures.

Keys are kept or dropped by the layer index that ``pattern`` finds in them (``"layers.{i}."``
by default, matched at a key-segment boundary, so ``model.layers.3.mlp...`` is layer 3 and
``mtp_layers.0`` is not a layer): keys of layers ``0..N-1`` and every key without a layer index
(embeddings, the final norm, the head) are kept, as stored (same dtype, same bytes). Quantized
checkpoints keep their scales, which sit beside their weights (``*_scale_inv``,
``*_blocks``/``*_scales``); a kept tensor whose companion would be dropped is an error.

Writing streams tensor by tensor (each is read from the mapped source, written, and its pages
handed back to the kernel: memory stays at about one tensor) into a folder beside ``dst``
that is renamed into place when complete (see :mod:`sdadapt._export.exporting`). ``config.json`` is
rewritten (:func:`shrink_config`); the other small files of the folder (tokenizer, generation
config...) are copied; other weight files (``.bin``, ``.pt``, sub-folders such as ``original/``)
are not.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from typing import Any

from pydantic import BaseModel

from .._base.progress import progress_bar
from .._base.regions import full_box
from .._export import PageReleaser, check_destination, write_folder
from .._recipes.nodes import Leaf, Node
from ..errors import ShrinkError
from ..sources import WEIGHT_SUFFIXES, HFConfig, local_path, open_source, read_json_dict

log = logging.getLogger(__name__)

__all__ = ["ShrinkError", "ShrinkReport", "layer_index", "shrink", "shrink_config"]

_SKIP_FILES = ("config.json", "model.safetensors.index.json", ".metadata")


class ShrinkReport(BaseModel):
    """What :func:`shrink` wrote.

    Attributes:
        dst: the folder written.
        layers: layers kept.
        layers_before: layers the source had.
        tensors: tensors written.
        tensors_dropped: tensors left out.
        bytes: bytes written.
        files: the files written.
        seconds: the whole call.

    Example::

        report = sdadapt.shrink("llama-8b/", "llama-2-layers/", layers=2)
        summary = str(report)
    """

    dst: str
    layers: int
    layers_before: int
    tensors: int
    tensors_dropped: int
    bytes: int
    files: list[str]
    seconds: float

    def format_text(self) -> str:
        return (
            f"wrote {self.dst}: {self.layers} of {self.layers_before} layers, {self.tensors} tensors "
            f"({self.bytes / 2**20:.1f} MiB; {self.tensors_dropped} dropped), {len(self.files)} file(s) "
            f"in {self.seconds:.2f} s"
        )

    def __str__(self) -> str:  # str(report): the summary, not the fields
        return self.format_text()


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    if pattern.count("{i}") != 1:
        raise ShrinkError(f"layer pattern {pattern!r} must contain {{i}} exactly once (e.g. 'layers.{{i}}.')")
    head, tail = pattern.split("{i}")
    return re.compile(r"(?:^|(?<=\.))" + re.escape(head) + r"(\d+)" + re.escape(tail))


def layer_index(key: str, pattern: str = "layers.{i}.") -> int | None:
    """The layer index ``pattern`` finds in ``key`` (its first match), or ``None``."""
    m = _pattern_regex(pattern).search(key)
    return int(m.group(1)) if m else None


def shrink_config(config: dict[str, Any], layers: int) -> dict[str, Any]:
    """``config`` (an HF ``config.json`` or a Meta ``params.json``) for the first ``layers`` layers:
    the layer count (``num_hidden_layers``, ``n_layers``, ``num_layers``, ``n_layer``) set, per-layer
    lists (``layer_types``, ``mlp_only_layers``, list-valued ``moe_layer_freq``) cut,
    ``first_k_dense_replace`` capped and ``num_nextn_predict_layers`` (multi-token-prediction
    layers, stored after the last layer and so dropped) set to 0; ``text_config`` likewise."""
    out = dict(config)
    for name in ("num_hidden_layers", "n_layers", "num_layers", "n_layer"):
        if isinstance(out.get(name), int):
            out[name] = layers
    if isinstance(out.get("layer_types"), list):
        out["layer_types"] = out["layer_types"][:layers]
    if isinstance(out.get("moe_layer_freq"), list):
        out["moe_layer_freq"] = out["moe_layer_freq"][:layers]
    if isinstance(out.get("mlp_only_layers"), list):
        out["mlp_only_layers"] = [i for i in out["mlp_only_layers"] if isinstance(i, int) and i < layers]
    if isinstance(out.get("first_k_dense_replace"), int):
        out["first_k_dense_replace"] = min(out["first_k_dense_replace"], layers)
    if isinstance(out.get("num_nextn_predict_layers"), int):
        out["num_nextn_predict_layers"] = 0
    if isinstance(out.get("text_config"), dict):
        out["text_config"] = shrink_config(out["text_config"], layers)
    return out


def _companions(key: str) -> list[str]:
    """Keys stored beside a quantized ``key`` that must be kept with it: an FP8 weight and its
    ``<weight>_scale_inv``, MXFP4 ``*_blocks`` and ``*_scales``."""
    out = [key.removesuffix("_scale_inv")] if key.endswith("_scale_inv") else [key + "_scale_inv"]
    for a, b in (("_blocks", "_scales"), ("_scales", "_blocks")):
        if key.endswith(a):
            out.append(key.removesuffix(a) + b)
    return out


def _select(keys: list[str], layers: int, pattern: str) -> tuple[list[str], int]:
    """The keys to keep, and the number of layers the checkpoint has."""
    rx = _pattern_regex(pattern)
    index = {}
    for k in keys:
        m = rx.search(k)
        index[k] = int(m.group(1)) if m else None
    found = sorted({i for i in index.values() if i is not None})
    if not found:
        raise ShrinkError(f"no key matches the layer pattern {pattern!r} (e.g. {keys[:3]}); pass --pattern")
    before = found[-1] + 1
    if layers < 1 or layers > before:
        raise ShrinkError(f"cannot keep {layers} layers: the checkpoint has {before} (pattern {pattern!r})")
    kept = [k for k in keys if (i := index[k]) is None or i < layers]
    kept_set, have = set(kept), set(keys)
    for k in kept:
        for companion in _companions(k):
            if companion in have and companion not in kept_set:
                raise ShrinkError(f"{k!r} is kept but its companion {companion!r} would be dropped; check the layer pattern")
    return kept, before


def _side_files(folder: str | None, dst_tmp: str, config: dict[str, Any] | None, layers: int) -> None:
    if config is not None:
        with open(os.path.join(dst_tmp, "config.json"), "w", encoding="utf-8") as f:
            json.dump(shrink_config(config, layers), f, indent=2)
            f.write("\n")
    if folder is None:
        return
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name in _SKIP_FILES or name.endswith(WEIGHT_SUFFIXES) or name.endswith(".index.json"):
            continue
        if not os.path.isfile(path):
            log.info("shrink: not copying %s (not a plain file)", path)
            continue
        shutil.copy2(path, os.path.join(dst_tmp, name))


def shrink(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    layers: int,
    *,
    pattern: str = "layers.{i}.",
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    progress: bool | None = None,
) -> ShrinkReport:
    """Write the first ``layers`` layers of checkpoint ``src`` (an HF folder, sharded or not, or
    a ``.safetensors`` file) to the folder ``dst`` as HF safetensors (shards of at most
    ``max_shard_size`` plus ``model.safetensors.index.json``, or one ``model.safetensors``),
    with ``config.json`` rewritten and the folder's other small files copied. ``progress``:
    a tqdm bar on stderr (``None``: only on a terminal). See the module docstring.

    Args:
        src: the HF checkpoint folder or ``.safetensors`` file.
        dst: the folder to write.
        layers: how many layers to keep.
        pattern: the key prefix of one layer, ``{i}`` the layer index.
        max_shard_size: the largest shard written.
        overwrite: replace an existing ``dst``.
        progress: show a progress bar (``None``: only on a terminal).

    Returns:
        The :class:`~sdadapt.reports.ShrinkReport`: layers, keys and bytes kept.

    Example::

        sdadapt.shrink("path/to/llama-8b", "llama-2-layers", layers=2)
    """
    t0 = time.perf_counter()
    src, dst = local_path(src), os.fspath(dst)  # a Hub id (hf://...): its snapshot folder
    check_destination(dst, overwrite)
    source = open_source(src)
    try:
        if source.kind not in ("HFShardedSource", "SafetensorsFile"):
            raise ShrinkError(f"{src}: shrink reads safetensors checkpoints (an HF folder or a .safetensors file), not {source.kind}")
        folder = src if os.path.isdir(src) else os.path.dirname(os.path.abspath(src))
        config = None
        config_path = os.path.join(folder, "config.json")
        if os.path.isfile(config_path):
            config = read_json_dict(config_path, HFConfig, what="config.json")
        keys = list(source.schema)
        kept, before = _select(keys, layers, pattern)
        # read in file order: sequential reads of each shard
        kept.sort(key=lambda k: (source.file_of(k), (loc.offset if (loc := source.locate(k)) else 0)))
        outputs: dict[str, Node] = {k: Leaf(k, tuple(source.schema[k].shape), source.schema[k].dtype) for k in kept}
        total = sum(source.schema[k].nbytes for k in kept)
        release = PageReleaser(source.files())
        bar = progress_bar(total, "shrink", enabled=progress)
        pending: list[Any] = []

        def pull(key: str) -> Any:
            while pending:  # the writer has written the previous tensor: hand its pages back
                release(pending.pop())
            t = source.read(key, full_box(tuple(source.schema[key].shape)))
            pending.append(t)
            bar.update(source.schema[key].nbytes)
            return t

        try:
            files = write_folder(
                dst,
                "safetensors",
                outputs,
                pull,
                max_shard_size=max_shard_size,
                overwrite=overwrite,
                check=lambda tmp: _side_files(folder if os.path.isdir(src) else None, tmp, config, layers),
            )
        finally:
            bar.close()
            for t in pending:
                release(t)
    finally:
        source.close()
    rep = ShrinkReport(
        dst=dst,
        layers=layers,
        layers_before=before,
        tensors=len(kept),
        tensors_dropped=len(keys) - len(kept),
        bytes=total,
        files=files,
        seconds=time.perf_counter() - t0,
    )
    log.info("%s", rep.format_text())
    return rep
