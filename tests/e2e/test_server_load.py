"""Load: 64 concurrent streaming clients (`outpace bench serve`'s client) for 8 s, long enough
for several rounds of 64 requests (OUTPACE_LOAD_TEST_S sets a longer soak): no errors, every
request completes, and the KV blocks are back to zero after the drain."""

from __future__ import annotations

import asyncio
import json
import os

from outpace.bench.datasets import random_text_prompts
from outpace.bench.serve import ServeBenchConfig, run_benchmark
from tests.e2e.server_helpers import API_KEY, scrape, wait_for

DURATION_S = float(os.environ.get("OUTPACE_LOAD_TEST_S", "8"))


def test_64_concurrent_streams(server, tmp_path):
    cfg = ServeBenchConfig(base_url=server.url, model=server.model, endpoint="/v1/completions",
                           api_key=API_KEY, num_prompts=None, duration_s=DURATION_S,
                           max_concurrency=64, output_len=32, ignore_eos=True, temperature=0.8,
                           timeout_s=300)
    prompts = random_text_prompts(64, 16, seed=0)
    before = scrape(server)
    s = asyncio.run(run_benchmark(cfg, prompts))
    (tmp_path / "load.json").write_text(json.dumps(s, indent=2))
    print("\nload:", json.dumps({k: v for k, v in s.items() if k not in ("config", "errors")}))
    assert s["failed"] == 0, s["errors"]
    # the 64 concurrent requests at least (more when the machine is quick enough to start a
    # second wave within the duration)
    assert s["completed"] == s["num_prompts"] >= 64
    assert s["total_output_tokens"] == 32 * s["completed"]
    after = wait_for(lambda: (lambda m: m if m["outpace:kv_cache_blocks_used"] == 0
                              and m["outpace:num_requests_running"] == 0
                              and m["outpace:num_requests_waiting"] == 0 else None)(
        scrape(server)), 15)
    assert after, scrape(server)
    done = after["outpace:request_success_total{finished_reason=length}"] - before.get(
        "outpace:request_success_total{finished_reason=length}", 0)
    assert done == s["completed"]
    assert after["outpace:generation_tokens_total"] - before["outpace:generation_tokens_total"] \
        == s["total_output_tokens"]
