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
brings its rows up to the committed tokens, with eager kernels queued ahead of the replay (no
host sync). Only what the device lacks goes up: the host keeps, per row, the request whose
tokens it holds and how many of them (`held`, `held_len`: set at a fill, advanced at each
step's collect by the tokens the graph appended), so a row keeps its tokens from step to step
and a fill uploads each row's tail (the tokens committed since, by the general path), a
request's whole text only when no row holds it (new, or its row was given to another, or
preempted since: `fill`). A request held in another row than its new one is moved there on the
device first (a batch's rows shift when a request ends). The lengths, the moves and the tokens
of a fill go up in one non-blocking copy (`_Staging`).

The graph then appends each row's emitted tokens after accept and proposes from the history:
the drafts go to the packed output (-1 past a row's count, so the host reads the count) and to
the carry, so the chained step verifies them with each row's own draft count. The drafts are
those the host's NgramProposer would propose from the same committed tokens (the lookup is the
same function of them), so the host's n-gram state and the graph can take turns: the general
path (prefills, mixed steps) still proposes on the host.

Cost: the history is 4 bytes x m x max_model_len. On CUDA with triton the lookup is one
kernel (kernels/ngram_lookup.py) that walks each row's own tokens only, O(length x
prompt_lookup_max) a row, and writes the packed output, the carry and the counts itself
(nothing allocated); elsewhere (or with KernelOptions.ngram_lookup_kernel off) the tensor-op
reference (`step_drafts_ref`) scans every row's full width, O(bucket x max_model_len x
prompt_lookup_max) a step, its temporaries taking at most 24 bytes x bucket x max_model_len
(`lookup_bytes`). A fill's moves take up to the history's size again (all of it:
`device_bytes`, kept out of the KV pool by the engine's builder). A launch from the host
uploads the tokens its rows lack: in steady decoding the tokens committed since the rows' last
fill, a prompt once.
"""

from __future__ import annotations

import numpy as np
import torch

from outpace.kernels.ngram_lookup import StepOutputs, ngram_lookup_triton, use_ngram_kernel
from outpace.speculative.ngram_device import lookup_bytes, ngram_propose_ref


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
        # What each row of `history` holds, as the host knows it: (the Request, its
        # num_preemptions) whose tokens these are, or None; and how many leading tokens of
        # that request's all_token_ids the row holds. A row holds them until a fill gives it
        # to another request (padding rows write nothing, so rows past a batch keep theirs).
        self.held: list = [None] * max_seqs
        self.held_len = np.zeros(max_seqs, np.int64)
        self._staging = _Staging(device)
        self.uploaded_tokens = 0  # tokens a fill copied up, summed (tests read it)
        self.moved_rows = 0  # rows a fill moved on the device, summed (tests read it)

    @staticmethod
    def device_bytes(max_num_seqs: int, max_model_len: int, lookup_kernel: bool = False) -> int:
        """A bound of the device memory this part takes with an engine's max_num_seqs and
        context: the history and its counters (one row more than max_num_seqs: the runner's
        padding slot), a fill's copy of the rows it moves (eager) and the lookup's
        temporaries at the largest bucket (in the graphs' memory pool): none where the lookup
        runs as the kernel (lookup_kernel: `use_ngram_kernel` holds), which writes into the
        step's outputs; the tensor-op reference's bound otherwise."""
        rows, width = max_num_seqs + 1, max_model_len + 1
        history = 4 * rows * width + 2 * 8 * rows
        moves = 4 * max_num_seqs * width
        return history + moves + lookup_bytes(max_num_seqs, max_model_len, lookup_kernel)

    def neutral_rows(self, bucket: int) -> None:
        """Every row of a bucket empty (graphs are captured over such a batch): no drafts.
        (The rows' tokens stay: `lengths` is staged again at every fill.)"""
        self.lengths[:bucket].zero_()
        self.counts[:bucket].zero_()

    def fill(self, plan, bucket: int) -> None:
        """Rows [0, bucket) up to the committed tokens of plan's requests (row i: request i;
        padding rows empty): each request's tokens that its row lacks, after moving its row
        there if another holds it. One non-blocking copy of the lengths, the moves and the
        tokens with their positions, then eager kernels queued ahead of the step's replay.

        A row's held tokens are a prefix of its request's: tokens are only appended
        (Scheduler._append), and the graph appends the tokens it emits, which the host then
        commits (all of them, but at a request's end, after which no fill sees it). A
        request preempted since its row was filled is uploaded whole all the same (its row
        may have been given away meanwhile; a recompute already costs O(context))."""
        scheduled = plan.scheduled
        held, held_len = self.held, self.held_len
        row_of = {id(h[0]): j for j, h in enumerate(held) if h is not None}
        lens = np.zeros(bucket, np.int64)
        src, dst, have, left = [], [], [], []
        for i, sr in enumerate(scheduled):
            req = sr.request
            n = min(req.num_tokens, self.width)
            lens[i] = n
            j = row_of.get(id(req))
            h = 0
            if j is not None:
                if held[j][1] == req.num_preemptions:
                    h = min(int(held_len[j]), n)
                if j != i:
                    left.append(j)
                    if h:
                        src.append(j)
                        dst.append(i)
            have.append(h)
        moved = max((have[i] for i in dst), default=0)  # the longest prefix a move copies
        for j in left:  # a row its request left holds nobody's tokens (unless refilled below)
            held[j] = None
        where, tokens = [], []
        stride = self.history.shape[1]
        for i, sr in enumerate(scheduled):
            req, n, h = sr.request, int(lens[i]), have[i]
            held[i] = (req, req.num_preemptions)
            held_len[i] = n
            if h < n:
                where.append(np.arange(i * stride + h, i * stride + n))
                tokens.extend(req.token_slice(h, n))
        moves = len(src)
        total = len(tokens)
        flat = self._staging.send([lens, np.asarray(src, np.int64), np.asarray(dst, np.int64)]
                                  + where + [np.asarray(tokens, np.int64)],
                                  bucket + 2 * moves + 2 * total)
        self.lengths[:bucket].copy_(flat[:bucket])
        if moved:
            # gathered first: a row may be both a move's source and another's destination
            cols = self.history[:, :moved]
            rows = cols.index_select(0, flat[bucket:bucket + moves])
            cols.index_copy_(0, flat[bucket + moves:bucket + 2 * moves], rows)
        if total:
            at = bucket + 2 * moves
            self.history.view(-1).index_copy_(0, flat[at:at + total],
                                              flat[at + total:].to(torch.int32))
        self.uploaded_tokens += total
        self.moved_rows += moves

    def collected(self, packed: np.ndarray, q: int, rows: int) -> None:
        """A step's output was read (packed: its [bucket, q + 1 + kd] output on the host, in
        row order; rows: its requests): each row's history grew by its emitted tokens
        (packed[:, :q], -1 past them), as `advance` appended them."""
        emitted = (packed[:rows, :q] >= 0).sum(axis=1)
        np.minimum(self.held_len[:rows] + emitted, self.width, out=self.held_len[:rows])

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
        history, lengths = self.history[:bucket, :self.width], self.lengths[:bucket]
        out = StepOutputs(carry_drafts, drafts_out, self.counts[:bucket], real[:bucket],
                          self.width)
        if use_ngram_kernel(history):  # one kernel writes all three outputs
            ngram_lookup_triton(history, lengths, kd, self.min_n, self.max_n, step=out)
        else:
            step_drafts_ref(history, lengths, kd, self.min_n, self.max_n, out)


def step_drafts_ref(history: torch.Tensor, lengths: torch.Tensor, k: int, min_n: int,
                    max_n: int, out: StepOutputs) -> None:
    """The fused step's lookup in tensor ops (what ngram_lookup_triton writes with `step`):
    each row's drafts from `ngram_propose_ref`, its count capped at max(context - 1 - length,
    0) and 0 in rows not real, into out.drafts (0 past the count), out.marked (-1 past it) and
    out.counts."""
    drafts, counts = ngram_propose_ref(history, lengths, k, min_n, max_n)
    counts = torch.minimum(counts, (out.context - 1 - lengths).clamp(min=0))
    counts = torch.where(out.real, counts, 0)
    keep = torch.arange(k, device=drafts.device) < counts.unsqueeze(1)
    out.marked.copy_(torch.where(keep, drafts, -1))
    out.drafts.copy_(torch.where(keep, drafts, 0))
    out.counts.copy_(counts)


class _Staging:
    """The host side of a fill's one copy: a host buffer (pinned on CUDA, grown as needed)
    that the fill's arrays are written into and copied up from without blocking. A pinned
    buffer is written again only once the last copy out of it has run (an event recorded
    after it, polled: that copy was queued ahead of the step whose output the host read
    since, so this rarely waits)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pin = device.type == "cuda"
        self.host = None  # int64 [capacity]
        self.copied = None  # torch.cuda.Event after the last copy out of `host`

    def send(self, arrays: list, n: int) -> torch.Tensor:
        """The arrays' n int64 values, concatenated, on the device."""
        if not self.pin:
            return torch.from_numpy(np.concatenate(arrays))
        if self.copied is not None:
            while not self.copied.query():
                pass
        if self.host is None or self.host.numel() < n:
            self.host = torch.empty(max(n, 2 * (0 if self.host is None else self.host.numel()),
                                        1024), dtype=torch.int64, pin_memory=True)
        np.concatenate(arrays, out=self.host.numpy()[:n])  # sync-ok: host memory
        flat = self.host[:n].to(self.device, non_blocking=True)
        if self.copied is None:
            self.copied = torch.cuda.Event()
        self.copied.record()
        return flat
