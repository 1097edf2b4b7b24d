"""Rows for the masked race kernel (kernels/masked_gumbel.py), shared by the interpreter check and
the GPU test: every combination of temperature, top-k, top-p and min-p the engine passes,
greedy rows, ties (bf16-rounded and integer logits), -inf entries and a constant row; and the
comparison with the reference (race_tokens over apply_sampling_params' masks)."""

from __future__ import annotations

import math

import torch

# (temperature, top_k, top_p, min_p) per row, cycled; the last word of a row decides greedy
PARAMS = [(0.8, 0, 0.9, 0.0), (1.0, 0, 0.5, 0.0), (1.3, 50, 1.0, 0.0), (1.0, 1, 1.0, 0.0),
          (0.7, 20, 0.8, 0.0), (1.0, 0, 1.0, 0.05), (1.0, 0, 0.95, 0.1), (2.0, 5, 0.7, 0.02),
          (1.0, 0, 1.0, 0.0), (0.9, 0, 0.01, 0.0), (1.1, 7, 0.6, 0.0), (3.0, 0, 0.3, 0.0),
          (1.0, 10 ** 6, 0.9, 0.0), (0.5, 3, 1.0, 0.3),
          # most of a flat top-k set: the draw moves when the top-k mass is wrong
          (2.0, 20, 0.99, 0.0), (1.5, 40, 0.95, 0.0), (3.0, 30, 0.5, 0.0), (4.0, 60, 0.7, 0.0)]


def hard_logits(rows: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    """[rows, vocab] float32 logits at three scales; with 5+ rows, rows of ties everywhere, a
    cut vocabulary (-inf entries) and one value (the lowest ids win every tie)."""
    scale = torch.tensor([1.0, 3.0, 8.0])[torch.arange(rows) % 3].unsqueeze(1)
    logits = torch.randn(rows, vocab, generator=g) * scale
    if rows > 4:
        logits[2] = torch.randint(-3, 4, (vocab,), generator=g).float()  # ties everywhere
        logits[3, vocab // 3:] = -math.inf  # a cut vocabulary
        logits[4] = 1.5  # one value: the lowest ids win every tie
    return logits


def make_case(rows: int, vocab: int, seed: int, dtype=torch.float32):
    """-> (logits [rows, vocab], words, positions, temperature, top_k, top_p, min_p)."""
    g = torch.Generator().manual_seed(seed)
    logits = hard_logits(rows, vocab, g).to(dtype)
    params = [PARAMS[(i + seed) % len(PARAMS)] for i in range(rows)]
    temp, top_k, top_p, min_p = (torch.tensor(c) for c in zip(*params))
    words = torch.randint(0, 1 << 32, (rows,), generator=g)
    words[rows // 2] = -1  # a greedy row (its masks change nothing)
    positions = torch.randint(0, 1 << 20, (rows,), generator=g)
    return (logits, words, positions, temp.float(), top_k.long(), top_p.float(),
            min_p.float())


def reference(case, pos_offset: int = 0) -> torch.Tensor:
    from outpace.sample.logits_processing import apply_sampling_params
    from outpace.sample.gumbel import race_tokens
    logits, words, positions, temp, top_k, top_p, min_p = case
    processed = apply_sampling_params(logits.float(), temp, top_k, top_p, min_p)
    return race_tokens(processed, words, positions, pos_offset=pos_offset)


def near_a_boundary(case, row: int) -> bool:
    """Whether a token of `row` has its mass ranked above it within float32 summation error of
    top_p (of the top-k mass), or x within rounding of min-p's floor: where the kernel's sums
    and the sort's may decide differently."""
    logits, _, _, temp, top_k, top_p, min_p = (t[row] for t in case)
    x = logits.double() / float(temp)
    order = torch.sort(x, descending=True, stable=True).indices
    xs = x[order]
    k = int(top_k) if 0 < int(top_k) < len(xs) else len(xs)
    e = torch.exp(xs[:k] - xs[0])
    above = (torch.cumsum(e, 0) - e) / e.sum()
    near_p = float(top_p) < 1 and bool((above - float(top_p)).abs().min() < 1e-4)
    floor = xs[0] + math.log(float(min_p)) if float(min_p) > 0 else -math.inf
    near_min_p = bool((xs - floor).abs().min() < 1e-5)
    return near_p or near_min_p


def assert_matches_reference(got: torch.Tensor, case, pos_offset: int = 0) -> None:
    """Every row's token equals the reference's, but for rows where a boundary lies within
    rounding (at most 2% of them, and never a greedy row)."""
    want = reference(case, pos_offset)
    bad = (got.cpu() != want).nonzero().flatten().tolist()
    words = case[1]
    assert all(near_a_boundary(case, r) and words[r] >= 0 for r in bad), (bad, got, want)
    assert len(bad) <= max(1, len(want) // 50), (bad, got, want)
