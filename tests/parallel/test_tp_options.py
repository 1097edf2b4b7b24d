"""Tensor parallelism's options and bookkeeping, without starting ranks: what shards and the
errors that say what to change (before any process starts or weight loads), and the step plans
rank 0 sends (engine/plan_mirror.py)."""

import dataclasses

import pytest

from outpace.engine.args import EngineArgs
from outpace.engine.plan_mirror import PlanMirror, PlanSender
from outpace.engine.preflight import check_engine_args
from outpace.errors import ConfigError
from outpace.model_config import ModelConfig
from outpace.parallel.shard import kv_head_start, local_config, vocab_range
from outpace.types import Request, SamplingParams, ScheduledRequest, StepPlan


def _cfg(heads=12, kv=4, inter=96, vocab=95):
    return ModelConfig(architecture="llama", vocab_size=vocab, hidden_size=48,
                       intermediate_size=inter, num_hidden_layers=2, num_attention_heads=heads,
                       num_key_value_heads=kv, head_dim=4)


def test_what_a_rank_holds():
    c = _cfg()
    assert local_config(c, 1) is c
    r = local_config(c, 2)
    assert (r.num_attention_heads, r.num_key_value_heads, r.intermediate_size) == (6, 2, 48)
    assert (r.hidden_size, r.vocab_size) == (48, 95)
    assert [kv_head_start(c, rank, 2) for rank in range(2)] == [0, 2]
    # fewer KV heads than ranks: each KV head on size / kv ranks, the ones its queries read
    one = _cfg(heads=4, kv=1, inter=8)
    assert local_config(one, 4).num_key_value_heads == 1
    assert [kv_head_start(one, r, 4) for r in range(4)] == [0, 0, 0, 0]
    two = _cfg(heads=8, kv=2, inter=8)
    assert [kv_head_start(two, r, 4) for r in range(4)] == [0, 0, 1, 1]
    # the vocabulary in ceil(V / size) rows, the last shard short
    assert [vocab_range(95, r, 2) for r in range(2)] == [(0, 48), (48, 47)]
    assert [vocab_range(96, r, 3) for r in range(3)] == [(0, 32), (32, 32), (64, 32)]


@pytest.mark.parametrize("size,cfg,match", [
    # (3 and 6 divide the heads but neither divide the 4 KV heads nor are multiples of them)
    (5, _cfg(), "does not divide the model's 12 attention heads; this model shards over 1, 2, "
                "4, 12 rank"),
    (3, _cfg(heads=12, kv=2, inter=96), "neither divides the model's 2 KV heads"),
    (2, _cfg(heads=4, kv=2, inter=95), "does not divide the model's MLP width 95"),
])
def test_a_model_that_does_not_shard_is_an_error_naming_the_sizes_that_do(size, cfg, match):
    with pytest.raises(ConfigError, match=match) as e:
        local_config(cfg, size)
    assert e.value.option == "tensor_parallel_size"


@pytest.mark.parametrize("kw,match", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be an integer in 1..64"),
    (dict(tensor_parallel_size=2, device="cuda"), "runs on the CPU"),
    (dict(tensor_parallel_size=3, speculative_config={"method": "eagle3",  # the shipped head
                                                      "draft_lm_head_dtype": "int8"}),
     "draft_lm_head_dtype 'int8' does not run under tensor parallelism"),
    (dict(tensor_parallel_size=2, device="cpu"),
     "does not divide the model's 9 attention heads; this model shards over 1, 3 rank"),
])
def test_tensor_parallel_options_are_checked_before_anything_starts(kw, match,
                                                                     default_model_path):
    with pytest.raises(ConfigError, match=match) as e:
        check_engine_args(EngineArgs(model=str(default_model_path), **kw))
    assert e.value.option == "tensor_parallel_size"


def _req(rid, prompt, out=()):
    r = Request(request_id=rid, prompt_token_ids=list(prompt),
                sampling_params=SamplingParams(max_tokens=8))
    r.output_token_ids.extend(out)
    return r


def _plan(*rows, tables=None):
    tables = tables or {}
    return StepPlan(scheduled=[ScheduledRequest(request=r, num_computed_tokens=r.num_tokens - 1,
                                                num_new_tokens=1 + len(d), draft_token_ids=d,
                                                block_ids=tables.get(r.request_id, [1, 2]))
                               for r, d in rows], load=3)


def test_the_mirrors_hold_what_rank_0_holds_step_after_step():
    sender, mirror = PlanSender(), PlanMirror()
    a, b = _req("a", [1, 2, 3]), _req("b", [4, 5])
    for r in (a, b):
        mirror.begin(sender.begin(r))
    for step in range(4):
        a.output_token_ids.append(10 + step)  # what the steps committed
        a.num_draft_exact_tokens = a.num_tokens
        if step == 2:
            b.output_token_ids.extend([7, 8])
            a.num_preemptions += 1
        encoded = sender.encode(_plan((a, [9, 9]), (b, [])))
        # only the new tokens travel, not the whole request
        assert encoded[0][0][1] == (len(a.output_token_ids) - 1, [10 + step])
        got = mirror.decode(encoded)
        for s, want in zip(got.scheduled, (a, b)):
            m = s.request
            assert m is mirror.requests[want.request_id]
            assert m.all_token_ids == want.all_token_ids
            assert (m.num_draft_exact_tokens, m.num_preemptions) == (
                want.num_draft_exact_tokens, want.num_preemptions)
        assert got.scheduled[0].draft_token_ids == [9, 9] and got.load == 3
        assert got.scheduled[0].num_computed_tokens == a.num_tokens - 1
    # a cut output (never done by the scheduler today) travels whole
    del a.output_token_ids[1:]
    assert mirror.decode(sender.encode(_plan((a, [])))).scheduled[0].request.all_token_ids == \
        a.all_token_ids
    sender.release("a")
    mirror.release("a")
    assert "a" not in mirror.requests
    assert dataclasses.fields(Request)  # the changing fields are read from the dataclass


def test_the_block_tables_travel_as_the_blocks_they_gained():
    sender, mirror = PlanSender(), PlanMirror()
    a = _req("a", [1, 2, 3])
    mirror.begin(sender.begin(a))
    for table, sent in (([7], (0, [7])), ([7, 9], (1, [9])), ([7, 9], (2, [])),
                        ([7, 9, 4, 5], (2, [4, 5])),
                        ([3, 8], (0, [3, 8])),  # a new table (preempted, readmitted): whole
                        ([3, 8, 6], (2, [6]))):
        encoded = sender.encode(_plan((a, []), tables={"a": table}))
        assert encoded[0][0][-1] == sent
        assert mirror.decode(encoded).scheduled[0].block_ids == table
    sender.release("a")
    mirror.release("a")
    a2 = _req("a", [1])  # the id used again: its table starts over
    mirror.begin(sender.begin(a2))
    encoded = sender.encode(_plan((a2, []), tables={"a": [2]}))
    assert encoded[0][0][-1] == (0, [2]) and mirror.decode(encoded).scheduled[0].block_ids == [2]


class _Workers:
    def __init__(self):
        self.sent, self.error, self.stopped = [], None, False

    def send(self, calls):
        self.sent.append(calls)

    def broke(self, cause, doing):
        self.error = f"rank 0 {type(cause).__name__}{doing}"
        return RuntimeError(self.error)

    def stop(self, timeout):
        self.stopped = True


class _Runner:
    proposer = None

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *a: self.calls.append((name, *a)) or f"{name} done"


def test_rank_0_sends_each_call_before_making_it_and_its_step_times_after():
    """Begin / release ride with the next step; the cost model's table measured on rank 0 is
    given to every rank (the draft lengths, and so the collectives a step runs, must agree)."""
    from outpace.engine.tp_executor import TensorParallelRunner
    workers, runner = _Workers(), _Runner()
    tpr = TensorParallelRunner(runner, workers)
    req = _req("a", [1, 2, 3])
    tpr.begin_request(req)
    assert workers.sent == [] and runner.calls == [("begin_request", req)]
    assert tpr.measure_step_times(3) == "measure_step_times done"
    assert [name for name, _ in workers.sent[0]] == ["begin", "measure_step_times"]
    tpr.release("a")
    plan = _plan((req, []))
    assert tpr.execute(plan) == "execute done"
    assert workers.sent[1][0] == ("set_step_times", "measure_step_times done")
    assert [name for name, _ in workers.sent[1]] == ["set_step_times", "release", "execute"]
    assert runner.calls[-1] == ("execute", plan)
    assert tpr.can_launch(plan) is False and tpr.fused is None


def test_ctrl_c_during_a_call_waits_for_its_end():
    import os
    import signal

    from outpace.engine.tp_executor import _sigint_after_the_call
    ran = []
    # Python's own handler, as an interactive run has it (a process started in the background
    # inherits SIGINT ignored, and then the signal below would be dropped)
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with _sigint_after_the_call():
                os.kill(os.getpid(), signal.SIGINT)
                ran.append("the rest of the call")  # not cut short
        assert ran == ["the rest of the call"]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, inherited)


def test_a_call_interrupted_on_rank_0_stops_the_ranks():
    """A KeyboardInterrupt (or any error) inside rank 0's part of a call leaves the others out
    of step: the group is marked broken and stopped, and the interrupt goes on up."""
    from outpace.engine.tp_executor import TensorParallelRunner

    class Interrupted(_Runner):
        def execute(self, plan):
            raise KeyboardInterrupt

    workers = _Workers()
    tpr = TensorParallelRunner(Interrupted(), workers)
    with pytest.raises(KeyboardInterrupt):
        tpr.execute(_plan((_req("a", [1, 2]), [])))
    assert workers.stopped and workers.error == "rank 0 KeyboardInterrupt in a step"


def test_the_plan_rows_carry_every_field_of_a_scheduled_request_and_a_plan():
    """A field added to ScheduledRequest or StepPlan must be sent too (plan_mirror.py)."""
    assert [f.name for f in dataclasses.fields(ScheduledRequest)] == [
        "request", "num_computed_tokens", "num_new_tokens", "draft_token_ids", "sample",
        "block_ids"]
    assert [f.name for f in dataclasses.fields(StepPlan)] == ["scheduled", "preempted_ids", "load"]


def test_a_steps_row_carries_no_timestamps_of_the_engine():
    """The engine's stamps (arrival, first scheduled, first token) are read on rank 0 only: a
    step's row (sent for every scheduled request, every step) leaves them out."""
    sender, mirror = PlanSender(), PlanMirror()
    a = _req("a", [1, 2, 3])
    mirror.begin(sender.begin(a))
    a.scheduled_time, a.first_token_time = 1234.5, 2345.5
    a.output_token_ids.append(10)
    encoded = sender.encode(_plan((a, [])))
    changing = encoded[0][0][2]
    assert not [v for v in changing if v in (1234.5, 2345.5)], changing
    assert mirror.decode(encoded).scheduled[0].request.all_token_ids == a.all_token_ids
