"""Scheduler: preemption and resume, lookahead, draft bookkeeping, and a random workload.

See scheduler_harness.py for the fake runner that checks every KV read against the tokens.
"""

import random

import pytest

from outpace.errors import InvalidRequestError
from outpace.types import RequestStatus, SpecStats
from tests.unit.scheduler_harness import (BS, EOS, FakeRunner, StubResult, drive, new_req, planned,
                                          prompt_of, reference,
                                          track)  # noqa: F401 (track: fixture)


# ---- preemption ---------------------------------------------------------------------------

def test_preemption_and_resume_recomputes_everything(track):
    # 8 usable blocks of 4 tokens; two requests that each grow to 6 blocks can't coexist.
    sched = track(num_blocks=9, budget=64, caching=False)
    runner = FakeRunner(sched)
    a = new_req("a", range(10, 20), max_tokens=12, ignore_eos=True)
    b = new_req("b", range(20, 30), max_tokens=12, ignore_eos=True)
    sched.add_request(a)
    sched.add_request(b)
    resumed = []

    def check(plan):
        for s in plan.scheduled:
            if s.request is b and b.num_preemptions and s.num_computed_tokens == 0:
                resumed.append((s.num_new_tokens, b.num_tokens, len(b.output_token_ids)))
        assert "a" not in plan.preempted_ids  # the most recently arrived one goes first
    done = drive(sched, runner, check=check)
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    # The resume step recomputes prompt + every output so far in one prefill.
    assert resumed and all(n == total and outs > 0 for n, total, outs in resumed)
    for r in (a, b):
        assert done[r.request_id].output_token_ids == reference(r.prompt_token_ids,
                                                                r.sampling_params)


def test_preempted_request_is_front_of_waiting_and_state_reset(track):
    sched = track(num_blocks=6, budget=64, caching=False)  # 5 usable blocks
    runner = FakeRunner(sched)
    a = new_req("a", range(10, 18), max_tokens=20, ignore_eos=True)  # 2 blocks
    b = new_req("b", range(20, 27), max_tokens=20, ignore_eos=True)  # 2 blocks
    sched.add_request(a)
    sched.add_request(b)
    c = new_req("c", [30, 31], max_tokens=2, ignore_eos=True)
    preempted = None
    for _ in range(30):
        plan = sched.schedule()
        if plan.preempted_ids:
            preempted = plan.preempted_ids
            break
        sched.update(plan, runner.execute(plan))
        if c.status is RequestStatus.WAITING and c.request_id not in sched._requests:
            sched.add_request(c)  # a later arrival waits behind the victim
    assert preempted == ["b"]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.spec_token_ids == [] and not sched.kv.has_blocks("b")
    assert sched.waiting[0] is b
    sched.update(plan, runner.execute(plan))
    drive(sched, runner)
    assert sched.max_len == 20  # the pool holds 20 tokens: a request alone can't outgrow it
    for r in (a, b, c):
        assert r.output_token_ids == reference(r.prompt_token_ids, r.sampling_params,
                                               max_len=20)


def test_preempting_a_request_already_scheduled_this_step_unschedules_it(track):
    # An older request's prefill chunk can preempt a newer decode scheduled earlier in the
    # same step; the victim must leave the plan and give its tokens back to the budget.
    sched = track(num_blocks=7, budget=16, caching=False)  # 6 usable blocks
    runner = FakeRunner(sched)
    b = new_req("b", [10, 11, 12, 13], max_tokens=6, ignore_eos=True)
    a = new_req("a", range(20, 40), max_tokens=3, ignore_eos=True)
    sched.add_request(b)
    sched.add_request(a)
    plan = sched.schedule()
    assert planned(plan) == [("b", 4), ("a", 12)]
    sched.update(plan, runner.execute(plan))
    sched._order["a"] = -1  # white box: make a the older one (FCFS can't build this alone)
    sched.running.sort(key=lambda r: sched._order[r.request_id])
    plan = sched.schedule()
    assert planned(plan) == [("a", 8)]
    assert plan.preempted_ids == ["b"] and sched.waiting[0] is b
    sched.update(plan, runner.execute(plan))
    drive(sched, runner)
    for r in (a, b):
        assert r.output_token_ids == reference(r.prompt_token_ids, r.sampling_params,
                                               max_len=sched.max_len)


def test_lone_request_is_capped_by_pool_capacity(track):
    # 4 usable blocks = 16 tokens < max_model_len: the request ends at the pool's size.
    sched = track(num_blocks=5, max_model_len=256, lookahead=2)
    assert sched.max_len == 14
    with pytest.raises(InvalidRequestError):
        sched.add_request(new_req("big", range(8, 22)))
    r = new_req("r", range(10, 20), max_tokens=None, ignore_eos=True)
    sched.add_request(r)
    drive(sched, FakeRunner(sched))
    assert r.status is RequestStatus.FINISHED_LENGTH and r.num_tokens == 14


# ---- speculative decoding -----------------------------------------------------------------

def test_draft_accept_reject_bookkeeping_and_lookahead(track):
    sched = track(lookahead=3)
    r = new_req("r", [10, 11, 12, 13, 14], max_tokens=20, ignore_eos=True)
    sched.add_request(r)
    plan = sched.schedule()
    assert len(sched.kv.block_ids("r")) * BS >= 5 + 3  # prefill reserves lookahead too
    sched.update(plan, StubResult.of(plan, [20], drafts_next=[21, 22, 23]))
    assert r.num_computed_tokens == 5 and r.spec_token_ids == [21, 22, 23]
    plan = sched.schedule()
    (s,) = plan.scheduled
    assert (s.num_computed_tokens, s.num_new_tokens, s.draft_token_ids) == (5, 4, [21, 22, 23])
    assert r.num_computed_tokens == 9
    assert len(sched.kv.block_ids("r")) * BS >= 9 + 3
    # 1 of 3 drafts accepted, then a recovered token: 2 rejected drafts roll back.
    sched.update(plan, StubResult.of(plan, [21, 30], accepted=1, drafts_next=[31, 32]))
    assert r.num_computed_tokens == 7 and r.num_tokens == 8
    assert r.output_token_ids == [20, 21, 30] and r.spec_token_ids == [31, 32]
    assert r.spec_stats.num_drafts == 1 and r.spec_stats.num_accepted_tokens == 1
    assert r.spec_stats.accepted_per_position == [1, 0, 0]
    plan = sched.schedule()  # all accepted + bonus
    assert plan.scheduled[0].num_new_tokens == 3
    sched.update(plan, StubResult.of(plan, [31, 32, 33], accepted=2))
    assert r.num_computed_tokens == 10 and r.num_tokens == 11 and r.spec_token_ids == []
    assert r.spec_stats.mean_acceptance_length == 2.5
    sched.abort_request("r")


def test_update_records_drafts_in_totals_also_for_a_request_ended_meanwhile(track):
    sched = track(lookahead=3)
    a = new_req("a", [10, 11, 12], max_tokens=20, ignore_eos=True)
    b = new_req("b", [13, 14, 15], max_tokens=20, ignore_eos=True)
    for r in (a, b):
        sched.add_request(r)
    plan = sched.schedule()
    sched.update(plan, StubResult.each(plan, ([20], 0, [21, 22]), ([30], 0, [31])))
    plan = sched.schedule()
    assert [s.draft_token_ids for s in plan.scheduled] == [[21, 22], [31]]
    result = StubResult.each(plan, ([21, 40], 1, []), ([31, 50], 1, []))
    sched.abort_request("b")  # ended after its step was planned: its tokens are not committed
    totals = SpecStats()
    sched.update(plan, result, totals=totals)
    assert a.output_token_ids == [20, 21, 40] and b.output_token_ids == [30]
    assert (a.spec_stats.num_draft_tokens, a.spec_stats.num_accepted_tokens) == (2, 1)
    assert b.spec_stats.num_drafts == 0
    # the engine's totals count both requests' drafts, as they were verified
    assert (totals.num_drafts, totals.num_draft_tokens, totals.num_accepted_tokens) == (2, 3, 2)
    assert totals.accepted_per_position == [2, 0]
    sched.abort_request("a")


@pytest.mark.parametrize("tokens,params,status,reason,kept", [
    ([5, EOS, 8], dict(stop_token_ids=[5]), RequestStatus.FINISHED_STOPPED, 5, [5]),
    ([6, EOS, 8], {}, RequestStatus.FINISHED_STOPPED, None, [6, EOS]),
    ([6, 8, 9], dict(max_tokens=2), RequestStatus.FINISHED_LENGTH, None, [6, 8]),
    ([6, 8, 9], dict(max_tokens=None), RequestStatus.FINISHED_LENGTH, None, [6, 8]),
    ([6, EOS, 8], dict(max_tokens=None, ignore_eos=True), RequestStatus.FINISHED_LENGTH, None,
     [6, EOS]),
    ([6], dict(max_tokens=None), RequestStatus.RUNNING, None, [6]),
])
def test_a_step_ends_at_its_first_ending_token(track, tokens, params, status, reason, kept):
    """A stop token is checked before EOS, EOS before max_tokens and the context's end; the
    tokens after the one that ends the request are dropped."""
    sched = track()
    r = new_req("r", range(10, 10 + sched.max_len - 2), **params)  # room for 2 outputs
    sched.add_request(r)
    sched.schedule()
    sched._append(r, tokens, None)
    assert (r.status, r.stop_reason, r.output_token_ids) == (status, reason, kept)
    assert r.first_token_time is not None
    r.status = RequestStatus.RUNNING  # (update() would retire it; abort does here)
    sched.abort_request("r")


def test_drafts_trimmed_to_max_tokens_and_context(track):
    sched = track(max_model_len=12)
    r = new_req("r", range(10, 18), max_tokens=3, ignore_eos=True)
    sched.add_request(r)
    plan = sched.schedule()
    sched.update(plan, StubResult.of(plan, [20], drafts_next=[1, 2, 3, 4]))
    plan = sched.schedule()  # 2 output tokens left -> at most 1 draft
    assert plan.scheduled[0].draft_token_ids == [1]
    sched.update(plan, StubResult.of(plan, [1, 2], accepted=1))
    assert r.status is RequestStatus.FINISHED_LENGTH and len(r.output_token_ids) == 3
    r2 = new_req("r2", range(10, 19), max_tokens=50, ignore_eos=True)  # 9 of 12 tokens
    sched.add_request(r2)
    plan = sched.schedule()
    sched.update(plan, StubResult.of(plan, [20], drafts_next=[1, 2, 3, 4]))
    plan = sched.schedule()  # context has room for 2 more tokens -> 1 draft
    assert plan.scheduled[0].draft_token_ids == [1]
    sched.update(plan, StubResult.of(plan, [1, 2], accepted=1))
    assert r2.status is RequestStatus.FINISHED_LENGTH and r2.num_tokens == 12


def test_inconsistent_runner_output_raises(track):
    sched = track()
    r = new_req("r", [10, 11])
    sched.add_request(r)
    plan = sched.schedule()
    with pytest.raises(RuntimeError):
        sched.update(plan, StubResult.of(plan, [1, 2]))  # 2 tokens without drafts
    sched.abort_request("r")


# ---- everything at once -------------------------------------------------------------------

@pytest.mark.parametrize("seed,spec_k,num_blocks,chunked", [
    (0, 0, 40, True), (1, 3, 40, True), (2, 5, 24, True), (3, 1, 200, False), (4, 3, 20, False)])
def test_random_workload_matches_reference(track, seed, spec_k, num_blocks, chunked):
    rng = random.Random(seed)
    lookahead = spec_k
    sched = track(num_blocks=num_blocks, budget=24, max_num_seqs=6, lookahead=lookahead,
                  max_model_len=64, chunked=chunked)
    runner = FakeRunner(sched, spec_k=spec_k, accuracy=0.6, seed=seed)
    shared = prompt_of(rng, 20)
    reqs, pending = [], []
    for i in range(24):
        n = rng.randrange(3, 40)
        pre = shared[:rng.choice([0, 4, 9, 13, 20])]
        sp = dict(max_tokens=rng.choice([None, 1, 5, 12, 30]), ignore_eos=rng.random() < 0.5)
        if rng.random() < 0.2:
            sp["stop_token_ids"] = [rng.randrange(8, 50)]
        pending.append(new_req(f"r{i}", prompt_of(rng, max(n, len(pre) + 1), pre), **sp))
    done, steps = {}, 0
    while pending or sched.has_unfinished():
        while pending and rng.random() < 0.5:  # requests arrive while others run
            reqs.append(pending.pop(0))
            sched.add_request(reqs[-1])
        plan = sched.schedule()
        if plan.is_empty:
            assert not sched.has_unfinished()
            continue
        assert plan.num_tokens <= 24 and sched.num_running <= 6
        for r in sched.update(plan, runner.execute(plan)):
            if r.is_finished:
                done[r.request_id] = r
        steps += 1
        assert steps < 3000
    assert len(done) == 24
    for r in reqs:
        want = reference(r.prompt_token_ids, r.sampling_params, max_len=sched.max_len)
        assert r.output_token_ids == want, r.request_id
    if num_blocks <= 24:
        assert sum(r.num_preemptions for r in reqs) > 0
    if spec_k:
        assert sum(r.spec_stats.num_accepted_tokens for r in reqs) > 0
    assert sched.kv.stats.num_hit_tokens > 0
