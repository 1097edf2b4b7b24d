"""The fused decode step: target forward, greedy verify/accept and the head's draft loop in one
CUDA graph per (batch bucket, query length q, draft steps kd), and one output copy per step.

A step qualifies when every scheduled request is decoding (its rows are its last committed token
and its drafts), whatever it samples with (penalties: runner/fused_penalties.py; logprobs: the
+logprobs graphs, whose second output holds each row's logprobs; relaxed acceptance in
thinking spans: runner/fused_relaxed.py, in greedy graphs). Then nothing between the step's
input copy and its output copies needs the host:

    input buffers (ids, positions, slots, block tables, seq_lens, num_drafts)
      -> target forward -> logits -> each row's token [B, q]: the argmax, or in a *sampled*
         graph (some request samples) the race keyed by the request's seed and the position
         (sample/gumbel.py), with its temperature (and in a *masked* graph its top-k, top-p and
         min-p) from staged buffers
      -> accept: longest matching draft prefix (or force-accept, benchmarks), emitted tokens
      -> head first pass over every row, next token = emitted token (filler past the accepted);
         none when kd = 0 (the k schedule turned drafting off): every request's plane entries
         of the step are left unwritten and its mark stays (RequestStepOutput.
         draft_plane_skipped); a step that would draft again for a request skipped so is
         declined (accepts) and runs the general path, which recomputes it from its mark
      -> draft 1 from row `accepted` of each request; draft loop j = 1 .. kd-1 at position
         first + accepted + j, slots and seq_lens computed on the device from the block tables
      -> packed [B, q + 1 + kd] = emitted tokens | accepted count | drafts   --one copy-->  host

A sampled row's token is the one the general path (runner/sampling_step.py) draws for the same
seed and position, so accept's strict prefix match verifies sampled requests exactly as greedy
ones, and graph and eager steps give the same tokens. Greedy, sampled and masked graphs are
captured apart, with the same keys (runner/graph_mode.py); the sampled and masked ones with
penalties, and every family with logprobs, when a request first needs such a key.

The host then trims each request's drafts to its own draft length (max_tokens, context, the
adaptive policy), exactly as the eager path would have asked the head for fewer. Running kd steps
for everyone writes draft KV a little further ahead for some requests; those positions lie past
the request's frontier, so a later step rewrites them before anyone reads them (the roll-by-one
invariant of head_proposer.py). Positions past a request's block table read a zero entry: the
null block, which nothing reads. Model-free drafters (n-gram, suffix) propose on the host after
the copy, from the committed tokens alone; with `"ngram_device": true` the n-gram lookup runs
in the graph instead, over a device history of each row's committed tokens
(runner/fused_ngram.py): its drafts land in the packed output (-1 past a row's count) and the
carry as a head's do, and its steps chain.

kd (runner/fused_draft_length.py) is the policy's k for the batch size (`draft_steps`), or
under the draft-length cost model (`"adaptive": "cost"`) the cost model's choice: the drafts a graph makes are verified by the
NEXT step, so when a step is launched (from the host, or chained) the cost model chooses the
next step's draft lengths, the graph's loop runs the longest of them (`launch_kd`,
`chained_kd`; 0: the graph runs no head), and the step's collect trims each request's drafts to
its own choice (`Launched.next_k`) instead of asking again. A graph step pads every row to one
length, so over a measured table the choice is one length for the batch. A choice made for a
step that then does not launch (a chain given up) is not counted (DraftLengthPolicy.commit), so
no request's probe is spent on it. Drafting after a kd = 0 step would read the skipped
draft-plane entries: such a step is not chained and runs the general path, which recomputes the
requests from their marks (`accepts`).

Overlap (chaining): every graph also leaves, in fixed carry buffers, what the next step's
inputs are made of (each request's bonus-token position, its bonus token and new drafts). A
*chained* graph starts by building its own inputs from them (positions, slots through the block
tables, sequence lengths), so the engine can launch step N+1 before it has read step N's output
copy, and reads N while N+1 runs (engine.py). Chaining is possible only when the host knows
N+1's shape without N's results: no host drafter (the device n-gram's rows verify their own
draft counts, left in its carry, in N+1's query length of kd + 1), and the engine's conditions
(no admission, blocks reserved for the worst case, no request near its limits).

A host drafter (n-gram, suffix) needs N's tokens before it can propose N+1's drafts, so its
steps chain only when N+1 drafts nothing (the k schedule's 0 at the batch size, or the cost
model's choice of 0 for everyone, made at the chain and handed to N's collect:
StepDraftLengths.chained_kd); otherwise they are *relaunched*: once N's output is read and the
drafts are proposed, N+1 is launched from the same carry (positions, slots and bonus tokens built on the
device) with only the drafts and their counts staged (`relaunch`), and N's commit,
detokenization and outputs run while N+1 does. That takes the scheduling, batch building and
input staging of a step off the path between two steps, where the GPU would otherwise sit
idle (decisions-log.md, "A host drafter's steps are relaunched from the carry").

On CUDA the bookkeeping around the model (a chained step's inputs, accept with what the head
and the next step read, the draft loop's positions and slots) is three Triton kernels
(runner/step_bookkeeping.py); elsewhere their PyTorch references run.

Graphs are captured over a dummy batch: the common ones at start-up, others the first time
their (bucket, q, kd) is seen (never while a step is in flight: chained graphs exist only if
captured ahead). They share the GraphRunner's memory pool.

The captured graphs and when each is captured are in runner/fused_graphs.py, the head's draft
loop inside a graph in runner/fused_draft_loop.py, MTP depths mode's window (in place of a
draft loop; its stash on the device) in runner/fused_depths_window.py, the device n-gram's
history and lookup in runner/fused_ngram.py, the prefill's graphs around the fused step (a
head's pass and drafts after a prefill graph, a greedy prefill launched like a decode step) in
runner/fused_prefill.py, what its sampled graphs stage and compute in runner/fused_sampling.py,
the penalties' tables in runner/fused_penalties.py, and the output's copies and the StepResult
they make in runner/fused_output.py.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from outpace.attention.base import AttentionMetadata, ForwardContext
from outpace.kernels.argmax import argmax_rows
from outpace.runner.chained_tables import ChainedTables
from outpace.runner.write_check import WriteCheck
from outpace.runner.fused_depths_window import DepthsWindow
from outpace.runner.fused_draft_loop import DraftLoop
from outpace.runner.fused_draft_length import StepDraftLengths
from outpace.runner.fused_graphs import GraphTable
from outpace.runner.fused_ngram import StepNgram
from outpace.runner.fused_output import StepOutput
from outpace.runner.fused_penalties import StepPenalties
from outpace.runner.fused_prefill import PrefillGraphs
from outpace.runner.fused_relaxed import StepRelaxed
from outpace.runner.fused_sampling import StepSampling
from outpace.runner.graph_mode import GREEDY, MODES, GraphMode, graph_mode
from outpace.runner.step_bookkeeping import accept, chained_inputs
from outpace.speculative.head_proposer import HeadProposer
from outpace.speculative.mtp_window import MTPWindowProposer
from outpace.types import StepResult


@dataclass
class Launched:
    """A fused step on the device whose output copy has not been read yet."""

    key: tuple  # (bucket, q, kd, chained)
    rows: list  # request ids in device row order (chained steps keep their first step's)
    host: object  # where the output copy lands: pinned tensor (CUDA) or the output itself
    event: Optional[object]  # recorded after the output copy (CUDA)
    t_launch: float = 0.0  # host seconds spent launching (benchmarks)
    prefill: bool = False  # a prefill step's (PrefillGraphs.launch), not a decode step's
    drafts: Optional[list] = None  # a relaunched step's draft count per row (host drafter)
    mode: GraphMode = GREEDY  # its graph's variant (graph_mode.MODES): its successors' too
    host_logprobs: Optional[object] = None  # a logprobs graph's second output, as `host`
    # under the cost model: request id -> the draft length chosen at launch for the next step
    # (the graph drafted the longest); collect trims to it. None: collect asks the policy
    next_k: Optional[dict] = None
    # with the device n-gram (fused_ngram.py): each row's drafts for the next step, counted at
    # collect in `rows` order (a step chained from this one verifies that many a row)
    next_drafts: Optional[list] = None

    @property
    def kd(self) -> int:
        return self.key[2]


class FusedStep:
    """The fused step, composed of parts that own their state: `table` (the captured graphs),
    `lengths` (each launch's draft-loop length, the cost model's choice),
    `draft_loop` (the head's part of a graph), `sampling` (what a sampled graph stages and
    draws), `penalties` (the penalty tables), `ngram` (the device n-gram lookup's history, with
    `"ngram_device": true`), `output` (host copies, StepResults) and `prefill` (the graphs
    around a prefill)."""

    def __init__(self, runner):
        # Weak: the runner owns this step (see HeadProposer.bind for why no cycle)
        self.runner = weakref.proxy(runner)
        self.graphs = runner.graphs  # GraphRunner: buckets, input buffers, capture, memory pool
        self.inputs = runner.inputs
        self.model = runner.model
        self.backend = runner.backend
        self.block_size = runner.block_size
        proposer = runner.proposer
        # A head drafts inside the graph; so does the n-gram lookup with "ngram_device"
        # (fused_ngram.py); another model-free drafter on the host after the copy. A head's
        # suffix enhancer replaces drafts on the host after the copy (StepOutput.result).
        self.head = (proposer if isinstance(proposer, HeadProposer)
                     and proposer.supports_device_drafting else None)
        dev = runner.device
        m = self.inputs.max_seqs
        # MTP depths mode's window (fused_depths_window.py), where every verify length fits
        # its rows; with the enhancer, the general path
        self.window = None
        if isinstance(proposer, MTPWindowProposer) and proposer.enhancer is None \
                and max(runner.graphs.q_lens) <= proposer.depth + 1:
            dtype = getattr(self.model, "dtype", None) or next(self.model.parameters()).dtype
            self.window = DepthsWindow(proposer, self.backend, self.block_size, m,
                                       runner.model_cfg.hidden_size, dtype, dev)
        # the head whose policy, counters and draft plane the graphs' drafting follows
        self.drafter = self.head if self.head is not None else (
            proposer if self.window is not None else None)
        self.ngram = (StepNgram(m, runner.max_model_len, proposer.spec, dev)
                      if proposer is not None and proposer.spec.ngram_device else None)
        self.host_drafter = proposer if proposer is not None and not proposer.num_kv_layers \
            and self.ngram is None else None
        kmax = max(runner.graphs.q_lens)
        # Staged with the batch (InputBuffers.stage's extra): a row's drafts, and whether it is a
        # request, not padding; the prefill's tail reads the next two; a relaunched step
        # (host drafter) the host's drafts.
        # A varlen step's head graph (PrefillGraphs.varlen_drafts) the last two.
        (self.num_drafts, self.real, self.prefill_next_ids, self.prefill_last_row,
         self.host_drafts, self.varlen_next_ids, self.varlen_last_rows) = self.inputs.add_buffers([
             ((m,), torch.long), ((m,), torch.bool),
             ((max(runner.graphs.prefill_q, default=1),), torch.long), ((1,), torch.long),
             ((m, kmax), torch.long), ((max(runner.graphs.varlen_t, default=1),), torch.long),
             ((m,), torch.long)])
        self.penalties = StepPenalties(self.inputs, runner.model_cfg.vocab_size)
        # relaxed acceptance inside thinking spans (fused_relaxed.py), where it is on
        relaxed = runner.sampling.relaxed
        self.relaxed = None if relaxed is None else StepRelaxed(self.inputs, relaxed,
                                                                runner.max_model_len, dev)
        self.sampling = StepSampling(self.inputs, self.runner, self.penalties)
        self.draft_loop = (DraftLoop(self.head, self.backend, self.block_size, m, dev)
                           if self.head is not None else None)
        # What chaining carries from a step to the next (see the module docstring); a host
        # drafter's steps relaunch from the same carry instead. So do a head's with the suffix
        # enhancer: the next step verifies the drafts the host chose after reading this one's
        # output (its graph drafts again, kd as the step before). Where the head's loop length
        # may change from step to step (a k schedule, the cost model) they are launched from
        # the host instead.
        enhanced = self.head is not None and self.head.enhancer is not None
        self.chainable = self.host_drafter is None and not enhanced
        self.relaunchable = self.host_drafter is not None or (
            enhanced and proposer.policy.schedule is None and proposer.policy.cost_model is None)
        self.carry_pos = torch.zeros(m, dtype=torch.long, device=dev)  # bonus token's position
        self.carry_tokens = torch.zeros(m, kmax, dtype=torch.long, device=dev)  # bonus, drafts
        # Force-accept's draws when its mean is whole: floor(mean - 1 + u) is mean - 1 for any
        # u in [0, 1), so zeros do and the graph skips a random-number kernel that real
        # verification doesn't have.
        self.zero_draws = torch.zeros(m, device=dev)
        self.lengths = StepDraftLengths(weakref.proxy(self))
        self.table = GraphTable(weakref.proxy(self))
        self.prefill = PrefillGraphs(weakref.proxy(self))
        self._tables = ChainedTables(self.inputs.max_blocks)
        self.is_cuda = dev.type == "cuda"
        self.replays = 0  # steps served (tests read it)
        self.chained = 0  # of which launched from the previous step's outputs
        self.relaunched = 0  # of which a host drafter's, launched from the previous carry
        self.mode_steps = {mode: 0 for mode in MODES}  # ...by their graph's GraphMode
        # Host seconds summed over steps (benchmarks read it): copying inputs and launching,
        # waiting for the output copy, turning it into the StepResult.
        self.timing = {"launch_s": 0.0, "wait_s": 0.0, "unpack_s": 0.0}
        self.output = StepOutput(self.runner, self.drafter, self.host_drafter,
                                 device_ngram=self.ngram is not None)
        # testing only (SpecConfig.check_fused_writes): every step's writes checked against
        # the blocks reserved for its requests; the draft loop's positions and slots per
        # graph (bucket, q, kd, chained, mode), as _compute made them
        self.write_check = (WriteCheck(self.block_size) if proposer is not None
                            and proposer.spec.check_fused_writes else None)
        self._loop_slots: dict = {}
        self.kd_steps: dict = {}  # decode steps served per draft-loop length kd (tests read it)

    def next_q(self, kd: int) -> int:
        """Query length of the step after one that drafted kd tokens on the device."""
        return kd + 1 if self.device_drafts else 1

    @property
    def device_drafts(self) -> bool:
        """Whether the graphs draft: a head's loop, MTP depths mode's window, or the device
        n-gram lookup."""
        return self.drafter is not None or self.ngram is not None

    @property
    def policy(self):
        """The draft-length policy of the drafter in the graphs; None when none drafts there."""
        if self.drafter is not None:
            return self.drafter.policy
        return self.runner.proposer.policy if self.ngram is not None else None

    # ---- eligibility ----------------------------------------------------------------------
    def accepts(self, plan) -> bool:
        """Whether decode steps run here (plan: any decode step; the answer is the engine's)."""
        proposer = self.runner.proposer
        if proposer is not None and not self.device_drafts and self.host_drafter is None:
            return False  # a head that can't draft on the device (MTP depths with the enhancer)
        if plan is not None and self.drafter is not None and self.drafter.work.skipped_rows \
                and self._resumes_drafting(plan):
            return False
        if plan is not None and self.window is not None and any(
                sr.request.num_tokens <= self.window.K for sr in plan.scheduled):
            return False  # the window's rows would start below position 0
        # relaxed acceptance in greedy graphs only (fused_relaxed.py), with a head or a host
        # drafter (MTP depths mode's window and the device n-gram: the general path)
        if self.relaxed is None:
            return True
        if self.window is not None or self.ngram is not None:
            return False
        return plan is None or not graph_mode(
            sr.request.sampling_params for sr in plan.scheduled).samples

    def _resumes_drafting(self, plan) -> bool:
        """Whether plan's graph would draft (kd > 0) for a request whose draft-plane entries
        above its mark were skipped (k = 0 steps) and not yet repaired: the general path then
        runs the step, drafting nothing for that request and recomputing it from its mark
        (ModelRunner._first_pass), where a graph would draft from the stale entries, and chain
        those drafts. A request at the end of its context is left out: it can draft nothing
        more (the host trims its k to 0), so its graph rows' drafts are never verified, and a
        skip that only the context's end caused must not keep its batch off the graphs."""
        for sr in plan.scheduled:
            req = sr.request
            mark = req.num_draft_exact_tokens
            if (sr.num_computed_tokens > mark and req.draft_repair_mark != mark
                    and sr.num_computed_tokens < req.max_model_len - 2):
                return self.lengths.launch_kd(plan) > 0
        return False

    # ---- the step: launch, chain, collect ----------------------------------------------------
    def execute(self, plan, hb, q: int) -> StepResult:
        return self.collect(self.launch(plan, hb, q), plan)

    @torch.inference_mode()
    def launch(self, plan, hb, q: int) -> Launched:
        """Copy the step's inputs in and launch its graph; nothing is waited for."""
        b = len(plan.scheduled)
        bucket = self.graphs.bucket_for(b)
        key = (bucket, q, self.lengths.launch_kd(plan), False)
        mode = graph_mode(sr.request.sampling_params for sr in plan.scheduled)
        table = self.table.by_mode[mode]
        if key not in table:
            if self.window is not None:  # capturing writes the stash's rows
                self.window.stage([], 0, pull_all=True)
            self.table.capture_later(key, mode)
        t0 = time.perf_counter()
        if self.window is not None:
            self.window.stage([sr.request for sr in plan.scheduled], bucket)
        nd = np.zeros(bucket, np.int64)
        nd[:b] = [len(sr.draft_token_ids) for sr in plan.scheduled]
        extra = [(self.num_drafts, nd), (self.real, np.arange(bucket) < b)]
        extra += self.sampling.mode_rows(plan, bucket, mode)
        if self.relaxed is not None:
            extra += self.relaxed.rows(plan, bucket, self.runner.sampling)
        self.graphs.load_padded(hb, full_width=True, extra=tuple(extra))
        if mode.penalties:
            self.penalties.fill_tables(plan, bucket)
        if self.ngram is not None:
            self.ngram.fill(plan, bucket)
        rows = [sr.request.request_id for sr in plan.scheduled]
        launched = self._replay(key, rows, t0, entry=table[key])
        launched.mode = mode
        launched.next_k = self.lengths.take(plan)
        self._check_writes(launched, [sr.block_ids for sr in plan.scheduled])
        return launched

    @torch.inference_mode()
    def chain(self, prev: Launched, block_tables: list, kd_next: int) -> Launched:
        """Launch the step after `prev` from its outputs on the device, before they are read,
        with a draft loop of kd_next steps (chained_kd, which said it can be chained).

        block_tables: per row of prev (prev.rows order), the request's block ids now (empty
        for a request that finished: its row then writes only the null block)."""
        bucket, _, kd, _ = prev.key
        key = (bucket, self.next_q(kd), kd_next, True)
        table = self.table.by_mode[prev.mode]
        t0 = time.perf_counter()
        bt = self._tables.update(prev.rows, bucket, block_tables)
        self.inputs.put_if_changed(self.inputs.block_tables, bt)
        if self.host_drafter is not None:  # a step that drafts nothing (chained_kd)
            # (its relaunch graph reads the staged counts; prev's collect proposes nothing)
            self.inputs.put_all([(self.num_drafts, np.zeros(bucket, np.int64))])
            next_k = self.lengths.take_host(prev)
            if next_k is not None:
                prev.next_k = next_k
        self.chained += 1
        launched = self._replay(key, prev.rows, t0, entry=table[key], chained=True)
        launched.mode = prev.mode
        launched.next_k = self.lengths.take(prev)
        self._check_writes(launched, block_tables, chained=True)
        return launched

    @torch.inference_mode()
    def relaunch(self, prev: Launched, drafts: list, block_tables: list) -> Optional[Launched]:
        """Launch the step after `prev` (whose output was read) for a host drafter, or a head
        with the suffix enhancer (its graph's loop drafting prev's kd again): from the carry
        prev left on the device, with `drafts` (per row of prev, prev.rows order: the drafts
        the host proposed or kept, [] for a request that finished) staged. block_tables as for
        chain. None when no graph was captured ahead for that query length."""
        bucket, kd = prev.key[0], prev.key[2]  # (a head's loop as prev's; a host drafter's 0)
        key = (bucket, self.relaunch_q(max(len(d) for d in drafts)), kd, True)
        table = self.table.by_mode[prev.mode]
        if not self.relaunchable or key not in table:
            return None
        t0 = time.perf_counter()
        nd = np.zeros(bucket, np.int64)
        width = self.host_drafts.shape[1]
        arr = np.zeros((bucket, width), np.int64)
        if drafts:  # one conversion of padded rows: a numpy write a row costs more host time
            nd[:len(drafts)] = [len(d) for d in drafts]
            pad = [0] * width
            arr[:len(drafts)] = [d + pad[len(d):] for d in drafts]
        bt = self._tables.update(prev.rows, bucket, block_tables)
        self.inputs.put_if_changed(self.inputs.block_tables, bt)
        self.inputs.put_all([(self.num_drafts, nd), (self.host_drafts, arr)])
        self.relaunched += 1
        launched = self._replay(key, prev.rows, t0, entry=table[key])
        launched.drafts = [len(d) for d in drafts]
        launched.mode = prev.mode
        self._check_writes(launched, block_tables, chained=True)
        return launched

    def _check_writes(self, launched: Launched, block_ids: list, chained: bool = False) -> None:
        """The write check of a step just replayed (testing only: write_check.py)."""
        if self.write_check is None:
            return
        bucket, q = launched.key[0], launched.key[1]
        buf = self.inputs
        self.write_check.check(launched.rows, block_ids, q, buf.slot_mapping[:bucket * q],
                               buf.positions[:bucket * q],
                               self._loop_slots.get(launched.key + (launched.mode,), ()),
                               chained=chained)

    def collect(self, launched, plan) -> StepResult:
        """Wait for the step's output copy and turn it into the StepResult of `plan` (the
        requests of launched.rows that are still running, in that order)."""
        t1 = time.perf_counter()
        if launched.event is not None:
            while not launched.event.query():  # poll: waits for this step only
                pass
        t2 = time.perf_counter()
        out = launched.host.numpy()  # sync-ok: host memory, its copy was waited for above
        row_of = {rid: i for i, rid in enumerate(launched.rows)}
        order = [row_of[sr.request.request_id] for sr in plan.scheduled]
        out = out[order]
        logprobs = None
        if launched.host_logprobs is not None:
            logprobs = launched.host_logprobs.numpy()[order]  # sync-ok: waited for above
        _, q, kd, _ = launched.key
        # a decode graph of kd = 0 runs no head work (compute); a prefill's tail always does
        skipped = self.drafter is not None and kd == 0 and not launched.prefill
        if self.ngram is not None:
            packed = launched.host.numpy()  # sync-ok: host memory, waited for above
            if not launched.prefill:  # the graph appended each row's emitted tokens
                self.ngram.collected(packed, q, len(launched.rows))
            if kd > 0:  # what a step chained from this one verifies, in launched.rows order
                drafted = packed[:, q + 1:] >= 0
                launched.next_drafts = drafted.sum(axis=1).tolist()  # sync-ok: numpy
        clock = self.runner.step_clock
        if launched.prefill or not plan.scheduled:  # a prefill, or a chain drained by nobody
            clock.interrupt()
        else:  # before `result`, which decides the next step's drafts (clock.chose); the
            # graph's own bucket (a chained step keeps its first launch's rows)
            clock.collected(launched.key[0], t2)
        next_k = None
        if launched.next_k is not None:
            next_k = [launched.next_k[sr.request.request_id] for sr in plan.scheduled]
        result = self.output.result(plan, out, q, kd, logprobs, plane_skipped=skipped,
                                    next_k=next_k)
        if launched.prefill:  # the counters and timings below are decode steps'
            return result
        if self.head is not None and kd > 0:  # the graph's head work, as the eager head counts it
            work = self.head.work
            work.first_pass_rows += plan.num_tokens
            work.loop_rows += (kd - 1) * len(plan.scheduled)
        if self.window is not None and kd > 0:  # the stash the graph left, on the host's books
            self.window.drafter_work(len(plan.scheduled))
            rows = out.tolist()  # sync-ok: numpy, already on the host
            self.window.kept([sr.request for sr in plan.scheduled], order,
                             [(r[q], r[q + 1:]) for r in rows])
        self.replays += 1
        self.kd_steps[kd] = self.kd_steps.get(kd, 0) + 1
        self.mode_steps[launched.mode] += 1
        tm = self.timing
        tm["launch_s"] += launched.t_launch
        tm["wait_s"] += t2 - t1
        tm["unpack_s"] += time.perf_counter() - t2
        return result

    def relaunch_q(self, longest: int) -> Optional[int]:
        """Query length of a relaunched step whose longest draft is `longest` tokens."""
        return next((q for q in self.graphs.q_lens if q > longest), None)

    def _replay(self, key, rows, t0, entry=None, prefill: bool = False,
                chained: bool = False) -> Launched:
        """Replay the graph of `key` (or `entry`, a (graph, outputs) pair) and queue the
        copies of its outputs. A step launched from the host may follow eager kernels: PDL is
        primed first (kernels/pdl.prime: after a torch kernel the graph replays slower)."""
        graph, outs = entry or self.table.greedy[key]
        # a logprobs graph's outputs: (packed, logprobs); any other's: packed
        packed, logprobs = outs if isinstance(outs, tuple) else (outs, None)
        if chained:
            graph.replay()
        else:
            self.graphs.replay(graph, "step")  # primed
        if not self.is_cuda:  # CPU stand-in: the "graph" already ran
            return Launched(key, rows, packed.clone(), None, time.perf_counter() - t0, prefill,
                            host_logprobs=None if logprobs is None else logprobs.clone())
        host = self.output.copy_out(packed)  # the step's device -> host copy
        host_logprobs = None if logprobs is None else self.output.copy_out(logprobs)
        self.output.flip()
        event = torch.cuda.Event()
        event.record()
        return Launched(key, rows, host, event, time.perf_counter() - t0, prefill,
                        host_logprobs=host_logprobs)

    # ---- what the graph computes ----------------------------------------------------------
    def _chained_inputs(self, bucket: int, q: int) -> None:
        """A chained step's inputs from the carry buffers: row j of request b is the token at
        carry_pos[b] + j (the bonus token, then the drafts)."""
        buf = self.inputs
        host_drafts = self.host_drafts[:bucket] if self.relaunchable else None
        if self.ngram is not None:  # each row's own count, its drafts after the bonus token
            self.num_drafts[:bucket].copy_(self.ngram.counts[:bucket])
            host_drafts = self.carry_tokens[:bucket, 1:]
        chained_inputs(self.carry_pos[:bucket], self.carry_tokens[:bucket], self.real[:bucket],
                       buf.block_tables[:bucket], self.block_size, q, buf.input_ids,
                       buf.positions, buf.slot_mapping, buf.seq_lens, buf.query_start_loc,
                       self.num_drafts, host_drafts=host_drafts)

    def compute(self, bucket: int, q: int, kd: int, chained: bool = False,
                mode: GraphMode = GREEDY) -> torch.Tensor:
        buf = self.inputs
        n = bucket * q
        if chained:
            self._chained_inputs(bucket, q)
        ids, pos = buf.input_ids[:n], buf.positions[:n]
        meta = AttentionMetadata(
            slot_mapping=buf.slot_mapping[:n], query_start_loc=buf.query_start_loc[:bucket + 1],
            seq_lens=buf.seq_lens[:bucket], block_tables=buf.block_tables[:bucket],
            max_query_len=q, max_seq_len=buf.max_blocks * self.block_size)
        ctx = ForwardContext(self.backend, meta)
        capture = self.head.capture_layers if self.head is not None else ()
        hidden, aux = self.model(ids, pos, ctx, capture_layers=capture)
        # [n]: each row's token, the target's choice that accept verifies the drafts against
        logits = raw = logprobs = None
        if mode.samples or mode.logprobs or self.relaxed is not None:
            logits = self.model.compute_logits(hidden)  # [n, V] float32
        if mode.logprobs:  # raw: as they were before the penalties change them in place
            raw = logits.clone() if mode.penalties else logits
        if mode.samples:
            target = self.sampling.sample(logits, ids, pos, bucket, q, mode)
        else:
            target = (self.model.greedy_tokens(hidden) if logits is None
                      else argmax_rows(logits))
        # [B, q + 1 + kd] = emitted tokens | accepted count | drafts: the step's one output
        # (kd = 0 without a head: draft_steps)
        packed = torch.empty(bucket, q + 1 + kd, dtype=torch.long, device=ids.device)
        mean = self.runner.sampling.force_accept_mean
        u = None
        if mean is not None:
            u = (self.zero_draws[:bucket] if float(mean).is_integer()
                 else torch.rand(bucket, device=ids.device))
        carry = ((self.carry_pos[:bucket], self.carry_tokens[:bucket])
                 if self.chainable or self.relaunchable else None)
        # (force-accept replaces verifying; sampled graphs don't serve relaxed steps: accepts)
        if self.relaxed is not None and mean is None and not mode.samples:
            target = self.relaxed.targets(target, ids, self.num_drafts[:bucket], logits,
                                          bucket, q)
        # Verify (or force-accept), and what the head and the next chained step start from:
        # the token at position + 1 of every row (emitted up to the accepted count, the
        # target's filler past it), each request's row `accepted` (position f - 2, f: its
        # committed length) and that position.
        next_ids, last_rows, first = accept(target, ids, self.num_drafts[:bucket], pos, q,
                                            packed, u, mean or 0.0,
                                            head=self.head is not None, carry=carry)
        if self.window is not None and kd > 0:
            outs = (packed[:, q + 1:],) + ((self.carry_tokens[:bucket, 1:1 + kd],)
                                           if self.chainable else ())
            self.window.run(hidden, packed[:, :q], packed[:, q], pos, self.real[:bucket],
                            buf.block_tables[:bucket], q, kd, outs)
        if mode.penalties:  # what the next step's penalties read (fused_penalties.py)
            self.penalties.count_emitted(packed, q, bucket)
        if self.relaxed is not None:  # the span state the next chained step reads
            self.relaxed.advance(packed, q, bucket)
        if raw is not None:
            logprobs = self.sampling.logprobs(raw, packed, bucket, q)
        if self.ngram is not None:  # the emitted tokens, then the next step's drafts from them
            self.ngram.advance(packed, q, bucket, self.real)
            self.ngram.propose(bucket, kd, self.real, packed[:, q + 1:],
                               self.carry_tokens[:bucket, 1:1 + kd])
        if self.head is not None and kd > 0:
            # the drafts go to the output and to the next chained step's rows 1 .. kd
            outs = (packed[:, q + 1:],) + ((self.carry_tokens[:bucket, 1:1 + kd],)
                                           if self.chainable else ())
            loop = self.draft_loop.run(hidden, aux, next_ids, pos, ctx, last_rows, first,
                                       buf.block_tables[:bucket], kd, outs)
            if loop is not None and self.write_check is not None:
                self._loop_slots[(bucket, q, kd, chained, mode)] = loop
        return packed if logprobs is None else (packed, logprobs)

    def fill_dummy(self, bucket: int, q: int) -> None:
        """A dummy batch that writes nowhere in the buffers (graphs are captured over it)."""
        self.graphs.fill_dummy(bucket, q)
        self.num_drafts[:bucket].zero_()
        self.real[:bucket].zero_()  # chained: every row is padding (slot -1)
        self.carry_pos[:bucket].zero_()
        self.carry_tokens[:bucket].zero_()
        self.sampling.greedy_rows(bucket)  # the dummy batch samples nothing...
        self.penalties.neutral_rows(bucket)  # ...and has no penalties
        if self.relaxed is not None:  # ...nor thinking spans
            self.relaxed.neutral_rows(bucket)
        if self.ngram is not None:  # ...nor history to draft from
            self.ngram.neutral_rows(bucket)

