"""Sampling as a race keyed by (seed, position): the same token whichever step computes it.

A random row draws token argmax_v(logit_v + G_v), G_v = -log(-log u_v) Gumbel noise (the
exponential race argmax(p_v / E_v) in log space: no softmax is needed), which picks v with
probability softmax(logits)_v. Here u_v is not drawn from a generator's stream but is a hash of
(the request's seed, the position of the token being sampled, v). So:

* a request's token at position p depends only on its seed, its prefix and p: not on which other
  requests share the batch, on which path (eager, or a CUDA graph) ran the step, or on whether
  the step verified drafts. A seeded request gives the same tokens with speculation as without.
* verification of drafts needs no rejection sampling: the target's token at each position is its
  race winner, and a draft is accepted when it equals it (strict prefix match, as for greedy).
  The winner at p uses noise keyed by p alone, independent of the drafts (which are functions of
  the prefix), so every emitted token is an exact sample of the target's distribution, and a
  deterministic draft d is accepted with probability p(d), as rejection sampling would.
* everything is tensor arithmetic of fixed shapes, so it runs inside a captured CUDA graph with
  per-row seeds and positions read from device buffers.

The hash (kernels/argmax.py's hash32) works on 32-bit words, held in int64 by the reference
(every product stays below 2^63: no overflow) and as uint32 by the kernel: the keys are
bit-identical on every device; u has 23 random bits, (x + 0.5) / 2^23, never 0 or 1.
"""

from __future__ import annotations

from typing import Optional

import torch

from outpace.kernels import use_triton
from outpace.kernels.argmax import GOLDEN, M32, Race, argmax_rows, gumbel_noise, hash32, race_key
from outpace.sample.logits_processing import apply_sampling_params

__all__ = ["gumbel_noise", "masked_race_tokens", "race_key", "race_tokens", "seed_word"]


def seed_word(seed: int) -> int:
    """A Python int seed of any size -> the 32-bit word the race keys start from."""
    s = int(seed) & ((1 << 64) - 1)
    return hash32((s & M32) ^ hash32(((s >> 32) + GOLDEN) & M32))


def race_tokens(logits: torch.Tensor, seed_words: torch.Tensor, positions: torch.Tensor,
                temperature: Optional[torch.Tensor] = None, pos_offset: int = 0) -> torch.Tensor:
    """[R, V] logits (processed: masked entries -inf), [R] int64 seed words (-1: a greedy row)
    and [R] positions of the tokens sampled (+ pos_offset) -> [R] int64 tokens: each row with a
    word a draw from softmax(row / temperature) (temperature [R], or already applied when None),
    argmax(row / temperature + gumbel_noise(race_key(word, position))); a greedy row its plain
    argmax. One fused Triton op on CUDA (kernels/argmax.py), tensors elsewhere. A row whose
    entries are all -inf but one draws that one."""
    return argmax_rows(logits, race=Race(seed_words, positions, temperature, pos_offset))


def masked_race_tokens(logits: torch.Tensor, seed_words: torch.Tensor, positions: torch.Tensor,
                       temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       min_p: torch.Tensor, pos_offset: int = 0) -> torch.Tensor:
    """race_tokens over each row's top-k / top-p / min-p nucleus, with per-row [R] values
    (effective_params': 1, 0, 1, 0 are no-ops; a greedy row, word -1, takes its argmax).
    On CUDA without materialising the masks (kernels/masked_gumbel.py: no sort; every CUDA path
    samples masked rows there, so eager steps and graphs agree); elsewhere the reference,
    race_tokens(apply_sampling_params(...)) (they may differ only for a token whose mass ranked
    above it lies within float32 rounding of top_p: the two sum in different orders)."""
    if use_triton(logits) and logits.dim() == 2:
        from outpace.kernels.masked_gumbel import masked_race_triton
        return masked_race_triton(logits, seed_words, positions, temperature, top_k, top_p,
                                  min_p, pos_offset)
    processed = apply_sampling_params(logits.to(torch.float32), temperature, top_k, top_p, min_p)
    return race_tokens(processed, seed_words, positions, pos_offset=pos_offset)
