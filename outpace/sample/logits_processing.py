"""Logits processing: penalties, temperature, top-k, top-p, min-p.

Order (vLLM's): repetition penalty, frequency and presence penalties, temperature, then the
top-k, top-p and min-p masks (masked entries become -inf). Greedy rows get the penalties only:
their argmax is the greedy token, and a temperature or mask would not change it.

Everything is vectorised over rows; the only Python loops run over rows and history tokens to
build small index tensors (host data the caller already holds), never over the vocabulary.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from outpace.types import SamplingParams

# Temperatures below this are greedy (as vLLM): dividing by them only overflows the logits.
SAMPLING_EPS = 1e-5


@dataclass
class SamplingRow:
    """One logits row to be sampled or verified."""

    params: SamplingParams
    history: Sequence[int] = ()  # prompt + output tokens before this position
    prompt_len: int = 0  # history[:prompt_len] is prompt (repetition penalty only)
    # the request's seed (SamplingParams.seed, or one the engine drew for it); None: the
    # sampler draws one for this call. The row samples the token at position len(history).
    seed: Optional[int] = None

    @property
    def is_greedy(self) -> bool:
        return self.params.temperature < SAMPLING_EPS


def process_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """[N, V] raw logits -> [N, V] float32 processed logits (a new tensor; the input is kept)."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits {tuple(logits.shape)} must be [len(rows)={len(rows)}, vocab]")
    out = logits.to(torch.float32, copy=True)  # [N, V]
    out = apply_penalties(out, rows)
    if all(r.is_greedy for r in rows):
        return out
    temps, top_k, top_p, min_p = zip(*(effective_params(r.params) for r in rows))
    dev = out.device

    def col(values, dtype=torch.float32):
        return torch.tensor(values, dtype=dtype, device=dev)
    # Masks only when a row asks for them; a mask that keeps everything is an exact no-op, so
    # this equals apply_sampling_params with every mask on (what a captured graph runs).
    return apply_sampling_params(
        out, col(temps), col(top_k, torch.long), col(top_p), col(min_p),
        top_k_top_p=any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p),
        use_min_p=any(m > 0.0 for m in min_p))


def effective_params(params: SamplingParams) -> tuple:
    """(temperature, top_k, top_p, min_p) as process_logits applies them: a greedy row's
    are no-ops (its argmax is the greedy token whatever they are)."""
    if params.temperature < SAMPLING_EPS:
        return 1.0, 0, 1.0, 0.0
    return float(params.temperature), int(params.top_k), float(params.top_p), float(params.min_p)


def apply_sampling_params(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                          top_p: torch.Tensor, min_p: torch.Tensor, *, top_k_top_p: bool = True,
                          use_min_p: bool = True) -> torch.Tensor:
    """Temperature, then the top-k / top-p masks, then min-p, over [N, V] float32 logits with
    per-row [N] values (effective_params: 1, 0, 1, 0 are no-ops). Fixed shapes and no host
    reads: CUDA graphs capture it with the values in device buffers. A new tensor."""
    out = logits / temperature.unsqueeze(1)
    row_max = None
    if top_k_top_p:
        out, row_max = apply_top_k_top_p(out, top_k, top_p, with_max=True)
    if use_min_p:
        out = apply_min_p(out, min_p, row_max)
    return out


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Repetition (prompt + output), frequency and presence (output only) penalties.

    logits: [N, V] float32, modified in place for the rows that have penalties, and returned.
    """
    idx = [i for i, r in enumerate(rows) if r.params.needs_penalties]
    if not idx:
        return logits
    dev = logits.device
    n, vocab = len(idx), logits.shape[1]
    sub_rows = [rows[i] for i in idx]
    # Flat (row, token) pairs: one scatter builds the whole [n, V] table, no padding needed.
    seen_flat = _flat_indices([r.history for r in sub_rows], vocab, dev)  # [total]
    out_flat = _flat_indices([r.history[r.prompt_len:] for r in sub_rows], vocab, dev)
    seen = torch.zeros(n * vocab, dtype=torch.bool, device=dev)
    seen[seen_flat] = True
    counts = torch.zeros(n * vocab, dtype=torch.float32, device=dev)
    counts.scatter_add_(0, out_flat, torch.ones_like(out_flat, dtype=torch.float32))
    seen, counts = seen.view(n, vocab), counts.view(n, vocab)

    def col(values):  # [n, 1]
        return torch.tensor(values, dtype=torch.float32, device=dev).unsqueeze(1)

    rep = col([r.params.repetition_penalty for r in sub_rows])
    freq = col([r.params.frequency_penalty for r in sub_rows])
    pres = col([r.params.presence_penalty for r in sub_rows])
    row_idx = torch.tensor(idx, dtype=torch.long, device=dev)
    sub = penalize(logits.index_select(0, row_idx), seen, counts, rep, freq, pres)  # [n, V]
    logits.index_copy_(0, row_idx, sub)
    return logits


def penalize(logits: torch.Tensor, seen: torch.Tensor, counts: torch.Tensor,
             rep: torch.Tensor, freq: torch.Tensor, pres: torch.Tensor) -> torch.Tensor:
    """The penalties over dense tables: logits [n, V] float32; seen [n, V] bool (in the prompt
    or the output so far), counts [n, V] float32 (occurrences in the output so far); rep,
    freq, pres [n, 1] float32. A new tensor. Penalties of 1, 0, 0 leave a row bit for bit as it
    was, so a captured graph applies this to every row (runner/fused_penalties.py)."""
    # Repetition as HF/vLLM: push seen tokens towards zero-probability in both signs.
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    out = torch.where(seen, penalised, logits)
    return out - freq * counts - pres * (counts > 0).to(torch.float32)


def _flat_indices(histories, vocab: int, device) -> torch.Tensor:
    """row-major flat indices row * vocab + token over every token of every history; [total]."""
    lens = [len(h) for h in histories]
    toks = torch.tensor(list(itertools.chain.from_iterable(histories)), dtype=torch.long)
    if toks.numel() and (int(toks.min()) < 0 or int(toks.max()) >= vocab):
        raise ValueError(f"history holds a token id outside the vocabulary [0, {vocab})")
    row = torch.repeat_interleave(torch.arange(len(histories)),
                                  torch.tensor(lens, dtype=torch.long))
    return (row * vocab + toks).to(device)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      with_max: bool = False):
    """Mask all but the top_k logits, then all but the smallest top-p nucleus of what is left.

    logits [N, V]; top_k [N] long (0: off); top_p [N] float (1: off). Ranks come from a stable
    sort, so exactly k tokens survive top-k even with ties (the lower ids win). Top-p keeps a
    token when the probability mass ranked strictly above it is < top_p (so the top-1 always
    stays), measured on the distribution renormalised after top-k. with_max: -> (masked, each
    row's maximum [N, 1]), the sort's first column (what min-p needs), which saves a graph
    torch's max over each row: a single-block reduction that one block walks alone.
    """
    vocab = logits.shape[1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True, stable=True)  # [N, V]
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)  # [1, V]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
    drop = ranks >= k.unsqueeze(1)  # [N, V] in sorted order
    probs = sorted_logits.masked_fill(drop, -math.inf).softmax(dim=-1)
    mass_above = probs.cumsum(dim=-1) - probs
    # top_p == 1 rows skip the test: rounding can push the cumulative mass to 1 before the tail.
    drop |= (mass_above >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    drop[:, 0] = False  # the top token stays whatever top_p is (a 0 would drop every token)
    mask = torch.empty_like(drop).scatter_(1, sorted_idx, drop)  # back to vocabulary order
    masked = logits.masked_fill(mask, -math.inf)
    return (masked, sorted_logits[:, :1]) if with_max else masked


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor,
                row_max: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Mask tokens whose probability is below min_p * p(top-1). logits [N, V]; min_p [N];
    row_max [N, 1]: each row's maximum when known (apply_top_k_top_p's).

    In log space p_i < min_p * p_max  <=>  l_i < l_max + log(min_p), which needs no softmax and
    is unchanged by earlier masks (they never remove the top-1). min_p = 0 gives -inf: no-op.
    """
    if row_max is None:
        row_max = logits.max(dim=-1, keepdim=True).values
    threshold = row_max + torch.log(min_p).unsqueeze(1)
    return logits.masked_fill(logits < threshold, -math.inf)
