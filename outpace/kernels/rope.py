"""Rotary position embedding (neox / rotate_half style), applied in place to q and k.

For a head vector x = [x1, x2] (halves of D/2) at position p with angles theta_i(p):

    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin

cos/sin tables are [max_pos, D/2] (one entry per frequency) or [max_pos, D]. A D-wide table is
read from its second half only: that half is (cos, +sin) both in HF's cat(freqs, freqs) layout
and in the "signed sin" layout ([-sin, sin]) some models precompute, so either works.
The math runs in fp32 and rounds once on the store (HF rounds after each bf16 op, so bf16 results
can differ from HF by an ulp; fp32 matches).

`apply_rope_and_store_triton` is the same kernel that also writes the rotated k and v into the
paged KV pool through the slot mapping (what kernels/store_kv.py does), so a layer's rope and
KV store are one launch instead of two: attention reads K/V from the pool only, so k itself is
not written back.
"""

from __future__ import annotations

import torch

from outpace.kernels import next_pow2, pdl, use_triton

try:  # guarded: CPU machines may not have triton
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None
    tl = None


def _table_offset(table: torch.Tensor, head_dim: int) -> int:
    """Column where the D/2 frequencies start in a cos/sin table; raises on a bad width."""
    if head_dim % 2:
        raise ValueError(f"rope needs an even head_dim, got {head_dim}")
    width = table.shape[-1]
    if width == head_dim // 2:
        return 0
    if width == head_dim:
        return head_dim // 2
    raise ValueError(f"cos/sin table width {width} must be head_dim/2 ({head_dim // 2}) "
                     f"or head_dim ({head_dim})")


# ----------------------------------------------------------------------------- reference

def apply_rope_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In place. q [T, Hq, D], k [T, Hkv, D], cos/sin [max_pos, D/2 or D], positions [T].

    Returns (q, k) for convenience.
    """
    d = q.shape[-1]
    half = d // 2
    off = _table_offset(cos, d)
    c = cos[positions.long()][:, off:off + half].float().unsqueeze(1)  # [T, 1, D/2]
    s = sin[positions.long()][:, off:off + half].float().unsqueeze(1)
    for x in (q, k):
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        x.copy_(torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1))
    return q, k


def apply_rope_and_store_ref(q, k, v, cos, sin, positions, kv_cache, layer, slot_mapping):
    """q rotated in place; rotated k and v written at slot_mapping in kv_cache[layer] (-1 rows
    skipped); k is left as it was. Returns q."""
    from outpace.kernels.store_kv import store_kv_ref
    k_rot = k.clone()
    apply_rope_ref(q, k_rot, cos, sin, positions)
    store_kv_ref(kv_cache, layer, k_rot, v, slot_mapping)
    return q


# ----------------------------------------------------------------------------- triton

if triton is not None:
    from outpace.kernels.pdl import wait_then_release

    @triton.jit
    def _rotate_heads(base, stride_h, num_heads, cos, sin, d, dmask, HALF,
                      BLOCK_H: tl.constexpr):
        h = tl.arange(0, BLOCK_H)
        mask = (h < num_heads)[:, None] & dmask[None, :]
        p1 = base + h[:, None] * stride_h + d[None, :]  # first half; the second is HALF further
        x1 = tl.load(p1, mask=mask, other=0.0)
        x2 = tl.load(p1 + HALF, mask=mask, other=0.0)
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        tl.store(p1, (x1f * cos - x2f * sin).to(x1.dtype), mask=mask)
        tl.store(p1 + HALF, (x2f * cos + x1f * sin).to(x1.dtype), mask=mask)

    @triton.jit
    def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, pos_ptr, stride_qt, stride_qh, stride_kt,
                     stride_kh, stride_cos, stride_sin, num_q_heads, num_kv_heads, HALF,
                     TABLE_OFF, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_vt, stride_vh,
                     stride_cb, stride_co, stride_ch, BLOCK_HQ: tl.constexpr,
                     BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
                     STORE_KV: tl.constexpr, CACHE_BLOCK: tl.constexpr,
                     USE_PDL: tl.constexpr):
        # One program per token: the cos/sin row is loaded once for all q and k heads.
        wait_then_release(USE_PDL)
        t = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        d = tl.arange(0, BLOCK_HALF)
        dmask = d < HALF
        cos = tl.load(cos_ptr + pos * stride_cos + TABLE_OFF + d, mask=dmask, other=0.0)
        sin = tl.load(sin_ptr + pos * stride_sin + TABLE_OFF + d, mask=dmask, other=0.0)
        cos = cos.to(tl.float32)[None, :]
        sin = sin.to(tl.float32)[None, :]
        _rotate_heads(q_ptr + t * stride_qt, stride_qh, num_q_heads, cos, sin, d, dmask, HALF,
                      BLOCK_H=BLOCK_HQ)
        if STORE_KV:
            slot = tl.load(slot_ptr + t).to(tl.int64)
            if slot >= 0:  # -1: a padded row writes nothing
                h = tl.arange(0, BLOCK_HKV)[:, None]
                mask = (h < num_kv_heads) & dmask[None, :]
                src = k_ptr + t * stride_kt + h * stride_kh + d[None, :]
                x1 = tl.load(src, mask=mask, other=0.0)
                x2 = tl.load(src + HALF, mask=mask, other=0.0)
                x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
                dst = (slot // CACHE_BLOCK) * stride_cb + (slot % CACHE_BLOCK) * stride_co \
                    + h * stride_ch + d[None, :]
                # round to k's dtype first, as rope-then-store would
                tl.store(kc_ptr + dst, (x1f * cos - x2f * sin).to(x1.dtype)
                         .to(kc_ptr.dtype.element_ty), mask=mask)
                tl.store(kc_ptr + dst + HALF, (x2f * cos + x1f * sin).to(x1.dtype)
                         .to(kc_ptr.dtype.element_ty), mask=mask)
                vsrc = v_ptr + t * stride_vt + h * stride_vh + d[None, :]
                tl.store(vc_ptr + dst, tl.load(vsrc, mask=mask).to(vc_ptr.dtype.element_ty),
                         mask=mask)
                tl.store(vc_ptr + dst + HALF, tl.load(vsrc + HALF, mask=mask)
                         .to(vc_ptr.dtype.element_ty), mask=mask)
        else:
            _rotate_heads(k_ptr + t * stride_kt, stride_kh, num_kv_heads, cos, sin, d, dmask,
                          HALF, BLOCK_H=BLOCK_HKV)


def apply_rope_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In place, Triton. Same contract as `apply_rope_ref`; q/k may be strided views (e.g. slices
    of a fused qkv buffer) as long as their last dim is contiguous."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    off = _table_offset(cos, d)
    _table_offset(sin, d)
    if q.stride(-1) != 1 or k.stride(-1) != 1:  # rare: rotate contiguous copies, copy back
        qc, kc = q.contiguous(), k.contiguous()
        apply_rope_triton(qc, kc, cos, sin, positions)
        q.copy_(qc)
        k.copy_(kc)
        return q, k
    if cos.stride(-1) != 1:
        cos = cos.contiguous()
    if sin.stride(-1) != 1:
        sin = sin.contiguous()
    if t == 0:
        return q, k
    half = d // 2
    _rope_kernel[(t,)](
        q, k, cos, sin, positions, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos.stride(0), sin.stride(0), hq, hkv, half, off,
        q, q, q, positions, 0, 0, 0, 0, 0,  # no KV store: unused
        BLOCK_HQ=next_pow2(hq), BLOCK_HKV=next_pow2(hkv), BLOCK_HALF=next_pow2(half),
        STORE_KV=False, CACHE_BLOCK=1, num_warps=4, **pdl.launch_options(q))
    return q, k


def apply_rope_and_store_triton(q, k, v, cos, sin, positions, kv_cache, layer, slot_mapping):
    """One launch: q [T, Hq, D] rotated in place; rotated k and v [T, Hkv, D] written into
    kv_cache[layer] ([slots, 2, blocks, block_size, Hkv, D]) at slot_mapping (-1 rows skipped);
    k itself is not modified. q/k/v may be strided head views with a contiguous last dim.
    Graph-capturable. Returns q."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    off = _table_offset(cos, d)
    _table_offset(sin, d)
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1 or cos.stride(-1) != 1 \
            or sin.stride(-1) != 1:  # rare: the two-launch path handles copies
        from outpace.kernels.store_kv import store_kv_triton
        k_rot = k.clone()
        apply_rope_triton(q, k_rot, cos, sin, positions)
        store_kv_triton(kv_cache, layer, k_rot, v, slot_mapping)
        return q
    if t == 0:
        return q
    kc, vc = kv_cache[layer, 0], kv_cache[layer, 1]  # [blocks, block_size, Hkv, D] views
    if kc.stride(-1) != 1 or kc.stride() != vc.stride():
        raise ValueError("kv_cache must be contiguous in its last dim, with equal K and V strides")
    half = d // 2
    _rope_kernel[(t,)](
        q, k, cos, sin, positions, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos.stride(0), sin.stride(0), hq, hkv, half, off,
        v, kc, vc, slot_mapping, v.stride(0), v.stride(1), kc.stride(0), kc.stride(1),
        kc.stride(2),
        BLOCK_HQ=next_pow2(hq), BLOCK_HKV=next_pow2(hkv), BLOCK_HALF=next_pow2(half),
        STORE_KV=True, CACHE_BLOCK=kc.shape[1], num_warps=4, **pdl.launch_options(q))
    return q


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In place; Triton on CUDA when triton is importable, the reference otherwise."""
    if use_triton(q):
        return apply_rope_triton(q, k, cos, sin, positions)
    return apply_rope_ref(q, k, cos, sin, positions)
