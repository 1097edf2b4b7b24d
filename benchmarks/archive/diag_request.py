"""Where one batch-1 request's time goes beyond its graphs, on the GPU machine (SmolLM2-135M,
bf16): no-spec against EAGLE-3 force-accept 3 at k = 2.

Run 15's batch-1 rows spend ~2 ms a request more than (TTFT + steps x graph time), for both
engines; at 43 spec steps a request that is 5% of the time, at 127 no-spec steps 2.5%. This
script shows which engine steps take it:

  * host trace (no profiler attached): every engine.step() of 4 requests, classified as the
    prefill step, the first decode step, chained steps and unchained steps, with mean / total
    wall time per class against the steady graph's GPU time;
  * device timeline (torch.profiler, after the timed part): the GPU's idle gaps over one
    request, the largest listed with the kernels on either side, and the total busy time.

    python benchmarks/diag_request.py --gguf PATH [--out DIR] [--penalties 1]

--penalties 1: every request with repetition_penalty 1.1 and frequency_penalty 0.3 (the
penalized families' graphs and prefill tails, and the table fill on the host).
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import diag_setup, make_heads, run_engine  # noqa: E402
from benchmarks.common import graph_ms as gpu_ms  # noqa: E402


PENALTIES: dict = {}  # the requests' penalties (--penalties)


def traced_request(eng, prompt, max_tokens):
    """Run one request alone -> list of per-step dicts (wall us, tokens committed, kind)."""
    from outpace import SamplingParams
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                        output_kind="final_only", **PENALTIES)
    fused = eng.runner.fused
    t_add = time.perf_counter()
    eng.add_request(f"trace-{time.monotonic_ns()}", prompt, sp)
    steps = []
    while eng.has_unfinished_requests():
        inflight = eng._inflight is not None
        r0, c0 = fused.replays, fused.chained
        g0 = eng.generation_tokens_total
        t0 = time.perf_counter()
        eng.step()
        t1 = time.perf_counter()
        steps.append({"us": 1e6 * (t1 - t0), "tokens": eng.generation_tokens_total - g0,
                      "fused": fused.replays - r0, "inflight_at_start": inflight,
                      "launched_next": fused.chained - c0})
    total = time.perf_counter() - t_add
    for i, s in enumerate(steps):
        s["kind"] = ("prefill" if i == 0 and not s["fused"] else
                     "chained" if s["inflight_at_start"] else "unchained")
    return steps, 1e6 * total


def summarize(steps, total_us, graph_us):
    by = {}
    for s in steps:
        d = by.setdefault(s["kind"], {"n": 0, "us": 0.0, "tokens": 0})
        d["n"] += 1
        d["us"] += s["us"]
        d["tokens"] += s["tokens"]
    for d in by.values():
        d["mean_us"] = round(d["us"] / d["n"], 1)
        d["us"] = round(d["us"], 1)
    decode = sum(s["us"] for s in steps[1:])
    n_dec = len(steps) - 1
    return {"total_us": round(total_us, 1), "steps": len(steps), "by_kind": by,
            "decode_us": round(decode, 1), "decode_steps_x_graph_us": round(n_dec * graph_us, 1),
            "decode_excess_us": round(decode - n_dec * graph_us, 1),
            "sequence": [f"{s['kind'][0]}{s['tokens']}:{s['us']:.0f}" for s in steps]}


def device_gaps(eng, prompt, max_tokens, top: int = 15):
    """GPU idle gaps over one request (profiled): total busy / span, the largest gaps."""
    from benchmarks.archive.diag_step import profiled_requests
    evs = profiled_requests(eng, [prompt], max_tokens)
    if not evs:
        return {"error": "no device events"}
    gaps, end, busy_end, idle = [], evs[0].time_range.end, evs[0].time_range.end, 0.0
    prev = evs[0]
    for e in evs[1:]:
        if e.time_range.start > busy_end:
            gap = e.time_range.start - busy_end
            idle += gap
            gaps.append((gap, prev.name[:60], e.name[:60], e.time_range.start - evs[0].time_range.start))
        if e.time_range.end > busy_end:
            busy_end, prev = e.time_range.end, e
        end = max(end, e.time_range.end)
    span = end - evs[0].time_range.start
    gaps.sort(reverse=True)
    hist = {f">{lo}us": round(sum(g for g, *_ in gaps if g > lo), 1) for lo in (2, 5, 20, 100)}
    return {"span_us": round(span, 1), "idle_us": round(idle, 1), "idle_by_size": hist,
            "largest": [{"gap_us": round(g, 1), "after": a, "before": b, "at_us": round(t, 1)}
                        for g, a, b, t in gaps[:top]]}


def prefill_phases(eng, prompts, reps: int = 3) -> dict:
    """Host us per phase of add_request and the engine step that runs a batch-1 prefill (no
    profiler: wrapped methods, nested ones counted in their callers too). FusedStep.collect
    waits for the prefill graph and its tail on the device."""
    from benchmarks.archive.diag_step import PhaseTimer
    from outpace import SamplingParams
    from outpace.engine.engine import LLMEngine
    from outpace.runner.cuda_graph import GraphRunner
    from outpace.runner.fused_step import FusedStep
    from outpace.attention.inputs import InputBuffers, Segment
    from outpace.scheduler.scheduler import Scheduler
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True,
                        output_kind="final_only", **PENALTIES)
    timer = PhaseTimer()
    wrapped = [(LLMEngine, "add_request"), (Scheduler, "schedule"),
               (type(eng.runner), "can_launch"), (type(eng.runner), "_host_batch"),
               (FusedStep, "launch_prefill"), (GraphRunner, "load_padded"),
               (InputBuffers, "stage"), (Segment, "copy"), (torch.cuda.CUDAGraph, "replay"),
               (FusedStep, "_replay"), (LLMEngine, "_chain"),
               (FusedStep, "_fill_penalty_tables"), (FusedStep, "_mode_rows"),
               (FusedStep, "collect"), (LLMEngine, "_commit")]
    n, first = 0, 0.0
    for _ in range(reps):
        for p in prompts:
            torch.cuda.synchronize()
            for cls, fn in wrapped:  # timed over the request's prefill step only
                timer.wrap(cls, fn)
            try:
                eng.add_request(f"phases-{time.monotonic_ns()}", p, sp)
                t = time.perf_counter()
                eng.step()  # the prefill step (it chains the first decode step)
                first += time.perf_counter() - t
            finally:
                timer.restore()
            n += 1
            while eng.has_unfinished_requests():
                eng.step()
    # Replaying the prefill graph here would read whatever its buffers last held (a decode
    # step's logits index is out of its rows): its GPU time is the collect's wait instead.
    return {"prefill_steps": n, "first_step_us": round(1e6 * first / n, 1),
            "host_us_per_prefill": {k: round(1e6 * v / n, 1) for k, v in sorted(timer.t.items())},
            "prefill_q": eng.runner.graphs.prefill_q_for(len(prompts[0]))}


def prefill_profile(eng, prompts, reps: int = 5, top: int = 40) -> dict:
    """cProfile over batch-1 prefill steps (add_request and the step that runs the prefill):
    the host functions with the most own time and the most cumulative time, in us a prefill
    (cProfile's own overhead inflates many small calls; read it for where, not how much)."""
    import cProfile
    import pstats
    from outpace import SamplingParams
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True,
                        output_kind="final_only", **PENALTIES)
    prof, n = cProfile.Profile(), 0
    for _ in range(reps):
        for p in prompts:
            torch.cuda.synchronize()
            prof.enable()
            eng.add_request(f"profile-{time.monotonic_ns()}", p, sp)
            eng.step()
            prof.disable()
            n += 1
            while eng.has_unfinished_requests():
                eng.step()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, ...)

    def rows(key):
        order = sorted(stats.items(), key=lambda kv: -kv[1][key])[:top]
        return [{"fn": f"{Path(f).name}:{line}:{name}", "calls": nc / n,
                 "tot_us": round(1e6 * tt / n, 1), "cum_us": round(1e6 * ct / n, 1)}
                for (f, line, name), (cc, nc, tt, ct, _) in order]
    return {"prefills": n, "by_own_time": rows(2), "by_cumulative": rows(3)}


def main():
    args, loaded, prompts = diag_setup(6, extra=(("--max-tokens", "128"), ("--penalties", "0")))
    if args.penalties != "0":
        PENALTIES.update(repetition_penalty=1.1, frequency_penalty=0.3)
    from outpace.engine.engine import LLMEngine
    max_tokens = int(args.max_tokens)
    eagle, _ = make_heads(args.gguf, tempfile.mkdtemp())
    configs = [("no-spec", None, 0),
               ("eagle3-fa3-k2", {"method": "eagle3", "model": str(eagle),
                                  "num_speculative_tokens": 2, "force_accept_mean": 3.0}, 2)]
    report = {}
    engines = []
    for name, spec, k in configs:
        eng = LLMEngine.from_args(args.gguf, loaded=loaded, device="cuda", dtype="bfloat16",
                                  speculative_config=spec, max_num_seqs=8, num_kv_blocks=2048,
                                  quiet=True, enable_prefix_caching=False)
        # every prompt once (a penalized family's prefill tail is captured per prefill graph
        # when first needed), then two at full length
        run_engine(eng, prompts, 1, 16, penalties=PENALTIES or None)
        run_engine(eng, prompts[:2], 1, max_tokens, penalties=PENALTIES or None)
        g, _ = eng.runner.fused._captured[(1, k + 1, k, True)]
        graph_us = 1000 * gpu_ms(g)
        reqs = []
        for p in prompts[2:6]:
            steps, total = traced_request(eng, p, max_tokens)
            reqs.append(summarize(steps, total, graph_us))
        report[name] = {"graph_us": round(graph_us, 1), "prompt_tokens": [len(p) for p in prompts[2:6]],
                        "requests": reqs}
        print(name, json.dumps({k_: v for k_, v in reqs[0].items() if k_ != "sequence"}),
              flush=True)
        print("  sequence", " ".join(reqs[0]["sequence"]), flush=True)
        report[name]["prefill_phases"] = ph = prefill_phases(eng, prompts[2:6])
        print(name, "prefill", json.dumps(ph), flush=True)
        report[name]["prefill_profile"] = pp = prefill_profile(eng, prompts[2:6])
        for key in ("by_cumulative", "by_own_time"):
            print(name, key)
            for r in pp[key][:30]:
                print(f"  {r['cum_us']:9.1f} {r['tot_us']:9.1f} {r['calls']:6.1f}  {r['fn']}")
        engines.append((name, eng))
    # profiled last (CUPTI stays attached and slows later launches)
    for name, eng in engines:
        report[name]["device"] = gaps = device_gaps(eng, prompts[2], max_tokens)
        print(name, "device", json.dumps(gaps), flush=True)
    name = "diag_request_penalized.json" if PENALTIES else "diag_request.json"
    (Path(args.out) / name).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
