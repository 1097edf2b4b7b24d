"""`StepRelaxed`: relaxed acceptance inside thinking spans (opt-in, lossy; SpecConfig's
relaxed_top_k, relaxed_delta, think_begin_ids, think_end_ids) in the fused step's graphs, as the
general path applies it (runner/sampling_step.py, speculative/verify.py):

- whether each row's request is inside a span after its committed tokens (`inside`, one bool a
  row): staged from the host's span trackers when a step is launched from the host, and
  advanced by each graph over the tokens it emitted, so chained and relaunched steps read it
  from the device;
- which drafts are eligible: inside the span given the drafts before them, and not a marker
  themselves (ThinkingSpanTracker.relaxed_eligible, in tensor ops over the step's k drafts),
  and among the drafts the request could still turn into output (a chained step verifies its
  k drafts even where fewer tokens are left, which strict verification makes harmless; a
  relaxed draft there would become the last token where a step launched from the host, its
  drafts trimmed by the scheduler, emits the target's): each row's output tokens left under
  max_tokens (`left`), staged with `inside` and counted down by the emitted tokens. The
  context never binds here: a host launch's drafts are trimmed by the scheduler already, and a
  chain runs only where the context has room for its drafts (Scheduler.context_has_room);
- the drafts that pass (relaxed_accept_batched over the rows' probabilities) take the target's
  place in the verify, up to the first draft neither the target nor the relaxed check accepts:
  strict prefix verification then accepts them, and emits the target's token after them, as the
  general path's greedy_verify_batched does with its relaxed mask.

Greedy graphs only: a sampled request's relaxed check reads its processed probabilities, which
those graphs do not form (such steps take the general path)."""

from __future__ import annotations

import numpy as np
import torch

from outpace.speculative.verify import relaxed_accept_batched


class StepRelaxed:
    def __init__(self, inputs, relaxed, max_model_len: int, device: torch.device):
        self.cfg = relaxed  # sampling_step.RelaxedAcceptance
        self.max_model_len = max_model_len  # (no request emits more)
        m = inputs.max_seqs
        self.inside, self.left = inputs.add_buffers([((m,), torch.bool), ((m,), torch.long)])
        # compared by broadcasting, never torch.isin: with many ids it sorts, which syncs with
        # the host and can't be captured
        self.begin_ids = torch.tensor(relaxed.begin_ids, dtype=torch.long, device=device)
        self.end_ids = torch.tensor(relaxed.end_ids, dtype=torch.long, device=device)

    def rows(self, plan, bucket: int, spans) -> list:
        """(buffer, values): whether each row's request is inside a span after its committed
        tokens (`spans`: SamplingStep, whose trackers the general path keeps too)."""
        inside = np.zeros(bucket, np.bool_)
        left = np.zeros(bucket, np.int64)
        reqs = [sr.request for sr in plan.scheduled]
        inside[:len(reqs)] = [spans.span_inside(r) for r in reqs]
        left[:len(reqs)] = [self._tokens_left(r) for r in reqs]
        return [(self.inside, inside), (self.left, left)]

    def _tokens_left(self, req) -> int:
        """Output tokens req may still emit under max_tokens (the context: module docstring)."""
        max_tokens = req.sampling_params.max_tokens
        return self.max_model_len if max_tokens is None else \
            max_tokens - len(req.output_token_ids)

    def neutral_rows(self, bucket: int) -> None:
        self.inside[:bucket].zero_()
        self.left[:bucket].zero_()

    @staticmethod
    def _among(tok: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return (tok.unsqueeze(-1) == ids).any(-1)

    def _next(self, inside: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        """The span state after `tok` ([B] each; -1: no token, the state kept)."""
        return (inside | self._among(tok, self.begin_ids)) & ~self._among(tok, self.end_ids)

    def targets(self, target: torch.Tensor, ids: torch.Tensor, num_drafts: torch.Tensor,
                logits: torch.Tensor, bucket: int, q: int) -> torch.Tensor:
        """[n] the target's tokens with the relaxed-accepted drafts in their place (see the
        module docstring); ids [n] the step's rows (a request's q rows: its last token, then
        its drafts), logits [n, V] float32."""
        if q == 1:
            return target
        k = q - 1
        tgt = target.view(bucket, q)
        drafts = ids.view(bucket, q)[:, 1:]  # [B, k]
        col = torch.arange(k, device=ids.device).unsqueeze(0)
        real = (col < num_drafts.unsqueeze(1)) & (col < self.left[:bucket].unsqueeze(1) - 1)
        inside = self.inside[:bucket]
        eligible = []
        for j in range(k):  # ThinkingSpanTracker.relaxed_eligible, a column at a time
            tok = drafts[:, j]
            marker = self._among(tok, self.begin_ids) | self._among(tok, self.end_ids)
            eligible.append(inside & ~marker)
            inside = self._next(inside, tok)
        eligible = torch.stack(eligible, dim=1) & real  # [B, k]
        probs = torch.softmax(logits.view(bucket, q, -1)[:, :k], dim=-1)  # the drafts' rows
        ok = relaxed_accept_batched(probs, drafts, self.cfg.top_k, self.cfg.delta, eligible)
        # up to the first draft that neither the target's token nor the relaxed check accepts
        match = (drafts == tgt[:, :k]) | ok
        prefix = torch.cumprod(match.long(), dim=1).bool()
        out = tgt.clone()
        out[:, :k] = torch.where(prefix & ok, drafts, tgt[:, :k])
        return out.view(-1)

    def advance(self, packed: torch.Tensor, q: int, bucket: int) -> None:
        """The span state after the step's emitted tokens (packed[:, :q], -1 past them), for
        the next chained or relaunched step."""
        inside = self.inside[:bucket]
        for j in range(q):
            tok = packed[:, j]
            inside = torch.where(tok >= 0, self._next(inside, tok), inside)
        self.inside[:bucket].copy_(inside)
        self.left[:bucket].sub_((packed[:, :q] >= 0).sum(dim=1))
