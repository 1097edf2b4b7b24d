"""`outpace bench latency`: the time of one batch end to end (prefill and every output token of
--batch-size requests at once), over --num-iters runs after --num-iters-warmup untimed ones, as
`vllm bench latency` measures it. Each run draws new random prompts (the same seed gives the
same runs), so the prefix cache never shortens a timed prefill; dataset prompts are the same
batch every run."""

from __future__ import annotations

import sys

from outpace.bench import offline
from outpace.bench.report import (at_least, check_output_json, mean, percentile, print_result,
                                  progress, write_json)

NAME = "latency"
HELP = "time one batch end to end (avg / p50 / p90 / p99 seconds)"
PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_arguments(p) -> None:
    offline.add_engine_and_prompt_args(p, input_len=32, output_len=128)
    p.add_argument("--batch-size", type=int, default=8, help="requests in the batch")
    p.add_argument("--num-iters-warmup", type=int, default=3, help="untimed runs first")
    p.add_argument("--num-iters", type=int, default=10, help="timed runs")


def run(a) -> int:
    at_least(a.batch_size, 1, "--batch-size")
    at_least(a.num_iters, 1, "--num-iters")
    at_least(a.num_iters_warmup, 0, "--num-iters-warmup")
    check_output_json(a.output_json)
    texts = offline.check_prompt_args(a, a.batch_size)
    params = offline.sampling_params(a)
    engine = offline.load_engine(a)
    spec_on = engine.config.spec.method is not None
    fixed = None if texts is None else offline.prompt_ids(engine, a, texts, a.batch_size, 0)

    def batch(i: int) -> list:
        if fixed is not None:
            return fixed
        return offline.prompt_ids(engine, a, None, a.batch_size, seed=a.seed * 1_000_003 + i)

    n = a.num_iters_warmup + a.num_iters
    latencies = []
    bar = progress(n, "batch", a.quiet)
    before = None
    for i in range(n):
        if i == a.num_iters_warmup:
            before = offline.spec_counters(engine)
            bar.set_description("timed")
        elif i == 0:
            bar.set_description("warm-up")
        seconds, _ = offline.run_requests(engine, batch(i), params, tag=f"lat{i}")
        if i >= a.num_iters_warmup:
            latencies.append(seconds)
        bar.update(1)
    bar.close()
    result = {
        "config": {"model": a.model, "batch_size": a.batch_size,
                   "input_len": a.input_len, "dataset": a.dataset, "output_len": a.output_len,
                   "num_iters": a.num_iters, "num_iters_warmup": a.num_iters_warmup,
                   "speculative_config": offline.spec_config(a)},
        "avg_latency": mean(latencies),
        "latencies": latencies,
        "percentiles": {str(p): percentile(latencies, p) for p in PERCENTILES},
    }
    rows = [("Batch size", a.batch_size), ("Output tokens per request", a.output_len),
            ("Timed iterations", a.num_iters), ("Avg latency (s)", result["avg_latency"])]
    rows += [(f"P{p} latency (s)", result["percentiles"][str(p)]) for p in (50, 90, 99)]
    if spec_on:
        result["spec"] = offline.spec_result(before, offline.spec_counters(engine))
        rows.append(("Mean acceptance length", result["spec"]["mean_acceptance_length"]))
    print_result("Latency Benchmark Result", rows, out=sys.stdout)
    write_json(a.output_json, result)
    return 0
