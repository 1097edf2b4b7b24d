"""k = 0 skips all draft work for that request (issue 35): no first pass over its rows, no draft
loop rows, no MTP window; its draft-plane mark stays, and when it drafts again it recomputes
from the mark before any draft reads a skipped entry (ModelRunner._first_pass,
Scheduler._draft_plane_mark; docs/design.md, "After a drafter raises: the draft-plane mark").

Checked against the oracles of test_draft_plane.py: stored entries below the mark (and below the
computed tokens wherever a request holds drafts), every draft chain against a dense recomputation
(a chain that read a skipped entry would differ), and the published blocks; output identical to
no speculation; the skipped rows counted (HeadProposer.work).
"""

from __future__ import annotations

import pytest
import torch

from outpace.speculative.draft_length import DraftLengthPolicy
from tests.speculative.conftest import rerun_capture
from tests.speculative.spec_helpers import (EXACT_DRAFTS, ChainRecorder, dense_chain,
                                            dense_draft_plane, engine_draft_plane, run_waves)
from tests.speculative.test_draft_plane import GREEDY, SMALL, PlaneChecker, head_spec, waves

# Per request (by its index in its wave), the draft lengths it is given at successive calls:
# one drafts every step, the others alternate k = 0 and k > 0 with different phases, so one
# batch mixes requests that draft and requests that skip.
PATTERNS = [(3,), (0, 3), (3, 0, 0), (0, 0, 3, 3), (0,)]


class AlternatingPolicy(DraftLengthPolicy):
    """A k schedule per request (PATTERNS), advanced at every call for it."""

    def __init__(self, k: int):
        super().__init__(k)
        self.calls: dict = {}

    def lengths(self, request_ids, batch_size: int) -> list:
        out = []
        for rid in request_ids:
            n = self.calls.get(rid, 0)
            self.calls[rid] = n + 1
            pattern = PATTERNS[int(rid.split("-")[1]) % len(PATTERNS)]
            out.append(min(self.k, pattern[n % len(pattern)]))
        return out


class SkipAudit:
    """Wraps propose and the head's step: a request with k = 0 that sampled gets no first pass
    unless its step repairs the plane from its mark; the pass runs over exactly the rows of the
    requests it is on for."""

    def __init__(self, proposer):
        self.bad, self.calls, self.skipped_requests = [], 0, 0
        inner, inner_step = proposer.propose, proposer.step
        self._expect = None

        def step(hidden, ids, pos, ctx):
            if self._expect is not None:  # the first pass: the first step call of a propose
                if hidden.shape[0] != self._expect:
                    self.bad.append(f"first pass over {hidden.shape[0]} rows, "
                                    f"{self._expect} expected")
                self._expect = None
            return inner_step(hidden, ids, pos, ctx)

        def propose(batch, k):
            self.calls += 1
            on = batch.first_pass
            assert on is not None, "a head with a draft plane is always told whom to pass over"
            for i, req in enumerate(batch.requests):
                if batch.last_row[i] < 0 or k[i] > 0:
                    if not on[i]:
                        self.bad.append(f"{req.request_id}: drafts k={k[i]} without its pass")
                    continue
                repairing = req.draft_repair_mark == req.num_draft_exact_tokens
                if on[i] and not repairing:
                    self.bad.append(f"{req.request_id}: k = 0 but its first pass ran")
                self.skipped_requests += not on[i]
            self._expect = sum(b - a for a, b, o in zip(batch.row_start, batch.row_end, on) if o)
            try:
                return inner(batch, k)
            finally:
                self._expect = None

        proposer.propose, proposer.step = propose, step


def drafting_plane_exact(loaded):
    """after_step: a request holding drafts (the head read its plane to make them) has its mark
    at its committed KV (num_tokens - 1: with overlap num_computed_tokens already counts the
    step in flight) and every entry below it exact."""
    model, cfg = loaded[0], loaded[1]
    seen = {"requests": 0}

    def check(engine):
        proposer = engine.runner.proposer
        for req in engine.scheduler.running:
            if not req.spec_token_ids:
                continue
            c = req.num_tokens - 1
            assert req.num_draft_exact_tokens == c, (
                f"{req.request_id} drafts with its mark at {req.num_draft_exact_tokens} below "
                f"its {c} computed tokens")
            want = dense_draft_plane(proposer, model, cfg, req.all_token_ids[:c + 1])
            got = engine_draft_plane(engine, req.request_id, c)
            err = float((got - want).abs().max().detach())
            assert err < 1e-4, f"{req.request_id}: plane differs from the oracle ({err:.2e})"
            seen["requests"] += 1
    return check, seen


@pytest.fixture(scope="module")
def reference(tiny_loaded) -> list:
    """The scenario's output without speculation, which every run here must give."""
    return run_waves(tiny_loaded, waves(), GREEDY, **SMALL).outputs


def test_k0_skips_draft_work_and_the_plane_is_repaired(tiny_loaded, tiny_heads, reference):
    for method in ("eagle3", "mtp"):
        want = reference
        at_mark = PlaneChecker(tiny_loaded, upto="mark")
        published = PlaneChecker(tiny_loaded, upto="published")
        drafting, seen = drafting_plane_exact(tiny_loaded)
        rec = {}

        def on_engine(engine):
            proposer = engine.runner.proposer
            proposer.policy = AlternatingPolicy(proposer.policy.k)
            rec["chains"] = ChainRecorder(proposer)
            rec["audit"] = SkipAudit(proposer)

        run = run_waves(tiny_loaded, waves(), GREEDY, on_engine=on_engine,
                        after_step=lambda e: (at_mark(e), published(e), drafting(e)),
                        speculative_config=head_spec(tiny_heads, method, 3,
                                                     enhancer_min_match=2), **SMALL)
        eng = run.engine
        work = eng.runner.proposer.work
        audit = rec["audit"]
        assert run.outputs == want, method
        assert not audit.bad, audit.bad[:5]
        assert eng.runner.draft_failures.total == 0
        # the scenario: skipped requests beside drafting ones, repairs, prefix hits, preemption
        assert audit.skipped_requests > 20 and work.skipped_rows > 40, (audit.skipped_requests,
                                                                       work)
        assert work.first_pass_rows > 0 and work.loop_rows > 0
        assert run.stats["spec"]["num_accepted_tokens"] > 0
        assert run.stats["num_preemptions_total"] > 0 and eng.kv.prefix_cache_hit_tokens > 0
        assert seen["requests"] > 30 and at_mark.entries_checked > 300
        assert published.entries_checked > 100
        chains = 0
        for committed, k, hiddens, toks in rec["chains"].chains():
            want_h, want_t = dense_chain(eng.runner.proposer, tiny_loaded[0], tiny_loaded[1],
                                         committed, k)
            torch.testing.assert_close(hiddens, want_h, atol=1e-4, rtol=1e-4,
                                       msg=lambda m: f"draft chain at f={len(committed)}: {m}")
            assert toks.tolist() == want_t.tolist()
            chains += 1
        assert chains >= 20, chains


def test_k0_skips_the_mtp_window(tiny_loaded, tiny_heads, reference):
    """MTP depths mode: a request with k = 0 gets no window (its rows counted as skipped) and
    keeps its stash; the output is the target's and the plane below the mark stays exact
    (depth 0's entries, the ones the dense oracle covers)."""
    want = reference

    def on_engine(engine):
        proposer = engine.runner.proposer
        proposer.policy = AlternatingPolicy(proposer.policy.k)

    spec = {"method": "mtp", "model": str(tiny_heads["mtp"]), "num_speculative_tokens": 1,
            "mtp_mode": "depths", "enhancer_min_match": 2, **EXACT_DRAFTS}
    run = run_waves(tiny_loaded, waves(), GREEDY, on_engine=on_engine,
                    speculative_config=spec, **SMALL)
    work = run.engine.runner.proposer.work
    assert run.outputs == want
    assert run.engine.runner.draft_failures.total == 0
    assert work.skipped_rows > 40 and work.first_pass_rows > 0, work
    assert run.stats["spec"]["num_accepted_tokens"] > 0


def test_k_schedule_at_zero_runs_no_head_in_the_fused_graph(tiny_loaded, tiny_heads, reference):
    """The fused step (CPU stand-in of its graphs) under a batch-size schedule that drafts only
    at batch <= 2: the steps of larger batches run graphs without the head (their rows counted
    as skipped); once the batch shrinks, the requests recompute from their marks on the general
    path before drafting; output identical, plane exact wherever a request holds drafts."""
    want = reference
    drafting, seen = drafting_plane_exact(tiny_loaded)
    at_mark = PlaneChecker(tiny_loaded, upto="mark")
    published = PlaneChecker(tiny_loaded, upto="published")
    k = 3
    spec = head_spec(tiny_heads, "eagle3", k, k_schedule=[[2, k]])

    def on_engine(engine):
        engine.runner.enable_cuda_graphs(tuple(range(1, k + 2)), capture_fused=True,
                                         capture=rerun_capture)

    run = run_waves(tiny_loaded, waves(), GREEDY, on_engine=on_engine,
                    after_step=lambda e: (drafting(e), at_mark(e), published(e)),
                    speculative_config=spec, max_num_seqs=8, **SMALL)
    eng = run.engine
    work = eng.runner.proposer.work
    assert run.outputs == want
    fused = eng.runner.fused
    assert fused.replays > 0 and any(key[2] == 0 for key in fused.table.greedy)
    assert work.skipped_rows > 20, work
    assert run.stats["spec"]["num_drafts"] > 0
    assert seen["requests"] > 5 and at_mark.entries_checked > 100


def test_a_skip_at_the_context_end_keeps_the_batch_on_the_graphs():
    """A request whose k was trimmed to 0 by the end of its context (its mark stayed) can draft
    nothing more: it must not send its batch off the fused graphs (FusedStep.accepts). One
    that can still draft and whose entries above its mark were skipped must."""
    from types import SimpleNamespace as NS

    from outpace.runner.fused_step import FusedStep

    def plan_of(computed, max_len, mark=10, repair=-1):
        req = NS(num_draft_exact_tokens=mark, draft_repair_mark=repair, max_model_len=max_len)
        return NS(draft_batch_size=1, scheduled=[NS(request=req, num_computed_tokens=computed)])

    step = NS(lengths=NS(launch_kd=lambda plan: 3))
    resumes = FusedStep._resumes_drafting
    assert resumes(step, plan_of(20, 64))  # can draft, entries 10..20 skipped: general path
    assert not resumes(step, plan_of(62, 64))  # at the context's end: nothing to draft
    assert not resumes(step, plan_of(20, 64, repair=10))  # its repair already ran
    assert not resumes(step, plan_of(10, 64))  # nothing above the mark
    assert not resumes(NS(lengths=NS(launch_kd=lambda plan: 0)), plan_of(20, 64))  # the graph drafts none
