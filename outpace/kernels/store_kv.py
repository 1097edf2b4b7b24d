"""Write new K/V rows into the paged KV pool through the slot mapping (Triton).

Pool layout (outpace/attention/base.py):

    kv_cache[layer_slot, 0|1, block_id, offset_in_block, kv_head, head_dim]
    slot = block_id * block_size + offset_in_block

Padded rows carry slot -1 and write nothing (the reference, `store_kv_ref`, writes them into the
null block 0, which nobody reads, so the two agree on everything that is ever read).
"""

from __future__ import annotations

import torch

from outpace.kernels import next_pow2

try:  # guarded: CPU machines may not have triton
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None
    tl = None


NULL_SLOT = 0  # the first slot of block 0, the pool's null block (attention/base.NULL_BLOCK)


def store_kv_ref(kv_cache: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Write k/v [T, Hkv, D] at slot_mapping [T]; slot -1 (padding) lands in the null block."""
    _, _, num_blocks, block_size, hkv, d = kv_cache.shape
    slots = torch.where(slot_mapping < 0, NULL_SLOT, slot_mapping)
    kv_cache[layer, 0].view(num_blocks * block_size, hkv, d).index_copy_(0, slots, k.to(kv_cache.dtype))
    kv_cache[layer, 1].view(num_blocks * block_size, hkv, d).index_copy_(0, slots, v.to(kv_cache.dtype))


if triton is not None:

    @triton.jit
    def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_kt, stride_kh,
                         stride_vt, stride_vh, stride_cb, stride_co, stride_ch, num_kv_heads,
                         HEAD_DIM, BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_D: tl.constexpr):
        # One program per token; every kv head of the token is written in one 2-D tile.
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot < 0:  # padded row
            return
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < num_kv_heads) & (d < HEAD_DIM)
        dst = blk * stride_cb + off * stride_co + h * stride_ch + d
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
        tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
        tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(kv_cache: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """kv_cache [slots, 2, blocks, block_size, Hkv, D]; k/v [T, Hkv, D] (last dim contiguous,
    other strides free); slot_mapping [T] int (-1 = padded row, skipped). Graph-capturable."""
    t, hkv, d = k.shape
    if t == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    kc, vc = kv_cache[layer, 0], kv_cache[layer, 1]  # [blocks, block_size, Hkv, D] views
    if kc.stride(-1) != 1 or kc.stride() != vc.stride():
        raise ValueError("kv_cache must be contiguous in its last dim, with equal K and V strides")
    _store_kv_kernel[(t,)](
        k, v, kc, vc, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), hkv, d, kc.shape[1],
        BLOCK_H=next_pow2(hkv), BLOCK_D=next_pow2(d), num_warps=4 if hkv * d >= 2048 else 2)
