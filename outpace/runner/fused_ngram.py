"""`StepNgram`, n-gram prompt lookup inside the fused graphs (`"ngram_device": true`), so that an
n-gram engine's decode steps chain like a head's instead of waiting for the host to propose.

A host drafter needs step N's tokens before it can propose N+1's drafts, so its steps are at
best relaunched from the carry after the host has read N (runner/fused_step.py). Here the
graph itself keeps each batch row's committed tokens in a device history and looks the next
drafts up there (speculative/ngram_device.py), so N+1 can be launched from N's carry before
the host has read anything:

    history [m, max_model_len + 1] int32   row b's committed tokens (the last column: a
                                           scratch cell the padded writes go to)
    lengths [m] long                       how many of them there are
    counts  [m] long                       the carry: each row's drafts for the next step

A step launched from a host batch (FusedStep.launch: the rows' requests may have changed)
fills its rows from the committed tokens, with eager kernels queued ahead of the replay (no
host sync), as the penalties' tables are filled (runner/fused_penalties.py). The graph then
appends each row's emitted tokens after accept and proposes from the history: the drafts go
to the packed output (-1 past a row's count, so the host reads the count) and to the carry, so
the chained step verifies them with each row's own draft count. The drafts are those the host's
NgramProposer would propose from the same committed tokens (the lookup is the same function of
them), so the host's n-gram state and the graph can take turns: the general path (prefills,
mixed steps) still proposes on the host.

Cost: the history is 4 bytes x m x max_model_len; the lookup scans every row's full width,
O(bucket x max_model_len x prompt_lookup_max) a step (ngram_device.py), and a launch from the
host uploads every row's committed tokens.
"""

from __future__ import annotations

import numpy as np
import torch

from outpace.speculative.ngram_device import ngram_propose


class StepNgram:
    """A part of FusedStep (with `"ngram_device": true`): the device token history, its fill
    at a host launch, and the graph's append and lookup."""

    def __init__(self, max_seqs: int, max_model_len: int, spec, device: torch.device):
        self.width = max_model_len
        self.min_n, self.max_n = spec.prompt_lookup_min, spec.prompt_lookup_max
        self.history = torch.zeros(max_seqs, max_model_len + 1, dtype=torch.int32,
                                   device=device)
        self.lengths = torch.zeros(max_seqs, dtype=torch.long, device=device)
        self.counts = torch.zeros(max_seqs, dtype=torch.long, device=device)

    def neutral_rows(self, bucket: int) -> None:
        """Every row of a bucket empty (graphs are captured over such a batch): no drafts."""
        self.lengths[:bucket].zero_()
        self.counts[:bucket].zero_()

    def fill(self, plan, bucket: int) -> None:
        """Rows [0, bucket) from the committed tokens of plan's requests (padding rows empty):
        one non-blocking upload from pinned memory of the lengths, then the positions and
        tokens of every row, scattered by eager kernels queued ahead of the step's replay."""
        stride = self.history.shape[1]
        lens = np.zeros(bucket, np.int64)
        where, tokens = [], []
        for i, sr in enumerate(plan.scheduled):
            toks = np.asarray(sr.request.all_token_ids[:self.width], np.int64)
            lens[i] = len(toks)
            where.append(i * stride + np.arange(len(toks)))
            tokens.append(toks)
        flat = torch.from_numpy(np.concatenate([lens] + where + tokens))
        if self.history.is_cuda:
            flat = flat.pin_memory().to(self.history.device, non_blocking=True)
        total = (len(flat) - bucket) // 2
        self.lengths[:bucket].copy_(flat[:bucket])
        self.history.view(-1).index_copy_(0, flat[bucket:bucket + total],
                                          flat[bucket + total:].to(torch.int32))

    def advance(self, packed: torch.Tensor, q: int, bucket: int, real: torch.Tensor) -> None:
        """After accept: append each real row's emitted tokens (packed[:, :q], -1 past its
        accepted count) to its history. Writes that don't land (-1, padding rows, past the
        width) go to the scratch column, so every shape is fixed."""
        emitted = packed[:bucket, :q]
        pos = self.lengths[:bucket].unsqueeze(1) + torch.arange(q, device=packed.device)
        ok = (emitted >= 0) & real[:bucket].unsqueeze(1) & (pos < self.width)
        pos = torch.where(ok, pos, self.width)
        self.history[:bucket].scatter_(1, pos, emitted.clamp(min=0).to(torch.int32))
        self.lengths[:bucket] += ok.sum(dim=1)

    def propose(self, bucket: int, kd: int, real: torch.Tensor, drafts_out: torch.Tensor,
                carry_drafts: torch.Tensor) -> None:
        """Each row's next drafts from its history (after advance): into drafts_out [B, kd]
        (-1 past the row's count: the output the host reads) and carry_drafts [B, kd] (0 past
        it: the next chained step's input rows), the counts into `counts`. Never past the
        context: the next step emits up to count + 1 tokens (ModelRunner.draft_lengths).
        kd = 0 (a k_schedule drafting nothing at this batch size): every count 0, since a step
        chained from this one verifies `counts` drafts a row (FusedStep._chained_inputs) and
        must not read an earlier step's."""
        if kd == 0:
            self.counts[:bucket].zero_()
            return
        lengths = self.lengths[:bucket]
        drafts, counts = ngram_propose(self.history[:bucket, :self.width], lengths, kd,
                                       self.min_n, self.max_n)
        counts = torch.minimum(counts, (self.width - 1 - lengths).clamp(min=0))
        counts = torch.where(real[:bucket], counts, 0)
        keep = torch.arange(kd, device=drafts.device) < counts.unsqueeze(1)
        drafts_out.copy_(torch.where(keep, drafts, -1))
        carry_drafts.copy_(torch.where(keep, drafts, 0))
        self.counts[:bucket].copy_(counts)
