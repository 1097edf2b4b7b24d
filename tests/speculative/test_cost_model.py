"""The draft-length cost model (`"adaptive": "cost"`): the step-time table, the per-request
acceptance estimates, the choice of every request's k on synthetic tables (k = 0 where
acceptance is low, the full k where it is high, both in one batch; the best ratio of all
choices, by brute force), the option through config and CLI, and engines with it on: output
identical to no speculation (eager and fused-graph paths), drafting stopping for a head whose
drafts are all rejected and coming back when they are accepted."""

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
from tests.speculative.spec_helpers import TINY_BLOCK, repetitive_prompts, run_waves
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
    policy.set_step_times(eager_table())
    assert policy.lengths(["a"], 1) == [K]
    for _ in range(6):
        policy.observe("a", K, 0)
    ks = [policy.lengths(["a"], 1)[0] for _ in range(40)]
    assert ks[0] == 0 and max(ks) == K


def test_policy_needs_a_table_and_keeps_the_schedule():
    policy = DraftLengthPolicy(K, schedule=[[2, 2]], adaptive="cost", prior=0.97)
    with pytest.raises(RuntimeError, match="no step-time table"):
        policy.lengths(["a"], 1)
    policy.set_step_times(padded_table())
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
        spec["model"] = str(tiny_heads[method])
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
        engine.runner.proposer.policy.set_step_times(eager_table(3, token_s=0.05))
        logs.append(StepLog(engine))
    got = run_waves(tiny_loaded, [prompts], GREEDY, speculative_config=spec_of(
        tiny_heads, method), on_engine=on_engine, **KW)
    assert got.outputs == want
    assert got.stats["spec"]["num_drafts"] > 0
    lengths = {nd for _, rids in logs[0].steps for nd, _ in rids.values()}
    assert len(lengths) > 1, lengths


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_fused_graph_steps_with_the_cost_model(tiny_loaded, tiny_heads, fake_graph_capture,
                                               method):
    """The fused step (CPU stand-in of its graphs): the table measured from the graphs covers
    every bucket and verify length; output identical to no speculation; the random head's
    drafts, all rejected, stop within a few steps."""
    prompts = repetitive_prompts(3, 22)
    want = run_waves(tiny_loaded, [prompts], GREEDY, **KW).outputs
    k = 3
    tables, logs = [], []

    def on_engine(engine):
        engine.runner.enable_cuda_graphs(tuple(range(1, k + 2)), capture_fused=True)
        engine.measure_step_times()
        tables.append(engine.runner.proposer.policy.cost_model.table)
        engine.runner.proposer.policy.set_step_times(eager_table(k, token_s=0.05))
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
        engine.runner.proposer.policy.set_step_times(eager_table(3, token_s=0.05))
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
