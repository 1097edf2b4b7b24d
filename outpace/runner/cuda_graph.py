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
prefill is ~150 Python kernel launches whose host time is many times a small model's GPU time,
and so most of TTFT (docs/decisions.md, "Batch-1 prefills replay from CUDA graphs").

    prefill graph(q): input_ids/positions/slot_mapping[:q], one sequence (full-width table)
                      -> hidden [q, H], aux [q, H] each, logits [1, V]

Any other batch (several requests' prefill chunks, prefill chunks beside decodes: the first
steps of a batch, every step that admits a request while others decode) is replayed from a
varlen graph of T >= its tokens (VARLEN_TOKENS) over every sequence slot of the buffers: the
real sequences, then the padding rows as sequences of their own (slot -1, the null block's
table, positions from 0), then empty sequences. The attention's programs follow a tile map
staged with the batch (one per 32 or so query tokens of a sequence; triton_paged.tile_map_for),
so empty sequences cost nothing. The graph stops at the hidden states; the few rows that get
logits go through the LM head after it. Eagerly such a step is ~300 kernel launches from
Python, whose host time is many times the step's GPU time (decisions-log.md, "Steps of
several prefill chunks replay varlen graphs").

    varlen graph(T): input_ids/positions/slot_mapping[:T], max_seqs sequences, tile map
                     -> hidden [T, H], aux [T, H] each
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import torch

from outpace.attention.base import AttentionMetadata, ForwardContext
from outpace.kernels import pdl
from outpace.attention.inputs import HostBatch

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# Prefill graph sizes: padding wastes at most a third of a prefill's rows past 32 tokens.
PREFILL_TOKENS = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
# Varlen graph sizes (up to the step's token budget, which is always one of them too).
VARLEN_TOKENS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class GraphRunner:
    def __init__(self, model, backend, inputs, capture_layers: tuple, max_num_seqs: int,
                 q_lens: tuple, max_tokens: int, max_model_len: int, capture=None,
                 prime=None):
        self.model = model
        self._capture = capture  # capture's stand-in (None: CUDA graphs; tests pass one)
        self._prime = pdl.prime if prime is None else prime  # replay's primer (pdl.prime)
        self.max_model_len = max_model_len  # positions stay below it (the rope tables)
        self.backend = backend
        self.inputs = inputs
        self.capture_layers = capture_layers
        self.buckets = [b for b in DEFAULT_BUCKETS
                        if b <= max_num_seqs and b * max(q_lens) <= max_tokens]
        self.q_lens = tuple(sorted(set(q_lens)))
        self.graphs: dict = {}  # (bucket, q) -> (graph, hidden, aux, logits)
        # (a prefill graph longer than the context would never run: _prefill_graph_q pads a
        # chunk only where its padded rows stay inside the context)
        self.prefill_q = tuple(q for q in PREFILL_TOKENS if q <= min(max_tokens, max_model_len))
        self.prefill_graphs: dict = {}  # q -> (graph, hidden, aux, logits [1, V])
        # (above 16 tokens: the attention's prefill tiles, whatever the batch's longest query;
        # at most what the sequence slots can hold, each sequence below max_model_len)
        limit = min(max_tokens, inputs.max_seqs * max_model_len)
        self.varlen_t = tuple(sorted({t for t in VARLEN_TOKENS if 16 < t < limit}
                                     | ({limit} if limit > 16 else set())))
        self.varlen_graphs: dict = {}  # T -> (graph, hidden, aux)
        self.varlen_replays = 0  # steps served by them (tests read it)
        # The attention's (sequence, query block) pairs for varlen graphs: a tile per block_q
        # tokens, and per sequence at most one partial tile (backends without tiles: none).
        block_q = getattr(backend, "varlen_block_q", None)
        self.tile_block_q = block_q(model.dtype) if block_q is not None else None
        self.tile_map = None
        if self.tile_block_q is not None:
            self.max_tiles = -(-max_tokens // self.tile_block_q) + inputs.max_seqs
            (self.tile_map,) = inputs.add_buffers([((self.max_tiles, 2), torch.int32)])
        self.pool = None

    def replay(self, graph, site: str) -> None:
        """Replay a graph launched from the host: eager kernels (sampling, an eager step) may
        have run before it, so PDL is primed first where that pays (kernels/pdl.prime: after a
        torch kernel a graph of PDL kernels replays slower). site: which kind of graph
        (KernelOptions.pdl_prime_skip: the kinds not primed)."""
        self._prime(self.inputs.device, site)
        graph.replay()

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
        t0 = time.perf_counter()
        for q in self.q_lens:
            for bucket in reversed(self.buckets):
                self.graphs[(bucket, q)] = self._capture_over_dummy(bucket, q, self._forward)
        for q in reversed(self.prefill_q):
            self.inputs.logits_indices[:1].fill_(q - 1)
            self.prefill_graphs[q] = self._capture_over_dummy(1, q, self._prefill_forward)
        for t in reversed(self.varlen_t):
            self.varlen_graphs[t] = self._capture_varlen(t)
        self.capture_s = time.perf_counter() - t0
        log.info("captured %d CUDA graphs (buckets %s, q %s), %d prefill graphs (up to %s "
                 "tokens) and %d varlen graphs (up to %s) in %.1f s", len(self.graphs),
                 self.buckets, self.q_lens, len(self.prefill_graphs),
                 max(self.prefill_q, default=0), len(self.varlen_graphs),
                 max(self.varlen_t, default=0), self.capture_s)

    def _capture_over_dummy(self, bucket: int, q: int, forward) -> tuple:
        """forward(ids, pos, ctx) over a dummy batch of `bucket` sequences of q tokens, warmed up
        and captured -> (graph, *its static outputs)."""
        buf = self.inputs
        n = bucket * q
        self.fill_dummy(bucket, q)
        meta = self._meta(bucket, q, buf.max_blocks * self.backend.block_size)
        ctx = ForwardContext(self.backend, meta)
        ids, pos = buf.input_ids[:n], buf.positions[:n]
        graph, outs = self.capture(lambda: forward(ids, pos, ctx))
        return (graph, *outs)

    def _varlen_meta(self, t: int) -> AttentionMetadata:
        buf = self.inputs
        m = buf.max_seqs
        return AttentionMetadata(
            slot_mapping=buf.slot_mapping[:t], query_start_loc=buf.query_start_loc[:m + 1],
            seq_lens=buf.seq_lens[:m], block_tables=buf.block_tables[:m], max_query_len=t,
            max_seq_len=buf.max_blocks * self.backend.block_size, tile_map=self.tile_map)

    def load_varlen_padding(self, t: int) -> None:
        """A varlen batch of t tokens that is all padding (graphs are captured over it)."""
        self.load_varlen(HostBatch(*(np.zeros(0, np.int64),) * 3, np.zeros(1, np.int32),
                                   np.zeros(0, np.int32), np.zeros((0, 1), np.int32),
                                   np.zeros(0, np.int64)), t)

    def _capture_varlen(self, t: int) -> tuple:
        """The varlen graph of t tokens, warmed up and captured over a batch of padding."""
        buf = self.inputs
        self.load_varlen_padding(t)
        ctx = ForwardContext(self.backend, self._varlen_meta(t))
        ids, pos = buf.input_ids[:t], buf.positions[:t]

        def forward():
            return self.model(ids, pos, ctx, capture_layers=self.capture_layers)
        graph, (hidden, aux) = self.capture(forward)
        return graph, hidden, aux

    def varlen_t_for(self, num_tokens: int, num_seqs: int):
        """The varlen graph a batch of num_tokens over num_seqs sequences pads to, or None (no
        such graph, or no sequence slots left for its padding rows)."""
        t = next((t for t in self.varlen_t if t >= num_tokens), None)
        if t is None or not self.varlen_graphs:
            return None
        pad_seqs = -(-(t - num_tokens) // self.max_model_len)
        return t if num_seqs + pad_seqs <= self.inputs.max_seqs else None

    def load_varlen(self, hb: HostBatch, t: int) -> None:
        """hb padded to t tokens over every sequence slot (see the module docstring), staged.
        The padding rows form sequences of at most max_model_len tokens."""
        buf = self.inputs
        n, b, m = len(hb.input_ids), len(hb.seq_lens), buf.max_seqs
        pad = t - n
        span = self.max_model_len
        lens = [min(span, pad - i) for i in range(0, pad, span)]  # the padding's sequences
        if b + len(lens) > m:
            raise ValueError(f"{b} sequences and {len(lens)} of padding exceed {m} slots")
        pos = np.concatenate([hb.positions] + [np.arange(k, dtype=np.int64) for k in lens])
        q_lens = np.zeros(m, np.int64)
        q_lens[:b] = np.diff(hb.query_start_loc)
        q_lens[b:b + len(lens)] = lens
        qsl = np.zeros(m + 1, np.int32)
        np.cumsum(q_lens, out=qsl[1:])
        seq_lens = np.zeros(m, np.int32)
        seq_lens[:b] = hb.seq_lens
        seq_lens[b:b + len(lens)] = lens
        bt = np.zeros((m, buf.max_blocks), np.int32)  # the padding reads the null block
        bt[:b, :hb.block_tables.shape[1]] = hb.block_tables
        padded = HostBatch(np.concatenate([hb.input_ids, np.zeros(pad, np.int64)]), pos,
                           np.concatenate([hb.slot_mapping, np.full(pad, -1, np.int64)]),
                           qsl, seq_lens, bt, hb.logits_indices)
        extra = ()
        if self.tile_map is not None:
            extra = ((self.tile_map, self._tiles(q_lens)),)
        buf.stage(padded, extra)

    def _tiles(self, q_lens: np.ndarray) -> np.ndarray:
        from outpace.attention.triton_paged import tile_map_for
        return tile_map_for(q_lens, self.max_tiles, self.tile_block_q)

    def run_varlen(self, hb: HostBatch, t: int, logits_fn):
        """hb padded to the varlen graph of t tokens, replayed; logits_fn(hidden rows) -> the
        logits of hb.logits_indices' rows. -> (hidden [n, H], aux, logits [N, V], metadata)."""
        n, num = len(hb.input_ids), len(hb.logits_indices)
        self.load_varlen(hb, t)
        graph, hidden, aux = self.varlen_graphs[t]
        self.replay(graph, "varlen")
        self.varlen_replays += 1
        rows = hidden.index_select(0, self.inputs.logits_indices[:num])
        return hidden[:n], [a[:n] for a in aux], logits_fn(rows), self._meta_of(hb)

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

    def dummy_step(self, bucket: int, q: int):
        """The target graph of (bucket, q) with a dummy batch staged for it, as a function that
        replays it (start-up timing, runner/step_timing.py)."""
        graph = self.graphs[(bucket, q)][0]
        self.fill_dummy(bucket, q)
        return lambda: self.replay(graph, "plain")

    def capture(self, fn):
        """fn warmed up (run twice: Triton compiles, cuBLAS picks its kernels) and captured
        -> (replayable graph, static outputs of fn). With a `capture` given at construction:
        what it returns for fn (a stand-in graph, whose replay() recomputes, runs on CPU)."""
        if self._capture is not None:
            return self._capture(fn)
        for _ in range(2):
            fn()
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
        self.replay(graph, "plain")
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
        self.replay(graph, "prefill")
        # The padded rows' sequence length passes the request's blocks: the proposer's
        # attention over these rows needs the full-width table too.
        return hidden, aux, logits[:num_sampled], self._meta_of(hb, full_width=True)

    def _meta_of(self, hb: HostBatch, full_width: bool = False) -> AttentionMetadata:
        """Metadata of the real (unpadded) batch in the fixed buffers, for the proposer: its
        sequences come first there, each with its own rows (padded to a uniform length in a
        bucket's graph, then the staged batch's query starts are hb's)."""
        buf = self.inputs
        b = len(hb.seq_lens)
        width = buf.max_blocks if full_width else hb.block_tables.shape[1]
        return AttentionMetadata(
            slot_mapping=buf.slot_mapping[:int(hb.query_start_loc[-1])],
            query_start_loc=buf.query_start_loc[:b + 1],
            seq_lens=buf.seq_lens[:b], block_tables=buf.block_tables[:b, :width],
            query_start_loc_host=hb.query_start_loc.tolist(),  # sync-ok: numpy
            seq_lens_host=hb.seq_lens.tolist(),  # sync-ok: numpy
            max_query_len=int(np.diff(hb.query_start_loc).max()),
            max_seq_len=int(hb.seq_lens.max()))
