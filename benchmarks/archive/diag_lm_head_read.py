"""How fast can a batch-1 step read an LM head? A device experiment, no model.

    PYTHONPATH=$PWD python3 benchmarks/diag_lm_head_read.py --out $OUT [--gemv]

Default: would prefetching an LM head into L2, on a side branch of the step's graph, pay?
At batch 1 a step is a chain of latency-bound kernels (~0.5 TB/s of HBM used on average) and then
an LM head GEMV that is bandwidth-bound (SmolLM2's 49152 x 576, 56.6 MB, ~16 us through cuBLAS);
an EAGLE-3 k = 2 step reads three of them. Run 22 saw a second read of an LM head run faster when
part of the first read's lines were still in L2. So: while the last target layers (or the draft
head's layer) run, a kernel on a forked stream could read the LM head's first P MB into L2, and
the GEMV after the join would find them there. This times a graph shaped like that step (30
"layers" of the few-row projections at one row, PDL, ~7.1 MB each, then norm, LM head and argmax;
then twice a head layer and a draft LM head) with and without the prefetch branch, for several
prefetch sizes and instruction kinds, and lists the GEMV's own time under the profiler.
Writes $OUT/diag_l2_prefetch.json.

--gemv: the product itself in other forms (F.linear, torch.mv, a pre-transposed weight, more
rows, the few-row Triton kernel), 20 to a graph, each after a 256 MB read of another buffer
(L2-cold, as in a step) and without it (L2-warm: the 54 MB head mostly in the 60 MB L2), so the
kernel's own limit shows apart from HBM's. Writes $OUT/diag_lm_head_gemv.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

DEV = "cuda"
H, INTER, QKV = 576, 1536, 960
VOCAB = 49152
LINE = 128


@triton.jit
def _prefetch_kernel(base, w_ptr, sink_ptr, n_units, units_per_prog, UNIT: tl.constexpr,
                     MODE: tl.constexpr, BLOCK: tl.constexpr):
    # MODE 0: prefetch.global.L2::evict_last per 128-byte line; 1: cp.async.bulk.prefetch.L2
    # of UNIT bytes a lane; 2: loads (evict_last) summed into a never-taken store.
    pid = tl.program_id(0)
    start = pid * units_per_prog
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, units_per_prog, BLOCK):
        idx = start + i + tl.arange(0, BLOCK)
        ok = idx < n_units
        if MODE == 0:
            addr = base + tl.where(ok, idx, 0).to(tl.int64) * UNIT
            tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;",
                                      "=r,l", [addr], dtype=tl.int32, is_pure=False, pack=1)
        elif MODE == 1:
            addr = base + tl.where(ok, idx, 0).to(tl.int64) * UNIT
            size = tl.full([BLOCK], UNIT, tl.int32)
            tl.inline_asm_elementwise(
                "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
                "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)
        else:
            v = tl.load(w_ptr + idx.to(tl.int64) * (UNIT // 2), mask=ok, other=0.0,
                        eviction_policy="evict_last")
            acc += v.to(tl.float32)
    if MODE == 2:
        s = tl.sum(acc, axis=0)
        if s == 1234.5:
            tl.store(sink_ptr, s)


def prefetch(w: torch.Tensor, mb: float, mode: int, progs: int, sink: torch.Tensor) -> None:
    nbytes = min(int(mb * 2 ** 20), w.numel() * w.element_size())
    unit = 16384 if mode == 1 else LINE  # bytes a lane asks for (mode 2 loads one bf16 of it)
    n = nbytes // unit
    per = -(-n // progs)
    _prefetch_kernel[(progs,)](w.data_ptr(), w, sink, n, per, UNIT=unit, MODE=mode,
                               BLOCK=32 if mode == 1 else 128, num_warps=1 if mode == 1 else 4)


def make_layers(n: int, gen: torch.Generator) -> list:
    def w(*shape):
        return (torch.randn(*shape, device=DEV, generator=gen) * 0.02).to(torch.bfloat16)
    return [dict(qkv=w(QKV, H), o=w(H, H), gu=w(2 * INTER, H), down=w(H, INTER),
                 n1=torch.ones(H, device=DEV, dtype=torch.bfloat16),
                 n2=torch.ones(H, device=DEV, dtype=torch.bfloat16)) for _ in range(n)]


def layer(x: torch.Tensor, p: dict) -> torch.Tensor:
    from outpace.kernels.skinny_gemm import (norm_small_linear, norm_small_linear_silu_mul,
                                              small_linear)
    q = norm_small_linear(x, p["n1"], 1e-5, p["qkv"])
    h = small_linear(q[:, :H].contiguous(), p["o"], residual=x)
    g = norm_small_linear_silu_mul(h, p["n2"], 1e-5, p["gu"])
    return small_linear(g, p["down"], residual=h)


def lm_head(x: torch.Tensor, nw: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    from outpace.kernels.argmax import argmax_rows
    from outpace.kernels.norm import rms_norm
    return argmax_rows(F.linear(rms_norm(x, nw, 1e-5), w))


def build(v: dict, target: list, head: list, lm: torch.Tensor, dlm: torch.Tensor,
          nw: torch.Tensor, x0: torch.Tensor, sink: torch.Tensor, side: torch.Stream):
    """The step for variant v: {'target_mb', 'draft_mb', 'mode', 'progs', 'lead', 'drafts'}."""
    main = torch.cuda.current_stream()

    def fork(w, mb):
        if mb <= 0:
            return False
        side.wait_stream(main)
        with torch.cuda.stream(side):
            prefetch(w, mb, v["mode"], v["progs"], sink)
        return True

    def join(forked):
        if forked:
            main.wait_stream(side)

    def step():
        x = x0
        n = len(target)
        forked = False
        for i, p in enumerate(target):
            if i == n - v["lead"]:
                forked = fork(lm, v["target_mb"])
            x = layer(x, p)
        join(forked)
        outs = [lm_head(x, nw, lm)]
        h = x
        for _ in range(v["drafts"]):
            forked = fork(dlm, v["draft_mb"])
            for p in head:
                h = layer(h, p)
            join(forked)
            outs.append(lm_head(h, nw, dlm))
        return outs
    return step


def time_graph(step, reps: int) -> tuple:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for _ in range(10):
        g.replay()
    torch.cuda.synchronize()
    best = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        b.synchronize()
        best.append(a.elapsed_time(b) / reps * 1000)
    return g, sorted(best)[len(best) // 2]


def gemv_times(g, reps: int = 20) -> list:
    """Durations (us) of the graph's cuBLAS kernels, averaged over replays, in graph order."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type.name == "CUDA"
           and ("nvjet" in e.name or "gemv" in e.name.lower() or "gemm" in e.name.lower())]
    per = len(evs) // reps if reps else 0
    if per == 0:
        return []
    return [round(sum(e.device_time for e in evs[j::per]) / reps, 2) for j in range(per)]


def gemv_forms(vocab: int, reps: int) -> list:
    from outpace.kernels.skinny_gemm import small_linear
    gen = torch.Generator(device=DEV).manual_seed(1)
    w = (torch.randn(vocab, H, device=DEV, generator=gen) * 0.02).to(torch.bfloat16)
    wt = w.t().contiguous()
    xs = {m: torch.randn(m, H, device=DEV, generator=gen).to(torch.bfloat16) for m in (1, 3, 8)}
    flush = torch.ones(256 << 19, dtype=torch.bfloat16, device=DEV)
    half = vocab // 2
    forms = {
        "linear": lambda: F.linear(xs[1], w),
        "linear_3rows": lambda: F.linear(xs[3], w),
        "linear_8rows": lambda: F.linear(xs[8], w),
        "mv": lambda: torch.mv(w, xs[1][0]),
        "matmul_col": lambda: torch.matmul(w, xs[1].t()),
        "mm_pretransposed": lambda: torch.mm(xs[1], wt),
        "linear_two_halves": lambda: (F.linear(xs[1], w[:half]), F.linear(xs[1], w[half:])),
        "small_linear": lambda: small_linear(xs[1], w),
        "small_linear_3rows": lambda: small_linear(xs[3], w),
    }
    rows = []
    for cold in (True, False):
        def graph_of(fn, n=20):
            def run():
                for _ in range(n):
                    if cold:
                        flush.sum(dtype=torch.float32)
                    if fn is not None:
                        fn()
            return time_graph(run, max(reps // 5, 10))[1]
        base = graph_of(None)
        for name, fn in forms.items():
            try:
                us = (graph_of(fn) - base) / 20
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"{name}: failed: {type(e).__name__}: {e}", flush=True)
                continue
            tbs = w.numel() * 2 / (us * 1e-6) / 1e12
            rows.append(dict(form=name, l2="cold" if cold else "warm", us=round(us, 2),
                             tb_s=round(tbs, 2)))
            print(f"{name:20s} {'cold' if cold else 'warm'}  {us:7.2f} us  {tbs:5.2f} TB/s",
                  flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--gemv", action="store_true")
    args = ap.parse_args()
    if args.gemv:
        rows = gemv_forms(args.vocab, args.reps)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "diag_lm_head_gemv.json").write_text(json.dumps(dict(
            device=torch.cuda.get_device_name(), torch=torch.__version__,
            triton=triton.__version__, time=time.strftime("%Y-%m-%d %H:%M:%S"), rows=rows),
            indent=1))
        return
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    gen = torch.Generator(device=DEV).manual_seed(0)
    target = make_layers(30, gen)
    head = make_layers(1, gen)
    lm = (torch.randn(args.vocab, H, device=DEV, generator=gen) * 0.02).to(torch.bfloat16)
    dlm = (torch.randn(args.vocab, H, device=DEV, generator=gen) * 0.02).to(torch.bfloat16)
    nw = torch.ones(H, device=DEV, dtype=torch.bfloat16)
    x0 = (torch.randn(1, H, device=DEV, generator=gen)).to(torch.bfloat16)
    sink = torch.zeros(1, device=DEV)
    side = torch.cuda.Stream()
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 0)
    print(f"{props.name}: L2 {l2 / 2 ** 20:.0f} MB, LM head {lm.numel() * 2 / 2 ** 20:.1f} MB",
          flush=True)
    base = dict(target_mb=0, draft_mb=0, mode=0, progs=32, lead=4, drafts=2)
    variants = [("none", {})]
    for mode in (0, 1, 2):
        for mb in (24, 40, 56):
            variants.append((f"m{mode}_t{mb}_d{mb}", dict(mode=mode, target_mb=mb,
                                                          draft_mb=mb)))
    variants += [("m1_t40_d40_p8", dict(mode=1, target_mb=40, draft_mb=40, progs=8)),
                 ("m1_t40_d40_p132", dict(mode=1, target_mb=40, draft_mb=40, progs=132)),
                 ("m0_t40_d40_p132", dict(mode=0, target_mb=40, draft_mb=40, progs=132)),
                 ("m1_t40_lead2", dict(mode=1, target_mb=40, lead=2)),
                 ("m1_t40_lead8", dict(mode=1, target_mb=40, lead=8)),
                 ("m1_t40_only", dict(mode=1, target_mb=40)),
                 ("m1_d40_only", dict(mode=1, draft_mb=40)),
                 ("none_nodraft", dict(drafts=0)),
                 ("m1_t40_nodraft", dict(mode=1, target_mb=40, drafts=0)),
                 ("m1_t56_nodraft", dict(mode=1, target_mb=56, drafts=0)),
                 ("none", {})]
    rows = []
    ref = None
    for name, over in variants:
        v = dict(base, **over)
        step = build(v, target, head, lm, dlm, nw, x0, sink, side)
        try:
            g, us = time_graph(step, args.reps)
            outs = step()
            toks = [int(t.item()) for t in outs]
            gem = gemv_times(g)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"{name}: failed: {type(e).__name__}: {e}", flush=True)
            rows.append(dict(name=name, error=f"{type(e).__name__}: {e}"))
            continue
        if v["drafts"] == 2 and ref is None:
            ref = toks
        same = ref is None or v["drafts"] != 2 or toks == ref
        rows.append(dict(name=name, variant=v, graph_us=round(us, 2), gemv_us=gem, same=same))
        print(f"{name:22s} graph {us:8.2f} us  gemv {gem}  same {same}", flush=True)
        del g
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "diag_l2_prefetch.json").write_text(json.dumps(dict(
        device=props.name, l2_bytes=l2, torch=torch.__version__, triton=triton.__version__,
        time=time.strftime("%Y-%m-%d %H:%M:%S"), rows=rows), indent=1))


if __name__ == "__main__":
    main()
