"""The fused step's output (runner/fused_step.py): the copies of its graph's outputs into pinned
host buffers, waiting for them, and the StepResult they make: each request's emitted tokens and
accepted count, its logprobs (a +logprobs graph's second output, runner/fused_sampling.py), and
its next drafts (the head's, trimmed to the request's draft length, or a host drafter's
proposals from the committed tokens).
"""

from __future__ import annotations

import time
from typing import Optional

import numpy as np
import torch

from outpace.kernels.logprobs import logprob_lists, token_logprobs
from outpace.speculative.base import CommittedTokens, DraftBatch
from outpace.types import RequestStepOutput, StepResult


class FusedOutput:
    """Mixin of FusedStep. Needs self.runner, self.head, self.host_drafter, self._host_out,
    self._parity and the step counters (replays, mode_steps, timing)."""

    def _copy_out(self, out: torch.Tensor) -> torch.Tensor:
        """Queue the copy of a graph output into its pinned host buffer (two per shape: step
        N's is read while N+1's copy is queued) -> that buffer."""
        host = self._host_out.get((out.shape, out.dtype, self._parity))
        if host is None:
            host = self._host_out[(out.shape, out.dtype, self._parity)] = torch.empty(
                out.shape, dtype=out.dtype, pin_memory=True)
        host.copy_(out, non_blocking=True)
        return host

    def collect(self, launched, plan) -> StepResult:
        """Wait for the step's output copy and turn it into the StepResult of `plan` (the
        requests of launched.rows that are still running, in that order)."""
        t1 = time.perf_counter()
        if launched.event is not None:
            while not launched.event.query():  # poll: waits for this step only
                pass
        t2 = time.perf_counter()
        out = launched.host.numpy()  # sync-ok: host memory, its copy was waited for above
        row_of = {rid: i for i, rid in enumerate(launched.rows)}
        order = [row_of[sr.request.request_id] for sr in plan.scheduled]
        out = out[order]
        logprobs = None
        if launched.host_logprobs is not None:
            logprobs = launched.host_logprobs.numpy()[order]  # sync-ok: waited for above
        _, q, kd, _ = launched.key
        result = self._result(plan, out, q, kd, logprobs)
        if launched.prefill:  # the counters and timings below are decode steps'
            return result
        self.replays += 1
        self.mode_steps[launched.mode] += 1
        tm = self.timing
        tm["launch_s"] += launched.t_launch
        tm["wait_s"] += t2 - t1
        tm["unpack_s"] += time.perf_counter() - t2
        return result

    def _result(self, plan, out: np.ndarray, q: int, kd: int,
                logprobs: Optional[np.ndarray] = None) -> StepResult:
        runner = self.runner
        proposer = runner.proposer
        result = StepResult()
        committed, ks = [], []
        batch_size = plan.draft_batch_size
        # A head at a batch size where the policy drafts nothing (k_schedule): no lengths to
        # trim, no drafts to read. Skipping that per-request work keeps such a step as cheap on
        # the host as a plain one (at batch 128 the host is the bottleneck). A host drafter is
        # always called: it indexes the new tokens even when it proposes none.
        drafting = proposer is not None and (self.host_drafter is not None
                                             or proposer.policy.base_k(batch_size) > 0)
        # One conversion of the whole output to Python ints: per-row numpy slicing and tolist
        # cost host time for every request, on the host's critical path at batch 128.
        rows = out.tolist()  # sync-ok: numpy, already on the host
        outputs = result.outputs
        lp_rows = None  # the most any request here asks for, in one conversion
        if logprobs is not None:
            lp_rows = logprob_lists(logprobs, max(
                sr.request.sampling_params.logprobs or 0 for sr in plan.scheduled))
        adaptive = proposer is not None and proposer.policy.adaptive
        observe = proposer.policy.observe if adaptive else None
        # the policy's k, the same for every request unless it adapts per request
        k_all = proposer.policy.base_k(batch_size) if drafting and not adaptive else None
        for i, (sr, row) in enumerate(zip(plan.scheduled, rows)):
            req = sr.request
            nd = len(sr.draft_token_ids)
            acc = row[q]
            toks = row[:acc + 1]
            outputs[req.request_id] = RequestStepOutput(
                token_ids=toks, num_draft_tokens=nd, num_accepted_tokens=acc)
            if lp_rows is not None and req.sampling_params.logprobs is not None:
                outputs[req.request_id].logprobs = token_logprobs(
                    lp_rows[i][:acc + 1], req.sampling_params.logprobs)
            if observe is not None:
                observe(req.request_id, nd, acc)
            if drafting:
                if self.host_drafter is not None:  # it reads the committed sequence's tail
                    committed.append(CommittedTokens(req.prompt_token_ids,
                                                     req.output_token_ids, toks))
                ks.append(runner.draft_length(req, batch_size, req.num_tokens + len(toks),
                                              k=k_all))
        if not drafting:
            return result
        if self.head is not None:
            drafts = [row[q + 1:q + 1 + min(k, kd)] for row, k in zip(rows, ks)]
        else:
            batch = DraftBatch(requests=[sr.request for sr in plan.scheduled],
                               committed=committed, row_start=[], row_end=[],
                               last_row=[len(c) - 2 for c in committed])
            drafts = self.host_drafter.propose(batch, ks)
        for sr, d, k in zip(plan.scheduled, drafts, ks):
            if k > 0 and d:
                result.outputs[sr.request.request_id].next_draft_token_ids = list(d[:k])
        return result
