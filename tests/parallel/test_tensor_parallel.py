"""Tensor parallelism on the CPU (gloo, engine/tp_executor.py): the sharded engine's output is the
unsharded engine's, token for token, for the default model over 3 ranks (its 9 query and 3 KV
heads) and a tiny random model over 2 (o and q/k/v biases, one KV head replicated on both ranks,
a vocabulary that does not divide); the model-free drafters run under it; a rank that dies fails
the engine at once with an error naming it, and nothing is left running."""

import os
import signal
import time

import pytest
import torch

from outpace import LLM, SamplingParams
from outpace.engine.tp_executor import WorkerDiedError
from tests.models.helpers import tiny_hf, word_tokenizer

PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, a dragon",
           "List three colors, then list them again:"]
TINY_PROMPTS = [[5, 6, 7, 8, 9, 10], [20, 21, 22, 20, 21, 22, 20, 21], [40, 3]]


@pytest.fixture(autouse=True, scope="module")
def keep_torch_threads():
    """Rank 0 takes its share of the cores (tp_executor.cpu_threads_per_rank): given back after."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _tokens(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _all_ended(llm) -> bool:
    procs = llm.engine.runner.workers.processes
    llm.shutdown()
    return all(not p.is_alive() for p in procs)


@pytest.fixture(scope="module")
def reference(loaded_default):
    return LLM("smollm2-135m", device="cpu", quiet=True, loaded=loaded_default)


@pytest.fixture(scope="module")
def default_tp3(default_model_path):
    llm = LLM(str(default_model_path), device="cpu", quiet=True, tensor_parallel_size=3)
    yield llm
    assert _all_ended(llm)


def test_three_ranks_give_the_default_models_tokens_and_logprobs(reference, default_tp3):
    """Greedy (with logprobs) and seeded sampling, in one batch."""
    params = [SamplingParams(max_tokens=32, temperature=0.0, logprobs=3)] * 2 + [
        SamplingParams(max_tokens=32, temperature=0.9, top_p=0.95, seed=s) for s in (11, 12)]
    want = reference.generate(PROMPTS, params)
    got = default_tp3.generate(PROMPTS, params)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lw, lg in zip(w.outputs[0].logprobs or (), g.outputs[0].logprobs or ()):
            assert lw.keys() == lg.keys()
            assert max(abs(lw[t] - lg[t]) for t in lw) < 1e-4
    assert want[0].outputs[0].logprobs


def test_ngram_drafting_under_three_ranks_is_the_plain_output(reference, default_model_path):
    llm = LLM(str(default_model_path), device="cpu", quiet=True, tensor_parallel_size=3,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    try:
        params = SamplingParams(max_tokens=24, temperature=0.0)
        prompts = PROMPTS[1:]  # code and a list: text that repeats
        assert _tokens(llm, prompts, params) == _tokens(reference, prompts, params)
        assert llm.engine.spec_stats.num_draft_tokens > 0  # it did draft
    finally:
        assert _all_ended(llm)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A tiny model with biases on q/k/v and o, 4 query heads over 1 KV head, and 95 ids
    (2 ranks: 48 and 47 rows)."""
    folder = tmp_path_factory.mktemp("tp_tiny")
    tiny_hf("llama_bias", seed=5, vocab_size=95, num_key_value_heads=1).save_pretrained(folder)
    word_tokenizer(folder, 95)
    return folder


def test_two_ranks_of_a_tiny_model_with_suffix_drafting(tiny_folder):
    ref = LLM(str(tiny_folder), device="cpu", quiet=True)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    want = ref.generate(TINY_PROMPTS, params)
    for spec in (None, {"method": "suffix", "num_speculative_tokens": 3}):
        llm = LLM(str(tiny_folder), device="cpu", quiet=True, tensor_parallel_size=2,
                  speculative_config=spec)
        try:
            got = llm.generate(TINY_PROMPTS, params)
        finally:
            assert _all_ended(llm)
        for w, g in zip(want, got):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids, spec
            for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
                assert max(abs(lw[t] - lg[t]) for t in lw) < 1e-5, spec


def test_a_killed_rank_fails_the_engine_at_once_and_nothing_is_left(tiny_folder):
    llm = LLM(str(tiny_folder), device="cpu", quiet=True, tensor_parallel_size=2)
    try:
        rank1 = llm.engine.runner.workers.processes[0]
        os.kill(rank1.pid, signal.SIGKILL)
        rank1.join(10)
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match="tensor-parallel rank 1 ended"):
            llm.generate(TINY_PROMPTS, SamplingParams(max_tokens=8))
        assert time.monotonic() - t0 < 10
        with pytest.raises(WorkerDiedError, match="rank 1"):  # every later call, at once
            llm.generate(TINY_PROMPTS[:1], SamplingParams(max_tokens=8))
        assert not llm.engine.has_unfinished_requests()
    finally:
        assert _all_ended(llm)
