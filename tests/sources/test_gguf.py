"""GGUF files as sources: every type bit-equal to gguf's own dequantization, per region; strict
errors naming the file and the tensor; the header parser fuzzed against gguf's writer."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.gguf_files import LISTED, dequantizable, oracle, write_gguf

from sdadapt.errors import SdadaptError, SourceError
from sdadapt.sources import _formats, _headers, open_source, recordable
from sdadapt.sources._gguf_header import GGML_TYPES, parse

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # random IQ blocks dequantize to NaN, in gguf too

FUZZ = settings(
    max_examples=int(os.environ.get("SDADAPT_FUZZ_EXAMPLES", "40")),
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's raw bits, so that NaNs compare equal where they are the same NaN."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _types() -> list[str]:
    return LISTED + [t for t in dequantizable() if t not in LISTED]


@pytest.fixture(scope="module")
def every_type(tmp_path_factory: pytest.TempPathFactory) -> str:
    rng = np.random.default_rng(0)
    tensors = {f"t.{q}.weight": (rng.standard_normal((6, 512)).astype(np.float32), q) for q in _types()}
    tensors["blk.0.ffn_down.weight"] = (rng.standard_normal((2, 3, 256)).astype(np.float32), "Q4_K")  # 3-d (experts)
    tensors["output_norm.weight"] = (rng.standard_normal(64).astype(np.float32), "F32")
    return write_gguf(tmp_path_factory.mktemp("gguf") / "every.gguf", tensors, {"general.name": "t"})


def test_the_table_claims_gguf_files() -> None:
    fmt = _formats.format_of_name("model-Q4_K_M.gguf")
    assert fmt is not None and fmt.name == "gguf" and fmt.recordable
    assert ".gguf" in _formats.WEIGHT_SUFFIXES and recordable("s3://b/m.gguf")


def test_the_tables_lazy_entry_agrees_with_the_modules_format(every_type: str) -> None:
    """The table declares GGUF without importing its reader; it is the reader's own ``FORMAT``."""
    from sdadapt.sources import _gguf_file

    lazy, own = _formats.format_of(every_type), _gguf_file.FORMAT
    assert lazy is not None and lazy is not own
    for field in ("name", "suffixes", "recordable", "folder_file", "members", "any_file"):
        assert getattr(lazy, field) == getattr(own, field), field
    assert lazy.claims(every_type) and own.claims(every_type) and not lazy.claims(every_type + ".json")
    size = os.path.getsize(every_type)
    assert list(lazy.header_ranges(every_type, size)) == list(own.header_ranges(every_type, size))
    assert lazy.config(every_type) == own.config(every_type)
    with lazy.open(every_type, None) as src, open_source(every_type) as other:
        assert isinstance(src, _gguf_file.GGUFFile) and src.schema.keys() == other.schema.keys()


def test_every_type_is_bit_equal_to_gguf_whole_and_per_region(every_type: str) -> None:
    ref = oracle(every_type)
    with open_source(every_type) as src:
        assert set(src.schema) == set(ref)
        for key, want in ref.items():
            info = src.schema[key]
            assert info.shape == tuple(want.shape) and info.dtype == want.dtype, key
            got = src.read(key, tuple((0, n) for n in info.shape))
            assert torch.equal(_bits(got), _bits(want)), f"{key} ({src.types[key]})"
            if want.dim() >= 2:  # a rank's region: some rows, columns cut inside a block
                box = (*((1, n) for n in want.shape[:-2]), (1, want.shape[-2]), (5, want.shape[-1] - 37))
                part = src.read(key, box)
                assert torch.equal(_bits(part), _bits(want[tuple(slice(a, b) for a, b in box)])), key


def test_a_region_reads_only_its_rows_blocks(every_type: str) -> None:
    with open_source(every_type) as src:
        info = src.schema["t.Q4_K.weight"]
        whole = src.region_bytes("t.Q4_K.weight", tuple((0, n) for n in info.shape))
        rows = src.region_bytes("t.Q4_K.weight", ((2, 4), (0, 512)))
        assert whole is not None and rows is not None
        assert sum(b - a for _, a, b in whole) == 6 * 2 * 144 and sum(b - a for _, a, b in rows) == 2 * 2 * 144
        cols = src.region_bytes("t.Q4_K.weight", ((0, 6), (300, 400)))  # the second block of each row
        assert cols is not None and [(b - a) for _, a, b in cols] == [144] * 6
        assert src.locate("t.F16.weight") is not None and src.locate("t.Q4_K.weight") is None


def test_the_header_is_recorded_and_replayed(every_type: str) -> None:
    with _headers.recording() as record:
        open_source(every_type).close()
    data, size = record.files[every_type]
    assert size == os.path.getsize(every_type) and 0 < len(data) < size
    with _headers.replaying(_headers.decode(_headers.encode(record))), open_source(every_type) as src:
        assert src.types["t.Q6_K.weight"] == "Q6_K"


def test_the_header_ranges_suffice_to_open_it(every_type: str, tmp_path: str) -> None:
    size = os.path.getsize(every_type)
    copy = os.path.join(tmp_path, "copy.gguf")
    with open(copy, "wb") as f:
        f.truncate(size)
    steps = 0
    for ranges in _formats.format_of_name(copy).header_ranges(copy, size):  # type: ignore[union-attr]
        steps += 1
        with open(every_type, "rb") as s, open(copy, "r+b") as d:
            for a, b in ranges:
                s.seek(a)
                d.seek(a)
                d.write(s.read(b - a))
    assert steps >= 1
    with open_source(copy) as src:
        assert len(src.schema) == len(oracle(every_type))


def _small(tmp_path: str, **meta: object) -> str:
    rng = np.random.default_rng(1)
    tensors = {
        "token_embd.weight": (rng.standard_normal((4, 64)).astype(np.float32), "F16"),
        "blk.0.attn_q.weight": (rng.standard_normal((64, 256)).astype(np.float32), "Q4_K"),
        "blk.1.attn_q.weight": (rng.standard_normal((64, 256)).astype(np.float32), "Q8_0"),
    }
    return write_gguf(os.path.join(tmp_path, "small.gguf"), tensors, meta, arch="llama")


def test_a_truncated_file_names_the_file_and_tensor(tmp_path: str) -> None:
    path = _small(tmp_path)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(SourceError, match=r"truncated GGUF file.*runs past the end") as e:
        open_source(path)
    assert e.value.path == path and e.value.key == "blk.1.attn_q.weight"
    with open(path, "r+b") as f:
        f.truncate(40)
    with pytest.raises(SourceError, match="truncated (or corrupt )?GGUF file"):
        open_source(path)


def _record_offset(data: bytes, name: str) -> int:
    """Where tensor ``name``'s record (its name's length) starts in the header bytes."""
    raw = name.encode()
    return data.index(struct.pack("<Q", len(raw)) + raw)


def test_an_unknown_type_is_refused_by_name(tmp_path: str) -> None:
    path = _small(tmp_path)
    data = bytearray(open(path, "rb").read())
    at = _record_offset(data, "blk.0.attn_q.weight") + 8 + len("blk.0.attn_q.weight") + 4 + 2 * 8
    assert struct.unpack_from("<I", data, at)[0] == 12  # Q4_K
    struct.pack_into("<I", data, at, 99)
    open(path, "wb").write(bytes(data))
    with pytest.raises(SourceError, match="ggml type 99, which sdadapt does not know") as e:
        open_source(path)
    assert e.value.key == "blk.0.attn_q.weight"


def test_a_type_gguf_cannot_dequantize_is_refused_by_name(tmp_path: str) -> None:
    # the test extra pins gguf 0.19.0, which has no Q8_K dequantization; a release that adds it
    # needs another undequantizable type here
    assert "Q8_K" not in dequantizable(), "the installed gguf dequantizes Q8_K: pick a type it cannot"
    rng = np.random.default_rng(2)
    tensors = {"a.weight": (rng.standard_normal((2, 256)).astype(np.float32), "F16"),
               "b.weight": (rng.standard_normal((2, 256)).astype(np.float32), "Q8_K")}  # fmt: skip
    path = write_gguf(os.path.join(tmp_path, "q8k.gguf"), tensors)
    with pytest.raises(SourceError, match="Q8_K-quantized, which the installed gguf package cannot dequantize") as e:
        open_source(path)
    assert e.value.key == "b.weight" and e.value.path == path


def test_metadata_that_disagrees_with_the_tensors_is_refused(tmp_path: str) -> None:
    with pytest.raises(SourceError, match=r"llama.block_count=3, the tensors hold blocks 0..1"):
        open_source(_small(tmp_path, **{"llama.block_count": 3}))
    with pytest.raises(SourceError, match=r"llama.embedding_length=32, the tensor's rows are 64 wide") as e:
        open_source(_small(tmp_path, **{"llama.block_count": 2, "llama.embedding_length": 32}))
    assert e.value.key == "token_embd.weight"
    with open_source(_small(tmp_path, **{"llama.block_count": 2, "llama.embedding_length": 64})) as src:
        assert src.metadata["llama.block_count"] == 2


def test_the_type_table_matches_gguf() -> None:
    for q, (block, size) in gguf.GGML_QUANT_SIZES.items():
        assert GGML_TYPES[int(q)] == (q.name, block, size)


_VALUES = st.one_of(
    st.integers(0, 2**32 - 1), st.floats(allow_nan=False, width=32), st.text(max_size=20), st.booleans(),
    st.lists(st.integers(-(2**31), 2**31 - 1), max_size=5), st.lists(st.text(max_size=5), max_size=5),
)  # fmt: skip


@FUZZ
@given(
    meta=st.dictionaries(st.from_regex(r"[a-z]{1,8}\.[a-z_]{1,8}", fullmatch=True), _VALUES, max_size=6),
    shapes=st.lists(st.tuples(st.integers(1, 3), st.sampled_from(["F32", "F16", "Q8_0", "Q4_K"])), min_size=1, max_size=4),
)
def test_fuzz_headers_gguf_writes_parse_as_gguf_reads_them(tmp_path_factory: pytest.TempPathFactory, meta: dict, shapes: list) -> None:
    path = str(tmp_path_factory.mktemp("fz") / "f.gguf")
    rng = np.random.default_rng(0)
    tensors = {f"t{i}.weight": (rng.standard_normal((rows, 256)).astype(np.float32), q) for i, (rows, q) in enumerate(shapes)}
    write_gguf(path, tensors, meta, arch="fuzz")
    data = open(path, "rb").read()
    head = parse(data, len(data), path)
    reader = gguf.GGUFReader(path)
    assert head.data_start == reader.data_offset
    for t in reader.tensors:
        rec = head.tensors[t.name]
        assert rec.shape == tuple(int(n) for n in reversed(t.shape.tolist())) and rec.type_id == int(t.tensor_type)
        assert head.data_start + rec.offset == t.data_offset
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert set(head.metadata) == set(fields)
    for key, want in fields.items():
        got = head.metadata[key]
        assert got == want or np.array_equal(np.float32(got), np.float32(want)), key


@FUZZ
@given(data=st.data())
def test_fuzz_headers_damaged_bytes_give_our_error(tmp_path_factory: pytest.TempPathFactory, data: st.DataObject) -> None:
    folder = tmp_path_factory.mktemp("dmg")
    path = _small(str(folder))
    raw = bytearray(open(path, "rb").read())
    head = parse(bytes(raw), len(raw), path)
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, head.header_end - 1))
        raw[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.one_of(st.none(), st.integers(0, len(raw))))
    if cut is not None:
        raw = raw[:cut]
    with open(path, "wb") as f:
        f.write(bytes(raw))
    try:
        parse(bytes(raw[: data.draw(st.integers(0, len(raw)))]), len(raw), path)
    except (SourceError, EOFError):
        pass
    try:
        with open_source(path) as src:
            for key, info in src.schema.items():
                src.read(key, tuple((0, n) for n in info.shape))
    except SdadaptError:
        pass
