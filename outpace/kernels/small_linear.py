"""Linear layers with few rows (M = 1..16 tokens: small-batch decode, verify of k+1 tokens), with
the neighbouring element-wise work fused in: Triton kernels and their PyTorch references.

Why: at batch 1 a small model's decode step is a chain of tiny GEMMs (SmolLM2-135M: 576 x 960)
that cuBLAS runs on ~15 CTAs in ~3.8 us each, while reading the weight would take ~0.3 us. Here one
program owns BLOCK_N output columns and runs the whole K loop, so even a 576-column weight is read
by ~300 programs at once, each weight element once for all M rows. The norm, the residual add and
silu * mul ride along, so a decoder layer needs fewer kernels:

    small_linear(x, w, residual=)            y = x @ w.T (+ residual, one rounding)
    norm_small_linear(x, nw, eps, w)         y = rms_norm(x) @ w.T
    norm_small_linear_silu_mul(x, nw, eps, w_gate_up)   a = silu(g) * u, [g, u] = rms_norm(x) @ w.T
    small_linear_silu_mul(x, w_gate_up)      a = silu(g) * u, [g, u] = x @ w.T
    silu_mul(gu)                             a = silu(gu[:, :I]) * gu[:, I:]   (any M)

Rounding follows the unfused torch composition (HF's modules) in the activation dtype (x's): the
rms_norm is HF's (statistics in fp32, normalized value rounded to the activation dtype, times the
weight in promote(weight, x)), its output is rounded to the activation dtype, each matmul output
is rounded to it, silu(g) is rounded, then the product. Products accumulate in fp32, so bf16
results differ from the references only by summation order (an ulp now and then). With
`residual` the sum is taken in fp32 before the single rounding to the residual's dtype (which
may be fp32 over bf16 x and w). The weight is x's dtype, or, under fp32 activations, stored in
bf16 / fp16 (RunnerConfig.weight_dtype) and upcast exactly: the results are fp32, as if the
weight were held in fp32.

Measured on an H200 (bf16, CUDA-graph replays, L2-cold weights; benchmarks/bench_small_linear.py):
SmolLM2 projections at M = 1 take 2.5-3.6 us against cuBLAS's 3.9-5.3, the fused norm + gate_up +
silu * mul 4.5 us against 9.1 for the unfused ops; Llama-8B shapes run at cuBLAS's speed (+-8%),
except the norm-fused projections at K = 4096 (the statistics pass costs 3-10 us there).

Each dispatcher runs the Triton kernel for CUDA inputs with at most SMALL_M_MAX rows and falls
back to the reference otherwise (CPU, wide batches, unusual layouts). Launches allocate by shape
only and never read device values, so they are CUDA-graph capturable; `out=` takes a buffer.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from outpace.kernels import next_pow2, pdl, use_triton
from outpace.kernels.norm import rms_norm_ref  # HF's RMSNorm: the norm the fused kernels apply

try:  # guarded: CPU machines may not have triton, and `import outpace` must still work
    import triton

    from outpace.kernels.small_linear_kernels import _silu_mul_kernel, _small_linear_kernel
except Exception:  # pragma: no cover - exercised only where triton is missing
    triton = None

SMALL_M_MAX = 16  # rows up to which the Triton kernels run; wider batches go to cuBLAS
_NUM_SMS = 132  # H200; only sets the program-count target of choose_blocks (a shape policy)


# ----------------------------------------------------------------------------- references

def silu_mul_ref(gu: torch.Tensor) -> torch.Tensor:
    """gu [..., 2I] -> silu(gu[..., :I]) * gu[..., I:]: silu rounded to the dtype, then the
    product (what `F.silu(g) * u` does on bf16)."""
    i = gu.shape[-1] // 2
    return F.silu(gu[..., :i]) * gu[..., i:]


def small_linear_ref(x: torch.Tensor, w: torch.Tensor, *,
                     residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] @ w[N, K].T in x's dtype (+ residual [M, N], added in fp32 before the one
    rounding to residual.dtype)."""
    if residual is None:
        return F.linear(x, w.to(x.dtype))  # .to: a no-op unless w is stored narrower
    return (residual.float() + F.linear(x.float(), w.float())).to(residual.dtype)


def norm_small_linear_ref(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                          w: torch.Tensor) -> torch.Tensor:
    """rms_norm(x) rounded to x.dtype, @ w.T -> [M, N] of x.dtype."""
    return F.linear(rms_norm_ref(x, norm_weight, eps).to(x.dtype), w.to(x.dtype))


def norm_small_linear_silu_mul_ref(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                                   w_gate_up: torch.Tensor) -> torch.Tensor:
    """w_gate_up [2I, K] (gate rows, then up rows) -> silu(g) * u [M, I] of x.dtype."""
    return silu_mul_ref(norm_small_linear_ref(x, norm_weight, eps, w_gate_up))


def small_linear_silu_mul_ref(x: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
    """silu(g) * u for [g, u] = x @ w_gate_up.T -> [M, I] of x.dtype."""
    return silu_mul_ref(F.linear(x, w_gate_up.to(x.dtype)))


# ----------------------------------------------------------------------------- block sizes

class Blocks(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    use_dot: bool
    tail_k: int = 0  # > 0: K is whole block_k steps plus a remainder read as a tile this wide
    # > 0: a warp a row (num_warps = block_m), the row read as rw_steps 256-column steps and
    # rw_rest more (row_warps_blocks)
    rw_steps: int = 0
    rw_rest: int = 0
    rw_rest_w: int = 256  # ...of this many columns each


# Numbers below are from benchmarks/bench_small_linear.py on an H200 (SmolLM2-135M and Llama-8B
# shapes, bf16, CUDA-graph replays with L2-cold weights).
# The broadcast-multiply-sum path materialises a [BLOCK_M, BLOCK_N, BLOCK_K] fp32 product per K
# step; up to 128 values a thread (4 warps) it stays in registers.
_PRODUCT_BUDGET = 16384
_SUM_ONE_STEP_K = 2048  # up to this K the broadcast path reads a row in one step...
_SUM_K = 1024  # ...beyond it in steps of this (faster than 2048 or 512 on Llama-8B shapes)
_DOT_K = 256  # K step of the tl.dot path
# ...over an int8 weight (a draft LM head): SmolLM2's 49152 x 576 head read twice in a step
# shaped like EAGLE-3 k = 2's took 11.6 + 9.0 us with 64-column steps, 11.9 + 10.5 with 128 and
# 15-18 + 13-16 with 256 (H200, benchmarks/diag_draft_lm_head.py, 128-column tiles, 3 stages)
_DOT_K_INT8 = 64
_DOT_STAGES = 3  # its software pipeline (3 beat 2 by ~20% on every shape, 4 was no better)
_DOT_SMEM = 64 * 1024  # its pipeline buffers: wide tiles get shorter K steps (LM head: 128 x 64)
_SUM_MAX_N = 16384  # wider weights (LM heads) take the tl.dot path even at M = 1
# Rows a broadcast-path program handles; more rows take more programs, each reading the same
# weight tile (an L2 hit). Two at most: in the k = 2 verify graph (3 rows) blocks of 2 beat
# blocks of 4, 0.846 vs 0.864 ms a step (run 10, benchmarks/diag_few_rows.py).
_SUM_ROWS = 2
# ...and one at these row counts (one-warp programs, below, multiply their rows in turn). Step
# graphs on the H200 (run 18, diag_few_rows_run18c.json; rows = batch x query length): 2 rows
# 0.667 -> 0.620 ms, 3 rows (k = 2 verify) 0.754 -> 0.727; 4 rows 0.713 -> 0.785 (each weight
# tile read four times, not two), so 4 keeps blocks of 2.
_ONE_ROW_M = (2, 3)
# A broadcast-path program with more than one row runs one warp when its product has at most
# this many values (256 a thread): it is reduced over K inside the warp (shuffles), with no
# exchange through shared memory between warps. In the k = 2 verify graph (3 rows, every
# SmolLM2 projection's product 4096-8192 values): 0.825 ms with 4 warps, 0.858 with 2, 0.803
# with 1 (run 14, diag_few_rows_run14b.json). One-row programs keep 4 (1 warp there: no-spec
# 0.544 -> 0.588 ms), and so do larger products (not measured with fewer).
_ONE_WARP_PRODUCT = 8192
# Rows up to which a small weight (K <= 2048, N <= 4096) takes that path. At M = 5 and 8 the
# row blocks of 4 lost to tl.dot on every SmolLM2 projection (qkv 3.8 vs 2.7 us, gate/up 7.2
# vs 3.1; run 8 sweep, with PDL), so beyond 4 rows tl.dot it is.
_SUM_MAX_M = 4
# Row counts whose programs give each row a warp (`row_warps_blocks`): rows -> (rows a program,
# columns a program). One program's warps read the same weight tile (the first from L2, the
# others from L1) with the whole row loaded at once, each multiplying its own row. Step graphs
# on the H200 (run 25, diag_few_rows_run25b-g.json; no-spec batch 2 / 4 decode, rows = batch):
# 2 rows 0.596 -> 0.528 ms, 4 rows 0.675 -> 0.604 (2 rows, 4 columns a program; all 4 rows in
# one program of 4 warps: 0.733; the rest of K = 576 as a masked 256-wide step instead of 64
# columns: 0.548 / 0.648). 3 rows (k = 2 verify at batch 1) lost in every form: one program of
# 4 warps 0.636 -> 0.787 ms, two of 2 warps 0.679-0.795, one row a program 0.702, any one
# projection alone 0.646-0.712; so 3 rows keep the one-warp programs.
_ROW_WARPS = {2: (2, 2), 4: (2, 4)}
_ROW_WARPS_MAX_K = 1536  # measured up to down's 1536; wider rows would hold more registers


@functools.lru_cache(maxsize=4096)  # a pure function of its arguments, asked every launch
def choose_blocks(M: int, N: int, K: int, *, elem_bytes: int = 2, x_bytes: int = 0,
                  gate_up: bool = False, norm: bool = False,
                  use_dot: Optional[bool] = None) -> Blocks:
    """Launch configuration of the few-row linear: a pure function of shapes and dtype size
    (never of values), so a captured graph and an eager call pick the same kernel.

    N is the number of output columns the programs split (I for the gate/up kernels, which
    read two weight tiles a step: `gate_up`); elem_bytes is the weight's element size and
    x_bytes x's (0: the same); `norm`: the kernel computes the RMSNorm statistics first.

    Broadcast multiply + sum (M = 1 up to N = 16384, and M <= _SUM_MAX_M on a small weight,
    K <= 2048 and N <= 4096): a program takes at most _SUM_ROWS rows, one at _ONE_ROW_M rows
    (a forced config with more rows runs more programs, each reading the same weight tile);
    at _ROW_WARPS rows (K <= _ROW_WARPS_MAX_K) a warp a row instead (row_warps_blocks).
    BLOCK_K takes the whole row in one step when K <= 2048, so all of a program's loads are
    in flight at once (a small weight is below the GPU's bandwidth-delay product, and every
    serial K step costs a DRAM latency); longer rows go in steps of 1024.
    With several rows a one-step row that isn't a power of two is two tiles, both loaded up
    front (`tail_k`: K = 576 is 512 + 64 columns, not a 1024-wide tile with 448 masked).
    BLOCK_N is as small as keeps >= 4 programs per SM (576 columns: 288 programs of 2) and grows
    up to the register budget for wide weights. 4 warps, except one for a several-row program
    with a small product (_ONE_WARP_PRODUCT).

    tl.dot otherwise (the rows padded to 16): on Llama-8B shapes the broadcast product over
    several rows was 1.5-5x slower than tensor cores, and on a SmolLM2 LM head (49152 x 576)
    tl.dot with 128 x 64 tiles beat the M = 1 broadcast path (17 vs 21 us). K steps of 256 in a
    3-stage pipeline, shorter where the stages would pass 64 KB; BLOCK_N is the largest of
    16..128 that keeps >= 2 programs per SM; 2 warps for narrow tiles (up to 15% faster), 4 for
    wide ones (2 warps were 2x slower on a 128-wide tile) and under the norm prologue (its
    [16, BLOCK_K] statistics tile). `use_dot` forces a path (tests, sweeps).
    """
    if use_dot is None:
        use_dot = not ((M == 1 and N <= _SUM_MAX_N)
                       or (M <= _SUM_MAX_M and K <= _SUM_ONE_STEP_K and N <= 4096))
    k_max = max(next_pow2(K), 16)
    tiles = 2 if gate_up else 1
    if use_dot:
        block_m = max(next_pow2(M), 16)
        block_n = 16  # tl.dot's minimum tile
        while block_n < 128 and _cdiv(N, block_n * 2) >= 2 * _NUM_SMS:
            block_n *= 2
        block_k = min(k_max, _DOT_K if elem_bytes > 1 else _DOT_K_INT8)
        x_bytes = x_bytes or elem_bytes
        while (block_k > 32 and _DOT_STAGES * block_k
               * (tiles * block_n * elem_bytes + block_m * x_bytes) > _DOT_SMEM):
            block_k //= 2
        return Blocks(block_m, block_n, block_k,
                      num_warps=4 if norm or block_n > 32 else 2,
                      num_stages=_DOT_STAGES, use_dot=True)
    if M in _ROW_WARPS and K <= _ROW_WARPS_MAX_K:
        return row_warps_blocks(K, *_ROW_WARPS[M])
    block_m = 1 if M in _ONE_ROW_M else min(next_pow2(M), _SUM_ROWS)
    block_k = k_max if k_max <= _SUM_ONE_STEP_K else _SUM_K
    block_k = min(block_k, max(_PRODUCT_BUDGET // (block_m * 2 * tiles), 16))
    tail_k = 0
    if M > 1 and block_k == k_max and K < k_max:
        # A row read in one step, padded to a power of two: read the largest power of two
        # below K and the rest as a second, narrower tile when that is narrower in all
        # (K = 576: 512 + 64 columns, not 1024; 1536: 1024 + 512, not 2048). Each lane
        # then multiplies only real columns: 44% fewer products at K = 576. For several
        # rows, whose one-warp programs multiply in turn: the k = 2 verify graph went from
        # 0.806 to 0.767 ms; one-row programs (4 warps, few products each) went from 0.544
        # to 0.633 ms with the split, so they keep one tile (H200, diag_few_rows_run16.json).
        main = k_max // 2
        rest = max(next_pow2(K - main), 16)
        if main + rest < k_max:
            block_k, tail_k = main, rest
    block_n = 2
    while (block_n * 2 * tiles * block_m * block_k <= _PRODUCT_BUDGET
           and _cdiv(N, block_n * 2) >= 4 * _NUM_SMS):
        block_n *= 2
    one_warp = M > 1 and block_m * block_n * tiles * (block_k + tail_k) <= _ONE_WARP_PRODUCT
    return Blocks(block_m, block_n, block_k, num_warps=1 if one_warp else 4, num_stages=2,
                  use_dot=False, tail_k=tail_k)


def row_warps_blocks(K: int, block_m: int, block_n: int) -> Blocks:
    """A broadcast-path launch with a warp a row (block_m warps): the row read as one tile of
    rw_steps 256-column steps (32 lanes x 8 values each: wider steps would put warps on K)
    and one of the rest, rw_rest steps of rw_rest_w columns (the rest's own power of two when
    it is narrower than a step: K = 576 is 2 x 256 + 64), both loaded before the PDL wait and
    masked past K. block_k (256) serves the norm statistics' loop."""
    steps = 1
    while steps * 2 * 256 <= K:
        steps *= 2
    rest = K - steps * 256
    rest_steps, rest_w = (next_pow2(_cdiv(rest, 256)), 256) if rest > 0 else (0, 256)
    if 0 < rest < 256:
        rest_w = max(next_pow2(rest), 16)
    return Blocks(block_m, block_n, 256, num_warps=block_m, num_stages=2, use_dot=False,
                  rw_steps=steps, rw_rest=rest_steps, rw_rest_w=rest_w)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _out(out: Optional[torch.Tensor], m: int, n: int, dtype: torch.dtype,
         device: torch.device) -> torch.Tensor:
    if out is None:
        return torch.empty((m, n), dtype=dtype, device=device)
    if out.shape != (m, n) or out.dtype != dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be [{m}, {n}] {dtype} with a unit last stride, "
                         f"got {tuple(out.shape)} {out.dtype} strides {out.stride()}")
    return out


def _launch(x, w, out, *, n_cols, norm_weight=None, eps=0.0, residual=None, silu_mul=False,
            rope_store: Optional["_RopeStore"] = None, scale: Optional[torch.Tensor] = None,
            blocks: Optional[Blocks] = None):
    """Shared launcher; `blocks` overrides choose_blocks (benchmark sweeps); `scale` [N] fp32
    with an int8 weight (per output column, applied before the output's one rounding)."""
    m, k = x.shape
    if m == 0 or n_cols == 0:
        return out
    two = silu_mul or rope_store is not None
    cfg = blocks or choose_blocks(m, n_cols, k, elem_bytes=w.element_size(),
                                  x_bytes=x.element_size(), gate_up=two,
                                  norm=norm_weight is not None)
    if cfg.use_dot and min(cfg.block_m, cfg.block_n, cfg.block_k) < 16:
        raise ValueError(f"{cfg}: tl.dot needs 16-wide tiles")
    if cfg.tail_k and not (cfg.block_k <= k and cfg.tail_k >= k % cfg.block_k > 0):
        raise ValueError(f"{cfg}: tail_k must cover K % block_k > 0 (K = {k})")
    nw = norm_weight if norm_weight is not None else w
    res = residual if residual is not None else out
    # _cdiv, not triton.cdiv: that one is a jit function, ~5 us a call from Python
    grid = (_cdiv(n_cols, cfg.block_n), _cdiv(m, cfg.block_m))
    # Without ROPE_STORE the epilogue's arguments are never read: any pointers and sizes do.
    rs = rope_store or _RopeStore(out, out, x, x, out, out, stride_cos=0, table_off=0,
                                  stride_cb=0, stride_co=0, stride_ch=0, half=1, hq=0, hkv=0,
                                  cache_block=1)
    _small_linear_kernel[grid](
        x, nw, w, scale if scale is not None else nw, res, out, m, n_cols, k, x.stride(0),
        res.stride(0), out.stride(0),
        float(eps), rs.cos, rs.sin, rs.positions, rs.slots, rs.k_cache, rs.v_cache,
        rs.stride_cos, rs.table_off, rs.stride_cb, rs.stride_co, rs.stride_ch,
        HAS_NORM=norm_weight is not None,
        NORM_ROUND=norm_weight is not None and norm_weight.dtype == x.dtype,
        HAS_RESIDUAL=residual is not None, SILU_MUL=silu_mul, W_SCALE=scale is not None,
        ROPE_STORE=rope_store is not None, TWO_TILES=two, HALF=rs.half, HQ=rs.hq, HKV=rs.hkv,
        CACHE_BLOCK=rs.cache_block, USE_DOT=cfg.use_dot,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, TAIL_K=cfg.tail_k,
        RW_STEPS=cfg.rw_steps, RW_REST=cfg.rw_rest, RW_REST_W=cfg.rw_rest_w,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl.launch_options(x))
    return out


class _RopeStore(NamedTuple):
    """What the ROPE_STORE epilogue needs: rope tables and positions, the KV pool and slots."""
    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    stride_cos: int
    table_off: int
    stride_cb: int
    stride_co: int
    stride_ch: int
    half: int
    hq: int
    hkv: int
    cache_block: int


def norm_qkv_rope_store_triton(x, norm_weight, eps, w_qkv, num_heads, num_kv_heads, head_dim,
                               cos, sin, positions, kv_cache, layer, slot_mapping, *,
                               blocks: Optional[Blocks] = None) -> torch.Tensor:
    """One launch for a decoder layer's attention input: rms_norm(x) @ w_qkv.T, rope of its q
    and k heads at `positions` (tables as in kernels/rope.py), k and v written into
    kv_cache[layer] at slot_mapping (-1: nothing). Returns q [M, Hq, D] (rotated)."""
    from outpace.kernels.rope import _table_offset
    x = _unit_last(x)
    m, d = x.shape[0], head_dim
    off = _table_offset(cos, d)
    _table_offset(sin, d)
    kc, vc = kv_cache[layer, 0], kv_cache[layer, 1]  # [blocks, block_size, Hkv, D]
    if kc.stride(-1) != 1 or kc.stride() != vc.stride() or cos.stride(-1) != 1 \
            or sin.stride() != cos.stride():
        raise ValueError("norm_qkv_rope_store needs contiguous rope tables and a kv_cache "
                         "contiguous in its last dim with equal K and V strides")
    q = torch.empty((m, num_heads * d), dtype=x.dtype, device=x.device)
    rs = _RopeStore(cos, sin, positions, slot_mapping, kc, vc, cos.stride(0), off, kc.stride(0),
                    kc.stride(1), kc.stride(2), d // 2, num_heads, num_kv_heads, kc.shape[1])
    _launch(x, w_qkv, q, n_cols=w_qkv.shape[0] // 2,
            norm_weight=norm_weight.contiguous() if norm_weight is not None else None,
            eps=eps, rope_store=rs, blocks=blocks)
    return q.view(m, num_heads, d)


def norm_qkv_rope_store_ref(x, norm_weight, eps, w_qkv, num_heads, num_kv_heads, head_dim,
                            cos, sin, positions, kv_cache, layer, slot_mapping) -> torch.Tensor:
    """norm_small_linear (small_linear when norm_weight is None: x is normalized already), then
    rope of q and k and the KV store (kernels/rope.py's reference)."""
    from outpace.kernels.rope import apply_rope_and_store_ref
    qkv = (norm_small_linear_ref(x, norm_weight, eps, w_qkv) if norm_weight is not None
           else small_linear_ref(x, w_qkv))
    heads = qkv.view(x.shape[0], num_heads + 2 * num_kv_heads, head_dim)
    q = heads[:, :num_heads].clone()
    apply_rope_and_store_ref(q, heads[:, num_heads:num_heads + num_kv_heads],
                             heads[:, num_heads + num_kv_heads:], cos, sin, positions, kv_cache,
                             layer, slot_mapping)
    return q


def small_linear_triton(x: torch.Tensor, w: torch.Tensor, *,
                        residual: Optional[torch.Tensor] = None,
                        out: Optional[torch.Tensor] = None,
                        blocks: Optional[Blocks] = None) -> torch.Tensor:
    x = _unit_last(x)
    dtype = residual.dtype if residual is not None else x.dtype
    out = _out(out, x.shape[0], w.shape[0], dtype, x.device)
    if residual is not None:
        residual = _unit_last(residual)
    return _launch(x, w, out, n_cols=w.shape[0], residual=residual, blocks=blocks)


def norm_small_linear_triton(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                             w: torch.Tensor, *, out: Optional[torch.Tensor] = None,
                             blocks: Optional[Blocks] = None) -> torch.Tensor:
    x = _unit_last(x)
    out = _out(out, x.shape[0], w.shape[0], x.dtype, x.device)
    return _launch(x, w, out, n_cols=w.shape[0], norm_weight=norm_weight.contiguous(), eps=eps,
                   blocks=blocks)


def norm_small_linear_silu_mul_triton(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                                      w_gate_up: torch.Tensor, *,
                                      out: Optional[torch.Tensor] = None,
                                      blocks: Optional[Blocks] = None) -> torch.Tensor:
    x = _unit_last(x)
    inter = w_gate_up.shape[0] // 2
    out = _out(out, x.shape[0], inter, x.dtype, x.device)
    return _launch(x, w_gate_up, out, n_cols=inter, norm_weight=norm_weight.contiguous(),
                   eps=eps, silu_mul=True, blocks=blocks)


def small_linear_silu_mul_triton(x: torch.Tensor, w_gate_up: torch.Tensor, *,
                                 out: Optional[torch.Tensor] = None,
                                 blocks: Optional[Blocks] = None) -> torch.Tensor:
    x = _unit_last(x)
    inter = w_gate_up.shape[0] // 2
    out = _out(out, x.shape[0], inter, x.dtype, x.device)
    return _launch(x, w_gate_up, out, n_cols=inter, silu_mul=True, blocks=blocks)


_SILU_BLOCK = 1024


def silu_mul_triton(gu: torch.Tensor, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """gu [M, 2I] (unit last stride, any row stride) -> [M, I]."""
    gu = _unit_last(gu)
    m, inter = gu.shape[0], gu.shape[1] // 2
    out = _out(out, m, inter, gu.dtype, gu.device)
    if m and inter:
        block = min(_SILU_BLOCK, next_pow2(inter))
        _silu_mul_kernel[(m, _cdiv(inter, block))](
            gu, out, inter, gu.stride(0), out.stride(0), BLOCK=block,
            num_warps=4 if block >= 512 else 1, **pdl.launch_options(gu))
    return out


# ----------------------------------------------------------------------------- dispatch

def _fast(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Kernel preconditions: CUDA + triton, 1..SMALL_M_MAX rows, a row-major weight of x's dtype
    or, under fp32 x, a 16-bit one (weight_dtype; the kernels upcast its tiles)."""
    return (x.dim() == 2 and 1 <= x.shape[0] <= SMALL_M_MAX and w.dim() == 2
            and w.is_contiguous() and x.shape[1] == w.shape[1]
            and (w.dtype == x.dtype or (x.dtype == torch.float32 and w.element_size() == 2))
            and use_triton(x))


def _copy_to(out: Optional[torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    if out is None:
        return y
    out.copy_(y)
    return out


def small_linear(x: torch.Tensor, w: torch.Tensor, *, residual: Optional[torch.Tensor] = None,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ w [N, K].T (+ residual [M, N] in fp32, one rounding to its dtype).
    Triton for CUDA inputs of at most SMALL_M_MAX rows, the reference otherwise."""
    if _fast(x, w):
        return small_linear_triton(x, w, residual=residual, out=out)
    return _copy_to(out, small_linear_ref(x, w, residual=residual))


def norm_small_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, w: torch.Tensor,
                      *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """rms_norm(x) @ w.T -> [M, N] of x.dtype."""
    if _fast(x, w):
        return norm_small_linear_triton(x, norm_weight, eps, w, out=out)
    return _copy_to(out, norm_small_linear_ref(x, norm_weight, eps, w))


def norm_small_linear_silu_mul(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                               w_gate_up: torch.Tensor, *,
                               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """silu(g) * u with [g, u] = rms_norm(x) @ w_gate_up.T -> [M, I] of x.dtype."""
    if _fast(x, w_gate_up):
        return norm_small_linear_silu_mul_triton(x, norm_weight, eps, w_gate_up, out=out)
    return _copy_to(out, norm_small_linear_silu_mul_ref(x, norm_weight, eps, w_gate_up))


def small_linear_silu_mul(x: torch.Tensor, w_gate_up: torch.Tensor, *,
                          out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """silu(g) * u with [g, u] = x @ w_gate_up.T -> [M, I]."""
    if _fast(x, w_gate_up):
        return small_linear_silu_mul_triton(x, w_gate_up, out=out)
    return _copy_to(out, small_linear_silu_mul_ref(x, w_gate_up))


def norm_qkv_rope_store(x, norm_weight, eps, w_qkv, num_heads, num_kv_heads, head_dim, cos,
                        sin, positions, kv_cache, layer, slot_mapping) -> torch.Tensor:
    """q [M, Hq, D] of rope(rms_norm(x) @ w_qkv.T) (of rope(x @ w_qkv.T) when norm_weight is
    None), with k and v stored in the pool; one Triton launch for CUDA inputs of at most
    SMALL_M_MAX rows, the reference otherwise."""
    args = (x, norm_weight, eps, w_qkv, num_heads, num_kv_heads, head_dim, cos, sin, positions,
            kv_cache, layer, slot_mapping)
    if _fast(x, w_qkv) and head_dim % 2 == 0:
        return norm_qkv_rope_store_triton(*args)
    return norm_qkv_rope_store_ref(*args)


def silu_mul(gu: torch.Tensor, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """silu(gu[:, :I]) * gu[:, I:] for any number of rows; Triton on CUDA."""
    if gu.dim() == 2 and use_triton(gu):
        return silu_mul_triton(gu, out=out)
    return _copy_to(out, silu_mul_ref(gu))
