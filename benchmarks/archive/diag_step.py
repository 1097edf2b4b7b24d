"""Where a fused decode step's time goes, on the GPU machine (SmolLM2-135M, bf16):

  * batch 1: the kernels of one chained step in the middle of a real request, in order, with
    durations and the idle gaps between them (no-spec q=1, EAGLE-3 force-accept 3 at k=2 with the full
    and a 32000-id draft vocabulary, and at k=4), and the host cost of launching each graph
    (cudaGraphLaunch, GPU busy and idle);
  * batch 128: host time per engine step split by phase (schedule, launch, chain, collect,
    commit with detokenization) for no-spec against EAGLE-3 (one draft there, the benchmark's
    k schedule), chained vs launched steps, the GPU time of the graph that steady decoding
    there replays, and the kernels of a step in the middle of 128 requests.
The graph times (replays in a loop) move each sequence on past its blocks, EAGLE-3's three
tokens a replay against no-spec's one, so they compare longer contexts for the spec graphs;
the listings come from real requests.

    python benchmarks/diag_step.py --gguf PATH [--out DIR]
"""
from __future__ import annotations

import collections
import functools
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import graph_ms as gpu_ms  # noqa: E402
from benchmarks.common import diag_setup, make_eagle3_reduced, make_heads  # noqa: E402
from benchmarks.common import run_engine  # noqa: E402


def format_listing(events) -> str:
    """Device events in start order -> a listing: us, gap before, name; with a summary line."""
    lines, prev_end, busy = [], None, 0.0
    for e in events:
        gap = 0.0 if prev_end is None else e.time_range.start - prev_end
        dur = e.time_range.end - e.time_range.start
        busy += dur
        lines.append(f"{dur:8.2f} {gap:6.2f}  {e.name[:90]}")
        prev_end = e.time_range.end
    span = events[-1].time_range.end - events[0].time_range.start
    head = (f"{len(events)} kernels, span {span:.1f} us, busy {busy:.1f} us, "
            f"gaps {span - busy:.1f} us (us: duration, gap before)")
    return head + "\n" + "\n".join(lines)


def profiled_requests(eng, prompts, max_tokens: int) -> list:
    """Run greedy requests for prompts (submitted at once) to the end under torch.profiler
    -> their device events in start order."""
    from torch.profiler import ProfilerActivity, profile
    from outpace import SamplingParams
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                        output_kind="final_only")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i, p in enumerate(prompts):
            eng.add_request(f"profiled-{i}-{time.monotonic_ns()}", p, sp)
        while eng.has_unfinished_requests():
            eng.step()
        torch.cuda.synchronize()
    return sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                  key=lambda e: e.time_range.start)


def split_steps(evs) -> list:
    """Device events in start order -> groups, one per chained step (a chained step starts with
    the kernel that makes its inputs from the carry); the first group is everything before the
    first chained step (the prefill and its tail)."""
    steps, cur = [], []
    for e in evs:
        if e.name.startswith("_chained_inputs_kernel") and cur:
            steps.append(cur)
            cur = []
        cur.append(e)
    steps.append(cur)
    return steps


def request_listing(eng, prompts, max_tokens: int = 128) -> str:
    """The kernels of one chained step in the middle of real requests, all submitted at once
    (profiled; one prompt: batch 1).
    Not the captured graph replayed in a loop: each replay moves the sequence on by its
    accepted tokens past the blocks the request holds (up to run 20 the listings' EAGLE-3
    attention read a 754-token context, 29 of its blocks the null block, against no-spec's
    434), so replayed listings compare different contexts."""
    steps = split_steps(profiled_requests(eng, prompts, max_tokens))
    mid = len(steps) // 2
    # the first group: everything before the first chained step (the prefill and its tail)
    by_name = collections.Counter()
    for e in steps[0]:
        by_name[e.name[:60]] += e.time_range.end - e.time_range.start
    prefill = format_listing(steps[0]).splitlines()[0]
    top = ", ".join(f"{n} {us:.1f}" for n, us in by_name.most_common(8))
    gaps = sorted(((b.time_range.start - a.time_range.end, a.name[:40], b.name[:40])
                   for a, b in zip(steps[0], steps[0][1:])), reverse=True)[:10]
    top += "\n    largest gaps (us, after, before): " + "; ".join(
        f"{g:.0f} {a} | {b}" for g, a, b in gaps)
    return (f"  step {mid} of {len(steps)} ({len(prompts)} prompts, the first "
            f"{len(prompts[0])} tokens, max_tokens {max_tokens})\n" + format_listing(steps[mid])
            + f"\n  before the first chained step (prefill): {prefill}\n    by kernel (us): {top}")


def prefill_trace(eng, prompt, path: Path) -> None:
    """A Chrome trace (host and device) of a batch-1 request's first two engine steps: its
    prefill, and the step that launches the first decode step from it; then the rest."""
    from torch.profiler import ProfilerActivity, profile
    from outpace import SamplingParams
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                        output_kind="final_only")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        eng.add_request(f"trace-{time.monotonic_ns()}", prompt, sp)
        for _ in range(2):
            eng.step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))
    while eng.has_unfinished_requests():
        eng.step()


def launch_cost(graph, reps: int = 50) -> dict:
    """Host us per graph.replay(): back to back (the GPU busy, as when chained), and one at a
    time after a synchronize (the GPU idle)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    busy = (time.perf_counter() - t) / reps
    torch.cuda.synchronize()
    idle = 0.0
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        graph.replay()
        idle += time.perf_counter() - t
    torch.cuda.synchronize()
    return {"busy_us": round(1e6 * busy, 1), "idle_us": round(1e6 * idle / reps, 1)}


class PhaseTimer:
    """Host seconds per engine phase (monkeypatched wrappers) and calls. Nothing synchronizes
    unless `sync`: then the device is synchronized before and after each call, so a phase's
    time includes its GPU work (nested calls are counted in their callers too)."""

    def __init__(self, sync: bool = False):
        self.t = collections.Counter()
        self.n = collections.Counter()
        self.sync = sync and torch.cuda.is_available()
        self.patched = []

    def wrap(self, cls, name):
        inner = getattr(cls, name)

        @functools.wraps(inner)
        def timed(*a, **k):
            if self.sync:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                if self.sync:
                    torch.cuda.synchronize()
                self.t[f"{cls.__name__}.{name}"] += time.perf_counter() - t0
                self.n[f"{cls.__name__}.{name}"] += 1
        setattr(cls, name, timed)
        self.patched.append((cls, name, inner))

    def restore(self):
        for cls, name, inner in reversed(self.patched):
            setattr(cls, name, inner)
        self.patched = []


def main():
    args, loaded, prompts = diag_setup(128, extra=(
        ("--configs", ""),  # a comma-separated subset of the configurations below
        ("--batch1-only", "0"),  # 1: skip the batch-128 phases
        ("--no-pdl", "0"),  # 1: kernels launched without PDL (each listed kernel's time is
        # then its own, not overlapped with its neighbours')
        ("--dtype", "bfloat16"),  # the engines' activation dtype ...
        ("--weight-dtype", "auto"),  # ... and weights' (float32 + bfloat16: the mixed mode)
        ("--kv-cache-dtype", "auto")))  # ... and KV pool's
    # The model diag_setup loaded (bf16) serves only the default precision.
    if (args.dtype, args.weight_dtype) not in (("bfloat16", "auto"), ("bfloat16", "bfloat16")):
        loaded = None
    if args.no_pdl == "1":
        import outpace.kernels.pdl as pdl
        pdl.ENABLED = False
    from outpace.engine.engine import LLMEngine
    from outpace.runner.fused_step import FusedStep
    from outpace.scheduler.scheduler import Scheduler
    tmp = tempfile.mkdtemp()
    eagle, _ = make_heads(args.gguf, tmp)
    eagle_dv = make_eagle3_reduced(args.gguf, tmp)
    # the benchmark's schedule (bench_gpu.smol_configs): one draft at 65-128 requests
    configs = [("no-spec", None, 0),
               ("eagle3-fa3-k2", {"method": "eagle3", "model": str(eagle),
                                  "num_speculative_tokens": 2, "force_accept_mean": 3.0,
                                  "k_schedule": [[32, 2], [128, 1]]}, 2),
               ("eagle3-dv32k-fa3-k2", {"method": "eagle3", "model": str(eagle_dv),
                                        "num_speculative_tokens": 2, "force_accept_mean": 3.0,
                                        "k_schedule": [[32, 2], [128, 1]]}, 2),
               ("eagle3-fa3.0", {"method": "eagle3", "model": str(eagle),
                                 "num_speculative_tokens": 4, "force_accept_mean": 3.0,
                                 "k_schedule": [[32, 4], [128, 1]]}, 4)]
    if args.configs:
        configs = [c for c in configs if c[0] in args.configs.split(",")]
    report, listings = [], []  # (report line, config, prompts, their engine kept alive)
    out = Path(args.out)
    for name, spec, k in configs:
        eng = LLMEngine.from_args(args.gguf, loaded=loaded, device="cuda", dtype=args.dtype,
                                  weight_dtype=args.weight_dtype,
                                  kv_cache_dtype=args.kv_cache_dtype,
                                  speculative_config=spec, max_num_seqs=128, num_kv_blocks=8192,
                                  quiet=True, enable_prefix_caching=False)
        for b in (1,) if args.batch1_only == "1" else (1, 128):
            run_engine(eng, prompts[:max(b, 2)], b, 8)
        r1 = run_engine(eng, prompts[:4], 1, 128)
        fused = eng.runner.fused
        g1, _ = fused._captured[(1, k + 1, k, True)]
        report.append(f"== {name} batch 1: tok/s {r1['tok_s']} tpot {r1['tpot_ms']} ms, "
                      f"step {r1.get('step_ms')} launch {r1.get('launch_ms')} wait "
                      f"{r1.get('wait_ms')} unpack {r1.get('unpack_ms')}; chained graph "
                      f"(1, {k + 1}, {k}): {gpu_ms(g1)} ms, launch {launch_cost(g1)}")
        listings.append((len(report), name, prompts[:1], eng))
        if name.endswith("-k2") or args.batch1_only == "1":
            continue
        # batch 128: phases of the host's step
        timer = PhaseTimer()
        for cls, fn in [(Scheduler, "schedule"), (Scheduler, "schedule_chained"),
                        (Scheduler, "update"), (FusedStep, "launch"), (FusedStep, "chain"),
                        (FusedStep, "collect"), (FusedStep, "_result"),
                        (LLMEngine, "_chain"), (LLMEngine, "_commit"),
                        (LLMEngine, "_output_of"), (type(eng.runner), "_host_batch"),
                        (type(eng.runner), "execute")]:
            timer.wrap(cls, fn)
        c0 = fused.chained
        r = run_engine(eng, prompts[:128], 128, 128)
        timer.restore()
        steps = r["all_steps"]
        kb = fused.draft_steps(128)
        key = (128, kb + 1, kb, True)
        g128, _ = fused._captured[key]
        report.append(f"== {name} batch 128: tok/s {r['tok_s']} tpot {r['tpot_ms']} ttft "
                      f"{r['ttft_ms']} step {r['step_ms']} ms; steps {steps}, fused "
                      f"{r['fused_steps']}, chained {fused.chained - c0}; graph {key[:3]} "
                      f"{gpu_ms(g128)} ms, launch {launch_cost(g128)}")
        report.append("  host ms per step: " + ", ".join(
            f"{key} {1000 * v / steps:.3f}" for key, v in sorted(timer.t.items())))
        listings.append((len(report), name, prompts[:128], eng))
        del eng
    # The kernel listings last: once torch.profiler has run, CUPTI stays attached and every
    # later launch costs more on the host (run 10's batch-128 and EAGLE-3 rows were timed so).
    for at, name, listed, eng in reversed(listings):
        report.insert(at, request_listing(eng, listed))
        if len(listed) == 1:
            prefill_trace(eng, listed[0], out / f"prefill_trace_{name}.json")
    del listings
    text = "\n".join(report)
    print(text)
    (out / "diag_step.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
