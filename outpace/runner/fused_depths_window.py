"""`DepthsWindow`, MTP depths mode's part of a fused graph: the frontier-anchored window of
speculative/mtp_window.py with all its geometry computed on the device from the step's
accepted counts, a fixed number of rows per request and the stash in fixed device buffers, so
that a depths-mode decode step replays as one graph with no host sync, and chains.

The eager window (MTPWindowProposer) stays the reference and serves every other step. For a
decode step of request b (its q rows start at s, the last committed token; `a` drafts
accepted, so f = s + a + 2 tokens are committed and e = f - 1 KV positions computed) the eager
window re-runs positions lo .. e-1 at every depth d < K, with

    lo = s                                          without a usable stash (none, or not ending at s)
    lo = max(min(s, e - W, m - W), stash start, 0)  otherwise

with m staged with the stash (`stage`: the eager rule's, e.g. the prompt's end after a mid-prompt
chunk whose last token this step computes) and, after a fused step, none: its drafts are the
fed ones (no enhancer replaces them), and verification commits a prefix of them followed by a
token that is not the next fed draft or by a bonus token, so m >= e. e - lo <= K + 1 (the
rule's terms: a + 1 <= K + 1, W <= K, and m - W >= e + 1 - W where m is staged), so a
window of R = K + 1 rows ending at e - 1 (positions e - R .. e - 1) holds every row the eager
window runs; rows below lo are computed but write nothing (slot -1), so the entries written are
exactly the eager window's, each from the same inputs. A row at p >= s takes h^0 from this
step's target rows, one below s from the stash. The token of row p at depth d is the token at
p + d + 1: the stash's for positions <= s, this step's emitted ones up to f - 1, else draft
(p + d + 1 - f), made at row e - 1 by an earlier depth.

The stash (per graph row, in `rows` order: a chained step keeps its predecessor's rows) holds
h^0 of positions end - K .. end - 1 (valid from `start`), the tokens at end - K + 1 .. end, and
end (-1: none). A step launched from the host stages the rows whose request's stash is not
already there (`stage`), from the proposer's host stash; the proposer reads a stash that is
still only here when the eager window next runs for its request (`pull`).

A request needs s >= K (every window position >= 0: FusedStep.accepts declines otherwise), and
the step's query length at most R.
"""

from __future__ import annotations

import torch

from outpace.attention.base import AttentionMetadata, ForwardContext
from outpace.kernels.argmax import argmax_rows
from outpace.speculative.mtp_window import RequestStash


class DepthsWindow:
    """The window of `proposer` (an MTPWindowProposer) in a graph over `backend`; at most
    `max_seqs` rows, hidden size `hidden_size` in `dtype`."""

    NONE = 1 << 60  # m where no fed token was wrong

    def __init__(self, proposer, backend, block_size: int, max_seqs: int, hidden_size: int,
                 dtype, device):
        self.proposer = proposer
        self.backend = backend
        self.block_size = block_size
        self.K = proposer.depth
        self.W = proposer.window
        if not 1 <= self.W <= self.K:  # pragma: no cover - a test's narrower window only
            raise ValueError(f"the window's width {self.W} must be in 1..{self.K}")
        self.R = self.K + 1  # rows per request
        K, R = self.K, self.R
        self.hidden = torch.zeros(max_seqs, K, hidden_size, dtype=dtype, device=device)
        self.tokens = torch.zeros(max_seqs, K, dtype=torch.long, device=device)
        self.start = torch.zeros(max_seqs, dtype=torch.long, device=device)
        self.end = torch.full((max_seqs,), -1, dtype=torch.long, device=device)
        self.unfed = torch.full((max_seqs,), self.NONE, dtype=torch.long, device=device)  # m
        self.query_start = torch.arange(max_seqs + 1, dtype=torch.int32, device=device) * R
        self.offsets = torch.arange(R, device=device)  # row r of a window: position e - R + r
        self.span = torch.arange(R + 1, device=device) - K  # ..., and e: s + a + these
        # -1 (a padding row's end, a row's slot where it writes nothing) as a tensor: a Python
        # scalar there becomes a device tensor at every call
        self.minus_one = torch.tensor(-1, dtype=torch.long, device=device)
        self.rows: dict = {}  # request id -> its stash's row here (kept by the last step)
        proposer.device_stash = self

    # ---- the stash between host and device ---------------------------------------------------
    def pull(self, request_id: str, start: int, end: int):
        """The stash of `request_id` still held here -> [end - start, H] hiddens (a copy)."""
        row = self.rows.pop(request_id)
        return self.hidden[row, self.K - (end - start):].clone()

    def forget(self, request_id: str) -> None:
        self.rows.pop(request_id, None)

    def stage(self, requests: list, bucket: int, pull_all: bool = False) -> None:
        """Before a step launched from the host over `requests` (graph rows 0..): every stash
        the step's rows would overwrite, or that moves to another row, is pulled to the host
        first (pull_all: every stash, as before a capture, which writes every row), then each
        request's stash is put in its row unless it is there already."""
        want = {req.request_id: b for b, req in enumerate(requests)}
        prop = self.proposer
        for rid, row in list(self.rows.items()):
            moved = want.get(rid, row) != row  # staged into another row below
            if pull_all or moved or (row < bucket and rid not in want):
                st = prop.stash.get(rid)
                if st is not None and st.hidden is None:
                    st.hidden = self.pull(rid, st.start, st.end)
                else:
                    self.rows.pop(rid)
        K = self.K
        for b, req in enumerate(requests):
            rid = req.request_id
            if self.rows.get(rid) == b:
                continue
            st = prop.stash.get(rid)
            s = req.num_tokens - 1
            if (st is None or st.preemptions != req.num_preemptions or st.end != s
                    or st.hidden is None):
                self.end[b] = -1  # the window starts at s, as the eager one would
                continue
            n = st.end - st.start
            self.hidden[b, K - n:].copy_(st.hidden)
            toks = req.all_token_ids[s - K + 1:s + 1]
            host = torch.tensor(toks, dtype=torch.long)
            if self.tokens.is_cuda:  # pinned: the copy is queued, the host doesn't wait
                host = host.pin_memory()
            self.tokens[b].copy_(host, non_blocking=True)
            self.start[b] = st.start
            self.end[b] = st.end
            # m: after a mid-prompt chunk its filler from the prompt's end on; after a step
            # that drafted, none (m >= e: see the module docstring)
            self.unfed[b] = st.frontier if st.fed is None else self.NONE
            self.rows[rid] = b

    def drafter_work(self, num_requests: int) -> None:
        """Count a step's window rows as the proposer's head work (DraftWork)."""
        self.proposer.work.first_pass_rows += self.R * num_requests

    def kept(self, requests: list, rows: list, steps: list) -> None:
        """After a step that ran the window, its output read (before it is committed): each
        request's host stash now says what the graph left in the request's row `rows[i]`
        (its hiddens stay here until pulled), by the graph's rule. steps: per request, the
        step's (accepted count, drafts)."""
        prop = self.proposer
        for b, req, (a, d) in zip(rows, requests, steps):
            rid = req.request_id
            s = req.num_tokens - 1
            e = s + a + 1
            st = prop.stash.get(rid)
            lo = s
            if st is not None and st.end == s and st.preemptions == req.num_preemptions:
                lo = min(s, e - self.W)
                if st.fed is None:  # as staged (stage)
                    lo = min(lo, st.frontier - self.W)
                lo = max(lo, st.start, 0, e - self.R)
            prop.stash[rid] = RequestStash(start=max(lo, e - self.W), end=e, hidden=None,
                                           frontier=e + 1, fed=list(d[:self.K - 1]),
                                           preemptions=req.num_preemptions)
            self.rows[rid] = b

    # ---- the window in the graph ------------------------------------------------------------
    def run(self, hidden, emitted, accepted, pos, real, block_tables, q: int,
            kd: int, outs: tuple):
        """The window of a decode step of `bucket` rows of q tokens (hidden [B*q, H] the
        target's output, pos [B*q], emitted [B, q] the step's tokens (-1 past the
        accepted), accepted [B], real [B]); draft j is written into column j of each of `outs`
        ([B, >= kd] int64). Updates the stash. -> the window's positions and slots [B, R]."""
        prop, K, R, W = self.proposer, self.K, self.R, self.W
        B, a = accepted.shape[0], accepted
        s = pos.view(B, q)[:, 0]
        span = (s + a).unsqueeze(1) + self.span  # [B, R + 1]: positions e - R .. e
        P, e, e_w = span[:, :R], span[:, R], span[:, R - W]
        # lo without the rule's terms e - R and 0: every row is >= e - R, and lo >= 0 already
        # (s and every stash start are), so neither changes which rows are below lo nor the
        # stash's start max(lo, e - W)
        lo = torch.minimum(torch.minimum(s, e_w), self.unfed[:B] - W)
        lo = torch.where(self.end[:B] == s, torch.maximum(lo, self.start[:B]), s)
        valid = (P >= lo.unsqueeze(1)) & real.unsqueeze(1)
        # h^0 and the depth-0 tokens: row r (position s + a - K + r) is entry a + r of
        # [stash | this step's rows] (h^0 from position s - K, tokens from s - K + 1); a < q
        # keeps it in range
        at = a.unsqueeze(1) + self.offsets
        both = torch.cat([self.hidden[:B], hidden.view(B, q, -1)], dim=1)
        h0 = both.gather(1, at.unsqueeze(2).expand(-1, -1, both.shape[2]))  # [B, R, H]
        # a request's tokens at positions e - K .. e + K (the committed ones up to e, then the
        # drafts, written as they are made): depth d's token of row r is entry r + d
        seq = torch.empty(B, R + K, dtype=torch.long, device=a.device)
        torch.gather(torch.cat([self.tokens[:B], emitted], dim=1), 1, at, out=seq[:, :R])
        # the stash the next step reads (h0 and seq are new tensors: the old stash was read)
        self.hidden[:B].copy_(h0[:, R - K:])
        self.tokens[:B].copy_(seq[:, 1:R])
        torch.maximum(lo, e_w, out=self.start[:B])
        torch.where(real, e, self.minus_one, out=self.end[:B])
        self.unfed[:B].fill_(self.NONE)
        # the window's metadata: rows below lo (and padding rows) write nothing; slots_for's
        # slots, the block table read in one gather
        ppos = P.clamp(min=0)
        blocks = block_tables.gather(1, (ppos // self.block_size).clamp_(
            max=block_tables.shape[1] - 1))
        slots = torch.add(ppos % self.block_size, blocks, alpha=self.block_size)
        slots = torch.where(valid, slots, self.minus_one)
        meta = AttentionMetadata(
            slot_mapping=slots.view(-1), query_start_loc=self.query_start[:B + 1],
            seq_lens=e.clamp(min=R).to(torch.int32),
            block_tables=block_tables, max_query_len=R,
            max_seq_len=block_tables.shape[1] * self.block_size)
        ctx = ForwardContext(self.backend, meta)
        flat_pos = ppos.view(-1)
        num_out = max(K - 1, kd)
        h = h0.view(B * R, -1)
        for d in range(K):
            h = prop.head(d, h, seq[:, d:d + R].reshape(-1), flat_pos, ctx,
                          **prop.embed_args(h))
            if d < num_out:  # draft d, at row e - 1: into seq, which the next depths read, and
                # the first output (argmax writes two views at most; the rest copy after)
                logits = prop.head.compute_logits(h.view(B, R, -1)[:, R - 1], prop.target, d)
                argmax_rows(logits, also=(seq[:, R + d],) + tuple(
                    o[:, d] for o in outs[:1] if d < kd))
        for o in outs[1:]:
            o[:, :kd].copy_(seq[:, R:R + kd])
        return ppos, slots
