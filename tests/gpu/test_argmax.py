"""Triton two-pass argmax vs torch.argmax on CUDA (exact: same index, ties to the first), with
and without the per-index offsets (EAGLE-3's d2t) added in the reduce kernel."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("triton")

from outpace.kernels.argmax import argmax_ref, argmax_rows, argmax_triton  # noqa: E402


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,vocab", [(1, 32000), (3, 4097), (7, 5), (16, 49152)])
def test_argmax_with_offsets(dtype, rows, vocab):
    """idx + offsets[idx] (EAGLE-3's d2t) in the reduce kernel: exact, ties to the first."""
    g = torch.Generator(device="cuda").manual_seed(rows + vocab)
    x = (torch.randn(rows, vocab, device="cuda", generator=g) * 4).to(dtype)
    top = x.max(dim=-1).values + 1
    x[:, vocab // 3] = top
    x[:, -1] = top
    if rows > 2:
        x[2] = top[2]  # one value everywhere: index 0
    offsets = (torch.randperm(vocab + 100, device="cuda", generator=g)[:vocab]
               - torch.arange(vocab, device="cuda"))
    idx = x.argmax(dim=-1)
    want = idx + offsets[idx]
    assert torch.equal(argmax_triton(x, offsets), want)
    assert torch.equal(argmax_rows(x, offsets), argmax_ref(x, offsets))
    assert torch.equal(argmax_rows(x), idx)  # without offsets: as before
    assert torch.equal(argmax_rows(x[None], offsets), want[None])  # leading dims


def test_argmax_with_offsets_in_a_cuda_graph():
    x = torch.randn(2, 32000, device="cuda", dtype=torch.bfloat16)
    offsets = torch.randint(0, 1000, (32000,), device="cuda")
    argmax_triton(x, offsets)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = argmax_triton(x, offsets)
    for seed in range(3):
        g = torch.Generator(device="cuda").manual_seed(seed)
        x.copy_(torch.randn(2, 32000, device="cuda", generator=g).to(x.dtype))
        offsets.copy_(torch.randint(0, 1000, (32000,), device="cuda", generator=g))
        graph.replay()
        idx = x.argmax(dim=-1)
        assert torch.equal(out, idx + offsets[idx])


@pytest.mark.parametrize("num_also", [1, 2])
def test_argmax_also_writes_into_columns_inside_a_graph(num_also):
    """The draft loop's argmax writes each draft into the step's output and carry columns
    (strided views) itself; in a graph, with new values every replay."""
    x = torch.randn(4, 32000, device="cuda", dtype=torch.bfloat16)
    offsets = torch.randint(-100, 100, (32000,), device="cuda")
    outs = [torch.full((4, 6), -7, dtype=torch.long, device="cuda") for _ in range(num_also)]
    also = tuple(o[:, 3] for o in outs)
    argmax_rows(x, offsets, also=also)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = argmax_rows(x, offsets, also=also)
    for seed in range(3):
        x.copy_(torch.randn(4, 32000, device="cuda", generator=torch.Generator(
            device="cuda").manual_seed(seed)).to(x.dtype))
        graph.replay()
        want = argmax_ref(x, offsets)
        assert torch.equal(got, want)
        for o in outs:
            assert torch.equal(o[:, 3], want)
            assert (o[:, [0, 1, 2, 4, 5]] == -7).all()
