"""argmax_rows on CPU (the reference path): extra outputs and their checks."""

from __future__ import annotations

import pytest
import torch

from outpace.kernels.argmax import argmax_rows


def test_also_receives_the_ids_with_offsets():
    x = torch.randn(3, 100, generator=torch.Generator().manual_seed(0))
    offsets = torch.arange(100) * 2
    wide = torch.zeros(3, 4, dtype=torch.long)
    got = argmax_rows(x, offsets, also=(wide[:, 1], wide[:, 3]))
    want = x.argmax(-1) * 3
    assert torch.equal(got, want)
    assert torch.equal(wide[:, 1], want) and torch.equal(wide[:, 3], want)
    assert (wide[:, [0, 2]] == 0).all()


def test_also_rejects_what_it_cannot_write():
    x = torch.randn(3, 10)
    with pytest.raises(ValueError, match="at most two"):
        argmax_rows(x, also=tuple(torch.zeros(3, dtype=torch.long) for _ in range(3)))
    with pytest.raises(ValueError, match=r"\[3\] int64"):
        argmax_rows(x, also=(torch.zeros(3, dtype=torch.int32),))
    with pytest.raises(ValueError, match=r"\[3\] int64"):
        argmax_rows(x, also=(torch.zeros(4, dtype=torch.long),))
    with pytest.raises(ValueError, match=r"\[R, V\]"):
        argmax_rows(x.view(1, 3, 10), also=(torch.zeros(3, dtype=torch.long),))
