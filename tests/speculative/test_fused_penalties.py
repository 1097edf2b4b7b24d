"""Penalties in the fused graphs (outpace/runner/fused_penalties.py) on CPU, with the
rerun_capture stand-in:

* requests with repetition, frequency and presence penalties (greedy and sampled, with and
  without masks, beside requests without any) run in the penalized graphs and emit what the
  general path emits, token for token, without speculation and with n-gram, EAGLE-3 and MTP
  drafting, chained, relaunched or launched step by step;
* their output is the same with and without speculation (a verify row's penalties count the
  drafts before it);
* the tables are refilled when a step is launched from the host after steps the graphs did not
  serve (a logprobs request in the batch).
"""

from __future__ import annotations

import dataclasses

import pytest

from outpace import SamplingParams
from outpace.runner.graph_mode import MASKED_PENALIZED, SAMPLE_PENALIZED, GraphMode, graph_mode
from tests.engine_helpers import make_engine, run_batch
from tests.speculative.spec_helpers import repetitive_prompts, run_waves
from tests.speculative.test_draft_plane import waves
from tests.speculative.test_fused_step import SMALL, enable_graphs, spec_for

HOT = dict(max_tokens=24, ignore_eos=True)
# Penalties strong enough to move the tiny model's tokens: each kind alone, greedy and sampled,
# with a mask or not, and requests without penalties beside them.
PENALIZED = [SamplingParams(frequency_penalty=2.0, temperature=0.0, **HOT),
             SamplingParams(frequency_penalty=1.5, temperature=0.8, seed=3, **HOT),
             SamplingParams(temperature=0.0, **HOT),
             SamplingParams(presence_penalty=2.0, repetition_penalty=0.5, temperature=0.0,
                            **HOT),
             SamplingParams(temperature=1.1, seed=5, **HOT),
             SamplingParams(repetition_penalty=1.8, temperature=0.0, **HOT)]
MASKED = [SamplingParams(repetition_penalty=1.5, frequency_penalty=2.0, temperature=0.9,
                         top_p=0.9, seed=1, **HOT),
          SamplingParams(frequency_penalty=2.0, temperature=0.0, **HOT),
          SamplingParams(presence_penalty=2.0, repetition_penalty=3.0, temperature=1.2,
                         top_k=10, **HOT)]
KINDS = {SAMPLE_PENALIZED: PENALIZED, MASKED_PENALIZED: MASKED}
# Milder, so that drafts on repetitive prompts are still accepted
MILD = {SAMPLE_PENALIZED: [SamplingParams(frequency_penalty=0.5, temperature=0.0, **HOT),
                           SamplingParams(presence_penalty=0.7, temperature=0.0, **HOT),
                           SamplingParams(frequency_penalty=0.4, temperature=0.6, seed=2,
                                          **HOT)],
        MASKED_PENALIZED: [SamplingParams(frequency_penalty=0.5, temperature=0.6, top_k=4,
                                          seed=4, **HOT),
                           SamplingParams(presence_penalty=0.7, repetition_penalty=1.2,
                                          temperature=0.5, top_p=0.8, **HOT)]}


def mode_id(value):
    """A GraphMode's part of a test id: its name (None: pytest's own id for other values)."""
    return str(value) if isinstance(value, GraphMode) else None


def params_for(mode: GraphMode, n: int = None) -> list:
    kinds = KINDS[mode]
    n = n or sum(len(w) for w in waves())
    return [kinds[i % len(kinds)] for i in range(n)]


def without_penalties(params: list) -> list:
    return [dataclasses.replace(p, repetition_penalty=1.0, frequency_penalty=0.0,
                                presence_penalty=0.0) for p in params]


# Each drafter in both families, each family sync and overlapped (the full product took ~2 min
# of the CPU suite)
EQUAL_CASES = [(None, 0, False, SAMPLE_PENALIZED), (None, 0, True, MASKED_PENALIZED),
               ("ngram", 3, True, SAMPLE_PENALIZED), ("ngram", 3, False, MASKED_PENALIZED),
               ("eagle3", 3, True, MASKED_PENALIZED), ("eagle3", 3, False, SAMPLE_PENALIZED),
               ("mtp", 2, True, SAMPLE_PENALIZED), ("mtp", 2, False, MASKED_PENALIZED)]


@pytest.mark.parametrize("method,k,overlap,mode", EQUAL_CASES,
                         ids=[f"{m}-{'overlap' if o else 'sync'}-{md}"
                              for m, _, o, md in EQUAL_CASES])
def test_penalized_fused_step_equals_eager(tiny_loaded, tiny_heads, method,
                                           k, overlap, mode):
    spec = spec_for(tiny_heads, method, k)
    params = params_for(mode)
    eager = run_waves(tiny_loaded, waves(), params, speculative_config=spec, **SMALL)
    fused = run_waves(tiny_loaded, waves(), params, overlap=overlap,
                      on_engine=lambda e: enable_graphs(e, k), speculative_config=spec,
                      **SMALL)
    assert fused.outputs == eager.outputs
    if not overlap:
        # (Overlapped steps reserve blocks for the worst case of the step after them, so in
        # this small pool they can preempt a request a step before eager does: the same
        # tokens, drafted in other rounds.)
        assert fused.stats["spec"] == eager.stats["spec"]
    steps = fused.engine.runner.fused
    assert steps.mode_steps[mode] > 20, f"the {mode} graphs served too few steps"
    if overlap and method not in ("ngram", "suffix"):
        assert steps.chained > 10, "no penalized step was launched from its predecessor's"
    if overlap and method == "ngram":
        assert steps.relaunched > 10, "no penalized step was relaunched from the carry"
    if method is None:  # the penalties did act: without them the tokens differ
        plain = run_waves(tiny_loaded, waves(), without_penalties(params), **SMALL)
        assert sum(a != b for a, b in zip(fused.outputs, plain.outputs)) >= 3


@pytest.mark.parametrize("method,k,mode", [("ngram", 3, SAMPLE_PENALIZED),
                                           ("suffix", 3, MASKED_PENALIZED)], ids=mode_id)
def test_penalized_output_is_the_same_with_and_without_speculation(
        tiny_loaded, tiny_heads, method, k, mode):
    """Row j of a verify step counts the drafts in rows 1 .. j as output tokens: on repetitive
    prompts the model-free drafters' drafts are accepted, and a row that left its earlier
    drafts out would choose another token than plain decoding. (A random head's drafts are
    almost never accepted.)"""
    prompts = repetitive_prompts(4, 9, period=5, repeats=3)
    params = [MILD[mode][i % len(MILD[mode])] for i in range(len(prompts))]
    plain = make_engine(tiny_loaded, **SMALL)
    want = run_batch(plain, prompts, params)
    eng = make_engine(tiny_loaded, speculative_config=spec_for(tiny_heads, method, k),
                      overlap=True, **SMALL)
    enable_graphs(eng, k)
    got = run_batch(eng, prompts, params)
    assert got == want
    spec = eng.stats()["spec"]
    assert spec["num_accepted_tokens"] > 10, spec
    assert eng.runner.fused.mode_steps[mode] > 10


def test_tables_refilled_after_steps_off_the_graphs(tiny_loaded, tiny_heads):
    """A request that arrives while penalized ones decode is prefilled in chunks beside their
    decode rows, steps the general path serves; the graphs count none of the tokens those
    steps emit, so the next step launched from the host refills every penalized row's tables
    from its committed tokens."""
    spec = spec_for(tiny_heads, "eagle3", 3)
    prompts = repetitive_prompts(2, 7)
    late = repetitive_prompts(1, 8, period=9, repeats=5)[0]  # 45+ tokens: chunks of 16

    def run(eng):
        for i, p in enumerate(prompts):
            eng.add_request(f"p{i}", p, PENALIZED[i])
        done, steps = {}, 0
        while eng.has_unfinished_requests():
            for o in eng.step():
                done[o.request_id] = o.token_ids if o.finished else None
            steps += 1
            if steps == 6:
                eng.add_request("late", late, PENALIZED[3])
        return done, steps
    want, _ = run(make_engine(tiny_loaded, speculative_config=spec, **SMALL))
    eng = make_engine(tiny_loaded, speculative_config=spec, overlap=True, **SMALL)
    enable_graphs(eng, 3)
    got, steps = run(eng)
    assert got == want
    fused = eng.runner.fused
    assert fused.mode_steps[SAMPLE_PENALIZED] > 5
    assert fused.replays + fused.prefill.launches < steps, "no step left the graphs"


@pytest.mark.parametrize("method,k,mode", [(None, 0, MASKED_PENALIZED),
                                           (None, 0, SAMPLE_PENALIZED),
                                           ("eagle3", 2, SAMPLE_PENALIZED),
                                           ("mtp", 2, MASKED_PENALIZED)], ids=mode_id)
def test_penalized_prefill_launched_like_a_decode_step(tiny_loaded, tiny_heads, method, k, mode):
    """A penalized request's prefill is launched like a decode step too: its family's prefill
    tail fills the request's tables, draws the first token over the prompt's repetition
    penalty and counts it; its decode steps chain from it. Token for token the eager
    engine's."""
    spec = spec_for(tiny_heads, method, k)
    eng = make_engine(tiny_loaded, speculative_config=spec, overlap=True, **SMALL)
    enable_graphs(eng, k)
    eager = make_engine(tiny_loaded, speculative_config=spec, **SMALL)
    fused = eng.runner.fused
    prompts = repetitive_prompts(4, 13, period=4, repeats=3)  # one chunk each
    # The first token is the one the prompt's repetition penalty acts on alone: below 1 it
    # pulls the prompt's tokens up.
    strong = (SamplingParams(repetition_penalty=0.2, temperature=0.0, **HOT) if mode ==
              SAMPLE_PENALIZED else SamplingParams(repetition_penalty=0.2, temperature=2.0,
                                                   top_k=3, seed=1, **HOT))
    params = [strong] + [p for p in KINDS[mode] if p.needs_penalties]
    other = make_engine(tiny_loaded, **SMALL)
    first = [run_batch(other, [prompt], p)[0][0] for prompt, p in zip(prompts, params)]
    free = [run_batch(other, [prompt], without_penalties([p])[0])[0][0]
            for prompt, p in zip(prompts, params)]
    assert first != free, "the prompt's penalties moved no first token"
    for n, (prompt, p) in enumerate(zip(prompts, params * 2)):
        own = graph_mode([p])  # (a greedy request with penalties: sample+penalties)
        launches, chained, steps = fused.prefill.launches, fused.chained, fused.mode_steps[own]
        got = run_batch(eng, [prompt], p)
        assert got == run_batch(eager, [prompt], p), n
        assert fused.prefill.launches - launches == 1, (n, len(prompt))
        assert fused.chained - chained >= 1 and fused.mode_steps[own] - steps >= 5
    assert eng.stats()["spec"] == eager.stats()["spec"]
