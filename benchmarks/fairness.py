"""Fairness on the CPU: how long a long prompt stalls a stream that is decoding beside it.

    python benchmarks/fairness.py [--caps default 0 64 32 16] [--reps 3] [--prompt-tokens 2500]

One stream decodes (greedy, EOS ignored) in an LLMEngine on the CPU (the default model,
smollm2-135m, and otherwise the engine's default settings); after its --before-th token a
prompt of --prompt-tokens tokens arrives. The stream's gaps between tokens are timed: its
median gap over the tokens before the arrival (its normal gap), and its worst gap from the
arrival until the long prompt's first token and --after tokens more. The ratio worst / median
is what issue 36 bounds (3x). Each --max-prefill-with-decodes value in --caps (`default`: the
builder's default, whatever it is) gets a fresh engine over the same loaded weights, --reps
times, the values in turns within each repetition (a shared machine's load then falls on all of
them alike). The long prompt is random token ids, different in every run (no prefix-cache hit).
Also reported: the long prompt's time to its first token (the price of a bound).

Writes benchmarks/results/latest/cpu_fairness.json (--out: a folder or a .json file).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (  # noqa: E402
    HERE, device_name, drop_script_folder, out_file, print_table, write_result)


def one_run(engine, cap_label, rep: int, seed: int, a) -> dict:
    """The stream, the long prompt's arrival, the gaps -> one row of the result. cap_label
    "none": the control, no prompt arrives and the stream is timed for --control-tokens more."""
    from outpace import SamplingParams

    control = cap_label == "none"
    vocab = engine.vocab_size
    stream, long_id = f"stream-{cap_label}-{rep}", f"long-{cap_label}-{rep}"
    g = torch.Generator().manual_seed(seed)
    stream_prompt = torch.randint(0, vocab, (a.stream_prompt_tokens,), generator=g).tolist()
    long_prompt = torch.randint(0, vocab, (a.prompt_tokens,), generator=g).tolist()
    budget = a.before + a.after + max(a.prompt_tokens, a.control_tokens)  # (a bound of 1 ends)
    engine.add_request(stream, stream_prompt,
                       SamplingParams(max_tokens=budget, temperature=0.0, ignore_eos=True))
    # each stream token's wall time and the engine thread's CPU time (torch's calling thread
    # takes its share of every parallel op and sleeps at the barrier: its CPU time is about
    # the step's wall time on an idle machine, whoever else holds the cores)
    times, cpu_times, arrival, long_first = [], [], None, None
    n_before = n_first = steps = steps_to_first = 0
    while True:
        count = len(times)
        outs = engine.step()
        now, cpu_now = time.perf_counter(), time.thread_time()
        steps += 1
        for o in outs:
            if o.request_id == stream:
                new = len(o.token_ids) - len(times)
                times.extend([now] * new)
                cpu_times.extend([cpu_now] * new)
            elif o.request_id == long_id and long_first is None and o.token_ids:
                long_first, n_first, steps_to_first = now, count, steps
        if arrival is None and len(times) >= a.before:
            arrival, n_before, steps = time.perf_counter(), len(times), 0
            if control:
                long_first, n_first = arrival, n_before
            else:
                engine.add_request(long_id, long_prompt,
                                   SamplingParams(max_tokens=4, temperature=0.0,
                                                  ignore_eos=True))
        if long_first is not None and \
                len(times) >= n_first + (a.control_tokens if control else a.after):
            break
    engine.abort_request(stream)
    if not control:
        engine.abort_request(long_id)

    def gaps_of(ts):
        gaps = [(t1 - t0) * 1e3 for t0, t1 in zip(ts, ts[1:])]
        # the first gap before: from the stream's prefill (its first token) to its first decode
        normal = statistics.median(gaps[1:n_before - 1])
        return normal, gaps[n_before - 1:]  # after: from the last token before the arrival on

    normal, after = gaps_of(times)
    cpu_normal, cpu_after = gaps_of(cpu_times)
    during = after if control else after[:max(n_first - n_before + 1, 1)]
    return {"max_prefill_with_decodes": cap_label, "rep": rep,
            "median_gap_ms": round(normal, 2), "worst_gap_ms": round(max(after), 2),
            "ratio": round(max(after) / normal, 2),
            "mean_gap_during_prefill_ms": round(statistics.mean(during), 2),
            "p90_gap_during_prefill_ms": round(_percentile(during, 0.9), 2),
            "cpu_ratio": round(max(cpu_after) / cpu_normal, 2),
            "long_ttft_s": None if control else round(long_first - arrival, 3),
            "steps_to_long_first": None if control else steps_to_first}


def _percentile(xs: list, q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)]


def build(loaded, model: str, cap):
    from outpace import LLMEngine
    kw = {} if cap in ("default", "none") else {"max_prefill_with_decodes": cap}
    return LLMEngine.from_args(model, device="cpu", loaded=loaded, quiet=True, **kw)


def main():
    drop_script_folder()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="catalog name, .gguf or HF folder")
    ap.add_argument("--caps", nargs="+", default=["none", "default", "0", "32", "16"],
                    help="--max-prefill-with-decodes values; 'default': the builder's default; "
                    "'none': the control (the default engine, no prompt arrives)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=2500)
    ap.add_argument("--stream-prompt-tokens", type=int, default=32)
    ap.add_argument("--before", type=int, default=24,
                    help="stream tokens before the long prompt arrives (its normal gap)")
    ap.add_argument("--after", type=int, default=4,
                    help="stream tokens timed after the long prompt's first token")
    ap.add_argument("--control-tokens", type=int, default=150,
                    help="the control's stream tokens timed after the arrival point")
    ap.add_argument("--threads", type=int, default=None, help="torch's CPU threads")
    ap.add_argument("--out", default=str(HERE / "results" / "latest"))
    a = ap.parse_args()
    caps = []
    for c in a.caps:
        if c not in ("default", "none") and not c.isdigit():
            ap.error(f"--caps takes non-negative integers, 'default' or 'none', got {c!r}")
        caps.append(c if c in ("default", "none") else int(c))
    if a.before < 4:
        ap.error("--before must be at least 4 (the normal gap is their median)")
    if a.threads:
        torch.set_num_threads(a.threads)

    from outpace.engine.builder import default_prefill_with_decodes
    from outpace.models.catalog import resolve_model
    from outpace.models.loader import load_model
    path = resolve_model(a.model, quiet=True)
    loaded = load_model(str(path), dtype=torch.float32, device=torch.device("cpu"), quiet=True)
    default_cap = default_prefill_with_decodes(torch.device("cpu"))

    # Warm-up (first calls of the large shapes allocate and pick kernels): one run, not kept.
    engine = build(loaded, a.model, 0)
    one_run(engine, "warm-up", 0, 0, a)
    del engine
    rows = []
    for rep in range(a.reps):
        for i, cap in enumerate(caps):
            engine = build(loaded, a.model, cap)
            row = one_run(engine, cap, rep, 1 + rep * len(caps) + i, a)
            if cap == "default":
                row["max_prefill_with_decodes"] = f"default ({default_cap})"
            rows.append(row)
            print(row, flush=True)
            del engine
            gc.collect()

    summary = []
    for cap in caps:
        label = f"default ({default_cap})" if cap == "default" else cap
        mine = [r for r in rows if r["max_prefill_with_decodes"] == label]
        ratios = sorted(r["ratio"] for r in mine)
        ttft = [r["long_ttft_s"] for r in mine if r["long_ttft_s"] is not None]
        summary.append({
            "max_prefill_with_decodes": label,
            "median_gap_ms": round(statistics.median(r["median_gap_ms"] for r in mine), 1),
            "worst_gap_ms": round(statistics.median(r["worst_gap_ms"] for r in mine), 1),
            "ratio_median": round(statistics.median(ratios), 2),
            "ratio_min": ratios[0], "ratio_max": ratios[-1],
            "p90_gap_during_prefill_ms": round(statistics.median(
                r["p90_gap_during_prefill_ms"] for r in mine), 1),
            "cpu_ratio_median": round(statistics.median(r["cpu_ratio"] for r in mine), 2),
            "cpu_ratio_max": max(r["cpu_ratio"] for r in mine),
            "long_ttft_s": round(statistics.median(ttft), 2) if ttft else None})
    cols = ["max_prefill_with_decodes", "median_gap_ms", "worst_gap_ms", "ratio_median",
            "ratio_min", "ratio_max", "p90_gap_during_prefill_ms", "cpu_ratio_median",
            "cpu_ratio_max", "long_ttft_s"]
    print_table(summary, cols)
    path = write_result(out_file(a.out, "cpu_fairness.json"), {
        "benchmark": "cpu_fairness", "device": device_name("cpu"),
        "threads": torch.get_num_threads(), "model": a.model, "dtype": "float32",
        "prompt_tokens": a.prompt_tokens, "stream_prompt_tokens": a.stream_prompt_tokens,
        "before": a.before, "after": a.after, "reps": a.reps,
        "default_max_prefill_with_decodes_cpu": default_cap,
        "summary": summary, "runs": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
