"""Reference attention backend: gather each sequence's pages, then SDPA. CPU and CUDA.

It is the oracle the Triton kernels are compared with, and the CPU engine's backend. It reads
the host mirrors of the metadata, so it is not graph-capturable.

On CPU a step where every sequence has a few query tokens (decode, verify, a draft head's
pass; the lengths near enough to pad) takes a planned path (see DecodePlan): such a step is
hundreds of tiny ops, so their count is what costs. Every sequence attends in one 4-D SDPA (the
flash kernel) with the masks made once per step, where the general path makes them, gathers and
attends a sequence at a time in every layer. Other steps (prefill chunks, chunks beside
decodes) attend each sequence on the flash kernel too (attend_sequence_cpu); CUDA keeps the
oracle's way (attend_sequence_oracle).
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
                        scale: float, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """attend_sequence_oracle's result on the CPU flash kernel, which SDPA takes only for 4-D
    inputs (3-D ones, as the oracle passes, run its math kernel: several times slower on a
    prefill chunk). q [n, Hq, D], k/v [Hkv, L, D] -> [n, Hq, D].

    Queries go head-major, [Hq, n, D], which viewed as [1, Hkv, group * n, D] is the oracle's
    fold (row g * n + i: query i of the KV head's g-th query head) without copying K/V. A
    chunk of fewer than _SPLIT_MIN_QUERIES queries takes one call with the folded causal mask;
    a longer one attends the prefix (keys 0 .. L - n - 1, seen by every query: no mask,
    folded) and the chunk's own keys (causal: SDPA's is_causal over the square, its K/V
    expanded to the query heads) separately, and the two are merged with their logsumexps.
    mask: the folded causal mask as folded_causal_mask makes it (a step's layers share one), or
    None to make it here."""
    n, hq, d = q.shape
    hkv, kv_len = k.shape[0], k.shape[1]
    group = hq // hkv
    qh = q.transpose(0, 1).contiguous()  # [Hq, n, D]
    qf = qh.view(1, hkv, group * n, d)
    kf, vf = k.unsqueeze(0), v.unsqueeze(0)
    if n == 1:
        o = F.scaled_dot_product_attention(qf, kf, vf, scale=scale)
    elif n < _SPLIT_MIN_QUERIES:
        if mask is None:
            mask = folded_causal_mask(n, kv_len, group, q.dtype, q.device)
        o = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, scale=scale)
    else:
        o = _attend_split(qh, qf, kf, vf, scale)
    return o.view(hq, n, d).transpose(0, 1)


def folded_causal_mask(n: int, kv_len: int, group: int, dtype, device) -> torch.Tensor:
    """attend_sequence_cpu's mask for n < _SPLIT_MIN_QUERIES queries over kv_len keys:
    [group * n, kv_len] float, 0 where row g * n + i (query i of a KV head's g-th query head)
    may look, -inf elsewhere (SDPA adds it; a float mask is not converted every call)."""
    seen = causal_mask(n, kv_len, device).repeat(group, 1)
    return torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill_(~seen,
                                                                            float("-inf"))


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
    """What every layer of one few-query step (B sequences, 1.._FEW_QUERY_MAX query tokens
    each: decode, verify, a draft head's pass) shares, made once per step: layers differ only
    in their KV slot.

      slots      [T] long: the write slots of the step's T query tokens, padding (-1) already
                 sent to the null block
      kv_start   a single sequence whose blocks are consecutive: its K/V is the run of pool
                 slots kv_start .. kv_start + kv_len - 1 and attention reads a view, no copy;
                 None: gather block_ids instead
      block_ids  [B * nb] long: nb table entries per sequence (padded entries included)
      kv_len     KV positions attended to per sequence: the longest sequence's length
      q_len      query tokens per sequence: the most any sequence has (Q)
      q_rows     [T] long: each query token's row in the padded [B * Q] layout, where the
                 sequences have unequal query counts; None: each has Q (the rows are in order)
      mask       float, -inf where a query may not look: [B, 1, 1, kv_len] past a shorter
                 sequence's end for one query a sequence (None: all lengths equal); for Q > 1
                 [B, 1, Q * group, kv_len], the folded queries (row i * group + g: query i,
                 position len - q + i of a sequence of len keys and q queries) causal over
                 their own keys, and a padded query row (i >= q) sees key 0 only (its output
                 is dropped; a row that sees no key has no softmax to take)
      pad_rows   [P] long: the rows past each sequence's end in the gathered
                 [B * nb * block_size] K/V rows, zeroed so that stale values there (even
                 inf/nan) can't leak through 0 * x; None: no padding
      kv_buf     the gather's destination, [2, B * nb, block_size * Hkv * D], made at the
                 first layer and reused by the rest (a copy allocated a layer costs page
                 faults where it is large enough to be mapped afresh each time)
    """

    slots: torch.Tensor
    kv_start: Optional[int]
    block_ids: Optional[torch.Tensor]
    kv_len: int
    num_seqs: int
    num_tokens: int
    q_len: int = 1
    q_rows: Optional[torch.Tensor] = None
    mask: Optional[torch.Tensor] = None
    pad_rows: Optional[torch.Tensor] = None
    kv_buf: Optional[torch.Tensor] = None


# Steps whose sequences have at most this many query tokens each take the DecodePlan path (a
# decode, a verify block, a draft head's pass over it); longer ones (prefill chunks) the
# general one.
_FEW_QUERY_MAX = 16


# A planned step pads its sequences' keys to the longest one's, and every layer gathers,
# zeroes and attends the padding; past this many padded keys a sequence on average (a long
# context beside short ones) that costs more than a call per sequence, so the general path
# attends each sequence over its own keys instead. The general path's calls are many small
# ops, each waking the other threads where a step runs on several: there padding pays off
# longer. A sequence's padded query rows attend every key too, so the bound counts padded
# (query row, key) pairs: at most this many a sequence and query row.
_PADDING_PER_SEQ_MAX = 128  # a step on one thread
_PADDING_PER_SEQ_MAX_THREADS = 512  # a step on several


def padding_per_seq_max() -> int:
    """The most padded (query row, key) pairs a sequence and query row, on average, that a
    planned step takes (with equal query counts: padded keys a sequence), for the threads the
    step runs on (models/cpu_fast_paths.cpu_threads_for picks them)."""
    return _PADDING_PER_SEQ_MAX if torch.get_num_threads() == 1 else \
        _PADDING_PER_SEQ_MAX_THREADS


def make_decode_plan(meta: AttentionMetadata, block_size: int, dtype=torch.float32,
                     group: int = 1) -> Optional[DecodePlan]:
    """A DecodePlan when every sequence has 1.._FEW_QUERY_MAX query tokens (and at most as
    many as its keys), their lengths and query counts are near enough to pad
    (padding_per_seq_max, counting a padded query row's keys too), and the
    host mirrors are there (the CPU engine's decode, verify and draft steps); None otherwise
    (prefill chunks, graph metadata). dtype: the queries' (the mask's); group: query heads
    per KV head."""
    qsl, seq_lens = meta.query_start_loc_host, meta.seq_lens_host
    b = len(seq_lens)
    if b == 0 or len(qsl) != b + 1 or qsl[0] != 0:
        return None
    q_lens = [qsl[s + 1] - qsl[s] for s in range(b)]
    if not all(0 < q <= min(_FEW_QUERY_MAX, n) for q, n in zip(q_lens, seq_lens)):
        return None
    kv_len, q_max, t = max(seq_lens), max(q_lens), qsl[-1]
    # padded (query row, key) pairs: for equal query counts q_max times the padded keys
    waste = b * q_max * kv_len - sum(q * n for q, n in zip(q_lens, seq_lens))
    if waste > padding_per_seq_max() * b * q_max:
        return None  # lengths or query counts too unequal to pad (see _PADDING_PER_SEQ_MAX)
    slots = meta.slot_mapping[:t]
    slots = torch.where(slots < 0, NULL_BLOCK * block_size, slots)
    dev = slots.device
    nb = (kv_len + block_size - 1) // block_size
    table = meta.block_tables[:b, :nb]
    plan = DecodePlan(slots, None, None, kv_len, b, t, q_max)
    ids = table[0].tolist() if b == 1 else None  # sync-ok: a CPU tensor
    if ids and ids[0] != NULL_BLOCK and ids == list(range(ids[0], ids[0] + nb)):
        plan.kv_start = ids[0] * block_size
    else:
        plan.block_ids = table.reshape(-1).long()
    lens = torch.tensor(seq_lens, device=dev)
    past = None
    if min(seq_lens) != kv_len:
        past = torch.arange(kv_len, device=dev)[None, :] >= lens[:, None]  # [B, kv_len]
        seq, key = past.nonzero(as_tuple=True)
        plan.pad_rows = seq * (nb * block_size) + key
    if min(q_lens) != q_max:
        plan.q_rows = torch.tensor([s * q_max + i for s, q in enumerate(q_lens)
                                    for i in range(q)], dtype=torch.long, device=dev)
    if q_max == 1:
        if past is not None:
            plan.mask = torch.zeros(b, 1, 1, kv_len, dtype=dtype, device=dev).masked_fill_(
                past.view(b, 1, 1, kv_len), float("-inf"))
        return plan
    # query i of sequence s (position len_s - q_s + i) sees key j <= len_s - q_s + i; a
    # padded query (i >= q_s) sees key 0 only
    i = torch.arange(q_max, device=dev)[None, :]  # [1, Q]
    qs = torch.tensor(q_lens, device=dev)
    last = torch.where(i < qs[:, None], (lens - qs)[:, None] + i, 0)  # [B, Q]
    seen = torch.arange(kv_len, device=dev)[None, None, :] <= last[:, :, None]  # [B, Q, L]
    seen = seen.repeat_interleave(group, 1).view(b, 1, q_max * group, kv_len)
    plan.mask = torch.zeros(seen.shape, dtype=dtype, device=dev).masked_fill_(
        ~seen, float("-inf"))
    return plan


class TorchRefBackend(AttentionBackend):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._plan_meta = None  # the metadata self._plan was made from (one step's)
        self._plan: Optional[DecodePlan] = None
        self._runs_meta = None  # the metadata self._runs was made from (see _kv_runs)
        self._runs: list = []
        self._masks: dict = {}  # (queries, keys) -> folded causal mask, one step's

    def forward(self, layer, q, k, v, meta: AttentionMetadata):
        if not q.is_cuda:  # (on CUDA this backend is the oracle: keep it to the general path)
            # A step's metadata is made fresh and not changed while its layers run, so the
            # plan made at its first layer serves them all.
            if meta is not self._plan_meta:
                self._plan_meta = meta
                self._plan = make_decode_plan(meta, self.block_size, q.dtype,
                                              self.num_heads // self.num_kv_heads)
            if self._plan is not None and q.shape[0] == self._plan.num_tokens:
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
            if runs is None:
                out[a:b] = attend(q[a:b], ks, vs, self.scale)
            else:  # (the CPU with host mirrors: the step's masks made once)
                out[a:b] = attend(q[a:b], ks, vs, self.scale, self._mask(b - a, kv_len, q))
        return out

    def _mask(self, n: int, kv_len: int, q: torch.Tensor) -> Optional[torch.Tensor]:
        """attend_sequence_cpu's folded causal mask for n queries over kv_len keys, made once a
        step (every layer's is the same); None where it takes none."""
        if n == 1 or n >= _SPLIT_MIN_QUERIES:
            return None
        mask = self._masks.get((n, kv_len))
        if mask is None:
            mask = folded_causal_mask(n, kv_len, self.num_heads // self.num_kv_heads, q.dtype,
                                      q.device)
            self._masks[(n, kv_len)] = mask
        return mask

    def _kv_runs(self, meta: AttentionMetadata, seq_lens: list) -> list:
        """Per sequence, the first pool slot of its K/V where its blocks are consecutive (its
        K/V is then a run of slots, read as a view: no copy a layer), else None; made at a
        step's first layer (its metadata, made fresh each step with host mirrors, serves them
        all), which also starts the step's masks afresh."""
        if meta is not self._runs_meta:
            bs = self.block_size
            runs = []
            for s, kv_len in enumerate(seq_lens):
                nb = (kv_len + bs - 1) // bs
                ids = meta.block_tables[s, :nb].tolist() if nb else []  # sync-ok: a CPU tensor
                consecutive = ids and ids[0] != NULL_BLOCK and ids == list(
                    range(ids[0], ids[0] + nb))
                runs.append(ids[0] * bs if consecutive else None)
            self._runs_meta, self._runs, self._masks = meta, runs, {}
        return self._runs

    def decode(self, layer, q, k, v, plan: DecodePlan):
        """A planned step's attention: q [T, Hq, D], k/v [T, Hkv, D] (each sequence's query
        tokens in order) -> [T, Hq, D].

        Every sequence in one 4-D SDPA call (the CPU flash kernel reads the strided K/V views
        as they are), its keys padded to the longest one's and its queries to the most any
        has; GQA folds each KV head's query group into the query axis, as in the general
        path."""
        _, _, num_blocks, bs, hkv, d = self.kv_cache.shape
        pool = self.kv_cache[layer].view(2, num_blocks * bs, hkv, d)  # [K|V, slot, Hkv, D]
        pool[0].index_copy_(0, plan.slots, k.to(pool.dtype))
        pool[1].index_copy_(0, plan.slots, v.to(pool.dtype))
        b, n, nq = plan.num_seqs, plan.kv_len, plan.q_len
        if plan.kv_start is not None:
            kv = pool[:, plan.kv_start:plan.kv_start + n].unsqueeze(1)  # [2, 1, L, Hkv, D]
        else:
            src = self.kv_cache[layer].view(2, num_blocks, bs * hkv * d)
            if plan.kv_buf is None:
                plan.kv_buf = src.new_empty(2, plan.block_ids.numel(), bs * hkv * d)
            kv = torch.index_select(src, 1, plan.block_ids, out=plan.kv_buf)  # (a copy)
            if plan.pad_rows is not None:
                kv.view(2, -1, hkv * d).index_fill_(1, plan.pad_rows, 0.0)
            kv = kv.view(2, b, -1, hkv, d)[:, :, :n]
        if kv.dtype != q.dtype:
            kv = kv.to(q.dtype)
        ks, vs = kv[0].transpose(1, 2), kv[1].transpose(1, 2)  # [B, Hkv, L, D]
        hq, group = self.num_heads, self.num_heads // hkv
        if plan.q_rows is not None:  # unequal query counts: scatter into [B * Q] rows
            q = q.new_zeros(b * nq, hq, d).index_copy_(0, plan.q_rows, q)
        # [B * Q, Hq, D] -> [B, Hkv, Q * group, D], row i * group + g
        qs = q.view(b, nq, hkv, group, d).transpose(1, 2).reshape(b, hkv, nq * group, d)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=plan.mask, scale=self.scale)
        o = o.view(b, hkv, nq, group, d).transpose(1, 2).reshape(b * nq, hq, d)
        return o if plan.q_rows is None else o.index_select(0, plan.q_rows)
