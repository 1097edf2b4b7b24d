"""kernels/logprobs.py's host side: row_logprobs' rows turned into what a request's output
holds (per token: its logprob, {id: logprob} of its top n), the reference's values and order."""

from __future__ import annotations

import math

import torch

from outpace.kernels.logprobs import logprob_lists, row_logprobs, token_logprobs


def test_rows_become_each_tokens_logprob_and_its_top_n():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g) * 3
    tokens = torch.tensor([3, 0, 49, 7])
    rows = row_logprobs(logits, tokens, 20).numpy()
    lp = torch.log_softmax(logits, dim=-1)
    for n in (0, 1, 5, 20):
        got = token_logprobs(logprob_lists(rows, 20 if n == 0 else n), n)
        assert len(got) == 4
        for r, (chosen, top) in enumerate(got):
            assert math.isclose(chosen, lp[r, tokens[r]].item(), rel_tol=1e-6)
            want = lp[r].topk(n)
            assert list(top) == want.indices.tolist()  # best first
            assert all(math.isclose(top[i], v, rel_tol=1e-6)
                       for i, v in zip(want.indices.tolist(), want.values.tolist()))


def test_a_batch_converted_for_its_largest_n_serves_smaller_ones():
    logits = torch.randn(2, 3, 30)
    rows = row_logprobs(logits.view(6, 30), torch.zeros(6, dtype=torch.long), 20)
    lists = logprob_lists(rows.view(2, 3, 41).numpy(), 5)  # one conversion, [2][3][11]
    assert len(lists) == 2 and len(lists[0]) == 3 and len(lists[0][0]) == 11
    alone = token_logprobs(logprob_lists(rows[:3].numpy(), 2), 2)
    assert token_logprobs(lists[0], 2) == alone


def test_a_vocabulary_smaller_than_n_gives_every_id():
    logits = torch.randn(2, 7)
    rows = row_logprobs(logits, torch.tensor([1, -1]), 7).numpy()  # top = the vocabulary
    got = token_logprobs(logprob_lists(rows, 20), 20)
    lp = torch.log_softmax(logits, dim=-1)
    for r, (_, top) in enumerate(got):
        assert len(top) == 7 and sorted(top) == list(range(7))
        assert all(math.isclose(v, lp[r, i].item(), rel_tol=1e-6) for i, v in top.items())
