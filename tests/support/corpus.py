"""A corpus of bad checkpoints, made by the tests themselves (issue 5).

    cases = build_corpus(folder)        # list[Case], every file written under ``folder``
    model = corpus_model()              # the model every case is loaded into
    sd = good_state_dict()              # what a good checkpoint holds

Every source kind (``torch.save``, safetensors, HF sharded, DCP) gets: truncations at several
points, flipped bytes in headers and in data (data flips are only detectable with checksums, so
those cases load with ``checksums=True`` against a sidecar written from the good file), headers
whose length or offsets point past the end or overlap, index/metadata entries naming missing
files or paths outside the folder (``../``, absolute, symlinks leading out), duplicate keys,
pickles that would import or call code (they must not run: each would create a marker file),
legacy pickles, empty files, wrong dtypes, and NaN/Inf values (``check_finite=True``).

Each :class:`Case` says what a load of it must raise (the exact ``SdadaptError`` subclass),
when (``phase="open"``: while planning, before the model is touched; ``phase="read"``: while
or right after reading, so the load must roll back), and which file (and key) the message
names. Files are written with the reference writers (torch.save, safetensors, dcp.save) and
then damaged by hand; sdadapt only writes the checksum sidecars.

The newer doors (Hub ids and caches, config.json, LoRA folders, quantized scales and blocks, the
shrink / convert / verify commands) have a corpus of their own: :mod:`corpus_doors`.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import zipfile
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from sdadapt.errors import LoadError, PlanError, SdadaptError, SourceError
from support.checkpoints import INDEX_NAME, write_hf_sharded, write_raw_safetensors, write_safetensors, write_torch_save
from support.models import TinyTransformer, parallelize

KEY = "layers.0.ffn.0.weight"  # the tensor the cases damage (shape [12, 8])
MODEL_KW = dict(layers=1, dim=8, heads=2, ffn=12, vocab=11)


def corpus_model(device: str = "cpu") -> TinyTransformer:
    with torch.device(device):
        return TinyTransformer(**MODEL_KW)


def good_state_dict() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    return {k: torch.randn(v.shape, generator=gen) for k, v in corpus_model("meta").state_dict().items()}


@dataclass
class Case:
    name: str
    kind: str  # torch_save | safetensors | hf_sharded | dcp
    path: str  # what to pass to sdadapt.load
    error: type[SdadaptError]
    phase: str  # "open" (planning: the model is never touched) | "read" (rolled back)
    file: str  # a path the message must contain
    key: str | None = None  # a key the message must contain (quoted)
    fragments: tuple[str, ...] = ()
    load_kwargs: dict[str, Any] = field(default_factory=dict)
    marker: str | None = None  # a file that must NOT exist afterwards (code would have run)

    def check_message(self, message: str) -> list[str]:
        """What the message lacks (empty: fine)."""
        wrong = []
        if self.file not in message:
            wrong.append(f"file {self.file}")
        if self.key is not None and repr(self.key) not in message and f"{self.key}:" not in message:
            wrong.append(f"key {self.key!r}")
        wrong += [f"fragment {f!r}" for f in self.fragments if f not in message]
        return wrong


# --------------------------------------------------------------------------------------------
# byte surgery
# --------------------------------------------------------------------------------------------
def _bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _write(path: str, data: bytes) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return path


def truncated(src: str, dst: str, cut: int) -> str:
    return _write(dst, _bytes(src)[:cut])


def flipped(src: str, dst: str, offset: int, mask: int = 0xFF) -> str:
    data = bytearray(_bytes(src))
    data[offset] ^= mask
    return _write(dst, bytes(data))


def copy_tree(src: str, dst: str) -> str:
    shutil.copytree(src, dst, symlinks=True)
    return dst


class _Reduce:
    """Pickles as a call of ``fn(*args)``: what a malicious checkpoint does."""

    def __init__(self, fn: Any, *args: Any):
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (self.fn, self.args)


def _zip_record_offset(path: str, suffix: str) -> tuple[int, int]:
    """(file offset, size) of the stored zip record whose name ends with ``suffix``."""
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        for info in z.infolist():
            if info.filename.endswith(suffix):
                f.seek(info.header_offset)
                local = f.read(30)
                n, m = struct.unpack("<HH", local[26:30])
                return info.header_offset + 30 + n + m, info.file_size
    raise KeyError(suffix)


def _torch_save_data_offset(path: str, key: str) -> int:
    """File offset of ``key``'s bytes in a flat torch.save zip (via the mapped storage)."""
    from sdadapt.sources import open_source

    with open_source(path) as src:
        loc = src.locate(key)
        assert loc is not None, "torch.save layout not located"
        return loc.offset


def _safetensors_data_offset(path: str, key: str) -> int:
    from sdadapt.sources._safetensors_file import read_header

    entries, _, start = read_header(path)
    return start + entries[key][1]


def _dcp_item(folder: str, key: str) -> tuple[str, int, int]:
    """(data file, offset, length) of ``key``'s stored item in a DCP folder."""
    with open(os.path.join(folder, ".metadata"), "rb") as f:
        md = pickle.load(f)  # our own file, written by dcp.save just now
    for idx, info in md.storage_data.items():
        if idx.fqn == key:
            return os.path.join(folder, info.relative_path), info.offset, info.length
    raise KeyError(key)


def _rewrite_dcp_metadata(folder: str, rename_file: Any) -> None:
    """Hand-edit ``.metadata``: each storage entry's relative_path -> rename_file(path)."""
    import dataclasses

    path = os.path.join(folder, ".metadata")
    with open(path, "rb") as f:
        md = pickle.load(f)
    md.storage_data = {
        idx: dataclasses.replace(info, relative_path=rename_file(info.relative_path)) for idx, info in md.storage_data.items()
    }
    with open(path, "wb") as f:
        pickle.dump(md, f)


def _write_dcp(folder: str, sd: dict[str, torch.Tensor]) -> str:
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({k: v.clone() for k, v in sd.items()}, checkpoint_id=folder, no_dist=True)
    return folder


def _checksums(path: str) -> None:
    from sdadapt.sources._integrity import write_checksums

    write_checksums(path)


# --------------------------------------------------------------------------------------------
# the corpus
# --------------------------------------------------------------------------------------------
def build_corpus(folder: str) -> list[Case]:
    """Write every bad checkpoint under ``folder`` and describe what loading it must do."""
    os.makedirs(folder, exist_ok=True)
    j = lambda *p: os.path.join(folder, *p)  # noqa: E731
    sd = good_state_dict()
    cases: list[Case] = []
    add = cases.append

    # ---------------- torch.save ----------------
    for sub in ("good", "pt", "pt_verify", "st", "st_verify", "st_nochecksums", "hf", "dcp"):
        os.makedirs(j(sub), exist_ok=True)
    good_pt = write_torch_save(j("good", "good.pt"), sd)
    data = _bytes(good_pt)
    pkl_off, pkl_len = _zip_record_offset(good_pt, "data.pkl")
    for cut in (10, pkl_off + pkl_len // 2, len(data) // 2, len(data) - 30, len(data) - 1):
        p = truncated(good_pt, j("pt", f"trunc_{cut}.pt"), cut)
        add(Case(f"pt_truncated_{cut}", "torch_save", p, SourceError, "open", p, fragments=("torch.save",)))
    p = flipped(good_pt, j("pt", "flip_magic.pt"), 0, 0x01)
    add(Case("pt_flip_magic", "torch_save", p, SourceError, "open", p, fragments=("corrupt or truncated",)))
    p = flipped(good_pt, j("pt", "flip_pickle_proto.pt"), pkl_off, 0xFF)  # 0x80 PROTO opcode -> 0x7f
    add(Case("pt_flip_pickle_opcode", "torch_save", p, SourceError, "open", p))
    # a flipped byte inside a key name in the pickle: the key no longer matches
    raw = bytearray(data)
    at = raw.find(KEY.encode(), pkl_off, pkl_off + pkl_len)
    assert at > 0
    raw[at + len(KEY) - 1] ^= 0x01  # ...weight -> ...weighu
    p = _write(j("pt", "flip_key.pt"), bytes(raw))
    add(Case("pt_flip_key_name", "torch_save", p, PlanError, "open", p, key=None, fragments=(KEY,)))
    # a flipped data byte: only checksums can tell
    src = write_torch_save(j("pt_verify", "m.pt"), sd)
    _checksums(src)
    off = _torch_save_data_offset(src, KEY) + 5
    raw = bytearray(_bytes(src))
    raw[off] ^= 0x40
    _write(src, bytes(raw))
    add(Case("pt_flip_data_verify", "torch_save", src, LoadError, "read", src, KEY, ("checksum mismatch",), {"checksums": True}))
    # pickles that would run code: each would create its marker file
    for name, payload in (
        ("mkdir", lambda m: _Reduce(os.mkdir, m)),
        ("eval", lambda m: _Reduce(eval, f"__import__('os').mkdir({m!r})")),
        ("system", lambda m: _Reduce(os.system, f"mkdir {m}")),
    ):
        marker = j("pt", f"pwned_{name}")
        p = j("pt", f"evil_{name}.pt")
        torch.save({**sd, "evil": payload(marker)}, p)
        add(Case(f"pt_evil_{name}", "torch_save", p, SourceError, "open", p, fragments=("refusing to unpickle",), marker=marker))
        # the same payload in a legacy (non-zip) file and as a bare pickle
        p = j("pt", f"evil_{name}_legacy.pt")
        torch.save({**sd, "evil": payload(marker)}, p, _use_new_zipfile_serialization=False)
        add(Case(f"pt_evil_{name}_legacy", "torch_save", p, SourceError, "open", p, fragments=("legacy",), marker=marker))
        p = j("pt", f"evil_{name}.pkl")
        with open(p, "wb") as f:
            pickle.dump({"w": payload(marker)}, f)
        add(Case(f"pt_evil_{name}_bare_pickle", "torch_save", p, SourceError, "open", p, marker=marker))
    p = write_torch_save(j("pt", "legacy.pt"), sd, legacy=True)
    add(Case("pt_legacy", "torch_save", p, SourceError, "open", p, fragments=("legacy (non-zip)",)))
    p = _write(j("pt", "empty.pt"), b"")
    add(Case("pt_empty", "torch_save", p, SourceError, "open", p, fragments=("empty file",)))
    # a zip record shorter than its tensor (hand-edited archive)
    p = j("pt", "record_short.pt")
    with zipfile.ZipFile(good_pt) as zin, zipfile.ZipFile(p, "w", compression=zipfile.ZIP_STORED) as zout:
        target = _torch_record_name(good_pt, KEY)
        for info in zin.infolist():
            blob = zin.read(info.filename)
            if info.filename.endswith(target):
                blob = blob[: len(blob) // 2]
            zout.writestr(info, blob)
    add(Case("pt_record_shorter_than_tensor", "torch_save", p, SourceError, "open", p, KEY))
    bad = dict(sd)
    bad[KEY] = sd[KEY].double()
    p = write_torch_save(j("pt", "wrong_dtype.pt"), bad)
    add(Case("pt_wrong_dtype", "torch_save", p, PlanError, "open", p, KEY, ("float64",)))
    bad = dict(sd)
    bad[KEY] = sd[KEY].clone()
    bad[KEY][3, 4] = float("nan")
    bad[KEY][0, 0] = float("-inf")
    p = write_torch_save(j("pt", "nan.pt"), bad)
    add(Case("pt_nan_check_finite", "torch_save", p, LoadError, "read", p, KEY, ("1 NaN, 1 Inf",), {"check_finite": True}))

    # ---------------- safetensors ----------------
    good_st = write_safetensors(j("good", "good.safetensors"), sd)
    data = _bytes(good_st)
    (hlen,) = struct.unpack("<Q", data[:8])
    for cut in (4, 8 + hlen // 2, 8 + hlen + 3, len(data) - 1):
        p = truncated(good_st, j("st", f"trunc_{cut}.safetensors"), cut)
        add(Case(f"st_truncated_{cut}", "safetensors", p, SourceError, "open", p))
    for name, n in (("huge", 2**63), ("past_end", len(data))):
        p = _write(j("st", f"header_len_{name}.safetensors"), struct.pack("<Q", n) + data[8:])
        add(Case(f"st_header_len_{name}", "safetensors", p, SourceError, "open", p, fragments=("header length",)))
    p = flipped(good_st, j("st", "flip_header_brace.safetensors"), 8, 0x01)  # '{' -> 'z'
    add(Case("st_flip_header_json", "safetensors", p, SourceError, "open", p, fragments=("not valid JSON",)))
    # a flipped digit in KEY's data_offsets: size no longer matches, or past the end
    header = json.loads(data[8 : 8 + hlen])
    e = header[KEY]
    for name, offs in (
        ("past_end", [e["data_offsets"][0], len(data) - 8 - hlen + 64]),
        ("overlap", [e["data_offsets"][0] - 16, e["data_offsets"][1] - 16]),
        ("reversed", [e["data_offsets"][1], e["data_offsets"][0]]),
    ):
        h = dict(header)
        h[KEY] = {**e, "data_offsets": offs}
        p = write_raw_safetensors(j("st", f"offsets_{name}.safetensors"), h, data[8 + hlen :])
        add(Case(f"st_offsets_{name}", "safetensors", p, SourceError, "open", p, None if name == "overlap" else KEY))
    h = dict(header)
    h[KEY] = {**e, "dtype": "F4"}
    p = write_raw_safetensors(j("st", "unknown_dtype.safetensors"), h, data[8 + hlen :])
    add(Case("st_unknown_dtype", "safetensors", p, SourceError, "open", p, KEY, ("unsupported dtype",)))
    h = dict(header)
    h[KEY] = {**e, "dtype": "I32"}  # same size, wrong dtype for the model
    p = write_raw_safetensors(j("st", "wrong_dtype.safetensors"), h, data[8 + hlen :])
    add(Case("st_wrong_dtype", "safetensors", p, PlanError, "open", p, KEY, ("int32",)))
    p = _write(j("st", "empty.safetensors"), b"")
    add(Case("st_empty", "safetensors", p, SourceError, "open", p, fragments=("empty file",)))
    src = write_safetensors(j("st_verify", "m.safetensors"), sd)
    _checksums(src)
    raw = bytearray(_bytes(src))
    raw[_safetensors_data_offset(src, KEY) + 7] ^= 0x01
    _write(src, bytes(raw))
    add(Case("st_flip_data_verify", "safetensors", src, LoadError, "read", src, KEY, ("checksum mismatch",), {"checksums": True}))
    src = write_safetensors(j("st_nochecksums", "m.safetensors"), sd)
    add(Case("st_verify_without_checksums", "safetensors", src, SourceError, "open", src, fragments=("sdadapt.checksums.json",), load_kwargs={"checksums": True}))
    bad = dict(sd)
    bad[KEY] = sd[KEY].clone()
    bad[KEY][11, 7] = float("inf")
    p = write_safetensors(j("st", "inf.safetensors"), bad)
    add(Case("st_inf_check_finite", "safetensors", p, LoadError, "read", p, KEY, ("0 NaN, 1 Inf",), {"check_finite": True}))

    # ---------------- HF sharded ----------------
    good_hf = write_hf_sharded(j("good", "hf"), sd, max_shard_bytes=1024)
    index = json.loads(_bytes(os.path.join(good_hf, INDEX_NAME)))
    shard_of_key = index["weight_map"][KEY]

    def hf_variant(name: str, weight_map: dict[str, Any] | None = None) -> str:
        f = copy_tree(good_hf, j("hf", name))
        if weight_map is not None:
            with open(os.path.join(f, INDEX_NAME), "w") as fh:
                json.dump({"metadata": index["metadata"], "weight_map": weight_map}, fh)
        return f

    f = hf_variant("missing_shard")
    os.remove(os.path.join(f, shard_of_key))
    add(Case("hf_missing_shard", "hf_sharded", f, SourceError, "open", os.path.join(f, INDEX_NAME), None, (repr(shard_of_key), "does not exist")))
    outside = write_safetensors(j("hf", "outside.safetensors"), {KEY: sd[KEY]})
    for name, target in (("dotdot", "../outside.safetensors"), ("abs", outside), ("dotdot_deep", "sub/../../outside.safetensors")):
        f = hf_variant(f"path_{name}", {**index["weight_map"], KEY: target})
        add(Case(f"hf_path_{name}", "hf_sharded", f, SourceError, "open", os.path.join(f, INDEX_NAME), KEY, ("outside",)))
    f = hf_variant("symlink_out", {**index["weight_map"], KEY: "link.safetensors"})
    os.symlink(outside, os.path.join(f, "link.safetensors"))
    add(Case("hf_symlink_out", "hf_sharded", f, SourceError, "open", os.path.join(f, INDEX_NAME), KEY, ("outside the checkpoint folder",)))
    f = hf_variant("duplicate_key")
    other = next(n for n in sorted(set(index["weight_map"].values())) if n != shard_of_key)
    others = {k: sd[k] for k, n in index["weight_map"].items() if n == other}
    write_safetensors(os.path.join(f, other), {**others, KEY: sd[KEY]})
    add(Case("hf_duplicate_key_across_shards", "hf_sharded", f, SourceError, "open", os.path.join(f, INDEX_NAME), KEY, ("two shards",)))
    f = hf_variant("truncated_shard")
    shard = os.path.join(f, shard_of_key)
    truncated(os.path.join(good_hf, shard_of_key), shard, os.path.getsize(shard) - 3)
    add(Case("hf_truncated_shard", "hf_sharded", f, SourceError, "open", shard))
    ix = _bytes(os.path.join(good_hf, INDEX_NAME))
    for name, blob in (("truncated", ix[: len(ix) // 2]), ("empty", b""), ("nested", b"[" * 100000), ("not_object", b"[1, 2]")):
        f = hf_variant(f"index_{name}")
        _write(os.path.join(f, INDEX_NAME), blob)
        add(Case(f"hf_index_{name}", "hf_sharded", f, SourceError, "open", os.path.join(f, INDEX_NAME)))
    f = hf_variant("index_huge")
    with open(os.path.join(f, INDEX_NAME), "r+b") as fh:
        fh.truncate(65 * 1024 * 1024)  # sparse: refused by size before it is parsed
    add(Case("hf_index_huge", "hf_sharded", f, SourceError, "open", os.path.join(f, INDEX_NAME), fragments=("exceeds the limit",)))
    f = hf_variant("flip_data_verify")
    _checksums(f)
    shard = os.path.join(f, shard_of_key)
    raw = bytearray(_bytes(shard))
    raw[_safetensors_data_offset(shard, KEY) + 1] ^= 0x10
    _write(shard, bytes(raw))
    add(Case("hf_flip_data_verify", "hf_sharded", f, LoadError, "read", shard, KEY, ("checksum mismatch",), {"checksums": True}))

    # ---------------- DCP ----------------
    good_dcp = _write_dcp(j("good", "dcp"), sd)
    datafile, item_off, item_len = _dcp_item(good_dcp, KEY)
    dname = os.path.basename(datafile)

    def dcp_variant(name: str) -> str:
        return copy_tree(good_dcp, j("dcp", name))

    f = dcp_variant("no_metadata")
    os.remove(os.path.join(f, ".metadata"))
    add(Case("dcp_no_metadata", "dcp", f, SourceError, "open", f, fragments=("no .metadata",)))
    f = dcp_variant("missing_data")
    os.remove(os.path.join(f, dname))
    add(Case("dcp_missing_data_file", "dcp", f, SourceError, "open", f, fragments=(dname, "missing")))
    md_bytes = _bytes(os.path.join(good_dcp, ".metadata"))
    for name, blob in (("truncated_half", md_bytes[: len(md_bytes) // 2]), ("truncated_end", md_bytes[:-1]), ("empty", b""), ("flipped", md_bytes[:1] + bytes([md_bytes[1] ^ 0xFF]) + md_bytes[2:])):
        f = dcp_variant(f"metadata_{name}")
        _write(os.path.join(f, ".metadata"), blob)
        add(Case(f"dcp_metadata_{name}", "dcp", f, SourceError, "open", os.path.join(f, ".metadata")))
    f = dcp_variant("truncated_data")
    truncated(datafile, os.path.join(f, dname), item_off + item_len // 2)
    add(Case("dcp_truncated_data", "dcp", f, SourceError, "open", os.path.join(f, dname), fragments=("truncated",)))
    outside_dcp = j("dcp", "outside.distcp")
    shutil.copy(datafile, outside_dcp)
    for name, fn in (("dotdot", lambda n: "../outside.distcp"), ("abs", lambda n: outside_dcp), ("subdir", lambda n: "sub/" + n)):
        f = dcp_variant(f"path_{name}")
        _rewrite_dcp_metadata(f, fn)
        add(Case(f"dcp_path_{name}", "dcp", f, SourceError, "open", os.path.join(f, ".metadata"), fragments=("not a plain file name",)))
    f = dcp_variant("symlink_out")
    os.remove(os.path.join(f, dname))
    os.symlink(outside_dcp, os.path.join(f, dname))
    add(Case("dcp_symlink_out", "dcp", f, SourceError, "open", os.path.join(f, ".metadata"), fragments=("outside the checkpoint folder",)))
    marker = j("dcp", "pwned")
    f = dcp_variant("evil_metadata")
    with open(os.path.join(f, ".metadata"), "wb") as fh:
        pickle.dump(_Reduce(os.mkdir, marker), fh)
    add(Case("dcp_evil_metadata", "dcp", f, SourceError, "open", os.path.join(f, ".metadata"), fragments=("refusing",), marker=marker))
    f = dcp_variant("flip_item_header")  # the stored item of KEY is itself a torch.save zip
    flipped(datafile, os.path.join(f, dname), item_off, 0x01)
    add(Case("dcp_flip_item_header", "dcp", f, LoadError, "read", os.path.join(f, dname), KEY))
    f = dcp_variant("flip_data_verify")
    _checksums(f)
    item = _bytes(datafile)[item_off : item_off + item_len]
    at = item_off + item.find(sd[KEY].numpy().tobytes()[:16]) + 2
    assert at > item_off + 2
    flipped(datafile, os.path.join(f, dname), at, 0x20)
    add(Case("dcp_flip_data_verify", "dcp", f, LoadError, "read", os.path.join(f, dname), KEY, ("checksum mismatch",), {"checksums": True}))
    names = [c.name for c in cases]
    assert len(names) == len(set(names)), "duplicate case names"
    return cases


def _torch_record_name(path: str, key: str) -> str:
    """The zip record (``data/<n>``) holding ``key``'s storage in a torch.save file."""
    from sdadapt.sources import open_source

    with open_source(path) as src:
        ptr = src._tensors[key].untyped_storage().data_ptr()  # type: ignore[attr-defined]
        by_ptr = sorted((t.untyped_storage().data_ptr(), k) for k, t in src._tensors.items())  # type: ignore[attr-defined]
    # storages are laid out in record order data/0, data/1, ... (one per tensor here)
    order = [k for _, k in by_ptr]
    with zipfile.ZipFile(path) as z:
        recs = sorted(
            (z.getinfo(n).header_offset, n) for n in z.namelist() if n.split("/")[-2:-1] == ["data"]
        )
    return "/" + recs[order.index(key)][1].split("/", 1)[1] if ptr else ""


BOUND_S = 20.0  # generous on a shared 2-core machine; a hang would be the launch timeout


# --------------------------------------------------------------------------------------------
# model state
# --------------------------------------------------------------------------------------------
def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def all_meta(model: nn.Module) -> bool:
    return all(_local(t).is_meta for t in (*model.parameters(), *model.buffers()))


def model_snapshot(model: nn.Module) -> dict[str, tuple[torch.Tensor, int]]:
    return {k: (_local(v).detach().clone(), _local(v).data_ptr()) for k, v in model.state_dict().items()}


def model_unchanged(model: nn.Module, snap: dict[str, tuple[torch.Tensor, int]]) -> bool:
    now = model_snapshot(model)
    return now.keys() == snap.keys() and all(
        now[k][0].dtype == snap[k][0].dtype
        and torch.equal(now[k][0].view(torch.uint8), snap[k][0].view(torch.uint8))
        and now[k][1] == snap[k][1]
        for k in snap
    )


def make_corpus_model(mesh: Any, meta: bool) -> nn.Module:
    if meta:
        model = corpus_model("meta")
    else:
        torch.manual_seed(7)
        model = corpus_model("cpu")
    return parallelize(model, mesh) if mesh is not None else model


def state_problems(got: dict[str, Any], label: str, where: str) -> list[str]:
    """The model after a failed load: unchanged, or (``/real``: written in place) partly
    overwritten, said so in the error and marked; never changed silently."""
    in_place = label.endswith("/real")
    if in_place and got["marked"] and "partly overwritten" in got["message"]:
        return []  # (possibly still unchanged: the read may have failed before its first write)
    if got["unchanged"] and not got["marked"]:
        return []
    return [f"{where}: the model changed (marked: {got['marked']}): {got.get('message', '')[:400]}"]
