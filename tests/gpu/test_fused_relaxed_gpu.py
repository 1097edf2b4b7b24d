"""Relaxed acceptance inside thinking spans in real CUDA graphs (runner/fused_relaxed.py): the
same tokens and drafts as the eager engine, with a head (chained) and n-gram (relaunched), and
after warm-up no step waits for the GPU (torch.cuda.set_sync_debug_mode("error"))."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("triton")

from outpace import SamplingParams  # noqa: E402
from tests.engine_helpers import run_batch  # noqa: E402
from tests.gpu.test_fused_step import (drafts_by_order, gpu_engine, record_drafts,  # noqa: E402
                                       spec_for, steps_without_sync)
from tests.speculative.spec_helpers import repetitive_prompts  # noqa: E402
from tests.speculative.test_draft_plane import RELAXED, THINK  # noqa: E402

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def _prompts():
    base = repetitive_prompts(5, 11)
    return base[:2] + [p + [THINK] for p in base[2:]]  # three of five inside a span


# a realistic check besides the one every eligible draft passes: the thresholds decide too
# (a draft exactly at one may go either way on either path, as an argmax tie may)
STRICTER = {**RELAXED, "relaxed_top_k": 3, "relaxed_delta": 0.2}


@pytest.mark.parametrize("relaxed", [RELAXED, STRICTER], ids=["any", "top3"])
@pytest.mark.parametrize("method", ["ngram", "eagle3"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_relaxed_graphs_replay_as_eager(cuda_loaded, cuda_heads, method, overlap, relaxed):
    spec = {**spec_for(cuda_heads, method, 3), **relaxed}
    eager = gpu_engine(cuda_loaded, spec, eager=True)
    want_drafts = record_drafts(eager)
    want = run_batch(eager, _prompts(), GREEDY)
    graphed = gpu_engine(cuda_loaded, spec, eager=False, overlap=overlap)
    got_drafts = record_drafts(graphed)
    assert run_batch(graphed, _prompts(), GREEDY) == want
    assert drafts_by_order(got_drafts, False) == drafts_by_order(want_drafts, False)
    assert graphed.runner.fused.replays > 10
    assert graphed.stats()["spec"] == eager.stats()["spec"]


def test_relaxed_decode_steps_do_not_sync_with_host(cuda_loaded, cuda_heads):
    eng = gpu_engine(cuda_loaded, {**spec_for(cuda_heads, "eagle3", 3), **RELAXED},
                     eager=False, overlap=True)
    params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    done = steps_without_sync(eng, _prompts()[1:], [params] * 4)
    assert done["replays"] == 10
