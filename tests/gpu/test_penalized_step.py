"""Penalties in the fused step on CUDA (runner/fused_penalties.py): repetition, frequency and
presence penalties, greedy and sampled, with masks or not, beside requests without them.

* graph replay gives the eager CUDA engine's tokens, and the CPU engine's (tiny fp32 target),
  chained, relaunched or launched step by step;
* a request's output is the same with and without speculation (a verify row counts the drafts
  before it);
* penalized decode steps do not sync with the host (DESIGN idea 9), the steps launched from the
  host (which fill the tables) included.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("triton")

from outpace.runner.fused_sampling import MASKED_PENALIZED, SAMPLE_PENALIZED  # noqa: E402
from tests.engine_helpers import make_engine, run_batch  # noqa: E402
from tests.gpu.test_fused_step import (CASES, gpu_engine, spec_for,  # noqa: E402
                                       steps_without_sync)
from tests.spec.spec_helpers import repetitive_prompts, tiny_target  # noqa: E402
from tests.spec.test_fused_penalties import KINDS, MILD, without_penalties  # noqa: E402

MODES = [SAMPLE_PENALIZED, MASKED_PENALIZED]


def params_for(prompts, mode: str, kinds=KINDS) -> list:
    return [kinds[mode][i % len(kinds[mode])] for i in range(len(prompts))]


@pytest.mark.parametrize("mode", MODES)
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


@pytest.mark.parametrize("mode", MODES)
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
