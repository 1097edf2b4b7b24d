"""The fused step's penalties (runner/fused_step.py): repetition, frequency and presence
penalties inside the captured graphs, so a batch with a penalized request decodes at graph speed
instead of falling back to the general path, which is several times slower a step (eager
sampling with host syncs; decisions-log.md, "penalties and logprobs in the fused graphs").

A row's penalties read the tokens before it: its request's prompt (repetition only), its output
so far, and in a verify step the drafts in the rows before it (SamplingStep.run gives row j the
history plus drafts[:j]). The graphs keep, per batch row, two tables over the vocabulary:

    prompt [m, V] bool     the request's prompt tokens
    counts [m, V] float32  how often each token occurs in its output so far

A step launched from a host batch (FusedStep.launch: the rows' requests may have changed since
the last step) fills its rows' tables from the committed tokens before its graph runs, with
eager kernels queued ahead of the replay (no host sync). The graph then advances `counts` itself
after accept, by each row's emitted tokens, so the steps chained or relaunched from it need
nothing from the host. A row's token is chosen from its request's tables plus the drafts in the
rows before it: exactly the history the general path gives that row, with the values of the
same `penalize` (on CUDA one kernel per step for the penalties and one for the count,
sample/penalty_kernels.py), so graph and eager steps draw the same tokens.

Rows without penalties stage 1, 0, 0, which `penalize` leaves bit for bit unchanged, so a
penalized graph serves them too. Penalized graphs (the "+penalties" modes) are captured when a
key is first launched with a penalized request (never while a step is in flight), with the
chained and relaunched graphs that follow it; the tables are made then (5 bytes x m x V: 63 MB
for 256 rows of a 49152-id vocabulary).
"""

from __future__ import annotations

import numpy as np
import torch

from outpace.sample.penalty_kernels import count_emitted, penalize_rows


class StepPenalties:
    """A part of FusedStep: the per-row penalty buffers and tables, their staging and filling,
    and the graph's penalty and update."""

    def __init__(self, inputs, vocab_size: int):
        self.inputs, self.vocab_size = inputs, vocab_size
        m = inputs.max_seqs
        # Staged at launch (chained and relaunched steps keep their first step's rows):
        # repetition, frequency and presence penalty of each row (1, 0, 0: none).
        self.pen_rep, self.pen_freq, self.pen_pres = self.inputs.add_buffers(
            [((m,), torch.float32)] * 3)
        self.pen_prompt = None  # [m, V] bool, made by ensure_tables
        self.pen_counts = None  # [m, V] float32

    def ensure_tables(self) -> None:
        """Make the tables (once: graphs capture their addresses)."""
        if self.pen_counts is None:
            m, vocab = self.inputs.max_seqs, self.vocab_size
            dev = self.inputs.input_ids.device
            self.pen_prompt = torch.zeros(m, vocab, dtype=torch.bool, device=dev)
            self.pen_counts = torch.zeros(m, vocab, dtype=torch.float32, device=dev)

    def neutral_rows(self, bucket: int) -> None:
        """Every row of a bucket without penalties (graphs are captured over such a batch)."""
        self.pen_rep[:bucket].fill_(1.0)
        self.pen_freq[:bucket].zero_()
        self.pen_pres[:bucket].zero_()

    def rows(self, plan, bucket: int) -> list:
        """(buffer, values) pairs of a penalized graph's per-row penalties; padding rows and
        requests without penalties get 1, 0, 0."""
        cols = np.zeros((3, bucket), np.float32)
        cols[0] = 1.0
        for i, sr in enumerate(plan.scheduled):
            p = sr.request.sampling_params
            cols[:, i] = (p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
        return [(self.pen_rep, cols[0]), (self.pen_freq, cols[1]), (self.pen_pres, cols[2])]

    def fill_tables(self, plan, bucket: int) -> None:
        """The tables of rows [0, bucket) from the committed tokens of plan's requests (empty
        for padding rows and requests without penalties). Eager kernels queued on the stream
        ahead of the step's replay; the token ids go up in one non-blocking copy from pinned
        memory (the caching host allocator keeps it until the copy is done)."""
        vocab = self.pen_counts.shape[1]
        self.pen_prompt[:bucket].zero_()
        self.pen_counts[:bucket].zero_()
        prompt, output = [], []
        for i, sr in enumerate(plan.scheduled):
            req = sr.request
            if req.sampling_params.needs_penalties:
                tokens = np.asarray(req.all_token_ids, np.int64)
                n_prompt = req.num_prompt_tokens
                prompt.append(i * vocab + tokens[:n_prompt])
                output.append(i * vocab + tokens[n_prompt:])
        if not prompt:
            return
        n_prompt = sum(len(a) for a in prompt)
        flat = torch.from_numpy(np.concatenate(prompt + output))
        if self.pen_counts.is_cuda:
            flat = flat.pin_memory().to(self.pen_counts.device, non_blocking=True)
        self.pen_prompt.view(-1).index_fill_(0, flat[:n_prompt], True)
        out = flat[n_prompt:]
        self.pen_counts.view(-1).index_add_(0, out, torch.ones(out.shape, device=out.device))

    def penalize(self, logits: torch.Tensor, ids: torch.Tensor, bucket: int,
                 q: int) -> torch.Tensor:
        """[n, V] float32 logits of a step's rows (n = bucket * q, input ids `ids`) -> penalized
        (in place on CUDA): each row's request's tables, its earlier drafts counted as output
        (sample/penalty_kernels.py)."""
        return penalize_rows(logits, self.pen_prompt, self.pen_counts, ids, self.pen_rep,
                             self.pen_freq, self.pen_pres, bucket, q)

    def count_emitted(self, packed: torch.Tensor, q: int, bucket: int) -> None:
        """After accept: add each row's emitted tokens (packed[:, :q] up to its accepted count
        packed[:, q], -1 past it) to its output counts."""
        count_emitted(packed[:bucket], q, self.pen_counts)
