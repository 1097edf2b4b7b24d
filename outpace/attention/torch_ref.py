"""Reference attention backend: gather each sequence's pages, then SDPA. CPU and CUDA.

It is the oracle the Triton kernels are compared with, and the CPU engine's backend. It reads
the host mirrors of the metadata, so it is not graph-capturable.

On CPU a step where every sequence has one query token (plain decode, the lengths near
enough) takes a batched path (see DecodePlan): a decode step is hundreds of tiny ops, so their
count is what costs. So does a step of one sequence with a few query tokens (a verify step at
batch 1, the draft head's first pass over it): one 4-D SDPA (the flash kernel) with a causal
mask made once per step, where the general path builds the mask in every layer. Other steps
(prefill chunks, chunks beside decodes) attend each sequence on the flash kernel too
(attend_sequence_cpu); CUDA keeps the oracle's way (attend_sequence_oracle).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from outpace.attention.base import NULL_BLOCK, AttentionBackend, AttentionMetadata
from outpace.kernels.store_kv import store_kv_ref as store_kv  # noqa: F401  (the reference write)


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


def attend_sequence_oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """One sequence's attention, the oracle's way: q [n, Hq, D] (the sequence's last n
    positions), k/v [Hkv, L, D] -> [n, Hq, D], causal. GQA without copying K/V: each KV head's
    query group is folded into the query axis, [n, Hq, D] -> [Hkv, group * n, D], and one SDPA
    takes an explicit causal mask."""
    n, hq, d = q.shape
    hkv, kv_len = k.shape[0], k.shape[1]
    group = hq // hkv
    qs = q.view(n, hkv, group, d).permute(1, 2, 0, 3).reshape(hkv, group * n, d)
    mask = None if n == 1 else causal_mask(n, kv_len, q.device).repeat(group, 1)
    o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale)
    return o.view(hkv, group, n, d).permute(2, 0, 1, 3).reshape(n, hq, d)


# From this many query tokens on, a CPU prefill chunk attends its cached prefix and its own
# causal square in two flash calls (the square's masked half skipped), merged by logsumexp;
# below it the two calls and the merge cost more than the masked half they save.
_SPLIT_MIN_QUERIES = 256


def attend_sequence_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """attend_sequence_oracle's result on the CPU flash kernel, which SDPA takes only for 4-D
    inputs (3-D ones, as the oracle passes, run its math kernel: several times slower on a
    prefill chunk). q [n, Hq, D], k/v [Hkv, L, D] -> [n, Hq, D].

    Queries go head-major, [Hq, n, D], which viewed as [1, Hkv, group * n, D] is the oracle's
    fold (row g * n + i: query i of the KV head's g-th query head) without copying K/V. A
    chunk of fewer than _SPLIT_MIN_QUERIES queries takes one call with the folded causal mask;
    a longer one attends the prefix (keys 0 .. L - n - 1, seen by every query: no mask,
    folded) and the chunk's own keys (causal: SDPA's is_causal over the square, its K/V
    expanded to the query heads) separately, and the two are merged with their logsumexps."""
    n, hq, d = q.shape
    hkv, kv_len = k.shape[0], k.shape[1]
    group = hq // hkv
    qh = q.transpose(0, 1).contiguous()  # [Hq, n, D]
    qf = qh.view(1, hkv, group * n, d)
    kf, vf = k.unsqueeze(0), v.unsqueeze(0)
    if n == 1:
        o = F.scaled_dot_product_attention(qf, kf, vf, scale=scale)
    elif n < _SPLIT_MIN_QUERIES:
        mask = causal_mask(n, kv_len, q.device).repeat(group, 1)
        o = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, scale=scale)
    else:
        o = _attend_split(qh, qf, kf, vf, scale)
    return o.view(hq, n, d).transpose(0, 1)


def _attend_split(qh, qf, kf, vf, scale: float) -> torch.Tensor:
    """attend_sequence_cpu's two-part attention -> [Hq, n, D] (float32 for narrower inputs:
    the caller's copy rounds once). The CPU flash kernel is called directly, not through SDPA,
    for the logsumexp the merge needs."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    hq, n, d = qh.shape
    group = hq // kf.shape[1]
    prefix = kf.shape[2] - n
    kd = kf[0, :, prefix:].repeat_interleave(group, 0).unsqueeze(0)  # [1, Hq, n, D]
    vd = vf[0, :, prefix:].repeat_interleave(group, 0).unsqueeze(0)
    o_own, lse_own = flash(qh.unsqueeze(0), kd, vd, 0.0, True, scale=scale)
    if prefix == 0:
        return o_own.reshape(hq, n, d)
    o_pre, lse_pre = flash(qf, kf[:, :, :prefix], vf[:, :, :prefix], 0.0, False, scale=scale)
    lse_pre, lse_own = lse_pre.reshape(hq, n, 1), lse_own.reshape(hq, n, 1)
    lse = torch.logaddexp(lse_pre, lse_own)
    return (o_pre.reshape(hq, n, d) * torch.exp(lse_pre - lse)
            + o_own.reshape(hq, n, d) * torch.exp(lse_own - lse))


@dataclass
class DecodePlan:
    """What every layer of one plain-decode step (B sequences, one query token each) shares,
    made once per step: layers differ only in their KV slot.

      slots      [B] long: the write slots, padding (-1) already sent to the null block
      kv_start   the single sequence's blocks are consecutive, so its K/V is the run of pool
                 slots kv_start .. kv_start + kv_len - 1 and attention reads a view, no copy;
                 None: gather block_ids instead
      block_ids  [B * nb] long: nb table entries per sequence (padded entries included)
      kv_len     KV positions attended to per sequence: the longest sequence's length
      mask       [B, 1, 1, kv_len] float, -inf past a shorter sequence's end (None: all equal)
      pad        [1, B, kv_len, 1, 1] bool, the same positions: their gathered K/V are zeroed
                 so that stale values there (even inf/nan) can't leak through 0 * x
      q_len      query tokens per sequence: 1, or n > 1 for a single sequence (a verify step
                 at batch 1); mask is then the causal
                 [n * group, kv_len] float mask of the folded queries (row i * group + g:
                 query i, position kv_len - n + i)
    """

    slots: torch.Tensor
    kv_start: Optional[int]
    block_ids: Optional[torch.Tensor]
    kv_len: int
    mask: Optional[torch.Tensor] = None
    pad: Optional[torch.Tensor] = None
    q_len: int = 1


# Single-sequence steps of at most this many query tokens take the DecodePlan path too (a
# verify block, the draft head's first pass over it); longer ones (prefill chunks) the general.
_FEW_QUERY_MAX = 16


# A plain-decode step pads its sequences' keys to the longest one's, and every layer gathers,
# zeroes and attends the padding; past this many padded keys a sequence on average (a long
# context beside short ones) that costs more than a call per sequence, so the general path
# attends each sequence over its own keys instead.
_PADDING_PER_SEQ_MAX = 128


def make_decode_plan(meta: AttentionMetadata, block_size: int, dtype=torch.float32,
                     group: int = 1) -> Optional[DecodePlan]:
    """A DecodePlan when every sequence has exactly one query token (and their lengths are
    near enough: _PADDING_PER_SEQ_MAX), or when a single sequence has a few
    (2.._FEW_QUERY_MAX), and the host mirrors are there (the CPU engine's decode and batch-1
    verify steps); None otherwise (prefill, batched verify, graph metadata). dtype: the
    queries' (the mask's); group: query heads per KV head."""
    qsl, seq_lens = meta.query_start_loc_host, meta.seq_lens_host
    b = len(seq_lens)
    if b == 1 and len(qsl) == 2 and qsl[0] == 0 and 1 < qsl[1] <= min(_FEW_QUERY_MAX,
                                                                          seq_lens[0]):
        return _few_query_plan(meta, block_size, dtype, group, qsl[1], seq_lens[0])
    if b == 0 or len(qsl) != b + 1 or qsl != list(range(b + 1)) or min(seq_lens) < 1:
        return None
    kv_len = max(seq_lens)
    if b * kv_len - sum(seq_lens) > _PADDING_PER_SEQ_MAX * b:
        return None  # lengths too unequal to pad (see _PADDING_PER_SEQ_MAX)
    slots = meta.slot_mapping[:b]
    slots = torch.where(slots < 0, NULL_BLOCK * block_size, slots)
    nb = (kv_len + block_size - 1) // block_size
    table = meta.block_tables[:b, :nb]
    if b == 1:
        ids = table[0].tolist()  # sync-ok: a CPU tensor
        if ids[0] != NULL_BLOCK and ids == list(range(ids[0], ids[0] + nb)):
            return DecodePlan(slots, ids[0] * block_size, None, kv_len)
    plan = DecodePlan(slots, None, table.reshape(-1).long(), kv_len)
    if min(seq_lens) != kv_len:
        dev = slots.device
        pad = (torch.arange(kv_len, device=dev)[None, :]
               >= torch.tensor(seq_lens, device=dev)[:, None])  # [B, kv_len]
        plan.mask = torch.zeros(b, 1, 1, kv_len, dtype=dtype, device=dev).masked_fill_(
            pad.view(b, 1, 1, kv_len), float("-inf"))
        plan.pad = pad.view(1, b, kv_len, 1, 1)
    return plan


def _few_query_plan(meta: AttentionMetadata, block_size: int, dtype, group: int, n: int,
                    kv_len: int) -> Optional[DecodePlan]:
    """make_decode_plan for one sequence of n > 1 query tokens: attention reads a view of the
    pool when its blocks are consecutive, else gathers them (one copy a layer)."""
    nb = (kv_len + block_size - 1) // block_size
    table = meta.block_tables[0, :nb]
    slots = meta.slot_mapping[:n]
    slots = torch.where(slots < 0, NULL_BLOCK * block_size, slots)
    # query i (position kv_len - n + i) sees kv j <= kv_len - n + i; rows i * group + g
    mask = torch.zeros(n * group, kv_len, dtype=dtype, device=slots.device).masked_fill_(
        ~causal_mask(n, kv_len, slots.device).repeat_interleave(group, 0), float("-inf"))
    ids = table.tolist()  # sync-ok: a CPU tensor
    if ids[0] != NULL_BLOCK and ids == list(range(ids[0], ids[0] + nb)):
        return DecodePlan(slots, ids[0] * block_size, None, kv_len, mask=mask, q_len=n)
    return DecodePlan(slots, None, table.long(), kv_len, mask=mask, q_len=n)


class TorchRefBackend(AttentionBackend):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._plan_meta = None  # the metadata self._plan was made from (one step's)
        self._plan: Optional[DecodePlan] = None
        self._runs_meta = None  # the metadata self._runs was made from (see _kv_runs)
        self._runs: list = []

    def forward(self, layer, q, k, v, meta: AttentionMetadata):
        if not q.is_cuda:  # (on CUDA this backend is the oracle: keep it to the general path)
            # A step's metadata is made fresh and not changed while its layers run, so the
            # plan made at its first layer serves them all.
            if meta is not self._plan_meta:
                self._plan_meta = meta
                self._plan = make_decode_plan(meta, self.block_size, q.dtype,
                                              self.num_heads // self.num_kv_heads)
            if self._plan is not None:
                return self.decode(layer, q, k, v, self._plan)
        return self.attend_each(layer, q, k, v, meta)

    def attend_stored(self, layer, q, meta: AttentionMetadata):
        return self.attend_each(layer, q, None, None, meta)

    def attend_each(self, layer, q, k, v, meta: AttentionMetadata):
        """The general path: store (unless k is None: already stored), then each sequence's
        attention over its gathered pages (attend_sequence_cpu on the CPU; on CUDA, where this
        backend is the oracle, attend_sequence_oracle)."""
        if k is not None:
            store_kv(self.kv_cache, layer, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        # Metadata built for a graph carries no host mirrors; read the device tensors instead
        # (a sync, which is fine for the oracle; the GPU path uses the Triton backend).
        qsl = meta.query_start_loc_host or meta.query_start_loc.tolist()  # sync-ok: oracle
        seq_lens = meta.seq_lens_host or meta.seq_lens.tolist()  # sync-ok: oracle
        attend = attend_sequence_oracle if q.is_cuda else attend_sequence_cpu
        # (graph metadata, without host mirrors, is one object refilled every replay: no
        # per-step plan can be kept for it)
        runs = None if q.is_cuda or not meta.seq_lens_host else self._kv_runs(meta, seq_lens)
        for s, kv_len in enumerate(seq_lens):
            a, b = qsl[s], qsl[s + 1]
            if b == a:
                continue
            if runs is not None and runs[s] is not None:
                pool = self.kv_cache[layer].flatten(1, 2)  # [K|V, slot, Hkv, D]
                ks, vs = pool[0, runs[s]:runs[s] + kv_len], pool[1, runs[s]:runs[s] + kv_len]
            else:
                ks, vs = gather_kv(self.kv_cache, layer, meta.block_tables[s], kv_len)
            ks = ks.transpose(0, 1).to(q.dtype)  # [Hkv, L, D]
            vs = vs.transpose(0, 1).to(q.dtype)
            out[a:b] = attend(q[a:b], ks, vs, self.scale)
        return out

    def _kv_runs(self, meta: AttentionMetadata, seq_lens: list) -> list:
        """Per sequence, the first pool slot of its K/V where its blocks are consecutive (its
        K/V is then a run of slots, read as a view: no copy a layer), else None; made at a
        step's first layer (its metadata, made fresh each step with host mirrors, serves them
        all)."""
        if meta is not self._runs_meta:
            bs = self.block_size
            runs = []
            for s, kv_len in enumerate(seq_lens):
                nb = (kv_len + bs - 1) // bs
                ids = meta.block_tables[s, :nb].tolist() if nb else []  # sync-ok: a CPU tensor
                consecutive = ids and ids[0] != NULL_BLOCK and ids == list(
                    range(ids[0], ids[0] + nb))
                runs.append(ids[0] * bs if consecutive else None)
            self._runs_meta, self._runs = meta, runs
        return self._runs

    def decode(self, layer, q, k, v, plan: DecodePlan):
        """One query token per sequence: q [B, Hq, D], k/v [B, Hkv, D] -> [B, Hq, D]; or one
        sequence of plan.q_len tokens: q [n, Hq, D], k/v [n, Hkv, D] -> [n, Hq, D].

        Every sequence in one 4-D SDPA call (the CPU flash kernel reads the strided K/V views
        as they are), padded to the longest one; GQA folds each KV head's query group into
        the query axis, as in the general path."""
        _, _, num_blocks, bs, hkv, d = self.kv_cache.shape
        pool = self.kv_cache[layer].view(2, num_blocks * bs, hkv, d)  # [K|V, slot, Hkv, D]
        pool[0].index_copy_(0, plan.slots, k.to(pool.dtype))
        pool[1].index_copy_(0, plan.slots, v.to(pool.dtype))
        b, n = (q.shape[0] if plan.q_len == 1 else 1), plan.kv_len
        if plan.kv_start is not None:
            kv = pool[:, plan.kv_start:plan.kv_start + n].unsqueeze(1)  # [2, 1, L, Hkv, D]
        else:
            kv = (self.kv_cache[layer].view(2, num_blocks, bs * hkv * d)
                  .index_select(1, plan.block_ids).view(2, b, -1, hkv, d)[:, :, :n])
            if plan.pad is not None:
                kv.masked_fill_(plan.pad, 0.0)  # a copy: the pool is untouched
        if kv.dtype != q.dtype:
            kv = kv.to(q.dtype)
        ks, vs = kv[0].transpose(1, 2), kv[1].transpose(1, 2)  # [B, Hkv, L, D]
        if plan.q_len > 1:  # one sequence, q [n, Hq, D]: fold (query, group) into one axis
            hkv, group = self.num_kv_heads, self.num_heads // self.num_kv_heads
            t = plan.q_len
            qs = q.view(t, hkv, group, d).transpose(0, 1).reshape(1, hkv, t * group, d)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=plan.mask,
                                               scale=self.scale)  # [1, Hkv, n * group, D]
            return o.view(hkv, t, group, d).transpose(0, 1).reshape(t, self.num_heads, d)
        qs = q.reshape(b, hkv, self.num_heads // hkv, d)  # [B, Hkv, group, D], a view here
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=plan.mask, scale=self.scale)
        return o.reshape(b, self.num_heads, d)
