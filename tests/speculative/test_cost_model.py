"""The draft-length cost model (`"adaptive": "cost"`): the step-time table, the per-request
acceptance estimates, the choice of every request's k on synthetic tables (k = 0 where
acceptance is low, the full k where it is high, both in one batch; the best ratio of all
choices, by brute force), the option through config and CLI, and engines with it on: output
identical to no speculation (eager and fused-graph paths), drafting stopping for a head whose
drafts are all rejected and coming back when they are accepted; on the fused graphs, the draft
loop's length following the choice (kd = 0 graphs with no head where drafting does not pay, the
full k where it does, switches both ways, chained steps)."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from outpace import SamplingParams
from outpace.errors import ConfigError
from outpace.speculative.acceptance import AcceptanceEstimates
from outpace.speculative.cost_model import CostModel
from outpace.speculative.draft_length import DraftLengthPolicy
from outpace.speculative.step_times import StepTimes
from outpace.speculative_config import SpecConfig
from tests.speculative.conftest import rerun_capture
from tests.speculative.spec_helpers import (EXACT_DRAFTS, TINY_BLOCK, repetitive_prompts,
                                            run_waves)
from tests.speculative.test_spec_engine import StepLog

K = 4


def padded_table(k=K, verify_row=0.15, buckets=(1, 2, 4, 8)):
    """A graph engine's table: a step costs 1 + verify_row per extra padded query row (per
    bucket a little more), whatever each request drafts."""
    verify = {(b, q): 1.0 + 0.01 * b + verify_row * (q - 1) for b in buckets
              for q in range(1, k + 2)}
    return StepTimes(buckets, tuple(range(1, k + 2)), verify)


def eager_table(k=K, token_s=0.2):
    """An eager engine's table: every drafted row costs token_s of a 1.0 step."""
    return StepTimes.eager(8, k, step_s=1.0, token_s=token_s)


def model_with(alphas, table, k=K):
    """A CostModel whose requests r0, r1, ... have the given conditional acceptance rows."""
    est = AcceptanceEstimates(k, 0.5)
    ids = [f"r{i}" for i in range(len(alphas))]
    rows = est.rows(ids)
    for r, a in zip(rows, alphas):
        est._alpha[r] = a
    return CostModel(k, est, table), ids


def expected(alpha, k):
    """1 + sum over positions i < k of the chain acceptance at i (the definition)."""
    total, chain = 1.0, 1.0
    for i in range(k):
        chain *= alpha[i]
        total += chain
    return total


def ratio(alphas, ks, table, batch):
    gain = sum(expected(a, k) for a, k in zip(alphas, ks)) + (batch - len(ks))
    return gain / (table.batch_time(batch, max(ks)) + sum(table.draft_cost(k) for k in ks))


# ---- the step-time table ---------------------------------------------------------------------


def test_step_time_lookup():
    t = StepTimes((1, 4), (1, 2, 4), {(1, 1): 1.0, (1, 2): 1.5, (1, 4): 2.0, (4, 1): 3.0,
                                      (4, 2): 3.5, (4, 4): 5.0}, draft={(4, 3): 0.25},
                  per_draft=(0.0, 0.1, 0.2, 0.3))
    assert t.max_draft == 3
    assert t.batch_time(1, 0) == 1.0 and t.batch_time(1, 1) == 1.5
    assert t.batch_time(1, 2) == 2.0  # 3 rows pad to the captured q = 4
    assert t.batch_time(3, 3) == 5.25  # bucket 4, q 4, and the drafter's term
    assert t.batch_time(8, 0) == 6.0  # past the largest bucket: in proportion
    assert t.batch_time(1, 4) == math.inf  # no captured q holds 5 rows
    assert t.draft_cost(0) == 0.0 and t.draft_cost(2) == 0.2


@pytest.mark.parametrize("kwargs,msg", [
    (dict(buckets=(1,), q_lens=(1, 2), verify={(1, 1): 1.0}), r"no verify time .*\(1, 2\)"),
    (dict(buckets=(1,), q_lens=(2,), verify={(1, 2): 1.0}), "query lengths from 1"),
    (dict(buckets=(1,), q_lens=(1,), verify={(1, 1): -1.0}), "finite numbers >= 0"),
    (dict(buckets=(1,), q_lens=(1, 2), verify={(1, 1): 1.0, (1, 2): 1.0}, per_draft=(0.0,)),
     "per_draft needs an entry for every draft length 0..1"),
])
def test_step_time_table_checks(kwargs, msg):
    with pytest.raises(ConfigError, match=msg):
        StepTimes(**kwargs)


# ---- acceptance estimates --------------------------------------------------------------------


def test_estimates_update_per_position():
    est = AcceptanceEstimates(3, 0.5, rate=0.5)
    assert est.alpha(["a"]).tolist() == [[0.5, 0.5, 0.5]]  # the prior
    est.observe("a", 3, 1)  # draft 0 accepted, draft 1 rejected, draft 2 unseen
    assert est.alpha(["a"]).tolist() == [[0.75, 0.25, 0.5]]
    est.observe("a", 2, 2)  # both accepted: position 2 was not drafted
    assert est.alpha(["a"]).tolist() == [[0.875, 0.625, 0.5]]
    est.observe("a", 3, 0)  # draft 0 rejected: nothing about the later ones
    assert est.alpha(["a"]).tolist() == [[0.4375, 0.625, 0.5]]
    est.observe("a", 0, 0)  # no drafts: nothing
    assert est.alpha(["a"]).tolist() == [[0.4375, 0.625, 0.5]]
    assert est.alpha(["b"]).tolist() == [[0.5, 0.5, 0.5]]  # another request: its own row
    est.forget("a")
    assert est.alpha(["c", "a"]).tolist() == [[0.5] * 3, [0.5] * 3]  # reused slot, fresh row
    est.forget("a")
    n = len(est)
    est.observe("a", 2, 1)  # a step drained after its request ended: no slot comes back
    assert len(est) == n


@pytest.mark.parametrize("seed", range(4))
def test_a_steps_observations_at_once_equal_one_at_a_time(seed):
    """observe_many (one numpy pass a step) leaves the estimates observe leaves, request by
    request: random drafts and accepted counts, requests without a row and empty drafts
    among them."""
    rng = random.Random(seed)
    one, many = AcceptanceEstimates(K, 0.5), AcceptanceEstimates(K, 0.5)
    ids = [f"r{i}" for i in range(12)]
    for est in (one, many):
        est.rows(ids[:10])  # r10, r11 never asked: ignored
    for _ in range(20):
        step = rng.sample(ids, 8)
        nd = [rng.randint(0, K + 1) for _ in step]
        na = [rng.randint(0, d) for d in nd]
        for r, d, a in zip(step, nd, na):
            one.observe(r, d, a)
        many.observe_many(step, nd, na)
    assert np.array_equal(one.alpha(ids[:10]), many.alpha(ids[:10]))


def test_estimates_prior_per_position_and_expected_emitted():
    est = AcceptanceEstimates(3, [0.9, 0.5, 0.2])
    a = est.alpha(["x"])
    assert a.tolist() == [[0.9, 0.5, 0.2]]
    e = AcceptanceEstimates.expected_emitted(a)[0]
    assert np.allclose(e, [expected(a[0], k) for k in range(4)])
    assert np.allclose(e, [1.0, 1.9, 1.9 + 0.45, 1.9 + 0.45 + 0.09])
    with pytest.raises(ValueError, match=r"prior must lie in \[0, 1\]"):
        AcceptanceEstimates(2, 1.5)


def test_estimates_grow_past_their_first_rows():
    est = AcceptanceEstimates(2, 0.5)
    ids = [f"r{i}" for i in range(40)]
    est.rows(ids)
    for i, rid in enumerate(ids):
        est.observe(rid, 2, i % 3)
    got = est.alpha(ids)
    for i in range(40):
        want = AcceptanceEstimates(2, 0.5)
        want.rows(["z"])
        want.observe("z", 2, i % 3)
        assert got[i].tolist() == want.alpha(["z"])[0].tolist()


# ---- the choice ------------------------------------------------------------------------------


@pytest.mark.parametrize("table", [padded_table(), eager_table()], ids=["padded", "eager"])
def test_low_acceptance_drafts_nothing_high_drafts_everything(table):
    low, _ = model_with([[0.05] * K] * 3, table)
    assert low.best_lengths(low.estimates.alpha(["r0", "r1", "r2"]), 3).tolist() == [0, 0, 0]
    high, _ = model_with([[0.97] * K] * 3, table)
    assert high.best_lengths(high.estimates.alpha(["r0", "r1", "r2"]), 3).tolist() == [K] * 3


def test_one_batch_mixes_lengths_where_rows_cost():
    """Eager rows cost their own time: the copying requests draft everything, the others
    nothing, in the same step; one in between drafts a little."""
    alphas = [[0.97] * K, [0.05] * K, [0.97] * K, [0.05] * K, [0.6, 0.1, 0.1, 0.1]]
    cm, ids = model_with(alphas, eager_table())
    ks = cm.choose(ids, len(ids), K)
    assert ks == [K, 0, K, 0, 1]


def test_padded_rows_make_everyone_draft_the_longest():
    """In a graph step every row pads to the longest draft: a request that drafts less saves
    nothing, so all draft the one length that pays for the batch."""
    alphas = [[0.97] * K, [0.05] * K, [0.97] * K]
    cm, ids = model_with(alphas, padded_table())
    assert cm.choose(ids, 3, K) == [K] * 3
    # ...unless the batch's gain does not pay for the longer step
    cm, ids = model_with([[0.97] * K] + [[0.02] * K] * 6, padded_table(verify_row=0.5))
    assert cm.choose(ids, 7, K) == [0] * 7


def test_the_bound_and_the_others_of_the_batch():
    table = padded_table(verify_row=0.5)
    cm, ids = model_with([[0.97] * K] * 2, table)
    assert cm.choose(ids, 2, 2) == [2, 2]  # k_max (a schedule's bound) caps the choice
    assert cm.best_lengths(cm.estimates.alpha(ids), 2).tolist() == [K, K]
    # the same two requests in a step of 8 (6 not drafting): the longer step costs all 8
    assert cm.best_lengths(cm.estimates.alpha(ids), 8).tolist() == [0, 0]


@pytest.mark.parametrize("seed", range(12))
def test_choice_is_the_best_ratio_of_all_choices(seed):
    """Random acceptance, random tables: the chosen lengths reach the best tokens per second
    of every combination of per-request lengths (brute force)."""
    rng = random.Random(seed)
    k = rng.choice([2, 3])
    n = rng.choice([2, 3, 4])
    alphas = [[rng.random() for _ in range(k)] for _ in range(n)]
    if seed % 2:
        table = StepTimes.eager(8, k, step_s=1.0, token_s=rng.uniform(0.01, 0.6),
                                head_step_s=rng.uniform(0, 0.2), verify_s=rng.uniform(0, 0.3))
    else:
        table = padded_table(k, verify_row=rng.uniform(0.02, 0.8))
    batch = n + rng.choice([0, 0, 3])
    cm, ids = model_with(alphas, table, k)
    got = cm.best_lengths(cm.estimates.alpha(ids), batch).tolist()
    best = max(ratio(alphas, ks, table, batch)
               for ks in itertools.product(range(k + 1), repeat=n))
    assert ratio(alphas, got, table, batch) >= best * (1 - 1e-9), (got, alphas)


def test_a_uniform_length_is_kept_unless_another_beats_it_by_the_margin():
    """Over a graph table everyone drafts one length; the last one used stays while another
    is better by less than KEEP_MARGIN (a change of length launches from the host), and gives
    way beyond it."""
    from outpace.speculative.cost_model import KEEP_MARGIN
    table = padded_table(verify_row=0.15)
    cm, ids = model_with([[0.6] * K] * 2, table)
    alpha = cm.estimates.alpha(ids)
    free = cm.best_lengths(alpha, 2)
    rates = {m: ratio(alpha.tolist(), [m, m], table, 2) for m in range(K + 1)}
    best = int(free[0])
    assert max(rates, key=rates.get) == best
    near = [m for m in rates if m != best and rates[best] < rates[m] * (1 + KEEP_MARGIN)]
    far = [m for m in rates if rates[best] >= rates[m] * (1 + KEEP_MARGIN)]
    assert near and far, rates  # the case has both kinds
    for m in near:
        assert cm.best_lengths(alpha, 2, keep=m).tolist() == [m, m]
    for m in far:
        assert cm.best_lengths(alpha, 2, keep=m).tolist() == [best, best]
    # per-row costs (eager steps) mix lengths: nothing is kept there
    eager, ids = model_with([[0.97] * K, [0.05] * K], eager_table())
    assert eager.best_lengths(eager.estimates.alpha(ids), 2, keep=1).tolist() == [K, 0]


def test_estimates_moving_around_a_tie_do_not_flip_the_length():
    """Acceptance wobbling around the point where two lengths tie: without the margin the
    length flips with every wobble; with it (the last length used kept), it stays put."""
    table = padded_table(verify_row=0.15)
    lo, hi = 0.05, 0.99  # bisect the acceptance where drafting 2 and 3 tie
    for _ in range(40):
        mid = (lo + hi) / 2
        two, three = (ratio([[mid] * K], [m], table, 1) for m in (2, 3))
        lo, hi = (mid, hi) if two > three else (lo, mid)
    flips = {}
    for keep in (False, True):
        chosen, last = [], None
        for i in range(40):
            a = lo + (0.01 if i % 2 else -0.01)
            cm, ids = model_with([[a] * K], table)
            ks = cm.best_lengths(cm.estimates.alpha(ids), 1, keep=last if keep else None)
            chosen.append(int(ks[0]))
            last = chosen[-1]
        flips[keep] = sum(x != y for x, y in zip(chosen, chosen[1:]))
    assert set(chosen) <= {2, 3}
    assert flips[False] == 39 and flips[True] == 0, flips


def test_probes_back_off_and_reset():
    """A request that drafts less than it could reads the prior once after 4 such steps, then
    after 8, 16 (the backoff doubles to its cap); drafting on its own estimate resets it."""
    est = AcceptanceEstimates(2, 0.9, probe_after=4, probe_max=16)
    cm = CostModel(2, est, eager_table(2))
    est.rows(["a"])
    for _ in range(8):
        est.observe("a", 2, 0)
    probes = [i for i in range(80) if cm.choose(["a"], 1, 2) != [0]]
    assert probes == [4, 13, 30, 47, 64], probes  # 4 short steps, then 8, 16, 16, 16
    est.observe("a", 2, 2)  # the probe's drafts were accepted
    est.observe("a", 2, 2)
    assert cm.choose(["a"], 1, 2) == [2]  # on its own estimate: the backoff resets
    for _ in range(8):
        est.observe("a", 2, 0)
    assert [i for i in range(10) if cm.choose(["a"], 1, 2) != [0]] == [4]


def test_undrafted_requests_come_back():
    """A request at k = 0 is measured again after a while (a probe)."""
    policy = DraftLengthPolicy(K, adaptive="cost", prior=0.9)
    policy.set_step_times(eager_table(), measure=False)
    assert policy.lengths(["a"], 1) == [K]
    for _ in range(6):
        policy.observe("a", K, 0)
    ks = [policy.lengths(["a"], 1)[0] for _ in range(40)]
    assert ks[0] == 0 and max(ks) == K


def test_policy_needs_a_table_and_keeps_the_schedule():
    policy = DraftLengthPolicy(K, schedule=[[2, 2]], adaptive="cost", prior=0.97)
    with pytest.raises(RuntimeError, match="no step-time table"):
        policy.lengths(["a"], 1)
    policy.set_step_times(padded_table(), measure=False)
    assert policy.lengths(["a", "b"], 2) == [2, 2]  # the schedule's k at batch 2 bounds it
    assert policy.lengths(["a", "b", "c"], 3) == [0, 0, 0]  # beyond its last bound: none
    assert policy.base_k(1) == 2
    policy.forget("a")


# ---- the option ------------------------------------------------------------------------------


def test_option_from_config_and_cli():
    from outpace.entrypoints.cli import build_parser
    from outpace.entrypoints.cli_options import engine_kwargs
    a = build_parser().parse_args(["generate", "hi", "--spec", "ngram",
                                   "--spec-option", "adaptive=cost"])
    spec = engine_kwargs(a)["speculative_config"]
    assert SpecConfig.from_dict(spec).adaptive == "cost"
    assert SpecConfig(method="suffix", adaptive="cost").adaptive == "cost"
    with pytest.raises(ConfigError, match="'adaptive' must be true, false or \"cost\""):
        SpecConfig(method="suffix", adaptive="costs")


# ---- engines ---------------------------------------------------------------------------------

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
KW = dict(block_size=TINY_BLOCK, max_num_batched_tokens=32)


def spec_of(tiny_heads, method, k=3, **opts):
    spec = {"method": method, "num_speculative_tokens": k, "adaptive": "cost", **opts}
    if method in ("eagle3", "mtp"):
        spec.update(model=str(tiny_heads[method]), **EXACT_DRAFTS)
    if method == "mtp":
        spec["mtp_mode"] = "eagle"
    return spec


def draft_lengths(log, rid="w0-0") -> list:
    """The drafts rid verified at each of its decode steps (StepLog)."""
    return [rids[rid][0] for _, rids in log.steps if rid in rids]


@pytest.mark.parametrize("method", ["ngram", "suffix", "eagle3", "mtp"])
def test_output_identical_to_no_speculation(tiny_loaded, tiny_heads, method):
    prompts = repetitive_prompts(5, 21)
    want = run_waves(tiny_loaded, [prompts], GREEDY, **KW).outputs
    logs = []

    def on_engine(engine):
        # the measured table, then one where every drafted row costs: a mix of lengths
        assert engine.runner.proposer.policy.cost_model.table is not None
        engine.runner.proposer.policy.set_step_times(eager_table(3, token_s=0.05), measure=False)
        logs.append(StepLog(engine))
    got = run_waves(tiny_loaded, [prompts], GREEDY, speculative_config=spec_of(
        tiny_heads, method), on_engine=on_engine, **KW)
    assert got.outputs == want
    assert got.stats["spec"]["num_drafts"] > 0
    lengths = {nd for _, rids in logs[0].steps for nd, _ in rids.values()}
    assert len(lengths) > 1, lengths


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_fused_graph_steps_with_the_cost_model(tiny_loaded, tiny_heads,
                                               method):
    """The fused step (CPU stand-in of its graphs): the table measured from the graphs covers
    every bucket and verify length; output identical to no speculation; the random head's
    drafts, all rejected, stop within a few steps."""
    prompts = repetitive_prompts(3, 22)
    want = run_waves(tiny_loaded, [prompts], GREEDY, **KW).outputs
    k = 3
    tables, logs = [], []

    def on_engine(engine):
        engine.runner.enable_cuda_graphs(tuple(range(1, k + 2)), capture_fused=True,
                                         capture=rerun_capture)
        engine.measure_step_times()
        tables.append(engine.runner.proposer.policy.cost_model.table)
        engine.runner.proposer.policy.set_step_times(eager_table(k, token_s=0.05), measure=False)
        logs.append(StepLog(engine))
    got = run_waves(tiny_loaded, [prompts], GREEDY, speculative_config=spec_of(
        tiny_heads, method, k), on_engine=on_engine, max_num_seqs=4, **KW)
    assert got.outputs == want
    assert got.engine.runner.fused.replays > 0
    if method == "eagle3":
        lens = draft_lengths(logs[0])
        assert lens[1] > 0 and 0 in lens[1:8], str(lens)  # stopped within a few steps
        after = lens[lens.index(0, 1):]  # ...for good: only probes (one in 16 steps)
        assert sum(1 for n in after if n) <= len(after) // 8, str(lens)
    table = tables[0]
    graphs = got.engine.runner.graphs
    assert table.q_lens == tuple(range(1, k + 2)) and table.buckets == tuple(graphs.buckets)
    assert set(table.verify) == {(b, q) for b in graphs.buckets for q in graphs.q_lens}


def test_head_whose_drafts_fail_stops_drafting_then_resumes(tiny_loaded, tiny_heads):
    """A random head's drafts are all rejected: within a few steps the request drafts nothing.
    Forced full acceptance from then on: it is tried again and drafts the full k."""
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    logs, state = [], {}

    def on_engine(engine):
        engine.runner.proposer.policy.set_step_times(eager_table(3, token_s=0.05), measure=False)
        logs.append(StepLog(engine))

    def after_step(engine):
        lens = draft_lengths(logs[0])
        if not state and len(lens) >= 4 and lens[-4:] == [0, 0, 0, 0]:
            engine.runner.sampling.force_accept_mean = 10.0  # accept everything from now on
            state["at"] = len(lens)

    run = run_waves(tiny_loaded, [repetitive_prompts(1, 23)], params, on_engine=on_engine,
                    after_step=after_step, speculative_config=spec_of(tiny_heads, "eagle3"),
                    **KW)
    lens = draft_lengths(logs[0])
    assert lens[1] == 3, lens  # the prior drafts (the first step is the prefill)
    assert "at" in state, lens  # drafting stopped
    assert 3 in lens[state["at"]:], lens  # and came back to the full k
    assert run.engine.runner.proposer.policy.cost_model.table is not None


# ---- the fused graph's draft loop follows the choice -----------------------------------------


class GraphSteps:
    """Records each fused decode step an engine collects: (q, its draft-loop length kd,
    chained), and the head's rows computed inside decode graphs, per kd (the CPU stand-in's
    replay re-runs FusedStep.compute, so a head pass or loop step there is real work)."""

    def __init__(self, engine):
        fused, head = engine.runner.fused, engine.runner.proposer
        self.steps = []  # (q, kd, chained) per decode step, in order
        self.head_rows: dict = {}  # kd -> head rows computed inside decode graphs of that kd
        inner_compute, inner_step, inner_collect = fused.compute, head.step, fused.collect
        inside = []

        def compute(bucket, q, kd, *args, **kw):
            inside.append(kd)
            try:
                return inner_compute(bucket, q, kd, *args, **kw)
            finally:
                inside.pop()

        def step(hidden, ids, pos, ctx):
            if inside:
                self.head_rows[inside[-1]] = self.head_rows.get(inside[-1], 0) + hidden.shape[0]
            return inner_step(hidden, ids, pos, ctx)

        def collect(launched, plan):
            if not launched.prefill:
                self.steps.append((launched.key[1], launched.kd, launched.key[3]))
            return inner_collect(launched, plan)

        fused.compute, head.step, fused.collect = compute, step, collect

    @property
    def kds(self) -> list:
        return [kd for _, kd, _ in self.steps]


def graph_run(tiny_loaded, tiny_heads, prompts, params, table, k=3, after_step=None,
              engine_kw=KW, **opts):
    """A cost-model EAGLE-3 engine on the fused graphs (CPU stand-in, overlap on) under
    `table`, run to completion -> (Run, GraphSteps)."""
    from tests.speculative.test_fused_step import enable_graphs
    rec = {}

    def on_engine(engine):
        enable_graphs(engine, k)
        engine.runner.proposer.policy.set_step_times(table, measure=False)
        rec["steps"] = GraphSteps(engine)
    run = run_waves(tiny_loaded, [prompts], params, on_engine=on_engine, after_step=after_step,
                    speculative_config=spec_of(tiny_heads, "eagle3", k, **opts),
                    max_num_seqs=8, **engine_kw)
    return run, rec["steps"]


def test_graph_runs_no_head_where_drafting_does_not_pay(tiny_loaded, tiny_heads):
    """Every extra verify row costs ten steps: the cost model chooses 0 for every step, and
    the fused steps run kd = 0 graphs (no head rows computed in them), chained; output
    identical to no speculation."""
    prompts = repetitive_prompts(3, 31)
    want = run_waves(tiny_loaded, [prompts], GREEDY, **KW).outputs
    run, steps = graph_run(tiny_loaded, tiny_heads, prompts, GREEDY,
                           padded_table(3, verify_row=10.0))
    fused, work = run.engine.runner.fused, run.engine.runner.proposer.work
    assert run.outputs == want
    assert len(steps.steps) > 20 and set(steps.kds) == {0}, steps.steps
    assert sum(steps.head_rows.values()) == 0, steps.head_rows
    assert work.loop_rows == 0 and work.skipped_rows >= len(steps.steps)
    assert fused.kd_steps == {0: len(steps.steps)}
    assert fused.chained > len(steps.steps) // 2, (fused.chained, len(steps.steps))
    assert run.stats["spec"]["num_drafts"] == 0


def test_graph_drafts_the_full_k_where_drafting_pays(tiny_loaded, tiny_heads):
    """Verify rows nearly free and every draft accepted (force-accept): every fused step's
    graph drafts the full k, its head computing rows, and the steps chain."""
    k = 3
    run, steps = graph_run(tiny_loaded, tiny_heads, repetitive_prompts(3, 32), GREEDY,
                           padded_table(k, verify_row=0.02), k=k, force_accept_mean=k + 1)
    fused, work = run.engine.runner.fused, run.engine.runner.proposer.work
    assert len(steps.steps) > 5 and set(steps.kds) == {k}, steps.steps
    assert steps.head_rows.get(k, 0) >= (k + 1) * len(steps.steps), steps.head_rows
    assert work.loop_rows >= (k - 1) * len(steps.steps)
    assert fused.chained > len(steps.steps) // 2, (fused.chained, len(steps.steps))
    spec = run.stats["spec"]
    assert spec["num_accepted_tokens"] == spec["num_draft_tokens"] > 0


def test_graph_follows_falling_acceptance_and_repairs_when_drafting_resumes(
        tiny_loaded, tiny_heads):
    """The random head's drafts are all rejected: the prior's full k falls to kd = 0 within a
    few steps; a probe later drafts again, which first recomputes the requests from their
    draft-plane marks (the kd = 0 graphs skipped their entries), then verifies k drafts in a
    graph. Output identical to no speculation; every request that holds drafts has an exact
    plane (dense oracle)."""
    from tests.speculative.test_draft_plane import PlaneChecker
    from tests.speculative.test_draft_skip import drafting_plane_exact
    k = 3
    params = SamplingParams(max_tokens=44, temperature=0.0, ignore_eos=True)
    prompts = repetitive_prompts(3, 33)
    kw = dict(KW, max_num_batched_tokens=64)  # the three requests' repairs in one step
    want = run_waves(tiny_loaded, [prompts], params, **kw).outputs
    drafting, seen = drafting_plane_exact(tiny_loaded)
    at_mark = PlaneChecker(tiny_loaded, upto="mark")
    resumed = []

    def after_step(engine):
        drafting(engine)
        at_mark(engine)
        if engine.runner.fused.kd_steps.get(0):  # drafts held after the first kd = 0 step
            resumed.extend(r.request_id for r in engine.scheduler.running if r.spec_token_ids)

    run, steps = graph_run(tiny_loaded, tiny_heads, prompts, params,
                           padded_table(k, verify_row=0.05), k=k, after_step=after_step,
                           engine_kw=kw)
    assert run.outputs == want
    kds = steps.kds
    assert kds[0] == k and 0 in kds, steps.steps
    first_zero = kds.index(0)
    assert kds[first_zero:first_zero + 8] == [0] * 8, steps.steps  # it stays off
    # the loop shortened on the device too: a chained step of another length than its
    # predecessor's (its graph captured with the predecessor's: GraphTable.successors)
    assert any(chained and kd != kds[i - 1] for i, (_, kd, chained) in enumerate(steps.steps)
               if i), steps.steps
    # a probe: drafting resumed after kd = 0 graphs (the repair first), a graph verified k
    assert len(set(resumed)) == 3, resumed
    assert any(q == k + 1 for q, _, _ in steps.steps[first_zero:]), steps.steps
    assert run.engine.runner.proposer.work.skipped_rows > 20
    assert seen["requests"] > 5 and at_mark.entries_checked > 100
    assert run.engine.runner.fused.chained > 10


def test_graph_switches_with_forced_acceptance(tiny_loaded, tiny_heads):
    """Force-accept on, off, on again: the graphs draft k, fall to kd = 0 and come back to
    k, with every write of a launched or chained step inside the blocks reserved for it."""
    from tests.speculative.test_draft_skip import drafting_plane_exact
    k = 3
    drafting, seen = drafting_plane_exact(tiny_loaded)
    state = {"steps": 0}

    def after_step(engine):
        drafting(engine)
        state["steps"] += 1
        if state["steps"] == 12:
            engine.runner.sampling.force_accept_mean = None  # the head stops agreeing
        elif state["steps"] == 40:
            engine.runner.sampling.force_accept_mean = k + 1.0

    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    run, steps = graph_run(tiny_loaded, tiny_heads, repetitive_prompts(2, 34), params,
                           padded_table(k, verify_row=0.05), k=k, after_step=after_step,
                           force_accept_mean=k + 1, check_fused_writes=True)
    kds = steps.kds
    off = kds.index(0)
    assert set(kds[:off]) == {k} and off > 3, steps.steps
    back = next((i for i in range(off, len(kds)) if kds[i] == k), None)
    assert back is not None and kds[back:back + 5] == [k] * 5, steps.steps
    fused = run.engine.runner.fused
    assert fused.chained > 20 and fused.write_check.chained_steps == fused.chained
    assert seen["requests"] > 5


def test_a_chained_step_keeps_one_length_and_never_drafts_after_a_skip():
    """StepDraftLengths.chained_kd under the cost model: the chained step verifies the drafts prev
    made for every row, so prev's choice must be kd for each; its own loop is the next
    choice when that is one length whose graph exists, and never > 0 right after a kd = 0
    decode step (whose skipped plane entries the general path repairs first)."""
    from types import SimpleNamespace as NS

    from outpace.runner.fused_draft_length import StepDraftLengths
    from outpace.runner.fused_step import Launched
    from outpace.runner.graph_mode import GREEDY as GREEDY_MODE

    def chained_kd(prev_kd, prev_next, choice, prefill=False, captured=None):
        captured = captured or {(1, prev_kd + 1, c, True) for c in range(4)}
        step = NS(chainable=True, next_q=lambda kd: kd + 1,
                  table=NS(by_mode={GREEDY_MODE: captured}))
        lengths = NS(step=step, follows_choice=True,
                     _next_choice=lambda after, rids, b: NS(lengths=list(choice)))
        prev = Launched((1, 2, prev_kd, False), ["a", "b"], None, None, prefill=prefill,
                        next_k=dict(zip("ab", prev_next)))
        plan = NS(draft_batch_size=2, scheduled=[NS(request=NS(request_id=r)) for r in "ab"])
        return StepDraftLengths.chained_kd(lengths, prev, plan)

    assert chained_kd(3, (3, 3), (3, 3)) == 3
    assert chained_kd(3, (3, 3), (0, 0)) == 0  # the choice falls: chained with no head
    assert chained_kd(3, (3, 1), (3, 3)) is None  # prev's drafts differ per row
    assert chained_kd(3, (2, 2), (3, 3)) is None  # ...or are not the kd its graph drafted
    assert chained_kd(3, (3, 3), (3, 1)) is None  # the next choice is not one length
    assert chained_kd(0, (0, 0), (0, 0)) == 0
    assert chained_kd(0, (0, 0), (3, 3)) is None  # drafting after a skip: the general path
    assert chained_kd(3, (3, 3), (3, 3), prefill=True) == 3
    assert chained_kd(3, (3, 3), (2, 2), captured={(1, 4, 3, True)}) is None  # no graph


@pytest.mark.parametrize("verify_row,chains", [(10.0, True), (0.02, False)],
                         ids=["drafting-never-pays", "drafting-pays"])
def test_host_drafter_steps_chain_where_the_cost_model_drafts_nothing(
        tiny_loaded, tiny_heads, verify_row, chains):
    """A host drafter (suffix) under the cost model, overlap on: where every extra verify row
    costs ten steps the choice is 0 for everyone, so each step chains from the last on the
    device like a plain one (no wait for the host's proposals) and nothing is drafted; where
    rows are nearly free the drafter proposes and its steps are relaunched. Output identical
    to no speculation either way; the chained steps' writes checked."""
    from tests.speculative.test_fused_step import enable_graphs
    k = 3
    prompts = repetitive_prompts(3, 34)
    want = run_waves(tiny_loaded, [prompts], GREEDY, **KW).outputs

    def on_engine(engine):
        enable_graphs(engine, k)
        engine.runner.proposer.policy.set_step_times(padded_table(k, verify_row=verify_row),
                                                     measure=False)
    runs = [run_waves(tiny_loaded, [prompts], GREEDY, on_engine=on_engine, max_num_seqs=8,
                      speculative_config=spec_of(tiny_heads, "suffix", k,
                                                 check_fused_writes=True),
                      overlap=overlap, **KW) for overlap in (False, True)]
    sync, run = runs
    fused, spec = run.engine.runner.fused, run.stats["spec"]
    assert run.outputs == sync.outputs == want
    # the same choices with overlap as without: a chain's choice reads the estimates a sync
    # step's choice does
    assert spec == sync.stats["spec"]
    assert fused.write_check.steps > 10
    if chains:
        assert fused.chained > fused.replays // 2, (fused.chained, fused.replays)
        assert spec["num_drafts"] == 0
    else:
        assert fused.relaunched > fused.replays // 2 and spec["num_accepted_tokens"] > 0
        assert fused.chained < fused.replays // 4, (fused.chained, fused.replays)
