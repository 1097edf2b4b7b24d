"""What makes a CUDA graph slow to launch, on the GPU machine. Run 10 measured the host time of one
graph.replay() at 8 us for the no-spec batch-1 step (157 kernels) but 100-220 us for the EAGLE-3
steps and the batch-128 steps (195-293 kernels). Those graphs differ in device-to-device memcpy
nodes (copy_ between contiguous tensors), cuBLAS kernels (nvjet) and node count. This script
captures synthetic graphs that add one ingredient at a time and reports the host microseconds
of a replay with the GPU idle (after a synchronize) and busy (back to back).

    python benchmarks/diag_launch.py [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.diag_step import launch_cost  # noqa: E402


def capture(fn):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/out")
    args = ap.parse_args()
    dev = "cuda"
    x = torch.zeros(1024, device=dev)
    a = torch.zeros(8, dtype=torch.long, device=dev)
    b = torch.zeros(8, dtype=torch.long, device=dev)
    w = torch.randn(49152, 576, dtype=torch.bfloat16, device=dev)
    h = torch.randn(3, 576, dtype=torch.bfloat16, device=dev)

    def adds(n):
        def f():
            for _ in range(n):
                x.add_(1.0)
        return f

    def with_memcpys(n, m):
        def f():
            adds(n)()
            for _ in range(m):
                b.copy_(a)  # same dtype, contiguous: a memcpy node
        return f

    def with_gemms(n, m):
        def f():
            adds(n)()
            for _ in range(m):
                F.linear(h, w)
        return f

    def with_triton(n, m):
        from outpace.kernels.norm import rms_norm_triton
        nw = torch.ones(576, dtype=torch.bfloat16, device=dev)

        def f():
            adds(n)()
            for _ in range(m):
                rms_norm_triton(h, nw, 1e-5)
        return f

    cases = {"adds150": adds(150), "adds300": adds(300),
             "adds150+memcpy8": with_memcpys(150, 8), "adds150+memcpy1": with_memcpys(150, 1),
             "adds150+gemm1": with_gemms(150, 1), "adds150+gemm5": with_gemms(150, 5),
             "adds150+triton30": with_triton(150, 30), "adds150+triton120": with_triton(150, 120)}
    rows = {}
    for name, fn in cases.items():
        rows[name] = launch_cost(capture(fn))
        print(name, rows[name], flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "diag_launch.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
