"""Fixed-address input buffers of the model runner.

Every step writes its token ids, positions, slot mapping, block tables and lengths into the same
device tensors, so a CUDA graph captured over them replays with new values. The host side is
built with numpy. The buffers are views of one device allocation (a `Segment`) with a host
mirror of the same layout (pinned on CUDA): a step writes its arrays into the mirror and the
parts it wrote go over in one non-blocking copy, not one per buffer (each copy costs host time
tens of microseconds long, and a prefill step stages about ten buffers; decisions-log.md,
"Staged inputs in one copy per segment"). Other components add their own staged
buffers (`add_buffers`), which a load then copies with the batch.

    input_ids      [max_tokens]            int64
    positions      [max_tokens]            int64
    slot_mapping   [max_tokens]            int64  (-1: padded row, writes nowhere that is read)
    logits_indices [max_tokens]            int64  rows of hidden that get logits
    query_start_loc[max_seqs + 1]          int32
    seq_lens       [max_seqs]              int32  KV length after the step
    block_tables   [max_seqs, max_blocks]  int32
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch

from outpace.attention.base import AttentionMetadata


@dataclass
class HostBatch:
    """One step's inputs on the host (numpy), before the copy to the device."""

    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T]
    query_start_loc: np.ndarray  # [B+1]
    seq_lens: np.ndarray  # [B]
    block_tables: np.ndarray  # [B, nb]
    logits_indices: np.ndarray  # [N]


class Segment:
    """Device tensors carved from one allocation, and a host mirror with the same layout
    (pinned on CUDA), so that what a step writes into several of them goes over in one copy.

    A copy covers the written parts and the bytes between them where those gaps are small
    (`GAP`): the gaps get the mirror's older values. Nothing reads them: a graph or an eager
    forward reads only the leading parts its own load wrote, or what its kernels wrote after
    it (every load writes every buffer a step reads)."""

    ALIGN = 64  # bytes; every tensor starts on a multiple
    GAP = 128 << 10  # bytes: parts closer than this go over in one copy

    def __init__(self, specs: list, device: torch.device, pin: bool):
        offsets, total = [], 0
        for shape, dtype in specs:
            offsets.append(total)
            nbytes = math.prod(shape) * dtype.itemsize
            total += -(-nbytes // self.ALIGN) * self.ALIGN
        total = max(total, self.ALIGN)
        self.device_bytes = torch.zeros(total, dtype=torch.uint8, device=device)
        self.host_bytes = torch.zeros(total, dtype=torch.uint8, pin_memory=pin)
        host = self.host_bytes.numpy()  # sync-ok: host memory
        self.offsets = offsets
        self.tensors, self.mirrors = [], []
        for (shape, dtype), off in zip(specs, offsets):
            nbytes = math.prod(shape) * dtype.itemsize
            self.tensors.append(self.device_bytes[off:off + nbytes].view(dtype).view(shape))
            np_dtype = torch.empty(0, dtype=dtype).numpy().dtype  # sync-ok: a CPU tensor
            self.mirrors.append(host[off:off + nbytes].view(np_dtype).reshape(shape))

    def copy(self, ranges: list) -> None:
        """Copy these byte ranges (start, end) of the mirror to the device, merged where close."""
        ranges.sort()
        start, end = ranges[0]
        for a, b in ranges[1:]:
            if a - end > self.GAP:
                self._copy(start, end)
                start = a
            end = max(end, b)
        self._copy(start, end)

    def _copy(self, start: int, end: int) -> None:
        self.device_bytes[start:end].copy_(self.host_bytes[start:end], non_blocking=True)


class InputBuffers:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device,
                 segment: type = Segment):
        """segment: the class buffers are carved from (Segment; tests pass a subclass that
        records its copies)."""
        self.device = device
        self._segment = segment
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        pin = device.type == "cuda"
        self._pin = pin
        # device buffer's data_ptr -> (its segment, its index there, shape, row bytes, item size)
        self._where: dict = {}
        (self.query_start_loc, self.seq_lens, self.logits_indices, self.input_ids,
         self.positions, self.slot_mapping, self.block_tables) = self.add_buffers([
             ((max_seqs + 1,), torch.int32), ((max_seqs,), torch.int32),
             ((max_tokens,), torch.long), ((max_tokens,), torch.long),
             ((max_tokens,), torch.long), ((max_tokens,), torch.long),
             ((max_seqs, max_blocks), torch.int32)])
        self._copied = torch.cuda.Event() if pin else None  # after the last staged copies
        # put_if_changed's memo: device buffer's data_ptr -> the array it last staged there.
        # Any other write to that buffer (_stage, or forget() by direct writers) drops it.
        self._uploaded: dict = {}

    def add_buffers(self, specs: list) -> list:
        """New zeroed device buffers, one per (shape, dtype) of specs, that put / load can stage
        (copied with the batch when passed to load as extra)."""
        seg = self._segment(specs, self.device, self._pin)
        for i, t in enumerate(seg.tensors):
            if t.dim() not in (1, 2):
                raise ValueError(f"staged buffers are 1-D or 2-D, got shape {tuple(t.shape)}")
            row_bytes = t.stride(0) * t.element_size() if t.dim() == 2 else 0
            self._where[t.data_ptr()] = (seg, i, t.shape, row_bytes, t.element_size())
        return list(seg.tensors)

    def put(self, dst: torch.Tensor, src: np.ndarray) -> torch.Tensor:
        """Copy src into the leading part of dst (a buffer of add_buffers) -> that view."""
        return self._stage([(dst, src)])[0]

    def put_all(self, pairs: list) -> list:
        """put for several (buffer, array) pairs, in one copy per segment -> the views."""
        return self._stage(pairs)

    def put_if_changed(self, dst: torch.Tensor, src: np.ndarray) -> torch.Tensor:
        """put, skipped when dst still holds what the last put_if_changed staged and that
        equals src. A chained decode step's block tables change once per block_size tokens
        a request; skipping the unchanged ones saves a host -> device copy, and the gaps
        around it on the GPU, per step."""
        view = dst[tuple(slice(0, n) for n in src.shape)]
        last = self._uploaded.get(dst.data_ptr())
        if last is not None and last.shape == src.shape and np.array_equal(last, src):
            return view
        self.put(dst, src)
        self._uploaded[dst.data_ptr()] = src.copy()
        return view

    def forget(self, dst: torch.Tensor) -> None:
        """dst was written outside put / load (e.g. a dummy batch): drop put_if_changed's memo."""
        self._uploaded.pop(dst.data_ptr(), None)

    def _stage(self, pairs: list, views: bool = True) -> list:
        """Write each (buffer, array) pair's array into the leading part of the buffer's mirror,
        then copy the written parts, one copy per segment (where they lie close) -> the views
        (with `views`; making them costs host time, so `stage`, for graph steps, makes none)."""
        if self._pin:
            # The last copies out of the mirrors must have run before they are overwritten;
            # they were queued before the previous step's output copy, so this rarely waits
            # (and it polls an event: no device-wide sync).
            while not self._copied.query():
                pass
        ranges: dict = {}  # segment -> [(start, end)] of bytes written
        out = []
        uploaded = self._uploaded
        for dst, src in pairs:
            ptr = dst.data_ptr()
            where = self._where.get(ptr)
            if where is None or where[2] != dst.shape:
                raise ValueError("InputBuffers stages only whole buffers of add_buffers")
            seg, i, _, row_bytes, itemsize = where
            if uploaded:
                uploaded.pop(ptr, None)
            shape = src.shape
            if len(shape) == 1:  # (the batch's buffers are 1-D or 2-D)
                n = shape[0]
                if views:
                    out.append(dst[:n])
                if n == 0:
                    continue
                seg.mirrors[i][:n] = src  # sync-ok: numpy into host memory
                end = n * itemsize
            else:
                r, c = shape
                if views:
                    out.append(dst[:r, :c])
                if r == 0 or c == 0:
                    continue
                seg.mirrors[i][:r, :c] = src  # sync-ok: numpy into host memory
                end = (r - 1) * row_bytes + c * itemsize  # to the last element written
            start = seg.offsets[i]
            ranges.setdefault(seg, []).append((start, start + end))
        for seg, rs in ranges.items():
            seg.copy(rs)
        if self._pin:
            self._copied.record()
        return out

    def stage(self, hb: HostBatch, extra: tuple = (), views: bool = False) -> list:
        """Copy the batch in (and extra: more (buffer of add_buffers, numpy array) pairs),
        for a graph that reads the buffers; with `views`, -> the batch's views (ids, positions,
        slots, logits indices, query starts, lengths, tables)."""
        return self._stage([
            (self.input_ids, hb.input_ids), (self.positions, hb.positions),
            (self.slot_mapping, hb.slot_mapping), (self.logits_indices, hb.logits_indices),
            (self.query_start_loc, hb.query_start_loc), (self.seq_lens, hb.seq_lens),
            (self.block_tables, hb.block_tables), *extra], views)[:7]

    def load(self, hb: HostBatch, extra: tuple = ()):
        """stage, for an eager forward -> (input_ids [T], positions [T], logits_indices [N],
        AttentionMetadata)."""
        ids, pos, slots, li, qsl, sl, bt = self.stage(hb, extra, views=True)
        q_lens = np.diff(hb.query_start_loc)
        meta = AttentionMetadata(
            slot_mapping=slots, query_start_loc=qsl, seq_lens=sl, block_tables=bt,
            # numpy arrays: host data, no device sync
            query_start_loc_host=hb.query_start_loc.tolist(),  # sync-ok: numpy
            seq_lens_host=hb.seq_lens.tolist(),  # sync-ok: numpy
            max_query_len=int(q_lens.max()) if len(q_lens) else 1,
            max_seq_len=int(hb.seq_lens.max()) if len(hb.seq_lens) else 1)
        return ids, pos, li, meta


# Rows from which build_host_batch runs whole-batch numpy operations instead of a few small
# ones a row: the whole-batch form costs more at one row and far less at many (measured on the
# CPU machine; decisions-log.md, "Host batches are built for the whole batch at once").
VECTOR_MIN_ROWS = 8


def build_host_batch(rows, block_size: int) -> HostBatch:
    """rows: list of (token_ids [n], start_position, block_ids, logits_offsets[, num_real]).

    Tokens of row i sit at positions start..start+n-1; logits_offsets are indices within the
    row (e.g. [n-1] for plain decode, [n-k-1 .. n-1] when verifying k drafts). Tokens past
    num_real are padding (to a uniform query length for a CUDA graph): slot -1, no KV written.
    A token whose position lies past its row's block table raises IndexError.

    Built with whole-batch numpy operations from VECTOR_MIN_ROWS rows on (every step a host
    drafter or a launch without chaining makes builds one), a row at a time below that.
    """
    if len(rows) >= VECTOR_MIN_ROWS:
        return _build_vectorized(rows, block_size)
    return _build_row_by_row(rows, block_size)


def _build_row_by_row(rows, block_size: int) -> HostBatch:
    n_tok = sum(len(r[0]) for r in rows)
    nb = max((len(r[2]) for r in rows), default=1) or 1
    ids = np.empty(n_tok, dtype=np.int64)
    pos = np.empty(n_tok, dtype=np.int64)
    slots = np.empty(n_tok, dtype=np.int64)
    qsl = np.zeros(len(rows) + 1, dtype=np.int32)
    seq_lens = np.empty(len(rows), dtype=np.int32)
    bt = np.zeros((len(rows), nb), dtype=np.int32)
    li = []
    at = 0
    for i, row in enumerate(rows):
        toks, start, blocks, offsets = row[:4]
        n = len(toks)
        real = row[4] if len(row) > 4 else n
        p = np.arange(start, start + n, dtype=np.int64)
        table = np.asarray(blocks, dtype=np.int64)
        ids[at:at + n] = toks
        pos[at:at + n] = p
        pr = p[:real]
        if len(pr) and pr[-1] // block_size >= len(table):
            raise IndexError("a token's position lies past its row's block table")
        slots[at:at + real] = table[pr // block_size] * block_size + pr % block_size
        slots[at + real:at + n] = -1
        bt[i, :len(blocks)] = blocks
        seq_lens[i] = start + n
        li.extend(at + o for o in offsets)
        at += n
        qsl[i + 1] = at
    return HostBatch(ids, pos, slots, qsl, seq_lens, bt, np.asarray(li, dtype=np.int64))


def _build_vectorized(rows, block_size: int) -> HostBatch:
    r = len(rows)
    chain = itertools.chain.from_iterable
    lens = np.fromiter((len(row[0]) for row in rows), np.int64, r)
    starts = np.fromiter((row[1] for row in rows), np.int64, r)
    reals = np.fromiter((row[4] if len(row) > 4 else len(row[0]) for row in rows), np.int64, r)
    nblocks = np.fromiter((len(row[2]) for row in rows), np.int64, r)
    qsl = np.zeros(r + 1, dtype=np.int32)
    np.cumsum(lens, out=qsl[1:], dtype=np.int32)
    n_tok = int(qsl[-1])
    ids = np.fromiter(chain(row[0] for row in rows), np.int64, n_tok)
    row_of = np.repeat(np.arange(r), lens)  # the row of every token
    local = np.arange(n_tok) - np.repeat(qsl[:-1].astype(np.int64), lens)
    pos = np.repeat(starts, lens) + local
    bt = np.zeros((r, max(int(nblocks.max()) if r else 1, 1)), dtype=np.int32)
    n_blk = int(nblocks.sum())
    blk_start = np.cumsum(nblocks) - nblocks
    bt[np.repeat(np.arange(r), nblocks), np.arange(n_blk) - np.repeat(blk_start, nblocks)] = \
        np.fromiter(chain(row[2] for row in rows), np.int64, n_blk)
    real = local < np.repeat(reals, lens)
    blk = pos // block_size
    if (blk[real] >= np.repeat(nblocks, lens)[real]).any():
        raise IndexError("a token's position lies past its row's block table")
    slots = np.where(real, bt[row_of, np.where(real, blk, 0)].astype(np.int64) * block_size
                     + pos % block_size, -1)
    seq_lens = (starts + lens).astype(np.int32)
    counts = np.fromiter((len(row[3]) for row in rows), np.int64, r)
    n_li = int(counts.sum())
    li = np.fromiter(chain(row[3] for row in rows), np.int64, n_li) \
        + np.repeat(qsl[:-1].astype(np.int64), counts)
    return HostBatch(ids, pos, slots, qsl, seq_lens, bt, li)
