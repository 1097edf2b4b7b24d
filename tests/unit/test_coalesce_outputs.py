"""A front end behind its engine core takes the step messages that queued up together
(output_processor.coalesce_messages): each request's outputs of those steps merged into one.
What the streams end with must equal what one message at a time gives: text, tokens, logprobs,
finish and stop reasons, stop strings cutting at the same token, failures and acks in place."""

from __future__ import annotations

import random

import pytest

from outpace.engine.output_processor import (CoreOutput, OutputProcessor, coalesce_messages,
                                             merge_run)
from outpace.engine.request_stream import RequestStream, RequestTiming
from outpace.types import SamplingParams


class _Tok:  # what the detokenizer reads of a tokenizer: one character a token
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)

    def convert_ids_to_tokens(self, ids):
        return [chr(97 + i % 26) for i in ids]


class _Owner:
    def abort(self, rid):
        pass


def out(rid, ids, finish=None, lps=None, times=None, stop=None):
    return CoreOutput(rid, list(ids), finish, stop, lps, 3, 0, times)


def merge_outputs(earlier: CoreOutput, later: CoreOutput) -> CoreOutput:
    """The oracle: two steps' outputs of one request joined, pairwise."""
    if earlier.finish_reason is not None:
        return earlier
    lps = earlier.new_logprobs
    if lps is not None or later.new_logprobs is not None:
        lps = list(lps or []) + list(later.new_logprobs or [])
    return later._replace(new_token_ids=list(earlier.new_token_ids) + list(later.new_token_ids),
                          new_logprobs=lps, engine_times=earlier.engine_times or later.engine_times)


def test_merge_run_joins_tokens_and_logprobs_and_keeps_the_first_stamps():
    a = out("r", [1, 2], lps=[{1: -0.1}, {2: -0.2}], times={"first_token_time": 5.0})
    b = out("r", [3], finish="length", lps=[{3: -0.3}])
    m = merge_run([a, b])
    assert m.new_token_ids == [1, 2, 3]
    assert m.new_logprobs == [{1: -0.1}, {2: -0.2}, {3: -0.3}]
    assert m.finish_reason == "length" and m.engine_times == {"first_token_time": 5.0}
    assert merge_run([out("r", [1]), out("r", [2])]).new_logprobs is None
    done = out("r", [1], finish="stop")
    assert merge_run([done, out("r", [9])]) == done  # nothing comes after the end


def test_runs_of_step_messages_become_one_and_other_messages_keep_their_place():
    s1, s2 = {"num_running": 1}, {"num_running": 2}
    m1 = ("out", [("a", None)], [out("a", [1]), out("b", [7])], [], s1)
    m2 = ("out", [("c", None)], [out("b", [8]), out("a", [2])], [("d", "boom")], None)
    dead = ("dead", RuntimeError("x"))
    m3 = ("out", [], [out("a", [3])], [], s2)
    got = coalesce_messages([m1, m2, dead, m3])
    assert got[1] is dead and got[2] is m3  # a run of one is left as it is
    kind, acks, outputs, failed, stats = got[0]
    assert kind == "out" and acks == [("a", None), ("c", None)]
    assert [(o.request_id, o.new_token_ids) for o in outputs] == [("a", [1, 2]), ("b", [7, 8])]
    assert failed == [("d", "boom")] and stats is s1  # the run's last stats
    assert coalesce_messages([]) == []


def _run(messages, params, coalesce):
    """The streams' end state: per request, the items' text, tokens and logprobs joined."""
    proc = OutputProcessor(_Tok())
    streams = {}
    for rid, p in params.items():
        streams[rid] = {"text": "", "ids": [], "lps": [], "end": None, "n": 0}
        proc.add(rid, [0, 1], p, RequestStream(rid, _Owner()), RequestTiming(rid, arrival=0.0))
    stopped_all = []
    for msg in (coalesce_messages(messages) if coalesce else messages):
        _, _, outputs, failed, _ = msg
        batch, _, stopped = proc.process(outputs, 1.0)
        stopped_all += stopped
        for rid, error in failed:
            if proc.pop(rid) is not None:
                streams[rid]["end"] = ("error", error)
        for stream, item in batch:
            s = streams[stream.request_id]
            s["text"] = item.text
            s["ids"] += item.new_token_ids
            s["lps"] += item.new_logprobs or []
            s["n"] = item.num_tokens
            if item.finished:
                s["end"] = (item.finish_reason, item.stop_reason)
    return streams, sorted(stopped_all)


@pytest.mark.parametrize("seed", range(30))
def test_coalesced_messages_give_every_stream_what_one_at_a_time_gives(seed):
    rng = random.Random(seed)
    params, pending = {}, {}
    for i in range(6):
        rid = f"r{i}"
        params[rid] = SamplingParams(max_tokens=50, stop=rng.choice([None, ["cd"], ["q", "xy"]]),
                                     logprobs=rng.choice([None, 1]))
        pending[rid] = rng.randrange(1, 12)  # tokens it gets before it ends
    failing = rng.choice([None, "r5"])
    messages = []
    while pending:
        outputs, failed = [], []
        for rid in list(pending):
            if rng.random() < 0.2:
                continue  # no token for it this step
            if rid == failing and rng.random() < 0.3:
                failed.append((rid, "step failed"))
                del pending[rid]
                continue
            n = rng.choice([1, 1, 1, 2, 3])  # speculation gives several
            ids = [rng.randrange(0, 26) for _ in range(n)]
            pending[rid] -= n
            finish = "length" if pending[rid] <= 0 else None
            if finish:
                del pending[rid]
            lps = ([{t: -0.5} for t in ids] if params[rid].logprobs is not None else None)
            outputs.append(out(rid, ids, finish, lps))
        rng.shuffle(outputs)
        messages.append(("out", [], outputs, failed, None))
    (streams, stopped), (streams1, stopped1) = (_run(messages, params, coalesce=True),
                                                _run(messages, params, coalesce=False))
    assert streams == streams1
    # a stop string ends a request the core still runs, which is then aborted there; taken
    # together with the core's own end of it, there is nothing left to abort
    ended_in_core = {o.request_id for m in messages for o in m[2] if o.finish_reason}
    assert set(stopped) <= set(stopped1)
    assert set(stopped1) - set(stopped) <= ended_in_core


def test_a_run_keeps_every_failure_the_core_s_stop_reason_and_its_last_stats():
    s1, s2 = {"num_running": 1}, {"num_running": 2}
    m1 = ("out", [], [out("a", [1]), out("b", [4])], [("c", "boom")], s1)
    m2 = ("out", [], [out("a", [2], finish="stop", stop=2)], [("d", "bang")], s2)
    m3 = ("out", [], [out("b", [5])], [], None)
    [(_, _, outputs, failed, stats)] = coalesce_messages([m1, m2, m3])
    assert failed == [("c", "boom"), ("d", "bang")]
    assert stats is s2  # the last stats sent, not the first
    a = next(o for o in outputs if o.request_id == "a")
    assert (a.new_token_ids, a.finish_reason, a.stop_reason) == ([1, 2], "stop", 2)


@pytest.mark.parametrize("seed", range(20))
def test_merge_run_is_merge_outputs_folded_from_the_left(seed):
    import functools
    rng = random.Random(seed)
    outs = []
    for i in range(rng.randrange(2, 8)):
        ids = [rng.randrange(26) for _ in range(rng.randrange(0, 3))]
        outs.append(out("r", ids, finish=rng.choice([None, None, None, "length", "stop"]),
                        lps=rng.choice([None, [{t: -0.5} for t in ids]]),
                        times=rng.choice([None, {"first_token_time": float(i)}])))
    assert merge_run(outs) == functools.reduce(merge_outputs, outs)
