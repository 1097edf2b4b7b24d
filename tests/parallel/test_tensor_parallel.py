"""Tensor parallelism on the CPU (gloo, engine/tp_executor.py): the sharded engine's output is the
unsharded engine's, token for token, for the default model over 3 ranks (its 9 query and 3 KV
heads) and a tiny random model over 2 (o and q/k/v biases, one KV head replicated on both ranks,
a vocabulary that does not divide); every drafter runs under it (EAGLE-3 and MTP heads sharded
too); a rank that dies fails the engine at once with an error naming it, and nothing is left
running."""

import os
import signal
import time

import pytest
import torch

from outpace import LLM, SamplingParams
from outpace.engine.tp_executor import WorkerDiedError
from tests.models.helpers import tiny_hf, word_tokenizer
from tests.process_helpers import wait_all_ended
from tests.speculative.spec_helpers import EXACT_DRAFTS

PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, a dragon",
           "List three colors, then list them again:"]
TINY_PROMPTS = [[5, 6, 7, 8, 9, 10], [20, 21, 22, 20, 21, 22, 20, 21], [40, 3]]
# small KV pools (a CPU pool is 1 GiB by default, touched when it is zeroed)
SMALL = dict(max_model_len=512, num_kv_blocks=80)
TINY = dict(num_kv_blocks=40)


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
    return LLM("smollm2-135m", device="cpu", quiet=True, loaded=loaded_default, **SMALL)


@pytest.fixture(scope="module")
def default_tp3(default_model_path):
    llm = LLM(str(default_model_path), device="cpu", quiet=True, tensor_parallel_size=3,
              **SMALL)
    yield llm
    assert _all_ended(llm)


def test_three_ranks_give_the_default_models_tokens_and_logprobs(reference, default_tp3):
    """Greedy (with logprobs) and seeded sampling, in one batch."""
    params = [SamplingParams(max_tokens=12, temperature=0.0, logprobs=3)] * 2 + [
        SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=s) for s in (11, 12)]
    want = reference.generate(PROMPTS, params)
    got = default_tp3.generate(PROMPTS, params)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lw, lg in zip(w.outputs[0].logprobs or (), g.outputs[0].logprobs or ()):
            assert lw.keys() == lg.keys()
            assert max(abs(lw[t] - lg[t]) for t in lw) < 1e-4
    assert want[0].outputs[0].logprobs


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A tiny model with biases on q/k/v and o, 4 query heads over 1 KV head, and 95 ids
    (2 ranks: 48 and 47 rows)."""
    folder = tmp_path_factory.mktemp("tp_tiny")
    tiny_hf("llama_bias", seed=5, vocab_size=95, num_key_value_heads=1).save_pretrained(folder)
    word_tokenizer(folder, 95)
    return folder


# greedy with logprobs, greedy, and seeded sampling, in one batch
TINY_PARAMS = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2),
               SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
               SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True)]


@pytest.fixture(scope="module")
def tiny_reference(tiny_folder):
    """The unsharded engine's output, without speculation."""
    return LLM(str(tiny_folder), device="cpu", quiet=True, **TINY).generate(TINY_PROMPTS,
                                                                          TINY_PARAMS)


@pytest.fixture(scope="module")
def tiny_heads(tiny_folder, tmp_path_factory):
    from outpace.training.init_draft import init_draft
    out = tmp_path_factory.mktemp("tp_heads")
    return {m: str(init_draft(m, str(tiny_folder), out / m, seed=3, quiet=True))
            for m in ("eagle3", "mtp")}


# (n-gram takes suffix's path under TP: a host drafter, its drafts carried in the step plans)
@pytest.mark.parametrize("method", [None, "suffix", "eagle3", "mtp"])
def test_two_ranks_of_a_tiny_model_give_its_output_with_every_drafter(
        tiny_folder, tiny_reference, tiny_heads, method):
    spec = None if method is None else {"method": method, "num_speculative_tokens": 3,
                                        **({"model": tiny_heads[method]}
                                           if method in tiny_heads else {})}
    llm = LLM(str(tiny_folder), device="cpu", quiet=True, tensor_parallel_size=2,
              speculative_config=spec, **TINY)
    try:
        got = llm.generate(TINY_PROMPTS, TINY_PARAMS)
    finally:
        assert _all_ended(llm)
    for w, g in zip(tiny_reference, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lw, lg in zip(w.outputs[0].logprobs or (), g.outputs[0].logprobs or ()):
            assert max(abs(lw[t] - lg[t]) for t in lw) < 1e-5
    assert tiny_reference[0].outputs[0].logprobs


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_a_draft_heads_drafts_are_the_same_over_two_ranks(tiny_folder, tiny_heads, method):
    """Under force-accept the output is made of the head's drafts, so it equals the unsharded
    engine's only if the sharded head drafts exactly what the whole one does (its layer cut
    right, its KV plane in each rank's pool)."""
    spec = {"method": method, "model": tiny_heads[method], "num_speculative_tokens": 3,
            "force_accept_mean": 2.0, **EXACT_DRAFTS}
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = []
    for size in (1, 2):
        llm = LLM(str(tiny_folder), device="cpu", quiet=True, tensor_parallel_size=size,
                  speculative_config=spec, seed=7, **TINY)
        try:
            outs.append((_tokens(llm, TINY_PROMPTS, params),
                         llm.engine.spec_stats.as_dict()["accepted_per_position"]))
        finally:
            if size > 1:
                assert _all_ended(llm)
    assert outs[1] == outs[0] and sum(outs[0][1]) > 0


def test_a_killed_rank_fails_the_engine_at_once_and_nothing_is_left(tiny_folder):
    llm = LLM(str(tiny_folder), device="cpu", quiet=True, tensor_parallel_size=2, **TINY)
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


def test_the_ranks_end_when_the_engines_process_is_killed(tiny_folder, tmp_path):
    """Rank 0's process killed outright (no cleanup runs): the other ranks see their pipe or
    their gloo connections close and exit, rather than wait forever."""
    import subprocess
    import sys
    script = tmp_path / "engine.py"
    script.write_text(
        "import os, sys, time\n"
        "from outpace import LLM\n"
        "if __name__ == '__main__':\n"
        f"    llm = LLM({str(tiny_folder)!r}, device='cpu', quiet=True, tensor_parallel_size=2,"
        " num_kv_blocks=40)\n"
        "    print(*[p.pid for p in llm.engine.runner.workers.processes], flush=True)\n"
        "    time.sleep(120)\n")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": repo, "OMP_NUM_THREADS": "1"})
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert pids
        proc.kill()
        proc.wait(10)
        assert not wait_all_ended(pids, 15)
    finally:
        proc.kill()


def test_a_script_without_the_main_guard_is_told_what_to_add(tiny_folder, tmp_path):
    """The ranks are spawned, so each imports the script that built the engine: without
    `if __name__ == "__main__":` a rank can't start, and the error says what to add."""
    import subprocess
    import sys
    script = tmp_path / "unguarded.py"
    script.write_text("from outpace import LLM\n"
                      f"LLM({str(tiny_folder)!r}, device='cpu', quiet=True, "
                      "tensor_parallel_size=2, num_kv_blocks=40)\n")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": repo, "OMP_NUM_THREADS": "1"})
    assert r.returncode != 0
    assert "tensor-parallel rank 1 ended while starting" in r.stderr, r.stderr[-2000:]
    assert 'if __name__ == "__main__":' in r.stderr
