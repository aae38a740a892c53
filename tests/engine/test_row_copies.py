"""The copies into and out of a row-sharing round's buffers (``_engine.blockcopy.copy_in_blocks``): equal to
``copy_`` bit for bit, in blocks small enough that torch runs each on the calling thread; and
``read_and_exchange``'s readers."""

from __future__ import annotations

import threading
from typing import cast

import pytest
import torch

from sdadapt._engine import blockcopy, share

CASES = {
    # (shape, dim cut, [start, stop), dtype): what each takes
    "down_proj slice, int64 view": ((64, 1024), 1, 256, 512, torch.bfloat16),
    "odd width, native dtype": ((37, 11), 1, 3, 6, torch.bfloat16),
    "even width, int32 view": ((50, 40), 1, 10, 20, torch.bfloat16),
    "fp32 piece": ((33, 24), 1, 6, 12, torch.float32),
    "rows wider than a block": ((3, 2, 70001), 2, 1, 70000, torch.bfloat16),
    "contiguous rows": ((300, 512), 0, 7, 290, torch.bfloat16),
    "3-d, inner dim cut": ((8, 9, 10), 1, 2, 5, torch.float16),
}


@pytest.mark.parametrize("case", list(CASES))
def test_copy_equals_copy_in_blocks(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    shape, dim, a, b, dtype = CASES[case]
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=g)
    x = x.view(dtype) if dtype.itemsize == 2 else torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, generator=g).view(dtype)
    src = x.narrow(dim, a, b - a)
    calls: list[int] = []
    real = torch.Tensor.copy_

    def counted(self: torch.Tensor, other: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        calls.append(self.numel())
        return real(self, other, non_blocking)

    dst = torch.full(src.shape, 0, dtype=dtype)
    monkeypatch.setattr(torch.Tensor, "copy_", counted)
    blockcopy.copy_in_blocks(dst, src)
    monkeypatch.undo()
    raw = lambda t: t.contiguous().view(-1).view(torch.uint8)  # noqa: E731 - bit for bit, NaN payloads too
    assert torch.equal(raw(dst), raw(src)), case
    assert calls and max(calls) < blockcopy.GRAIN, (case, max(calls))
    if case == "down_proj slice, int64 view":  # 4 bf16 values a block element: a quarter of the calls
        assert len(calls) <= -(-src.numel() // 4 // (blockcopy.GRAIN - 1)) + 1, len(calls)


def test_read_and_exchange_without_rows_needs_no_reader() -> None:
    """No rows: ``read_rows`` is None and only ``read_own`` runs, on this thread, no rounds thread."""
    seen: list[str] = []
    own, error, got = share.read_and_exchange(lambda: seen.append(threading.current_thread().name), [], None, 1 << 20)
    assert (own, error, got) == (None, None, 0)
    assert seen == [threading.current_thread().name]

    def fail() -> None:
        raise OSError("disk gone")

    own, error, got = share.read_and_exchange(fail, [], None, 1 << 20)
    assert isinstance(own, OSError) and error is None and got == 0


def test_read_and_exchange_rows_need_a_reader() -> None:
    rows = cast("list[share.RowShare]", [object()])  # refused before a row is looked at
    with pytest.raises(ValueError, match="read_rows"):
        share.read_and_exchange(lambda: None, rows, None, 1 << 20)
