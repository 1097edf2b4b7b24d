"""Does what an engine ran before move its batch-1 speculative step, on the GPU machine?

Run 32 timed EAGLE-3 force-accept 3 (k = 2) at batch 1 in bench's smol section after two
warm-up histories: batches `1 32` and `1 8 32`. The 3-row warp-a-row policy measured 2.24x
no-spec after the first and 2.07x after the second (the old policy ~2% apart), each history in
its own process, so possibly on another machine. Here both histories and both policies run in
one process, interleaved, each on a fresh engine:

  * per (round, policy, history): the timed batch-1 runs' tok/s, step_ms, the host's wait on
    the GPU, and the KV block ids the timed requests were given (first and spread);
  * GPU clocks, power and temperature sampled by nvidia-smi beside the whole run
    (`smi.csv`, when nvidia-smi is there);
  * last (torch.profiler slows later launches on the host): the kernels of one batch-1 step
    after each history, summed by kernel name, fast history against slow.

  * with --probe 1 (or 2), instead: after the fast history, one extra run of another kind
    (PROBES; PROBES_2: what re-capturing the graphs resets),
    to find which part of the batch-8 warm-up moves the step.

    python benchmarks/diag_history.py --gguf PATH [--out DIR] [--rounds 2] [--more 1]
        [--probe 1 --profile 0] [--policies old,rw3]
"""
from __future__ import annotations

import collections
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import diag_setup, make_heads, run_engine  # noqa: E402
from benchmarks.archive.diag_step import profiled_requests, split_steps  # noqa: E402

HISTORIES = {"b1_32": (1, 32), "b1_8_32": (1, 8, 32)}
# More orders (--more): which part of the batch-8 warm-up moves the step, and whether
# releasing the allocator's cached memory afterwards undoes it.
MORE = {"b1_32_8": (1, 32, 8), "b8_1_32": (8, 1, 32), "b1_8_32+empty": (1, 8, 32),
        "b1_8full_32": (1, 8, 32)}
MAX_SEQS = 32
# Probes (--probe): after the fast history (1, 32), one extra run -> is the step slow after it?
# "recapture": the slow history, then every fused graph captured again.
PROBES = ("none", "b8_prefill", "b8_staggered", "b2", "slow", "slow+recapture")
# --probe 2: what the recapture resets (the null block's contents; the fixed input buffers'
# rows past the batch; the batch-1 graphs alone), and garbage in the null block after the
# fast history.
PROBES_2 = ("none", "slow", "slow+zero_null", "fast+randn_null", "slow+reset_rows",
            "slow+recapture_b1")
# --probe 3: the random fill's data, or its launches? (copies of zeros and of random values
# into the null block, random values into a scratch tensor and into a block no request holds)
PROBES_3 = ("none", "fast+zeros_null", "fast+randn_scratch", "fast+randn_last_block",
            "fast+randn_null", "slow+recapture_chained")
# --probe 4: is it a new allocator segment (cudaMalloc) after capture? A large tensor taken and
# kept cached; the same released to the driver; a small one; a graph captured in its own pool.
PROBES_4 = ("none", "fast+large_kept", "fast+large_released", "fast+small",
            "fast+own_graph", "slow")
# --probe 5: one small torch kernel makes it slow (probe 4). Is it the last eager kernel's kind
# that matters: the small fill followed by one PDL-launched Triton kernel, by a cuBLAS matmul,
# or by the chained step's own kernels run eagerly (no capture)?
PROBES_5 = ("none", "fast+small", "fast+small+triton_norm", "fast+small+matmul",
            "fast+small+eager_step")
BATCH1_REQUESTS = 4  # bench's --batch1-requests
MAX_TOKENS = 128


def set_policy(name: str) -> None:
    """'old': the default few-row policy; 'rw3': 3 rows a warp a row, one row a program."""
    import outpace.kernels.skinny_gemm.blocks as slb
    slb._ROW_WARPS.pop(3, None)
    if name == "rw3":
        slb._ROW_WARPS[3] = slb.ROW_WARPS_3
    slb.choose_blocks.cache_clear()


def fresh_engine(args, loaded, spec):
    from outpace.engine.engine import LLMEngine
    return LLMEngine.from_args(args.gguf, loaded=loaded, device="cuda", dtype="bfloat16",
                               speculative_config=spec, max_num_seqs=MAX_SEQS,
                               num_kv_blocks=8192, quiet=True, enable_prefix_caching=False)


def warm_up(eng, prompts, name, history) -> None:
    """bench's smol warm-up: every batch size, the largest at full length ("8full": batch 8
    at full length too; "+empty": the allocator's cached blocks released after)."""
    for b in history:
        full = b == max(history) or (b == 8 and "8full" in name)
        run_engine(eng, prompts[:b if b > 1 else BATCH1_REQUESTS], b, MAX_TOKENS if full else 4)
    if name.endswith("+empty"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def record_allocations(eng) -> list:
    """Wrap the block pool's allocate: -> the list each allocation's ids are appended to."""
    pool = eng.kv.pool
    got, allocate = [], pool.allocate

    def recording(n):
        out = allocate(n)
        got.append(list(out))
        return out
    pool.allocate = recording
    return got


def staggered(eng, prompts, n: int, max_tokens: int) -> None:
    """n requests added one an engine step (each prefilled alone, decoded together)."""
    from outpace import SamplingParams
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                        output_kind="final_only")
    for i, p in enumerate(prompts[:n]):
        eng.add_request(f"stagger-{i}", p, sp)
        eng.step()
    while eng.has_unfinished_requests():
        eng.step()


def probe(eng, prompts, name: str) -> None:
    f, kv = eng.runner.fused, eng.runner.kv_cache
    if name.startswith("slow"):
        warm_up(eng, prompts, "", (8,))
    torch.cuda.synchronize()
    if name == "slow+zero_null":
        kv[:, :, 0].zero_()
    elif name == "fast+randn_null":
        kv[:, :, 0].copy_(torch.randn_like(kv[:, :, 0]))
    elif name == "fast+zeros_null":
        kv[:, :, 0].copy_(torch.zeros_like(kv[:, :, 0]))
    elif name == "fast+randn_scratch":
        scratch = torch.randn_like(kv[:, :, 0])
        scratch.add_(1.0)
        del scratch
    elif name == "fast+randn_last_block":
        kv[:, :, -1].copy_(torch.randn_like(kv[:, :, -1]))
    elif name in ("fast+large_kept", "fast+large_released"):
        x = torch.empty(256 << 20, dtype=torch.uint8, device=kv.device)
        x.fill_(1)
        del x
        if name == "fast+large_released":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    elif name.startswith("fast+small"):
        x = torch.empty(1000, dtype=torch.uint8, device=kv.device)
        x.fill_(1)
        del x
        if name.endswith("+triton_norm"):
            from outpace.kernels.norm import rms_norm_triton
            w = torch.ones(576, dtype=torch.bfloat16, device=kv.device)
            rms_norm_triton(torch.randn(3, 576, dtype=torch.bfloat16, device=kv.device), w, 1e-5)
        elif name.endswith("+matmul"):
            a = torch.randn(64, 64, device=kv.device)
            a @ a
        elif name.endswith("+eager_step"):
            key = next(k for k in f._captured if k[0] == 1 and k[3])
            f.graphs.fill_dummy(1, key[1])
            for t in (f.num_drafts, f.real, f.carry_pos, f.carry_tokens):
                t[:1].zero_()
            f._greedy_rows(1)
            f._no_penalty_rows(1)
            f._compute(*key)
    elif name == "fast+own_graph":
        g, x = torch.cuda.CUDAGraph(), torch.zeros(1000, device=kv.device)
        with torch.cuda.graph(g):
            x.add_(1.0)
        g.replay()
    elif name == "slow+recapture_chained":
        for mode, table in f._by_mode.items():
            for key in [k for k in table if k[0] == 1 and k[3]]:
                table[key] = f._capture(*key, mode=mode)
    elif name == "slow+reset_rows":
        m = eng.runner.max_num_seqs
        f.graphs.fill_dummy(m, 1)
        for t in (f.num_drafts, f.real, f.carry_pos, f.carry_tokens):
            t.zero_()
        if f.graphs.tile_map is not None:
            f.graphs.tile_map.zero_()
    elif name == "slow+recapture_b1":
        for mode, table in f._by_mode.items():
            for key in [k for k in table if k[0] == 1]:
                table[key] = f._capture(*key, mode=mode)
    elif name == "slow+recapture":
        f = eng.runner.fused
        for mode, table in f._by_mode.items():
            for key in list(table):
                table[key] = f._capture(*key, mode=mode)
    elif name == "b8_prefill":
        run_engine(eng, prompts[:8], 8, 1)
    elif name == "b8_staggered":
        staggered(eng, prompts, 8, 4)
    elif name == "b2":
        run_engine(eng, prompts[:2], 2, 4)


def counters(eng) -> dict:
    f = eng.runner.fused
    return {"replays": f.replays, "chained": f.chained, "relaunched": f.relaunched,
            "varlen": eng.runner.graphs.varlen_replays}


def timed(eng, prompts, reps: int = 3) -> dict:
    got = record_allocations(eng)
    c0 = counters(eng)
    runs = sorted((run_engine(eng, prompts[:BATCH1_REQUESTS], 1, MAX_TOKENS)
                   for _ in range(reps)), key=lambda r: r["tok_s"])
    r = runs[len(runs) // 2]
    ids = [b for chunk in got for b in chunk]
    c1 = counters(eng)
    return {"paths": {k: c1[k] - c0[k] for k in c0}, "tok_s": r["tok_s"],
            "tok_s_runs": [x["tok_s"] for x in runs],
            "step_ms": r.get("step_ms"), "wait_ms": r.get("wait_ms"),
            "launch_ms": r.get("launch_ms"),
            "blocks_first": ids[:12], "blocks_min": min(ids, default=None),
            "blocks_max": max(ids, default=None), "blocks_n": len(ids)}


def listing(step) -> list:
    """One step's kernels: (start us from the step's first, duration us, name)."""
    t0 = step[0].time_range.start
    return [(round(e.time_range.start - t0, 2), round(e.time_range.end - e.time_range.start, 2),
             e.name[:50]) for e in step]


def step_kernels(eng, prompt) -> dict:
    """Kernel name -> us summed over the chained steps of one profiled batch-1 request, per
    step (the mean over its steps)."""
    chained = split_steps(profiled_requests(eng, [prompt], MAX_TOKENS))[1:]  # [0]: the prefill
    by_name = collections.Counter()
    for s in chained:
        for e in s:
            by_name[e.name[:70]] += (e.time_range.end - e.time_range.start) / len(chained)
    spans = [s[-1].time_range.end - s[0].time_range.start for s in chained[1:-1]]
    return {"steps": len(chained), "span_us_median": round(statistics.median(spans), 1),
            "busy_us": round(sum(by_name.values()), 1),
            "kernels_a_step": [len(s) for s in chained[:3]],
            "mid_steps": [listing(s) for s in chained[len(chained) // 2:][:2]],
            "by_kernel_us": {n: round(v, 2) for n, v in by_name.most_common()}}


def main():
    args, loaded, prompts = diag_setup(64, (
        ("--rounds", "2"), ("--more", "0"), ("--policies", "old,rw3"), ("--probe", "0"),
        ("--profile", "1")))
    histories = {**HISTORIES, **(MORE if int(args.more) else {})}
    if int(args.probe):
        histories = {}
    pols = args.policies.split(",")
    smi = None
    try:
        smi = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,"
             "temperature.gpu,utilization.gpu", "--format=csv", "-lms", "200"],
            stdout=open(Path(args.out) / "smi.csv", "w"), stderr=subprocess.DEVNULL)
    except OSError:
        pass
    eagle, _ = make_heads(args.gguf, tempfile.mkdtemp())
    spec = {"method": "eagle3", "model": str(eagle), "num_speculative_tokens": 2,
            "force_accept_mean": 3.0, "k_schedule": [[32, 2], [128, 1]]}
    rows = []
    # The process's first engine pays CUDA's lazy loading: one untimed pass first.
    eng = fresh_engine(args, loaded, spec)
    warm_up(eng, prompts, "first", (1, 8, 32))
    del eng
    for rnd in range(int(args.rounds)):
        for pol in pols:
            for hname, history in histories.items():
                set_policy(pol)
                eng = fresh_engine(args, loaded, spec)
                warm_up(eng, prompts, hname, history)
                row = {"round": rnd, "policy": pol, "history": hname, **timed(eng, prompts)}
                rows.append(row)
                print(row, flush=True)
                del eng
                torch.cuda.empty_cache()
    for rnd in range(int(args.rounds) if int(args.probe) else 0):
        for pol in pols:
            for name in {1: PROBES, 2: PROBES_2, 3: PROBES_3, 4: PROBES_4,
                          5: PROBES_5}[int(args.probe)]:
                set_policy(pol)
                eng = fresh_engine(args, loaded, spec)
                warm_up(eng, prompts, "", (1, 32))
                seg0 = torch.cuda.memory_stats()["segment.all.current"]
                probe(eng, prompts, name)
                seg1 = torch.cuda.memory_stats()["segment.all.current"]
                row = {"round": rnd, "policy": pol, "probe": name, **timed(eng, prompts)}
                row["segments"] = [seg0, seg1, torch.cuda.memory_stats()["segment.all.current"]]
                row.pop("blocks_first")
                rows.append(row)
                print(row, flush=True)
                del eng
                torch.cuda.empty_cache()
    profiles = {}
    for pol in pols if int(args.profile) else ():
        for hname, history in HISTORIES.items():
            set_policy(pol)
            eng = fresh_engine(args, loaded, spec)
            warm_up(eng, prompts, hname, history)
            timed(eng, prompts, reps=1)
            profiles[f"{pol}/{hname}"] = step_kernels(eng, prompts[0])
            print(pol, hname, {k: v for k, v in profiles[f"{pol}/{hname}"].items()
                               if k not in ("by_kernel_us", "mid_steps")}, flush=True)
            del eng
            torch.cuda.empty_cache()
    set_policy("old")
    if smi is not None:
        smi.terminate()
    out = {"rows": rows, "profiles": profiles}
    (Path(args.out) / "diag_history.json").write_text(json.dumps(out, indent=1) + "\n")
    for pol in pols if profiles else ():
        a, b = profiles[f"{pol}/b1_32"], profiles[f"{pol}/b1_8_32"]
        print(f"{pol}: span {a['span_us_median']} vs {b['span_us_median']} us; largest "
              "kernel differences (b1_32 - b1_8_32, us a step):")
        names = set(a["by_kernel_us"]) | set(b["by_kernel_us"])
        diffs = sorted(((a["by_kernel_us"].get(n, 0) - b["by_kernel_us"].get(n, 0), n)
                        for n in names), key=lambda x: -abs(x[0]))
        for d, n in diffs[:8]:
            print(f"  {d:+7.2f}  {n}")


if __name__ == "__main__":
    main()
