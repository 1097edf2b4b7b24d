"""What makes a CUDA graph slow to launch, on the GPU machine. Run 10 measured the host time of one
graph.replay() at 8 us for the no-spec batch-1 step (157 kernels) but 100-220 us for the EAGLE-3
steps and the batch-128 steps (195-293 kernels): about 0.5 us a node, as if those graphs lost a
fast launch path. They differ from the fast one in device-to-device memcpy nodes (copy_ between
contiguous tensors), cuBLAS kernels (nvjet), torch kernels between PDL Triton kernels, and node
count.

  * synthetic graphs that add one ingredient at a time to a chain of torch kernels or of PDL
    Triton kernels: host microseconds of a replay with the GPU idle (after a synchronize) and
    busy (back to back);
  * the engine's real steady graphs (SmolLM2-shaped random model: no-spec and EAGLE-3 k = 2 at
    batch 1 and 128), each in a fresh engine: launch cost, and again recaptured with PDL off;
  * one graph's launch cost before and after a torch.profiler session in the process.

    python benchmarks/diag_launch.py [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.archive.diag_step import launch_cost  # noqa: E402

def capture(fn):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def synthetic() -> dict:
    from outpace.kernels import pdl
    from outpace.kernels.norm import rms_norm_triton
    dev = "cuda"
    x = torch.zeros(1024, device=dev)
    a = torch.zeros(8, dtype=torch.long, device=dev)
    b = torch.zeros(8, dtype=torch.long, device=dev)
    w = torch.randn(49152, 576, dtype=torch.bfloat16, device=dev)
    h = torch.randn(3, 576, dtype=torch.bfloat16, device=dev)
    nw = torch.ones(576, dtype=torch.bfloat16, device=dev)

    def adds(n):
        for _ in range(n):
            x.add_(1.0)

    def tritons(n):
        for _ in range(n):
            rms_norm_triton(h, nw, 1e-5)

    extras = {"": lambda: None, "+memcpy1": lambda: b.copy_(a),
              "+gemm1": lambda: F.linear(h, w), "+rand1": lambda: torch.rand(8, device=dev),
              "+add1": lambda: adds(1), "+cat1": lambda: torch.cat([a, b])}
    rows = {}

    def case(name, fn):
        rows[name] = launch_cost(capture(fn))
        print(name, rows[name], flush=True)

    case("adds150", lambda: adds(150))
    case("adds300", lambda: adds(300))
    case("adds150+memcpy8", lambda: (adds(150), [b.copy_(a) for _ in range(8)]))
    case("adds150+gemm5", lambda: (adds(150), [F.linear(h, w) for _ in range(5)]))
    for use_pdl in (True, False):
        pdl.ENABLED = use_pdl
        tag = "pdl" if use_pdl else "nopdl"
        for ename, extra in extras.items():
            # the extra ingredient in the middle of the chain, as in a real step
            case(f"triton150{tag}{ename}", lambda extra=extra: (tritons(75), extra(), tritons(75)))
    pdl.ENABLED = True
    return rows


def real_graphs() -> dict:
    from benchmarks.throughput import _NullTokenizer, smollm2_shaped
    from outpace.engine.engine import LLMEngine
    from outpace.kernels import pdl
    model, cfg, eagle = smollm2_shaped(Path(tempfile.mkdtemp()))
    rows = {}
    spec = {"method": "eagle3", "model": str(eagle), "num_speculative_tokens": 2,
            "force_accept_mean": 3.0, "k_schedule": [[32, 2], [64, 1]]}
    for name, sp in (("no-spec", None), ("eagle3-k2", spec)):
        eng = LLMEngine.from_args("smollm2-shaped", loaded=(model, cfg, _NullTokenizer()),
                                  device="cuda", dtype="bfloat16", max_num_seqs=128,
                                  num_kv_blocks=4096, max_model_len=2048, quiet=True,
                                  speculative_config=sp, enable_prefix_caching=False)
        fused = eng.runner.fused
        for b in (1, 128):
            kd = fused.draft_steps(b)
            key = (b, fused.next_q(kd), kd, True)
            if key not in fused._captured:
                print(name, key, "not captured", flush=True)
                continue
            r = {"launch": launch_cost(fused._captured[key][0])}
            pdl.ENABLED = False
            try:
                g2, _ = fused._capture(*key)
                r["launch_nopdl"] = launch_cost(g2)
            finally:
                pdl.ENABLED = True
            fused._captured[key] = fused._capture(*key)
            rows[f"{name} {key}"] = r
            print(name, key, r, flush=True)
        del eng, fused
        torch.cuda.empty_cache()
    return rows


def after_profiler() -> dict:
    """Launch cost of one graph before and after a torch.profiler session in this process (run
    last: what it measures stays for the rest of the process)."""
    from torch.profiler import ProfilerActivity, profile
    from outpace.kernels.norm import rms_norm_triton
    h = torch.randn(3, 576, dtype=torch.bfloat16, device="cuda")
    nw = torch.ones(576, dtype=torch.bfloat16, device="cuda")
    x = torch.zeros(1024, device="cuda")
    g = capture(lambda: ([rms_norm_triton(h, nw, 1e-5) for _ in range(150)],
                         [x.add_(1.0) for _ in range(10)]))

    def eager_ms():  # host + GPU ms of 1000 eager torch kernel launches
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(1000):
            x.add_(1.0)
        torch.cuda.synchronize()
        return round(1e3 * (time.perf_counter() - t), 2)

    rows = {"before": launch_cost(g), "eager_1000_adds_ms_before": eager_ms()}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
        for _ in range(5):
            g.replay()
        torch.cuda.synchronize()
    rows["after"] = launch_cost(g)
    rows["eager_1000_adds_ms_after"] = eager_ms()
    print("profiler:", rows, flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/out")
    ap.add_argument("--parts", default="synthetic,real,profiler")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if "synthetic" in args.parts:
        res["synthetic"] = synthetic()
    if "real" in args.parts:
        res["real"] = real_graphs()
    if "profiler" in args.parts:
        res["profiler"] = after_profiler()
    (out / "diag_launch.json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
