"""Sampled decoding in the fused step on CUDA (runner/fused_step.py's sampled graphs,
sample/gumbel.py): temperature, top-k, top-p and min-p requests, seeded or not, beside greedy ones.

* the race's noise on CUDA equals the CPU's;
* graph replay gives the eager engine's tokens, and the CPU engine's (tiny fp32 target);
* a request's output is the same with and without speculation (the race keys each token by
  seed and position; drafts are verified against it);
* sampled decode steps do not sync with the host (docs/design.md, "Overlap and no host
  syncs"), chained or not.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("triton")

from outpace import SamplingParams  # noqa: E402
from outpace.runner.graph_mode import MASKED, SAMPLE, GraphMode  # noqa: E402
from outpace.sample.gumbel import gumbel_noise, race_tokens, race_key, seed_word  # noqa: E402
from tests.engine_helpers import make_engine, run_batch  # noqa: E402
from tests.gpu.test_fused_step import (CASES, DEFAULT, gpu_engine, spec_for,  # noqa: E402
                                       steps_without_sync)
from tests.speculative.spec_helpers import repetitive_prompts, tiny_target  # noqa: E402

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
# seeded and not, each of top-p, top-k and min-p (masked graphs), or a temperature alone
# (sampled graphs), and a greedy request
SAMPLED = {MASKED: [
    SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=1.2, top_k=12, ignore_eos=True), GREEDY,
    SamplingParams(max_tokens=40, temperature=0.6, min_p=0.05, seed=-5, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=1.0, seed=11, ignore_eos=True)],
    SAMPLE: [SamplingParams(max_tokens=40, temperature=0.8, seed=3, ignore_eos=True),
             SamplingParams(max_tokens=40, temperature=1.2, ignore_eos=True), GREEDY]}


def params_for(prompts, mode: GraphMode = MASKED) -> list:
    kinds = SAMPLED[mode]
    return [kinds[i % len(kinds)] for i in range(len(prompts))]


def test_noise_on_cuda_equals_cpu():
    keys = race_key(torch.full((8,), seed_word(5)), torch.arange(8))
    cpu = gumbel_noise(keys, 49152)
    gpu = gumbel_noise(keys.cuda(), 49152).cpu()
    assert torch.equal(race_key(torch.full((8,), seed_word(5)).cuda(), torch.arange(8).cuda())
                       .cpu(), keys)
    assert torch.allclose(cpu, gpu, rtol=1e-6, atol=1e-6)
    logits = torch.randn(8, 49152, generator=torch.Generator().manual_seed(0)) * 3
    words, positions = torch.full((8,), seed_word(5)), torch.arange(8)
    assert torch.equal(race_tokens(logits, words, positions),
                       race_tokens(logits.cuda(), words.cuda(), positions.cuda()).cpu())


@pytest.mark.parametrize("with_temp", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(1, 49152), (3, 49152), (37, 32000), (5, 4097)])
def test_race_kernel_matches_reference(dtype, rows, vocab, with_temp):
    """argmax_rows(race=...) (kernels/argmax.py's pass 1: division, keys, hashed noise) against
    argmax_ref on fresh inputs, a greedy row (word -1) among them."""
    from outpace.kernels.argmax import Race, argmax_ref, argmax_rows
    g = torch.Generator().manual_seed(rows * vocab + with_temp)
    x = (torch.randn(rows, vocab, generator=g) * 2).to(dtype)
    words = torch.randint(0, 1 << 32, (rows,), generator=g)
    words[rows // 2] = -1
    positions = torch.randint(0, 1 << 20, (rows,), generator=g)
    temp = torch.rand(rows, generator=g) + 0.3 if with_temp else None
    race = Race(words, positions, temp, pos_offset=1)
    on_gpu = Race(words.cuda(), positions.cuda(), temp.cuda() if with_temp else None, 1)
    got = argmax_rows(x.cuda(), race=on_gpu).cpu()
    assert torch.equal(got, argmax_ref(x, race=race))
    assert got[rows // 2] == x[rows // 2].float().argmax()


@pytest.mark.parametrize("mode", [MASKED, SAMPLE], ids=str)
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("method,k", CASES, ids=[f"{m}-k{k}" for m, k in CASES])
def test_sampled_graph_replay_equals_eager_and_cpu(cuda_loaded, cuda_heads, method, k, overlap,
                                                   mode):
    spec = spec_for(cuda_heads, method, k)
    prompts = repetitive_prompts(5, 11)  # 5 requests: bucket 8, 3 padded rows
    params = params_for(prompts, mode)
    want = run_batch(gpu_engine(cuda_loaded, spec, eager=True), prompts, params)
    graphed = gpu_engine(cuda_loaded, spec, eager=False, overlap=overlap)
    got = run_batch(graphed, prompts, params)
    assert got == want
    fused = graphed.runner.fused
    assert fused.mode_steps[mode] > 20, f"the {mode} graphs served too few steps"
    if overlap and method != "ngram":
        assert fused.chained > 10
    cpu = make_engine(tiny_target(seed=0), speculative_config=spec, max_num_seqs=8)
    assert run_batch(cpu, prompts, params) == want
    assert sum(a != b for a, b in zip(got, run_batch(graphed, prompts, GREEDY))) >= 3


@pytest.mark.parametrize("mode", [MASKED, SAMPLE], ids=str)
@pytest.mark.parametrize("method,k", [(None, 0), ("eagle3", 3), ("mtp", 2)])
def test_sampled_prefill_launched_like_a_decode_step(cuda_loaded, cuda_heads, method, k, mode):
    """One request at a time: a sampled prefill is launched like a decode step (its family's
    prefill tail draws the token on the device) and its decode steps chain from it; tokens
    equal the eager engine's."""
    spec = spec_for(cuda_heads, method, k)
    eager = gpu_engine(cuda_loaded, spec, eager=True)
    graphed = gpu_engine(cuda_loaded, spec, eager=False)
    fused = graphed.runner.fused
    for n, (prompt, p) in enumerate(zip(repetitive_prompts(3, 14), params_for(range(5), mode))):
        if p.temperature == 0:
            continue
        launches, chained = fused.prefill.launches, fused.chained
        assert run_batch(graphed, [prompt], p) == run_batch(eager, [prompt], p), n
        assert fused.prefill.launches - launches == 1 and fused.chained - chained >= 10


SPEC_CASES = [(m, k, {}) for m, k in CASES[1:]] + [("ngram", 3, DEFAULT)]


@pytest.mark.parametrize("method,k,opts", SPEC_CASES,
                         ids=[f"{m}-k{k}" + ("-default" if o else "") for m, k, o in SPEC_CASES])
def test_sampled_output_is_the_same_with_and_without_speculation(cuda_loaded, cuda_heads,
                                                                 method, k, opts):
    prompts = repetitive_prompts(5, 12)
    params = params_for(prompts)
    plain = run_batch(gpu_engine(cuda_loaded, None, eager=False), prompts, params)
    eng = gpu_engine(cuda_loaded, spec_for(cuda_heads, method, k, **opts), eager=False)
    assert eng.config.spec.ngram_device is (opts == DEFAULT)
    assert run_batch(eng, prompts, params) == plain
    assert eng.stats()["spec"]["num_drafts"] > 50 and eng.runner.fused.mode_steps[MASKED] > 20


@pytest.mark.parametrize("method,k,opts", [(None, 0, {}), ("ngram", 3, {}),
                                           ("ngram", 3, DEFAULT),
                                           ("eagle3", 3, {"force_accept_mean": 3.0}),
                                           ("eagle3", 3, {})],
                         ids=["plain", "ngram", "ngram-default", "eagle3-fa3", "eagle3"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_sampled_decode_steps_do_not_sync_with_host(cuda_loaded, cuda_heads, method, k, opts,
                                                    overlap):
    eng = gpu_engine(cuda_loaded, spec_for(cuda_heads, method, k, **opts), eager=False,
                     overlap=overlap)
    params = [SamplingParams(max_tokens=80, temperature=0.9, top_p=0.95, seed=i,
                             ignore_eos=True) for i in range(4)]
    done = steps_without_sync(eng, repetitive_prompts(4, 3), params)
    assert done["replays"] == done[MASKED] == 10
