"""Penalties in the fused step on CUDA (runner/fused_penalties.py): repetition, frequency and
presence penalties, greedy and sampled, with masks or not, beside requests without them.

* graph replay gives the eager CUDA engine's tokens, and the CPU engine's (tiny fp32 target),
  chained, relaunched or launched step by step;
* a request's output is the same with and without speculation (a verify row counts the drafts
  before it);
* penalized decode steps do not sync with the host (docs/design.md, "Overlap and no host
  syncs"), the steps launched from the host (which fill the tables) included.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("triton")

from outpace.runner.graph_mode import MASKED_PENALIZED, SAMPLE_PENALIZED, GraphMode  # noqa: E402
from tests.engine_helpers import make_engine, run_batch  # noqa: E402
from tests.gpu.test_fused_step import (CASES, gpu_engine, spec_for,  # noqa: E402
                                       steps_without_sync)
from tests.speculative.spec_helpers import repetitive_prompts, tiny_target  # noqa: E402
from tests.speculative.test_fused_penalties import KINDS, MILD, without_penalties  # noqa: E402

MODES = [SAMPLE_PENALIZED, MASKED_PENALIZED]


@pytest.mark.parametrize("bucket,q,vocab", [(1, 3, 49152), (8, 1, 49152), (32, 3, 32000),
                                            (3, 5, 128256), (2, 9, 151936)])
def test_penalty_kernels_match_reference(bucket, q, vocab):
    """sample/penalty_kernels.py against its torch reference on fresh random inputs: bit for bit
    (IEEE division, no fused multiply-add), rows of 1, 0, 0 untouched; the counts exact."""
    from outpace.sample.penalty_kernels import (count_emitted, count_emitted_ref, penalize_rows,
                                           penalize_rows_ref)
    g = torch.Generator(device="cuda").manual_seed(bucket * 31 + q)
    m = bucket + 3
    logits = torch.randn(bucket * q, vocab, device="cuda", generator=g) * 5
    prompt = torch.rand(m, vocab, device="cuda", generator=g) < 0.05
    counts = torch.randint(0, 4, (m, vocab), device="cuda", generator=g).float() \
        * (torch.rand(m, vocab, device="cuda", generator=g) < 0.02)
    ids = torch.randint(0, 500, (bucket * q,), device="cuda", generator=g)
    rep = 0.5 + 1.5 * torch.rand(m, device="cuda", generator=g)
    freq = torch.rand(m, device="cuda", generator=g) * 4 - 2
    pres = torch.rand(m, device="cuda", generator=g) * 4 - 2
    rep[0], freq[0], pres[0] = 1.0, 0.0, 0.0
    want = penalize_rows_ref(logits.clone(), prompt, counts, ids, rep, freq, pres, bucket, q)
    got = penalize_rows(logits.clone(), prompt, counts, ids, rep, freq, pres, bucket, q)
    assert torch.equal(got, want), (got - want).abs().max()
    assert torch.equal(got[:q], logits[:q]) and not torch.equal(got, logits) or bucket == 1
    packed = torch.randint(0, 300, (bucket, q + 2), device="cuda", generator=g)
    packed[:, q - 1:q] = -1 if q > 1 else packed[:, q - 1:q]
    a, b = counts.clone(), counts.clone()
    count_emitted_ref(packed, q, a)
    count_emitted(packed, q, b)
    assert torch.equal(a, b) and not torch.equal(a, counts)


def params_for(prompts, mode: GraphMode, kinds=KINDS) -> list:
    return [kinds[mode][i % len(kinds[mode])] for i in range(len(prompts))]


@pytest.mark.parametrize("mode", MODES, ids=str)
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("method,k", CASES, ids=[f"{m}-k{k}" for m, k in CASES])
def test_penalized_graph_replay_equals_eager_and_cpu(cuda_loaded, cuda_heads, method, k,
                                                     overlap, mode):
    spec = spec_for(cuda_heads, method, k)
    prompts = repetitive_prompts(5, 11)  # 5 requests: bucket 8, 3 padded rows
    params = params_for(prompts, mode)
    want = run_batch(gpu_engine(cuda_loaded, spec, eager=True), prompts, params)
    graphed = gpu_engine(cuda_loaded, spec, eager=False, overlap=overlap)
    got = run_batch(graphed, prompts, params)
    assert got == want
    fused = graphed.runner.fused
    assert fused.mode_steps[mode] > 15, f"the {mode} graphs served too few steps"
    if overlap and method != "ngram":
        assert fused.chained > 10
    if overlap and method == "ngram":
        assert fused.relaunched > 10
    cpu = make_engine(tiny_target(seed=0), speculative_config=spec, max_num_seqs=8)
    assert run_batch(cpu, prompts, params) == want
    plain = run_batch(graphed, prompts, without_penalties(params))
    assert sum(a != b for a, b in zip(got, plain)) >= 2, "the penalties changed nothing"


@pytest.mark.parametrize("mode", MODES, ids=str)
@pytest.mark.parametrize("method,k", [("ngram", 3), ("suffix", 3)])
def test_penalized_output_is_the_same_with_and_without_speculation(cuda_loaded, cuda_heads,
                                                                   method, k, mode):
    prompts = repetitive_prompts(4, 9, period=5, repeats=3)
    params = params_for(prompts, mode, MILD)
    plain = run_batch(gpu_engine(cuda_loaded, None, eager=False), prompts, params)
    spec = {"method": method, "num_speculative_tokens": k}  # model-free drafters
    eng = gpu_engine(cuda_loaded, spec, eager=False, overlap=True)
    assert run_batch(eng, prompts, params) == plain
    assert eng.stats()["spec"]["num_accepted_tokens"] > 10
    assert eng.runner.fused.mode_steps[mode] > 10


@pytest.mark.parametrize("method,k,opts", [(None, 0, {}), ("ngram", 3, {}),
                                           ("eagle3", 3, {"force_accept_mean": 3.0}),
                                           ("eagle3", 3, {})],
                         ids=["plain", "ngram", "eagle3-fa3", "eagle3"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_penalized_decode_steps_do_not_sync_with_host(cuda_loaded, cuda_heads, method, k, opts,
                                                      overlap):
    eng = gpu_engine(cuda_loaded, spec_for(cuda_heads, method, k, **opts), eager=False,
                     overlap=overlap)
    prompts = repetitive_prompts(4, 3)
    params = [dataclasses.replace(p, max_tokens=80)
              for p in params_for(prompts, MASKED_PENALIZED)]
    done = steps_without_sync(eng, prompts, params)
    assert done["replays"] == done[MASKED_PENALIZED] == 10


@pytest.mark.parametrize("mode", MODES, ids=str)
@pytest.mark.parametrize("method,k", [(None, 0), ("eagle3", 3), ("mtp", 2)])
def test_penalized_prefill_launched_like_a_decode_step(cuda_loaded, cuda_heads, method, k,
                                                       mode):
    """One request at a time: a penalized prefill is launched like a decode step (its tail
    fills the tables, draws the first token and counts it) and its decode steps chain from it;
    tokens equal the eager engine's."""
    spec = spec_for(cuda_heads, method, k)
    eager = gpu_engine(cuda_loaded, spec, eager=True)
    graphed = gpu_engine(cuda_loaded, spec, eager=False)
    fused = graphed.runner.fused
    params = [p for p in KINDS[mode] if p.needs_penalties]
    for n, (prompt, p) in enumerate(zip(repetitive_prompts(3, 14), params * 2)):
        launches, chained = fused.prefill.launches, fused.chained
        assert run_batch(graphed, [prompt], p) == run_batch(eager, [prompt], p), n
        assert fused.prefill.launches - launches == 1 and fused.chained - chained >= 5
