"""The fused step's sampling (runner/fused_step.py): what a sampled graph stages for a step's
requests, and the tokens it draws (which graphs the requests need: runner/graph_mode.py).

Greedy, sampled and masked graphs share their keys (bucket, q, kd, chained) and differ only in
how a row's token is chosen from the LM head's logits: the argmax; the race of sample/gumbel.py
with the request's temperature, seed and the position sampled, all inside the argmax kernel; or
that race over the top-k / top-p / min-p nucleus (`masked_race_tokens`: kernels/masked_gumbel.py,
no sort). A request with repetition, frequency or presence penalties takes the sampled or masked
graph with penalties (SAMPLE_PENALIZED, MASKED_PENALIZED in runner/graph_mode.py; the tables:
runner/fused_penalties.py), whose rows are penalized before the race; a greedy one races there
with no noise (its argmax). A step pays only for what its requests ask, so a request that sets
only a temperature costs about what a greedy one does, and the masks and penalties are paid only
where some request asks for them (decisions-log.md: "Sampled graphs", "top-k / top-p / min-p
without a sort", "penalties and logprobs in the fused graphs"). Each token equals the one the
general path (runner/sampling_step.py, the same kernels on CUDA) draws for the same seed and
position, so accept's strict prefix match verifies sampled drafts exactly as greedy ones.
"""

from __future__ import annotations

import numpy as np
import torch

from outpace.kernels.logprobs import row_logprobs
from outpace.runner.graph_mode import GraphMode
from outpace.sample.logits_processing import SAMPLING_EPS
from outpace.sample.gumbel import masked_race_tokens, race_tokens
from outpace.types import MAX_LOGPROBS


class StepSampling:
    """A part of FusedStep: the per-request sampling buffers, their staging and the sampled
    graphs' token choice (penalized first, in the penalized graphs, by `penalties`)."""

    def __init__(self, inputs, runner, penalties):
        # runner: a weak proxy (FusedStep's); its SamplingStep draws each request's seed
        self.inputs, self.runner, self.penalties = inputs, runner, penalties
        m = inputs.max_seqs
        # A sampled graph's per-request sampling (staged at launch; chained and relaunched
        # steps keep their first step's rows, so theirs stay valid): temperature (1 in a greedy
        # row), top-k, top-p, min-p, and the seed's race word (SamplingStep.seed_word_for; -1:
        # a greedy row).
        (self.sample_temp, self.sample_top_k, self.sample_top_p, self.sample_min_p,
         self.sample_seed) = self.inputs.add_buffers([
             ((m,), torch.float32), ((m,), torch.long), ((m,), torch.float32),
             ((m,), torch.float32), ((m,), torch.long)])
        # A logprobs graph's count: how many of each row's top its requests ask for at most
        # (its output holds MAX_LOGPROBS; on CUDA only these are computed, kernels/logprobs.py)
        (self.logprobs_count,) = self.inputs.add_buffers([((1,), torch.int32)])

    def greedy_rows(self, bucket: int) -> None:
        """Every row of a bucket greedy (graphs are captured over such a dummy batch)."""
        self.sample_temp[:bucket].fill_(1.0)
        self.sample_seed[:bucket].fill_(-1)

    def sampling_rows(self, plan, bucket: int) -> list:
        """(buffer, values) pairs of a sampled graph's per-request sampling; padding rows are
        greedy."""
        cols = np.zeros((5, bucket), np.float64)
        cols[:, :] = np.array([1.0, 0, 1.0, 0.0, -1])[:, None]
        sampling = self.runner.sampling
        for i, sr in enumerate(plan.scheduled):
            p = sr.request.sampling_params
            if p.temperature >= SAMPLING_EPS:
                cols[:, i] = (p.temperature, p.top_k, p.top_p, p.min_p,
                              sampling.seed_word_for(sr.request))
        return [(self.sample_temp, cols[0].astype(np.float32)),
                (self.sample_top_k, cols[1].astype(np.int64)),
                (self.sample_top_p, cols[2].astype(np.float32)),
                (self.sample_min_p, cols[3].astype(np.float32)),
                (self.sample_seed, cols[4].astype(np.int64))]

    def mode_rows(self, plan, bucket: int, mode: GraphMode) -> list:
        """What a graph of `mode` stages per request, as (buffer, values) pairs: the sampling
        rows of a racing graph, a logprobs graph's count, the penalties of a penalized one
        (StepPenalties)."""
        rows = self.sampling_rows(plan, bucket) if mode.samples else []
        if mode.logprobs:
            rows.append((self.logprobs_count, np.array([max(
                sr.request.sampling_params.logprobs or 0 for sr in plan.scheduled)], np.int32)))
        return rows + (self.penalties.rows(plan, bucket) if mode.penalties else [])

    def sample(self, logits, ids, pos, bucket: int, q: int, mode: GraphMode) -> torch.Tensor:
        """[n] tokens of a sampled graph from its [n, V] float32 logits (rows with input ids
        `ids` at positions `pos`; penalized in place on CUDA): greedy rows' argmax, the others'
        race (their temperature, and in a masked graph top-k, top-p, min-p; keyed by their seed
        and the position sampled, pos + 1), as SamplingStep computes them (Sampler.sample: the
        masked race for every row when a row asks for a mask; a mask that keeps everything
        changes nothing), over the penalized logits in a penalized graph. Without masks the
        temperature, the keys and the noise are all in the argmax kernel."""
        if mode.penalties:
            logits = self.penalties.penalize(logits, ids, bucket, q)
        return self.sample_logits(logits, pos, bucket, q, masks=mode.masks)

    def logprobs(self, logits, packed, bucket: int, q: int) -> torch.Tensor:
        """[bucket, q, 1 + 2 * top] float32 from the rows' [n, V] raw logits: each row's
        emitted token's logprob (packed[:, :q]; garbage past the accepted count, where the host
        reads nothing), then the top values, then their ids (exact in float32: below 2^24), so
        the step still ends in copies of two fixed buffers. Of each row's top only the first
        logprobs_count (the launch's largest n) are computed on CUDA, as the general path
        computes them (SamplingStep._logprobs, the same row_logprobs); each request's n of them
        are read on the host."""
        top = min(MAX_LOGPROBS, logits.shape[1])
        out = row_logprobs(logits, packed[:, :q].reshape(-1), top, self.logprobs_count)
        return out.view(bucket, q, 1 + 2 * top)

    def sample_logits(self, logits, pos, bucket: int, q: int, masks: bool) -> torch.Tensor:
        """sample from the [n, V] logits (n = bucket * q rows at positions pos)."""
        def per_row(t):  # [bucket] -> [n], each request's value on its q rows
            return t[:bucket, None].expand(bucket, q).reshape(-1)
        temp, words = per_row(self.sample_temp), per_row(self.sample_seed)
        if not masks:
            return race_tokens(logits, words, pos, temperature=temp, pos_offset=1)
        return masked_race_tokens(logits, words, pos, temp, per_row(self.sample_top_k),
                                  per_row(self.sample_top_p), per_row(self.sample_min_p),
                                  pos_offset=1)
