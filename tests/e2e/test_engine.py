"""Engine behaviour on the real default model (CPU, fp32): batching, chunked prefill, prefix
cache, preemption, seeded sampling, stop strings, bad input. Every engine is checked for leaked
KV blocks after use."""

from __future__ import annotations

import pytest

from outpace import SamplingParams
from outpace.engine.engine import LLMEngine
from outpace.errors import InvalidRequestError
from tests.engine_helpers import PlanRecorder, chat_ids, make_engine, run_alone, run_batch

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion to a child in two sentences.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Give me a name for a black cat.",
    "What is 12 times 12?",
]


def mixed_prompts(tok) -> list:
    """8 prompts of mixed lengths: 4 short chats and 4 long ones (~50 to ~240 tokens)."""
    short = chat_ids(tok, QUESTIONS[:4])
    filler = ("The history of the printing press begins in the fifteenth century, when movable "
              "type changed how books were made and read across Europe. ")
    long_ = chat_ids(tok, [filler * n + q for n, q in zip((1, 3, 6, 8), QUESTIONS[4:])])
    out = []
    for s, l in zip(short, long_):
        out += [s, l]
    return out


def test_batch_with_chunked_prefill_equals_each_alone(loaded_default):
    eng = make_engine(loaded_default, max_num_batched_tokens=96, max_num_seqs=16)
    prompts = mixed_prompts(eng.tokenizer)
    assert max(len(p) for p in prompts) > 200
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    rec = PlanRecorder(eng)
    batched = run_batch(eng, prompts, params)
    # chunking and prefill/decode mixing really happened
    assert any(not sr.sample for plan in rec.plans for sr in plan.scheduled)
    assert any({sr.num_new_tokens > 1 for sr in plan.scheduled} == {True, False}
               for plan in rec.plans)
    assert all(plan.num_tokens <= 96 for plan in rec.plans)
    alone_eng = make_engine(loaded_default, enable_prefix_caching=False)
    for p, got in zip(prompts, batched):
        assert got == run_alone(alone_eng, p, params)


def test_prefix_cache_hit_same_output_and_skips_tokens(loaded_default):
    eng = make_engine(loaded_default)
    tok = eng.tokenizer
    system = "You are a careful assistant. " * 20
    a = chat_ids(tok, ["Name a fruit."], system=system)[0]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    cold = make_engine(loaded_default, enable_prefix_caching=False)
    expected = run_alone(cold, a, params)

    first = run_alone(eng, a, params)
    rec = PlanRecorder(eng)
    eng.add_request("again", a, params)
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.finished]
    assert first == expected and outs[0].token_ids == expected
    assert outs[0].num_cached_tokens >= 16 * ((len(a) - 1) // 16) - 16 > 0
    computed = sum(sr.num_new_tokens for p in rec.plans for sr in p.scheduled)
    # only the uncached tail of the prompt plus one token per decode step was computed
    assert computed == len(a) - outs[0].num_cached_tokens + len(expected) - 1
    assert eng.kv.prefix_cache_hit_tokens >= outs[0].num_cached_tokens


def test_small_pool_preempts_and_outputs_stay_identical(loaded_default):
    tok = loaded_default[2]
    prompts = chat_ids(tok, QUESTIONS[:6])
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    # 6 requests x ~55 tokens need ~24 blocks of 16; give the pool 14.
    eng = make_engine(loaded_default, num_kv_blocks=15, enable_prefix_caching=False)
    batched = run_batch(eng, prompts, params)
    assert eng.num_preemptions_total > 0
    ref = make_engine(loaded_default, enable_prefix_caching=False)
    for p, got in zip(prompts, batched):
        assert got == run_alone(ref, p, params)


def test_seeded_sampling_is_reproducible(loaded_default):
    eng = make_engine(loaded_default)
    p = chat_ids(eng.tokenizer, ["Tell me a story about a dragon."])[0]
    other = chat_ids(eng.tokenizer, QUESTIONS[:3])
    sp = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=1234)
    a = run_alone(eng, p, sp)
    b = run_batch(eng, [other[0], p, other[1]],
                  [SamplingParams(max_tokens=24, temperature=1.0), sp,
                   SamplingParams(max_tokens=5, temperature=0.7, seed=9)])[1]
    c = run_alone(eng, p, SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=4321))
    assert a == b
    assert a != c


def test_stop_strings_cut_exactly(loaded_default):
    eng = make_engine(loaded_default)
    p = chat_ids(eng.tokenizer, ["Count from one to twenty in words, separated by commas."])[0]
    full = _final(eng, p, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    text = full.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop and stop in text
    cut = text.index(stop)
    got = _final(eng, p, SamplingParams(max_tokens=32, temperature=0.0, stop=[stop],
                                        ignore_eos=True))
    assert got.text == text[:cut]
    assert got.finish_reason == "stop" and got.outputs[0].stop_reason == stop
    assert got.token_ids == full.token_ids[:len(got.token_ids)]
    kept = _final(eng, p, SamplingParams(max_tokens=32, temperature=0.0, stop=[stop],
                                         include_stop_str_in_output=True, ignore_eos=True))
    assert kept.text == text[:cut + len(stop)]
    tid = full.token_ids[5]
    by_id = _final(eng, p, SamplingParams(max_tokens=32, temperature=0.0, stop_token_ids=[tid],
                                          ignore_eos=True))
    assert by_id.token_ids == full.token_ids[:full.token_ids.index(tid) + 1]
    assert by_id.outputs[0].stop_reason == tid


def test_final_only_outputs(loaded_default):
    """output_kind="final_only": step() returns a request's output only when it finishes, and
    that output (text, tokens, stop cut, metrics) is the cumulative mode's last one; LLM.generate
    asks for it."""
    import dataclasses
    from outpace.entrypoints.llm import LLM
    eng = make_engine(loaded_default)
    prompts = chat_ids(eng.tokenizer, QUESTIONS[:3])
    base = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    full = _final(eng, prompts[0], base)
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 2]
    wants = []
    for params in (base, dataclasses.replace(base, stop=[stop])):
        want = [_final(eng, p, params) for p in prompts]
        wants.append(want)
        final = dataclasses.replace(params, output_kind="final_only")
        for i, p in enumerate(prompts):
            eng.add_request(f"fo-{i}-{len(params.stop)}", p, final)
        got = {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                assert out.finished, "a final_only request's intermediate output was returned"
                got[out.request_id] = out
        for i, w in enumerate(want):
            g = got[f"fo-{i}-{len(params.stop)}"]
            assert (g.text, g.token_ids, g.finish_reason, g.outputs[0].stop_reason) == \
                (w.text, w.token_ids, w.finish_reason, w.outputs[0].stop_reason)
            assert g.metrics["first_token_time"] and g.metrics["finished_time"]
    with pytest.raises(InvalidRequestError, match="output_kind"):
        SamplingParams(output_kind="delta")
    llm = LLM.__new__(LLM)  # the offline API over this engine
    llm.engine, llm._ids = eng, iter(range(10 ** 6))
    seen = []
    add = eng.add_request
    eng.add_request = lambda rid, p, sp: (seen.append(sp.output_kind), add(rid, p, sp))
    outs = llm.generate(prompts[:2], base)
    assert seen == ["final_only"] * 2
    assert [o.token_ids for o in outs] == [w.token_ids for w in wants[0][:2]]
    assert base.output_kind == "cumulative"  # the caller's params are not changed
    assert eng.kv.num_used_blocks == 0


def test_bad_requests_raise_and_engine_keeps_serving(loaded_default):
    eng = make_engine(loaded_default, max_model_len=128)
    p = chat_ids(eng.tokenizer, ["Hi"])[0]
    with pytest.raises(InvalidRequestError, match="context"):
        eng.add_request("long", list(range(5, 200)), SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        eng.add_request("huge", p, SamplingParams(max_tokens=500))
    with pytest.raises(InvalidRequestError):
        eng.add_request("ids", [10 ** 9], SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequestError):
        eng.add_request("empty", "", SamplingParams(max_tokens=4))
    for bad in (dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5), dict(max_tokens=0),
                dict(top_k=-3), dict(min_p=2.0), dict(n=2), dict(logprobs=100)):
        with pytest.raises(InvalidRequestError):
            SamplingParams(**bad)
    assert len(run_alone(eng, p, SamplingParams(max_tokens=4, temperature=0.0))) == 4


def test_logprobs_are_returned(loaded_default):
    eng = make_engine(loaded_default)
    p = chat_ids(eng.tokenizer, ["Say yes."])[0]
    out = _final(eng, p, SamplingParams(max_tokens=4, temperature=0.0, logprobs=3))
    lps = out.outputs[0].logprobs
    assert len(lps) == len(out.token_ids)
    for tid, entry in zip(out.token_ids, lps):
        assert tid in entry and len(entry) >= 3
        assert entry[tid] == max(entry.values())  # greedy picks the most likely token


def _final(eng: LLMEngine, ids, params):
    eng.add_request("one", ids, params)
    final = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                final = o
    return final
