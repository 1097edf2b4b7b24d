"""The Triton kernels behind attention/triton_paged.py (its docstring gives the tile layout,
the causal split of each tile's KV range and the split-KV merge): the varlen paged attention
kernel with its two variants (waiting on the PDL dependency before its first load, or first
loading its first KV tile: PREFETCH), and the split merges. Launch them through
triton_paged.paged_attention, which chooses tiles, splits and the variant.
"""

from __future__ import annotations

try:  # guarded: `import outpace` (and this module) must work without triton
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None

if triton is not None:
    from outpace.kernels.pdl import wait_then_release
    from outpace.kernels.bf16x3 import dot_fp32_bf16

    @triton.jit
    def _attn_tile(acc, l_i, m_i, q, k, v, cols, cmask, qpos, qk_scale, MASKED: tl.constexpr,
                   IS_FP32: tl.constexpr):
        # One KV tile of the online softmax: k [BLOCK_D, BLOCK_N], v [BLOCK_N, BLOCK_D] as
        # loaded (columns outside cmask are 0). MASKED applies the causal mask (and cmask);
        # unmasked tiles are full tiles every row of the tile may see.
        # IS_FP32: fp32 q over an fp32 pool in three-pass TF32, over a bf16 pool (kv_cache_dtype)
        # in three bf16 dots (kernels/bf16x3.py); the same for p over v.
        if IS_FP32 and k.dtype == tl.bfloat16:
            qk = dot_fp32_bf16(q, k, tl.zeros([q.shape[0], k.shape[1]], dtype=tl.float32))
        elif IS_FP32:
            qk = tl.dot(q, k.to(q.dtype), input_precision="tf32x3")
        else:
            qk = tl.dot(q, k.to(q.dtype))
        qk = qk * qk_scale  # [BLOCK_M, BLOCK_N], log2 domain
        if MASKED:
            vis = (cols[None, :] <= qpos[:, None]) & cmask[None, :]
            qk = tl.where(vis, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # A row that has seen nothing yet (possible under split-KV) keeps m = -inf; shift by 0
        # instead so exp2 gives 0 rather than NaN.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        # (masked rows of v are 0, so garbage can't leak)
        if IS_FP32 and v.dtype == tl.bfloat16:
            pv = dot_fp32_bf16(p, v, tl.zeros_like(acc))
        elif IS_FP32:
            pv = tl.dot(p, v.to(q.dtype), input_precision="tf32x3")
        else:
            v = v.to(q.dtype)
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        return acc, l_i, m_new

    @triton.jit
    def _kv_offsets(bt_row_ptr, cols, cmask, kvh, stride_cb, stride_co, stride_ch,
                    BLOCK_SIZE: tl.constexpr, CG: tl.constexpr):
        # Pool offsets of KV columns `cols` of one sequence (through its block table); CG:
        # the block-table load bypasses L1.
        if CG:
            blk = tl.load(bt_row_ptr + cols // BLOCK_SIZE, mask=cmask, other=0,
                          cache_modifier=".cg")
        else:
            blk = tl.load(bt_row_ptr + cols // BLOCK_SIZE, mask=cmask, other=0)
        blk = blk.to(tl.int64)
        return blk * stride_cb + (cols % BLOCK_SIZE) * stride_co + kvh * stride_ch

    @triton.jit
    def _attn_tiles(acc, l_i, m_i, q, kc_ptr, vc_ptr, bt_row_ptr, lo, hi, qpos, offs_d, dmask,
                    kvh, stride_cb, stride_co, stride_ch, qk_scale, BLOCK_SIZE: tl.constexpr,
                    MASKED: tl.constexpr, BLOCK_N: tl.constexpr, IS_FP32: tl.constexpr,
                    CG: tl.constexpr):
        # Online softmax over KV columns [lo, hi). MASKED applies the causal mask (and hi);
        # unmasked calls only get full tiles every row of the tile may see.
        for start in range(lo, hi, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            cmask = cols < hi
            kv_off = _kv_offsets(bt_row_ptr, cols, cmask, kvh, stride_cb, stride_co, stride_ch,
                                 BLOCK_SIZE, CG)
            k = tl.load(kc_ptr + kv_off[None, :] + offs_d[:, None],
                        mask=cmask[None, :] & dmask[:, None], other=0.0)
            v = tl.load(vc_ptr + kv_off[:, None] + offs_d[None, :],
                        mask=cmask[:, None] & dmask[None, :], other=0.0)
            acc, l_i, m_i = _attn_tile(acc, l_i, m_i, q, k, v, cols, cmask, qpos, qk_scale,
                                       MASKED, IS_FP32)
        return acc, l_i, m_i

    @triton.jit
    def _paged_attn_kernel(
            q_ptr, kc_ptr, vc_ptr, out_ptr, ws_acc_ptr, ws_m_ptr, ws_l_ptr, cnt_ptr,
            qsl_ptr, seq_lens_ptr, bt_ptr, tile_ptr,
            stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_co, stride_ch,
            stride_bt, num_tokens, num_q_heads, qk_scale, min_chunk, HEAD_DIM,
            BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
            BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_D: tl.constexpr,
            NUM_SPLITS: tl.constexpr, IS_FP32: tl.constexpr, FUSED_MERGE: tl.constexpr,
            PREFETCH: tl.constexpr, TILE_MAP: tl.constexpr, USE_PDL: tl.constexpr):
        # PREFETCH: before the PDL wait (kernels/pdl.py) the kernel reads what only kernels at
        # least two launches back wrote, which have finished once it runs (its predecessor
        # launched it after its own wait): the step's query layout, lengths and block tables,
        # and the KV of every column before this step's tokens. So the first tile's
        # block-table entries and old K / V are in flight while the predecessor (the q / k / v
        # projection) still runs; q and this step's K / V are read after the wait. Those early
        # loads bypass L1 (.cg): L2 is coherent with the writers on other SMs. Without
        # PREFETCH the kernel waits before its first load (see paged_attention for when).
        if not PREFETCH:
            wait_then_release(USE_PDL)
        if TILE_MAP:
            # program_id(0) indexes a list of (sequence, query block) pairs staged with the
            # batch (a graph of many prefill sequences: a grid of every sequence x the longest
            # one's blocks would be mostly empty programs); a spare entry is (0, a block past
            # any sequence), which the `active` test below turns away
            seq = tl.load(tile_ptr + 2 * tl.program_id(0))
            qb = tl.load(tile_ptr + 2 * tl.program_id(0) + 1)
        else:
            qb = tl.program_id(0)
            seq = tl.program_id(1)
        kvh = tl.program_id(2) // NUM_SPLITS
        split = tl.program_id(2) % NUM_SPLITS
        q_start = tl.load(qsl_ptr + seq, cache_modifier=".cg")
        q_len = tl.load(qsl_ptr + seq + 1, cache_modifier=".cg") - q_start
        first = qb * BLOCK_Q  # first local query token of this tile
        active = first < q_len  # else a tile past this sequence's queries (or a padded one)
        if not PREFETCH:
            if not active:
                return
        seq_len = tl.load(seq_lens_ptr + seq, cache_modifier=".cg")
        ctx = seq_len - q_len
        last = tl.minimum(q_len, first + BLOCK_Q) - 1

        kv_end = ctx + last + 1
        if NUM_SPLITS == 1:
            lo = kv_end * 0
            hi = kv_end
            num_active = 1
        else:
            chunk = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
            chunk = tl.maximum(chunk, min_chunk)  # min_chunk is a multiple of BLOCK_N
            lo = split * chunk
            hi = tl.minimum(lo + chunk, kv_end)
            # The splits that cover some of the range; with FUSED_MERGE the others (a context
            # shorter than NUM_SPLITS minimum chunks: their ranges are empty) store no partial
            # and take no ticket, and the merge reads only these.
            num_active = tl.cdiv(kv_end, chunk)
        mid = ((ctx + first + 1) // BLOCK_N) * BLOCK_N
        mid = tl.minimum(tl.maximum(mid, lo), hi)

        offs_d = tl.arange(0, BLOCK_D)
        dmask = offs_d < HEAD_DIM
        bt_row_ptr = bt_ptr + seq.to(tl.int64) * stride_bt
        if PREFETCH:
            cols0 = lo + tl.arange(0, BLOCK_N)  # the first tile, [lo, lo + BLOCK_N)
            cmask0 = cols0 < tl.where(active, hi, lo)  # an inactive tile loads nothing
            kv_off0 = _kv_offsets(bt_row_ptr, cols0, cmask0, kvh, stride_cb, stride_co,
                                  stride_ch, BLOCK_SIZE, True)
            old0 = cmask0 & (cols0 < ctx)
            k0 = tl.load(kc_ptr + kv_off0[None, :] + offs_d[:, None],
                         mask=old0[None, :] & dmask[:, None], other=0.0, cache_modifier=".cg")
            v0 = tl.load(vc_ptr + kv_off0[:, None] + offs_d[None, :],
                         mask=old0[:, None] & dmask[None, :], other=0.0, cache_modifier=".cg")

            wait_then_release(USE_PDL)  # everything below may read what the predecessor wrote
            if not active:
                return

            new0 = cmask0 & (cols0 >= ctx)  # this step's tokens in the first tile (0 above)
            k0 += tl.load(kc_ptr + kv_off0[None, :] + offs_d[:, None],
                          mask=new0[None, :] & dmask[:, None], other=0.0)
            v0 += tl.load(vc_ptr + kv_off0[:, None] + offs_d[None, :],
                          mask=new0[:, None] & dmask[None, :], other=0.0)

        rows = tl.arange(0, BLOCK_M)
        tok = first + rows // GROUP_PAD  # local query token of each row
        hig = rows % GROUP_PAD
        row_ok = (tok < q_len) & (hig < GROUP)
        head = kvh * GROUP + hig
        # Pad rows borrow the last real token's position so no row is ever fully masked.
        qpos = ctx + tl.minimum(tok, q_len - 1)
        tok_g = (q_start + tok).to(tl.int64)
        io_mask = row_ok[:, None] & dmask[None, :]
        q = tl.load(q_ptr + tok_g[:, None] * stride_qt + head[:, None] * stride_qh
                    + offs_d[None, :], mask=io_mask, other=0.0)  # [BLOCK_M, BLOCK_D]

        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        start = lo
        if PREFETCH:
            # the first tile, always masked (exact for a full tile too); the rest as below
            acc, l_i, m_i = _attn_tile(acc, l_i, m_i, q, k0, v0, cols0, cmask0, qpos, qk_scale,
                                       True, IS_FP32)
            start = tl.minimum(lo + BLOCK_N, hi)
            mid = tl.maximum(mid, start)
        # full tiles every row of the tile sees unmasked, then the causal edge masked
        acc, l_i, m_i = _attn_tiles(acc, l_i, m_i, q, kc_ptr, vc_ptr, bt_row_ptr, start, mid,
                                    qpos, offs_d, dmask, kvh, stride_cb, stride_co, stride_ch,
                                    qk_scale, BLOCK_SIZE, False, BLOCK_N, IS_FP32, PREFETCH)
        acc, l_i, m_i = _attn_tiles(acc, l_i, m_i, q, kc_ptr, vc_ptr, bt_row_ptr, mid, hi, qpos,
                                    offs_d, dmask, kvh, stride_cb, stride_co, stride_ch,
                                    qk_scale, BLOCK_SIZE, True, BLOCK_N, IS_FP32, PREFETCH)

        if NUM_SPLITS == 1:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(out_ptr + tok_g[:, None] * stride_ot + head[:, None] * stride_oh
                     + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=io_mask)
        elif not FUSED_MERGE:  # every split's partial, for _merge_splits_kernel
            _store_partial(ws_acc_ptr, ws_m_ptr, ws_l_ptr, acc, m_i, l_i, split, num_tokens,
                           num_q_heads, tok_g, head, row_ok, offs_d, io_mask, HEAD_DIM)
        elif split < num_active:
            _store_partial(ws_acc_ptr, ws_m_ptr, ws_l_ptr, acc, m_i, l_i, split, num_tokens,
                           num_q_heads, tok_g, head, row_ok, offs_d, io_mask, HEAD_DIM)
            # The tile's last split to finish merges all of them (no second kernel). Its
            # acq_rel ticket orders the other splits' partial stores (each issued before
            # their own ticket, behind a barrier) before its loads.
            tl.debug_barrier()
            tile = (seq * tl.num_programs(0) + qb) * (tl.num_programs(2) // NUM_SPLITS) + kvh
            ticket = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
            if ticket == num_active - 1:
                tl.store(cnt_ptr + tile, 0)  # zero again for the next launch (graphs)
                _merge_tile(ws_acc_ptr, ws_m_ptr, ws_l_ptr, out_ptr, tok_g, head, row_ok,
                            offs_d, io_mask, stride_ot, stride_oh, num_tokens,
                            num_q_heads, HEAD_DIM, num_active, NUM_SPLITS, BLOCK_M, BLOCK_D)

    @triton.jit
    def _store_partial(ws_acc_ptr, ws_m_ptr, ws_l_ptr, acc, m_i, l_i, split, num_tokens,
                       num_q_heads, tok_g, head, row_ok, offs_d, io_mask, HEAD_DIM):
        # workspace: acc [NUM_SPLITS, T, Hq, HEAD_DIM], m and l [NUM_SPLITS, T, Hq]
        idx = (split * num_tokens + tok_g) * num_q_heads + head
        tl.store(ws_acc_ptr + idx[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=io_mask)
        tl.store(ws_m_ptr + idx, m_i, mask=row_ok)
        tl.store(ws_l_ptr + idx, l_i, mask=row_ok)

    @triton.jit
    def _merge_tile(ws_acc_ptr, ws_m_ptr, ws_l_ptr, out_ptr, tok_g, head, row_ok, offs_d,
                    io_mask, stride_ot, stride_oh, num_tokens, num_q_heads, HEAD_DIM,
                    num_active, NUM_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_D: tl.constexpr):
        # The merge of _merge_splits_kernel for one tile's rows, over its first num_active
        # splits (the others hold nothing). Loads bypass L1 (.cg): the partials were written
        # by other programs of this launch.
        s = tl.arange(0, NUM_SPLITS)
        idx = (s[:, None] * num_tokens + tok_g[None, :]) * num_q_heads + head[None, :]
        live = (s < num_active)[:, None] & row_ok[None, :]
        m = tl.load(ws_m_ptr + idx, mask=live, other=float("-inf"),
                    cache_modifier=".cg")  # [NUM_SPLITS, BLOCK_M]
        l_s = tl.load(ws_l_ptr + idx, mask=live, other=0.0, cache_modifier=".cg")
        m_max = tl.max(m, 0)
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
        w = tl.exp2(m - m_max[None, :])  # empty splits have m = -inf -> weight 0
        den = tl.sum(w * l_s, 0)
        num = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for j in tl.static_range(NUM_SPLITS):  # unrolled: the loads are issued together
            row = (j * num_tokens + tok_g) * num_q_heads + head
            a = tl.load(ws_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
                        mask=io_mask & (tl.full([BLOCK_M], j, tl.int32) < num_active)[:, None],
                        other=0.0, cache_modifier=".cg")
            w_j = tl.sum(tl.where(s[:, None] == j, w, 0.0), 0)
            num += w_j[:, None] * a
        out = num / tl.where(den > 0, den, 1.0)[:, None]
        tl.store(out_ptr + tok_g[:, None] * stride_ot + head[:, None] * stride_oh
                 + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=io_mask)

    @triton.jit
    def _merge_splits_kernel(ws_acc_ptr, ws_m_ptr, ws_l_ptr, out_ptr, qsl_ptr, num_seqs,
                             stride_ot, stride_oh, num_tokens, num_q_heads, HEAD_DIM,
                             NUM_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr,
                             USE_PDL: tl.constexpr):
        wait_then_release(USE_PDL)
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        if t >= tl.load(qsl_ptr + num_seqs):  # padding token after the last sequence
            return
        s = tl.arange(0, NUM_SPLITS)
        idx = (s * num_tokens + t) * num_q_heads + h
        m = tl.load(ws_m_ptr + idx)
        l_s = tl.load(ws_l_ptr + idx)
        m_max = tl.max(m, 0)
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
        w = tl.exp2(m - m_max)  # empty splits have m = -inf -> weight 0
        d = tl.arange(0, BLOCK_D)
        a = tl.load(ws_acc_ptr + idx[:, None] * HEAD_DIM + d[None, :],
                    mask=(d < HEAD_DIM)[None, :], other=0.0)
        num = tl.sum(w[:, None] * a, 0)
        den = tl.sum(w * l_s, 0)
        out = num / tl.where(den > 0, den, 1.0)
        tl.store(out_ptr + t * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty),
                 mask=d < HEAD_DIM)
