"""Load client for a running `outpace serve` (or any OpenAI-compatible server): a thin wrapper of
`outpace bench serve` (outpace/bench/serve.py, where the measurement and its definitions live)
with this suite's prompt sets, timed runs (--duration) and result files.

    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --max-concurrency 16 \
        --num-prompts 200 --output-len 128 --result-file benchmarks/results/serve.json

With --start-server MODEL it is the serving suite instead (benchmarks/serve_suite.py): servers
it starts and stops itself, for each speculative config, against the offline engine on the same
prompts (`python benchmarks/serve.py --start-server MODEL --help`).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import drop_script_folder, print_table, serve_prompts, write_result  # noqa: E402,E501

drop_script_folder()

from outpace.bench.serve import ServeBenchConfig, run_benchmark  # noqa: E402
from outpace.bench.server_metrics import run_means, scrape  # noqa: E402
from outpace.errors import OutpaceError  # noqa: E402

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(x == "--start-server" or x.startswith("--start-server=") for x in argv):
        from benchmarks.serve_suite import main as suite_main
        return suite_main(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None)
    p.add_argument("--endpoint", default="chat", choices=list(ENDPOINTS))
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset", default="mtbench", choices=["mtbench", "humaneval", "random"])
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--duration", type=float, default=None, help="seconds; overrides --num-prompts")
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--no-ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-file", default=None, help="JSON path (default: print only)")
    p.add_argument("--note", default="", help="free text stored in the result (server setup)")
    a = p.parse_args(argv)
    cfg = ServeBenchConfig(base_url=a.base_url, model=a.model, endpoint=ENDPOINTS[a.endpoint],
                           api_key=a.api_key,
                           num_prompts=None if a.duration else a.num_prompts,
                           duration_s=a.duration, request_rate=a.request_rate,
                           max_concurrency=a.max_concurrency, output_len=a.output_len,
                           ignore_eos=not a.no_ignore_eos, temperature=a.temperature,
                           seed=a.seed)
    before = scrape(cfg.base_url)  # the server's own numbers over the run (outpace's only)
    try:
        s = asyncio.run(run_benchmark(cfg, serve_prompts(a.dataset, a.seed)))
    except OutpaceError as e:  # the server unreachable, or the key refused
        print(f"serve.py: error: {e}", file=sys.stderr)
        return 2
    means = run_means(before, scrape(cfg.base_url))
    phases = means.pop("server_phase_mean_ms")
    s.update(means)
    s.update({f"server_{k}_mean_ms": v for k, v in phases.items()})
    s["config"]["dataset"] = a.dataset
    if a.note:
        s["note"] = a.note
    rows = [{"metric": k, "value": f"{v:.2f}" if isinstance(v, float) else
             "" if v is None else v} for k, v in s.items() if k not in ("config", "errors")]
    print_table(rows, ["metric", "value"])
    for e in s["errors"]:
        print("error:", e, file=sys.stderr)
    if a.result_file:
        print("wrote", write_result(Path(a.result_file), s))
    return 0 if s["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
