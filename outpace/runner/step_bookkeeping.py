"""The fused decode step's bookkeeping as three small Triton kernels, with their PyTorch references
(runner/fused_step.py runs the kernels on CUDA and the references elsewhere):

    chained_inputs   a chained step's inputs from the previous step's carry: token ids,
                     positions, KV slots through the block tables (-1 for padding rows),
                     sequence lengths, query starts, draft counts (or, for drafts a host
                     drafter staged, its drafts and counts as staged)
    accept           greedy verification (longest draft prefix the target agrees with) or the
                     benchmarks' force-accept, written straight into the step's packed output,
                     with what the head's draft loop and the next chained step read: the token
                     after every row, each request's last committed row and position, the carry
    loop_inputs      positions, KV slots and sequence lengths of every draft-loop step

Why: in PyTorch each of these is 10-20 tiny element-wise kernels with a gap between each two,
which at batch 1 adds up to a noticeable share of the step (decisions-log.md, "where a fused
step's time goes" and "The fused step's bookkeeping is three Triton kernels"). The values are
integers: the kernels and the references agree exactly.
"""

from __future__ import annotations

from typing import Optional

import torch

from outpace.kernels import next_pow2, pdl, use_triton
from outpace.speculative.verify import force_accept, greedy_verify_batched

try:  # guarded: CPU machines may not have triton, and `import outpace` must still work
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None


# ----------------------------------------------------------------------------- references

def slots_for(positions: torch.Tensor, block_tables: torch.Tensor, block_size: int):
    """[..., B] positions -> [..., B] KV slots: position b of each row reads request b's
    [B, W] block table (clamped to the width)."""
    idx = (positions // block_size).clamp(max=block_tables.shape[1] - 1)
    rows = torch.arange(block_tables.shape[0], device=positions.device)
    blocks = block_tables[rows, idx].to(torch.long)  # broadcasts to [..., B], contiguous
    return blocks * block_size + positions % block_size


def chained_inputs_ref(carry_pos, carry_tokens, real, block_tables, block_size: int, q: int,
                       input_ids, positions, slot_mapping, seq_lens, query_start_loc,
                       num_drafts, host_drafts: Optional[torch.Tensor] = None) -> None:
    """Row j of request b is the token carry_tokens[b, j] at position carry_pos[b] + j.
    carry_pos, real, num_drafts: [B]; carry_tokens [B, >= q]; block_tables [B, W]; the outputs
    are the first B * q (B, B + 1) entries of the input buffers. With host_drafts ([B, >= q - 1],
    a host drafter's drafts, staged with num_drafts): rows 1 .. q - 1 are host_drafts[b] and
    num_drafts is left as staged."""
    bucket = carry_pos.shape[0]
    n = bucket * q
    pos = carry_pos.unsqueeze(1) + torch.arange(q, device=carry_pos.device)  # [B, q]
    slots = slots_for(pos.T, block_tables, block_size).T
    slots = torch.where(real.unsqueeze(1), slots, torch.full_like(slots, -1))
    if host_drafts is not None:
        ids = torch.cat([carry_tokens[:, :1], host_drafts[:, :q - 1]], dim=1)
        input_ids[:n].copy_(ids.reshape(n))
    else:
        input_ids[:n].copy_(carry_tokens[:, :q].reshape(n))
    positions[:n].copy_(pos.reshape(n))
    slot_mapping[:n].copy_(slots.reshape(n))
    seq_lens[:bucket].copy_(pos[:, -1] + 1)
    query_start_loc[:bucket + 1].copy_(
        torch.arange(bucket + 1, dtype=torch.int32, device=carry_pos.device) * q)
    if host_drafts is None:
        num_drafts[:bucket].copy_(torch.where(real, q - 1, 0))


def accept_ref(target, input_ids, num_drafts, positions, q: int, packed,
               force_u: Optional[torch.Tensor] = None, force_mean: float = 0.0):
    """target [B * q] argmax of every row, input_ids [B * q] (a request's last committed token
    then its drafts), num_drafts [B], positions [B * q].

    Writes packed[:, :q] = emitted tokens (accepted drafts, then the target's token at the first
    rejected position, then -1) and packed[:, q] = accepted count (greedy_verify_batched; with
    force_u [B] uniform draws, force_accept at force_mean instead: benchmarks, lossy).
    -> (next_ids [B * q]: the token after every row, emitted or the target's filler;
        last_rows [B]: each request's row `accepted`; first [B]: its position;
        last [B]: the token emitted there, the last one)."""
    bucket = num_drafts.shape[0]
    tgt = target.view(bucket, q).to(torch.long)
    drafts = input_ids.view(bucket, q)[:, 1:].to(torch.long)
    if force_u is not None:
        emitted, acc = force_accept(tgt, drafts, num_drafts, force_mean, u=force_u)
    else:
        emitted, acc = greedy_verify_batched(tgt, drafts, num_drafts)
    packed[:, :q].copy_(emitted)
    packed[:, q].copy_(acc)
    next_ids = torch.where(emitted >= 0, emitted, tgt).view(bucket * q)
    last_rows = torch.arange(bucket, device=target.device) * q + acc
    first = positions.view(bucket, q)[:, 0] + acc
    return next_ids, last_rows, first, emitted.gather(1, acc.unsqueeze(1)).squeeze(1)


def loop_inputs_ref(first, block_tables, block_size: int, steps: int):
    """Draft-loop step s = 1 .. steps of request b runs at position first[b] + s.
    -> (positions, slots [steps, B] long, seq_lens [steps, B] int32)."""
    s = torch.arange(1, steps + 1, device=first.device).unsqueeze(1)
    pos = first.unsqueeze(0) + s
    return pos, slots_for(pos, block_tables, block_size), (pos + 1).to(torch.int32)


# ----------------------------------------------------------------------------- kernels

if triton is not None:
    from outpace.kernels.pdl import wait_then_release

    # All three are PDL kernels (kernels/pdl.py) with no prologue: each waits first. Launched
    # that way, accept and the loop's inputs start while the argmax before them finishes, and
    # the projection after them may start its weight loads early.

    @triton.jit
    def _chained_inputs_kernel(carry_pos_ptr, carry_tok_ptr, stride_ct, real_ptr, bt_ptr,
                               stride_bt, width, ids_ptr, pos_ptr, slot_ptr, lens_ptr, qsl_ptr,
                               nd_ptr, hd_ptr, stride_hd, bucket, BS: tl.constexpr,
                               Q: tl.constexpr, QP: tl.constexpr, HOST_DRAFTS: tl.constexpr,
                               USE_PDL: tl.constexpr):
        wait_then_release(USE_PDL)
        b = tl.program_id(0)
        j = tl.arange(0, QP)
        jm = j < Q
        p0 = tl.load(carry_pos_ptr + b).to(tl.int64)
        pos = p0 + j
        if HOST_DRAFTS:  # the bonus token from the carry, the drafts as the host staged them
            tok = tl.load(carry_tok_ptr + b * stride_ct + j, mask=j == 0, other=0)
            tok += tl.load(hd_ptr + b * stride_hd + j - 1, mask=jm & (j > 0), other=0)
        else:
            tok = tl.load(carry_tok_ptr + b * stride_ct + j, mask=jm, other=0)
        is_real = tl.load(real_ptr + b).to(tl.int1)
        idx = tl.minimum(pos // BS, width - 1)
        blk = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + idx, mask=jm, other=0).to(tl.int64)
        slot = tl.where(is_real, blk * BS + pos % BS, -1)
        row = b * Q + j
        tl.store(ids_ptr + row, tok, mask=jm)
        tl.store(pos_ptr + row, pos, mask=jm)
        tl.store(slot_ptr + row, slot, mask=jm)
        tl.store(lens_ptr + b, (p0 + Q).to(tl.int32))
        tl.store(qsl_ptr + b, (b * Q).to(tl.int32))
        if b == bucket - 1:  # (b + 1, not bucket: an argument equal to 1 arrives as a Python
            # int, which has no .to)
            tl.store(qsl_ptr + b + 1, ((b + 1) * Q).to(tl.int32))
        if not HOST_DRAFTS:
            tl.store(nd_ptr + b, tl.where(is_real, Q - 1, 0).to(tl.int64))

    @triton.jit
    def _accept_kernel(tgt_ptr, ids_ptr, nd_ptr, pos_ptr, u_ptr, force_base, packed_ptr,
                       stride_pk, next_ptr, last_rows_ptr, first_ptr, carry_pos_ptr,
                       carry_tok_ptr, stride_ct, FORCE: tl.constexpr, HEAD: tl.constexpr,
                       CHAIN: tl.constexpr, Q: tl.constexpr, QP: tl.constexpr,
                       USE_PDL: tl.constexpr):
        wait_then_release(USE_PDL)
        b = tl.program_id(0)
        j = tl.arange(0, QP)
        jm = j < Q
        row0 = b * Q
        t = tl.load(tgt_ptr + row0 + j, mask=jm, other=0).to(tl.int64)
        dm = j < Q - 1
        d = tl.load(ids_ptr + row0 + j + 1, mask=dm, other=-1).to(tl.int64)  # draft j
        nd = tl.load(nd_ptr + b).to(tl.int64)
        if FORCE:
            u = tl.load(u_ptr + b)
            acc = tl.maximum(tl.floor(force_base + u), 0.0).to(tl.int64)
            acc = tl.minimum(acc, nd)
        else:  # first rejected draft (or the first position without one)
            ok = (d == t) & dm & (j < nd)
            acc = tl.min(tl.where(ok, QP, j), axis=0).to(tl.int64)
        last = tl.sum(tl.where(j == acc, t, 0), axis=0)
        emitted = tl.where(j < acc, d, tl.where(j == acc, last, -1))
        tl.store(packed_ptr + b * stride_pk + j, emitted, mask=jm)
        tl.store(packed_ptr + b * stride_pk + Q, acc)
        first = tl.load(pos_ptr + row0).to(tl.int64) + acc
        if HEAD:
            tl.store(next_ptr + row0 + j, tl.where(emitted >= 0, emitted, t), mask=jm)
            tl.store(last_rows_ptr + b, row0 + acc)
            tl.store(first_ptr + b, first)
        if CHAIN:
            tl.store(carry_pos_ptr + b, first + 1)
            tl.store(carry_tok_ptr + b * stride_ct, last)

    @triton.jit
    def _loop_inputs_kernel(first_ptr, bt_ptr, stride_bt, width, pos_ptr, slot_ptr, lens_ptr,
                            bucket, BS: tl.constexpr, STEPS: tl.constexpr,
                            USE_PDL: tl.constexpr):
        wait_then_release(USE_PDL)
        b = tl.program_id(0)
        f = tl.load(first_ptr + b).to(tl.int64)
        for s in tl.static_range(STEPS):
            p = f + 1 + s
            blk = tl.load(bt_ptr + b.to(tl.int64) * stride_bt
                          + tl.minimum(p // BS, width - 1)).to(tl.int64)
            tl.store(pos_ptr + s * bucket + b, p)
            tl.store(slot_ptr + s * bucket + b, blk * BS + p % BS)
            tl.store(lens_ptr + s * bucket + b, (p + 1).to(tl.int32))


# ----------------------------------------------------------------------------- launchers

def chained_inputs_triton(carry_pos, carry_tokens, real, block_tables, block_size: int, q: int,
                          input_ids, positions, slot_mapping, seq_lens, query_start_loc,
                          num_drafts, host_drafts: Optional[torch.Tensor] = None) -> None:
    bucket = carry_pos.shape[0]
    hd = host_drafts if host_drafts is not None else carry_tokens
    _chained_inputs_kernel[(bucket,)](
        carry_pos, carry_tokens, carry_tokens.stride(0), real, block_tables,
        block_tables.stride(0), block_tables.shape[1], input_ids, positions, slot_mapping,
        seq_lens, query_start_loc, num_drafts, hd, hd.stride(0), bucket, BS=block_size, Q=q,
        QP=next_pow2(q), HOST_DRAFTS=host_drafts is not None, num_warps=1,
        **pdl.launch_options(carry_pos))


def accept_triton(target, input_ids, num_drafts, positions, q: int, packed,
                  force_u: Optional[torch.Tensor] = None, force_mean: float = 0.0, *,
                  head: bool = True, carry: Optional[tuple] = None):
    bucket = num_drafts.shape[0]
    dev = target.device
    if head:
        next_ids = torch.empty(bucket * q, dtype=torch.long, device=dev)
        last_rows = torch.empty(bucket, dtype=torch.long, device=dev)
        first = torch.empty(bucket, dtype=torch.long, device=dev)
    else:  # the kernel writes none of them (HEAD=False): any pointer will do
        next_ids = last_rows = first = packed
    carry_pos, carry_tok = carry if carry is not None else (packed, packed)
    _accept_kernel[(bucket,)](
        target, input_ids, num_drafts, positions,
        force_u if force_u is not None else packed, float(force_mean) - 1.0,
        packed, packed.stride(0), next_ids, last_rows, first, carry_pos, carry_tok,
        carry_tok.stride(0), FORCE=force_u is not None, HEAD=head, CHAIN=carry is not None,
        Q=q, QP=next_pow2(q), num_warps=1, **pdl.launch_options(target))
    return (next_ids, last_rows, first) if head else (None, None, None)


def loop_inputs_triton(first, block_tables, block_size: int, steps: int):
    bucket = first.shape[0]
    pos = torch.empty(steps, bucket, dtype=torch.long, device=first.device)
    slots = torch.empty_like(pos)
    lens = torch.empty(steps, bucket, dtype=torch.int32, device=first.device)
    _loop_inputs_kernel[(bucket,)](first, block_tables, block_tables.stride(0),
                                   block_tables.shape[1], pos, slots, lens, bucket,
                                   BS=block_size, STEPS=steps, num_warps=1,
                                   **pdl.launch_options(first))
    return pos, slots, lens


# ----------------------------------------------------------------------------- dispatchers

def chained_inputs(*args, host_drafts: Optional[torch.Tensor] = None) -> None:
    """chained_inputs_ref's writes (same arguments), in one kernel on CUDA."""
    (chained_inputs_triton if use_triton(args[0]) else chained_inputs_ref)(
        *args, host_drafts=host_drafts)


def accept(target, input_ids, num_drafts, positions, q: int, packed,
           force_u: Optional[torch.Tensor] = None, force_mean: float = 0.0, *,
           head: bool = True, carry: Optional[tuple] = None):
    """accept_ref's writes, in one kernel on CUDA; carry (carry_pos [B], carry_tokens [B, >= 1]):
    also the next chained step's first row there (position first + 1, the last emitted token).
    -> (next_ids, last_rows, first) as accept_ref's (None on CUDA unless `head`)."""
    if use_triton(target):
        return accept_triton(target, input_ids, num_drafts, positions, q, packed, force_u,
                             force_mean, head=head, carry=carry)
    next_ids, last_rows, first, last = accept_ref(target, input_ids, num_drafts, positions, q,
                                                  packed, force_u, force_mean)
    if carry is not None:
        carry[0].copy_(first + 1)
        carry[1][:, 0].copy_(last)
    return next_ids, last_rows, first


def loop_inputs(first, block_tables, block_size: int, steps: int):
    """loop_inputs_ref's result, from one kernel on CUDA."""
    if use_triton(first):
        return loop_inputs_triton(first, block_tables, block_size, steps)
    return loop_inputs_ref(first, block_tables, block_size, steps)
