"""Where a batch-1 request's time goes: per-step wall times, cProfile by cumulative time and
torch.profiler's CPU/CUDA table for one prefill step (TTFT), and a Chrome trace of 24 steady
overlapped decode steps (decode_trace.json: the GPU's gaps between graphs, TPOT vs graph time).

    python benchmarks/diag_prefill.py --gguf PATH [--out DIR]
"""
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import diag_setup  # noqa: E402


def main():
    args, loaded, prompts = diag_setup(4)
    from outpace import SamplingParams
    from outpace.engine.engine import LLMEngine
    eng = LLMEngine.from_args(args.gguf, loaded=loaded, device="cuda", dtype="bfloat16",
                              max_num_seqs=8, quiet=True, enable_prefix_caching=False)
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    report = []

    def one(p, tag, prof=None):
        """Run p alone; -> wall ms of each engine step (the first is the prefill)."""
        eng.add_request(f"{tag}-{time.monotonic_ns()}", p, sp)
        times = []
        while eng.has_unfinished_requests():
            torch.cuda.synchronize()
            t = time.perf_counter()
            if prof is not None and not times:
                prof.enable()
            eng.step()
            if prof is not None and len(times) == 0:
                prof.disable()
            torch.cuda.synchronize()
            times.append(round(1000 * (time.perf_counter() - t), 3))
        return times

    for rep in range(3):
        for p in prompts:
            one(p, "w")
    for p in prompts:
        report.append(f"prompt {len(p)} tokens: step ms {one(p, 't')}")
    pr = cProfile.Profile()
    one(prompts[0], "p", pr)
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(45)
    report.append(s.getvalue())
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
    report.append(s.getvalue())
    from torch.profiler import ProfilerActivity, profile
    eng.add_request(f"tp-{time.monotonic_ns()}", prompts[1], sp)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
        eng.step()
        torch.cuda.synchronize()
    while eng.has_unfinished_requests():
        eng.step()
    report.append(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    report.append(tp.key_averages().table(sort_by="self_cuda_time_total", row_limit=20))
    # Steady decoding, overlapped as in the benchmark: trace 24 steps after 40.
    eng.add_request(f"td-{time.monotonic_ns()}", prompts[2],
                    SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True))
    for _ in range(40):
        eng.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
        t = time.perf_counter()
        for _ in range(24):
            eng.step()
        report.append(f"24 overlapped decode steps: {1000 * (time.perf_counter() - t) / 24:.3f} "
                      f"ms per step (host wall, under the profiler)")
    tp.export_chrome_trace(str(Path(args.out) / "decode_trace.json"))
    while eng.has_unfinished_requests():
        eng.step()
    text = "\n".join(report)
    print(text)
    (Path(args.out) / "diag_prefill.txt").write_text(text)


if __name__ == "__main__":
    main()
