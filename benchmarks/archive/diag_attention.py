"""The attention kernel alone at batch 1, SmolLM2's heads (9 query, 3 KV, 64 wide): us a launch
for a decode (1 query token), a verify (3) and a draft-loop step (1 token under a bound of 3),
at several contexts, with the split-KV factor, the prefetch variant and the fused merge varied,
and in an engine-sized pool. --prefill: a short prompt's prefill instead (one sequence of T
query tokens from position 0, causal), under other tile shapes and split-KV factors.
Launched without PDL, 20 to a CUDA graph, so each time is the kernel's own (L2-warm KV, or
from HBM where another buffer is read before each launch).

    python benchmarks/diag_attention.py [--out DIR] [--prefill]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

HQ, HKV, D, BS = 9, 3, 64, 16


def case(ctx: int, q_len: int, bound: int, splits: int, prefetch: bool, fused: bool,
         dtype=torch.bfloat16, reps: int = 20, pool: tuple = (), flush_mb: int = 0) -> float:
    """pool: (layer slots, blocks) of an engine-sized pool, the sequence in consecutive blocks
    from block 1 of the last slot (as the pool hands them out); else a pool just big enough,
    the blocks in random order. flush_mb: before each launch read that many MB of another
    buffer, so the KV comes from HBM (the time is then the graph's less a graph of the reads
    alone)."""
    from outpace.attention.base import AttentionMetadata
    from outpace.attention.triton_paged import paged_attention
    dev = "cuda"
    seq = ctx + q_len
    blocks = -(-seq // BS) + 1
    g = torch.Generator(device=dev).manual_seed(ctx + q_len)
    slots, pool_blocks = pool or (1, blocks + 1)
    kv = torch.randn(slots, 2, pool_blocks, BS, HKV, D, device=dev, generator=g).to(dtype)
    if pool:
        table = torch.arange(1, blocks + 1, device=dev, dtype=torch.int32)[None]
    else:
        table = torch.randperm(blocks, device=dev, generator=g).add_(1).to(torch.int32)[None]
    q = torch.randn(q_len, HQ, D, device=dev, generator=g).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.full((q_len,), -1, device=dev, dtype=torch.int64),
        query_start_loc=torch.tensor([0, q_len], device=dev, dtype=torch.int32),
        seq_lens=torch.tensor([seq], device=dev, dtype=torch.int32), block_tables=table,
        query_start_loc_host=[0, q_len], seq_lens_host=[seq], max_query_len=bound,
        max_seq_len=seq)
    counters = torch.zeros(132, device=dev, dtype=torch.int32) if fused else None

    def run():
        return paged_attention(q, kv, slots - 1, meta, D ** -0.5, splits, 64, counters,
                               prefetch)
    flush = torch.ones(flush_mb << 19, dtype=torch.bfloat16, device=dev)

    def flushed_run():
        if flush_mb:
            flush.sum(dtype=torch.float32)
        return run()

    def flush_only():
        flush.sum(dtype=torch.float32)
    run()
    torch.cuda.synchronize()
    us = graph_us(flushed_run, reps)
    return round(us - (graph_us(flush_only, reps) if flush_mb else 0.0), 2)


def graph_us(fn, reps: int) -> float:
    """Best us a call of `fn`, captured `reps` times in one CUDA graph."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, 1000 * start.elapsed_time(end) / (10 * reps))
    return best


def prefill_rows() -> list:
    """us a launch of a T-token prompt's attention (T = 32 .. 256, SmolLM2's heads) with the
    tiles choose_tiles gives (the first row of each T) and other (rows a tile, KV columns a
    step, warps) and split-KV factors."""
    import outpace.attention.triton_paged as tp
    orig = tp.choose_tiles
    gp = 4  # 3 query heads a KV head, padded
    rows = []
    for t in (32, 64, 96, 128, 192, 256):
        base = orig(t, HQ // HKV, D, torch.bfloat16)
        shapes = [None] + [(bm, bn, w) for bm in (32, 64, 128) for bn in (32, 64)
                           for w in (4, 8) if (bm, bn, w) != (base.block_m, base.block_n,
                                                              base.num_warps)]
        for shape in shapes:
            for splits in (1, 2, 4):
                if shape is None:
                    tp.choose_tiles = orig
                else:
                    bm, bn, w = shape
                    cfg = tp.TileConfig(bm // gp, bm, bn, w, 2)
                    tp.choose_tiles = lambda *a, cfg=cfg: cfg
                try:
                    us = case(0, t, t, splits, False, splits > 1)
                except Exception as e:  # a shape that does not compile: report, go on
                    print(t, shape, splits, "failed:", repr(e)[:200], flush=True)
                    continue
                finally:
                    tp.choose_tiles = orig
                cfg = shape or (base.block_m, base.block_n, base.num_warps)
                rows.append(dict(kind="prefill", q_len=t, block_m=cfg[0], block_n=cfg[1],
                                 warps=cfg[2], splits=splits, current=shape is None, us=us))
                print(rows[-1], flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/out")
    ap.add_argument("--prefill", action="store_true")
    args = ap.parse_args()
    import outpace.kernels.pdl as pdl
    pdl.ENABLED = False
    if args.prefill:
        rows = prefill_rows()
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "diag_attention_prefill.json").write_text(json.dumps(rows, indent=1) + "\n")
        return
    rows = []
    for ctx in (100, 200, 400):
        for name, q_len, bound in (("decode", 1, 1), ("verify", 3, 3), ("loop", 1, 3)):
            for splits in (1, 4, 8):
                for prefetch in (True, False):
                    for fused in ((True, False) if splits > 1 else (False,)):
                        us = case(ctx, q_len, bound, splits, prefetch, fused)
                        rows.append(dict(ctx=ctx, kind=name, q_len=q_len, bound=bound,
                                         splits=splits, prefetch=prefetch, fused_merge=fused,
                                         us=us))
                        print(rows[-1], flush=True)
    for ctx in (200,):
        for name, q_len in (("decode", 1), ("verify", 3)):
            us = case(ctx, q_len, q_len, 8, True, True, dtype=torch.float32)
            rows.append(dict(ctx=ctx, kind=name + "-fp32", q_len=q_len, bound=q_len, splits=8,
                             prefetch=True, fused_merge=True, us=us))
            print(rows[-1], flush=True)
    # An engine-sized pool (SmolLM2 + an EAGLE-3 head: 31 layer slots, the diagnostics' 8192
    # blocks): does the KV's place in a 3 GB pool change the kernel's time?
    for name, q_len in (("decode", 1), ("verify", 3)):
        us = case(200, q_len, q_len, 8, True, True, pool=(31, 8192))
        rows.append(dict(ctx=200, kind=name + "-pool31x8192", q_len=q_len, bound=q_len,
                         splits=8, prefetch=True, fused_merge=True, us=us))
        print(rows[-1], flush=True)
    # KV from HBM: another buffer read before each launch (an L2 of 50 MB holds none of it
    # after 64 MB; 256 MB as a step's weights), against the same with no read (0)
    for flush_mb in (0, 64, 256):
        for name, q_len, bound in (("decode", 1, 1), ("verify", 3, 3), ("loop", 1, 3)):
            us = case(200, q_len, bound, 8, True, True, pool=(31, 8192), flush_mb=flush_mb)
            rows.append(dict(ctx=200, kind=f"{name}-pool31x8192-flush{flush_mb}", q_len=q_len,
                             bound=bound, splits=8, prefetch=True, fused_merge=True,
                             flush_mb=flush_mb, us=us))
            print(rows[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "diag_attention.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
