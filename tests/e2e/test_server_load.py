"""Load: 64 concurrent streaming clients (benchmarks/serve.py as the client) for 8 s, long enough
for several rounds of 64 requests (OUTPACE_LOAD_TEST_S sets a longer soak): no errors, every
request completes, and the KV blocks are back to zero after the drain."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
from pathlib import Path

from tests.e2e.server_helpers import API_KEY, scrape, wait_for

REPO = Path(__file__).resolve().parents[2]
DURATION_S = float(os.environ.get("OUTPACE_LOAD_TEST_S", "8"))


def _bench_module():
    spec = importlib.util.spec_from_file_location("outpace_bench_serve",
                                                  REPO / "benchmarks" / "serve.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_64_concurrent_streams(server, tmp_path):
    bench = _bench_module()
    cfg = bench.BenchConfig(base_url=server.url, model=server.model, endpoint="completions",
                            api_key=API_KEY, dataset="random", num_prompts=None,
                            duration_s=DURATION_S, max_concurrency=64, output_len=32,
                            ignore_eos=True, temperature=0.8, timeout_s=300)
    before = scrape(server)
    s = asyncio.run(bench.run_benchmark(cfg))
    (tmp_path / "load.json").write_text(json.dumps(s, indent=2))
    print("\nload:", json.dumps({k: v for k, v in s.items() if k not in ("config", "errors")}))
    assert s["failed"] == 0, s["errors"]
    # the 64 concurrent requests at least (more when the machine is quick enough to start a
    # second wave within the duration)
    assert s["completed"] == s["num_requests"] >= 64
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
