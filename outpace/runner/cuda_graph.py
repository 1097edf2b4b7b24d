"""CUDA graphs of the target forward for uniform decode/verify batches.

A batch where every request computes the same number of tokens q (q = 1: plain decode;
q = k + 1: verify k drafts) is padded up to a batch-size bucket and replayed from a graph
captured once per (bucket, q). Everything the graph reads sits at fixed addresses in the
runner's InputBuffers; padded requests have slot -1 (they write no KV) and attend only to their
own q positions of the null block, and their outputs are ignored.

    buckets: 1 2 4 8 16 24 32 48 64 96 128 ... (up to max_num_seqs)
    graph(bucket, q): input_ids/positions/slot_mapping[:bucket*q], seq_lens/block_tables[:bucket]
                      -> hidden [bucket*q, H], aux [bucket*q, H] each, logits [bucket*q, V]

A single request's prefill (or prefill chunk) of n tokens is replayed the same way from a
prefill graph of q >= n tokens (PREFILL_TOKENS, up to the step's token budget): the rows past n
are padding (slot -1, past the request's real positions, so no real row attends to them), and
the graph computes logits only at logits_indices[0], the row that is sampled. Eagerly, a batch-1
prefill is ~150 Python kernel launches, 26-32 ms of host time on the H200 machine for a 135M
model whose GPU time is ~1 ms (benchmarks/diag_prefill.py): the whole of TTFT.

    prefill graph(q): input_ids/positions/slot_mapping[:q], one sequence (full-width table)
                      -> hidden [q, H], aux [q, H] each, logits [1, V]
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from outpace.attention.base import AttentionMetadata, ForwardContext
from outpace.runner.inputs import HostBatch

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# Prefill graph sizes: padding wastes at most a third of a prefill's rows past 32 tokens.
PREFILL_TOKENS = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512)


class GraphRunner:
    def __init__(self, model, backend, inputs, capture_layers: tuple, max_num_seqs: int,
                 q_lens: tuple, max_tokens: int):
        self.model = model
        self.backend = backend
        self.inputs = inputs
        self.capture_layers = capture_layers
        self.buckets = [b for b in DEFAULT_BUCKETS
                        if b <= max_num_seqs and b * max(q_lens) <= max_tokens]
        self.q_lens = tuple(sorted(set(q_lens)))
        self.graphs: dict = {}  # (bucket, q) -> (graph, hidden, aux, logits)
        self.prefill_q = tuple(q for q in PREFILL_TOKENS if q <= max_tokens)
        self.prefill_graphs: dict = {}  # q -> (graph, hidden, aux, logits [1, V])
        self.pool = None

    def bucket_for(self, num_seqs: int):
        for b in self.buckets:
            if b >= num_seqs:
                return b
        return None

    def prefill_q_for(self, num_tokens: int):
        """The smallest prefill graph that holds num_tokens, or None (then: eager)."""
        return next((q for q in self.prefill_q if q >= num_tokens), None)

    def can_run(self, hb: HostBatch) -> bool:
        q = np.diff(hb.query_start_loc)
        if len(q) == 0 or (q != q[0]).any() or int(q[0]) not in self.q_lens:
            return False
        return self.bucket_for(len(q)) is not None

    def _meta(self, bucket: int, q: int, max_seq_len: int) -> AttentionMetadata:
        buf = self.inputs
        return AttentionMetadata(
            slot_mapping=buf.slot_mapping[:bucket * q],
            query_start_loc=buf.query_start_loc[:bucket + 1],
            seq_lens=buf.seq_lens[:bucket], block_tables=buf.block_tables[:bucket],
            max_query_len=q, max_seq_len=max_seq_len)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every (bucket, q), largest first so smaller graphs share its memory pool."""
        for q in self.q_lens:
            for bucket in reversed(self.buckets):
                self.graphs[(bucket, q)] = self._capture_over_dummy(bucket, q, self._forward)
        for q in reversed(self.prefill_q):
            self.inputs.logits_indices[:1].fill_(q - 1)
            self.prefill_graphs[q] = self._capture_over_dummy(1, q, self._prefill_forward)
        log.info("captured %d CUDA graphs (buckets %s, q %s) and %d prefill graphs (up to %s "
                 "tokens)", len(self.graphs), self.buckets, self.q_lens, len(self.prefill_graphs),
                 max(self.prefill_q, default=0))

    def _capture_over_dummy(self, bucket: int, q: int, forward) -> tuple:
        """forward(ids, pos, ctx) over a dummy batch of `bucket` sequences of q tokens, warmed up
        and captured -> (graph, *its static outputs)."""
        buf = self.inputs
        n = bucket * q
        self.fill_dummy(bucket, q)
        meta = self._meta(bucket, q, buf.max_blocks * self.backend.block_size)
        ctx = ForwardContext(self.backend, meta)
        ids, pos = buf.input_ids[:n], buf.positions[:n]
        for _ in range(2):  # warm-up: Triton compiles, cuBLAS picks its kernels
            forward(ids, pos, ctx)
        graph, outs = self.capture(lambda: forward(ids, pos, ctx))
        return (graph, *outs)

    def fill_dummy(self, bucket: int, q: int) -> None:
        """A valid batch that writes nowhere (slot -1): each sequence attends to its own q
        positions of the null block. Graphs are warmed up and captured over it."""
        buf = self.inputs
        n = bucket * q
        buf.input_ids[:n].zero_()
        buf.positions[:n].copy_(torch.arange(q, device=buf.device).repeat(bucket))
        buf.slot_mapping[:n].fill_(-1)
        buf.query_start_loc[:bucket + 1].copy_(
            torch.arange(0, (bucket + 1) * q, q, device=buf.device, dtype=torch.int32))
        buf.seq_lens[:bucket].fill_(q)
        buf.block_tables[:bucket].zero_()
        buf.forget(buf.block_tables)

    def capture(self, fn):
        """-> (replayable graph, static outputs of fn)."""
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outs = fn()
        if self.pool is None:
            self.pool = graph.pool()
        torch.cuda.synchronize()
        return graph, outs

    def _forward(self, ids, pos, ctx):
        hidden, aux = self.model(ids, pos, ctx, capture_layers=self.capture_layers)
        return hidden, aux, self.model.compute_logits(hidden)

    def _prefill_forward(self, ids, pos, ctx):
        hidden, aux = self.model(ids, pos, ctx, capture_layers=self.capture_layers)
        rows = hidden.index_select(0, self.inputs.logits_indices[:1])
        return hidden, aux, self.model.compute_logits(rows)

    def load_padded(self, hb: HostBatch, full_width: bool = False, extra: tuple = ()):
        """Pad hb to its bucket and copy it into the fixed buffers.

        full_width: write the whole width of the block tables (zeros past each request's
        blocks), for graphs that compute positions past the step's own tokens on the device.
        extra: more (device buffer, numpy array) pairs to copy in (InputBuffers.stage).
        -> (bucket, q)."""
        q = int(hb.query_start_loc[1] - hb.query_start_loc[0])
        b = len(hb.seq_lens)
        bucket = self.bucket_for(b)
        pad = (bucket - b) * q
        ids = np.concatenate([hb.input_ids, np.zeros(pad, np.int64)])
        pos = np.concatenate([hb.positions, np.tile(np.arange(q), bucket - b)])
        slots = np.concatenate([hb.slot_mapping, np.full(pad, -1, np.int64)])
        qsl = np.arange(0, (bucket + 1) * q, q, dtype=np.int32)
        seq_lens = np.concatenate([hb.seq_lens, np.full(bucket - b, q, np.int32)])
        width = self.inputs.max_blocks if full_width else hb.block_tables.shape[1]
        bt = np.zeros((bucket, width), np.int32)
        bt[:b, :hb.block_tables.shape[1]] = hb.block_tables
        padded = HostBatch(ids, pos, slots, qsl, seq_lens, bt, hb.logits_indices)
        self.inputs.stage(padded, extra)
        return bucket, q

    def run(self, hb: HostBatch):
        """Pad hb to its bucket, copy into the fixed buffers, replay.

        -> (hidden [T, H], aux, logits [N, V] at hb.logits_indices, AttentionMetadata)."""
        bucket, q = self.load_padded(hb)
        b = len(hb.seq_lens)
        n = b * q
        graph, hidden, aux, logits = self.graphs[(bucket, q)]
        graph.replay()
        li = self.inputs.logits_indices[:len(hb.logits_indices)]
        return hidden[:n], [a[:n] for a in aux], logits.index_select(0, li), self._meta_of(hb)

    def run_prefill(self, hb: HostBatch, extra: tuple = ()):
        """One request's prefill rows, padded to q = len(hb.input_ids) (a prefill_q), with at
        most one sampled row; extra: more (device buffer, numpy array) pairs copied in with
        them. -> (hidden [q, H], aux, logits [0 or 1, V], AttentionMetadata)."""
        q = len(hb.input_ids)
        if len(hb.seq_lens) != 1 or q not in self.prefill_graphs or len(hb.logits_indices) > 1:
            raise ValueError(f"no prefill graph for {len(hb.seq_lens)} sequences of {q} tokens "
                             f"with {len(hb.logits_indices)} sampled rows")
        num_sampled = len(hb.logits_indices)
        if num_sampled == 0:  # a chunk that samples nothing: a valid dummy row
            hb = dataclasses.replace(hb, logits_indices=np.array([q - 1], np.int64))
        # Full-width block table: the padded rows' positions past the request's blocks read
        # the null block, not a stale entry from an earlier step.
        self.load_padded(hb, full_width=True, extra=extra)
        graph, hidden, aux, logits = self.prefill_graphs[q]
        graph.replay()
        # The padded rows' sequence length passes the request's blocks: the proposer's
        # attention over these rows needs the full-width table too.
        return hidden, aux, logits[:num_sampled], self._meta_of(hb, full_width=True)

    def _meta_of(self, hb: HostBatch, full_width: bool = False) -> AttentionMetadata:
        """Metadata of the real (unpadded) batch in the fixed buffers, for the proposer."""
        buf = self.inputs
        b = len(hb.seq_lens)
        q = int(hb.query_start_loc[1] - hb.query_start_loc[0])
        width = buf.max_blocks if full_width else hb.block_tables.shape[1]
        return AttentionMetadata(
            slot_mapping=buf.slot_mapping[:b * q], query_start_loc=buf.query_start_loc[:b + 1],
            seq_lens=buf.seq_lens[:b], block_tables=buf.block_tables[:b, :width],
            query_start_loc_host=hb.query_start_loc.tolist(),  # sync-ok: numpy
            seq_lens_host=hb.seq_lens.tolist(),  # sync-ok: numpy
            max_query_len=q, max_seq_len=int(hb.seq_lens.max()))
