"""`DraftLoop`, the head's part of a fused graph: its first pass over every row of the step
(a decode graph of kd = 0 runs no head at all: fused_step.py; the prefill graphs run the pass
alone), then kd draft steps, each step's positions, slots and sequence lengths computed on the device. Decode
graphs (runner/fused_step.py) and the graphs around a prefill (runner/fused_prefill.py) run it.
"""

from __future__ import annotations

import torch

from outpace.attention.base import AttentionMetadata, ForwardContext
from outpace.kernels.norm import gather_rms_norm
from outpace.runner.step_bookkeeping import loop_inputs
from outpace.speculative.base import DraftBatch


class DraftLoop:
    """The draft loop of `head` (a HeadProposer that drafts on the device) over the step's
    attention `backend`; `max_seqs` rows at most."""

    def __init__(self, head, backend, block_size: int, max_seqs: int, device):
        self.head = head
        self.backend = backend
        self.block_size = block_size
        # every loop step's query starts: one token a request
        self.query_start = torch.arange(max_seqs + 1, dtype=torch.int32, device=device)

    def run(self, hidden, aux, next_ids, pos, ctx, last_rows, first, block_tables, kd,
            outs: tuple):
        """The head's first pass, then kd draft steps; draft j is written into column j of
        each of `outs` ([B, >= kd] int64, at most two) by the argmax kernel itself. -> the
        loop's positions and slots ([kd - 1, B] each, for the write check), or None (kd <= 1)."""
        head = self.head
        batch = DraftBatch(requests=[], committed=[], row_start=[], row_end=[], last_row=[],
                           hidden=hidden, aux_hidden=aux)
        h = head.step(head.first_hidden(batch), next_ids, pos, ctx)
        if kd == 0:
            return None
        # [B, H] head output at each request's f - 2, and its norm for the LM head: one kernel
        norm = head.draft_norm()
        normed, h = gather_rms_norm(h, last_rows, norm.weight, norm.eps)
        tok = head.draft_ids_normed(normed, also=tuple(o[:, 0] for o in outs))
        bucket = first.shape[0]
        if kd > 1:
            # Positions, slots and sequence lengths of every loop step at once ([kd-1, B], each
            # row contiguous): one kernel in place of ten per step.
            pos_all, slots_all, lens_all = loop_inputs(first, block_tables, self.block_size,
                                                       kd - 1)
        for j in range(1, kd):
            p = pos_all[j - 1]
            meta = AttentionMetadata(
                slot_mapping=slots_all[j - 1], query_start_loc=self.query_start[:bucket + 1],
                seq_lens=lens_all[j - 1], block_tables=block_tables,
                max_query_len=1, max_seq_len=block_tables.shape[1] * self.block_size)
            h = head.step(h, tok, p, ForwardContext(self.backend, meta))
            tok = head.draft_ids(h, also=tuple(o[:, j] for o in outs))
        return (pos_all, slots_all) if kd > 1 else None
