"""/metrics parses with prometheus_client's parser and its counters move as requests run; the
TTFT's phases add up to it (outpace.bench.server_metrics reads them as benchmarks/serve.py does)."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from outpace.bench.server_metrics import PHASES, TTFT, TTFT_SUM, histogram_totals
from tests.e2e.server_helpers import scrape, wait_for

EXPECTED = [
    "outpace:num_requests_running", "outpace:num_requests_waiting",
    "outpace:kv_cache_blocks_used", "outpace:kv_cache_blocks_total",
    "outpace:kv_cache_usage_perc", "outpace:prompt_tokens_total",
    "outpace:generation_tokens_total", "outpace:time_to_first_token_seconds_count",
    "outpace:time_per_output_token_seconds_count", "outpace:e2e_request_latency_seconds_count",
    "outpace:spec_decode_num_drafts_total", "outpace:spec_decode_num_draft_tokens_total",
    "outpace:spec_decode_num_accepted_tokens_total", "outpace:spec_decode_draft_failures_total",
]


def test_metrics_parse_and_move(server):
    # the labelled histograms appear with their first request, which other tests may not have
    # sent yet: every name is checked after this test's requests
    before = scrape(server)
    assert before["outpace:kv_cache_blocks_total"] > 0
    usages = []
    with server.client() as client:
        for stream in (False, True):
            body = {"model": server.model, "prompt": "metrics please", "max_tokens": 7,
                    "ignore_eos": True, "stream": stream}
            if stream:
                body["stream_options"] = {"include_usage": True}
                with client.stream("POST", "/v1/completions", json=body) as r:
                    lines = [ln for ln in r.iter_lines() if ln.startswith("data: {")]
                usages.append(httpx.Response(200, content=lines[-1][6:]).json()["usage"])
            else:
                usages.append(client.post("/v1/completions", json=body).json()["usage"])
    after = scrape(server)
    for name in EXPECTED:
        assert name in after, name

    def delta(name):
        return after.get(name, 0) - before.get(name, 0)

    assert delta("outpace:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert delta("outpace:generation_tokens_total") == 14
    for h in ("time_to_first_token_seconds", "time_per_output_token_seconds",
              "e2e_request_latency_seconds"):
        assert delta(f"outpace:{h}_count") == 2
        assert delta(f"outpace:{h}_sum") > 0
    assert delta("outpace:request_success_total{finished_reason=length}") == 2
    ttft_inf = after["outpace:time_to_first_token_seconds_bucket{le=+Inf}"]
    assert ttft_inf == after["outpace:time_to_first_token_seconds_count"]
    assert after["outpace:engine_healthy"] == 1


def test_error_statuses_are_counted(server):
    before = scrape(server).get("outpace:http_request_errors_total{status_code=404}", 0)
    httpx.get(server.url + "/v1/nope", timeout=10)
    after = scrape(server)["outpace:http_request_errors_total{status_code=404}"]
    assert after == before + 1


def _output_text(line: str) -> str:
    """The output text an SSE line carries (a completion's text, a chat delta's content)."""
    if not line.startswith("data: {"):
        return ""
    choices = json.loads(line[6:]).get("choices") or [{}]
    return choices[0].get("text") or (choices[0].get("delta") or {}).get("content") or ""


def _totals(srv) -> dict:
    return histogram_totals(httpx.get(srv.url + "/metrics", timeout=10).text)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "where does the time go"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "where does it go"}]}),
])
def test_ttft_phases_add_up_to_the_ttft(server, path, body):
    """One streamed request at a time, /metrics around it: each phase recorded once, none
    negative, the TTFT's own adding up to the server's TTFT, and the server's TTFT with the
    phases before (HTTP header to handler) and after it (to the first chunk) inside the
    client's TTFT."""
    before = _totals(server)
    body = {**body, "model": server.model, "max_tokens": 3, "ignore_eos": True, "stream": True}
    with server.client() as client:
        sent = time.perf_counter()
        client_ttft = None
        with client.stream("POST", path, json=body) as r:
            for line in r.iter_lines():
                if client_ttft is None and _output_text(line):
                    client_ttft = time.perf_counter() - sent

    def recorded():  # (as its last chunk goes out; beside an engine process, maybe just after)
        t = _totals(server)
        return t if t[TTFT][1] > before.get(TTFT, (0, 0))[1] else None

    after = wait_for(recorded, timeout=5)

    def one(name):  # the request's value: the only one recorded meanwhile
        s0, c0 = before.get(name, (0.0, 0.0))
        assert after[name][1] - c0 == 1, name
        return after[name][0] - s0

    ttft = one(TTFT)
    phases = {phase: one(h) for phase, h in PHASES}
    assert all(v >= 0 for v in phases.values()), phases
    assert sum(phases[p] for p in TTFT_SUM) == pytest.approx(ttft, abs=1e-4), (ttft, phases)
    assert client_ttft is not None
    assert phases["http_wait"] + ttft + phases["first_chunk"] <= client_ttft
