"""What does an int8 draft LM head save in a speculative step? A device experiment, no model.

    PYTHONPATH=$PWD python3 benchmarks/diag_draft_lm_head.py --out $OUT

An EAGLE-3 k = 2 step at batch 1 reads its draft LM head twice (one read a draft token); at
SmolLM2's 49152 x 576 bf16 that is 56.6 MB, ~16 us a read, ~5% of the step (run 21's listing).
This times a graph shaped like that step (diag_l2_persist.py's: 30 one-row GEMVs over a layer's
7.1 MB each, the target's LM head, then twice [the head's layer, the draft LM head]) with the
draft LM head as cuBLAS over bf16 (today's path), the few-row Triton kernel over bf16, and the
same kernel over an int8 copy with a per-row scale (kernels/int8_linear.py), for
draft vocabularies of 32000 and 49152 ids; it also checks the int8 kernel against its
reference on the tensor-core path. Writes $OUT/diag_draft_lm_head.json.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.archive import diag_l2_persist  # noqa: E402
from benchmarks.archive.diag_l2_persist import step_fn, step_weights  # noqa: E402
from outpace.kernels.int8_linear import (  # noqa: E402
    int8_linear_ref, int8_linear_triton, quantize_int8_rows)
from outpace.kernels.skinny_gemm import Blocks, choose_blocks, small_linear_triton  # noqa: E402

DEV = "cuda"
H = 576


def time_graph(fn, reps=200):
    return diag_l2_persist.time_graph(fn, torch.cuda.Stream(), reps)


def kernel_means(graph, reps=5):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    ks = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                key=lambda e: e.time_range.start)
    durs = [e.time_range.end - e.time_range.start for e in ks]
    per = len(durs) // reps
    return [sum(durs[r * per + i] for r in range(reps)) / reps for i in range(per)]


def check_int8(g):
    rows = []
    for m in (1, 3, 8):
        for n in (32000, 49152, 1000):
            w = torch.randn(n, H, device=DEV, generator=g) / H ** 0.5
            q, s = quantize_int8_rows(w)
            x = torch.randn(m, H, device=DEV, generator=g).bfloat16()
            y = int8_linear_triton(x, q, s).float()
            r = int8_linear_ref(x, q, s).float()
            rows.append({"m": m, "n": n, "max_abs_err": (y - r).abs().max().item(),
                         "ref_max": r.abs().max().item()})
    return rows


def sweep_configs(vocab):
    out = []
    for bn in (32, 64, 128, 256):
        for bk in (64, 128, 256):
            for warps in (4, 8):
                for stages in (2, 3, 4):
                    if stages * bk * (bn + 32) > 160 * 1024 or (bn == 256 and warps == 4):
                        continue
                    out.append(Blocks(16, bn, bk, warps, stages, True))
    for bn in (4, 8, 16, 32):
        for bk, tail in ((1024, 0), (512, 64)):
            for warps in (2, 4, 8):
                if bn * (bk + tail) > 32768:
                    continue
                out.append(Blocks(1, bn, bk, warps, 2, False, tail))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--sweep", action="store_true",
                    help="also time forced launch configurations of the int8 kernel")
    args = ap.parse_args()
    g = torch.Generator(device=DEV).manual_seed(0)
    res = {"device": torch.cuda.get_device_properties(0).name, "check": check_int8(g)}
    print(res["check"], flush=True)
    w, layers, target_head, head_layer, x = step_weights(g)
    rows = []
    for vocab in (32000, 49152):
        dw = w(vocab)
        q, s = quantize_int8_rows(dw)
        variants = {"cublas_bf16": lambda x, dw=dw: F.linear(x, dw),
                    "triton_bf16": lambda x, dw=dw: small_linear_triton(x, dw),
                    "triton_int8": lambda x, q=q, s=s: int8_linear_triton(x, q, s)}
        for rep in range(2):
            for name, draft in variants.items():
                us, graph = time_graph(step_fn(layers, target_head, head_layer, draft, x))
                mean = kernel_means(graph)
                ok = len(mean) == 41
                rows.append({"draft_vocab": vocab, "variant": name, "rep": rep,
                             "graph_us": round(us, 1), "kernels": len(mean),
                             "draft_heads_us": [round(mean[35], 2), round(mean[40], 2)]
                             if ok else None})
                print(rows[-1], flush=True)
                del graph
        if args.sweep and vocab == 49152:
            for cfg in sweep_configs(vocab):
                draft = (lambda x, q=q, s=s, cfg=cfg: int8_linear_triton(x, q, s, blocks=cfg))
                try:
                    us, graph = time_graph(step_fn(layers, target_head, head_layer, draft, x))
                except Exception as e:  # a config the compiler rejects (resources)
                    rows.append({"draft_vocab": vocab, "variant": "sweep", "blocks": cfg,
                                 "error": repr(e)[:200]})
                    continue
                mean = kernel_means(graph)
                rows.append({"draft_vocab": vocab, "variant": "sweep", "blocks": cfg,
                             "graph_us": round(us, 1),
                             "draft_heads_us": [round(mean[35], 2), round(mean[40], 2)]
                             if len(mean) == 41 else None})
                print(rows[-1], flush=True)
                del graph
    res["default_blocks"] = choose_blocks(1, 49152, H, elem_bytes=1)
    res["rows"] = rows
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "diag_draft_lm_head.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
