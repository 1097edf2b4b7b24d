"""Malformed requests: each gets a 4xx with an OpenAI-style error body that says what is wrong,
and the server keeps serving."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.e2e.server_helpers import MAX_MODEL_LEN

MODEL = "<model>"  # replaced by the served name
OK_COMPLETION = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
C, CHAT, TOK, DETOK = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"


def _with(base: dict, **changes) -> dict:
    out = {**base, **changes}
    return {k: v for k, v in out.items() if v is not ...}  # `...` deletes a key


# (id, path, body (dict, or bytes sent raw), expected status, a word the message must contain)
CASES = [
    ("invalid_json", C, b'{"model": "x", "prompt": ', 400, "JSON"),
    ("body_not_object", C, b'[1, 2, 3]', 400, "object"),
    ("empty_body", C, b"", 400, "empty"),
    ("nested_1000_deep", C, b'{"model": "<model>", "prompt": ' + b"[" * 1000 + b"]" * 1000
     + b"}", 400, "levels deep"),
    ("nested_in_chat", CHAT, b'{"model": "<model>", "messages": [{"role": "user", "content": '
     + b'{"a": ' * 500 + b"1" + b"}" * 500 + b"}]}", 400, "levels deep"),
    ("invalid_utf8", C, b'{"model": "m", "prompt": "\xff\xfe"}', 400, "UTF-8"),
    ("lone_surrogate", C, b'{"model": "<model>", "prompt": "a\\ud800b"}', 400, "surrogate"),
    ("nan_constant", C, b'{"model": "<model>", "prompt": "a", "temperature": NaN}', 400, "NaN"),
    ("unknown_model", C, _with(OK_COMPLETION, model="gpt-17"), 404, "gpt-17"),
    ("model_wrong_type", C, _with(OK_COMPLETION, model=5), 400, "model"),
    ("missing_prompt", C, _with(OK_COMPLETION, prompt=...), 400, "prompt"),
    ("prompt_wrong_type", C, _with(OK_COMPLETION, prompt=3.5), 400, "prompt"),
    ("prompt_many", C, _with(OK_COMPLETION, prompt=["a", "b"]), 400, "one prompt"),
    ("prompt_empty", C, _with(OK_COMPLETION, prompt=""), 400, "empty"),
    ("prompt_ids_out_of_range", C, _with(OK_COMPLETION, prompt=[1, 10 ** 9]), 400, "token"),
    ("prompt_too_long", C, _with(OK_COMPLETION, prompt="hello " * (MAX_MODEL_LEN + 10)), 400,
     "context"),
    ("prompt_plus_max_tokens_too_long", C,
     _with(OK_COMPLETION, prompt="hello " * (MAX_MODEL_LEN // 2), max_tokens=MAX_MODEL_LEN - 8),
     400, "context"),
    ("max_tokens_negative", C, _with(OK_COMPLETION, max_tokens=-1), 400, "max_tokens"),
    ("max_tokens_zero", C, _with(OK_COMPLETION, max_tokens=0), 400, "max_tokens"),
    ("max_tokens_huge", C, _with(OK_COMPLETION, max_tokens=10 ** 12), 400, "max_tokens"),
    ("max_tokens_string", C, _with(OK_COMPLETION, max_tokens="5"), 400, "max_tokens"),
    ("max_tokens_float", C, _with(OK_COMPLETION, max_tokens=5.5), 400, "max_tokens"),
    ("temperature_negative", C, _with(OK_COMPLETION, temperature=-0.5), 400, "temperature"),
    ("temperature_string", C, _with(OK_COMPLETION, temperature="hot"), 400, "temperature"),
    ("top_p_zero", C, _with(OK_COMPLETION, top_p=0.0), 400, "top_p"),
    ("top_p_above_one", C, _with(OK_COMPLETION, top_p=1.5), 400, "top_p"),
    ("top_p_zero_in_float32", C, _with(OK_COMPLETION, top_p=1e-46, temperature=1.0), 400,
     "smallest normal float32"),
    ("top_k_negative", C, _with(OK_COMPLETION, top_k=-7), 400, "top_k"),
    ("min_p_above_one", C, _with(OK_COMPLETION, min_p=2.0), 400, "min_p"),
    ("frequency_penalty_range", C, _with(OK_COMPLETION, frequency_penalty=5.0), 400,
     "frequency_penalty"),
    ("repetition_penalty_zero", C, _with(OK_COMPLETION, repetition_penalty=0.0), 400,
     "repetition_penalty"),
    ("seed_string", C, _with(OK_COMPLETION, seed="abc"), 400, "seed"),
    ("seed_out_of_64_bits", C, _with(OK_COMPLETION, seed=2 ** 80), 400, "seed"),
    ("top_k_huge", C, _with(OK_COMPLETION, top_k=10 ** 20, temperature=1.0), 400, "top_k"),
    ("n_unsupported", C, _with(OK_COMPLETION, n=3), 400, "n=3"),
    ("logprobs_too_many", C, _with(OK_COMPLETION, logprobs=50), 400, "logprobs"),
    ("stop_wrong_type", C, _with(OK_COMPLETION, stop=7), 400, "stop"),
    ("stop_empty_string", C, _with(OK_COMPLETION, stop=[""]), 400, "stop"),
    ("stream_wrong_type", C, _with(OK_COMPLETION, stream="yes"), 400, "stream"),
    ("stream_options_without_stream", C,
     _with(OK_COMPLETION, stream_options={"include_usage": True}), 400, "stream"),
    ("echo_unsupported", C, _with(OK_COMPLETION, echo=True), 400, "echo"),
    ("chat_empty_messages", CHAT, _with(OK_CHAT, messages=[]), 400, "messages"),
    ("chat_messages_not_list", CHAT, _with(OK_CHAT, messages="hi"), 400, "messages"),
    ("chat_bad_role", CHAT, _with(OK_CHAT, messages=[{"role": "wizard", "content": "x"}]), 400,
     "role"),
    ("chat_missing_role", CHAT, _with(OK_CHAT, messages=[{"content": "x"}]), 400, "role"),
    ("chat_content_number", CHAT, _with(OK_CHAT, messages=[{"role": "user", "content": 42}]),
     400, "content"),
    ("chat_image_part", CHAT, _with(OK_CHAT, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), 400, "text"),
    ("chat_top_logprobs_without_logprobs", CHAT, _with(OK_CHAT, top_logprobs=2), 400,
     "logprobs"),
    ("chat_tools_unsupported", CHAT, _with(OK_CHAT, tools=[{"type": "function"}]), 400, "tool"),
    ("chat_max_completion_tokens_negative", CHAT, _with(OK_CHAT, max_completion_tokens=-3,
                                                               max_tokens=...), 400,
     "max_tokens"),
    ("tokenize_neither_prompt_nor_messages", TOK, {"model": MODEL}, 400, "either prompt"),
    ("tokenize_prompt_and_messages", TOK, {"prompt": "a", "messages": OK_CHAT["messages"]},
     400, "either prompt"),
    ("tokenize_prompt_ids", TOK, {"prompt": [1, 2]}, 400, "string"),
    ("tokenize_unknown_model", TOK, {"model": "gpt-17", "prompt": "a"}, 404, "gpt-17"),
    ("tokenize_bad_role", TOK, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("tokenize_messages_with_special_tokens", TOK,
     {"messages": OK_CHAT["messages"], "add_special_tokens": True}, 400, "add_special_tokens"),
    ("detokenize_missing_tokens", DETOK, {"model": MODEL}, 400, "tokens"),
    ("detokenize_not_ints", DETOK, {"tokens": ["a"]}, 400, "tokens"),
    ("detokenize_bool", DETOK, {"tokens": [True]}, 400, "tokens"),
    ("detokenize_out_of_range", DETOK, {"tokens": [1, 10 ** 9]}, 400, "vocabulary"),
    ("detokenize_negative", DETOK, {"tokens": [-1]}, 400, "vocabulary"),
]


def _send(client: httpx.Client, srv, path: str, body) -> httpx.Response:
    if isinstance(body, dict):
        body = json.dumps(body).replace(MODEL, srv.model).encode()
    else:
        body = body.replace(MODEL.encode(), srv.model.encode())
    return client.post(path, content=body, headers={"Content-Type": "application/json"})


def _check_error(r: httpx.Response, status: int, word: str) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert isinstance(err["message"], str) and word.lower() in err["message"].lower(), err
    assert isinstance(err["type"], str) and "param" in err and "code" in err


@pytest.mark.parametrize("path,body,status,word", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_malformed_request_is_4xx(server, path, body, status, word):
    with server.client() as client:
        _check_error(_send(client, server, path, body), status, word)


def test_protocol_level_errors(server):
    with server.client() as client:
        _check_error(client.post(C, content=b'{"a": "' + b"x" * (4 << 20) + b'"}'), 413,
                     "limit")
        _check_error(client.get(C), 405, "GET")
        body = json.dumps(OK_COMPLETION).replace(MODEL, server.model)
        for ctype in ("text/plain", "application/x-www-form-urlencoded"):
            _check_error(client.post(C, content=body, headers={"Content-Type": ctype}), 415,
                         "Content-Type: application/json")
        assert client.head("/health").status_code == 200
        _check_error(client.get("/v1/nothing-here"), 404, "/v1/nothing-here")


def test_api_key(server):
    body = json.dumps(OK_COMPLETION).replace(MODEL, server.model)
    for headers, word in [({}, "missing"), ({"Authorization": "Bearer wrong"}, "wrong"),
                          ({"Authorization": "Basic dGVzdC1rZXk="}, "wrong")]:
        r = httpx.post(server.url + C, content=body, headers=headers, timeout=30)
        _check_error(r, 401, word)
        _check_error(httpx.get(server.url + "/v1/models", headers=headers, timeout=30), 401, word)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200  # open, as vLLM's


def test_still_healthy_after_errors(server):
    """Runs after the malformed requests above (same session server)."""
    with server.client() as client:
        for _, path, body, _, _ in CASES:  # all of them once more, back to back
            assert 400 <= _send(client, server, path, body).status_code < 500
        assert client.get("/health").status_code == 200
        r = _send(client, server, C, _with(OK_COMPLETION, max_tokens=3,
                                           ignore_eos=True)).json()
        assert r["usage"]["completion_tokens"] == 3
        r = _send(client, server, CHAT, OK_CHAT)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"


def test_loopback_server_without_a_key_answers_only_loopback_names(server, spec_server):
    """DNS rebinding: a page on evil.example that resolves to 127.0.0.1 sends Host:
    evil.example; the keyless loopback server refuses it, the keyed one needs its key anyway."""
    port = spec_server.url.rsplit(":", 1)[1]
    r = httpx.get(spec_server.url + "/v1/models", headers={"Host": f"evil.example:{port}"},
                  timeout=30)
    _check_error(r, 403, "not a loopback name")
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "[::1]", "LOCALHOST.",
                 f"0.0.0.0:{port}", "10.1.2.3"):  # IP addresses: no DNS name to rebind
        r = httpx.get(spec_server.url + "/v1/models", headers={"Host": host}, timeout=30)
        assert r.status_code == 200, (host, r.text)
    r = httpx.get(server.url + "/v1/models", timeout=30,
                  headers={"Host": "evil.example", "Authorization": f"Bearer {server.api_key}"})
    assert r.status_code == 200
