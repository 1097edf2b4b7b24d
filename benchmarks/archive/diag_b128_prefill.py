"""Where the batch-128 ramp-up (the prefill steps) spends its host time, no-spec vs EAGLE-3:
cProfile of the first steps after 128 requests arrive at once.

    python benchmarks/diag_b128_prefill.py --gguf PATH [--out DIR]
"""
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import diag_setup, make_heads, run_engine  # noqa: E402


def main():
    args, loaded, prompts = diag_setup(128)
    from outpace import SamplingParams
    from outpace.engine.engine import LLMEngine
    eagle, _ = make_heads(args.gguf, tempfile.mkdtemp())
    report = []
    for name, spec in (("no-spec", None),
                       ("eagle3-fa3.0", {"method": "eagle3", "model": str(eagle),
                                         "num_speculative_tokens": 4, "force_accept_mean": 3.0,
                                         "k_schedule": [[32, 4], [64, 1]]})):
        eng = LLMEngine.from_args(args.gguf, loaded=loaded, device="cuda", dtype="bfloat16",
                                  speculative_config=spec, max_num_seqs=128, num_kv_blocks=8192,
                                  quiet=True, enable_prefix_caching=False)
        run_engine(eng, prompts, 128, 4)
        sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(prompts):
            eng.add_request(f"{name}-{i}", p, sp)
        pr = cProfile.Profile()
        times = []
        while eng.has_unfinished_requests():
            torch.cuda.synchronize()
            t = time.perf_counter()
            pr.enable()
            plan_sizes = eng.step()
            pr.disable()
            torch.cuda.synchronize()
            times.append(round(1000 * (time.perf_counter() - t), 2))
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(40)
        report.append(f"== {name}: step ms {times}\n{s.getvalue()}")
        del eng, plan_sizes
        torch.cuda.empty_cache()
    text = "\n".join(report)
    print(text)
    (Path(args.out) / "diag_b128_prefill.txt").write_text(text)


if __name__ == "__main__":
    main()
