"""Relaxed acceptance inside thinking spans in the fused step's graphs (runner/fused_relaxed.py),
on CPU with the rerun_capture stand-in: outputs and acceptance statistics equal the general
path's, with a head (steps chained from the device) and a host drafter (steps relaunched from the
carry), launched from the host or overlapped; the span state the graphs advance on the device
is the one the host's trackers reach."""

from __future__ import annotations

import pytest

from tests.speculative.spec_helpers import TINY_BLOCK, repetitive_prompts, run_waves
from tests.speculative.test_draft_plane import END, RELAXED, THINK, per_request_rate
from tests.speculative.test_fused_step import GREEDY, enable_graphs, spec_for


def _prompts():
    outside = [p for p in repetitive_prompts(4, 7) if THINK not in p and END not in p][:3]
    # inside a span from the start; one whose span ends in its prompt; one that opens it late
    return outside + [p + [THINK] for p in outside[:2]] + [outside[2] + [THINK, 7, END]]


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_relaxed_acceptance_in_the_fused_step_equals_eager(tiny_loaded, tiny_heads, method, overlap):
    spec = {**spec_for(tiny_heads, method, 3), **RELAXED}
    kw = dict(block_size=TINY_BLOCK, max_num_batched_tokens=32, max_num_seqs=8)
    prompts = _prompts()
    eager = run_waves(tiny_loaded, [prompts], GREEDY, speculative_config=spec, **kw)
    fused = run_waves(tiny_loaded, [prompts], GREEDY, speculative_config=spec, overlap=overlap,
                      on_engine=lambda e: enable_graphs(e, 3), **kw)
    assert fused.outputs == eager.outputs
    assert fused.stats["spec"] == eager.stats["spec"]
    step = fused.engine.runner.fused
    assert step.replays > 8, "the fused step served too few steps"
    if overlap:
        assert (step.relaunched if method == "ngram" else step.chained) > 5
    # it did relax: inside the span every draft passes (top_k = the vocabulary, delta = 1)
    rates = per_request_rate(fused)
    assert all(r == 1.0 for r in rates[3:5]), rates
    assert rates[5] < 1.0 or method == "ngram", rates  # the span closed in its prompt


def test_sampled_requests_under_relaxed_acceptance_take_the_general_path(
        tiny_loaded, tiny_heads):
    from outpace import SamplingParams
    spec = {**spec_for(tiny_heads, "eagle3", 3), **RELAXED}
    kw = dict(block_size=TINY_BLOCK, max_num_batched_tokens=32, max_num_seqs=8)
    sampled = SamplingParams(max_tokens=16, temperature=0.8, seed=1, ignore_eos=True)
    run = run_waves(tiny_loaded, [_prompts()[:2]], sampled, speculative_config=spec,
                    on_engine=lambda e: enable_graphs(e, 3), **kw)
    assert run.engine.runner.fused.replays == 0


def test_step_relaxed_against_the_span_tracker_and_verify_on_random_rows():
    """StepRelaxed's tensor ops against the general path's pieces on fresh random rows:
    eligibility (ThinkingSpanTracker.relaxed_eligible, cut to the tokens left), the verify with
    the relaxed mask (greedy_verify_batched), the span state and tokens left after it."""
    import torch

    from outpace.attention.inputs import InputBuffers
    from outpace.runner.fused_relaxed import StepRelaxed
    from outpace.runner.sampling_step import RelaxedAcceptance
    from outpace.runner.step_bookkeeping import accept_ref
    from outpace.speculative.verify import (ThinkingSpanTracker, greedy_verify_batched,
                                            relaxed_accept_batched)
    begin, end, vocab = (3, 4), (5,), 12
    for seed in range(20):
        # every other seed accepts any eligible draft: a wrongly eligible one shows at once
        cfg = RelaxedAcceptance(top_k=4 if seed % 2 else vocab, delta=0.3 if seed % 2 else 1.0,
                                begin_ids=begin, end_ids=end)
        g = torch.Generator().manual_seed(seed)
        bucket, q = 6, 4
        k = q - 1
        step = StepRelaxed(InputBuffers(64, 8, 4, torch.device("cpu")), cfg, 1000,
                           torch.device("cpu"))
        inside = torch.rand(bucket, generator=g) < 0.6
        left = torch.randint(1, 6, (bucket,), generator=g)
        step.inside[:bucket].copy_(inside)
        step.left[:bucket].copy_(left)
        ids = torch.randint(0, vocab, (bucket * q,), generator=g)
        num_drafts = torch.randint(0, k + 1, (bucket,), generator=g)
        logits = torch.randn(bucket * q, vocab, generator=g) * 2
        target = logits.argmax(-1)
        got = step.targets(target, ids, num_drafts, logits, bucket, q)
        packed = torch.empty(bucket, q + 1 + 0, dtype=torch.long)
        accept_ref(got, ids, num_drafts, torch.zeros(bucket * q, dtype=torch.long), q, packed)
        # the general path's pieces
        drafts = ids.view(bucket, q)[:, 1:]
        eligible = torch.zeros(bucket, k, dtype=torch.bool)
        for b in range(bucket):
            t = ThinkingSpanTracker(begin, end, inside=bool(inside[b]))
            usable = min(int(num_drafts[b]), max(int(left[b]) - 1, 0))
            eligible[b, :usable] = torch.tensor(t.relaxed_eligible(drafts[b, :usable].tolist()),
                                                dtype=torch.bool)
        probs = torch.softmax(logits.view(bucket, q, -1), dim=-1)
        relaxed = relaxed_accept_batched(probs, drafts, cfg.top_k, cfg.delta, eligible)
        want, acc = greedy_verify_batched(target.view(bucket, q), drafts, num_drafts, relaxed)
        assert torch.equal(packed[:, :q], want) and torch.equal(packed[:, q], acc), seed
        step.advance(packed, q, bucket)
        for b in range(bucket):
            t = ThinkingSpanTracker(begin, end, inside=bool(inside[b]))
            t.update([x for x in want[b].tolist() if x >= 0])
            assert bool(step.inside[b]) == t.inside, (seed, b)
        assert torch.equal(step.left[:bucket], left - (want >= 0).sum(1)), seed
