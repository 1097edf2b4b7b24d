"""The device n-gram lookup (speculative/ngram_device.py) on CUDA: captured in a CUDA graph and
replayed over fresh histories and lengths written into its fixed input buffers, each replay
equal to NgramDrafter.propose row by row; an eager call makes no host sync."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from outpace.speculative.ngram_device import ngram_propose  # noqa: E402
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
def test_graph_replay_matches_ngram_drafter(min_n, max_n, k, periodic):
    rng = random.Random(min_n * 10 + max_n)
    rows_n, width, vocab = 2048, 96, 4
    hist = torch.zeros(rows_n, width, dtype=torch.long, device="cuda")
    lengths = torch.zeros(rows_n, dtype=torch.long, device="cuda")
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


def test_no_host_sync():
    rng = random.Random(5)
    rows = random_rows(rng, 256, 64, 3)
    h, n = batch(rows, 64, rng, 3)
    hist, lengths = h.cuda(), n.cuda()
    ngram_propose(hist, lengths, 4, 1, 4)  # first call outside the check (lazy CUDA init)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        drafts, counts = ngram_propose(hist, lengths, 4, 1, 4, periodic=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    have = [d[:c] for d, c in zip(drafts.tolist(), counts.tolist())]
    assert have == expected(rows, 4, 1, 4, periodic=True)
