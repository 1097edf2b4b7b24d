"""/metrics parses with prometheus_client's parser and its counters move as requests run."""

from __future__ import annotations

import httpx

from tests.e2e.server_helpers import scrape

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
