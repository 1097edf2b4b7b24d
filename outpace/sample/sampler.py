"""Token sampling: greedy, random (exponential race) with per-request seeds, and logprobs.

Random rows pick argmax(probs / E) with E ~ Exp(1) i.i.d. per vocabulary entry, which draws token
i with probability probs[i] / sum(probs) (the smallest of independent E_i / probs[i] is an
exponential race) without a cumulative sum or a host sync. A seeded request draws its noise row
from its own generator, so its tokens depend only on its seed and its own history, not on which
other requests share the batch or where it sits in it. Unseeded rows share one draw from the
sampler's default generator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from outpace.sample.logits_processing import SamplingRow, process_logits

__all__ = ["Sampler", "SamplerOutput", "SamplingRow", "draw_exponential", "make_generator",
           "probs_from_processed", "process_logits"]

# Exp(1) draws can round to 0.0 in float32; dividing by 0 would turn a masked (p = 0) entry into
# nan. Clamping to the smallest normal keeps p = 0 entries at 0 and never picks them.
_TINY = torch.finfo(torch.float32).tiny


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [N] long
    processed_logits: torch.Tensor  # [N, V] float32, after penalties, temperature and masks
    logprobs: Optional[torch.Tensor] = None  # [N] float32, logprob of the chosen token
    top_logprob_ids: Optional[torch.Tensor] = None  # [N, n] long, by logprob descending
    top_logprobs: Optional[torch.Tensor] = None  # [N, n] float32


def make_generator(seed: int, device="cpu") -> torch.Generator:
    """A per-request generator for SamplingParams.seed, on the device the logits live on."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def probs_from_processed(processed: torch.Tensor) -> torch.Tensor:
    """[N, V] processed logits -> [N, V] probabilities (masked entries are exactly 0)."""
    return torch.softmax(processed.to(torch.float32), dim=-1)


def draw_exponential(generators: Sequence[Optional[torch.Generator]], vocab: int, device,
                     default_generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """[len(generators), vocab] Exp(1) noise: each seeded row from its own generator, the
    unseeded rows in one draw from `default_generator` (torch's global RNG if None)."""
    noise = torch.empty(len(generators), vocab, dtype=torch.float32, device=device)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        block = torch.empty(len(unseeded), vocab, dtype=torch.float32, device=device)
        block.exponential_(generator=default_generator)
        noise[unseeded] = block
    for i, gen in enumerate(generators):
        if gen is not None:
            noise[i].exponential_(generator=gen)
    return noise.clamp_(min=_TINY)


class Sampler:
    """Turns logits rows into tokens (and logprobs).

    logprobs_mode "raw" (vLLM's default): log_softmax of the logits as the model produced them,
    before penalties, temperature and masks. "processed": log_softmax of the processed logits.
    """

    def __init__(self, seed: Optional[int] = None, logprobs_mode: str = "raw"):
        if logprobs_mode not in ("raw", "processed"):
            raise ValueError(f"logprobs_mode must be 'raw' or 'processed', got {logprobs_mode!r}")
        self.seed = seed
        self.logprobs_mode = logprobs_mode
        self._generators: dict = {}  # str(device) -> torch.Generator

    def default_generator(self, device) -> torch.Generator:
        """The generator unseeded rows draw from (one per device, created on first use)."""
        key = str(torch.device(device))
        gen = self._generators.get(key)
        if gen is None:
            gen = torch.Generator(device=device)
            if self.seed is None:
                gen.seed()  # non-deterministic, as an unseeded request should be
            else:
                gen.manual_seed(self.seed)
            self._generators[key] = gen
        return gen

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
                 num_logprobs: Optional[int] = 0) -> SamplerOutput:
        """logits [N, V] -> tokens [N]; num_logprobs None skips logprobs, 0 gives only the
        chosen token's, n > 0 also the top-n."""
        processed = process_logits(logits, rows)  # [N, V]
        token_ids = self.sample_processed(processed, rows)  # [N]
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

    def sample_processed(self, processed: torch.Tensor,
                         rows: Sequence[SamplingRow]) -> torch.Tensor:
        """[N, V] processed logits -> [N] long tokens: argmax for greedy rows, else a draw."""
        token_ids = processed.argmax(dim=-1)  # [N]
        rand = [i for i, r in enumerate(rows) if not r.is_greedy]
        if not rand:
            return token_ids
        dev = processed.device
        rand_idx = torch.tensor(rand, dtype=torch.long, device=dev)
        probs = probs_from_processed(processed.index_select(0, rand_idx))  # [R, V]
        noise = draw_exponential([rows[i].generator for i in rand], processed.shape[1], dev,
                                 self.default_generator(dev))
        token_ids[rand_idx] = (probs / noise).argmax(dim=-1)
        return token_ids
