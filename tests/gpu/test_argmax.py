"""Triton two-pass argmax vs torch.argmax on CUDA (exact: same index, ties to the first)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("triton")

from outpace.kernels.argmax import argmax_triton  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,vocab", [(1, 49152), (5, 49152), (3, 128256), (7, 1000),
                                        (2, 5), (64, 32000), (1, 2049)])
def test_argmax_matches_torch(dtype, rows, vocab):
    g = torch.Generator(device="cuda").manual_seed(rows * vocab)
    x = (torch.randn(rows, vocab, device="cuda", generator=g) * 4).to(dtype)
    # ties: the maximum again at a later and an earlier column, in different chunks
    top = x.max(dim=-1).values + 1
    x[:, vocab // 2] = top
    x[:, -1] = top
    if rows > 1:
        x[1] = top[1]  # a whole row of one value: index 0
    got = argmax_triton(x)
    assert torch.equal(got, x.argmax(dim=-1))
    assert torch.equal(got[0], torch.tensor(vocab // 2, device="cuda"))


def test_argmax_in_a_cuda_graph_sees_new_values():
    x = torch.randn(4, 49152, device="cuda", dtype=torch.bfloat16)
    argmax_triton(x)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = argmax_triton(x)
    for seed in range(3):
        x.copy_(torch.randn(4, 49152, device="cuda", generator=torch.Generator(
            device="cuda").manual_seed(seed)).to(x.dtype))
        graph.replay()
        assert torch.equal(out, x.argmax(dim=-1))


def test_argmax_of_nan_rows_is_in_range():
    x = torch.randn(3, 49152, device="cuda", dtype=torch.bfloat16)
    x[0] = float("nan")  # a whole row of NaN: index 0, as torch
    x[1, 777] = float("nan")  # NaN counts as the maximum
    got = argmax_triton(x)
    assert got.tolist()[:2] == [0, 777]
    assert torch.equal(got[2], x[2].argmax())
