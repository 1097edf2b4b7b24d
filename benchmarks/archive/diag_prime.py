"""What the PDL prime before host-replayed graphs does to TTFT and tok/s, on the GPU machine.

Run 34's bench gave the "@noprime" arms (kernels/pdl.PRIME off) a lower batch-1 tok/s for
EAGLE-3 (4186 against 4660) but a lower TTFT too (1.44 ms against 1.77 at batch 1, 6.3
against 7.9 at batch 32), while no-spec's TTFT was lower with the prime. Those were separate
engines timed minutes apart. Here one engine per configuration is timed with the prime on
and off in alternating order, round by round (pdl.PRIME is read at every replay), so both
arms share the engine, its graphs and the host's moment:

  * per (config, prime, batch): the median over rounds of tok/s, TTFT and TPOT.

  * first, the host's cost of one prime (pdl.prime) against one small torch kernel launch;
  * with --graphs 1, instead of the requests: the GPU time of single graph replays (prefill,
    varlen and the batch-1 fused step's graphs) right after an eager torch kernel, with and
    without a prime between them.

    python benchmarks/diag_prime.py --gguf PATH [--out DIR] [--rounds 5] [--graphs 1]
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import diag_setup, make_heads, run_engine  # noqa: E402
from benchmarks.throughput import smol_configs  # noqa: E402
from outpace.kernels import pdl  # noqa: E402

BATCHES = (1, 8, 32)
# The arms: the graph kinds not primed (pdl.PRIME_SKIP); None: no prime at all. "default":
# the engine's own PRIME_SKIP (since run 34: steps and prefill graphs primed; named
# "step+prefill" in diag_prime_run34_sites.json)
ARMS = {"all": frozenset(), "default": pdl.PRIME_SKIP,
        "step": frozenset({"prefill", "varlen", "head", "plain"}), "none": None}
MAX_TOKENS = 128


def host_us(fn, n: int = 2000) -> float:
    """Median host microseconds of fn() over 5 batches of n calls (the device drained first)."""
    import torch
    fn()
    per = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        per.append(1e6 * (time.perf_counter() - t0) / n)
        torch.cuda.synchronize()
    return round(statistics.median(per), 2)


def after_eager_ms(graph, prime: bool, x, reps: int = 30) -> float:
    """Median GPU ms of [a one-element fill (eager torch), a prime if asked, graph.replay()],
    each alone on the stream (the prime's own ~2 us included)."""
    import torch
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        x.fill_(1.0)
        if prime:
            pdl.prime(x.device)
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return round(statistics.median(times), 4)


def graph_times(eng, x) -> dict:
    """after_eager_ms of an engine's prefill, varlen and batch-1 fused graphs, prime on / off
    alternating -> {graph: {"prime": ms, "noprime": ms}}."""
    from benchmarks.common import fused_graphs
    g = eng.runner.graphs
    graphs = {f"prefill_q{q}": g.prefill_graphs[q][0] for q in (16, 64, 256)
              if q in g.prefill_graphs}
    graphs.update({f"varlen_t{t}": g.varlen_graphs[t][0] for t in (64, 256, 1024)
                   if t in g.varlen_graphs})
    fused = fused_graphs(eng)  # the greedy graphs
    graphs.update({f"fused_{k}": v[0] for k, v in fused.items() if k[0] == 1})
    out = {}
    for name, graph in graphs.items():
        runs = {"prime": [], "noprime": []}
        for rnd in range(4):
            for prime in ((True, False) if rnd % 2 == 0 else (False, True)):
                runs["prime" if prime else "noprime"].append(after_eager_ms(graph, prime, x))
        out[name] = {k: statistics.median(v) for k, v in runs.items()}
        print(name, out[name], flush=True)
    return out


def main():
    args, loaded, prompts = diag_setup(32, (("--rounds", "5"), ("--graphs", "0")))
    import torch
    from outpace.engine.engine import LLMEngine
    dev = torch.device("cuda")
    x = torch.zeros(1, device=dev)
    out = {"host_us": {"prime": host_us(lambda: pdl.prime(dev)),
                       "torch_fill": host_us(lambda: x.fill_(1.0))}}
    print(out, flush=True)
    eagle, mtp = make_heads(args.gguf, tempfile.mkdtemp())
    configs = {name: spec for name, spec in smol_configs(2, [3.0], eagle, mtp)
               if name in ("no-spec", "eagle3-fa3-k2")}  # the benchmark's configurations
    default_skip = pdl.PRIME_SKIP
    for name, spec in configs.items():
        eng = LLMEngine.from_args(args.gguf, loaded=loaded, device="cuda", dtype="bfloat16",
                                  speculative_config=spec, max_num_seqs=max(BATCHES),
                                  num_kv_blocks=4096, quiet=True, enable_prefix_caching=False)
        for b in BATCHES:  # warm-up (Triton compiles, graphs captured)
            run_engine(eng, prompts[:b if b > 1 else 4], b, MAX_TOKENS)
        if args.graphs != "0":
            out[name] = graph_times(eng, x)
            del eng
            continue
        runs = {(a, b): [] for a in ARMS for b in BATCHES}
        for rnd in range(int(args.rounds)):
            shift = rnd % len(ARMS)
            for arm in list(ARMS)[shift:] + list(ARMS)[:shift]:
                pdl.PRIME = ARMS[arm] is not None
                pdl.PRIME_SKIP = ARMS[arm] or frozenset()
                for b in BATCHES:
                    r = run_engine(eng, prompts[:b if b > 1 else 4], b, MAX_TOKENS)
                    runs[(arm, b)].append({k: r[k] for k in ("tok_s", "ttft_ms", "tpot_ms")})
        pdl.PRIME, pdl.PRIME_SKIP = True, default_skip
        med = statistics.median
        out[name] = {f"{a}_b{b}": {k: med(x[k] for x in v) for k in ("tok_s", "ttft_ms",
                                                                      "tpot_ms")} | {"runs": v}
                     for (a, b), v in runs.items()}
        for key, v in out[name].items():
            print(name, key, {k: v[k] for k in ("tok_s", "ttft_ms", "tpot_ms")}, flush=True)
        del eng
    path = Path(args.out) / "diag_prime.json"
    path.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
