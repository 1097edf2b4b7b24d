"""Sampling and verification of one step's logits, per request.

Row layout: a sampled request contributes 1 + d logits rows, where d = its number of drafts
(row j = the position after the j-th draft). Every row gets the request's own sampling
processing (penalties over the history up to that row, temperature, top-k/p, min-p), so a draft
position is judged by exactly the distribution a non-speculative step would sample from.

    no drafts  -> the row's token: greedy argmax, or the race keyed by the request's seed and
                  the position (sample/gumbel.py)
    drafts     -> strict prefix match of the drafts against those tokens (greedy_verify_batched),
                  greedy or sampled alike: a sampled row's race winner is an exact draw from its
                  distribution whatever the drafts were, so the output equals plain decoding's
                  for the same seed, and a draft d is accepted with probability p(d), as
                  rejection sampling against a deterministic drafter would

Relaxed acceptance (opt-in, lossy; docs/design.md, "Verification and exactness"): with `relaxed`
set, a draft inside a thinking span (per-request ThinkingSpanTracker over the committed tokens
and the drafts before it) is also accepted when relaxed_accept_batched passes it; outside a span
verification stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from outpace.errors import ConfigError
from outpace.kernels.logprobs import logprob_lists, row_logprobs, token_logprobs
from outpace.sample.logits_processing import SAMPLING_EPS, SamplingRow, process_logits
from outpace.sample.gumbel import seed_word
from outpace.sample.sampler import Sampler, probs_from_processed
from outpace.speculative.verify import (ThinkingSpanTracker, force_accept, greedy_verify_batched,
                                 relaxed_accept_batched)
from outpace.types import MAX_LOGPROBS, RequestStepOutput


@dataclass(frozen=True)
class RelaxedAcceptance:
    top_k: int
    delta: float
    begin_ids: tuple
    end_ids: tuple

    @staticmethod
    def from_spec(spec, vocab_size: int) -> Optional["RelaxedAcceptance"]:
        """None when the SpecConfig sets no relaxed acceptance (it checked that all four
        options come together); ConfigError for a token id outside the vocabulary."""
        if not spec.relaxed:
            return None
        for key in ("think_begin_ids", "think_end_ids"):
            bad = [t for t in getattr(spec, key) if t >= vocab_size]
            if bad:
                raise ConfigError(f"{key} must be token ids in 0..{vocab_size - 1}, got {bad}")
        cfg = RelaxedAcceptance(spec.relaxed_top_k, spec.relaxed_delta, spec.think_begin_ids,
                                spec.think_end_ids)
        ThinkingSpanTracker(cfg.begin_ids, cfg.end_ids)  # validates the id sets
        return cfg


class SamplingStep:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.sampler = Sampler(seed=seed)
        self._seeds: dict = {}  # request_id -> (seed, its race word), drawn once per request
        # Benchmarks only (lossy): accept floor(mean - 1 + U) drafts regardless of the target,
        # so a random head can stand in for a trained one at a chosen mean acceptance length.
        self.force_accept_mean: Optional[float] = None
        # its draws: the engine's own generator, so that nothing else in the process (a
        # user's torch.rand) moves them, and every tensor-parallel rank draws the same
        self._force_draws = torch.Generator(device=device).manual_seed(seed)
        self.relaxed: Optional[RelaxedAcceptance] = None
        self._spans: dict = {}  # request_id -> [ThinkingSpanTracker, committed tokens fed]

    def release(self, request_id: str) -> None:
        self._seeds.pop(request_id, None)
        self._spans.pop(request_id, None)

    def _eligible(self, req, drafts: list, kmax: int) -> list:
        """[kmax] bool: which drafts of req sit inside a thinking span (False past its drafts)."""
        return self._span(req).relaxed_eligible(drafts) + [False] * (kmax - len(drafts))

    def span_inside(self, req) -> bool:
        """Whether req is inside a thinking span after its committed tokens (the fused step
        stages it: runner/fused_relaxed.py)."""
        return self._span(req).inside

    def _span(self, req) -> ThinkingSpanTracker:
        """req's span tracker, fed the tokens committed since it was last asked."""
        entry = self._spans.get(req.request_id)
        n = req.num_tokens
        if entry is None or entry[1] > n:
            cfg = self.relaxed
            entry = self._spans[req.request_id] = [
                ThinkingSpanTracker(cfg.begin_ids, cfg.end_ids), 0]
        entry[0].update(req.token_slice(entry[1], n))  # only the tokens new since then
        entry[1] = n
        return entry[0]

    def _seed_entry(self, req) -> tuple:
        entry = self._seeds.get(req.request_id)
        if entry is None:
            seed = req.sampling_params.seed
            if seed is None:  # drawn once: the request's tokens follow one key sequence
                seed = self.sampler.seed_for_unseeded()
            entry = self._seeds[req.request_id] = (seed, seed_word(seed))
        return entry

    def seed_for(self, req) -> int:
        """The seed req's sampled tokens race with: its own, or one drawn for it once."""
        return self._seed_entry(req)[0]

    def seed_word_for(self, req) -> int:
        """seed_word(seed_for(req)), kept: what a fused step stages for the request."""
        return self._seed_entry(req)[1]

    def run(self, plan, logits: torch.Tensor) -> list:
        """logits [N, V] in row order -> list (one per scheduled request) of RequestStepOutput,
        None for requests that sampled nothing (mid-prompt chunks)."""
        rows, groups = [], []  # groups: (index in plan, first row, num drafts)
        for i, sr in enumerate(plan.scheduled):
            if not sr.sample:
                continue
            req, drafts = sr.request, sr.draft_token_ids
            hist = req.all_token_ids
            greedy = req.sampling_params.temperature < SAMPLING_EPS
            seed = None if greedy else self.seed_for(req)
            groups.append((i, len(rows), len(drafts)))
            for j in range(len(drafts) + 1):
                rows.append(SamplingRow(req.sampling_params, hist + drafts[:j],
                                        req.num_prompt_tokens, seed))
        outputs = [None] * len(plan.scheduled)
        if not rows:
            return outputs
        targets = self.sampler.sample(logits, rows)  # [N]: each row's token
        emitted: dict = {}  # plan index -> (tokens, num_accepted)

        plain = [g for g in groups if g[2] == 0]
        if plain:
            toks = targets[[g[1] for g in plain]]
            for g, t in zip(plain, toks.tolist()):  # sync-ok: the step's output copy
                emitted[g[0]] = ([t], 0)
        spec = [g for g in groups if g[2] > 0]
        if spec:
            self._verify(plan, spec, logits, rows, targets, emitted)

        logprobs = self._logprobs(plan, logits, groups, emitted)
        for i, _, nd in groups:
            toks, acc = emitted[i]
            outputs[i] = RequestStepOutput(token_ids=toks, num_draft_tokens=nd,
                                           num_accepted_tokens=acc, logprobs=logprobs.get(i))
        return outputs

    def _verify(self, plan, groups, logits, rows, targets, emitted):
        dev = logits.device
        kmax = max(g[2] for g in groups)
        # [B, kmax+1] row indices; positions past a request's drafts repeat its last row.
        index = torch.tensor([[g[1] + min(j, g[2]) for j in range(kmax + 1)] for g in groups],
                             device=dev)
        drafts = torch.tensor([plan.scheduled[g[0]].draft_token_ids + [-1] * (kmax - g[2])
                               for g in groups], dtype=torch.long, device=dev)
        num_drafts = torch.tensor([g[2] for g in groups], device=dev)
        if self.force_accept_mean is not None:
            u = torch.rand(len(groups), generator=self._force_draws, device=dev)
            out, acc = force_accept(targets[index], drafts, num_drafts, self.force_accept_mean,
                                    u=u)
        else:
            relaxed = None
            if self.relaxed is not None:
                probs = probs_from_processed(process_logits(logits, rows))[index]
                eligible = torch.tensor(
                    [self._eligible(plan.scheduled[g[0]].request,
                                    plan.scheduled[g[0]].draft_token_ids, kmax) for g in groups],
                    dtype=torch.bool, device=dev)  # [B, kmax]
                relaxed = relaxed_accept_batched(probs, drafts, self.relaxed.top_k,
                                                 self.relaxed.delta, eligible)
            out, acc = greedy_verify_batched(targets[index], drafts, num_drafts, relaxed)
        out_l, acc_l = out.tolist(), acc.tolist()  # sync-ok: the step's output copy
        for g, o, a in zip(groups, out_l, acc_l):
            emitted[g[0]] = (o[:a + 1], a)

    @staticmethod
    def _logprobs(plan, logits, groups, emitted) -> dict:
        """Raw logprobs (vLLM's default) of each emitted token and the top n at its row, for
        the requests of `groups` that ask for them -> {plan index: [(logprob, {id: logprob})]}:
        the first of each row's top up to the largest n asked for, then each request's own n,
        as the fused graphs take them (the same row_logprobs, so ties at the n-th value fall
        the same way on both paths); every request's rows in one launch and one copy (a varlen
        step of 32 prompts made 32)."""
        rows, tokens, spans, n_max = [], [], [], 0
        for i, first, _ in groups:
            n = plan.scheduled[i].request.sampling_params.logprobs
            if n is None:
                continue
            toks = emitted[i][0]
            spans.append((i, len(rows), len(toks), n))
            rows.extend(range(first, first + len(toks)))
            tokens.extend(toks)
            n_max = max(n_max, n)
        if not spans:
            return {}
        dev = logits.device
        top = min(MAX_LOGPROBS, logits.shape[1]) if n_max > 0 else 0
        got = row_logprobs(logits[torch.tensor(rows, device=dev)],
                           torch.tensor(tokens, device=dev), top,
                           torch.tensor([n_max], dtype=torch.int32, device=dev))
        lists = logprob_lists(got.cpu().numpy(), n_max)  # sync-ok: part of the output copy
        return {i: token_logprobs(lists[s:s + k], n) for i, s, k, n in spans}
