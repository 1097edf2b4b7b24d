"""The official `openai` client, unmodified, against real `outpace serve` processes."""

from __future__ import annotations

import math

import openai
import pytest

from tests.e2e.server_helpers import scrape

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three colours of a fox."}]
SAMPLINGS = [
    pytest.param(dict(temperature=0.0), id="greedy"),
    pytest.param(dict(temperature=0.9, top_p=0.9, seed=1234,
                      extra_body={"top_k": 50, "min_p": 0.01}), id="seeded"),
    pytest.param(dict(temperature=0.7, seed=7, frequency_penalty=0.5, presence_penalty=0.3,
                      extra_body={"repetition_penalty": 1.1}), id="penalties"),
]


def client_of(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=srv.api_key or "unused",
                         max_retries=0, timeout=60)


@pytest.fixture(params=["plain", "spec"])
def any_server(request):
    return request.getfixturevalue("server" if request.param == "plain" else "spec_server")


def test_models(server):
    models = client_of(server).models.list()
    assert [m.id for m in models.data] == [server.model]
    assert client_of(server).models.retrieve(server.model).id == server.model


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_completion_stream_equals_nonstream(any_server, sampling):
    c = client_of(any_server)
    full = c.completions.create(model=any_server.model, prompt=PROMPT, max_tokens=24, **sampling)
    chunks = list(c.completions.create(model=any_server.model, prompt=PROMPT, max_tokens=24,
                                       stream=True, stream_options={"include_usage": True},
                                       **sampling))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == full.choices[0].text
    assert full.choices[0].finish_reason in ("stop", "length")
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finishes[-1] == full.choices[0].finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()
    u = full.usage
    assert u.prompt_tokens > 0 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    if full.choices[0].finish_reason == "length":
        assert u.completion_tokens == 24


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_chat_stream_equals_nonstream(any_server, sampling):
    c = client_of(any_server)
    full = c.chat.completions.create(model=any_server.model, messages=MESSAGES, max_tokens=24,
                                     **sampling)
    chunks = list(c.chat.completions.create(model=any_server.model, messages=MESSAGES,
                                            max_tokens=24, stream=True, **sampling))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    msg = full.choices[0].message
    assert msg.role == "assistant" and text == msg.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(ch.usage is None for ch in chunks)  # no include_usage: no usage chunk
    assert full.usage.completion_tokens >= 1


def test_speculation_is_lossless_and_counted(server, spec_server):
    """Greedy output with n-gram speculation equals the output without it, and the speculative
    counters on /metrics move."""
    before = scrape(spec_server)
    prompt = "one two three four one two three four one two three four one two"
    for srv_prompt in (prompt, PROMPT):
        outs = [client_of(s).completions.create(model=s.model, prompt=srv_prompt, max_tokens=48,
                                                temperature=0.0, extra_body={"ignore_eos": True})
                for s in (server, spec_server)]
        assert outs[0].choices[0].text == outs[1].choices[0].text
        assert outs[1].usage.completion_tokens == 48
    after = scrape(spec_server)
    assert after["outpace:spec_decode_num_drafts_total"] > before.get(
        "outpace:spec_decode_num_drafts_total", 0)
    assert after["outpace:spec_decode_num_draft_tokens_total"] >= \
        after["outpace:spec_decode_num_accepted_tokens_total"]
    per_pos = [v for k, v in after.items() if k.startswith(
        "outpace:spec_decode_num_accepted_tokens_per_pos_total{")]
    assert sum(per_pos) == after["outpace:spec_decode_num_accepted_tokens_total"]


def test_completion_logprobs(server):
    c = client_of(server)
    r = c.completions.create(model=server.model, prompt=PROMPT, max_tokens=8, temperature=0.0,
                             logprobs=3)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    for chosen, tops in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(tops) == 3 and chosen <= 0.0
        assert math.isclose(chosen, max(tops.values()), abs_tol=1e-4)  # greedy: the top one
    assert lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs_stream_and_not(server):
    c = client_of(server)
    kw = dict(model=server.model, messages=MESSAGES, max_tokens=6, temperature=0.0,
              logprobs=True, top_logprobs=2)
    full = c.chat.completions.create(**kw)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 2 and e.logprob <= 0.0
        assert math.isclose(e.logprob, e.top_logprobs[0].logprob, abs_tol=1e-4)
        assert e.bytes == list(e.token.encode())
    streamed = [e for ch in c.chat.completions.create(stream=True, **kw)
                if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == \
        [(e.token, round(e.logprob, 4)) for e in content]


def test_stop_string_cut_the_same_streamed_or_not(server):
    c = client_of(server)
    base = c.completions.create(model=server.model, prompt=PROMPT, max_tokens=40,
                                temperature=0.0, extra_body={"ignore_eos": True}).choices[0].text
    if len(base.strip()) < 12:
        pytest.skip("the random model produced too little text for a stop string")
    stop = base[8:11]
    kw = dict(model=server.model, prompt=PROMPT, max_tokens=40, temperature=0.0, stop=[stop],
              extra_body={"ignore_eos": True})
    r = c.completions.create(**kw)
    assert r.choices[0].text == base[:base.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **kw)
                       if ch.choices)
    assert streamed == r.choices[0].text


def test_token_id_prompt_and_max_tokens(server):
    c = client_of(server)
    r = c.completions.create(model=server.model, prompt=[1, 2, 3, 4, 5], max_tokens=5,
                             temperature=0.0, extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 5
    assert r.choices[0].finish_reason == "length"
