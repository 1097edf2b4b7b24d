"""Fixed-address input buffers of the model runner.

Every step writes its token ids, positions, slot mapping, block tables and lengths into the same
device tensors, so a CUDA graph captured over them replays with new values. The host side is
built with numpy and copied in once per buffer (pinned + non_blocking on CUDA).

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


class InputBuffers:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device):
        self.device = device
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        pin = device.type == "cuda"

        def buf(*shape, dtype):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.input_ids = buf(max_tokens, dtype=torch.long)
        self.positions = buf(max_tokens, dtype=torch.long)
        self.slot_mapping = buf(max_tokens, dtype=torch.long)
        self.logits_indices = buf(max_tokens, dtype=torch.long)
        self.query_start_loc = buf(max_seqs + 1, dtype=torch.int32)
        self.seq_lens = buf(max_seqs, dtype=torch.int32)
        self.block_tables = buf(max_seqs, max_blocks, dtype=torch.int32)
        self._pin = pin
        # CUDA: one pinned host mirror per device buffer, made once. Pinning a fresh tensor
        # every step costs an allocation each, and freeing one records a CUDA event, which
        # is illegal while another engine is capturing a graph in the same process.
        self._staging: dict = {}  # device buffer's data_ptr -> pinned host tensor
        self._copied = torch.cuda.Event() if pin else None  # after the last staged copies
        # put_if_changed's memo: device buffer's data_ptr -> the array it last staged there.
        # Any other write to that buffer (_stage, or forget() by direct writers) drops it.
        self._uploaded: dict = {}

    def put(self, dst: torch.Tensor, src: np.ndarray) -> torch.Tensor:
        """Copy src into the leading part of dst and return that view."""
        view = self._stage(dst, src)
        if self._pin:
            self._copied.record()
        return view

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

    def _stage(self, dst: torch.Tensor, src: np.ndarray) -> torch.Tensor:
        self._uploaded.pop(dst.data_ptr(), None)
        view = dst[tuple(slice(0, n) for n in src.shape)]
        if not self._pin:
            view.copy_(torch.from_numpy(src))
            return view
        host = self._staging.get(dst.data_ptr())
        if host is None:
            host = self._staging[dst.data_ptr()] = torch.empty(dst.shape, dtype=dst.dtype,
                                                               pin_memory=True)
        # The last copies out of the mirrors must have run before they are overwritten; they
        # were queued before the previous step's output copy, so this rarely waits (and it
        # polls an event: no device-wide sync).
        while not self._copied.query():
            pass
        staged = host.view(-1)[:src.size].view(src.shape)  # contiguous, like src
        staged.numpy()[...] = src  # sync-ok: a numpy view of pinned host memory
        view.copy_(staged, non_blocking=True)
        return view

    def load(self, hb: HostBatch, extra: tuple = ()):
        """-> (input_ids [T], positions [T], logits_indices [N], AttentionMetadata).

        extra: more (device buffer, numpy array) pairs to copy in with the batch (one wait for
        the mirrors for all of them, see _stage)."""
        for dst, src in extra:
            self._stage(dst, src)
        ids = self._stage(self.input_ids, hb.input_ids)
        pos = self._stage(self.positions, hb.positions)
        slots = self._stage(self.slot_mapping, hb.slot_mapping)
        li = self._stage(self.logits_indices, hb.logits_indices)
        qsl = self._stage(self.query_start_loc, hb.query_start_loc)
        sl = self._stage(self.seq_lens, hb.seq_lens)
        bt = self._stage(self.block_tables, hb.block_tables)
        if self._pin:
            self._copied.record()
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
# ones a row (CPU machine: 128 decode rows 750 -> 140 us, but one row 9 -> 40 us).
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
