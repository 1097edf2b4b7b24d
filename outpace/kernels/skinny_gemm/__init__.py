"""Linear layers with few rows (M = 1..16 tokens: small-batch decode, verify of k+1 tokens), with
the neighbouring element-wise work fused in: Triton kernels and their PyTorch references.

Why: at batch 1 a small model's decode step is a chain of tiny GEMMs (SmolLM2-135M: 576 x 960)
that cuBLAS runs on ~15 CTAs, taking many times what reading the weight would. Here one
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

On SmolLM2's widths these kernels are faster than cuBLAS, and the fused norm + gate_up + silu *
mul gains most against the unfused ops; on Llama-8B's they run at about cuBLAS's speed, except
the norm-fused projections at K = 4096, where the statistics pass costs more than the fusion
saves (so wide models keep cuBLAS: models/llama.py). benchmarks/kernel_speed.py measures
them; the numbers are in decisions-log.md, "Measurements moved out of code comments".

Each dispatcher runs the Triton kernel for CUDA inputs with at most SMALL_M_MAX rows and falls
back to the reference otherwise (CPU, wide batches, unusual layouts). Launches allocate by shape
only and never read device values, so they are CUDA-graph capturable; `out=` takes a buffer.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from outpace.kernels import next_pow2, pdl, use_triton
from outpace.kernels.options import current
from outpace.kernels.norm import rms_norm_ref  # HF's RMSNorm: the norm the fused kernels apply
# the launch policy (re-exported: callers and sweeps take choose_blocks from here)
from outpace.kernels.skinny_gemm.blocks import Blocks, _cdiv, choose_blocks

try:  # guarded: CPU machines may not have triton, and `import outpace` must still work
    import triton

    from outpace.kernels.skinny_gemm.kernels import _silu_mul_kernel, _small_linear_kernel
except Exception:  # pragma: no cover - exercised only where triton is missing
    triton = None

SMALL_M_MAX = 16  # rows up to which the Triton kernels run; wider batches go to cuBLAS
# ...and up to which the projections without a norm prologue also may (`mid_rows_ok`): a
# short prefill, a small varlen step, or a decode / verify step of that many rows, of a narrow
# model, where fusing the rope + KV store and the silu * mul into the projection's epilogue
# saves two kernels a layer. The tl.dot path in row blocks (choose_blocks): at 64-256 rows of
# SmolLM2's shapes the plain projections run at about cuBLAS's speed and gate_up + silu * mul
# beats cuBLAS + the silu * mul kernel (H200; docs/decisions.md, "Prefill-sized projections as
# Triton kernels"); beyond 256 rows not measured.
MID_M_MAX = 256


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
                                  norm=norm_weight is not None,
                                  row_warps=current().row_warps_rows)
    if cfg.use_dot and min(cfg.block_m, cfg.block_n, cfg.block_k) < 16:
        raise ValueError(f"{cfg}: tl.dot needs 16-wide tiles")
    if cfg.tail_k and not (cfg.block_k <= k and cfg.tail_k >= k % cfg.block_k > 0):
        raise ValueError(f"{cfg}: tail_k must cover K % block_k > 0 (K = {k})")
    nw = norm_weight if norm_weight is not None else w
    res = residual if residual is not None else out
    # _cdiv, not triton.cdiv: that one is a jit function, slow to call from Python
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


def mid_rows_ok(x: torch.Tensor, w: torch.Tensor, n_cols: Optional[int] = None,
                triton_ok: Optional[bool] = None) -> bool:
    """Whether a projection of x [M, K] by w [N, K] with SMALL_M_MAX < M <= MID_M_MAX may run
    the Triton kernel (small_linear_triton, small_linear_silu_mul_triton, or
    norm_qkv_rope_store_triton without a norm): CUDA with triton, x and w of one 16-bit dtype
    (the faithful mode's fp32 rows keep split_mm), a row-major w, and a narrow weight (K <=
    2048, at most 4096 output columns, n_cols: the columns the programs split), the shapes
    measured. triton_ok: whether Triton may run on x (None: use_triton(x))."""
    return (x.dim() == 2 and SMALL_M_MAX < x.shape[0] <= MID_M_MAX and w.dim() == 2
            and w.is_contiguous() and x.shape[1] == w.shape[1] <= 2048
            and (n_cols or w.shape[0]) <= 4096 and w.dtype == x.dtype
            and x.dtype in (torch.bfloat16, torch.float16)
            and (use_triton(x) if triton_ok is None else triton_ok))


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
