"""Logprobs in the fused step on CUDA (the +logprobs graphs): requests asking for logprobs
beside requests that don't, greedy, sampled, masked and penalized.

* kernels/logprobs.py against its reference on fresh random rows (ties to the lower id);
* graph replay gives the eager CUDA engine's tokens, and the CPU engine's (tiny fp32 target),
  with their logprobs to float32 rounding, chained, relaunched or step by step; a lone
  request's prefill launched like a decode step (its family's prefill tail) too;
* logprobs decode steps do not sync with the host (docs/design.md, "Overlap and no host
  syncs").
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("triton")

from outpace.runner.graph_mode import GraphMode  # noqa: E402
from tests.engine_helpers import make_engine, run_batch_outputs  # noqa: E402
from tests.gpu.test_fused_step import (CASES, gpu_engine, spec_for,  # noqa: E402
                                       steps_without_sync)
from tests.speculative.spec_helpers import repetitive_prompts, tiny_target  # noqa: E402
from tests.speculative.test_fused_logprobs import (CROSS_DEVICE, PARAMS, close,  # noqa: E402
                                                   params_for)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows,vocab,top", [(1, 49152, 20), (3, 32000, 5), (96, 49152, 20),
                                            (7, 151936, 20), (5, 4099, 1), (4, 49152, 0)])
def test_logprobs_kernel_matches_reference(rows, vocab, top, dtype):
    from outpace.kernels.logprobs import row_logprobs
    from tests.unit import logprobs_cases
    logits, tokens = logprobs_cases.make_case(rows, vocab, seed=rows + vocab + top, dtype=dtype)
    logits, tokens = logits.cuda(), tokens.cuda()
    want = logprobs_cases.stable_ref(logits, tokens, top)
    logprobs_cases.check(row_logprobs(logits, tokens, top), want, top, tol=2e-5)
    count = min(3, top)  # a graph's count: the first of the top
    got = row_logprobs(logits, tokens, top, torch.tensor([count], dtype=torch.int32,
                                                         device="cuda"))
    cols = [0, *range(1, 1 + count), *range(1 + top, 1 + top + count)]
    logprobs_cases.check(got[:, cols], want[:, cols], count, tol=2e-5)


def outputs(eng, prompts, params) -> list:
    """(token ids, logprobs) per prompt, all prompts in one batch."""
    return [(o.token_ids, o.outputs[0].logprobs)
            for o in run_batch_outputs(eng, prompts, params)]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("method,k", CASES, ids=[f"{m}-k{k}" for m, k in CASES])
def test_logprobs_graph_replay_equals_eager_and_cpu(cuda_loaded, cuda_heads, method, k,
                                                    overlap):
    spec = spec_for(cuda_heads, method, k)
    prompts = repetitive_prompts(6, 11)  # 6 requests: bucket 8, 2 padded rows
    params = params_for(len(prompts))
    want = outputs(gpu_engine(cuda_loaded, spec, eager=True), prompts, params)
    graphed = gpu_engine(cuda_loaded, spec, eager=False, overlap=overlap)
    got = outputs(graphed, prompts, params)
    assert [t for t, _ in got] == [t for t, _ in want]
    assert all(close(a, b) for (_, a), (_, b) in zip(got, want))
    fused = graphed.runner.fused
    served = sum(n for mode, n in fused.mode_steps.items() if mode.logprobs)
    assert served > 15, "the logprobs graphs served too few steps"
    if overlap and method != "ngram":
        assert fused.chained > 10
    cpu = outputs(make_engine(tiny_target(seed=0), speculative_config=spec, max_num_seqs=8),
                  prompts, params)
    assert [t for t, _ in cpu] == [t for t, _ in want]
    assert all(close(a, b, CROSS_DEVICE) for (_, a), (_, b) in zip(cpu, want))


@pytest.mark.parametrize("method,k,opts", [(None, 0, {}), ("ngram", 3, {}),
                                           ("eagle3", 3, {"force_accept_mean": 3.0})],
                         ids=["plain", "ngram", "eagle3-fa3"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_logprobs_decode_steps_do_not_sync_with_host(cuda_loaded, cuda_heads, method, k, opts,
                                                     overlap):
    import dataclasses
    eng = gpu_engine(cuda_loaded, spec_for(cuda_heads, method, k, **opts), eager=False,
                     overlap=overlap)
    prompts = repetitive_prompts(4, 3)
    params = [dataclasses.replace(p, max_tokens=80) for p in params_for(len(prompts))]
    done = steps_without_sync(eng, prompts, params)
    served = sum(n for mode, n in done.items() if isinstance(mode, GraphMode) and mode.logprobs)
    assert done["replays"] == served == 10


@pytest.mark.parametrize("method,k", [(None, 0), ("eagle3", 3)], ids=["plain", "eagle3"])
def test_logprobs_prefill_tail_equals_eager(cuda_loaded, cuda_heads, method, k):
    spec = spec_for(cuda_heads, method, k)
    graphed = gpu_engine(cuda_loaded, spec, eager=False)
    eager = gpu_engine(cuda_loaded, spec, eager=True)
    fused = graphed.runner.fused
    prompts = repetitive_prompts(len(PARAMS), 13)
    for n, (prompt, p) in enumerate(zip(prompts, PARAMS)):
        launches = fused.prefill.launches
        got, want = outputs(graphed, [prompt], [p]), outputs(eager, [prompt], [p])
        assert [t for t, _ in got] == [t for t, _ in want], n
        assert all(close(a, b) for (_, a), (_, b) in zip(got, want)), n
        assert fused.prefill.launches - launches == 1, n
