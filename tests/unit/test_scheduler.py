"""Scheduler: budget, chunked prefill, decode/prefill mixing, prefix hits, stops, abort, queue.

See scheduler_harness.py for the fake runner that checks every KV read against the tokens.
"""

import pytest

from outpace.errors import InvalidRequestError, QueueFullError
from outpace.types import RequestStatus
from tests.unit.scheduler_harness import (EOS, FakeRunner, StubResult, drive, new_req, planned,
                                          reference, track)  # noqa: F401 (track: fixture)


# ---- basic flow ---------------------------------------------------------------------------

def test_single_request_matches_reference(track):
    sched = track()
    r = new_req("a", [11, 12, 13, 14, 15], max_tokens=10, ignore_eos=True)
    sched.add_request(r)
    done = drive(sched, FakeRunner(sched))
    assert done["a"].output_token_ids == reference(r.prompt_token_ids, r.sampling_params)
    assert r.status is RequestStatus.FINISHED_LENGTH and len(r.output_logprobs) == 10
    assert r.first_token_time is not None


def test_chunked_prefill_splits_under_budget(track):
    sched = track(budget=16)
    r = new_req("a", range(8, 58), max_tokens=2, ignore_eos=True)  # 50 tokens
    sched.add_request(r)
    runner = FakeRunner(sched)
    chunks = []
    for _ in range(4):
        plan = sched.schedule()
        (s,) = plan.scheduled
        chunks.append((s.num_computed_tokens, s.num_new_tokens, s.sample))
        sched.update(plan, runner.execute(plan))
    assert chunks == [(0, 16, False), (16, 16, False), (32, 16, False), (48, 2, True)]
    assert len(r.output_token_ids) == 1 and r.num_computed_tokens == 50
    drive(sched, runner)
    assert r.output_token_ids == reference(r.prompt_token_ids, r.sampling_params)


def test_decodes_first_then_prefill_chunk(track):
    sched = track(budget=10)
    runner = FakeRunner(sched)
    a, b = new_req("a", [10, 11, 12], max_tokens=5), new_req("b", [20, 21], max_tokens=5)
    sched.add_request(a)
    sched.add_request(b)
    plan = sched.schedule()
    assert planned(plan) == [("a", 3), ("b", 2)]
    sched.update(plan, runner.execute(plan))
    c = new_req("c", range(8, 38), max_tokens=3)
    sched.add_request(c)
    plan = sched.schedule()
    got = [(s.request.request_id, s.num_new_tokens, s.sample) for s in plan.scheduled]
    assert got == [("a", 1, True), ("b", 1, True), ("c", 8, False)]
    sched.update(plan, runner.execute(plan))
    drive(sched, runner)
    for r in (a, b, c):
        assert r.output_token_ids == reference(r.prompt_token_ids, r.sampling_params)


def test_max_num_seqs_and_fcfs_admission(track):
    sched = track(max_num_seqs=2)
    reqs = [new_req(f"r{i}", [10 + i, 11, 12], max_tokens=3, ignore_eos=True) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    plan = sched.schedule()
    assert [s.request.request_id for s in plan.scheduled] == ["r0", "r1"]
    assert sched.num_running == 2 and sched.num_waiting == 2
    runner = FakeRunner(sched)
    sched.update(plan, runner.execute(plan))
    drive(sched, runner)
    assert all(len(r.output_token_ids) == 3 for r in reqs)


def test_chunking_disabled_waits_for_room(track):
    sched = track(budget=12, chunked=False)
    runner = FakeRunner(sched)
    a = new_req("a", range(8, 16), max_tokens=4, ignore_eos=True)  # 8 tokens
    b = new_req("b", range(20, 30), max_tokens=2, ignore_eos=True)  # 10: fits only alone
    long = new_req("long", range(8, 38), max_tokens=1)  # 30 > budget: chunked anyway
    for r in (a, b, long):
        sched.add_request(r)
    plan = sched.schedule()
    assert planned(plan) == [("a", 8)]
    sched.update(plan, runner.execute(plan))
    plan = sched.schedule()  # a decodes (1), b's 10 fit in the 11 left, long takes the rest
    got = [(s.request.request_id, s.num_new_tokens, s.sample) for s in plan.scheduled]
    assert got == [("a", 1, True), ("b", 10, True), ("long", 1, False)]
    sched.update(plan, runner.execute(plan))
    drive(sched, runner)
    assert long.output_token_ids == reference(long.prompt_token_ids, long.sampling_params)


# ---- prefix cache -------------------------------------------------------------------------

def test_prefix_hit_recorded_and_output_unchanged(track):
    sched = track()
    runner = FakeRunner(sched)
    shared = list(range(10, 22))  # 3 blocks
    a = new_req("a", shared + [40, 41], max_tokens=4, ignore_eos=True)
    sched.add_request(a)
    drive(sched, runner)
    b = new_req("b", shared + [30], max_tokens=4, ignore_eos=True)
    sched.add_request(b)
    plan = sched.schedule()
    assert plan.scheduled[0].num_computed_tokens == 12 and plan.scheduled[0].num_new_tokens == 1
    sched.update(plan, runner.execute(plan))
    drive(sched, runner)
    assert b.num_cached_tokens == 12 and a.num_cached_tokens == 0
    assert b.output_token_ids == reference(b.prompt_token_ids, b.sampling_params)
    assert sched.kv.stats.num_hit_tokens == 12


# ---- stops, abort, queue ------------------------------------------------------------------

def test_stop_token_eos_and_ignore_eos(track):
    sched = track(lookahead=2)

    def step_with(r, tokens, accepted):
        sched.add_request(r)
        plan = sched.schedule()
        sched.update(plan, StubResult.of(plan, [20], drafts_next=[21, EOS, 23]))
        plan = sched.schedule()
        return sched.update(plan, StubResult.of(plan, tokens, accepted=accepted))

    a = new_req("a", [10, 11], max_tokens=20)
    assert step_with(a, [21, EOS, 23, 24], 3) == [a]
    assert a.output_token_ids == [20, 21, EOS] and a.status is RequestStatus.FINISHED_STOPPED
    assert a.stop_reason is None  # EOS, as vLLM reports it
    b = new_req("b", [10, 11], max_tokens=20, ignore_eos=True)
    step_with(b, [21, EOS, 23, 24], 3)
    assert b.output_token_ids == [20, 21, EOS, 23, 24] and not b.is_finished
    sched.abort_request("b")
    c = new_req("c", [10, 11], max_tokens=20, ignore_eos=True, stop_token_ids=[23])
    step_with(c, [21, EOS, 23, 24], 3)
    assert c.output_token_ids == [20, 21, EOS, 23] and c.stop_reason == 23
    assert c.status is RequestStatus.FINISHED_STOPPED
    d = new_req("d", [10, 11], max_tokens=3)
    step_with(d, [21, 40], 1)  # draft trimmed to 1; max_tokens reached exactly
    assert d.status is RequestStatus.FINISHED_LENGTH and d.output_token_ids == [20, 21, 40]


def test_abort_frees_blocks_and_between_schedule_and_update(track):
    sched = track()
    runner = FakeRunner(sched)
    a = new_req("a", range(10, 30), max_tokens=5)
    b = new_req("b", range(30, 40), max_tokens=5, ignore_eos=True)
    w = new_req("w", range(10, 14), max_tokens=5)
    sched.add_request(a)
    sched.add_request(b)
    plan = sched.schedule()
    result = runner.execute(plan)
    used = sched.kv.num_used_blocks
    got = sched.abort_request("a")  # arrives while the step runs
    assert got is a and a.status is RequestStatus.FINISHED_ABORTED
    assert sched.kv.num_used_blocks == used - 5 and not sched.kv.has_blocks("a")
    progressed = sched.update(plan, result)
    assert progressed == [b] and a.output_token_ids == []
    assert sched.abort_request("a") is None
    sched.add_request(w)  # aborting a waiting request
    assert sched.abort_request("w") is w and sched.num_waiting == 0
    drive(sched, runner)
    assert b.output_token_ids == reference(b.prompt_token_ids, b.sampling_params)


def test_finish_request_for_stop_strings(track):
    sched = track()
    runner = FakeRunner(sched)
    r = new_req("r", [10, 11, 12], max_tokens=10, ignore_eos=True)
    sched.add_request(r)
    plan = sched.schedule()
    sched.update(plan, runner.execute(plan))
    sched.finish_request("r", RequestStatus.FINISHED_STOPPED, "###")
    assert r.status is RequestStatus.FINISHED_STOPPED and r.stop_reason == "###"
    assert sched.num_running == 0


def test_queue_bound_duplicate_and_bad_prompts(track):
    sched = track(max_waiting=2, max_model_len=16)
    sched.add_request(new_req("a", [1, 2]))
    sched.add_request(new_req("b", [1, 2]))
    with pytest.raises(QueueFullError):
        sched.add_request(new_req("c", [1, 2]))
    with pytest.raises(InvalidRequestError):
        sched.add_request(new_req("a", [1, 2]))
    sched.abort_request("b")
    with pytest.raises(InvalidRequestError):
        sched.add_request(new_req("empty", []))
    with pytest.raises(InvalidRequestError):
        sched.add_request(new_req("long", range(16)))
    sched.abort_request("a")



# ---- fairness: a long prompt beside running decodes ----------------------------------------

@pytest.mark.parametrize("cap", [0, 6])
def test_prefill_beside_decodes_is_bounded(track, cap):
    """With max_prefill_with_decodes, a step that carries decodes takes at most that many
    prefill tokens; a step without decodes still takes the whole budget; outputs unchanged."""
    sched = track(budget=32, num_blocks=128, prefill_with_decodes=cap)
    runner = FakeRunner(sched)
    a = new_req("a", [10, 11, 12], max_tokens=30, ignore_eos=True)
    sched.add_request(a)
    plan = sched.schedule()
    sched.update(plan, runner.execute(plan))  # a decodes from now on
    b = new_req("b", list(range(20, 120)), max_tokens=4, ignore_eos=True)
    sched.add_request(b)
    prefills = []

    def check(plan):
        decodes = [s for s in plan.scheduled if s.request is a]
        pre = sum(s.num_new_tokens for s in plan.scheduled if s.request is b
                  and s.num_computed_tokens < len(b.prompt_token_ids))
        if pre:
            prefills.append((bool(decodes), pre))
    done = drive(sched, runner, check=check)
    assert done["a"].output_token_ids == reference(a.prompt_token_ids, a.sampling_params)
    assert done["b"].output_token_ids == reference(b.prompt_token_ids, b.sampling_params)
    beside = [n for with_decodes, n in prefills if with_decodes]
    assert beside, prefills
    if cap:
        assert max(beside) <= cap, prefills
    else:
        assert max(beside) > 6, prefills  # the whole budget left (the check can fail)


def test_prefill_alone_takes_the_whole_budget(track):
    sched = track(budget=32, num_blocks=128, prefill_with_decodes=6)
    runner = FakeRunner(sched)
    b = new_req("b", list(range(20, 120)), max_tokens=2, ignore_eos=True)
    sched.add_request(b)
    plan = sched.schedule()
    assert plan.scheduled[0].num_new_tokens == 32
    sched.update(plan, runner.execute(plan))
    drive(sched, runner)
