"""Reference attention backend: gather each sequence's pages, then SDPA. CPU and CUDA.

It is the oracle the Triton kernels are compared with, and the CPU engine's backend. It reads
the host mirrors of the metadata, so it is not graph-capturable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from outpace.attention.base import NULL_BLOCK, AttentionBackend, AttentionMetadata


def store_kv(kv_cache: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k/v [T, Hkv, D] at slot_mapping [T]; slot -1 (padding) lands in the null block."""
    _, _, num_blocks, block_size, hkv, d = kv_cache.shape
    slots = torch.where(slot_mapping < 0, NULL_BLOCK * block_size, slot_mapping)
    kv_cache[layer, 0].view(num_blocks * block_size, hkv, d).index_copy_(0, slots, k.to(kv_cache.dtype))
    kv_cache[layer, 1].view(num_blocks * block_size, hkv, d).index_copy_(0, slots, v.to(kv_cache.dtype))


def gather_kv(kv_cache: torch.Tensor, layer: int, block_table: torch.Tensor, seq_len: int):
    """K, V of one sequence as [seq_len, Hkv, D] each."""
    block_size = kv_cache.shape[3]
    nb = (seq_len + block_size - 1) // block_size
    ids = block_table[:nb].long()
    k = kv_cache[layer, 0].index_select(0, ids).flatten(0, 1)[:seq_len]
    v = kv_cache[layer, 1].index_select(0, ids).flatten(0, 1)[:seq_len]
    return k, v


def causal_mask(q_len: int, kv_len: int, device) -> torch.Tensor:
    """[q_len, kv_len] bool: query i (position kv_len - q_len + i) sees kv j <= its position."""
    qpos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    return torch.arange(kv_len, device=device)[None, :] <= qpos


class TorchRefBackend(AttentionBackend):
    def forward(self, layer, q, k, v, meta: AttentionMetadata):
        store_kv(self.kv_cache, layer, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        # Metadata built for a graph carries no host mirrors; read the device tensors instead
        # (a sync, which is fine for the oracle; the GPU path uses the Triton backend).
        qsl = meta.query_start_loc_host or meta.query_start_loc.tolist()  # sync-ok: oracle
        seq_lens = meta.seq_lens_host or meta.seq_lens.tolist()  # sync-ok: oracle
        hkv, d = self.num_kv_heads, self.head_dim
        group = self.num_heads // hkv
        for s, kv_len in enumerate(seq_lens):
            a, b = qsl[s], qsl[s + 1]
            n = b - a
            if n == 0:
                continue
            ks, vs = gather_kv(self.kv_cache, layer, meta.block_tables[s], kv_len)
            ks = ks.transpose(0, 1).to(q.dtype)  # [Hkv, L, D]
            vs = vs.transpose(0, 1).to(q.dtype)
            # GQA without copying K/V: fold each KV head's query group into the query axis,
            # [n, Hq, D] -> [Hkv, group * n, D]. (SDPA's enable_gqa is very slow on CPU.)
            qs = q[a:b].view(n, hkv, group, d).permute(1, 2, 0, 3).reshape(hkv, group * n, d)
            mask = None if n == 1 else causal_mask(n, kv_len, q.device).repeat(group, 1)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=self.scale)
            out[a:b] = o.view(hkv, group, n, d).permute(2, 0, 1, 3).reshape(n, hkv * group, d)
        return out
