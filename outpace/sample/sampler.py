"""Token sampling: greedy, random (a race keyed by the request's seed and the position), logprobs.

Random rows race (sample/gumbel.py): token argmax(processed + Gumbel noise), the noise a hash of
the row's seed, the position of the token it samples and the vocabulary id. No cumulative sum,
no host sync, and a request's tokens depend only on its seed and its own history, not on which
other requests share the batch, where it sits in it, or whether the step verified drafts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from outpace.sample.logits_processing import (SamplingRow, apply_penalties, effective_params,
                                              process_logits)
from outpace.sample.gumbel import masked_race_tokens, race_tokens, seed_word

__all__ = ["Sampler", "SamplerOutput", "SamplingRow", "probs_from_processed", "process_logits"]


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [N] long
    processed_logits: torch.Tensor  # [N, V] float32, after penalties, temperature and masks
    logprobs: Optional[torch.Tensor] = None  # [N] float32, logprob of the chosen token
    top_logprob_ids: Optional[torch.Tensor] = None  # [N, n] long, by logprob descending
    top_logprobs: Optional[torch.Tensor] = None  # [N, n] float32


def probs_from_processed(processed: torch.Tensor) -> torch.Tensor:
    """[N, V] processed logits -> [N, V] probabilities (masked entries are exactly 0)."""
    return torch.softmax(processed.to(torch.float32), dim=-1)


class Sampler:
    """Turns logits rows into tokens (and logprobs).

    logprobs_mode "raw" (vLLM's default): log_softmax of the logits as the model produced them,
    before penalties, temperature and masks. "processed": log_softmax of the processed logits.
    """

    def __init__(self, seed: Optional[int] = None, logprobs_mode: str = "raw"):
        if logprobs_mode not in ("raw", "processed"):
            raise ValueError(f"logprobs_mode must be 'raw' or 'processed', got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode
        # seeds for rows that come without one (seed None: non-deterministic, as an unseeded
        # request should be)
        self._rng = random.Random(seed)

    def seed_for_unseeded(self) -> int:
        return self._rng.getrandbits(63)

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
                 num_logprobs: Optional[int] = 0) -> SamplerOutput:
        """logits [N, V] -> tokens [N]; num_logprobs None skips logprobs, 0 gives only the
        chosen token's, n > 0 also the top-n."""
        processed = process_logits(logits, rows)  # [N, V]
        token_ids = self.sample(logits, rows)  # [N]
        out = SamplerOutput(token_ids=token_ids, processed_logits=processed)
        if num_logprobs is not None:
            source = logits if self.logprobs_mode == "raw" else processed
            logprobs = torch.log_softmax(source.to(torch.float32), dim=-1)  # [N, V]
            out.logprobs = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
            n = min(num_logprobs, logprobs.shape[1])
            if n > 0:
                vals, ids = logprobs.topk(n, dim=-1, largest=True, sorted=True)
                out.top_logprobs, out.top_logprob_ids = vals, ids
        return out

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """[N, V] logits -> [N] long tokens: a greedy row's argmax (after penalties), a random
        row's race at position len(row.history) with its seed (or one drawn for it), over its
        processed logits: masked_race_tokens when a row asks for top-k, top-p or min-p (on CUDA
        the kernel a masked graph runs, so eager steps and graphs draw the same tokens), else
        race_tokens with the temperature (the kernel a sampled graph runs)."""
        penalized = apply_penalties(logits.to(torch.float32, copy=True), rows)
        if all(r.is_greedy for r in rows):
            return penalized.argmax(dim=-1)
        dev = penalized.device
        words = torch.tensor([-1 if r.is_greedy else
                              seed_word(r.seed if r.seed is not None else self.seed_for_unseeded())
                              for r in rows], dtype=torch.int64, device=dev)
        positions = torch.tensor([len(r.history) for r in rows], dtype=torch.int64, device=dev)
        temps, top_k, top_p, min_p = zip(*(effective_params(r.params) for r in rows))
        temps = torch.tensor(temps, dtype=torch.float32, device=dev)
        if any(r.params.needs_masks and not r.is_greedy for r in rows):
            return masked_race_tokens(
                penalized, words, positions, temps,
                torch.tensor(top_k, dtype=torch.int64, device=dev),
                torch.tensor(top_p, dtype=torch.float32, device=dev),
                torch.tensor(min_p, dtype=torch.float32, device=dev))
        return race_tokens(penalized, words, positions, temperature=temps)
