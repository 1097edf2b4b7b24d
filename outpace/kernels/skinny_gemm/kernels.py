"""The Triton kernels behind kernels/skinny_gemm/ (its docstring says what they compute and
why): one few-row projection kernel with its optional prologue (RMSNorm) and epilogues (residual
add, silu * mul, rope + KV store), and the plain silu * mul kernel. Launch them through
skinny_gemm/'s functions, which choose the block sizes.
"""

from __future__ import annotations

try:  # guarded: CPU machines may not have triton, and `import outpace` must still work
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None

if triton is not None:
    from outpace.kernels.pdl import wait_then_release
    from outpace.kernels.bf16x3 import dot_fp32_bf16

    @triton.jit
    def _operand(x, rstd, nw, A_DTYPE: tl.constexpr, HAS_NORM: tl.constexpr,
                 NORM_ROUND: tl.constexpr):
        # x as loaded -> the matmul operand, fp32 holding A_DTYPE values (A_DTYPE: the
        # activation dtype, x's; the weight's too unless that is stored narrower). With the
        # norm: rstd (x's rows' statistics) and nw (its weight at x's columns) broadcast to x.
        if HAS_NORM:
            n = (x.to(tl.float32) * rstd).to(x.dtype)  # HF casts back before the weight
            n = nw.to(tl.float32) * n.to(tl.float32)
            if NORM_ROUND:  # weight and activation share a dtype: torch's product is in it
                n = n.to(x.dtype)
            x = n
        return x.to(A_DTYPE).to(tl.float32)

    @triton.jit
    def _dot_input(x, nw_ptr, offs_k, k_mask, rstd, A_DTYPE: tl.constexpr,
                   HAS_NORM: tl.constexpr, NORM_ROUND: tl.constexpr):
        # _operand for x [BLOCK_M, BLOCK_K]
        nw = x
        if HAS_NORM:
            nw = tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0)[None, :]
        return _operand(x, rstd[:, None], nw, A_DTYPE, HAS_NORM, NORM_ROUND)

    @triton.jit
    def _accumulate(acc, a, w, A_DTYPE: tl.constexpr, USE_DOT: tl.constexpr):
        # acc [BLOCK_M, BLOCK_N] += a [BLOCK_M, BLOCK_K] @ w [BLOCK_N, BLOCK_K].T
        if USE_DOT:
            if w.dtype == tl.int8:
                # an int8 weight (its per-column scale is applied in the epilogue): every
                # value |v| <= 127 is exact in bf16 / fp16, so the dots below take it as is
                w = w.to(tl.bfloat16 if A_DTYPE == tl.float32 else A_DTYPE)
            if A_DTYPE == tl.float32 and w.dtype == tl.bfloat16:
                # fp32 activations over a bf16 weight (weight_dtype): three bf16 dots give the
                # fp32 product from the weight tile as stored (kernels/bf16x3.py)
                acc = dot_fp32_bf16(a, tl.trans(w), acc)
            elif A_DTYPE == tl.float32:  # no tf32: fp32 layers must match fp32 torch; a
                # weight stored in fp16 is upcast exactly, since tl.dot wants operands of
                # one dtype
                acc = tl.dot(a, tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
            else:  # a holds w-dtype values already (A_DTYPE is w's dtype: only fp32
                # activations meet a narrower weight), so this cast is exact
                acc = tl.dot(a.to(w.dtype), tl.trans(w), acc)
        else:
            # GEMV-style broadcast multiply + sum, for M = 1: tensor cores would pad the row to
            # 16 and stage tiles through shared memory for nothing (the op is bound by the
            # weight read); here the weight tile goes straight to registers.
            acc += tl.sum(a[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        return acc

    @triton.jit
    def _silu_mul_values(g, u, OUT_DTYPE: tl.constexpr):
        # g, u fp32 holding OUT_DTYPE values; silu rounded, then the product (torch's roundings)
        s = (g / (1.0 + tl.exp(-g))).to(OUT_DTYPE).to(tl.float32)
        return (s * u).to(OUT_DTYPE)

    @triton.jit
    def _load_w(w_rows, u_rows, offs_k, n_mask, K, SILU_MUL: tl.constexpr):
        # The weight tile of one K step (and its up-half tile for SILU_MUL).
        mask = n_mask[:, None] & (offs_k < K)[None, :]
        w = tl.load(w_rows + offs_k[None, :], mask=mask, other=0.0)
        wu = w
        if SILU_MUL:
            wu = tl.load(u_rows + offs_k[None, :], mask=mask, other=0.0)
        return w, wu

    @triton.jit
    def _step(acc, acc_u, w, wu, x_rows, m_mask, offs_k, K, nw_ptr, rstd,
              A_DTYPE: tl.constexpr, HAS_NORM: tl.constexpr, NORM_ROUND: tl.constexpr,
              SILU_MUL: tl.constexpr, USE_DOT: tl.constexpr):
        # One K step: load x (an L2 hit), make the matmul operand, accumulate.
        k_mask = offs_k < K
        x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        a = _dot_input(x, nw_ptr, offs_k, k_mask, rstd, A_DTYPE, HAS_NORM, NORM_ROUND)
        acc = _accumulate(acc, a, w, A_DTYPE, USE_DOT)
        if SILU_MUL:
            acc_u = _accumulate(acc_u, a, wu, A_DTYPE, USE_DOT)
        return acc, acc_u

    @triton.jit
    def _load_w_row_warps(w_rows, u_rows, k0, n_mask, m_mask, K, SILU_MUL: tl.constexpr,
                          BLOCK_M: tl.constexpr, STEPS: tl.constexpr, WIDTH: tl.constexpr):
        # Columns [k0, k0 + STEPS * WIDTH) of the weight as [STEPS, BLOCK_N, BLOCK_M, WIDTH],
        # the same addresses for every row: with the rows on the axis before the lanes' 256
        # (32 lanes x 8 values) Triton gives each warp a row, and every step is loaded at once.
        # A padding row's warp (3 rows in 4) loads nothing.
        offs = k0 + tl.arange(0, STEPS)[:, None, None, None] * WIDTH \
            + tl.arange(0, WIDTH)[None, None, None, :] \
            + tl.zeros([1, 1, BLOCK_M, 1], dtype=tl.int32)
        mask = n_mask[None, :, None, None] & (offs < K) & m_mask[None, None, :, None]
        w = tl.load(w_rows[None, :, :, None] + offs, mask=mask, other=0.0)
        wu = w
        if SILU_MUL:
            wu = tl.load(u_rows[None, :, :, None] + offs, mask=mask, other=0.0)
        return w, wu

    @triton.jit
    def _product_row_warps(acc, acc_u, w, wu, x_rows, m_mask, k0, K, nw_ptr, rstd,
                           A_DTYPE: tl.constexpr, HAS_NORM: tl.constexpr,
                           NORM_ROUND: tl.constexpr, SILU_MUL: tl.constexpr,
                           STEPS: tl.constexpr, WIDTH: tl.constexpr):
        # acc [BLOCK_N, BLOCK_M] += the product of _load_w_row_warps' tile with x's columns
        offs = k0 + tl.arange(0, STEPS)[:, None] * WIDTH + tl.arange(0, WIDTH)[None, :]
        k_mask = offs < K
        x = tl.load(x_rows[None, :, :] + offs[:, None, :],
                    mask=m_mask[None, :, None] & k_mask[:, None, :], other=0.0)  # [S, M, W]
        nw = x
        if HAS_NORM:
            nw = tl.load(nw_ptr + offs, mask=k_mask, other=0.0)[:, None, :]
        a = _operand(x, rstd[None, :, None], nw, A_DTYPE, HAS_NORM,
                     NORM_ROUND)[:, None, :, :]  # [S, 1, M, W]
        acc += tl.sum(tl.sum(a * w.to(tl.float32), axis=3), axis=0)
        if SILU_MUL:
            acc_u += tl.sum(tl.sum(a * wu.to(tl.float32), axis=3), axis=0)
        return acc, acc_u

    @triton.jit
    def _small_linear_kernel(x_ptr, nw_ptr, w_ptr, scale_ptr, r_ptr, out_ptr, M, N, K,
                             stride_xm, stride_rm, stride_om, eps,
                             cos_ptr, sin_ptr, pos_ptr, slot_ptr, kc_ptr, vc_ptr, stride_cos,
                             table_off, stride_cb, stride_co, stride_ch,
                             HAS_NORM: tl.constexpr, NORM_ROUND: tl.constexpr,
                             HAS_RESIDUAL: tl.constexpr, SILU_MUL: tl.constexpr,
                             W_SCALE: tl.constexpr,
                             ROPE_STORE: tl.constexpr, TWO_TILES: tl.constexpr,
                             HALF: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
                             CACHE_BLOCK: tl.constexpr,
                             USE_DOT: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             TAIL_K: tl.constexpr, RW_STEPS: tl.constexpr,
                             RW_REST: tl.constexpr, RW_REST_W: tl.constexpr,
                             USE_PDL: tl.constexpr):
        # One program: output columns [pid * BLOCK_N, +BLOCK_N) for rows
        # [program_id(1) * BLOCK_M, +BLOCK_M) (one row block unless the broadcast path splits
        # the rows; each program then reads the same weight tile, an L2 hit for all but one),
        # whole K loop.
        # With SILU_MUL the weight is [2N, K] and the program also owns up rows N + j. With
        # ROPE_STORE (a qkv weight, heads of 2 * HALF rows) column j is the rope pair of rows
        # (head, d) and (head, d + HALF), head = j // HALF, d = j % HALF, so the epilogue can
        # rotate q and k itself (see norm_qkv_rope_store).
        # TAIL_K > 0: K is whole BLOCK_K steps and a remainder of at most TAIL_K columns, read
        # as one more (narrower) tile, loaded up front with the first: K = 576 is 512 + 64
        # columns instead of 576 of a 1024-wide tile (see choose_blocks).
        pid = tl.program_id(0)
        offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = offs_m < M
        n_mask = offs_n < N
        # Roundings happen in the activation dtype (x's): the weight's too, except where the
        # weight is stored narrower (fp32 activations over bf16 weights, weight_dtype).
        A_DTYPE: tl.constexpr = x_ptr.dtype.element_ty
        x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
        if ROPE_STORE:
            row = (offs_n // HALF) * (2 * HALF) + offs_n % HALF
            w_rows = w_ptr + row[:, None].to(tl.int64) * K
            u_rows = w_rows + HALF * K  # the rope partner rows
        else:
            w_rows = w_ptr + offs_n[:, None].to(tl.int64) * K
            u_rows = w_ptr + (offs_n[:, None].to(tl.int64) + N) * K  # the up half (SILU_MUL)

        # The first weight tile is loaded before anything else, so its DRAM latency overlaps
        # the norm statistics; when K fits one step (a small model at M = 1) that is the
        # program's whole weight read.
        offs_k = tl.arange(0, BLOCK_K)
        if RW_STEPS > 0:
            w, wu = _load_w_row_warps(w_rows, u_rows, 0, n_mask, m_mask, K, TWO_TILES,
                                      BLOCK_M, RW_STEPS, 256)
            if RW_REST > 0:
                w_r, wu_r = _load_w_row_warps(w_rows, u_rows, RW_STEPS * 256, n_mask, m_mask,
                                              K, TWO_TILES, BLOCK_M, RW_REST, RW_REST_W)
        else:
            w, wu = _load_w(w_rows, u_rows, offs_k, n_mask, K, TWO_TILES)
        k_main = K  # the columns read in BLOCK_K steps
        if TAIL_K > 0:
            k_main = K - K % BLOCK_K
            offs_t = k_main + tl.arange(0, TAIL_K)
            w_t, wu_t = _load_w(w_rows, u_rows, offs_t, n_mask, K, TWO_TILES)
        # With PDL these loads are issued while the previous kernel still runs
        # (kernels/pdl.py); everything below may read what earlier kernels wrote.
        wait_then_release(USE_PDL)

        rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
        if HAS_NORM:
            # Every program recomputes the row statistics: x is a few KB and L2-resident, and
            # this saves the separate norm kernel and its round trip through memory.
            sq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
            for k0 in range(0, k_main, BLOCK_K):
                offs_kk = k0 + tl.arange(0, BLOCK_K)
                xk = tl.load(x_rows + offs_kk[None, :],
                             mask=m_mask[:, None] & (offs_kk < K)[None, :], other=0.0)
                xk = xk.to(tl.float32)
                sq += xk * xk
            ss = tl.sum(sq, axis=1)
            if TAIL_K > 0:
                xt = tl.load(x_rows + offs_t[None, :],
                             mask=m_mask[:, None] & (offs_t < K)[None, :], other=0.0)
                xt = xt.to(tl.float32)
                ss += tl.sum(xt * xt, axis=1)
            rstd = 1.0 / tl.sqrt(ss / K + eps)

        if RW_STEPS > 0:  # the whole row in at most two tiles; accumulators [N, M]
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            acc, acc_u = _product_row_warps(acc, acc, w, wu, x_rows, m_mask, 0, K, nw_ptr,
                                            rstd, A_DTYPE, HAS_NORM, NORM_ROUND, TWO_TILES,
                                            RW_STEPS, 256)
            if RW_REST > 0:
                acc, acc_u = _product_row_warps(acc, acc_u, w_r, wu_r, x_rows, m_mask,
                                                RW_STEPS * 256, K, nw_ptr, rstd, A_DTYPE,
                                                HAS_NORM, NORM_ROUND, TWO_TILES, RW_REST,
                                                RW_REST_W)
            acc = tl.trans(acc)
            acc_u = tl.trans(acc_u)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc, acc_u = _step(acc, acc, w, wu, x_rows, m_mask, offs_k, K, nw_ptr, rstd,
                               A_DTYPE, HAS_NORM, NORM_ROUND, TWO_TILES, USE_DOT)
            for k0 in range(BLOCK_K, k_main, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                w, wu = _load_w(w_rows, u_rows, offs_k, n_mask, K, TWO_TILES)
                acc, acc_u = _step(acc, acc_u, w, wu, x_rows, m_mask, offs_k, K, nw_ptr,
                                   rstd, A_DTYPE, HAS_NORM, NORM_ROUND, TWO_TILES, USE_DOT)
            if TAIL_K > 0:
                acc, acc_u = _step(acc, acc_u, w_t, wu_t, x_rows, m_mask, offs_t, K, nw_ptr,
                                   rstd, A_DTYPE, HAS_NORM, NORM_ROUND, TWO_TILES, USE_DOT)

        if W_SCALE:  # an int8 weight's per-column scale, in fp32 before the one rounding
            acc *= tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out_mask = m_mask[:, None] & n_mask[None, :]
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        OUT_DTYPE: tl.constexpr = out_ptr.dtype.element_ty
        if ROPE_STORE:
            _rope_store_epilogue(acc, acc_u, offs_m, offs_n, m_mask, n_mask, out_ptr,
                                 stride_om, cos_ptr, sin_ptr, pos_ptr, slot_ptr, kc_ptr, vc_ptr,
                                 stride_cos, table_off, stride_cb, stride_co, stride_ch,
                                 A_DTYPE, HALF, HQ, HKV, CACHE_BLOCK)
        elif SILU_MUL:
            # g and u are rounded as the gate/up matmul output would be, then silu * mul.
            g = acc.to(A_DTYPE).to(tl.float32)
            u = acc_u.to(A_DTYPE).to(tl.float32)
            y = _silu_mul_values(g, u, OUT_DTYPE)
        elif HAS_RESIDUAL:
            r = tl.load(r_ptr + offs_m[:, None].to(tl.int64) * stride_rm + offs_n[None, :],
                        mask=out_mask, other=0.0)
            y = (r.to(tl.float32) + acc).to(OUT_DTYPE)
        else:
            y = acc.to(OUT_DTYPE)
        if not ROPE_STORE:
            tl.store(out_ptrs, y, mask=out_mask)

    @triton.jit
    def _rope_store_epilogue(acc, acc_u, offs_m, offs_n, m_mask, n_mask, q_ptr, stride_qm,
                             cos_ptr, sin_ptr, pos_ptr, slot_ptr, kc_ptr, vc_ptr, stride_cos,
                             table_off,
                             stride_cb, stride_co, stride_ch, A_DTYPE: tl.constexpr,
                             HALF: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
                             CACHE_BLOCK: tl.constexpr):
        # acc / acc_u: the (d, d + HALF) halves of q, k and v heads for every token row. The
        # same roundings as projection -> rope kernel -> KV store: the projection's output is
        # rounded to the activation dtype, rope runs in fp32 and rounds once, k is rounded to
        # its dtype before the pool's.
        x1 = acc.to(A_DTYPE).to(tl.float32)
        x2 = acc_u.to(A_DTYPE).to(tl.float32)
        head = (offs_n // HALF)[None, :]
        d = (offs_n % HALF)[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
        pos = tl.load(pos_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
        t_off = pos[:, None] * stride_cos + table_off + d
        c = tl.load(cos_ptr + t_off, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + t_off, mask=mask, other=0.0).to(tl.float32)
        r1 = x1 * c - x2 * s
        r2 = x2 * c + x1 * s
        # q heads -> q [M, HQ * 2 * HALF]
        q_mask = mask & (head < HQ)
        q_ptrs = q_ptr + offs_m[:, None].to(tl.int64) * stride_qm + head * (2 * HALF) + d
        tl.store(q_ptrs, r1.to(q_ptr.dtype.element_ty), mask=q_mask)
        tl.store(q_ptrs + HALF, r2.to(q_ptr.dtype.element_ty), mask=q_mask)
        # k (rotated) and v (as is) -> the pool at each row's slot; slot -1 (padding) writes
        # nothing
        slot = tl.load(slot_ptr + offs_m, mask=m_mask, other=-1).to(tl.int64)
        kv_mask = mask & (slot >= 0)[:, None]
        is_v = head >= HQ + HKV
        kvh = tl.where(is_v, head - HQ - HKV, head - HQ)
        dst = (slot // CACHE_BLOCK)[:, None] * stride_cb \
            + (slot % CACHE_BLOCK)[:, None] * stride_co + kvh * stride_ch + d
        k_mask = kv_mask & (head >= HQ) & (head < HQ + HKV)
        K_DTYPE: tl.constexpr = kc_ptr.dtype.element_ty
        tl.store(kc_ptr + dst, r1.to(A_DTYPE).to(K_DTYPE), mask=k_mask)
        tl.store(kc_ptr + dst + HALF, r2.to(A_DTYPE).to(K_DTYPE), mask=k_mask)
        v_mask = kv_mask & is_v
        V_DTYPE: tl.constexpr = vc_ptr.dtype.element_ty
        tl.store(vc_ptr + dst, x1.to(V_DTYPE), mask=v_mask)
        tl.store(vc_ptr + dst + HALF, x2.to(V_DTYPE), mask=v_mask)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, I, stride_gm, stride_om, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr):
        wait_then_release(USE_PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < I
        g = tl.load(gu_ptr + row * stride_gm + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * stride_gm + I + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_om + cols,
                 _silu_mul_values(g, u, out_ptr.dtype.element_ty), mask=mask)
