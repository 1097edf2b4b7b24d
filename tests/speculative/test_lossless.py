"""Speculative decoding is lossless: greedy output with speculation == without, token for token.

The matrix (tiny peaked target, CPU fp32): every method (ngram, suffix, EAGLE-3 and MTP-eagle
random heads) x k in {1, 3, 5}, in one scenario that has it all: a budget of 16 tokens per step
(prefill chunks mixed with decodes and verify blocks), a pool so small that requests are
preempted and resumed, and a second wave of requests sharing a system prompt with the first
(prefix-cache hits, one an exact repeat). Each run checks that the scenario really happened
(preemptions, cache hits, mixed steps) and that drafts were made and accepted, so a pass is
not vacuous. Then penalties and ignored-for-greedy filters, and a small matrix on the real model.
"""

from __future__ import annotations

import pytest

from outpace import SamplingParams
from tests.engine_helpers import PlanRecorder, chat_ids
from tests.speculative.spec_helpers import (MIN_MARGIN, TINY_BLOCK, first_divergence, min_greedy_margin,
                                     repetitive_prompts, run_waves)

ENGINE = dict(block_size=TINY_BLOCK, max_num_batched_tokens=16, num_kv_blocks=40)
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
METHODS = ["ngram", "suffix", "eagle3", "mtp"]


def waves():
    system = repetitive_prompts(1, 99, period=10, repeats=1)[0]  # shared system prompt
    first = repetitive_prompts(6, 1, prefix=system)
    return [first, repetitive_prompts(2, 2, prefix=system) + [first[0]]]


def spec_config(method, k, heads, enhancer=True, **extra):
    cfg = {"method": method, "num_speculative_tokens": k, **extra}
    if method in ("eagle3", "mtp"):
        cfg["model"] = str(heads[method])
        if method == "mtp":
            cfg["mtp_mode"] = "eagle"
        if enhancer:  # random heads propose junk; suffix matches make some drafts right
            cfg["enhancer_min_match"] = 2
    return cfg


def recorded_run(loaded, scenario, params, **kwargs):
    rec = {}
    run = run_waves(loaded, scenario, params,
                    on_engine=lambda e: rec.setdefault("plans", PlanRecorder(e)), **kwargs)
    run.plans = rec["plans"].plans
    return run


def assert_scenario_happened(run):
    assert run.stats["num_preemptions_total"] > 0, "no preemption: pool too large for the test"
    assert run.engine.kv.prefix_cache_hit_tokens > 0, "no prefix-cache hit"
    mixed = [p for p in run.plans
             if any(not sr.sample or (sr.num_new_tokens > 1 and not sr.draft_token_ids)
                    for sr in p.scheduled)
             and any(sr.sample and sr.num_computed_tokens >= len(sr.request.prompt_token_ids)
                     for sr in p.scheduled)]
    assert mixed, "no step mixed a prefill chunk with decodes"
    assert any(not sr.sample for p in run.plans for sr in p.scheduled), "no chunked prefill"


def assert_same(loaded, prompts, want, got):
    for p, w, g in zip(prompts, want, got):
        if w != g:
            pytest.fail(first_divergence(loaded[0], loaded[1], p, w, g))


@pytest.fixture(scope="module")
def reference(tiny_loaded):
    scenario = waves()
    run = recorded_run(tiny_loaded, scenario, GREEDY, **ENGINE)
    assert_scenario_happened(run)
    prompts = scenario[0] + scenario[1]
    margin = min_greedy_margin(tiny_loaded[0], tiny_loaded[1],
                               [p + o for p, o in zip(prompts, run.outputs)],
                               [len(p) for p in prompts])
    assert margin > MIN_MARGIN, f"reference has a near-tie (gap {margin:.1e}); change the seed"
    return scenario, run.outputs


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("method", METHODS)
def test_greedy_spec_equals_non_spec(tiny_loaded, tiny_heads, reference, method, k):
    scenario, want = reference
    run = recorded_run(tiny_loaded, scenario, GREEDY,
                       speculative_config=spec_config(method, k, tiny_heads), **ENGINE)
    assert_same(tiny_loaded, scenario[0] + scenario[1], want, run.outputs)
    assert_scenario_happened(run)
    s = run.stats["spec"]
    assert s["num_drafts"] > 10 and s["num_accepted_tokens"] > 5, s
    assert len(s["accepted_per_position"]) == k
    if k > 1:  # drafts longer than one token were verified (and some accepted past the first)
        assert max(len(sr.draft_token_ids) for p in run.plans for sr in p.scheduled) > 1
        assert s["accepted_per_position"][1] > 0, s


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_random_head_alone_is_lossless(tiny_loaded, tiny_heads, reference, method):
    """Head drafts only (no enhancer): nearly all rejected, output unchanged."""
    scenario, want = reference
    run = run_waves(tiny_loaded, scenario, GREEDY,
                    speculative_config=spec_config(method, 3, tiny_heads, enhancer=False),
                    **ENGINE)
    assert_same(tiny_loaded, scenario[0] + scenario[1], want, run.outputs)
    assert run.stats["spec"]["num_draft_tokens"] > 100


# ---- penalties and filters: draft positions get the same processing as a plain step ----------

PENALISED = [
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=1.3),
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, frequency_penalty=0.4),
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, presence_penalty=0.6),
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=1.1,
                   frequency_penalty=0.2, presence_penalty=0.2, top_k=3, top_p=0.5, min_p=0.2),
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, top_k=2, top_p=0.3,
                   min_p=0.5),
    GREEDY,
]


PENALISED_ENGINE = dict(block_size=TINY_BLOCK, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def penalised_reference(tiny_loaded):
    """(prompts, their PENALISED output without speculation), checked to be a reference that
    tests the penalties and filters."""
    prompts = repetitive_prompts(6, 5)
    plain = run_waves(tiny_loaded, [prompts], GREEDY, **PENALISED_ENGINE).outputs
    want = run_waves(tiny_loaded, [prompts], PENALISED, **PENALISED_ENGINE).outputs
    # the penalties really act (else the test proves nothing about them) ...
    assert all(w != p for w, p in zip(want[:4], plain[:4]))
    # ... and top-k/top-p/min-p are no-ops for greedy rows
    assert want[4] == plain[4] and want[5] == plain[5]
    return prompts, want


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_penalties_and_filters_with_greedy_are_lossless(tiny_loaded, tiny_heads,
                                                        penalised_reference, method):
    prompts, want = penalised_reference
    kw = PENALISED_ENGINE
    run = run_waves(tiny_loaded, [prompts], PENALISED,
                    speculative_config=spec_config(method, 3, tiny_heads), **kw)
    assert_same(tiny_loaded, prompts, want, run.outputs)
    penalised_accepted = sum(o.spec_stats.num_accepted_tokens for o in run.outs[:4])
    assert penalised_accepted > 0, "no draft was accepted under penalties"


# ---- the real default model ------------------------------------------------------------------

COPY_TEXT = ("The old lighthouse stood on the northern cliff. Every night the keeper climbed "
             "ninety steps to light the lamp, and every morning he wrote the weather in a book.")
REAL_QUESTIONS = [
    f"Repeat this text exactly: {COPY_TEXT}",
    f"Rewrite this text, changing 'keeper' to 'guard': {COPY_TEXT}",
    "List the numbers from one to twenty, separated by commas.",
    "What is the capital of France?",
]


REAL_PARAMS = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
REAL_ENGINE = dict(max_num_batched_tokens=64, block_size=16)


@pytest.fixture(scope="module")
def real_reference(loaded_default):
    prompts = chat_ids(loaded_default[2], REAL_QUESTIONS)
    return prompts, run_waves(loaded_default, [prompts], REAL_PARAMS, **REAL_ENGINE).outputs


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_real_model_greedy_spec_equals_non_spec(loaded_default, real_heads, real_reference,
                                                method):
    prompts, want = real_reference
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "eagle3":
        spec.update(model=str(real_heads["eagle3"]), enhancer_min_match=3)
    run = run_waves(loaded_default, [prompts], REAL_PARAMS, speculative_config=spec,
                    **REAL_ENGINE)
    assert_same(loaded_default, prompts, want, run.outputs)
    s = run.stats["spec"]
    assert s["num_drafts"] > 0 and s["num_accepted_tokens"] > 0, s
    print(f"\nreal model, {method} k=3: mean acceptance length "
          f"{s['mean_acceptance_length']:.2f} over {s['num_drafts']} drafts")
