"""An experiment for the few-row projections (kernels/skinny_gemm/) at 2-3 rows, on the GPU:
can one program take every row, with each warp owning whole output columns?

Why: in the k = 2 verify step a target layer at 3 rows costs 4.8 us more than at one row on the
critical path (diag_step_run19.txt). The production kernel gives each row its own one-warp
program (3x the programs of a one-row step); giving a program more rows or columns made it
slower (runs 10-19), and with more warps Triton splits K across them (a shared-memory reduction;
the sm_90 TTGIR shows it). Here the weight tile is a [STEPS, BLOCK_N, 256] tensor: 32 lanes x 8
bf16 cover the 256 columns of a K step exactly, so Triton puts the warps on the BLOCK_N axis and
every dot product is reduced inside one warp (shuffles, no barrier). The x rows are loaded in the
weight's layout (a broadcast load, L1 hits), so no layout conversion sits between load and
multiply; the rows are multiplied in turn against the registers-resident weight.

Plain projection only (no norm, residual, silu or rope epilogue): it is timed against
small_linear_triton's plain projection at the same rows, in CUDA graphs of 20 back-to-back
calls with PDL and L2-cold weights (bench_small_linear's harness), SmolLM2-135M shapes, M = 1-3.

    PYTHONPATH=$PWD python benchmarks/diag_warp_columns.py [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from outpace.kernels import next_pow2, pdl  # noqa: E402

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None

LANES_K = 256  # one warp's K span: 32 lanes x 8 bf16 (one 16-byte load each)

if triton is not None:
    from outpace.kernels.pdl import wait_then_release

    @triton.jit
    def _warp_cols_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_om,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STEPS: tl.constexpr,
                          USE_PDL: tl.constexpr):
        # out[m, n] = sum_k x[m, k] w[n, k] for the program's BLOCK_N columns and every row.
        s = tl.arange(0, STEPS)[:, None, None]
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :, None]
        k = s * 256 + tl.arange(0, 256)[None, None, :]  # [STEPS, 1, 256]
        kmask = k < K
        w = tl.load(w_ptr + n.to(tl.int64) * K + k, mask=(n < N) & kmask, other=0.0)
        wait_then_release(USE_PDL)
        w = w.to(tl.float32)
        cols = tl.arange(0, BLOCK_M)[None, :]  # acc is [BLOCK_N, BLOCK_M]: rows as columns
        nn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
        for m in tl.static_range(BLOCK_M):
            ok = tl.full([1, 1, 1], m, tl.int32) < M
            # x row m in the weight's layout: [STEPS, BLOCK_N, 256], every n the same row
            xm = tl.load(x_ptr + m * stride_xm + k + n * 0, mask=kmask & ok, other=0.0)
            p = tl.sum(tl.sum(xm.to(tl.float32) * w, axis=2), axis=0)  # [BLOCK_N]
            # acc takes p's layout (built from it, not from tl.zeros): no conversion per row
            if m == 0:
                acc = tl.where(cols == 0, p[:, None], 0.0)
            else:
                acc = tl.where(cols == m, p[:, None], acc)
        tl.store(out_ptr + cols * stride_om + nn, acc.to(out_ptr.dtype.element_ty),
                 mask=(nn < N) & (cols < M))


def warp_cols_linear(x: torch.Tensor, w: torch.Tensor, block_n: int = 8,
                     num_warps: int = 4) -> torch.Tensor:
    """x [M, K] @ w [N, K].T with the experiment's kernel (M <= 4, unit last strides)."""
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    steps = next_pow2(-(-k // LANES_K))
    _warp_cols_kernel[(-(-n // block_n),)](
        x, w, out, m, n, k, x.stride(0), out.stride(0), BLOCK_M=next_pow2(m), BLOCK_N=block_n,
        STEPS=steps, num_warps=num_warps, **pdl.launch_options(x))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/out")
    args = ap.parse_args()
    from benchmarks.kernels import SMOL, Weights, max_err, time_graph, x_of
    from outpace.kernels.skinny_gemm import choose_blocks, small_linear_triton
    rows = []
    for layer in ("qkv", "o", "gate_up", "down"):
        n, k = SMOL[layer]
        wts = Weights(n, k)
        for m in (1, 2, 3):
            x = x_of(m, k)
            ref = F.linear(x.float(), wts.w[0].float())
            cur = time_graph(lambda i: small_linear_triton(x, wts.w[i]), len(wts))
            row = {"layer": layer, "N": n, "K": k, "M": m, "current_us": round(cur, 2),
                   "current_config": str(choose_blocks(m, n, k))}
            for bn, warps in ((4, 4), (8, 4), (16, 4), (8, 8), (4, 2)):
                name = f"n{bn}w{warps}"
                err = max_err(warp_cols_linear(x, wts.w[0], bn, warps), ref)
                t = time_graph(lambda i: warp_cols_linear(x, wts.w[i], bn, warps), len(wts))
                row[name + "_us"] = round(t, 2)
                row[name + "_err"] = f"{err:.1e}"
            rows.append(row)
            print(row, flush=True)
        wts = None  # the copies go before the next shape's
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "diag_warp_columns.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
