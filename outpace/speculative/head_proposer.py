"""Chain drafting with a one-layer head whose KV lives in the target's pool (EAGLE-3, MTP).

Roll-by-one (docs/design.md, "Roll-by-one"): the draft KV entry at position q is computed from
the target's hidden at q and the token at q+1. Each step has two phases:

  first pass   the head runs over *every* target row of the step (prefill chunks and verify
               blocks alike), with input token = token at position+1. Rows whose next token is
               committed write exact entries; rows past the accepted prefix write filler that
               the draft loop or the next step overwrites before anyone reads it.
  draft loop   for a request with frontier f (committed length), the first pass's row at
               f-2 predicts draft 1 (the token at f). Draft step j >= 1 runs one row at
               position f-2+j with the head's previous output as hidden and draft j as token,
               and predicts draft j+1. It writes draft KV up to f+k-3 = p+a+k-1 <= p+2k-1,
               the lookahead the scheduler reserved (docs/design.md, "Scheduling and
               lookahead reservation").

    positions:  ... f-3  f-2 | f-1      f       f+1 ...
    tokens:     ...  c    c  |  x(c)   d1      d2
    first pass: exact entries up to f-2 (token at f-1 = x is committed)
    draft loop:            j=1 at f-1 (token d1) -> d2;  j=2 at f (token d2) -> d3 ...

The invariant "entries below the first row of a step are exact" holds by induction, which is
why a rejected draft needs no rewind. The draft loop uses its own input buffers, so nothing the
target's step shares is touched (docs/design.md, "The draft phase leaves the target's step
alone").
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from outpace.attention.base import ForwardContext
from outpace.kernels.argmax import argmax_rows
from outpace.kernels.int8_linear import int8_linear, quantize_int8_rows
from outpace.kernels.skinny_gemm import SMALL_M_MAX
from outpace.models.cpu_fast_paths import cpu_threads_for
from outpace.parallel.group import SINGLE
from outpace.attention.inputs import InputBuffers, build_host_batch
from outpace.speculative.base import DraftBatch, DraftWork, Proposer
from outpace.speculative.draft_length import DraftLengthPolicy
from outpace.speculative.injected_failures import InjectedFailures


class HeadProposer(Proposer):
    """Subclasses define first_hidden(batch), step(hidden, ids, pos, ctx) and draft_ids."""

    # The fused graph step (runner/fused_step.py) may run this head's draft loop on the device.
    supports_device_drafting = True

    def __init__(self, policy: DraftLengthPolicy, target, spec):
        self.policy = policy
        self.target = target
        self.runner = None
        self.enhancer = None
        # "int8": the drafts' LM head reads an int8 copy of its weight (quantized at bind; see
        # draft_ids_normed). Output is unaffected (the target verifies every draft); a draft
        # may differ where two logits are within the quantization error.
        self.draft_lm_head_dtype = spec.draft_lm_head_dtype
        self._int8_lm_head = None  # (int8 weight or its exact float copy on CPU, scale, d2t)
        self.injected = InjectedFailures(spec.inject_draft_failures)  # testing only
        self.work = DraftWork()
        if spec.enhancer_min_match:
            from outpace.speculative.model_free import SuffixProposer
            self.enhancer = SuffixProposer(DraftLengthPolicy(policy.k), spec)
            self.enhancer_min_match = spec.enhancer_min_match

    def bind(self, runner) -> None:
        # A weak back-reference: the runner owns the proposer, and a cycle between them would
        # outlive `del engine` once the builder has frozen the heap (gc.freeze) on CUDA.
        self.runner = weakref.proxy(runner)
        self.block_size = runner.block_size
        self.loop_inputs = InputBuffers(runner.inputs.max_seqs, runner.inputs.max_seqs,
                                        runner.inputs.max_blocks, runner.device)
        # a first pass over some of a step's requests (the others draft nothing: _first_pass)
        self.pass_inputs = InputBuffers(runner.inputs.max_tokens, runner.inputs.max_seqs,
                                        runner.inputs.max_blocks, runner.device)
        if self.draft_lm_head_dtype == "int8" and self._int8_lm_head is None:
            weight, offsets = self.draft_lm_head()
            with torch.no_grad():
                q, scale = quantize_int8_rows(weight)
            if q.device.type != "cuda":
                # the reference path multiplies in fp32: keep the integers as fp32 once
                # instead of converting the whole matrix every draft step
                q = q.float()
            self._int8_lm_head = (q, scale, offsets)

    def draft_lengths(self, reqs: list, batch_size: int) -> list:
        return self.policy.lengths([req.request_id for req in reqs], batch_size)

    def begin(self, request) -> None:
        if self.enhancer is not None:
            self.enhancer.begin(request)

    def finish(self, request_id: str) -> None:
        self.policy.forget(request_id)
        if self.enhancer is not None:
            self.enhancer.finish(request_id)

    # ---- subclass hooks -------------------------------------------------------------------
    def first_hidden(self, batch: DraftBatch) -> torch.Tensor:  # [T, H]
        raise NotImplementedError

    def step(self, hidden, input_ids, positions, ctx) -> torch.Tensor:  # -> [T, H]
        raise NotImplementedError

    def draft_norm(self):
        """The RMSNorm (weight, eps) before the head's LM head."""
        raise NotImplementedError

    def draft_lm_head(self) -> tuple:
        """(weight [V, H], offsets [V] or None): the LM head the drafts come from, and what
        turns its ids into target ids (EAGLE-3's d2t)."""
        raise NotImplementedError

    def draft_ids_from_lm_head(self, normed, also: tuple = ()) -> torch.Tensor:
        """draft_ids_normed through the head's own LM head, in its dtype."""
        raise NotImplementedError

    def draft_ids_normed(self, normed, also: tuple = ()) -> torch.Tensor:
        """[N, H] draft_norm'ed hidden -> [N] target token ids (greedy), also written into
        `also` (at most two [N] int64 views: the fused step's output and carry columns).
        With draft_lm_head_dtype "int8" the logits of up to SMALL_M_MAX rows come from the
        int8 copy (half the bytes of a bf16 LM head, the largest read of a small model's draft
        step at small batch). More rows share one read of the head's own LM head in a GEMM,
        where the int8 copy has no kernel (its reference would convert the whole matrix)."""
        if not self.int8_lm_head_for(normed.shape[0]):
            return self.draft_ids_from_lm_head(normed, also)
        q, scale, offsets = self._int8_lm_head
        return argmax_rows(int8_linear(normed, q, scale), offsets=offsets, also=also)

    def int8_lm_head_for(self, rows: int) -> bool:
        """Whether draft_ids_normed over this many rows reads the int8 copy."""
        return self._int8_lm_head is not None and rows <= SMALL_M_MAX

    def draft_ids(self, hidden, also: tuple = ()) -> torch.Tensor:
        """[N, H] head output -> [N] target token ids (greedy; `also`: draft_ids_normed)."""
        return self.draft_ids_normed(self.draft_norm()(hidden), also)

    def embed_args(self, hidden: torch.Tensor) -> dict:
        """The target's embedding for the head's step on `hidden`: embed_tokens, and its table
        too (the head's one-kernel gather + norms, kernels/embed_norm_cat.py) when the table's rows
        cast straight to hidden's dtype are embed_tokens' (the target computes in that dtype)."""
        t = self.target
        table = getattr(t, "embed_weight", None)
        if table is not None and (getattr(t, "dtype", None) != hidden.dtype
                                  or getattr(t, "tp", SINGLE).size > 1):  # a shard of it
            table = None
        return {"embed_fn": t.embed_tokens, "embed_weight": table}

    # ---- the two phases -------------------------------------------------------------------
    def propose(self, batch: DraftBatch, k: list) -> list:
        # On CPU a small step's drafting (the first pass over a verify block, one-row draft
        # steps) runs on one thread, as the target's forward does (cpu_threads_for)
        with cpu_threads_for(batch.positions, batch.meta.max_query_len):
            return self._propose(batch, k)

    def _propose(self, batch: DraftBatch, k: list) -> list:
        self.injected.begin(points=2)
        self.injected.at(0)  # before the first pass: this step's rows keep stale entries
        h, last_row = self._first_pass(batch)
        self.injected.at(1)  # after it: the plane is written, the drafts are not
        active = [i for i, ki in enumerate(k) if ki > 0 and last_row[i] >= 0]
        drafts = [[] for _ in k]
        if not active:
            return drafts
        rows = torch.tensor([last_row[i] for i in active], device=h.device)
        h = h.index_select(0, rows)  # [A, H]: head output at each request's position f-2
        tok = self.draft_ids(h)  # [A] draft 1
        record = [(list(active), tok)]
        for j in range(1, max(k[i] for i in active)):
            keep = [n for n, i in enumerate(active) if k[i] > j]
            if len(keep) < len(active):  # requests that have all their drafts drop out
                sel = torch.tensor(keep, device=h.device)
                h, tok = h.index_select(0, sel), tok.index_select(0, sel)
                active = [active[n] for n in keep]
            loop_rows = [([0], len(batch.committed[i]) - 2 + j, batch.block_ids[i], [0])
                         for i in active]
            _, pos, _, meta = self.loop_inputs.load(self.host_batch(loop_rows))
            h = self.step(h, tok, pos, ForwardContext(self.runner.backend, meta))
            self.work.loop_rows += len(active)
            tok = self.draft_ids(h)
            record.append((list(active), tok))
        flat = torch.cat([t for _, t in record]).tolist()  # sync-ok: the drafts are step output
        at = 0
        for idxs, _ in record:
            for i in idxs:
                drafts[i].append(flat[at])
                at += 1
        return self._enhance(batch, drafts, k)

    def host_batch(self, rows: list):
        """build_host_batch of these rows at the head's block size: the metadata of the draft
        loop, a gathered first pass and the MTP window (mtp_window.py) (tests wrap it on an
        instance to misplace writes)."""
        return build_host_batch(rows, self.block_size)

    def _first_pass(self, batch: DraftBatch) -> tuple:
        """The head over the rows of the requests whose first pass runs (batch.first_pass) ->
        (its output over those rows, each request's last_row in that output; -1 where skipped).
        Every request's: one pass over the target's rows with the target's metadata. Some:
        their rows gathered, with metadata of their own in `pass_inputs` (the target's stays
        untouched). None: no head work at all."""
        on = batch.first_pass
        total = len(batch.next_token_ids)
        if on is None or all(on):
            self.work.first_pass_rows += total
            ctx = ForwardContext(self.runner.backend, batch.meta)
            return (self.step(self.first_hidden(batch), batch.next_token_ids, batch.positions,
                              ctx), batch.last_row)
        self.work.skip(sum(b - a for a, b, run in zip(batch.row_start, batch.row_end, on)
                           if not run))
        last_row = [-1] * len(on)
        if not any(on):
            return None, last_row
        rows, host_rows, at = [], [], 0
        seq_lens = batch.meta.seq_lens_host
        for i, run in enumerate(on):
            if not run:
                continue
            a, b = batch.row_start[i], batch.row_end[i]
            rows.extend(range(a, b))
            host_rows.append((np.zeros(b - a, dtype=np.int64), seq_lens[i] - (b - a),
                              batch.block_ids[i], []))
            if batch.last_row[i] >= 0:
                last_row[i] = at + batch.last_row[i] - a
            at += b - a
        self.work.first_pass_rows += at
        dev = batch.next_token_ids.device
        idx = torch.tensor(rows, dtype=torch.long, device=dev)
        _, pos, _, meta = self.pass_inputs.load(self.host_batch(host_rows))
        sub = DraftBatch(requests=[], committed=[], row_start=[], row_end=[], last_row=[],
                         hidden=None if batch.hidden is None else batch.hidden[idx],
                         aux_hidden=[a[idx] for a in batch.aux_hidden])
        h = self.step(self.first_hidden(sub), batch.next_token_ids[idx], pos,
                      ForwardContext(self.runner.backend, meta))
        return h, last_row

    def _enhance(self, batch: DraftBatch, drafts: list, k: list) -> list:
        return self.enhance(batch.requests, batch.committed, drafts, k)

    def enhance(self, requests: list, committed: list, drafts: list, k: list) -> list:
        """Suffix enhancer: a long enough suffix match replaces the head's drafts (per request:
        its committed tokens, its drafts, its draft length). The fused step's graphs call it on
        the drafts they made, as the eager head does on its own, so both verify the same."""
        if self.enhancer is None:
            return drafts
        for i, (req, toks_so_far) in enumerate(zip(requests, committed)):
            if k[i] <= 0:
                continue
            toks, match_len = self.enhancer.match(req, toks_so_far, k[i])
            if toks and match_len >= self.enhancer_min_match:
                drafts[i] = toks[:k[i]]
        return drafts
