"""`outpace bench throughput`: offline throughput, as `vllm bench throughput` measures it:
--num-prompts requests given to the engine at once and run to completion; requests/s, total
(prompt + output) tokens/s and output tokens/s over that time, and with speculation the mean
acceptance length (tokens per verify step, bonus included)."""

from __future__ import annotations

import sys

from outpace.bench import offline
from outpace.bench.report import (at_least, check_output_json, print_result, progress,
                                  write_json)

NAME = "throughput"
HELP = "offline throughput: requests/s, total and output tokens/s"


def add_arguments(p) -> None:
    offline.add_engine_and_prompt_args(p, input_len=128, output_len=128)
    p.add_argument("--num-prompts", type=int, default=64, help="requests")


def run(a) -> int:
    at_least(a.num_prompts, 1, "--num-prompts")
    check_output_json(a.output_json)
    texts = offline.check_prompt_args(a, a.num_prompts)
    params = offline.sampling_params(a)
    engine = offline.load_engine(a)
    prompts = offline.prompt_ids(engine, a, texts, a.num_prompts, seed=a.seed)
    before = offline.spec_counters(engine)
    bar = progress(len(prompts), "req", a.quiet)
    elapsed, outs = offline.run_requests(engine, prompts, params, tag="tput",
                                         on_finished=lambda _: bar.update(1))
    bar.close()
    prompt_tokens = sum(len(p) for p in prompts)
    output_tokens = sum(len(o.token_ids) for o in outs)
    result = {
        "config": {"model": a.model, "num_prompts": a.num_prompts, "input_len": a.input_len,
                   "dataset": a.dataset, "output_len": a.output_len,
                   "speculative_config": offline.spec_config(a)},
        "elapsed_time": elapsed,
        "num_requests": len(outs),
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "total_num_tokens": prompt_tokens + output_tokens,
        "requests_per_second": len(outs) / elapsed,
        "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
    }
    rows = [("Successful requests", len(outs)), ("Elapsed time (s)", elapsed),
            ("Total prompt tokens", prompt_tokens), ("Total output tokens", output_tokens),
            ("Request throughput (req/s)", result["requests_per_second"]),
            ("Total token throughput (tok/s)", result["tokens_per_second"]),
            ("Output token throughput (tok/s)", result["output_tokens_per_second"])]
    if engine.config.spec.method is not None:
        result["spec"] = offline.spec_result(before, offline.spec_counters(engine))
        rows.append(("Mean acceptance length", result["spec"]["mean_acceptance_length"]))
    print_result("Throughput Benchmark Result", rows, out=sys.stdout)
    write_json(a.output_json, result)
    return 0
