"""Logprobs in the fused graphs (runner/fused_step.py's +logprobs modes) on CPU, with the
rerun_capture stand-in: requests asking for logprobs (only the chosen token's, a few, the
most there are), greedy, sampled, masked and penalized, beside requests without them, run in
the logprobs graphs and get what the general path gives them, token for token and logprob for
logprob, without speculation and with n-gram, EAGLE-3 and MTP drafting, chained, relaunched or
launched step by step; a logprobs request's prefill is launched like a decode step too.
"""

from __future__ import annotations

import math

import pytest

from outpace import SamplingParams
from outpace.runner.graph_mode import MODES, graph_mode
from outpace.types import MAX_LOGPROBS
from tests.engine_helpers import make_engine, run_batch_outputs
from tests.speculative.spec_helpers import repetitive_prompts, run_waves
from tests.speculative.test_draft_plane import waves
from tests.speculative.test_fused_step import SMALL, enable_graphs, spec_for

HOT = dict(max_tokens=24, ignore_eos=True)
PARAMS = [SamplingParams(temperature=0.0, logprobs=2, **HOT),
          SamplingParams(temperature=0.8, seed=3, logprobs=0, **HOT),
          SamplingParams(temperature=0.0, **HOT),
          SamplingParams(temperature=1.1, top_p=0.8, logprobs=MAX_LOGPROBS, **HOT),
          SamplingParams(temperature=0.0, frequency_penalty=1.0, logprobs=5, **HOT),
          SamplingParams(temperature=0.7, seed=9, **HOT)]
CASES = [(None, 0, False), ("ngram", 3, True), ("eagle3", 3, True), ("mtp", 2, False)]


def close(a, b, tol: float = 1e-5) -> bool:
    """Logprob lists equal up to float32 rounding, ids exactly: a padded graph's matmuls
    round other than an eager step's (tokens are compared exactly). tol: relative and
    absolute; two devices' fp32 arithmetic (CPU against CUDA) each round up to ~1e-5 from the
    exact value on the tiny target's logits, so a comparison across devices takes CROSS_DEVICE."""
    if a is None or b is None:
        return a is b
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(math.isclose(x[i], y[i], rel_tol=tol, abs_tol=tol)
                                     for i in x) for x, y in zip(a, b))


# a wrong row, position or KV entry moves a logprob by 0.1 or more: far above either tolerance
CROSS_DEVICE = 5e-5


def params_for(n: int) -> list:
    return [PARAMS[i % len(PARAMS)] for i in range(n)]


@pytest.mark.parametrize("method,k,overlap", CASES,
                         ids=[f"{m}-{'overlap' if o else 'sync'}" for m, _, o in CASES])
def test_logprobs_fused_step_equals_eager(tiny_loaded, tiny_heads, method,
                                          k, overlap):
    spec = spec_for(tiny_heads, method, k)
    params = params_for(sum(len(w) for w in waves()))
    eager = run_waves(tiny_loaded, waves(), params, speculative_config=spec, **SMALL)
    fused = run_waves(tiny_loaded, waves(), params, overlap=overlap,
                      on_engine=lambda e: enable_graphs(e, k), speculative_config=spec,
                      **SMALL)
    assert fused.outputs == eager.outputs
    for got, want, p in zip(fused.outs, eager.outs, params):
        got_lp, want_lp = got.outputs[0].logprobs, want.outputs[0].logprobs
        assert close(got_lp, want_lp), (got.request_id, got_lp, want_lp)
        if p.logprobs is not None:  # every token's, with its top n (and itself)
            assert len(got_lp) == len(got.token_ids)
            assert all(len(d) >= max(p.logprobs, 1) for d in got_lp)
    steps = fused.engine.runner.fused
    served = sum(n for mode, n in steps.mode_steps.items() if mode.logprobs)
    assert served > 20, "the logprobs graphs served too few steps"
    assert set(steps.mode_steps) == set(MODES)
    if overlap and method not in ("ngram", "suffix"):
        assert steps.chained > 10, "no logprobs step was launched from its predecessor's"
    if overlap and method == "ngram":
        assert steps.relaunched > 10


@pytest.mark.parametrize("method,k", [(None, 0), ("eagle3", 2)])
def test_logprobs_prefill_launched_like_a_decode_step(tiny_loaded, tiny_heads, method, k):
    """A logprobs request's prefill (one chunk) runs its family's prefill tail, which leaves
    the first token's logprobs beside it; its decode steps chain from it. Tokens and logprobs
    are the eager engine's."""
    spec = spec_for(tiny_heads, method, k)
    eng = make_engine(tiny_loaded, speculative_config=spec, overlap=True, **SMALL)
    enable_graphs(eng, k)
    eager = make_engine(tiny_loaded, speculative_config=spec, **SMALL)
    fused = eng.runner.fused
    prompts = repetitive_prompts(len(PARAMS), 13, period=4, repeats=3)  # one chunk each
    for n, (prompt, p) in enumerate(zip(prompts, PARAMS)):
        if p.logprobs is None:
            continue
        own = graph_mode([p])
        launches, chained, steps = fused.prefill.launches, fused.chained, fused.mode_steps[own]
        got = run_batch_outputs(eng, [prompt], p)[0]
        want = run_batch_outputs(eager, [prompt], p)[0]
        assert got.token_ids == want.token_ids, n
        assert close(got.outputs[0].logprobs, want.outputs[0].logprobs), n
        assert len(got.outputs[0].logprobs) == len(got.token_ids) == p.max_tokens
        assert fused.prefill.launches - launches == 1, (n, own)
        assert fused.chained - chained >= 1 and fused.mode_steps[own] - steps >= 5
