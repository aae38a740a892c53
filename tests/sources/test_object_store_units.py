"""The pieces of object storage reading that need no server: URLs, byte runs of a region,
coalescing, the settings, the missing-extra error, AWS profiles. (The real server's tests are
in test_object_store.py.)"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sdadapt.errors import SourceError
from sdadapt.sources._object_store import FetchSettings, _merge, _profile_keys, _subtract, is_url, make_store, split_url
from sdadapt.sources._remote import box_runs


def test_urls() -> None:
    assert is_url("s3://b/p") and is_url("gs://b") and not is_url("hf://a/b") and not is_url("/tmp/s3://x")
    assert split_url("s3://bucket/a/b/") == ("s3", "bucket", "a/b")
    for bad in ("s3://", "s3:///x", "s3://b/../x"):
        with pytest.raises(SourceError, match="not an object storage URL"):
            split_url(bad)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.data())
def test_box_runs_are_exactly_the_region_bytes(shape: list[int], data: st.DataObject) -> None:
    box = []
    for n in shape:
        a = data.draw(st.integers(0, n - 1))
        box.append((a, data.draw(st.integers(a + 1, n))))
    t = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.int16).reshape(shape)
    raw = t.reshape(-1).view(torch.uint8)
    runs = box_runs(tuple(shape), 2, tuple(box))
    got = torch.cat([raw[s : s + n] for s, n in runs]).view(torch.int16)
    want = t[tuple(slice(a, b) for a, b in box)].reshape(-1)
    assert torch.equal(got, want)
    assert all(s1 + n1 < s2 for (s1, n1), (s2, _) in zip(runs, runs[1:], strict=False))  # sorted, not touching


def test_box_runs_of_many_rows_become_one_span() -> None:
    runs = box_runs((10000, 8), 1, ((0, 10000), (2, 4)))
    assert runs == [(2, 9999 * 8 + 2)]


def test_coalescing_and_what_is_missing() -> None:
    assert _merge([(10, 20), (0, 5), (25, 30)], 5) == [(0, 30)]
    assert _merge([(10, 20), (0, 5), (26, 30)], 5) == [(0, 20), (26, 30)]
    assert _subtract([(0, 100)], [(10, 20), (50, 200)]) == [(0, 10), (20, 50)]
    assert _subtract([(0, 10), (20, 30)], [(0, 10)]) == [(20, 30)]


def test_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SDADAPT_REMOTE_GAP_BYTES", "0")
    monkeypatch.setenv("SDADAPT_REMOTE_CONCURRENCY", "4")
    s = FetchSettings()
    assert (s.gap_bytes, s.concurrency, s.request_bytes) == (0, 4, 8 << 20)
    monkeypatch.setenv("SDADAPT_REMOTE_CONCURRENCY", "0")
    with pytest.raises(SourceError, match="SDADAPT_REMOTE_CONCURRENCY='0'"):
        FetchSettings()


def test_a_missing_client_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "obstore", None)
    with pytest.raises(SourceError, match=r"pip install 'sdadapt\[s3\]'"):
        make_store("s3://bucket/x", None)
    with pytest.raises(SourceError, match=r"pip install 'sdadapt\[gcs\]'"):
        make_store("gs://bucket/x", None)


def test_profile_keys_are_read_and_never_logged(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    creds = tmp_path / "credentials"
    creds.write_text("[work]\naws_access_key_id = AKIAEXAMPLE\naws_secret_access_key = s3cr3t-value\n")
    config = tmp_path / "config"
    config.write_text("[profile work]\nregion = eu-west-3\n")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    monkeypatch.setenv("AWS_PROFILE", "work")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    keys = _profile_keys("s3", {})
    assert keys == {"access_key_id": "AKIAEXAMPLE", "secret_access_key": "s3cr3t-value", "region": "eu-west-3"}
    assert _profile_keys("s3", {"access_key_id": "given"}) == {}
    monkeypatch.setenv("AWS_PROFILE", "other")
    assert _profile_keys("s3", {}) == {}
    assert "s3cr3t" not in caplog.text


def test_a_bad_option_names_the_keys_not_the_values() -> None:
    pytest.importorskip("obstore", reason="the test extra installs obstore")
    with pytest.raises(SourceError) as e:
        make_store("s3://bucket/x", {"no_such_option": "s3cr3t-value"})
    assert "no_such_option" in str(e.value) and "s3cr3t" not in str(e.value)


def test_the_request_size_and_concurrency_follow_the_measurements() -> None:
    from sdadapt.sources._fetching import DEFAULT_CONCURRENCY, DEFAULT_REQUEST, MiB, choose

    # S3 across a region: 50 ms to the first byte, 90 MB/s a stream, a 10 GiB share
    f = choose(0.05, 90e6, 10 << 30)
    assert f.request_bytes == 32 * MiB  # 4 * L * B = 18 MB, up to a power of two
    assert f.concurrency == 48  # 4 GiB/s at 90 MB/s a stream
    # a local server: 2 ms, 400 MB/s: small requests suffice, fewer streams
    f = choose(0.002, 400e6, 10 << 30)
    assert (f.request_bytes, f.concurrency) == (4 * MiB, 11)
    # clamped: 64 MiB and 64 streams at most; 1 MiB and 4 streams at least
    assert (choose(1.0, 10e6, 100 << 30).request_bytes, choose(1.0, 10e6, 100 << 30).concurrency) == (64 * MiB, 64)
    assert (choose(1e-5, 5e9, 10 << 30).request_bytes, choose(1e-5, 5e9, 10 << 30).concurrency) == (MiB, 4)
    # a small share: smaller requests, so that every stream has work; no more streams than requests
    f = choose(0.05, 90e6, 64 * MiB)
    assert (f.request_bytes, f.concurrency) == (MiB, 48)
    assert choose(0.05, 90e6, 3 * MiB).concurrency == 3
    # nothing measured: the defaults
    assert (choose(None, None, 10 << 30).request_bytes, choose(None, None, 10 << 30).concurrency) == (DEFAULT_REQUEST, DEFAULT_CONCURRENCY)


class _Object:
    """A stand-in for a Remote holding one object (the real one is tested against SeaweedFS in
    test_object_store.py): its bytes, the requests made, the probes' kept blocks."""

    def __init__(self, data: bytes, kept: list[tuple[int, int]]):
        self.data = data
        self.asked: list[tuple[int, int]] = []
        self.kept = [(a, b, data[a:b]) for a, b in kept]

    def get_range(self, name: str, start: int, stop: int) -> bytes:
        self.asked.append((start, stop))
        return self.data[start:stop]

    def kept_blocks(self, name: str, start: int, stop: int) -> list[tuple[int, int, bytes]]:
        return [k for k in self.kept if k[0] < stop and k[1] > start]


def test_ranges_land_packed_in_memory_joined_by_the_gap_and_taken_from_the_probes() -> None:
    from sdadapt.sources._fetching import ObjectFile

    data = bytes(range(256)) * 4
    obj = _Object(data, kept=[(100, 140)])
    segments = [(0, 10), (20, 10), (100, 50), (600, 8)]
    mem = torch.zeros(5 + 78, dtype=torch.uint8)
    requests, fetched = ObjectFile(obj, "x").read_into(segments, mem, 5, gap=10)  # type: ignore[arg-type]
    want = b"".join(data[a : a + n] for a, n in segments)
    assert bytes(mem[5:].tolist()) == want and mem[:5].sum() == 0
    # (0, 30) joined across a 10-byte gap; (100, 150) less the probe's (100, 140); (600, 608) alone
    assert obj.asked == [(0, 30), (140, 150), (600, 608)]
    assert (requests, fetched) == (3, 30 + 10 + 8)


@pytest.mark.skipif(sys.platform == "win32", reason="mirrors are locked with flock, which Windows lacks; there they go at exit only")
def test_mirrors_left_by_ended_processes_go_and_live_ones_stay(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that ends without its exit handlers (killed, or a fork leaving with os._exit)
    leaves its mirror folder behind; the next mirror made on the machine removes it, and never
    the mirror of a process still alive."""
    from sdadapt.sources import _mirrors as store

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def child(stay: bool) -> tuple[int, str]:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child makes a mirror, says where, and leaves (or waits to be killed)
            os.close(r)
            root = store.new_mirror("sdadapt-mirror-s3-b-")
            Path(root, "model.safetensors").write_bytes(b"x" * 10)
            os.write(w, root.encode() + b"\n")
            if stay:
                time.sleep(60)
            os._exit(0)
        os.close(w)
        with os.fdopen(r) as f:
            return pid, f.readline().strip()

    ended, left = child(stay=False)
    os.waitpid(ended, 0)
    assert Path(left, "model.safetensors").exists() and Path(f"{left}.lock").exists()
    alive, live = child(stay=True)  # its mirror's making removes the one left behind
    try:
        assert not Path(left).exists() and not Path(f"{left}.lock").exists()
        mine = store.new_mirror("sdadapt-mirror-s3-b-")
        assert Path(live, "model.safetensors").read_bytes() == b"x" * 10
        store.drop_mirror(mine)
        assert not Path(mine).exists() and not Path(f"{mine}.lock").exists()
    finally:
        os.kill(alive, 9)
        os.waitpid(alive, 0)
