"""Where a fused decode step's time goes, on the GPU machine (SmolLM2-135M, bf16):

  * batch 1: the kernels of one replay of each engine's steady graph, in order, with durations
    and the idle gaps between them (no-spec q=1, EAGLE-3 force-accept 3 at k=2 with the full
    and a 32000-id draft vocabulary, and at k=4), and the host cost of launching each graph
    (cudaGraphLaunch, GPU busy and idle);
  * batch 128: host time per engine step split by phase (schedule, launch, chain, collect,
    commit with detokenization) for no-spec against EAGLE-3 (one draft there, the benchmark's
    k schedule), chained vs launched steps, and the GPU time of the graph that steady
    decoding there replays.

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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_gpu import graph_ms as gpu_ms  # noqa: E402
from benchmarks.bench_gpu import diag_setup, make_eagle3_reduced, make_heads  # noqa: E402
from benchmarks.bench_gpu import run_engine  # noqa: E402


def kernel_listing(graph, reps: int = 5, flush_mb: int = 0) -> str:
    """The kernels of the last of `reps` replays, in start order: name, us, gap before.
    flush_mb: before each replay read that many MB of another buffer (then a pause), so the
    replay starts with an L2 holding none of what the previous replay left there."""
    from torch.profiler import ProfilerActivity, profile
    flush = torch.empty(flush_mb << 19, dtype=torch.bfloat16, device="cuda").fill_(1)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            if flush_mb:
                flush.sum(dtype=torch.float32)
                torch.cuda.synchronize()
                time.sleep(0.002)  # a gap the replay split below sees
            graph.replay()
            torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    evs.sort(key=lambda e: e.time_range.start)
    # Split into replays at the big gaps the synchronizes leave; keep the last replay.
    groups, cur = [], []
    for e in evs:
        if cur and e.time_range.start - cur[-1].time_range.end > 30:
            groups.append(cur)
            cur = []
        cur.append(e)
    groups.append(cur)
    last = groups[-1]
    lines, prev_end, busy = [], None, 0.0
    for e in last:
        gap = 0.0 if prev_end is None else e.time_range.start - prev_end
        dur = e.time_range.end - e.time_range.start
        busy += dur
        lines.append(f"{dur:8.2f} {gap:6.2f}  {e.name[:90]}")
        prev_end = e.time_range.end
    span = last[-1].time_range.end - last[0].time_range.start
    head = (f"{len(last)} kernels, span {span:.1f} us, busy {busy:.1f} us, "
            f"gaps {span - busy:.1f} us (us: duration, gap before)")
    return head + "\n" + "\n".join(lines)


def attention_inputs(eng) -> str:
    """The first sequence's attention inputs as the last replay left them: query tokens, KV
    length, the block table's used entries, and the split-KV factor the backend picks."""
    import math
    import types
    buf = eng.runner.fused.inputs
    qsl = buf.query_start_loc[:2].tolist()
    seq = int(buf.seq_lens[0])
    table = buf.block_tables[0, :math.ceil(seq / eng.runner.block_size)].tolist()
    # num_splits_for reads only these two fields of the metadata
    meta = types.SimpleNamespace(max_query_len=qsl[1] - qsl[0], seq_lens=buf.seq_lens[:1])
    splits = eng.runner.backend.num_splits_for(meta, eng.runner.model_cfg.num_attention_heads)
    return (f"  attention inputs: q_len {qsl[1] - qsl[0]}, seq_len {seq}, splits {splits}, "
            f"pool {tuple(eng.runner.kv_cache.shape)}, blocks {table}")


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
    """Host seconds per engine phase (monkeypatched wrappers; nothing synchronizes)."""

    def __init__(self):
        self.t = collections.Counter()
        self.patched = []

    def wrap(self, cls, name):
        inner = getattr(cls, name)

        @functools.wraps(inner)
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                self.t[f"{cls.__name__}.{name}"] += time.perf_counter() - t0
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
        ("--kv-cache-dtype", "auto"),  # ... and KV pool's
        ("--flush-mb", "0")))  # > 0: each listed replay starts L2-cold (kernel_listing)
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
    report, listings = [], []  # listings: (report line, graph, its engine kept alive)
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
        listings.append((len(report), g1, eng))
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
        listings.append((len(report), g128, eng))
        del eng
    # The kernel listings last: once torch.profiler has run, CUPTI stays attached and every
    # later launch costs more on the host (run 10's batch-128 and EAGLE-3 rows were timed so).
    # Each with what the listed replay's attention read (its last replay's inputs).
    for at, graph, eng in reversed(listings):
        report.insert(at, kernel_listing(graph, flush_mb=int(args.flush_mb)) + "\n"
                      + attention_inputs(eng))
    del listings
    text = "\n".join(report)
    print(text)
    (out / "diag_step.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
