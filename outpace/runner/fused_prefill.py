"""The fused step's prefill graphs (PrefillGraphs, a part of runner/fused_step.FusedStep).

Prefill (a head only): a step of one request's prefill chunk runs the target in a prefill graph
(runner/cuda_graph.py) and samples on the host; the head's pass over the chunk and its draft
loop then replay a second graph, captured per prefill graph over that graph's static hidden
states (`PrefillGraphs.drafts`). Eagerly that pass and loop are ~40 Triton launches from Python for
microseconds of GPU work each: they would be most of a head engine's batch-1 TTFT
(decisions-log.md, "A head's prefill pass replays a graph").

Where steps chain, a prefill step that samples is launched like a decode step instead
(`PrefillGraphs.launch`): the prefill graph, then a tail graph that takes the token from the prefill
graph's logits (the argmax, or the race of a sampled or masked graph: one tail per sampling
family, as the decode graphs have), runs the head's pass and draft loop from it, and leaves
token, drafts and position in the carry and in an output laid out as a one-token decode step's.
So the first decode step chains from the prefill too (not with the device n-gram: `tails_on`),
rather than waiting for the host to read the token (an unchained step takes much longer than a
chained one: docs/decisions.md, "The first decode step chains from the prefill"); sampled and
masked requests' prefills take it as greedy ones do, rather than the slower general path. A
logprobs family's tail also leaves the first token's logprobs in a second output, as its decode
graphs do, so those prefills stay off the general path too.

Varlen (a head only): a step that replays a varlen graph of T tokens (several prompts' chunks,
chunks beside decodes) samples on the host, then replays the head's graph for T
(`varlen_drafts`): the head's pass over the T rows and its draft loop over every sequence
slot, a row per slot in the varlen batch's order, reading the block tables that batch staged.
A slot that drafts nothing (a chunk that samples nothing, padding) drafts from its own last
row: its loop writes only at positions its next chunk rewrites, or into the null block.
Eagerly that pass and loop are milliseconds of launches from Python at batch 8, about as long
as the varlen step itself (decisions-log.md, "A head's pass and drafts after a varlen graph,
in graphs").
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from outpace.attention.base import ForwardContext
from outpace.kernels.argmax import argmax_rows
from outpace.runner.graph_mode import BASE_MODES, GREEDY, GraphMode, graph_mode

if TYPE_CHECKING:
    from outpace.runner.fused_step import Launched


class PrefillGraphs:
    """A part of FusedStep: the graphs around a prefill. They read the step's staged buffers
    and carry, and run its head's draft loop (FusedStep.draft_loop) and replay (FusedStep._replay):
    `step` is the FusedStep that owns this part (a weak proxy)."""

    def __init__(self, step):
        self.step = step
        # Prefill: (q, kd) -> (graph, (drafts [1, kd],) or ()), and what the host fills in:
        # the token after every row, the row whose head output drafts (drafts).
        self.heads: dict = {}
        # A prefill's end where steps chain: (GraphMode, q, kd) -> (graph, packed
        # [1, 2 + kd]) (launch)
        self.tails: dict = {}
        self.launches = 0  # prefill steps launched that way (tests read it)
        # prefill_next_ids and prefill_last_row: staged buffers made in FusedStep.__init__
        self.replays = 0  # prefill steps whose head ran from a graph (tests read it)
        # A varlen step's head: (T, kd) -> (graph, (drafts [max_num_seqs, kd],) or ())
        # (varlen_drafts)
        self.varlen_heads: dict = {}
        self.varlen_head_replays = 0  # varlen steps whose head ran from a graph (tests read it)

    def capture(self) -> None:
        """Capture, for every prefill graph, the head's graphs: its pass over the chunk alone
        (kd = 0: a chunk that samples nothing, or no drafts wanted) and with the batch-1 draft
        loop; and where steps chain, the tail of a greedy prefill (launch). At
        start-up only: capturing fills the input buffers with a dummy batch, which would
        clobber a prefill step's inputs in between its two graphs."""
        for q in self.step.graphs.prefill_graphs:
            for kd in sorted({0, self.step.lengths.draft_steps(1)}) if self.step.head is not None else ():
                if (q, kd) not in self.heads:
                    self.heads[(q, kd)] = self._capture_head(q, kd)
            kd = self.step.lengths.draft_steps(1)
            for mode in BASE_MODES if self.tails_on else ():
                if (mode, q, kd) not in self.tails:
                    self.tails[(mode, q, kd)] = self._capture_head(
                        q, kd, tail=True, mode=mode)
        for t in self.step.graphs.varlen_graphs if self.step.head is not None else ():
            for kd in sorted({0, self.varlen_kd}):
                if (t, kd) not in self.varlen_heads:
                    self.varlen_heads[(t, kd)] = self._capture_varlen_head(t, kd)

    @property
    def tails_on(self) -> bool:
        """Whether a prefill is launched like a decode step (`launch`): where steps chain and
        the drafts are not the device n-gram's (its tail would need the history filled for
        the prefill; its first decode step is launched from the host instead), nor MTP depths
        mode's window (its tail would need the window: its first decode step likewise)."""
        return self.step.chainable and self.step.ngram is None and self.step.window is None

    @property
    def varlen_kd(self) -> int:
        """The varlen head graphs' draft-loop length: the most any batch size drafts (a
        request's own k is a prefix of it)."""
        return max(self.step.lengths.draft_steps(b) for b in (1, *self.step.graphs.buckets))

    @torch.inference_mode()
    def drafts(self, q: int, next_ids: np.ndarray, last_row: int, k: int,
                       batch_size: int) -> Optional[list]:
        """The head's pass and k drafts for a single-request prefill step that just ran in the
        prefill graph of q rows (its hidden states and inputs still in the fixed buffers):
        next_ids [q], the token after every row; last_row, the row of position f - 2 (f: the
        committed length after this step's token); k, the request's draft length (0: the pass
        alone). -> the drafts, or None when no graph fits (the caller runs the head eagerly).
        The loop runs kd >= k steps; past k its positions may pass the context's end, which
        the rope tables' margin covers (models/rotary.py)."""
        kd = self.step.lengths.draft_steps(batch_size) if k > 0 else 0
        entry = self.heads.get((q, kd))
        if entry is None or kd < k:
            return None
        graph, outs = entry
        staged = [(self.step.prefill_next_ids, next_ids)]
        if kd:  # only the draft loop reads the row that drafts
            staged.append((self.step.prefill_last_row, np.array([last_row], np.int64)))
        self.step.inputs.put_all(staged)
        self.step.graphs.replay(graph, "head")  # after the step's eager sampling
        self.replays += 1
        if kd == 0:
            return []
        return outs[0][0, :k].tolist()  # sync-ok: the step's drafts, read once

    @torch.inference_mode()
    def varlen_drafts(self, t: int, next_ids: np.ndarray, last_rows: list, ends: list,
                      ks: list) -> Optional[list]:
        """The head's pass and drafts for a step that just ran in the varlen graph of t
        tokens (its hidden states and staged batch still in the fixed buffers): next_ids [n],
        the token after every real row; per scheduled request (the batch's sequences, in
        order) the row of its position f - 2 (-1: it drafts nothing), the end of its rows and
        its draft length. -> each request's drafts, or None when no graph fits (the caller
        runs the head eagerly)."""
        if self.step.head is None:
            return None
        kd = self.varlen_kd if max(ks, default=0) > 0 else 0
        entry = self.varlen_heads.get((t, kd))
        if entry is None or max(ks, default=0) > kd:
            return None
        m = self.step.runner.max_num_seqs  # the scheduler's slots (the spare one holds padding)
        own = [k for last, k in zip(last_rows, ks) if last >= 0]
        if any(self.step.head.int8_lm_head_for(m) != self.step.head.int8_lm_head_for(
                sum(k > j for k in own)) for j in range(max(ks, default=0))):
            return None  # the eager loop's rows (those still drafting) read the other LM head
        graph, outs = entry
        n = len(next_ids)
        rows = np.full(m, n if n < t else 0, np.int64)  # padding: row n
        for i, (last, end) in enumerate(zip(last_rows, ends)):
            rows[i] = last if last >= 0 else end - 1
        self.step.inputs.put_all([(self.step.varlen_next_ids, next_ids), (self.step.varlen_last_rows, rows)])
        self.step.graphs.replay(graph, "head")  # after the step's eager sampling
        self.varlen_head_replays += 1
        if kd == 0:
            return [[] for _ in ks]
        drafts = outs[0][:len(ks)].tolist()  # sync-ok: the step's drafts, read once
        return [d[:k] for d, k in zip(drafts, ks)]

    def _capture_varlen_head(self, t: int, kd: int):
        """The head's pass over varlen graph t's rows and kd drafts for every slot the
        scheduler fills (varlen_drafts; not the input buffers' spare slot, which only ever
        holds padding), captured over a batch of padding."""
        _, hidden, aux = self.step.graphs.varlen_graphs[t]
        buf = self.step.inputs
        m = self.step.runner.max_num_seqs
        self.step.graphs.load_varlen_padding(t)
        self.step.varlen_next_ids.zero_()
        self.step.varlen_last_rows.zero_()
        meta = self.step.graphs._varlen_meta(t)
        pos = buf.positions[:t]

        def fn():
            last = self.step.varlen_last_rows[:m]
            first = pos.index_select(0, last)
            outs = (torch.empty(m, kd, dtype=torch.long, device=pos.device),)
            self.step.draft_loop.run(hidden, aux, self.step.varlen_next_ids[:t], pos,
                                     ForwardContext(self.step.backend, meta), last, first,
                                     buf.block_tables[:m], kd, outs)
            return outs if kd else ()
        return self.step.graphs.capture(fn)

    def _capture_head(self, q: int, kd: int, tail: bool = False,
                              mode: GraphMode = GREEDY):
        """The head's pass and kd drafts over prefill graph q's hidden states, from the
        host's next ids (drafts). With `tail`, a prefill's whole end (launch):
        its token, from the graph's logits as a decode graph of `mode` draws it (the argmax,
        or the race with the staged sampling of row 0), follows the sampled row; then the
        head (if any) drafts, and the token and drafts land in the output [1, 2 + kd] laid
        out as a decode step's (token | 0 accepted | drafts) and, with the token's position,
        in the carry that the next (chained) step starts from."""
        _, hidden, aux, logits = self.step.graphs.prefill_graphs[q]
        buf = self.step.inputs
        self.step.graphs.fill_dummy(1, q)
        self.step.sampling.greedy_rows(1)
        self.step.penalties.neutral_rows(1)
        self.step.prefill_next_ids.zero_()
        self.step.prefill_last_row.zero_()  # the loop then stays at positions 1 .. kd - 1
        # the prefill graph's own metadata (full-width block table, static bounds)
        meta = self.step.graphs._meta(1, q, buf.max_blocks * self.step.block_size)
        pos = buf.positions[:q]

        def fn():
            first = pos.index_select(0, self.step.prefill_last_row)
            logprobs = None
            if tail:
                packed = torch.zeros(1, 2 + kd, dtype=torch.long, device=pos.device)
                if not mode.samples:
                    tok = argmax_rows(logits, also=(packed[:, 0], self.step.carry_tokens[:1, 0]))
                else:  # the token at first + 1, drawn as the decode graphs of `mode` draw
                    rows = logits
                    if mode.penalties:  # (row 0's tables: the prompt, no output yet)
                        rows = self.step.penalties.penalize(logits.clone(), first, 1, 1)
                    tok = self.step.sampling.sample_logits(rows, first, 1, 1, masks=mode.masks)
                    packed[:, 0].copy_(tok)
                    self.step.carry_tokens[:1, 0].copy_(tok)
                    if mode.penalties:  # the first output token, for the next step
                        self.step.penalties.count_emitted(packed, 1, 1)
                if mode.logprobs:  # the raw logits (penalties went to a clone)
                    logprobs = self.step.sampling.logprobs(logits, packed, 1, 1)
                if self.step.head is not None:
                    self.step.prefill_next_ids[:q].index_copy_(0, self.step.prefill_last_row, tok)
                torch.add(first, 1, out=self.step.carry_pos[:1])
                outs = (packed[:, 2:], self.step.carry_tokens[:1, 1:1 + kd])
            else:
                outs = (torch.empty(1, kd, dtype=torch.long, device=pos.device),)
            if self.step.head is not None:
                self.step.draft_loop.run(hidden, aux, self.step.prefill_next_ids[:q], pos,
                                         ForwardContext(self.step.backend, meta),
                                         self.step.prefill_last_row, first,
                                         buf.block_tables[:1], kd, outs)
            if tail:
                return packed if logprobs is None else (packed, logprobs)
            return outs if kd else ()
        return self.step.graphs.capture(fn)

    def can_launch(self, plan, q: int) -> bool:
        """Whether `launch` serves plan (one request's prefill chunk that samples, padded
        to prefill graph q, with a tail of its sampling family; the tail of a family with
        penalties or logprobs is captured by `launch` when first needed)."""
        sr = plan.scheduled[0]
        mode = graph_mode([sr.request.sampling_params])
        if mode not in BASE_MODES:  # penalties or logprobs: a tail captured when needed
            return sr.sample and self.tails_on and q in self.step.graphs.prefill_graphs
        return sr.sample and (mode, q, self.step.lengths.draft_steps(plan.draft_batch_size)) \
            in self.tails

    @torch.inference_mode()
    def launch(self, plan, hb, q: int) -> Launched:
        """A prefill step launched like a decode step, so that the first decode step chains
        from it on the device (LLMEngine._chain) instead of waiting for the host: the prefill
        graph, then its tail graph (its token, the head's pass and drafts, the carry). Its
        output reads as a decode step's of one token (collect); a sampled request's chained
        steps replay its family's graphs with the sampling staged here."""
        t0 = time.perf_counter()
        kd = self.step.lengths.draft_steps(plan.draft_batch_size)
        n = plan.scheduled[0].num_new_tokens
        mode = graph_mode([plan.scheduled[0].request.sampling_params])
        if mode not in BASE_MODES and (mode, q, kd) not in self.tails:
            # Nothing is in flight (PrefillGraphs.launch follows can_launch, as FusedStep.launch does): the
            # tail, and the decode graphs that chain from it
            self.step.table.capture_later((1, self.step.next_q(kd), kd, False), mode)
            self.tails[(mode, q, kd)] = self._capture_head(q, kd, tail=True,
                                                                            mode=mode)
        extra = [(self.step.prefill_last_row, np.array([n - 1], np.int64)),
                 (self.step.real, np.ones(1, bool))]
        extra += self.step.sampling.mode_rows(plan, 1, mode)
        if self.step.head is not None:  # the token after each row; the last one's is the sample
            next_ids = np.zeros(q, np.int64)
            next_ids[:n - 1] = hb.input_ids[1:n]
            extra.append((self.step.prefill_next_ids, next_ids))
        self.step.graphs.run_prefill(hb, extra=tuple(extra))  # staged with the batch (primed)
        if mode.penalties:
            # row 0's tables, queued between the prefill graph (which doesn't read them) and
            # the tail (which does): their host launches then run while the device runs the
            # prefill, not before it
            self.step.penalties.fill_tables(plan, 1)
        self.launches += 1
        launched = self.step._replay((1, 1, kd, False), [plan.scheduled[0].request.request_id], t0,
                                entry=self.tails[(mode, q, kd)], prefill=True)
        launched.mode = mode
        # under the cost model the first decode step's draft lengths (the tail drafts kd)
        launched.next_k = self.step.lengths.choose_next(plan)
        return launched

