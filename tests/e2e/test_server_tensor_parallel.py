"""`outpace serve --tensor-parallel-size 2` (CPU): the server answers as the unsharded one does,
with the engine in a thread of the server or in a process of its own, and when the server is
stopped (SIGTERM) no rank is left running."""

from __future__ import annotations

import pytest

from tests.e2e.server_helpers import MAX_MODEL_LEN, NUM_KV_BLOCKS, ServerProcess
from tests.process_helpers import descendants, wait_all_ended


PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def unsharded_answer(tiny_model_dir):
    from outpace import LLM, SamplingParams
    llm = LLM(str(tiny_model_dir), device="cpu", quiet=True, max_model_len=MAX_MODEL_LEN,
              num_kv_blocks=NUM_KV_BLOCKS)
    return llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0,
                                               ignore_eos=True))[0].outputs[0].text


@pytest.mark.parametrize("mode", [[], ["--engine-process"]], ids=["thread", "process"])
def test_a_sharded_server_answers_and_leaves_no_rank(tiny_model_dir, unsharded_answer, tmp_path,
                                                     mode):
    body = {"model": str(tiny_model_dir), "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    srv = ServerProcess(tiny_model_dir, ["--tensor-parallel-size", "2", *mode],
                        tmp_path / "serve.log")
    try:
        srv.wait_healthy()
        with srv.client() as c:
            r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        ranks = descendants(srv.proc.pid)
        assert ranks  # the other rank (and with --engine-process, the core)
    finally:
        srv.stop()
    assert r.json()["choices"][0]["text"] == unsharded_answer and unsharded_answer
    assert not wait_all_ended(ranks, 10), srv.log_tail()
