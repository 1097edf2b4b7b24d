"""Draft verification (docs/design.md, "Verification and exactness"; vLLM's vocabulary).

One verify step of a request with k drafts d_0..d_{k-1} scores k+1 target positions: position i
holds the target's distribution for the token after d_{i-1} (position 0: after the committed
prefix). The step emits the accepted drafts, then exactly one more token:

    drafts      d0   d1   d2          accepted = 2 (d2 rejected)
    positions   p0   p1   p2   p3
    emitted     d0   d1   r2           r2 recovered at position 2;  all accepted -> bonus from p3

Greedy: d_i is accepted while it equals the target argmax (strict prefix match); the token at
the first mismatch (or the bonus) is the target argmax there. The engine verifies sampled
requests the same way, against each position's race winner (sample/gumbel.py): with the race
keyed by seed and position that is exact for deterministic drafts, which every drafter here
proposes (runner/sampling_step.py).
Sampling against a draft distribution q (a drafter that samples its drafts; no engine path
calls it, see decisions-log.md, "The race keyed by (seed, position)"): accept d_i with
probability min(1, p(d_i) / q(d_i)); on rejection draw from
norm(max(p - q, 0)). Then every emitted token is distributed exactly as the target alone would
draw it. Relaxed acceptance (opt-in, lossy) may also accept a draft inside a thinking span.

The *_batched functions use tensor ops only (no host reads of tensor values, no boolean-mask indexing), so
they run inside a CUDA graph; the random numbers come in as tensors (`draw_verify_randomness`
draws them per request, from each request's own generator, before the step).
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence, Union

import torch

from outpace.errors import ConfigError

_TINY = torch.finfo(torch.float32).tiny


def _accepted_prefix(accept: torch.Tensor) -> torch.Tensor:
    """[B, k] bool -> [B] long: length of the all-True prefix of each row."""
    return accept.to(torch.long).cumprod(dim=1).sum(dim=1)


def _emit(drafts: torch.Tensor, num_accepted: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """[B, k+1] emitted tokens: accepted drafts, then `last` [B], then -1 padding."""
    b, k = drafts.shape
    j = torch.arange(k + 1, device=drafts.device).unsqueeze(0)  # [1, k+1]
    padded = torch.cat([drafts, drafts.new_full((b, 1), -1)], dim=1)  # [B, k+1]
    n = num_accepted.unsqueeze(1)
    out = torch.where(j < n, padded, torch.full_like(padded, -1))
    return torch.where(j == n, last.unsqueeze(1).to(padded.dtype), out)


def greedy_verify_batched(target_argmax: torch.Tensor, drafts: torch.Tensor,
                          num_drafts: torch.Tensor,
                          relaxed: Optional[torch.Tensor] = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Strict prefix match for B requests at once.

    target_argmax [B, k+1] long; drafts [B, k] long (entries past num_drafts are padding, any
    value); num_drafts [B]; relaxed [B, k] bool or None (extra accepts, see relaxed_accept).
    Returns (emitted [B, k+1] long padded with -1, num_accepted [B] long).
    """
    b, k = drafts.shape
    drafts = drafts.to(torch.long)
    target_argmax = target_argmax.to(torch.long)
    valid = torch.arange(k, device=drafts.device).unsqueeze(0) < num_drafts.unsqueeze(1)
    accept = drafts == target_argmax[:, :k]
    if relaxed is not None:
        accept = accept | relaxed
    num_accepted = _accepted_prefix(accept & valid)  # [B]
    last = target_argmax.gather(1, num_accepted.unsqueeze(1)).squeeze(1)  # [B]
    return _emit(drafts, num_accepted, last), num_accepted


def force_accept(target_argmax: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor,
                 mean: float, u: Optional[torch.Tensor] = None):
    """Benchmarks only (lossy): accept a random count with mean `mean - 1` (stochastic rounding,
    drawn on the device unless `u` [B] uniform draws are given), then the target's greedy token
    at the first unaccepted position.

    target_argmax [B, k+1], drafts [B, k], num_drafts [B] -> (emitted [B, k+1] padded with -1,
    accepted [B])."""
    b = drafts.shape[0]
    if u is None:
        u = torch.rand(b, device=drafts.device)
    acc = torch.minimum((mean - 1.0 + u).floor().long().clamp(min=0), num_drafts)
    out = torch.cat([drafts, drafts.new_full((b, 1), -1)], dim=1)
    j = torch.arange(out.shape[1], device=out.device).unsqueeze(0)
    out = torch.where(j > acc.unsqueeze(1), torch.full_like(out, -1), out)
    out.scatter_(1, acc.unsqueeze(1), target_argmax.gather(1, acc.unsqueeze(1)))
    return out, acc


def greedy_verify(target_argmax: torch.Tensor,
                  draft_token_ids: Union[torch.Tensor, Sequence[int]]) -> tuple[list, int]:
    """target_argmax [k+1], drafts [k] -> (emitted tokens, num_accepted). Host-side helper."""
    drafts = torch.as_tensor(draft_token_ids, dtype=torch.long, device=target_argmax.device)
    k = drafts.numel()
    if target_argmax.numel() != k + 1:
        raise ValueError(f"target_argmax needs k+1={k + 1} entries, got {target_argmax.numel()}")
    out, acc = greedy_verify_batched(target_argmax.view(1, k + 1), drafts.view(1, k),
                                     torch.tensor([k], device=drafts.device))
    n = int(acc[0])
    return out[0, :n + 1].tolist(), n  # sync-ok: host-side helper


def draw_verify_randomness(generators: Sequence[Optional[torch.Generator]], k: int, vocab: int,
                           device, default_generator: Optional[torch.Generator] = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-request randomness of one rejection-sampling step.

    Returns (uniforms [B, k] in [0, 1), noise [B, V] ~ Exp(1)). Only one token per request is
    ever drawn from a residual or bonus distribution, so one noise row per request suffices for
    all k+1 positions. A seeded request draws from its own generator (k uniforms, then V
    exponentials), so its result doesn't depend on the rest of the batch.
    """
    b = len(generators)
    uniforms = torch.empty(b, k, dtype=torch.float32, device=device)
    noise = torch.empty(b, vocab, dtype=torch.float32, device=device)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        uniforms[unseeded] = torch.rand(len(unseeded), k, device=device,
                                        generator=default_generator)
        block = torch.empty(len(unseeded), vocab, dtype=torch.float32, device=device)
        noise[unseeded] = block.exponential_(generator=default_generator)
    for i, gen in enumerate(generators):
        if gen is not None:
            uniforms[i] = torch.rand(k, device=device, generator=gen)
            noise[i].exponential_(generator=gen)
    return uniforms, noise.clamp_(min=_TINY)


def rejection_verify_batched(target_probs: torch.Tensor, drafts: torch.Tensor,
                             draft_probs: Optional[torch.Tensor], num_drafts: torch.Tensor,
                             uniforms: torch.Tensor, noise: torch.Tensor,
                             relaxed: Optional[torch.Tensor] = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless rejection sampling for B requests at once.

    target_probs [B, k+1, V] (processed target distribution per position); drafts [B, k] long
    (padding past num_drafts: any value); draft_probs [B, k, V] or None (a deterministic drafter:
    q is one-hot on the draft); num_drafts [B]; uniforms [B, k]; noise [B, V] (Exp(1), > 0);
    relaxed [B, k] bool or None (extra accepts). Returns (emitted [B, k+1] padded with -1,
    num_accepted [B]).
    """
    b, k1, vocab = target_probs.shape
    k = k1 - 1
    drafts = drafts.to(torch.long)
    dev = target_probs.device
    rows = torch.arange(b, device=dev)
    if k == 0:
        num_accepted = torch.zeros(b, dtype=torch.long, device=dev)
        last = (target_probs[:, 0] / noise).argmax(dim=-1)
        return _emit(drafts, num_accepted, last), num_accepted
    safe = drafts.clamp(0, vocab - 1)  # padding may be -1; `valid` discards those rows anyway
    p_d = target_probs[:, :k].gather(2, safe.unsqueeze(2)).squeeze(2)  # [B, k]
    if draft_probs is None:
        q_d = torch.ones_like(p_d)
    else:
        q_d = draft_probs.gather(2, safe.unsqueeze(2)).squeeze(2)  # [B, k]
    valid = torch.arange(k, device=dev).unsqueeze(0) < num_drafts.unsqueeze(1)
    # u < p/q written without the division: q(d) = 0 (a draft the drafter couldn't have drawn)
    # is accepted iff p(d) > 0.
    accept = uniforms * q_d < p_d
    if relaxed is not None:
        accept = accept | relaxed
    num_accepted = _accepted_prefix(accept & valid)  # [B]

    p_at = target_probs[rows, num_accepted]  # [B, V]: where the extra token is drawn
    at = num_accepted.clamp(max=k - 1)  # the rejected draft's index (clamped for bonus rows)
    if draft_probs is None:
        q_at = torch.zeros_like(p_at).scatter_(1, safe[rows, at].unsqueeze(1), 1.0)
    else:
        q_at = draft_probs[rows, at]  # [B, V]
    is_bonus = (num_accepted >= num_drafts).unsqueeze(1)  # [B, 1]
    residual = torch.where(is_bonus, p_at, (p_at - q_at).clamp(min=0))
    # A rejection with p == q everywhere (rounding, or a relaxed-only path) leaves no residual
    # mass; falling back to p keeps the draw well defined.
    empty = residual.sum(dim=1, keepdim=True) <= 0
    residual = torch.where(empty, p_at, residual)
    last = (residual / noise).argmax(dim=-1)  # exponential race: no normalisation needed
    return _emit(drafts, num_accepted, last), num_accepted


def rejection_verify(target_probs: torch.Tensor,
                     draft_token_ids: Union[torch.Tensor, Sequence[int]],
                     draft_probs: Optional[torch.Tensor],
                     generator: Optional[torch.Generator] = None) -> tuple[list, int]:
    """target_probs [k+1, V], drafts [k], draft_probs [k, V] or None -> (emitted, num_accepted).

    Host-side helper over rejection_verify_batched; generator None draws from torch's global RNG.
    """
    k1, vocab = target_probs.shape
    dev = target_probs.device
    drafts = torch.as_tensor(draft_token_ids, dtype=torch.long, device=dev).view(1, -1)
    if drafts.shape[1] != k1 - 1:
        raise ValueError(f"target_probs has {k1} positions; it needs k+1 for k={drafts.shape[1]}")
    uniforms, noise = draw_verify_randomness([generator], k1 - 1, vocab, dev)
    out, acc = rejection_verify_batched(
        target_probs.unsqueeze(0), drafts,
        None if draft_probs is None else draft_probs.unsqueeze(0),
        torch.tensor([k1 - 1], device=dev), uniforms, noise)
    n = int(acc[0])
    return out[0, :n + 1].tolist(), n  # sync-ok: host-side helper


def _check_relaxed(top_k: int, delta: float) -> None:
    if not isinstance(top_k, int) or top_k < 1:
        raise ConfigError(f"relaxed acceptance top_k must be an integer >= 1, got {top_k!r}")
    if not 0.0 <= delta <= 1.0:
        raise ConfigError(f"relaxed acceptance delta must be in [0, 1], got {delta!r}")


def relaxed_accept_batched(target_probs: torch.Tensor, drafts: torch.Tensor, top_k: int,
                           delta: float, eligible: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[B, k(+1), V] target probs, [B, k] drafts -> [B, k] bool relaxed accepts.

    A draft passes when its probability is >= the target's k-th largest (so it is among the
    top_k, ties included) and p(top-1) - p(draft) <= delta. `eligible` [B, k] bool (e.g. inside
    a thinking span) gates it; None: every position is eligible.
    """
    _check_relaxed(top_k, delta)
    k = drafts.shape[1]
    probs = target_probs[:, :k]  # [B, k, V]
    top = probs.topk(min(top_k, probs.shape[-1]), dim=-1).values  # [B, k, top_k]
    p_d = probs.gather(2, drafts.to(torch.long).clamp(min=0).unsqueeze(2)).squeeze(2)  # [B, k]
    ok = (p_d >= top[..., -1]) & (top[..., 0] - p_d <= delta) & (p_d > 0)
    return ok if eligible is None else ok & eligible


def relaxed_accept(target_probs_row: torch.Tensor, draft_token: int, top_k: int,
                   delta: float) -> bool:
    """Opt-in lossy acceptance: the draft is among the target's top_k and within delta of the
    top-1 probability. target_probs_row [V]."""
    ok = relaxed_accept_batched(target_probs_row.view(1, 1, -1),
                                torch.tensor([[draft_token]], device=target_probs_row.device),
                                top_k, delta)
    return bool(ok[0, 0])


def _as_id_set(ids: Union[int, Iterable[int]]) -> frozenset:
    return frozenset([ids] if isinstance(ids, int) else ids)


class ThinkingSpanTracker:
    """Whether a request is inside a thinking span (e.g. between <think> and </think>).

    Markers are single token ids (several allowed per side). Feed every committed token through
    `update`; `relaxed_eligible` tells which drafts of the next step may be relaxed-accepted.
    """

    def __init__(self, begin_token_ids: Union[int, Iterable[int]],
                 end_token_ids: Union[int, Iterable[int]], inside: bool = False):
        self.begin_ids = _as_id_set(begin_token_ids)
        self.end_ids = _as_id_set(end_token_ids)
        if not self.begin_ids or not self.end_ids:
            raise ConfigError("thinking span needs at least one begin and one end token id")
        if self.begin_ids & self.end_ids:
            raise ConfigError("thinking span begin and end token ids must differ, got "
                              f"{sorted(self.begin_ids & self.end_ids)} in both")
        self._inside = bool(inside)

    @classmethod
    def from_tokens(cls, begin_token_ids, end_token_ids,
                    token_ids: Iterable[int]) -> "ThinkingSpanTracker":
        """Rebuild the state from a whole token history (e.g. prompt + output after resume)."""
        tracker = cls(begin_token_ids, end_token_ids)
        tracker.update(token_ids)
        return tracker

    @property
    def inside(self) -> bool:
        return self._inside

    def _next(self, inside: bool, tok: int) -> bool:
        if tok in self.begin_ids:
            return True
        if tok in self.end_ids:
            return False
        return inside

    def update(self, token_ids: Iterable[int]) -> None:
        """Advance over committed tokens, in order."""
        for tok in token_ids:
            self._inside = self._next(self._inside, int(tok))

    def relaxed_eligible(self, draft_token_ids: Sequence[int]) -> list:
        """[k] bool: draft i is inside the span given the committed tokens and drafts[:i], and
        is not itself a marker (relaxing a marker would open or close a span on a guess).
        Does not change the state."""
        out, inside = [], self._inside
        for tok in draft_token_ids:
            tok = int(tok)
            out.append(inside and tok not in self.begin_ids and tok not in self.end_ids)
            inside = self._next(inside, tok)
        return out
