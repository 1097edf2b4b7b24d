"""The model runner: one StepPlan in, one StepResult out.

It owns the KV pool (target layers + draft KV plane), the attention backend, the fixed-address
input buffers, the per-request sampling generators and the proposer. A step:

    build host inputs -> copy into fixed buffers -> target forward (hidden + captured layers)
    -> logits at sampled rows -> sample / verify drafts -> propose next drafts -> StepResult

With CUDA graphs, a greedy decode step runs as one graph instead (runner/fused_step.py).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from outpace.attention.base import ForwardContext
from outpace.attention.inputs import InputBuffers, build_host_batch
from outpace.kernels.options import use_kernel_options
from outpace.rate_limited_log import RateLimitedLog
from outpace.runner.sampling_step import RelaxedAcceptance, SamplingStep
from outpace.runner.step_clock import StepClock
from outpace.runner_config import KernelOptions
from outpace.speculative.base import DraftBatch
from outpace.types import RequestStepOutput, StepPlan, StepResult

log = logging.getLogger(__name__)


def make_backend(kv_cache, model_cfg, device: torch.device):
    scale = model_cfg.head_dim ** -0.5
    args = (kv_cache, model_cfg.num_attention_heads, model_cfg.num_key_value_heads,
            model_cfg.head_dim, scale)
    if device.type == "cuda":
        try:
            from outpace.attention.triton_paged import TritonPagedBackend
            return TritonPagedBackend(*args)
        except ImportError:
            log.warning("triton is not available; using the PyTorch reference attention")
    from outpace.attention.torch_ref import TorchRefBackend
    return TorchRefBackend(*args)


# The five ways a step runs (ModelRunner.choose_path decides; launch / chain / relaunch run
# FUSED steps, and prefill steps of PREFILL_GRAPH, launched like them, with overlap).
FUSED, DECODE_GRAPH, PREFILL_GRAPH, VARLEN_GRAPH, EAGER = (
    "fused", "decode_graph", "prefill_graph", "varlen_graph", "eager")
STEP_PATHS = (FUSED, DECODE_GRAPH, PREFILL_GRAPH, VARLEN_GRAPH, EAGER)


@dataclass(frozen=True)
class StepPath:
    kind: str  # one of STEP_PATHS
    size: Optional[int] = None  # the graph's query length (fused, decode, prefill) or T (varlen)


def _under_kernel_options(method):
    """Run a ModelRunner method with the runner's KernelOptions in force (kernels/options.py):
    every kernel it launches or captures into a graph follows them."""
    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        with use_kernel_options(self.kernel_options):
            return method(self, *args, **kwargs)
    return wrapped


class ModelRunner:
    def __init__(self, model, model_cfg, num_blocks: int, block_size: int, max_model_len: int,
                 max_num_tokens: int, max_num_seqs: int, device: torch.device, kv_dtype,
                 proposer=None, seed: int = 0, kernel_options: KernelOptions = KernelOptions()):
        self.kernel_options = kernel_options
        self.path_steps = {kind: 0 for kind in STEP_PATHS}  # synchronous steps by path (tests)
        self.model = model
        self.model_cfg = model_cfg
        self.device = device
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.proposer = proposer
        num_draft_layers = proposer.num_kv_layers if proposer is not None else 0
        self.num_layer_slots = model_cfg.num_hidden_layers + num_draft_layers
        # [slots, K|V, blocks, block_size, Hkv, D]: draft layers sit after the target's.
        self.kv_cache = torch.zeros(self.num_layer_slots, 2, num_blocks, block_size,
                                    model_cfg.num_key_value_heads, model_cfg.head_dim,
                                    dtype=kv_dtype, device=device)
        self.backend = make_backend(self.kv_cache, model_cfg, device)
        # Block-table width: the context plus the largest verify block and draft lookahead
        # (k <= 16, SpecConfig), so a step near the end of the context still fits.
        max_blocks = (max_model_len + 2 * 16 + block_size - 1) // block_size + 1
        # One sequence slot more than the scheduler fills: a varlen graph's padding rows are a
        # sequence of their own (cuda_graph.load_varlen), so a step whose prompts fill every
        # slot still pads into a graph instead of running eagerly (several times slower).
        self.max_num_seqs = max_num_seqs
        self.inputs = InputBuffers(max_num_tokens, max_num_seqs + 1, max_blocks, device)
        self.sampling = SamplingStep(device, seed)
        self.graphs = None  # GraphRunner once enable_cuda_graphs() ran
        self.fused = None  # FusedStep: greedy decode steps as one graph each (with graphs)
        # Every drafter exception is counted (StepResult.num_draft_failures, the engine's
        # total, /metrics) and logged at most once an interval: a drafter that fails every
        # step must not flood the log
        # request id -> the draft length a request was given when it drafted again over
        # skipped entries, kept for the step that recomputes them (_first_pass)
        self._deferred_k: dict = {}
        self.draft_failures = RateLimitedLog(
            log, "the drafter raised; continuing without drafts for that step")
        # decode steps' measured times for the cost model (a no-op without one)
        policy = getattr(proposer, "policy", None)
        self.step_clock = StepClock(policy.observe_step if policy is not None
                                    else lambda *a: None)
        if proposer is not None:
            self.sampling.force_accept_mean = proposer.spec.force_accept_mean
            self.sampling.relaxed = RelaxedAcceptance.from_spec(proposer.spec,
                                                                model_cfg.vocab_size)
            if hasattr(proposer, "bind"):
                proposer.bind(self)

    def begin_request(self, req) -> None:
        """A request the engine admitted: its drafter state begins."""
        if self.proposer is not None:
            self.proposer.begin(req)

    def shutdown(self) -> None:
        """Nothing to stop (a tensor-parallel runner stops its other ranks)."""

    def release(self, request_id: str) -> None:
        """Forget per-request state (generator, proposer state)."""
        self.sampling.release(request_id)
        self._deferred_k.pop(request_id, None)
        if self.proposer is not None:
            self.proposer.finish(request_id)

    @_under_kernel_options
    def enable_cuda_graphs(self, q_lens: tuple, capture_fused: bool = False,
                           capture=None, prime=None) -> None:
        """Capture the target forward for decode/verify batches (CUDA only); capture_fused:
        also capture the fused greedy steps steady decoding uses now, not when first seen.
        capture, prime: GraphRunner's (None: a CUDA graph capture, pdl.prime; tests pass
        stand-ins that run on the CPU)."""
        from outpace.runner.cuda_graph import GraphRunner
        layers = self.proposer.capture_layers if self.proposer is not None else ()
        self.graphs = GraphRunner(self.model, self.backend, self.inputs, layers,
                                  self.max_num_seqs, q_lens, self.inputs.max_tokens,
                                  self.max_model_len, capture=capture, prime=prime)
        self.graphs.capture_all()
        from outpace.runner.fused_step import FusedStep
        self.fused = FusedStep(self)
        self.fused.prefill.capture()
        if capture_fused:
            self.fused.table.capture_common()

    @_under_kernel_options
    def measure_step_times(self, max_draft: int):
        """The step-time table of this runner's steps (runner/step_timing.py): from its graphs
        once enable_cuda_graphs ran, else from a few eager forwards."""
        from outpace.runner.step_timing import measure_step_times
        return measure_step_times(self, max_draft)

    def _graph_q(self, plan: StepPlan):
        """The captured query length a pure decode/verify step pads to, or None."""
        if self.graphs is None:
            return None
        n = 0
        for sr in plan.scheduled:
            if not sr.sample or sr.num_computed_tokens + 1 != sr.request.num_tokens:
                return None  # a prefill chunk: run eagerly
            n = max(n, sr.num_new_tokens)
        q = next((q for q in self.graphs.q_lens if q >= n), None)
        if q is None or self.graphs.bucket_for(len(plan.scheduled)) is None:
            return None
        return q

    def _prefill_graph_q(self, plan: StepPlan):
        """The prefill graph a step of one request's prefill chunk pads to, or None.

        Not when the padded rows' positions would pass the context (the rope tables end
        there), nor for a chunk that carries drafts."""
        if self.graphs is None or len(plan.scheduled) != 1:
            return None
        sr = plan.scheduled[0]
        if sr.draft_token_ids:
            return None
        q = self.graphs.prefill_q_for(sr.num_new_tokens)
        if q is None or sr.num_computed_tokens + q > self.max_model_len:
            return None
        return q

    # ---- overlap (see runner/fused_step.py and LLMEngine.step) -----------------------------
    def can_launch(self, plan: StepPlan) -> bool:
        """Whether plan can run as a fused step launched now and collected later: a decode
        step, or a greedy prefill step (PrefillGraphs.launch) that the first decode step
        then chains from. A host drafter's decode steps too: they are relaunched, not chained
        (FusedStep.relaunch)."""
        fused = self.fused
        if fused is None or not (fused.chainable or fused.relaunchable) \
                or not fused.accepts(plan):
            return False
        if self._graph_q(plan) is not None:
            return True
        q = self._prefill_graph_q(plan)
        # (not under relaxed acceptance: the first decode step would chain from the prefill
        # graph without the span state staged)
        return q is not None and fused.relaxed is None and self.fused.prefill.can_launch(plan, q)

    @_under_kernel_options
    def launch(self, plan: StepPlan):
        q = self._graph_q(plan)
        if q is not None:
            return self.fused.launch(plan, self._host_batch(plan, q), q)
        q = self._prefill_graph_q(plan)
        return self.fused.prefill.launch(plan, self._host_batch(plan, q), q)

    def chained_kd(self, launched, plan: StepPlan) -> Optional[int]:
        return self.fused.lengths.chained_kd(launched, plan)

    @_under_kernel_options
    def chain(self, launched, block_tables: list, kd_next: int):
        return self.fused.chain(launched, block_tables, kd_next)

    @_under_kernel_options
    def relaunch(self, launched, drafts: list, block_tables: list):
        return self.fused.relaunch(launched, drafts, block_tables)

    @_under_kernel_options
    def collect(self, launched, plan: StepPlan) -> StepResult:
        return self.fused.collect(launched, plan)

    # ---- the synchronous step -------------------------------------------------------------
    def _host_batch(self, plan: StepPlan, q_graph):
        """The step's rows on the host; padded to q_graph tokens each when it runs in a graph."""
        rows = []
        for sr in plan.scheduled:
            req = sr.request
            start, n = sr.num_computed_tokens, sr.num_new_tokens
            committed_part = req.token_slice(start, start + n)
            toks = committed_part + sr.draft_token_ids[:n - len(committed_part)]
            nd = len(sr.draft_token_ids)
            offsets = list(range(n - 1 - nd, n)) if sr.sample else []
            if q_graph is not None and q_graph > n:  # pad to the graph's uniform query length
                rows.append((toks + [0] * (q_graph - n), start, sr.block_ids, offsets, n))
            else:
                rows.append((toks, start, sr.block_ids, offsets))
        return build_host_batch(rows, self.block_size)

    def choose_path(self, plan: StepPlan):
        """The one place that decides how a step runs -> (StepPath, its host batch): the fused
        step's graph (a decode or verify step the fused step accepts), a decode graph (one
        it doesn't), a prefill graph (one request's prefill chunk), a varlen graph (any other
        step that fits one), or eagerly."""
        q_graph = self._graph_q(plan)
        q_prefill = self._prefill_graph_q(plan) if q_graph is None else None
        hb = self._host_batch(plan, q_graph or q_prefill)
        if q_graph is not None:
            fused = self.fused is not None and self.fused.accepts(plan)
            return StepPath(FUSED if fused else DECODE_GRAPH, q_graph), hb
        if q_prefill is not None:
            return StepPath(PREFILL_GRAPH, q_prefill), hb
        if self.graphs is not None:  # several prefill chunks, chunks beside decodes
            t = self.graphs.varlen_t_for(len(hb.input_ids), len(hb.seq_lens))
            if t is not None:
                return StepPath(VARLEN_GRAPH, t), hb
        return StepPath(EAGER), hb

    @torch.inference_mode()
    @_under_kernel_options
    def execute(self, plan: StepPlan) -> StepResult:
        path, hb = self.choose_path(plan)
        self.path_steps[path.kind] += 1
        if path.kind == FUSED:
            return self.fused.execute(plan, hb, path.size)
        self.step_clock.interrupt()
        q_prefill = path.size if path.kind == PREFILL_GRAPH else None
        t_varlen = path.size if path.kind == VARLEN_GRAPH else None
        if path.kind == DECODE_GRAPH:
            hidden, aux, logits, meta = self.graphs.run(hb)
        elif path.kind == PREFILL_GRAPH:
            hidden, aux, logits, meta = self.graphs.run_prefill(hb)
        elif path.kind == VARLEN_GRAPH:
            hidden, aux, logits, meta = self.graphs.run_varlen(hb, t_varlen,
                                                               self.model.compute_logits)
        if path.kind != EAGER:
            t = len(hb.input_ids)
            ids, pos = self.inputs.input_ids[:t], self.inputs.positions[:t]
        else:
            ids, pos, logits_idx, meta = self.inputs.load(hb)
            ctx = ForwardContext(self.backend, meta)
            capture = self.proposer.capture_layers if self.proposer is not None else ()
            hidden, aux = self.model(ids, pos, ctx, capture_layers=capture)  # [T, H]
            logits = self.model.compute_logits(hidden[logits_idx])  # [N, V]

        per_req = self.sampling.run(plan, logits)  # list[RequestStepOutput | None]
        result = StepResult()
        for sr, out in zip(plan.scheduled, per_req):
            result.outputs[sr.request.request_id] = out or RequestStepOutput(token_ids=[])
        if self.proposer is not None:
            seen = [(sr.request.request_id, out.num_draft_tokens, out.num_accepted_tokens)
                    for sr, out in zip(plan.scheduled, per_req) if out is not None]
            if seen:
                self.proposer.policy.observe_many(*zip(*seen))
            self._propose(plan, per_req, hb, ids, pos, hidden, aux, meta, result, q_prefill,
                          t_varlen)
        return result

    def _propose(self, plan, per_req, hb, ids, pos, hidden, aux, meta, result,
                 q_prefill=None, t_varlen=None) -> None:
        """Ask the proposer for the next drafts of every request that committed a token (from
        the fused step's head graph after a prefill or varlen graph's step, where one was
        captured)."""
        qsl = hb.query_start_loc
        reqs, committed, starts, ends, last_rows = [], [], [], [], []
        drafting = []  # the rows of requests that committed a token: they get a draft length
        next_ids = np.empty_like(hb.input_ids)
        for i, (sr, out) in enumerate(zip(plan.scheduled, per_req)):
            req = sr.request
            a, b = int(qsl[i]), int(qsl[i + 1])
            new = out.token_ids if out is not None else []
            full = req.all_token_ids + new
            s = sr.num_computed_tokens
            # Token at position p+1 for rows p = s..s+n-1 (committed ones; the rest is filler).
            nxt = full[s + 1:s + 1 + (b - a)]
            nxt = nxt + [0] * ((b - a) - len(nxt))
            next_ids[a:b] = nxt
            reqs.append(req)
            committed.append(full)
            starts.append(a)
            ends.append(b)
            if out is not None and new:
                # Last committed-next row: the row of position len(full) - 2.
                last_rows.append(a + (len(full) - 2 - s))
                drafting.append(i)
            else:
                last_rows.append(-1)
        ks = [0] * len(reqs)
        for i, k in zip(drafting, self.draft_lengths([reqs[i] for i in drafting],
                                                     plan.draft_batch_size,
                                                     [len(committed[i]) for i in drafting])):
            ks[i] = k
        first_pass = self._first_pass(plan, drafting, ks, result,
                                      [len(c) for c in committed])
        if first_pass is not None and not any(first_pass):
            # nobody drafts: no head work this step (every plane entry left as it is)
            self.proposer.work.skip(len(hb.input_ids))
            return
        try:
            drafts = None
            if first_pass is not None and not all(first_pass):
                pass  # the head graphs cover every row: the eager head gathers the others'
            elif q_prefill is not None and self.fused is not None:
                one = self.fused.prefill.drafts(q_prefill, next_ids, last_rows[0], ks[0],
                                                plan.draft_batch_size)
                drafts = None if one is None else [one]
            elif t_varlen is not None and self.fused is not None:
                drafts = self.fused.prefill.varlen_drafts(t_varlen, next_ids, last_rows, ends, ks)
            if drafts is not None:
                self.proposer.work.first_pass_rows += len(hb.input_ids)
                # the head's suffix enhancer, as its eager propose applies it
                drafts = self.proposer.enhance(reqs, committed, drafts, ks)
            else:
                # (the eager head's pass gathers the rows of the requests that run it)
                batch = DraftBatch(
                    requests=reqs, committed=committed, row_start=starts, row_end=ends,
                    last_row=last_rows, positions=pos,
                    next_token_ids=torch.from_numpy(next_ids).to(self.device),
                    hidden=hidden, aux_hidden=aux, meta=meta,
                    block_ids=[sr.block_ids for sr in plan.scheduled], first_pass=first_pass)
                drafts = self.proposer.propose(batch, ks)
        except Exception as e:  # a drafter bug must not take the engine down: go on without drafts
            if self.model.tp.size > 1:
                # not under tensor parallelism: the other ranks' drafting runs collectives
                # this rank would now skip, so the ranks are out of step (the step fails)
                raise
            self.drafter_failed(e, plan, result)
            return
        for sr, d, k in zip(plan.scheduled, drafts, ks):
            if k > 0 and d:
                result.outputs[sr.request.request_id].next_draft_token_ids = list(d[:k])

    def _first_pass(self, plan: StepPlan, drafting: list, ks: list, result: StepResult,
                    num_committed: list) -> Optional[list]:
        """Whether a head with a draft plane runs over each request's rows this step (None:
        no draft plane, everyone's). k = 0 skips all draft work for that request: no first
        pass, no loop rows, no MTP window; its plane entries for the step's rows are left
        unwritten (draft_plane_skipped: the scheduler keeps its mark). Always run: mid-prompt
        chunks (no draft length yet: a skip would cost a recompute of the prompt at its last
        chunk) and a repair step (a step recomputing from the mark: Request.draft_repair_mark
        is the mark), whatever k. A request that drafts again (k > 0) while its entries from
        the mark up to this step's first row are stale drafts nothing this step and recomputes
        from the mark (draft_plane_written False, as after a drafter failure), so no draft
        ever reads a skipped entry; once per mark, as there: after a repair that failed it
        drafts over the stale entries. The draft length it was given then is kept for its
        repair step, which drafts at least that many (a policy's probe of a request that
        drafted nothing would otherwise be spent on the recompute and never drafted)."""
        if not self.proposer.num_kv_layers:
            return None
        on = [True] * len(plan.scheduled)
        outputs = result.outputs
        for i in drafting:
            sr = plan.scheduled[i]
            req = sr.request
            mark, s = req.num_draft_exact_tokens, sr.num_computed_tokens
            repairing = s <= mark and req.draft_repair_mark == mark
            if repairing:
                deferred = self._deferred_k.pop(req.request_id, 0)
                ks[i] = max(ks[i], min(deferred, req.max_model_len - num_committed[i] - 1))
            if ks[i] == 0 and not repairing:
                on[i] = False
                outputs[req.request_id].draft_plane_skipped = True
            elif ks[i] > 0 and s > mark and req.draft_repair_mark != mark:
                on[i] = False
                self._deferred_k[req.request_id] = ks[i]
                ks[i] = 0
                outputs[req.request_id].draft_plane_written = False
        return on

    def drafter_failed(self, exc: Exception, plan: StepPlan, result: StepResult) -> None:
        """The drafter raised in `plan`'s step: count and log it (rate-limited) and, for a head
        with a draft plane, mark every request's rows of the step as not written (the
        scheduler recomputes them before any draft reads them: Scheduler.update)."""
        self.draft_failures.record(exc)
        result.num_draft_failures += 1
        self.step_clock.chose(0)  # the next step verifies no drafts
        if self.proposer.num_kv_layers:
            outputs = result.outputs
            for sr in plan.scheduled:
                outputs[sr.request.request_id].draft_plane_written = False

    def draft_lengths(self, reqs: list, batch_size: int, num_committed: list,
                      k: Optional[int] = None, chosen: Optional[list] = None) -> list:
        """Drafts to propose for each of reqs (a step's requests that committed tokens, asked
        together: the cost model chooses for the batch): the policy's k (or `k`, the policy's
        answer for everyone, already asked; or `chosen`, its answer per request, chosen when
        a fused step launched), never past the context (the next step emits up to k + 1
        tokens, so k <= context left - 1).

        Not trimmed to max_tokens: a step launched ahead on the device (LLMEngine._chain)
        verifies all of them, so the host's plan must hold them all; a step scheduled on the
        host trims them there (Scheduler._drafts_for)."""
        if chosen is not None:
            ks = chosen
        elif k is not None:
            ks = [k] * len(reqs)
        else:
            ks = self.proposer.draft_lengths(reqs, batch_size)
        ks = [max(0, min(ki, req.max_model_len - n - 1))
              for ki, req, n in zip(ks, reqs, num_committed)]
        self.step_clock.chose(max(ks, default=0))
        return ks
