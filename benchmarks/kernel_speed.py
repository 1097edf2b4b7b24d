"""Few-row linear kernels (outpace.kernels.skinny_gemm) against torch on the GPU.

    PYTHONPATH=$PWD python benchmarks/kernel_speed.py --out $OUT [--total-s 50]

Every timing is of a CUDA graph of 20 back-to-back calls, replayed many times, so launch gaps are
what a captured decode step sees. Each call reads its own copy of the weight, and there are
enough copies (>= 3x the L2) that no call finds its weight in L2, as in a real forward where
every layer has its own weights. Reported per call: microseconds, achieved GB/s (weight + x +
outputs), and the max abs error against the PyTorch reference.

Sections, in this order (the sweep gets whatever is left of --total-s):
  linear  F.linear vs small_linear (choose_blocks' config), SmolLM2-135M and Llama-8B shapes,
          M in 1, 4, 8, 16, bf16
  fused   norm_small_linear vs rms_norm + F.linear; norm_small_linear_silu_mul vs rms_norm +
          F.linear + silu * mul; small_linear_silu_mul vs F.linear + silu * mul; small_linear
          with a residual vs F.linear + add; silu_mul vs F.silu(g) * u
  sweep   BLOCK_N / BLOCK_K / num_warps / num_stages / tl.dot variants around choose_blocks for
          small_linear, most important shapes first; the best per shape, with its config
Writes $OUT/small_linear.json (--out DIR) and prints the tables.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import device_name, print_table, write_result  # noqa: E402
from outpace.kernels.norm import rms_norm  # noqa: E402
from outpace.kernels.skinny_gemm import (  # noqa: E402
    choose_blocks, norm_small_linear_ref, norm_small_linear_silu_mul_ref,
    norm_small_linear_silu_mul_triton, norm_small_linear_triton, silu_mul_ref, silu_mul_triton,
    small_linear_ref, small_linear_silu_mul_ref, small_linear_silu_mul_triton,
    small_linear_triton)

DEV = "cuda"
DT = torch.bfloat16
CALLS = 20  # calls per captured graph
MS = [1, 4, 8, 16]
SMOL = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
        "lm_head": (49152, 576)}
L8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
       "lm_head": (128256, 4096)}
MODELS = {"smol": SMOL, "8b": L8B}
EPS = 1e-5


def l2_bytes() -> int:
    return getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 60 << 20) or (60 << 20)


class Weights:
    """Copies of one random weight (and RMSNorm weight), enough that consecutive calls in a graph
    never find their weight in L2."""

    def __init__(self, n, k, seed=0):
        g = torch.Generator(device=DEV).manual_seed(seed)
        one = n * k * 2
        count = max(1, min(CALLS * 10, math.ceil(3 * l2_bytes() / one)))
        base = (torch.randn(n, k, device=DEV, generator=g) / k ** 0.5).to(DT)
        self.w = [base] + [base.clone() for _ in range(count - 1)]
        self.nw = (1 + 0.2 * torch.randn(k, device=DEV, generator=g)).to(DT)
        self.n, self.k = n, k

    def __len__(self):
        return len(self.w)


def time_graph(call, copies: int) -> float:
    """us per call of call(i) (i: which weight copy), CUDA-graph captured, CALLS per graph."""
    n_graphs = math.ceil(copies / CALLS)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        call(0)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graphs = []
    for gi in range(n_graphs):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for j in range(CALLS):
                call((gi * CALLS + j) % copies)
        graphs.append(graph)
    for graph in graphs:
        graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for graph in graphs:
        graph.replay()
    torch.cuda.synchronize()
    once = time.perf_counter() - t0
    reps = max(2, min(50, int(0.004 / max(once, 1e-6))))  # ~4 ms of replays
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        for graph in graphs:
            graph.replay()
    end.record()
    end.synchronize()
    del graphs
    return start.elapsed_time(end) * 1000 / (reps * n_graphs * CALLS)


def max_err(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def gbps(nbytes, us) -> float:
    return round(nbytes / (us * 1e-6) / 1e9, 1)


def row(op, model, layer, n, k, m, nbytes, t_us, o_us, err, cfg=None):
    return dict(op=op, model=model, layer=layer, N=n, K=k, M=m, torch_us=round(t_us, 2),
                ours_us=round(o_us, 2), speedup=round(t_us / o_us, 2),
                torch_GBps=gbps(nbytes, t_us), ours_GBps=gbps(nbytes, o_us),
                max_err=f"{err:.2e}", config=fmt_cfg(cfg) if cfg else "")


def fmt_cfg(b) -> str:
    return (f"m{b.block_m}n{b.block_n}k{b.block_k}w{b.num_warps}s{b.num_stages}"
            f"{'dot' if b.use_dot else 'sum'}")


def x_of(m, k, seed=1):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(m, k, device=DEV, generator=g) * 2).to(DT)


# ----------------------------------------------------------------------------- sections

def section_linear(weights):
    rows = []
    for model, shapes in MODELS.items():
        for layer, (n, k) in shapes.items():
            ws = weights(n, k)
            for m in MS:
                x = x_of(m, k)
                err = max_err(small_linear_triton(x, ws.w[0]), small_linear_ref(x, ws.w[0]))
                t = time_graph(lambda i: F.linear(x, ws.w[i]), len(ws))
                o = time_graph(lambda i: small_linear_triton(x, ws.w[i]), len(ws))
                nbytes = 2 * (n * k + m * k + m * n)
                rows.append(row("linear", model, layer, n, k, m, nbytes, t, o, err,
                                choose_blocks(m, n, k)))
    return rows


def section_fused(weights):
    rows = []
    for model, shapes in MODELS.items():
        for m in MS:
            # final/input norm + projection (qkv, LM head)
            for layer in ("qkv", "lm_head"):
                n, k = shapes[layer]
                ws = weights(n, k)
                x = x_of(m, k)
                err = max_err(norm_small_linear_triton(x, ws.nw, EPS, ws.w[0]),
                              norm_small_linear_ref(x, ws.nw, EPS, ws.w[0]))
                t = time_graph(lambda i: F.linear(rms_norm(x, ws.nw, EPS), ws.w[i]), len(ws))
                o = time_graph(lambda i: norm_small_linear_triton(x, ws.nw, EPS, ws.w[i]),
                               len(ws))
                nbytes = 2 * (n * k + m * k + m * n + k)
                rows.append(row("norm+linear", model, layer, n, k, m, nbytes, t, o, err,
                                choose_blocks(m, n, k, norm=True)))
            # post-attention norm + gate_up + silu * mul, with and without the norm
            n, k = shapes["gate_up"]
            inter = n // 2
            ws = weights(n, k)
            x = x_of(m, k)
            nbytes = 2 * (n * k + m * k + m * inter + k)

            def torch_mlp_in(i, norm=True):
                gu = F.linear(rms_norm(x, ws.nw, EPS) if norm else x, ws.w[i])
                return F.silu(gu[:, :inter]) * gu[:, inter:]

            err = max_err(norm_small_linear_silu_mul_triton(x, ws.nw, EPS, ws.w[0]),
                          norm_small_linear_silu_mul_ref(x, ws.nw, EPS, ws.w[0]))
            t = time_graph(torch_mlp_in, len(ws))
            o = time_graph(lambda i: norm_small_linear_silu_mul_triton(x, ws.nw, EPS, ws.w[i]),
                           len(ws))
            rows.append(row("norm+gate_up+silu_mul", model, "gate_up", n, k, m, nbytes, t, o,
                            err, choose_blocks(m, inter, k, gate_up=True, norm=True)))
            err = max_err(small_linear_silu_mul_triton(x, ws.w[0]),
                          small_linear_silu_mul_ref(x, ws.w[0]))
            t = time_graph(lambda i: torch_mlp_in(i, norm=False), len(ws))
            o = time_graph(lambda i: small_linear_silu_mul_triton(x, ws.w[i]), len(ws))
            rows.append(row("gate_up+silu_mul", model, "gate_up", n, k, m, nbytes - 2 * k, t, o,
                            err, choose_blocks(m, inter, k, gate_up=True)))
            # o_proj / down_proj + residual add (bf16 residual: torch rounds twice, we once)
            for layer in ("o", "down"):
                n, k = shapes[layer]
                ws = weights(n, k)
                x = x_of(m, k)
                r = x_of(m, n, seed=2)
                err = max_err(small_linear_triton(x, ws.w[0], residual=r),
                              small_linear_ref(x, ws.w[0], residual=r))
                t = time_graph(lambda i: F.linear(x, ws.w[i]) + r, len(ws))
                o = time_graph(lambda i: small_linear_triton(x, ws.w[i], residual=r), len(ws))
                nbytes = 2 * (n * k + m * k + 2 * m * n)
                rows.append(row("linear+residual", model, layer, n, k, m, nbytes, t, o, err,
                                choose_blocks(m, n, k)))
    # silu_mul alone, at any batch size
    for model, shapes in MODELS.items():
        inter = shapes["gate_up"][0] // 2
        for m in (1, 16, 256):
            gu = x_of(m, 2 * inter, seed=3)
            err = max_err(silu_mul_triton(gu), silu_mul_ref(gu))
            t = time_graph(lambda i: F.silu(gu[:, :inter]) * gu[:, inter:], 1)
            o = time_graph(lambda i: silu_mul_triton(gu), 1)
            rows.append(row("silu_mul", model, "act", 2 * inter, 0, m, 2 * 3 * m * inter, t, o,
                            err))
    return rows


def variants(m, n, k):
    """choose_blocks' config and its neighbours, the default first."""
    d = choose_blocks(m, n, k)
    k_max = max(1 << (k - 1).bit_length(), 16)
    out = [d]

    def add(b):
        if b in out or not 1 <= b.block_n <= 256 or not 16 <= b.block_k <= k_max:
            return
        if b.use_dot and b.block_n < 16:
            return
        if not b.use_dot and b.block_m * b.block_n * b.block_k > 32768:
            return  # far past the register budget: spills, not worth a compile
        out.append(b)

    if m >= 2 and m <= 16:  # the other path first: the question that matters most
        add(choose_blocks(m, n, k, use_dot=not d.use_dot))
    if d.use_dot and m > 16:  # prefill-sized row counts: row blocks and column tiles
        for bm in (16, 32, 64, 128):
            for bn in (16, 32, 64):
                if bm < m * 2:
                    add(d._replace(block_m=bm, block_n=bn))
    if not d.use_dot and d.block_m < m:  # all rows in one program instead of row blocks
        add(d._replace(block_m=1 << (m - 1).bit_length()))
    for bn in (d.block_n // 2, d.block_n * 2):
        add(d._replace(block_n=bn))
    for bk in (d.block_k // 2, d.block_k * 2):
        add(d._replace(block_k=bk))
    if k > d.block_k:  # a real K loop: how deep a software pipeline?
        for s in (d.num_stages - 1, d.num_stages + 1):
            add(d._replace(num_stages=s))
    for w in (2, 8):
        add(d._replace(num_warps=w))
    return out


def section_sweep(weights, deadline, ms=(1, 4, 16, 8), models=("smol", "8b")):
    rows = []
    order = [(model, m) for model in models for m in ms]
    for model, m in order:
        for layer, (n, k) in MODELS[model].items():
            if time.perf_counter() > deadline:
                return rows, False
            ws = weights(n, k)
            x = x_of(m, k)
            results = []
            for b in variants(m, n, k):
                if time.perf_counter() > deadline:
                    break
                try:
                    us = time_graph(lambda i: small_linear_triton(x, ws.w[i], blocks=b), len(ws))
                except Exception as e:  # a config that doesn't compile: report, go on
                    print(f"  {fmt_cfg(b)} failed: {type(e).__name__}: {str(e)[:120]}")
                    continue
                results.append((us, b))
            if not results:
                continue
            default_us = results[0][0] if results[0][1] == choose_blocks(m, n, k) else None
            best_us, best = min(results, key=lambda r: r[0])
            rows.append(dict(model=model, layer=layer, N=n, K=k, M=m,
                             default=fmt_cfg(choose_blocks(m, n, k)),
                             default_us=round(default_us, 2) if default_us else "",
                             best=fmt_cfg(best), best_us=round(best_us, 2),
                             best_GBps=gbps(2 * (n * k + m * k + m * n), best_us),
                             tried=len(results),
                             all=" ".join(f"{fmt_cfg(b)}={us:.2f}" for us, b in results)))
    return rows, True


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--total-s", type=float, default=50.0,
                    help="wall-clock budget; the sweep stops when it is spent")
    ap.add_argument("--sections", default="linear,fused,sweep")
    ap.add_argument("--sweep-ms", default="1,4,16,8",
                    help="row counts the sweep tries, in this order (e.g. 5 for a k=4 verify)")
    ap.add_argument("--sweep-models", default="smol,8b")
    ap.add_argument("--ms", default="",
                    help="row counts of the linear and fused sections (default 1,4,8,16); "
                         "above 16 (prefill chunks) the kernels run their tl.dot path")
    ap.add_argument("--models", default="smol,8b", help="models of the linear and fused sections")
    args = ap.parse_args()
    global MS, MODELS
    if args.ms:
        MS = [int(m) for m in args.ms.split(",")]
    MODELS = {m: MODELS[m] for m in args.models.split(",")}
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernel_speed.py needs CUDA")
    t0 = time.perf_counter()
    deadline = t0 + args.total_s
    sections = set(args.sections.split(","))
    cache = {}

    def weights(n, k):  # one set of copies alive at a time (the 8B LM head is 1 GB)
        if (n, k) not in cache:
            cache.clear()
            torch.cuda.empty_cache()
            cache[(n, k)] = Weights(n, k)
        return cache[(n, k)]

    payload = dict(device=device_name(DEV), torch=torch.__version__,
                   triton=__import__("triton").__version__, dtype=str(DT), calls_per_graph=CALLS,
                   l2_bytes=l2_bytes())
    if "linear" in sections:
        payload["linear"] = section_linear(weights)
        print(f"\n== linear ({time.perf_counter() - t0:.1f} s)")
        print_table(payload["linear"], ["model", "layer", "N", "K", "M", "torch_us", "ours_us",
                                        "speedup", "torch_GBps", "ours_GBps", "max_err",
                                        "config"])
    if "fused" in sections:
        payload["fused"] = section_fused(weights)
        print(f"\n== fused ({time.perf_counter() - t0:.1f} s)")
        print_table(payload["fused"], ["op", "model", "layer", "N", "K", "M", "torch_us",
                                       "ours_us", "speedup", "ours_GBps", "max_err", "config"])
    if "sweep" in sections:
        payload["sweep"], complete = section_sweep(
            weights, deadline, ms=[int(m) for m in args.sweep_ms.split(",")],
            models=args.sweep_models.split(","))
        payload["sweep_complete"] = complete
        print(f"\n== sweep ({time.perf_counter() - t0:.1f} s, "
              f"{'complete' if complete else 'cut by --total-s'})")
        print_table(payload["sweep"], ["model", "layer", "N", "K", "M", "default", "default_us",
                                       "best", "best_us", "best_GBps", "tried"])
    payload["elapsed_s"] = round(time.perf_counter() - t0, 1)
    path = write_result(Path(args.out) / "small_linear.json", payload)
    print(f"\nwrote {path} ({payload['elapsed_s']} s)")


if __name__ == "__main__":
    main()
