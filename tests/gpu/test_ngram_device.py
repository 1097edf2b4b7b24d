"""The device n-gram lookup (speculative/ngram_device.py) on CUDA: captured in a CUDA graph and
replayed over fresh histories and lengths written into its fixed input buffers, each replay
equal to NgramDrafter.propose row by row (the Triton kernel, kernels/ngram_lookup.py, and the
tensor-op reference with KernelOptions.ngram_lookup_kernel off); an eager call makes no host
sync; the kernel equals the reference on random CUDA inputs, eagerly and in a graph replayed
with new histories and lengths, in both its forms (returned outputs, the fused step's
StepOutputs)."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from outpace.kernels.ngram_lookup import (StepOutputs, ngram_lookup_triton,  # noqa: E402
                                          use_ngram_kernel)
from outpace.kernels.options import use_kernel_options  # noqa: E402
from outpace.runner.fused_ngram import step_drafts_ref  # noqa: E402
from outpace.runner_config import KernelOptions  # noqa: E402
from outpace.speculative.ngram_device import ngram_propose, ngram_propose_ref  # noqa: E402
from tests.speculative.test_ngram_device import batch, expected  # noqa: E402


def random_rows(rng: random.Random, count: int, width: int, vocab: int) -> list:
    rows = []
    for _ in range(count):
        if rng.random() < 0.5:  # repeated motifs: long matches that run into the end
            motif = [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
            rows.append((motif * width)[:rng.randint(0, width)])
        else:
            rows.append([rng.randrange(vocab) for _ in range(rng.randint(0, width))])
    return rows


@pytest.mark.parametrize("min_n,max_n,k,periodic", [(1, 4, 4, False), (2, 5, 7, True),
                                                    (3, 3, 1, False)])
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "reference"])
def test_graph_replay_matches_ngram_drafter(min_n, max_n, k, periodic, kernel):
    options = KernelOptions() if kernel else KernelOptions().ablate("ngram_lookup_kernel")
    with use_kernel_options(options):
        replay_matches_ngram_drafter(min_n, max_n, k, periodic, kernel)


def replay_matches_ngram_drafter(min_n, max_n, k, periodic, kernel):
    rng = random.Random(min_n * 10 + max_n)
    rows_n, width, vocab = 2048, 96, 4
    hist = torch.zeros(rows_n, width, dtype=torch.long, device="cuda")
    lengths = torch.zeros(rows_n, dtype=torch.long, device="cuda")
    assert use_ngram_kernel(hist) == kernel
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up before capture, as torch.cuda.graphs asks
        for _ in range(2):
            ngram_propose(hist, lengths, k, min_n, max_n, periodic)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        drafts, counts = ngram_propose(hist, lengths, k, min_n, max_n, periodic)
    for _replay in range(3):
        rows = random_rows(rng, rows_n, width, vocab)
        h, n = batch(rows, width, rng, vocab)
        hist.copy_(h)
        lengths.copy_(n)
        graph.replay()
        torch.cuda.synchronize()
        have = [d[:c] for d, c in zip(drafts.tolist(), counts.tolist())]
        want = expected(rows, k, min_n, max_n, periodic)
        bad = [(r, w, g) for r, w, g in zip(rows, want, have) if w != g]
        assert not bad, f"{len(bad)} rows differ; first: tokens, expected, got = {bad[0]}"
        assert not drafts[torch.arange(k, device="cuda") >= counts[:, None]].any()


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "reference"])
def test_no_host_sync(kernel):
    options = KernelOptions() if kernel else KernelOptions().ablate("ngram_lookup_kernel")
    rng = random.Random(5)
    rows = random_rows(rng, 256, 64, 3)
    h, n = batch(rows, 64, rng, 3)
    hist, lengths = h.cuda(), n.cuda()
    with use_kernel_options(options):
        assert use_ngram_kernel(hist) == kernel
        # the same call first, outside the check: lazy CUDA init, the kernel's compile
        ngram_propose(hist, lengths, 4, 1, 4, periodic=True)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            drafts, counts = ngram_propose(hist, lengths, 4, 1, 4, periodic=True)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    have = [d[:c] for d, c in zip(drafts.tolist(), counts.tolist())]
    assert have == expected(rows, 4, 1, 4, periodic=True)


def kernel_case(rng: random.Random, rows_n: int, width: int, vocab: int, dtype):
    """(history, lengths) on CUDA: random_rows' texts with stale ids past them, lengths 0, 1,
    2, the width, past it and below 0 (clamped) among them."""
    rows = random_rows(rng, rows_n, width, vocab)
    h, n = batch(rows, width, rng, vocab)
    n[:6] = torch.tensor([0, 1, 2, width, width + 9, -4])
    return h.to(dtype).cuda(), n.cuda()


@pytest.mark.parametrize("min_n,max_n,k,periodic", [(1, 4, 4, False), (2, 5, 7, True),
                                                    (3, 3, 1, False), (1, 8, 16, True)])
@pytest.mark.parametrize("width", [96, 8192])
def test_kernel_matches_reference(min_n, max_n, k, periodic, width):
    """ngram_lookup_triton equal to ngram_propose_ref on the same CUDA tensors (int32 and
    int64 histories, several blocks a row at the engine's width), and ngram_propose
    dispatching to it."""
    rng = random.Random(min_n + max_n * 7 + k + width)
    for dtype in (torch.int32, torch.long):
        hist, lengths = kernel_case(rng, 300, width, 3, dtype)
        want = ngram_propose_ref(hist, lengths, k, min_n, max_n, periodic)
        for got in (ngram_lookup_triton(hist, lengths, k, min_n, max_n, periodic),
                    ngram_propose(hist, lengths, k, min_n, max_n, periodic)):
            for a, b in zip(got, want):
                assert a.dtype == torch.long and torch.equal(a, b)
        assert want[1].sum() > 0


@pytest.mark.parametrize("step", [False, True], ids=["returned", "step-outputs"])
def test_kernel_graph_replay_matches_reference(step):
    """The kernel captured in a CUDA graph (returned outputs, or the fused step's StepOutputs
    into strided views of wider buffers), replayed over new histories and lengths copied into
    its input buffers: each replay equal to the reference run eagerly on the same inputs."""
    rng = random.Random(17 + step)
    rows_n, width, k, q, min_n, max_n = 64, 512, 5, 3, 1, 4
    hist = torch.zeros(rows_n, width + 1, dtype=torch.int32, device="cuda")  # + scratch
    lengths = torch.zeros(rows_n, dtype=torch.long, device="cuda")
    real = torch.ones(rows_n, dtype=torch.bool, device="cuda")
    packed = torch.full((rows_n, q + 1 + k), -7, dtype=torch.long, device="cuda")
    carry = torch.full((rows_n, k + 1), -7, dtype=torch.long, device="cuda")
    counts = torch.full((rows_n,), -7, dtype=torch.long, device="cuda")
    out = StepOutputs(carry[:, 1:], packed[:, q + 1:], counts, real, width) if step else None

    def lookup():
        return ngram_lookup_triton(hist[:, :width], lengths, k, min_n, max_n, step=out)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiled and warmed up before capture
        lookup()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        drafts, got_counts = lookup()
    for _replay in range(3):
        h, n = kernel_case(rng, rows_n, width, 4, torch.int32)
        hist[:, :width].copy_(h)
        lengths.copy_(n.clamp(0, width) if step else n)
        real.copy_(torch.rand(rows_n, device="cuda") < 0.8)
        graph.replay()
        if step:
            ref = StepOutputs(torch.zeros(rows_n, k, dtype=torch.long, device="cuda"),
                              torch.zeros(rows_n, k, dtype=torch.long, device="cuda"),
                              torch.zeros(rows_n, dtype=torch.long, device="cuda"), real, width)
            step_drafts_ref(hist[:, :width], lengths, k, min_n, max_n, ref)
            assert torch.equal(carry[:, 1:], ref.drafts) and torch.equal(counts, ref.counts)
            assert torch.equal(packed[:, q + 1:], ref.marked)
            assert (packed[:, :q + 1] == -7).all() and (carry[:, 0] == -7).all()
        else:
            want = ngram_propose_ref(hist[:, :width], lengths, k, min_n, max_n)
            assert torch.equal(drafts, want[0]) and torch.equal(got_counts, want[1])
        assert got_counts.sum() > 0
