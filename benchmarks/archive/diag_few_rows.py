"""Which few-row projection configuration makes a verify step (q = 2 .. 5 rows a request) cheap
inside the real graph (PDL chains, L2-cold weights, the norm / rope / silu fusions), on the GPU
machine: batch-1 TPOT and the chained graph's time of no-spec and EAGLE-3 force-accept 3 engines
(k = 2, 4) under several block policies for 2 <= M <= 8 rows.

In isolation (bench_small_linear.py's sweep) tl.dot at M = 5 ran as fast as M = 1; in the step's
graph the target's layers at q = 5 took 1.7x those at q = 1 (diag_step.py, run 10).

    python benchmarks/diag_few_rows.py --gguf PATH [--out DIR]
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import diag_setup, make_heads, run_engine  # noqa: E402
from benchmarks.common import graph_ms as gpu_ms  # noqa: E402


def policies(orig):
    """name -> choose_blocks replacement (rows 2 .. 8 of small weights only). mMnNkKwW: the
    broadcast path with BLOCK_M, BLOCK_N, BLOCK_K (0: the whole row up to 2048, as choose_blocks
    takes it) and num_warps; dot: tl.dot as choose_blocks configures it."""
    from outpace.kernels.skinny_gemm.blocks import Blocks

    def few(m, n, k):
        return 2 <= m <= 8 and n <= 4096

    def bcast(block_m, block_n, block_k=0, warps=4, tail=False):
        # tail: a one-step row split into two tiles as choose_blocks does (tail_k)
        def f(m, n, k, **kw):
            if not few(m, n, k):
                return orig(m, n, k, **kw)
            kmax = max(1 << (k - 1).bit_length(), 16)
            bk = block_k or (kmax if kmax <= 2048 else 1024)
            bm = min(block_m, 1 << (m - 1).bit_length())
            bk, tk = min(bk, kmax), 0
            if tail and bk == kmax:  # choose_blocks' split of this K (a 2-row query has it)
                split = orig(2, 2, k)
                if split.tail_k:
                    bk, tk = split.block_k, split.tail_k
            return Blocks(bm, block_n, bk, warps, 2, False, tk)
        return f

    def dot(m, n, k, **kw):
        if not few(m, n, k):
            return orig(m, n, k, **kw)
        kw.pop("use_dot", None)
        return orig(m, n, k, use_dot=True, **kw)

    def warps(w, rows=(2, 8)):
        # the current configuration with num_warps = w on the broadcast path, rows in `rows`
        def f(m, n, k, **kw):
            b = orig(m, n, k, **kw)
            if b.use_dot or not rows[0] <= m <= rows[1]:
                return b
            return b._replace(num_warps=w)
        return f

    # tl.dot for one kind of projection only (rows 2 .. 4), told apart by shape and fusion:
    # SmolLM2's norm + gate_up + silu (gate_up, norm, N = I = 1536), norm + qkv + rope + store
    # (gate_up, N = 480), o (576 x 576, residual) and down (K = 1536); the EAGLE-3 head's
    # projections have the same shapes except its qkv (K = 1152) and fc (K = 1728).
    kinds = {"gu": lambda n, k, kw: kw.get("gate_up") and n >= 1024,
             "qkv": lambda n, k, kw: kw.get("gate_up") and n < 1024,
             "o": lambda n, k, kw: not kw.get("gate_up") and k < 1024,
             "down": lambda n, k, kw: not kw.get("gate_up") and k >= 1024}

    def picks(names, rows, m, n, k, kw):
        # whether a launch is one of these kinds of small projection at these rows
        return rows[0] <= m <= rows[1] and n <= 4096 and any(kinds[x](n, k, kw) for x in names)

    def dot_for(names, rows=(2, 4), tile=None):
        # tile: (block_n, block_k, warps, stages) replacing choose_blocks' tl.dot choice
        def f(m, n, k, **kw):
            if not picks(names, rows, m, n, k, kw):
                return orig(m, n, k, **kw)
            kw.pop("use_dot", None)
            b = orig(m, n, k, use_dot=True, **kw)
            if tile is not None:
                b = Blocks(b.block_m, tile[0], tile[1], tile[2], tile[3], True)
            return b
        return f

    def tweak_for(names, rows=(2, 3), **fields):
        # the current broadcast configuration of some kinds of projection with `fields`
        # (block_n, num_warps, ...) replaced, at `rows`
        def f(m, n, k, **kw):
            b = orig(m, n, k, **kw)
            if b.use_dot or not picks(names, rows, m, n, k, kw):
                return b
            return b._replace(**fields)
        return f

    def no_tail(rows=(1, 16)):
        # K read as one padded power-of-two tile (before the tail_k split), rows in `rows`
        def f(m, n, k, **kw):
            b = orig(m, n, k, **kw)
            if not b.tail_k or not rows[0] <= m <= rows[1]:
                return b
            return b._replace(block_k=b.block_k * 2, tail_k=0)
        return f

    def constants(**values):
        # choose_blocks itself (uncached) with some of its module constants changed
        import outpace.kernels.skinny_gemm.blocks as sl

        def f(m, n, k, **kw):
            saved = {name: getattr(sl, name) for name in values}
            for name, v in values.items():
                setattr(sl, name, v)
            try:
                return orig.__wrapped__(m, n, k, **kw)
            finally:
                for name, v in saved.items():
                    setattr(sl, name, v)
        return f

    def row_warps(rows=(2, 3, 4), block_n=2, block_m=0, k_max=2048, only=None, warps=0):
        # a warp a row (small_linear_blocks.row_warps_blocks) at these row counts, for rows of
        # at most k_max columns and `only` these kinds of projection (None: all); block_m: rows a
        # program (0: all of them); warps: fewer warps than rows (each multiplies several)
        from outpace.kernels.skinny_gemm.blocks import row_warps_blocks

        def f(m, n, k, **kw):
            b = orig(m, n, k, **kw)
            if (m in rows and not b.use_dot and k <= k_max
                    and (only is None or any(kinds[x](n, k, kw) for x in only))):
                rw = row_warps_blocks(k, block_m or (1 << (m - 1).bit_length()), block_n)
                return rw._replace(num_warps=warps) if warps else rw
            return b
        return f

    def as_one_row(m, n, k, **kw):
        # every row its own program, configured as a one-row launch (4 warps, one padded tile)
        if not few(m, n, k):
            return orig(m, n, k, **kw)
        return orig(1, n, k, **kw)

    def row_invariant(like: int):
        # every launch of at most 16 rows with one configuration whatever its row count, so a
        # row's order of summation (and bits) does not depend on the rows beside it: the one a
        # launch of `like` rows gets (1: four warps over one padded tile; 3: the verify's one
        # warp with the tail split), one row a program; tl.dot launches (LM heads) as at one row
        def f(m, n, k, **kw):
            if m > 16:
                return orig(m, n, k, **kw)
            b = orig(like, n, k, **kw)
            return orig(1, n, k, **kw) if b.use_dot else b
        return f

    def row_invariant_rw(m3_rows: int):
        # every launch of at most 16 rows of a small weight (K <= 1536, N <= 4096) a warp a
        # row (row_warps_blocks: each row reduced inside its own warp, in an order set by K
        # alone): 1 row a program at M = 1, 2 at M = 2, m3_rows at M = 3 (4: one program with a
        # padding warp; 1: three one-warp programs), 4 above; LM heads (tl.dot) as at one row
        from outpace.kernels.skinny_gemm.blocks import row_warps_blocks

        def f(m, n, k, **kw):
            if m > 16:
                return orig(m, n, k, **kw)
            b = orig(1, n, k, **kw)
            if b.use_dot or k > 1536 or n > 4096:
                return b
            bm = {1: 1, 2: 2, 3: m3_rows}.get(m, 4)
            return row_warps_blocks(k, bm, 2)
        return f

    def one_row_rw(base):
        # one-row launches of small weights a warp a row (one-warp programs), others as `base`
        from outpace.kernels.skinny_gemm.blocks import row_warps_blocks

        def f(m, n, k, **kw):
            b = base(m, n, k, **kw)
            if m != 1 or b.use_dot or k > 1536 or n > 4096:
                return b
            return row_warps_blocks(k, 1, 2)
        return f

    old3 = constants(_ROW_WARPS={2: (2, 2), 4: (2, 4)})  # 3 rows as before run 32
    return {"current": orig, "dot": dot, "as_m1": as_one_row, "old3": old3,
            "m1_rw1": one_row_rw(orig), "m1_rw1_old3": one_row_rw(old3),
            "inv_rw4": row_invariant_rw(4), "inv_rw1": row_invariant_rw(1),
            "inv_m1": row_invariant(1), "inv_m3": row_invariant(3),
            # a warp a row (the default at 2 and 4 rows), in other shapes and at 3 rows
            "no_rw": constants(_ROW_WARPS={}), "rw": row_warps(), "rw_n4": row_warps(block_n=4),
            "rw_m2": row_warps(block_m=2), "rw3_m2n4": row_warps((3,), 4, 2, 1536),
            "rw3_m1": row_warps((3,), 2, 1, 1536), "rw3_m4w2": row_warps((3,), 2, 4, 1536, warps=2),
            "rw3_m4": row_warps((3,), 2, 4, 1536), "rw3_m4n4": row_warps((3,), 4, 4, 1536),
            "rw3_gu": row_warps((3,), only=["gu"]), "rw3_down": row_warps((3,), only=["down"]),
            "rw3_qkv": row_warps((3,), only=["qkv"]), "rw3_o": row_warps((3,), only=["o"]),
            "rows1": constants(_SUM_ROWS=1), "rows1_m8": constants(_SUM_ROWS=1, _SUM_MAX_M=8),
            "rows1_m16": constants(_SUM_ROWS=1, _SUM_MAX_M=16),
            "rows2_m8": constants(_SUM_MAX_M=8),
            "m1n2w1t": bcast(1, 2, warps=1, tail=True), "m1n4w1t": bcast(1, 4, warps=1, tail=True),
            "m1n2w2t": bcast(1, 2, warps=2, tail=True), "m1n1w1t": bcast(1, 1, warps=1, tail=True),
            "m1n2w1": bcast(1, 2, warps=1), "notail": no_tail(), "notail_m1": no_tail((1, 1)),
            "notail_few": no_tail((2, 16)),
            "dot_gu": dot_for(["gu"]), "dot_qkv": dot_for(["qkv"]), "dot_o": dot_for(["o"]),
            "dot_down": dot_for(["down"]), "dot_gu_down": dot_for(["gu", "down"]),
            "dot_gu_qkv": dot_for(["gu", "qkv"]),
            "dot_gu_n32": dot_for(["gu"], tile=(32, 64, 4, 3)),
            "dot_gu_k64": dot_for(["gu"], tile=(16, 64, 4, 3)),
            "dot_gu_k64w2": dot_for(["gu"], tile=(16, 64, 2, 3)),
            "dot_gu_k256s2": dot_for(["gu"], tile=(16, 256, 4, 2)),
            "dot_gu1": dot_for(["gu"], rows=(1, 4)),
            "m4n2w1t": bcast(4, 2, warps=1, tail=True), "m2n4w1t": bcast(2, 4, warps=1, tail=True),
            "m2n2w1t": bcast(2, 2, warps=1, tail=True), "m4n1w1t": bcast(4, 1, warps=1, tail=True),
            "w1": warps(1), "w2": warps(2), "w1all": warps(1, (1, 16)),
            "w2all": warps(2, (1, 16)), "m2n4w1": bcast(2, 4, warps=1),
            "m2n1w1": bcast(2, 1, warps=1), "m4n2w1": bcast(4, 2, warps=1),
            "m2n2w2": bcast(2, 2, warps=2), "m2n4w2": bcast(2, 4, warps=2),
            "m2n2w1": bcast(2, 2, warps=1), "m2n2k512": bcast(2, 2, 512),
            "m2n4": bcast(2, 4), "m2n2": bcast(2, 2), "m4n1": bcast(4, 1),
            "m2n1": bcast(2, 1), "m4n2w8": bcast(4, 2, warps=8), "m4n1w8": bcast(4, 1, warps=8),
            "m4n2k512": bcast(4, 2, 512), "m8n1": bcast(8, 1),
            # one kind of projection at 2-3 rows with twice the columns a program (half the
            # programs: fewer CTAs to dispatch before the next kernel may start)
            "qkv_n4": tweak_for(["qkv"], block_n=4), "o_n4": tweak_for(["o"], block_n=4),
            "gu_n4": tweak_for(["gu"], block_n=4), "down_n4": tweak_for(["down"], block_n=4),
            "gu_n1": tweak_for(["gu"], block_n=1), "down_n1": tweak_for(["down"], block_n=1)}


def head_attention(backend, orig_attend, setting: str, num_target_layers: int):
    """backend._attend with the draft head's launches (layer >= num_target_layers) configured
    by `setting` (see --head-attn); the target's layers as the engine launches them."""
    if setting == "cur":
        return orig_attend
    from outpace.attention.triton_paged import paged_attention
    splits = int(setting.removesuffix("np"))
    prefetch = False if setting.endswith("np") else None

    def attend(layer, q, meta):
        if layer < num_target_layers:
            return orig_attend(layer, q, meta)
        return paged_attention(q, backend.kv_cache, layer, meta, backend.scale, splits,
                               backend.min_split_tokens, backend.split_counters, prefetch)
    return attend


def main():
    args, loaded, prompts = diag_setup(4, extra=(
        ("--policies", "current,m2n2,m4n1,m2n1,m4n2w8,m8n1"),
        ("--engines", "no-spec,eagle3-fa3-k2,eagle3-fa3-k4"), ("--tag", ""),
        # attention's split-KV settings to try under every policy, SPLITSxMIN_TOKENS
        # (max_kv_splits x min_split_tokens of the Triton backend; "" keeps the engine's)
        ("--attn", ""),
        # the draft head's own attention launches (its KV plane: layers past the target's):
        # "cur" as the engine launches them, else SPLITS (a power of two) with "np" for the
        # variant that waits before its first load (no KV prefetch before the PDL wait)
        ("--head-attn", "cur")))
    import outpace.kernels.skinny_gemm as sl
    from outpace.engine.engine import LLMEngine
    eagle, _ = make_heads(args.gguf, tempfile.mkdtemp())
    engines = [("no-spec", None, 0)] + [
        (f"eagle3-fa3-k{k}", {"method": "eagle3", "model": str(eagle),
                              "num_speculative_tokens": k, "force_accept_mean": 3.0}, k)
        for k in (2, 4)]
    engines = [e for e in engines if e[0] in args.engines.split(",")]
    orig = sl.choose_blocks
    table = policies(orig)
    rows = []
    for name, spec, k in engines:
        eng = LLMEngine.from_args(args.gguf, loaded=loaded, device="cuda", dtype="bfloat16",
                                  speculative_config=spec, max_num_seqs=8, num_kv_blocks=2048,
                                  quiet=True, enable_prefix_caching=False)
        fused = eng.runner.fused
        backend = eng.runner.backend
        default_attn = f"{backend.max_kv_splits}x{backend.min_split_tokens}"
        combos = [(pol, attn, ha) for pol in args.policies.split(",")
                  for attn in (args.attn.split(",") if args.attn else [default_attn])
                  for ha in (args.head_attn.split(",") if spec else ["cur"])]
        orig_attend = backend._attend
        for pol, attn, ha in combos:
            backend._attend = head_attention(backend, orig_attend, ha,
                                             eng.runner.model.config.num_hidden_layers)
            sl.choose_blocks = table[pol]
            backend.max_kv_splits, backend.min_split_tokens = map(int, attn.split("x"))
            t0 = time.perf_counter()
            try:
                for key in list(fused._captured):
                    fused._captured[key] = fused._capture(*key)
                cap_s = time.perf_counter() - t0
                run_engine(eng, prompts[:2], 1, 16)
                r = run_engine(eng, prompts, 1, 128)
            except Exception as e:  # a configuration that fails to compile: report, go on
                print(name, pol, attn, "failed:", repr(e)[:300], flush=True)
                sl.choose_blocks = orig
                backend.max_kv_splits, backend.min_split_tokens = map(
                    int, default_attn.split("x"))
                for key in list(fused._captured):
                    fused._captured[key] = fused._capture(*key)
                continue
            g, _ = fused._captured[(1, k + 1, k, True)]
            row = {"engine": name, "policy": pol, "attn": attn, "head_attn": ha,
                   "tok_s": r["tok_s"],
                   "tpot_ms": r["tpot_ms"],
                   "graph_ms": gpu_ms(g), "capture_s": round(cap_s, 1),
                   "mean_acceptance_length": r["mean_acceptance_length"],
                   # every bucket's steady (chained) graph: rows = bucket x q
                   "bucket_graph_ms": {f"b{key[0]}_q{key[1]}": gpu_ms(gg) for key, (gg, _)
                                       in sorted(fused._captured.items()) if key[3]}}
            rows.append(row)
            print(row, flush=True)
        sl.choose_blocks = orig
        backend._attend = orig_attend
        del eng
        torch.cuda.empty_cache()
    ns = {(r["policy"], r["attn"]): r for r in rows if r["engine"] == "no-spec"}
    first = rows[0]["attn"] if rows else None  # the engine's own attention settings
    for r in rows:
        same = ns.get((r["policy"], r["attn"]))
        if r["engine"] != "no-spec" and same is not None:
            r["ratio_to_nospec_same_policy"] = round(r["tok_s"] / same["tok_s"], 3)
            if ("current", first) in ns:
                r["ratio_to_nospec_current"] = round(
                    r["tok_s"] / ns[("current", first)]["tok_s"], 3)
    (Path(args.out) / f"diag_few_rows{args.tag}.json").write_text(json.dumps(rows, indent=1) + "\n")
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()
