"""The draft KV plane of EAGLE-3 / MTP-eagle heads (outpace/speculative/head_proposer.py), checked
against oracles recomputed from scratch:

* stored entries: after every engine step, every draft-plane entry below a request's committed
  KV length equals a dense recomputation of the head over the committed tokens with the exact
  target hiddens (roll-by-one: entry p from hidden p and token p+1);
* read entries: every draft chain the head runs equals the chain recomputed in a fresh pool that
  holds only exact entries, so a rejected draft's entry is never read once its position is
  committed (a stale entry would change the chain's hidden states);
* with varied acceptance (forced acceptance counts, and real acceptance through the suffix
  enhancer), chunked prefill, prefix-cache hits (trimmed last block) and preemption.

Also: the draft phase leaves the target's inputs and metadata untouched, even when the head
raises (docs/design.md, "The draft phase leaves the target's step alone"); a raising drafter
never takes the engine down; lookahead reservation keeps every draft write inside the request's
own blocks; relaxed acceptance in thinking spans.
"""

from __future__ import annotations

import logging

import pytest
import torch

from outpace import SamplingParams
from outpace.errors import ConfigError
from tests.engine_helpers import make_engine
from tests.speculative.spec_helpers import (EXACT_DRAFTS, TINY_BLOCK, ChainRecorder, dense_chain,
                                            dense_draft_plane, engine_draft_plane,
                                            repetitive_prompts, run_waves)

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
# (whole-budget prefill chunks beside decodes, not the CPU default's bound: the scenarios'
# preemptions come from them)
SMALL = dict(block_size=TINY_BLOCK, max_num_batched_tokens=16, num_kv_blocks=30,
             max_prefill_with_decodes=0)
DRAFTER_RAISED = "the drafter raised"


def waves():
    # 10 tokens: requests diverge inside a block (the aligned case is the xfail test below)
    system = repetitive_prompts(1, 99, period=10, repeats=1)[0]
    first = repetitive_prompts(5, 3, prefix=system)
    return [first, repetitive_prompts(2, 4, prefix=system) + [first[1]]]


def head_spec(heads, method, k, **opts):
    spec = {"method": method, "model": str(heads[method]), "num_speculative_tokens": k,
            **EXACT_DRAFTS, **opts}
    if method == "mtp":
        spec["mtp_mode"] = "eagle"
    return spec


class PlaneChecker:
    """after_step hook: stored draft-plane entries below num_computed_tokens are exact (upto
    "published": those of the blocks the request has published to the prefix cache; "mark":
    those below its draft-plane mark)."""

    def __init__(self, loaded, soft=False, upto="computed"):
        self.model, self.cfg = loaded[0], loaded[1]
        self.entries_checked = 0
        self.soft, self.failures = soft, []  # soft: collect failures, let the run finish
        self.upto = upto

    def __call__(self, engine):
        proposer = engine.runner.proposer
        for req in engine.scheduler.running:
            c = req.num_computed_tokens
            if self.upto == "published":
                c = min(engine.kv._num_cached.get(req.request_id, 0) * engine.kv.block_size,
                        req.num_tokens - 1)
            elif self.upto == "mark":
                c = req.num_draft_exact_tokens
            if c < 2:
                continue
            want = dense_draft_plane(proposer, self.model, self.cfg, req.all_token_ids[:c + 1])
            got = engine_draft_plane(engine, req.request_id, c)
            err = (got - want).abs().amax(dim=(0, 2, 3)).detach()  # [c] per position
            bad = (err > 1e-4).nonzero().flatten().tolist()
            msg = (f"{req.request_id}: draft-plane entries at positions {bad[:8]} (of {c} "
                   f"committed) differ from the dense recomputation (max err "
                   f"{float(err.max()):.2e})")
            if bad and self.soft:
                self.failures.append(msg)
            assert self.soft or not bad, msg
            self.entries_checked += c


# ---- the two oracles, with varied acceptance, chunking, prefix hits and preemption -----------

CASES = [
    ("eagle3", 3, {"force_accept_mean": 1.6}),  # accepts 0 or 1 of 3
    ("eagle3", 4, {"force_accept_mean": 3.5}),  # accepts 2 or 3 of 4
    ("eagle3", 4, {"force_accept_mean": 4.8}),  # mostly all 4 (bonus) accepted
    ("mtp", 3, {"force_accept_mean": 2.5}),
    ("eagle3", 5, {"enhancer_min_match": 2}),  # lossless, real acceptance 0..5
    ("mtp", 2, {"enhancer_min_match": 2}),
]


@pytest.mark.parametrize("method,k,opts", CASES,
                         ids=[f"{m}-k{k}-{next(iter(o))}" for m, k, o in CASES])
def test_draft_plane_matches_dense_oracle(tiny_loaded, tiny_heads, method, k, opts):
    checker = PlaneChecker(tiny_loaded)
    rec = {}
    run = run_waves(tiny_loaded, waves(), GREEDY, after_step=checker,
                    on_engine=lambda e: rec.setdefault("chains", ChainRecorder(
                        e.runner.proposer)),
                    speculative_config=head_spec(tiny_heads, method, k, **opts), **SMALL)
    eng = run.engine
    proposer = eng.runner.proposer
    assert eng.runner.draft_failures.total == 0
    # the scenario happened: preemption, prefix hits, varied acceptance
    assert run.stats["num_preemptions_total"] > 0
    assert eng.kv.prefix_cache_hit_tokens > 0
    per_pos = [run.stats["spec"]["num_drafts"]] + run.stats["spec"]["accepted_per_position"]
    steps_accepting = [a - b for a, b in zip(per_pos, per_pos[1:] + [0])]  # [k+1]: by count
    assert sum(n > 0 for n in steps_accepting) >= 2, f"acceptance never varied: {per_pos}"
    assert checker.entries_checked > 500

    chains = 0
    for committed, kk, hiddens, toks in rec["chains"].chains():
        want_h, want_t = dense_chain(proposer, tiny_loaded[0], tiny_loaded[1], committed, kk)
        assert hiddens.shape[0] == kk
        torch.testing.assert_close(hiddens, want_h, atol=1e-4, rtol=1e-4,
                                   msg=lambda m: f"draft chain at f={len(committed)}: {m}")
        assert toks.tolist() == want_t.tolist()
        chains += 1
    assert chains >= 30


def test_oracles_catch_a_misplaced_draft_write(tiny_loaded, tiny_heads):
    """Negative control: a draft loop that writes one position too low overwrites the exact
    entry at f-2 with a chained draft value; both oracles must notice."""
    eng = make_engine(tiny_loaded, speculative_config=head_spec(tiny_heads, "eagle3", 3),
                      block_size=TINY_BLOCK)
    inner = eng.runner.proposer.host_batch  # this engine's proposer only
    eng.runner.proposer.host_batch = lambda rows: inner(
        [(t, start - 1, blocks, offs) for t, start, blocks, offs in rows])
    chains = ChainRecorder(eng.runner.proposer)
    checker = PlaneChecker(tiny_loaded)
    for i, p in enumerate(repetitive_prompts(2, 3)):
        eng.add_request(f"r{i}", p, GREEDY)
    stored_caught = False
    for _ in range(6):
        eng.step()
        try:
            checker(eng)
        except AssertionError:
            stored_caught = True
    for rid in ("r0", "r1"):
        eng.abort_request(rid)
    assert stored_caught, "the stored-entry oracle missed a misplaced draft write"
    model, cfg = tiny_loaded[0], tiny_loaded[1]
    differ = [not torch.allclose(h, dense_chain(eng.runner.proposer, model, cfg, c, k)[0],
                                 atol=1e-4)
              for c, k, h, _ in chains.chains() if k > 2]
    assert any(differ), "the chain oracle missed a misplaced draft write"


def aligned_pair():
    """Two prompts sharing a 12-token system prompt (3 whole blocks), diverging at token 12."""
    system = repetitive_prompts(1, 99, period=12, repeats=1)[0]
    return repetitive_prompts(2, 21, prefix=system, period=8, repeats=2)


def test_prefix_hit_recomputes_the_last_matched_block(tiny_loaded, tiny_heads):
    """B matches A's blocks 0..2; block 2's last draft entry was computed from A's token 12,
    so B must not inherit it (the trim, docs/design.md "Prefix caching"): its own entry at 11
    uses its own token 12."""
    a, b = aligned_pair()
    checker = PlaneChecker(tiny_loaded)
    run = run_waves(tiny_loaded, [[a], [b]], GREEDY, after_step=checker,
                    speculative_config=head_spec(tiny_heads, "eagle3", 3), block_size=TINY_BLOCK)
    assert run.outs[1].num_cached_tokens == 8  # blocks 0, 1 inherited, block 2 trimmed
    assert checker.entries_checked > 100


def test_prefix_hit_through_a_block_with_another_successor(tiny_loaded, tiny_heads):
    """A and B share a 12-token system prompt (3 whole blocks) and diverge at token 12. B
    recomputes block 2 (trim) and caches its copy under the same hash as A's, which stays the
    findable one. C repeats B's prompt: by hash it would match blocks 0..3 and inherit A's
    block 2, whose entry at position 11 was computed from A's token 12. The manager follows
    physical chains for draft planes: B's block 3 follows B's copy of block 2, not A's, so C's
    match stops at A's block 2, which is then trimmed."""
    a, b = aligned_pair()
    checker = PlaneChecker(tiny_loaded, soft=True)
    spec = head_spec(tiny_heads, "eagle3", 3)
    run = run_waves(tiny_loaded, [[a], [b], [b]], GREEDY, after_step=checker,
                    speculative_config=spec, block_size=TINY_BLOCK)
    assert run.outs[2].num_cached_tokens == 8  # blocks 0, 1 inherited; A's block 2 is not
    assert not checker.failures, checker.failures[0]


# ---- docs/design.md, "The draft phase leaves the target's step alone" ------------------------


def target_state(runner, batch):
    """Everything of the target's step the draft phase must not change."""
    inp = runner.inputs
    meta = batch.meta
    tensors = {name: getattr(inp, name).clone() for name in (
        "input_ids", "positions", "slot_mapping", "logits_indices", "query_start_loc",
        "seq_lens", "block_tables")}
    tensors.update(meta_slot_mapping=meta.slot_mapping.clone(),
                   meta_query_start_loc=meta.query_start_loc.clone(),
                   meta_seq_lens=meta.seq_lens.clone(), meta_block_tables=meta.block_tables.clone(),
                   positions=batch.positions.clone(), hidden=batch.hidden.clone(),
                   next_token_ids=batch.next_token_ids.clone())
    for i, a in enumerate(batch.aux_hidden):
        tensors[f"aux{i}"] = a.clone()
    host = (list(meta.query_start_loc_host), list(meta.seq_lens_host), meta.max_query_len,
            meta.max_seq_len, id(meta.slot_mapping), id(meta.block_tables))
    return tensors, host


class ScopeGuard:
    """Wraps proposer.propose: snapshots the target's state before, compares it after (also
    when propose raises). `raise_every`: make the head's forward raise on every n-th propose
    call, inside the draft loop or in the first pass (alternating)."""

    def __init__(self, proposer, runner, raise_every=0):
        self.violations, self.calls, self.raised = [], 0, 0
        inner, inner_step = proposer.propose, proposer.step

        def step(hidden, ids, pos, ctx):
            n = self.calls
            if raise_every and n % raise_every == 0:
                in_loop = hidden.shape[0] != ctx.meta.num_tokens or ctx.meta is not self._meta
                if (n // raise_every) % 2 == 0 or in_loop:
                    self.raised += 1
                    raise RuntimeError("injected head failure")
            return inner_step(hidden, ids, pos, ctx)

        def propose(batch, k):
            self.calls += 1
            self._meta = batch.meta
            before, host_before = target_state(runner, batch)
            try:
                return inner(batch, k)
            finally:
                after, host_after = target_state(runner, batch)
                for name, t in before.items():
                    if not torch.equal(t, after[name]):
                        self.violations.append(name)
                if host_before != host_after:
                    self.violations.append("host metadata")

        proposer.propose, proposer.step = propose, step


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_draft_phase_leaves_target_state_unchanged(tiny_loaded, tiny_heads, method):
    rec = {}
    spec = head_spec(tiny_heads, method, 4, enhancer_min_match=2)
    run_waves(tiny_loaded, waves(), GREEDY, on_engine=lambda e: rec.setdefault(
        "g", ScopeGuard(e.runner.proposer, e.runner)), speculative_config=spec, **SMALL)
    assert rec["g"].calls > 20 and not rec["g"].violations, rec["g"].violations


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_drafter_failure_is_repaired_counted_and_never_published(tiny_loaded, tiny_heads,
                                                                 caplog, method):
    """A drafter that raises (injected: every third call, alternately before the head's first
    pass, so that step's rows keep stale draft entries, and after it): the engine goes on
    without drafts for that step, recomputes the request from its draft-plane mark, so after
    every step the plane below the computed tokens equals the dense oracle again and no block
    with a stale draft entry is ever published; every failure is counted, and logged once in
    the rate limiter's interval; the output is the target's."""
    want = run_waves(tiny_loaded, waves(), GREEDY, **SMALL).outputs
    stored, published = PlaneChecker(tiny_loaded), PlaneChecker(tiny_loaded, upto="published")
    spec = head_spec(tiny_heads, method, 3, enhancer_min_match=2, inject_draft_failures=3)
    with caplog.at_level(logging.ERROR, logger="outpace.runner.model_runner"):
        run = run_waves(tiny_loaded, waves(), GREEDY, after_step=lambda e: (stored(e),
                                                                            published(e)),
                        speculative_config=spec, **SMALL)
    eng = run.engine
    injected = eng.runner.proposer.injected
    assert injected.raised >= 10, injected.raised
    assert run.stats["num_draft_failures_total"] == injected.raised
    assert eng.runner.draft_failures.total == injected.raised
    assert run.outputs == want
    assert stored.entries_checked > 500 and published.entries_checked > 200
    # the scenario: drafting went on between failures, preemption, prefix hits
    assert run.stats["spec"]["num_accepted_tokens"] > 0
    assert run.stats["num_preemptions_total"] > 0 and eng.kv.prefix_cache_hit_tokens > 0
    logged = [r for r in caplog.records if DRAFTER_RAISED in r.getMessage()]
    assert len(logged) == 1 and "injected drafter failure" in caplog.text


def test_drafter_failing_every_step_ends_the_repairs(tiny_loaded, tiny_heads):
    """A head that raises at every call: a request is recomputed from its draft-plane mark once,
    and when that step's drafter raises too it goes on without (or it would recompute forever:
    the run must end); the output is still the target's. Its plane is never written, so its
    mark stays at admission and no block of it is ever published (no later prefix hits)."""
    want = run_waves(tiny_loaded, waves(), GREEDY, **SMALL).outputs
    published = PlaneChecker(tiny_loaded, upto="published")
    steps = []

    def after_step(engine):
        published(engine)
        steps.append(1)
        assert len(steps) < 1000, "no progress: the requests recompute forever"

    spec = head_spec(tiny_heads, "eagle3", 3, inject_draft_failures=1)
    run = run_waves(tiny_loaded, waves(), GREEDY, after_step=after_step, speculative_config=spec,
                    **SMALL)
    assert run.outputs == want
    injected = run.engine.runner.proposer.injected
    assert injected.raised > 50 and run.stats["num_draft_failures_total"] == injected.raised
    assert run.stats["spec"]["num_draft_tokens"] == 0
    assert run.engine.kv.prefix_cache_hit_tokens == 0 and published.entries_checked == 0


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_head_that_raises_is_logged_once_and_output_is_unchanged(tiny_loaded, tiny_heads,
                                                                 caplog, method):
    want = run_waves(tiny_loaded, waves(), GREEDY, **SMALL).outputs
    rec = {}
    spec = head_spec(tiny_heads, method, 3, enhancer_min_match=2)
    with caplog.at_level(logging.ERROR, logger="outpace.runner.model_runner"):
        run = run_waves(tiny_loaded, waves(), GREEDY, on_engine=lambda e: rec.setdefault(
            "g", ScopeGuard(e.runner.proposer, e.runner, raise_every=3)),
            speculative_config=spec, **SMALL)
    guard = rec["g"]
    assert guard.raised >= 5 and not guard.violations, (guard.raised, guard.violations)
    assert run.stats["num_draft_failures_total"] == guard.raised
    assert run.outputs == want
    assert run.stats["spec"]["num_accepted_tokens"] > 0  # drafting went on between failures
    logged = [r for r in caplog.records if DRAFTER_RAISED in r.getMessage()]
    assert len(logged) == 1 and "injected head failure" in caplog.text


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_model_free_drafter_that_raises_does_not_kill_the_engine(tiny_loaded, caplog, method):
    want = run_waves(tiny_loaded, waves(), GREEDY, **SMALL).outputs
    with caplog.at_level(logging.ERROR, logger="outpace.runner.model_runner"):
        run = run_waves(tiny_loaded, waves(), GREEDY,
                        speculative_config={"method": method, "num_speculative_tokens": 3,
                                            "inject_draft_failures": 4}, **SMALL)
    assert run.outputs == want
    injected = run.engine.runner.proposer.injected
    assert injected.calls > 20 and run.stats["spec"]["num_accepted_tokens"] > 0
    assert run.stats["num_draft_failures_total"] == injected.raised >= 5
    assert sum(DRAFTER_RAISED in r.getMessage() for r in caplog.records) == 1


# ---- docs/design.md, "Scheduling and lookahead reservation" ----------------------------------


class WriteChecker:
    """Wraps the attention backend: every K/V write (target and draft plane) must land in the
    writing request's own block table, at the block its position maps to, in a block no other
    request holds; records how far draft-plane writes reach past the step's scheduled tokens."""

    def __init__(self, engine):
        self.engine = engine
        self.bad, self.writes, self.max_draft_reach = [], 0, 0
        backend = engine.runner.backend
        inner = backend.forward
        self.draft_slot = engine.config.model_config.num_hidden_layers

        def forward(layer, q, k, v, meta):
            self.check(layer, meta)
            return inner(layer, q, k, v, meta)
        backend.forward = forward

    def check(self, layer, meta):
        kv = self.engine.kv
        bs = kv.block_size
        tables = {rid: kv.block_ids(rid) for rid in list(kv._blocks)}
        slots = meta.slot_mapping.tolist()
        qsl = meta.query_start_loc_host
        for s, seq_len in enumerate(meta.seq_lens_host):
            row = meta.block_tables[s].tolist()
            owner = [rid for rid, t in tables.items() if t and row[:len(t)] == t
                     and not any(row[len(t):])]
            if len(owner) != 1:
                self.bad.append(f"layer {layer} seq {s}: block table matches {owner}")
                continue
            table = tables[owner[0]]
            others = {b for rid, t in tables.items() if rid != owner[0] for b in t}
            n = qsl[s + 1] - qsl[s]
            req = self.engine.scheduler.get_request(owner[0])
            for i in range(n):
                pos, slot = seq_len - n + i, slots[qsl[s] + i]
                self.writes += 1
                if pos // bs >= len(table) or slot != table[pos // bs] * bs + pos % bs:
                    self.bad.append(f"layer {layer} {owner[0]} pos {pos}: slot {slot} outside "
                                    f"its {len(table)} blocks")
                elif slot // bs in others:
                    self.bad.append(f"layer {layer} {owner[0]} pos {pos}: block {slot // bs} "
                                    f"is shared with another request")
                if layer == self.draft_slot and req is not None:
                    self.max_draft_reach = max(self.max_draft_reach,
                                               pos - req.num_computed_tokens + 1)


@pytest.mark.parametrize("k", [2, 5])
def test_draft_writes_stay_inside_reserved_blocks(tiny_loaded, tiny_heads, caplog, k):
    rec = {}
    # forced full acceptance pushes the frontier (and the draft loop) as far as it can go
    spec = head_spec(tiny_heads, "eagle3", k, force_accept_mean=k + 0.9)
    with caplog.at_level(logging.ERROR, logger="outpace.runner.model_runner"):
        run = run_waves(tiny_loaded, waves(), GREEDY,
                        on_engine=lambda e: rec.setdefault("w", WriteChecker(e)),
                        speculative_config=spec, block_size=TINY_BLOCK,
                        max_num_batched_tokens=16, num_kv_blocks=26)
    w = rec["w"]
    assert not w.bad, w.bad[:5]
    assert DRAFTER_RAISED not in caplog.text  # e.g. a loop position past the block table
    assert run.stats["num_preemptions_total"] > 0 and w.writes > 1000
    # During a step num_computed_tokens counts the verify block, so a reach of r means a draft
    # write r-1 positions past it. The loop reaches p+a+k-1: all k-1 lookahead tokens when
    # every draft is accepted, never more (so token-exact, not only block-exact).
    assert w.max_draft_reach == k - 1, w.max_draft_reach


# ---- relaxed acceptance inside thinking spans (opt-in, lossy) ---------------------------------

THINK, END = 94, 95
RELAXED = {"relaxed_top_k": 96, "relaxed_delta": 1.0,  # inside a span: accept any draft
           "think_begin_ids": [THINK], "think_end_ids": [END]}


def per_request_rate(run):
    return [o.spec_stats.acceptance_rate for o in run.outs]


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_relaxed_acceptance_only_inside_thinking_spans(tiny_loaded, tiny_heads, method):
    outside = [p for p in repetitive_prompts(4, 7) if THINK not in p and END not in p][:3]
    inside = [p + [THINK] for p in outside]
    prompts = outside + inside
    kw = dict(block_size=TINY_BLOCK, max_num_batched_tokens=32)
    want = run_waves(tiny_loaded, [prompts], GREEDY, **kw).outputs
    assert not any({THINK, END} & set(o) for o in want), "pick other marker ids"
    base = {"method": method, "num_speculative_tokens": 3}
    if method == "eagle3":
        base.update(model=str(tiny_heads["eagle3"]), enhancer_min_match=2)
    strict = run_waves(tiny_loaded, [prompts], GREEDY, speculative_config=base, **kw)
    relaxed = run_waves(tiny_loaded, [prompts], GREEDY, speculative_config={**base, **RELAXED},
                        **kw)
    n = len(outside)
    assert strict.outputs == want
    assert relaxed.outputs[:n] == want[:n]  # outside a span verification stays exact
    assert per_request_rate(relaxed)[:n] == per_request_rate(strict)[:n]
    rates_strict, rates_relaxed = per_request_rate(strict)[n:], per_request_rate(relaxed)[n:]
    # inside the span every draft passes (top_k = vocab, delta = 1), strict accepts fewer
    assert all(r == 1.0 for r in rates_relaxed), rates_relaxed
    assert sum(rates_strict) / n < 0.9, rates_strict
    assert relaxed.outputs[n:] != want[n:]  # lossy where it applies, as documented


def relaxed_verify(history, drafts, logits, top_k=96, delta=1.0):
    """One greedy verify through SamplingStep with relaxed acceptance -> (emitted, accepted)."""
    from outpace.runner.sampling_step import RelaxedAcceptance, SamplingStep
    from outpace.types import Request, ScheduledRequest, StepPlan
    step = SamplingStep(torch.device("cpu"))
    from outpace.speculative_config import SpecConfig
    step.relaxed = RelaxedAcceptance.from_spec(SpecConfig.from_dict(
        {"relaxed_top_k": top_k, "relaxed_delta": delta, "think_begin_ids": [THINK],
         "think_end_ids": [END]}), 96)
    req = Request("r", history[:2], GREEDY)
    req.output_token_ids = list(history[2:])
    plan = StepPlan([ScheduledRequest(req, len(history) - 1, 1 + len(drafts), list(drafts))])
    out = step.run(plan, logits)[0]
    return out.token_ids, out.num_accepted_tokens


def peaked_logits(argmax_ids, second=None):
    """[len, 96] logits: argmax_ids[j] wins row j by 10, `second[j]` (if given) is runner-up."""
    lg = torch.zeros(len(argmax_ids), 96)
    for j, t in enumerate(argmax_ids):
        lg[j, t] = 10.0
        if second is not None:
            lg[j, second[j]] = 9.0
    return lg


def test_relaxed_verify_respects_span_markers_top_k_and_delta():
    target = [1, 2, 3, 4, 5]  # the target's argmax at the 5 positions of a 4-draft block
    drafts = [20, 21, END, 22]  # all differ from the target
    outside = [7, 8, 9]
    inside = [7, THINK, 9]
    closed = [THINK, 8, END, 9]
    logits = peaked_logits(target)
    assert relaxed_verify(outside, drafts, logits) == ([1], 0)
    assert relaxed_verify(closed, drafts, logits) == ([1], 0)
    # inside: 20, 21 relaxed; the END marker itself is never relaxed -> target token there
    assert relaxed_verify(inside, drafts, logits) == ([20, 21, 3], 2)
    # an END that the target agrees with closes the span: the draft after it is strict
    agree = peaked_logits([1, 2, END, 4, 5])
    assert relaxed_verify(inside, drafts, agree) == ([20, 21, END, 4], 3)
    # top_k and delta gate it: drafts must be the runner-up (top_k=2) and within delta
    runner_up = peaked_logits(target, second=[20, 21, 30, 31, 32])
    p1, p2 = torch.softmax(runner_up[0], -1).topk(2).values.tolist()
    assert relaxed_verify(inside, drafts, runner_up, top_k=2, delta=0.9) == ([20, 21, 3], 2)
    assert relaxed_verify(inside, drafts, runner_up, top_k=1, delta=0.9) == ([1], 0)
    assert relaxed_verify(inside, drafts, runner_up, top_k=2, delta=(p1 - p2) / 2) == ([1], 0)


def test_relaxed_sampling_path_accepts_inside_span(tiny_loaded):
    prompts = [p + [THINK] for p in repetitive_prompts(3, 7)]
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=3, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, **RELAXED}
    run = run_waves(tiny_loaded, [prompts], params, speculative_config=spec,
                    block_size=TINY_BLOCK)
    drafted = [o.spec_stats for o in run.outs if o.spec_stats.num_draft_tokens]
    assert drafted and all(s.acceptance_rate == 1.0 for s in drafted)


@pytest.mark.parametrize("opts,msg", [
    ({"relaxed_top_k": 5}, "missing"),
    ({**RELAXED, "relaxed_delta": 1.5}, "relaxed_delta"),
    ({**RELAXED, "relaxed_top_k": 0}, "relaxed_top_k"),
    ({**RELAXED, "think_end_ids": [500]}, "think_end_ids"),
    ({**RELAXED, "think_end_ids": [THINK]}, "differ"),
])
def test_relaxed_options_are_validated_at_build(tiny_loaded, opts, msg):
    with pytest.raises(ConfigError, match=msg):
        make_engine(tiny_loaded, speculative_config={"method": "ngram", **opts})
