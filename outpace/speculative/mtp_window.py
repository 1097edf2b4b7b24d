"""MTP "depths" mode: module d drafts token d+1, over a frontier-anchored window (docs/design.md,
"MTP: eagle mode and the frontier-anchored window").

Module d (0-based) at position i reads h^d_i (h^0 = the target's hidden at i) and the token
t[i+d+1]; its output h^{d+1}_i predicts t[i+d+2]. With f committed tokens (t[0..f-1]; target
hiddens exist up to f-2), draft j (1-based, the token at f-1+j) is module j-1's prediction at
position f-2, whose input token t[f-2+j] is committed for j=1 and draft j-1 otherwise.

Module d's KV entry at i depends on t[i+1 .. i+d+1] (its own input token and, through h^d and
the attention, those of lower depths and positions), so it is exact only once they are all
committed. Every step therefore re-runs, for every depth, one window of rows per request that
ends at the last computed position e-1 (= f-2 after sampling):

    positions:     lo ........ s-1 | s ............. e-1 | e = f-1   f     f+1
    h^0 from:      the stash       | this step's target   |
    token of row i at depth d: t[i+d+1] if committed, else draft (i+d+1-f) of this step
    depth 0:       t[lo+1] ...                 t[e]  (all committed)
    depth 1:       t[lo+2] ...       t[e]    draft0  -> row e-1 predicts draft 1
    depth 2:       t[lo+3] ...  t[e]  draft0  draft1 -> row e-1 predicts draft 2

  s  = first target position of this step, e = KV positions computed after it,
  lo = max(0, min(s, e - W, m - W)), W = K = the configured number of drafts, m = the first
       position that last step's window fed with a token that did not get committed (the
       prompt's end for a mid-prompt chunk, whose rows past the prompt got filler).

Why W = K suffices: entry (d, i) is inexact only when one of its tokens t[i+1..i+d+1] was fed
wrong, i.e. i+d+1 >= m, so i >= m - 1 - d >= m - K (d <= K-1). With plain verification the
accepted drafts are exactly the tokens fed and the first rejected one sits at e, so m >= e and
the next window [e - K, e-1] covers every such entry; everything below it is exact by
induction. The m term matters only when the drafts sent out differ from the ones fed (the
suffix enhancer replaced them). Only the first K modules run: a module d >= K would leave
inexact entries down to m - 1 - d, below a K-row window, and never drafts; so the draft plane
needs K layer slots, not D. Rows below s need target hiddens of positions computed earlier:
the per-request stash keeps those of the last K computed positions. Where it does not reach (a
new request with a prefix hit, a resume after preemption) the window starts at s: entries
below came from the prefix cache, and the window never writes into a shared block.

Every module runs every step for mid-prompt requests and those that draft (their KV must stay
exact); only the LM head at row e-1 is skipped where nobody needs it. A request whose draft
length is 0 gets no window at all (DraftBatch.first_pass) and keeps its stash: its draft-plane
mark stays, and when it drafts again it is recomputed from the mark, whose position is the
stash's end, as after a drafter failure (docs/design.md, "After a drafter raises").
One batched head forward per depth covers all requests (one varlen metadata for all depths).
The draft plane is written only at positions the target already wrote, so no lookahead.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from outpace.attention.base import ForwardContext
from outpace.errors import ConfigError
from outpace.attention.inputs import InputBuffers
from outpace.speculative.base import DraftBatch
from outpace.speculative.head_proposer import HeadProposer


@dataclass
class RequestStash:
    """What the next step's window needs from this one, per request."""

    start: int  # first position held in `hidden`
    end: int  # e of the step that wrote it: hidden holds positions start..end-1
    # [end - start, H] target hiddens (h^0); None: still in the fused graphs' device stash
    # (runner/fused_depths_window.py), copied here when this window next reads it
    hidden: object
    frontier: int  # committed length f of that step
    fed: object  # [int] drafts fed as the tokens at f, f+1, ...; None: filler (mid-prompt)
    preemptions: int  # req.num_preemptions then: a preemption invalidates the stash


@dataclass
class _Window:
    """One step's window geometry, built on the host (numpy)."""

    host_rows: list = field(default_factory=list)  # build_host_batch rows
    # (window rows, source rows) of h^0: from batch.hidden (positions >= s) or from
    # cat(used stashes) (positions < s)
    from_hidden: tuple = field(default_factory=lambda: ([], []))
    from_stash: tuple = field(default_factory=lambda: ([], []))
    stashes: list = field(default_factory=list)  # [RequestStash] the window reads
    tokens: list = field(default_factory=list)  # per request [K, w] token of row at depth d
    use_draft: list = field(default_factory=list)  # per request [K, w] bool
    draft_src: list = field(default_factory=list)  # per request [K, w] index into drafts
    draft_rows: list = field(default_factory=list)  # [S] window row e-1 of sampled requests
    sampled: list = field(default_factory=list)  # [S] request index in the batch
    which: list = field(default_factory=list)  # index in the batch of each windowed request
    keep: list = field(default_factory=list)  # per request: (first window row, n) of new stash
    starts: list = field(default_factory=list)  # per request: first position of the new stash
    ends: list = field(default_factory=list)  # per request: e


class MTPWindowProposer(HeadProposer):
    """D-module MTP head, depth d = module d, drafts k <= K = num_speculative_tokens <= D."""

    # not a chain: the fused graphs run this window as a part of their own (DepthsWindow)
    supports_device_drafting = False

    def __init__(self, spec, policy, target, head):
        super().__init__(policy, target, spec)
        if self.draft_lm_head_dtype != "auto":
            raise ConfigError("draft_lm_head_dtype applies to EAGLE-3 heads and MTP's 'eagle' "
                              "mode; mtp_mode 'depths' drafts from each module's logits "
                              "(leave draft_lm_head_dtype unset or use mtp_mode 'eagle')")
        self.head = head
        self.depth = int(spec.num_speculative_tokens)  # K: modules run = drafts at most
        if not 1 <= self.depth <= head.num_modules:
            raise ConfigError(f"mtp_mode 'depths' needs 1 <= num_speculative_tokens <= "
                              f"{head.num_modules} (the head's modules), got {self.depth}")
        self.window = self.depth  # W: rows re-run per request and depth (tests lower it)
        # Module d writes slot first_layer_slot + d; only modules 0..K-1 ever run.
        self.num_kv_layers = self.depth
        self.stash: dict = {}  # request_id -> RequestStash
        # the fused graphs' stash (runner/fused_depths_window.DepthsWindow, which sets it):
        # pull(request_id, start, end), forget(request_id)
        self.device_stash = None

    def bind(self, runner) -> None:
        self.runner = weakref.proxy(runner)  # (see HeadProposer.bind)
        self.block_size = runner.block_size
        if self.depth > self.block_size:
            # The prefix-cache argument (entries below a trimmed hit are exact) needs every
            # inexact tail to fit in one block.
            raise ConfigError(f"mtp_mode 'depths' needs num_speculative_tokens ({self.depth}) "
                              f"<= block_size ({self.block_size}); lower k or raise block_size")
        # Window rows <= the step's target rows + K per request (see _geometry).
        self.win_inputs = InputBuffers(runner.inputs.max_tokens, runner.inputs.max_seqs,
                                       runner.inputs.max_blocks, runner.device)

    def finish(self, request_id: str) -> None:
        super().finish(request_id)
        self.stash.pop(request_id, None)
        if self.device_stash is not None:
            self.device_stash.forget(request_id)

    # ---- geometry (host) ------------------------------------------------------------------
    def _window_start(self, req, committed: list, s: int, e: int) -> int:
        """lo for a request whose step computed positions s..e-1 (see the module docstring)."""
        st = self.stash.get(req.request_id)
        if st is None or st.end != s or st.preemptions != req.num_preemptions:
            return s  # no hiddens below s: entries there came from the prefix cache
        lo = min(s, e - self.window)
        # m: first position fed last step with a token that is not the committed one.
        if st.fed is None:  # mid-prompt: filler from the prompt's end on
            lo = min(lo, st.frontier - self.window)
        else:
            m, end = st.frontier, st.frontier + len(st.fed)
            while m < end and m < len(committed) and committed[m] == st.fed[m - st.frontier]:
                m += 1
            if m < end:
                lo = min(lo, m - self.window)
        return max(lo, st.start, 0)

    def _geometry(self, batch: DraftBatch) -> _Window:
        K, meta = self.depth, batch.meta
        win = _Window()
        stash_at = 0  # where the next used stash starts in cat(used stashes)
        rows_so_far = 0
        on = batch.first_pass
        for i, req in enumerate(batch.requests):
            a, n = batch.row_start[i], batch.row_end[i] - batch.row_start[i]
            if on is not None and not on[i]:  # drafts nothing: no window, its stash kept
                self.work.skip(n)
                continue
            win.which.append(i)
            s = meta.seq_lens_host[i] - n  # first target position of this step
            committed = batch.committed[i]
            f = len(committed)
            e = min(s + n, f - 1)
            lo = self._window_start(req, committed, s, e)
            w = e - lo
            win.host_rows.append((np.zeros(w, dtype=np.int64), lo, batch.block_ids[i], []))
            if lo < s:
                st = self.stash[req.request_id]
                if st.hidden is None:  # left by a fused step: a copy from the device stash
                    st.hidden = self.device_stash.pull(req.request_id, st.start, st.end)
                win.from_stash[0].extend(range(rows_so_far, rows_so_far + s - lo))
                win.from_stash[1].extend(range(stash_at + lo - st.start, stash_at + s - st.start))
                win.stashes.append(st)
                stash_at += st.hidden.shape[0]
            win.from_hidden[0].extend(range(rows_so_far + s - lo, rows_so_far + w))
            win.from_hidden[1].extend(range(a, a + e - s))
            # Tokens at positions lo+1 .. e-1+K: committed where known, else drafts.
            known = np.asarray(committed[lo + 1:min(f, e + K)], dtype=np.int64)
            seg = np.zeros(w + K, dtype=np.int64)
            seg[:len(known)] = known
            q = np.arange(lo, e)[None, :] + np.arange(1, K + 1)[:, None]  # [K, w]: i + d + 1
            win.tokens.append(seg[q - lo - 1])
            sampled = batch.last_row[i] >= 0
            if sampled:
                j = len(win.sampled)
                win.sampled.append(i)
                win.draft_rows.append(rows_so_far + w - 1)
                win.use_draft.append(q >= f)
                win.draft_src.append(np.clip(q - f, 0, K - 1) + j * K)
            else:  # mid-prompt: no drafts; rows past the prompt get filler, rewritten later
                win.use_draft.append(np.zeros((K, w), dtype=bool))
                win.draft_src.append(np.zeros((K, w), dtype=np.int64))
            first = max(lo, e - self.window)
            win.keep.append((rows_so_far + first - lo, e - first))
            win.starts.append(first)
            win.ends.append(e)
            rows_so_far += w
        self.work.first_pass_rows += rows_so_far
        return win

    # ---- the step -------------------------------------------------------------------------
    def propose(self, batch: DraftBatch, k: list) -> list:
        drafts = [[] for _ in k]
        self.injected.begin(points=3)
        if not batch.requests:
            return drafts
        self.injected.at(0)  # before any depth: the window's rows keep stale entries
        K, dev = self.depth, batch.hidden.device
        win = self._geometry(batch)
        if not win.which:
            return drafts
        _, pos, _, meta = self.win_inputs.load(self.host_batch(win.host_rows))
        ctx = ForwardContext(self.runner.backend, meta)

        def put(parts, dtype):  # per-request [K, w] arrays -> one [K, R] device tensor
            return torch.from_numpy(np.concatenate(parts, axis=1).astype(dtype)).to(dev)

        tokens, use, src = (put(win.tokens, np.int64), put(win.use_draft, np.bool_),
                            put(win.draft_src, np.int64))
        h0 = self._gather_h0(batch.hidden, win, pos.shape[0])  # [R, H]
        num_sampled = len(win.sampled)
        # Drafts the window feeds back (0..K-2) plus those anyone asked for.
        num_out = max([K - 1] + [k[i] for i in win.sampled]) if num_sampled else 0
        table = torch.zeros(max(num_sampled, 1), K, dtype=torch.long, device=dev)  # [S, K]
        flat = table.view(-1)
        draft_rows = torch.tensor(win.draft_rows, dtype=torch.long, device=dev)
        h = h0  # [R, H]
        for d in range(K):
            ids = torch.where(use[d], flat[src[d]], tokens[d])  # [R]
            h = self.head(d, h, ids, pos, ctx, **self.embed_args(h))
            if d == 0:
                self.injected.at(1)  # depth 0 rewrote its window, the others did not
            if d < num_out:
                logits = self.head.compute_logits(h.index_select(0, draft_rows), self.target,
                                                  d)
                table[:num_sampled, d] = logits.argmax(dim=-1)
        # sync-ok: the drafts are the step's output (one copy)
        out = table[:num_sampled, :num_out].tolist() if num_out else []  # sync-ok: the drafts
        for j, i in enumerate(win.sampled):
            if k[i] > 0:
                drafts[i] = out[j][:k[i]]
        drafts = self._enhance(batch, drafts, k)
        self.injected.at(2)  # every depth wrote its window, the stash is not kept yet
        # Last: a call that raises before here leaves every stash as the last good step left
        # it, which the step that repairs the plane after a failure starts from (its first
        # row is the failed step's, the stash's end)
        self._keep_stash(batch, win, h0, out)
        return drafts

    @staticmethod
    def _gather_h0(hidden: torch.Tensor, win: _Window, num_rows: int) -> torch.Tensor:
        """[R, H] h^0 of every window row: this step's target rows, older ones from stashes."""
        def idx(rows):
            return torch.tensor(rows, dtype=torch.long, device=hidden.device)

        h0 = hidden.new_empty(num_rows, hidden.shape[1])
        dst, src = win.from_hidden
        h0.index_copy_(0, idx(dst), hidden.index_select(0, idx(src)))
        if win.stashes:
            old = torch.cat([st.hidden for st in win.stashes])  # [<= K per request, H]
            dst, src = win.from_stash
            h0.index_copy_(0, idx(dst), old.index_select(0, idx(src)))
        return h0

    def _keep_stash(self, batch: DraftBatch, win: _Window, h0: torch.Tensor, out: list) -> None:
        """The next step's h^0 for rows below its s: target hiddens of positions [e-W, e-1]."""
        idx = [r for first, n in win.keep for r in range(first, first + n)]
        kept = h0.index_select(0, torch.tensor(idx, dtype=torch.long, device=h0.device))
        parts = kept.split([n for _, n in win.keep])
        fed = {i: out[j][:self.depth - 1] if out else [] for j, i in enumerate(win.sampled)}
        new = {}
        for n, i in enumerate(win.which):
            req = batch.requests[i]
            new[req.request_id] = RequestStash(
                start=win.starts[n], end=win.ends[n], hidden=parts[n],
                frontier=len(batch.committed[i]), fed=fed.get(i),
                preemptions=req.num_preemptions)
        self.stash.update(new)  # all requests' or none
        if self.device_stash is not None:  # the device's copies of these are stale now
            for rid in new:
                self.device_stash.forget(rid)
