"""The cost model's measured step times: corrections to the start-up table from the wall time
between decode steps, and the choices they change (a host drafter whose steps wait for the
host stops drafting where its acceptance does not pay for the wait)."""

from __future__ import annotations

import pytest

from outpace.runner.step_clock import StepClock
from outpace.speculative.measured_steps import MeasuredSteps
from tests.speculative.test_cost_model import (GREEDY, KW, model_with, padded_table, spec_of)
from tests.speculative.spec_helpers import repetitive_prompts, run_waves


def test_corrections_average_per_bucket_and_length():
    table = padded_table(3, verify_row=0.1)  # buckets 1, 2, 4, 8
    m = MeasuredSteps(table, rate=0.5)
    assert m.correction(1, 0) == m.correction(3, 2) == 0.0 and m.snapshot() is None
    base = table.batch_time(1, 2)
    m.observe(1, 2, base + 1.0)  # one sample is not a correction yet
    assert m.correction(1, 2) == 0.0
    m.observe(1, 2, base + 3.0)  # the lesser of the first two
    assert m.correction(1, 2) == pytest.approx(1.0)
    m.observe(1, 2, base + 2.0)  # then half-way toward each new sample
    assert m.correction(1, 2) == pytest.approx(1.5)
    assert m.batch_time(1, 2) == pytest.approx(base + 1.5)
    # another drafting length at the bucket takes the nearest measured one; m = 0 does not
    assert m.correction(1, 3) == m.correction(1, 1) == pytest.approx(1.5)
    assert m.correction(1, 0) == 0.0
    # batches share their table bucket, other buckets are apart
    m.observe(3, 0, table.batch_time(3, 0) - 0.5)
    m.observe(4, 0, table.batch_time(4, 0) - 0.4)
    assert m.correction(4, 0) == pytest.approx(-0.5) and m.correction(2, 0) == 0.0
    assert m.snapshot() == {"1/2": 1500.0, "4/0": -500.0}
    # every interval counted where it was measured (a first sample too)
    assert m.sample_counts() == {"1/2": 3, "4/0": 2}
    # a pause in the first two samples does not count; later a sample far above the
    # estimate counts as OUTLIER times it
    m2 = MeasuredSteps(table, outlier=3.0)
    t = table.batch_time(1, 0)
    m2.observe(1, 0, 100 * t)
    m2.observe(1, 0, 2 * t)
    assert m2.correction(1, 0) == pytest.approx(t)
    m2.observe(1, 0, 100 * t)
    assert m2.correction(1, 0) == pytest.approx(t + 0.2 * (6 * t - t - t))
    # nonsense is ignored; a frozen one observes nothing
    m2.observe(1, 0, -1.0)
    m2.observe(1, 0, float("nan"))
    assert m2.samples == 3
    frozen = MeasuredSteps(table, frozen=True)
    frozen.observe(1, 1, 50.0)
    frozen.observe(1, 1, 50.0)
    assert frozen.correction(1, 1) == 0.0 and frozen.samples == 0



def test_a_bucket_with_no_drafting_measured_takes_the_nearest_buckets():
    """A bucket where no drafting length was measured takes the nearest measured bucket's
    drafting correction (nearest in ratio, then the nearest length there), scaled down in
    proportion from a larger bucket and as it is from a smaller one; the step without drafts
    is never inferred; a bucket's own measurement wins. A batch draining into a smaller bucket
    then does not try drafting afresh there: with a host wait measured at bucket 8, the choice
    at bucket 2 is 0 where the table alone would draft."""
    table = padded_table(3, verify_row=0.02)  # buckets 1, 2, 4, 8
    m = MeasuredSteps(table)
    for _ in range(2):
        m.observe(8, 3, table.batch_time(8, 3) + 8.0)
    assert m.correction(2, 3) == m.correction(2, 1) == pytest.approx(2.0)  # 8.0 x 2 / 8
    assert m.correction(4, 2) == pytest.approx(4.0)
    assert m.correction(2, 0) == m.correction(8, 0) == 0.0
    for _ in range(2):
        m.observe(1, 2, table.batch_time(1, 2) + 0.5)
    assert m.correction(2, 3) == pytest.approx(0.5)  # bucket 1 is nearer 2 than 8 is
    assert m.correction(4, 3) == pytest.approx(4.0)  # 8 is nearer 4 than 1 is: 8.0 x 4 / 8
    for _ in range(2):
        m.observe(2, 1, table.batch_time(2, 1) + 0.25)
    assert m.correction(2, 3) == pytest.approx(0.25)  # its own bucket's, any length
    # the choice at a bucket never measured
    cm, ids = model_with([[0.6] * 3] * 2, table, k=3)
    assert cm.best_lengths(cm.estimates.alpha(ids), 2).tolist() == [3, 3]
    for _ in range(2):
        cm.observe_step(8, 3, table.batch_time(8, 3) + 8.0)
    assert cm.best_lengths(cm.estimates.alpha(ids), 2).tolist() == [0, 0]

def test_a_correction_not_measured_again_goes_stale():
    """A drafting length the choice gave up on loses its correction after `stale` steps of
    other lengths (so it is tried, and measured, again); measured again, it counts afresh."""
    table = padded_table(3, verify_row=0.1)
    m = MeasuredSteps(table, stale=10)
    for _ in range(2):
        m.observe(1, 3, table.batch_time(1, 3) + 5.0)
    for i in range(10):
        m.observe(1, 0, table.batch_time(1, 0))
        assert m.correction(1, 3) == m.correction(1, 2) == pytest.approx(5.0), i
    m.observe(1, 0, table.batch_time(1, 0))
    assert m.correction(1, 3) == m.correction(1, 2) == 0.0
    assert m.snapshot() == {"1/0": 0.0}
    m.observe(1, 3, table.batch_time(1, 3) + 1.0)  # afresh: two samples again
    assert m.correction(1, 3) == 0.0
    m.observe(1, 3, table.batch_time(1, 3) + 2.0)
    assert m.correction(1, 3) == pytest.approx(1.0)
    # a lone first sample goes stale too: it does not pair with one long after it
    m.observe(1, 2, table.batch_time(1, 2) + 0.01)
    for _ in range(11):
        m.observe(1, 0, table.batch_time(1, 0))
    m.observe(1, 2, table.batch_time(1, 2) + 4.0)
    m.observe(1, 2, table.batch_time(1, 2) + 3.0)
    assert m.correction(1, 2) == pytest.approx(3.0)
    # the step without drafts never goes stale
    assert m.correction(1, 0) == 0.0 and "1/0" in m.snapshot()


def test_the_clock_reports_only_consecutive_decode_steps():
    seen = []
    clock = StepClock(lambda *a: seen.append(a))
    clock.collected(4, 1.0)  # the first: no interval yet
    clock.chose(3)
    clock.collected(4, 1.5)
    clock.chose(0)
    clock.collected(8, 1.75)
    clock.interrupt()  # a prefill, a request added: the next output starts afresh
    clock.chose(2)
    clock.collected(8, 9.0)
    clock.collected(8, 9.25)
    assert seen == [(4, 3, 0.5), (8, 0, 0.25), (8, 2, 0.25)]


def test_a_measured_host_wait_turns_drafting_off_and_a_cheap_one_keeps_it():
    """Drafting pays by the table (a padded row costs 0.02 of a step, acceptance 0.6); steps
    measured with a host wait of two steps make the choice 0; measured at the table's time,
    drafting stays."""
    table = padded_table(3, verify_row=0.02)
    cm, ids = model_with([[0.6] * 3] * 2, table, k=3)
    assert cm.best_lengths(cm.estimates.alpha(ids), 2).tolist() == [3, 3]
    for _ in range(5):
        cm.observe_step(2, 3, table.batch_time(2, 3))
        cm.observe_step(2, 0, table.batch_time(2, 0))
    assert cm.best_lengths(cm.estimates.alpha(ids), 2).tolist() == [3, 3]
    for _ in range(10):
        cm.observe_step(2, 3, table.batch_time(2, 3) + 2.0)
    assert cm.best_lengths(cm.estimates.alpha(ids), 2).tolist() == [0, 0]
    # a length never measured takes the drafting correction too
    assert cm.measured.batch_time(2, 1) > table.batch_time(2, 1) + 1.5


class ScriptedClock(StepClock):
    """A clock whose intervals are scripted: `wait` seconds after a step chosen to draft
    (the host's proposal and relaunch), 1.0 otherwise; the intervals seen are kept."""

    def __init__(self, report, wait: float):
        super().__init__(report)
        self.wait, self.now, self.seen = wait, 0.0, []

    def collected(self, requests, now):
        self.now += 1.0 + (self.wait if self._pending > 0 else 0.0)
        if self._last is not None:
            self.seen.append(self._pending)
        super().collected(requests, self.now)


@pytest.mark.parametrize("wait,drafts", [(9.0, False), (0.0, True)],
                         ids=["host-wait-9-steps", "no-host-wait"])
def test_host_drafter_stops_drafting_once_its_wait_is_measured(
        tiny_loaded, tiny_heads, wait, drafts):
    """A suffix drafter under the cost model on the fused graphs, overlap on, with a table
    where drafting pays: where its drafting steps are measured to cost ten steps, it drafts
    only until that is measured and then chains plain steps; measured at the table's cost it
    keeps drafting. Output identical to no speculation either way."""
    from tests.speculative.test_fused_step import enable_graphs
    k = 3
    prompts = repetitive_prompts(3, 34)
    want = run_waves(tiny_loaded, [prompts], GREEDY, **KW).outputs
    clocks = []

    def on_engine(engine):
        enable_graphs(engine, k)
        policy = engine.runner.proposer.policy
        policy.set_step_times(padded_table(k, verify_row=0.02))
        clocks.append(ScriptedClock(policy.observe_step, wait))
        engine.runner.step_clock = clocks[0]
    run = run_waves(tiny_loaded, [prompts], GREEDY, on_engine=on_engine, max_num_seqs=8,
                    speculative_config=spec_of(tiny_heads, "suffix", k), overlap=True, **KW)
    fused, spec = run.engine.runner.fused, run.stats["spec"]
    clock, measured = clocks[0], run.engine.runner.proposer.policy.cost_model.measured
    assert run.outputs == want
    assert measured.samples == len(clock.seen) > 10
    drafted = sum(1 for m in clock.seen if m > 0)
    if drafts:
        assert drafted > len(clock.seen) // 2 and spec["num_accepted_tokens"] > 0
    else:  # two drafting steps a batch bucket measure the wait; then plain steps, chained
        assert 0 < drafted <= 2 * 3 and drafted < len(clock.seen) // 3, clock.seen
        assert fused.chained > fused.replays // 2, (fused.chained, fused.replays)
        assert measured.correction(3, k) > 5.0
