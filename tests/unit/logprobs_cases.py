"""Rows for the logprobs kernel (kernels/logprobs.py), shared by the interpreter check and the
GPU test: the masked race's hard rows (several scales, rows of ties: the lower id first, a cut
vocabulary), tokens of -1 (past an accepted count); and the reference with that tie rule (a
stable sort; torch.topk orders ties as it likes)."""

from __future__ import annotations

import torch

from tests.unit.masked_gumbel_cases import hard_logits


def make_case(rows: int, vocab: int, seed: int, dtype=torch.float32):
    """-> (logits [rows, vocab] (masked_gumbel_cases.hard_logits), tokens [rows] int64, some
    -1)."""
    g = torch.Generator().manual_seed(seed)
    logits = hard_logits(rows, vocab, g)
    tokens = torch.randint(-1, vocab, (rows,), generator=g)
    return logits.to(dtype), tokens


def stable_ref(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> torch.Tensor:
    """row_logprobs_ref with ties in the top going to the lower id."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, tokens.clamp(0, lp.shape[1] - 1).view(-1, 1))
    values, ids = torch.sort(lp, dim=-1, descending=True, stable=True)
    return torch.cat([chosen, values[:, :top], ids[:, :top].to(torch.float32)], dim=1)


def check(got: torch.Tensor, want: torch.Tensor, top: int, tol: float = 1e-6) -> None:
    """Ids exactly, logprobs to float32 rounding (the kernel sums exp in another order)."""
    assert got.shape == want.shape and got.dtype == torch.float32, (got.shape, want.shape)
    assert torch.equal(got[:, 1 + top:], want[:, 1 + top:]), \
        (got[:, 1 + top:], want[:, 1 + top:])
    torch.testing.assert_close(got[:, :1 + top], want[:, :1 + top], rtol=tol, atol=tol)
