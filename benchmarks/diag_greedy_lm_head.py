"""The draft LM head's greedy ids in a step-shaped graph: norm -> LM head -> argmax apart (the
engine before session 18: Triton norm, cuBLAS or the int8 few-row kernel, argmax's two passes)
against kernels/greedy_lm_head.py (two launches), bf16 and int8 weights, 32000 and 49152 draft
ids, 1, 2 and 4 rows; and a sweep of the fused kernel's launch shapes. A device experiment, no
model file.

    PYTHONPATH=$PWD python3 benchmarks/diag_greedy_lm_head.py --out $OUT [--sweep]

The graph is diag_l2_persist.py's step shape with the few-row Triton kernels the engine runs
(PDL launches, so a kernel's weight prefetch can overlap the one before): 30 one-row
projections over a layer's 7.1 MB, the target's LM head (cuBLAS), then twice [the head's layer,
the draft path]. graph_us is the whole graph's time a replay; draft_us the draft path's
kernels summed from a profile (durations, not overlap). Writes
$OUT/diag_greedy_lm_head.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import diag_l2_persist  # noqa: E402
from benchmarks.diag_l2_persist import step_weights  # noqa: E402
from outpace.kernels.argmax import argmax_rows  # noqa: E402
from outpace.kernels.greedy_lm_head import (GreedyBlocks, choose_greedy_blocks,  # noqa: E402
                                            greedy_lm_head_triton)
from outpace.kernels.int8_linear import int8_linear, quantize_int8_rows  # noqa: E402
from outpace.kernels.norm import rms_norm  # noqa: E402
from outpace.kernels.small_linear import small_linear  # noqa: E402

DEV = "cuda"
H = 576


def step_fn(layers, target_head, head_layer, draft, x, xd):
    def fn():
        h = x
        for w in layers:
            h = small_linear(x, w)
        F.linear(x, target_head)
        for _ in range(2):
            for w in head_layer:
                h = small_linear(x, w)
            draft(xd)
        return h
    return fn


def kernel_times(graph, reps=5):
    """-> per-kernel mean durations (us) of one replay, in launch order, and their names."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    ks = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                key=lambda e: e.time_range.start)
    per = len(ks) // reps
    means = [sum(ks[r * per + i].time_range.end - ks[r * per + i].time_range.start
                 for r in range(reps)) / reps for i in range(per)]
    return means, [k.name for k in ks[:per]]


def variants(dw, q, s, nw, blocks=None):
    return {
        "unfused_bf16": lambda x: argmax_rows(F.linear(rms_norm(x, nw, 1e-6), dw)),
        "unfused_int8": lambda x: argmax_rows(int8_linear(rms_norm(x, nw, 1e-6), q, s)),
        "fused_bf16": lambda x: greedy_lm_head_triton(x, dw, norm_weight=nw, eps=1e-6),
        "fused_int8": lambda x: greedy_lm_head_triton(x, q, norm_weight=nw, eps=1e-6, scale=s),
    }


def sweep_blocks(elem_bytes):
    out = []
    widths = (8, 16, 32) if elem_bytes == 2 else (16, 32, 64)
    for bn in widths:
        for tiles in (1, 4):
            for warps in (2, 4, 8):
                out.append(GreedyBlocks(bn, tiles, warps, 512, 64))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    g = torch.Generator(device=DEV).manual_seed(0)
    w, layers, target_head, head_layer, x = step_weights(g)
    nw = (1 + 0.1 * torch.randn(H, device=DEV, generator=g)).bfloat16()
    res = {"device": torch.cuda.get_device_properties(0).name,
           "policy": {f"{m}x{eb}": choose_greedy_blocks(m, H, eb)
                      for m in (1, 2, 4) for eb in (1, 2)}}
    rows, agree = [], []
    stream = torch.cuda.Stream()
    for vocab in (49152, 32000):
        dw = w(vocab)
        q, s = quantize_int8_rows(dw)
        for m in (1, 2, 4):
            xd = torch.randn(m, H, device=DEV, generator=g).bfloat16()
            vs = variants(dw, q, s, nw)
            for kind in ("bf16", "int8"):  # how often the fused ids equal the unfused ones
                xs = torch.randn(512, H, device=DEV, generator=g).bfloat16()
                same = sum(torch.equal(vs[f"fused_{kind}"](xs[i:i + m]),
                                       vs[f"unfused_{kind}"](xs[i:i + m]))
                           for i in range(0, 512, m))
                agree.append({"draft_vocab": vocab, "rows": m, "weight": kind,
                              "equal_calls": same, "calls": 512 // m})
            for rep in range(2):
                for name, draft in vs.items():
                    us, graph = diag_l2_persist.time_graph(
                        step_fn(layers, target_head, head_layer, draft, x, xd), stream)
                    row = {"draft_vocab": vocab, "rows": m, "variant": name, "rep": rep,
                           "graph_us": round(us, 1)}
                    if rep == 0:
                        means, names = kernel_times(graph)
                        # the draft path: every kernel after the second head layer's last
                        # projection
                        tail = len(means) - 1 - [i for i, n in enumerate(names)
                                                 if "small_linear" in n][-1]
                        row["draft_us"] = round(sum(means[-tail:]), 2)
                        row["draft_kernels"] = [[n[:40], round(t, 2)] for n, t
                                                in zip(names[-tail:], means[-tail:])]
                    rows.append(row)
                    print(row, flush=True)
                    del graph
        if args.sweep and vocab == 49152:
            xd = torch.randn(1, H, device=DEV, generator=g).bfloat16()
            for kind, wt, sc in (("bf16", dw, None), ("int8", q, s)):
                for cfg in sweep_blocks(wt.element_size()):
                    def draft(x, wt=wt, sc=sc, cfg=cfg):
                        return greedy_lm_head_triton(x, wt, norm_weight=nw, eps=1e-6, scale=sc,
                                                     blocks=cfg)
                    try:
                        us, graph = diag_l2_persist.time_graph(
                            step_fn(layers, target_head, head_layer, draft, x, xd), stream)
                    except Exception as e:  # resources the compiler rejects
                        rows.append({"draft_vocab": vocab, "variant": f"sweep_{kind}",
                                     "blocks": cfg, "error": repr(e)[:160]})
                        continue
                    rows.append({"draft_vocab": vocab, "rows": 1, "variant": f"sweep_{kind}",
                                 "blocks": cfg, "graph_us": round(us, 1)})
                    print(rows[-1], flush=True)
                    del graph
    res["rows"] = rows
    res["agreement"] = agree
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "diag_greedy_lm_head.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
