"""The fused step's output (runner/fused_step.py): the copies of its graph's outputs into pinned
host buffers, waiting for them, and the StepResult they make: each request's emitted tokens and
accepted count, its logprobs (a +logprobs graph's second output, runner/fused_sampling.py), and
its next drafts (the graph's: a head's or the device n-gram's, trimmed to the request's draft
length, a head's replaced by its suffix enhancer's where that matched long enough; or a host
drafter's proposals from the committed tokens).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from outpace.kernels.logprobs import logprob_lists, token_logprobs
from outpace.speculative.base import CommittedTokens, DraftBatch
from outpace.types import RequestStepOutput, StepResult


class StepOutput:
    """A part of FusedStep: its outputs' pinned host buffers (two per shape and dtype: step N's
    is read while N+1's copy is queued), and the StepResult an output makes."""

    def __init__(self, runner, head, host_drafter, device_ngram: bool = False):
        # runner: a weak proxy (FusedStep's); head / host_drafter / device_ngram: who drafts,
        # as FusedStep says (the device n-gram's drafts end at a -1: fused_ngram.py)
        self.runner, self.head, self.host_drafter = runner, head, host_drafter
        self.device_ngram = device_ngram
        self._host_out: dict = {}  # (shape, dtype, parity) -> pinned host tensor
        self._parity = 0

    def flip(self) -> None:
        """The next step's copies go to the other buffer of each pair."""
        self._parity ^= 1

    def copy_out(self, out: torch.Tensor) -> torch.Tensor:
        """Queue the copy of a graph output into its pinned host buffer (two per shape: step
        N's is read while N+1's copy is queued) -> that buffer."""
        host = self._host_out.get((out.shape, out.dtype, self._parity))
        if host is None:
            host = self._host_out[(out.shape, out.dtype, self._parity)] = torch.empty(
                out.shape, dtype=out.dtype, pin_memory=True)
        host.copy_(out, non_blocking=True)
        return host

    def result(self, plan, out: np.ndarray, q: int, kd: int,
               logprobs: Optional[np.ndarray] = None,
               plane_skipped: bool = False, next_k: Optional[list] = None) -> StepResult:
        """The StepResult of `plan` from a step's output rows (in plan order); plane_skipped:
        the graph ran no head work, so every request's plane entries of the step are unwritten
        (RequestStepOutput.draft_plane_skipped); next_k: each request's draft length for the
        next step, chosen when the step was launched (the cost model: the graph drafted the
        longest; fused_step.py), where the policy is not asked again."""
        runner = self.runner
        proposer = runner.proposer
        result = StepResult()
        committed, asked, num_committed = [], [], []
        batch_size = plan.draft_batch_size
        # A head at a batch size where the policy drafts nothing (k_schedule), or whose launch
        # chose no drafts for the next step (the cost model: a kd = 0 graph): no lengths to
        # trim, no drafts to read. Skipping that per-request work keeps such a step as cheap on
        # the host as a plain one (at batch 128 the host is the bottleneck). A host drafter is
        # always called: it indexes the new tokens even when it proposes none.
        drafting = proposer is not None and (
            self.host_drafter is not None
            or (max(next_k, default=0) if next_k is not None
                else proposer.policy.base_k(batch_size)) > 0)
        # One conversion of the whole output to Python ints: per-row numpy slicing and tolist
        # cost host time for every request, on the host's critical path at batch 128.
        rows = out.tolist()  # sync-ok: numpy, already on the host
        outputs = result.outputs
        lp_rows = None  # the most any request here asks for, in one conversion
        if logprobs is not None:
            lp_rows = logprob_lists(logprobs, max(
                sr.request.sampling_params.logprobs or 0 for sr in plan.scheduled))
        adaptive = proposer is not None and proposer.policy.adaptive
        observed = ([], [], []) if adaptive else None  # request ids, drafts, accepted
        # the policy's k, the same for every request unless it adapts per request
        k_all = proposer.policy.base_k(batch_size) if drafting and not adaptive else None
        # a host drafter and a head's suffix enhancer propose from the committed tokens
        enhancer = self.head is not None and self.head.enhancer is not None
        reads_tokens = self.host_drafter is not None or enhancer
        for i, (sr, row) in enumerate(zip(plan.scheduled, rows)):
            req = sr.request
            nd = len(sr.draft_token_ids)
            acc = row[q]
            toks = row[:acc + 1]
            outputs[req.request_id] = RequestStepOutput(
                token_ids=toks, num_draft_tokens=nd, num_accepted_tokens=acc,
                draft_plane_skipped=plane_skipped)
            if lp_rows is not None and req.sampling_params.logprobs is not None:
                outputs[req.request_id].logprobs = token_logprobs(
                    lp_rows[i][:acc + 1], req.sampling_params.logprobs)
            if observed is not None:
                observed[0].append(req.request_id)
                observed[1].append(nd)
                observed[2].append(acc)
            if drafting:
                if reads_tokens:  # it reads the committed sequence's tail
                    committed.append(CommittedTokens(req.prompt_token_ids,
                                                     req.output_token_ids, toks))
                asked.append(req)
                num_committed.append(req.num_tokens + len(toks))
        if observed is not None:
            proposer.policy.observe_many(*observed)
        if plane_skipped:
            self.head.work.skip(sum(sr.num_new_tokens for sr in plan.scheduled))
        if not drafting:
            runner.step_clock.chose(0)
            return result
        ks = runner.draft_lengths(asked, batch_size, num_committed, k=k_all, chosen=next_k)
        if self.host_drafter is None:  # drafted in the graph
            drafts = [row[q + 1:q + 1 + min(k, kd)] for row, k in zip(rows, ks)]
            if self.device_ngram:  # a row's drafts end at its first -1
                drafts = [d[:d.index(-1)] if -1 in d else d for d in drafts]
            if enhancer:  # a long suffix match replaces the graph's drafts, as in the eager head
                try:
                    drafts = self.head.enhance(asked, committed, drafts, ks)
                except Exception as e:  # as on the general path: no drafts for this step
                    runner.drafter_failed(e, plan, result)
                    return result
        else:
            batch = DraftBatch(requests=[sr.request for sr in plan.scheduled],
                               committed=committed, row_start=[], row_end=[],
                               last_row=[len(c) - 2 for c in committed])
            try:
                drafts = self.host_drafter.propose(batch, ks)
            except Exception as e:  # as on the general path: no drafts for this step
                runner.drafter_failed(e, plan, result)
                return result
        for sr, d, k in zip(plan.scheduled, drafts, ks):
            if k > 0 and d:
                result.outputs[sr.request.request_id].next_draft_token_ids = list(d[:k])
        return result
