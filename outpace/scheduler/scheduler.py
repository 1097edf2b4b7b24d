"""FCFS continuous batching with chunked prefill, preemption by recompute, and lookahead.

One step (schedule):
  1. decodes of running requests, oldest first: 1 token + the request's drafts (trimmed so the
     step can't run past max_tokens or the context), with lookahead slots for the draft KV;
  2. unfinished prefills of running requests (chunked to the budget left);
  3. admission of waiting requests (front first) while the budget, max_num_seqs and the pool
     allow; skipped in a step that preempted, so a victim isn't re-admitted at once.
All share max_num_batched_tokens; in a step that carries decodes, 2 and 3 together take at most
max_prefill_with_decodes tokens (when set), so a long prompt can't stall running streams. When a running request can't get its blocks, the most recently
arrived running request is preempted (possibly itself): its blocks are freed, it goes back to the
front of the waiting queue and, when resumed, recomputes prompt + outputs as one prefill (the
prefix cache may serve part of it); its next sampled token continues its output.

num_computed_tokens advances in schedule() by everything scheduled, drafts included; update()
rolls back the rejected drafts, so afterwards a decoding request has exactly
num_computed_tokens == num_tokens - 1 (the last sampled token has no KV yet).

The draft-plane mark (Request.num_draft_exact_tokens): a head's draft KV is exact below it.
update() advances it with num_computed_tokens when the step's first pass ran; when the drafter
raised it stays, and num_computed_tokens goes back to it (once per mark value): the request's
next step recomputes its committed tokens from there as a prefill chunk (target KV rewritten
with the same values, the head's first pass rewriting the stale draft entries before any draft
reads them). A step in which the request drafts nothing (k = 0) runs no draft work for it and
keeps the mark; when it drafts again the runner asks for the same recompute first
(ModelRunner._first_pass). The prefix cache publishes only blocks below both, so never a block
whose draft entries are stale.

Context limit: a request may not grow past what the whole pool holds for it alone (less the
lookahead), so a request running alone can always get its blocks and preemption never loops.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from outpace.config import SchedulerConfig
from outpace.errors import ConfigError, InvalidRequestError, QueueFullError
from outpace.kvcache.manager import KVCacheManager
from outpace.types import (Request, RequestStatus, ScheduledRequest, SpecStats, StepPlan,
                           StepResult)

log = logging.getLogger(__name__)


@dataclass
class _Step:
    budget: int
    prefill_budget: int  # what prefill chunks may still take (<= budget)
    scheduled: dict = field(default_factory=dict)  # request_id -> ScheduledRequest, in order
    preempted: list = field(default_factory=list)  # request ids


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 num_lookahead_tokens: int = 0, block_size: int = 16,
                 draft_plane: bool = False):
        if block_size != kv.block_size:
            raise ConfigError(f"scheduler block_size {block_size} differs from the KV cache's "
                              f"{kv.block_size}; build both from one CacheConfig")
        self.cfg = cfg
        self.kv = kv
        self.max_model_len = max_model_len
        self.num_lookahead_tokens = num_lookahead_tokens
        self.block_size = block_size
        # whether requests have a draft plane (a head's KV in the pool) whose mark to keep
        self.draft_plane = draft_plane
        # The manager caps lookahead at max_model_len, so only a pool smaller than one
        # max-length request shortens the context (see the module docstring).
        cap = kv.capacity_tokens
        self.max_len = max_model_len if max_model_len <= cap else cap - num_lookahead_tokens
        if self.max_len < 2:
            raise ConfigError(
                f"the KV pool holds {cap} tokens, too few for any request with "
                f"{num_lookahead_tokens} lookahead tokens; give the KV cache more memory")
        self.waiting: deque = deque()
        self.running: list = []  # arrival order: running[-1] is the first preemption victim
        self._requests: dict = {}  # request_id -> Request, waiting or running
        self._order: dict = {}  # request_id -> arrival number (FCFS order)
        self._counter = itertools.count()
        self._finished_pending: list = []  # finished inside schedule(); reported by update()

    # ---- queue ----------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._finished_pending)

    def get_request(self, request_id: str) -> Optional[Request]:
        return self._requests.get(request_id)

    def _max_len(self, req: Request) -> int:
        return min(self.max_len, req.max_model_len)

    def add_request(self, request: Request) -> None:
        rid = request.request_id
        if rid in self._requests:
            raise InvalidRequestError(f"request id {rid!r} is already in use; use a new id")
        limit = self.cfg.max_waiting_requests
        if limit is not None and len(self.waiting) >= limit:
            raise QueueFullError(f"{len(self.waiting)} requests are waiting (the bound is "
                                 f"max_waiting_requests={limit}); retry later")
        n = request.num_tokens
        if n == 0:
            raise InvalidRequestError("the prompt is empty; give at least one token")
        max_len = self._max_len(request)
        if n >= max_len:
            why = ("the KV pool" if max_len < min(self.max_model_len, request.max_model_len)
                   else "max_model_len")
            raise InvalidRequestError(
                f"the prompt has {n} tokens but at most {max_len - 1} fit ({why} allows "
                f"{max_len} tokens of prompt and output); shorten the prompt"
                + (" or give the KV cache more memory" if why == "the KV pool" else
                   " or raise max_model_len"))
        request.status = RequestStatus.WAITING
        self._order[rid] = next(self._counter)
        self._requests[rid] = request
        self.waiting.append(request)

    def finish_request(self, request_id: str, status: RequestStatus,
                       stop_reason=None) -> Optional[Request]:
        """End a waiting or running request now (stop string, abort); frees its blocks."""
        if not status.finished:
            raise ValueError(f"finish_request needs a finished status, got {status}")
        req = self._requests.get(request_id)
        if req is None:
            return None
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = status
        req.stop_reason = stop_reason
        req.spec_token_ids = []
        del self._requests[request_id]
        del self._order[request_id]
        return req

    def abort_request(self, request_id: str) -> Optional[Request]:
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    # ---- schedule -------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        budget = self.cfg.max_num_batched_tokens
        step = _Step(budget=budget, prefill_budget=budget)
        RUNNING = RequestStatus.RUNNING
        for req in list(self.running):  # 1. decodes
            if step.budget <= 0:
                break
            if req.status is not RUNNING or req.num_tokens - req.num_computed_tokens != 1:
                continue
            drafts = self._drafts_for(req, step.budget)
            self._schedule_running(req, 1 + len(drafts), drafts, True, step)
        cap = self.cfg.max_prefill_with_decodes
        if cap and self.cfg.enable_chunked_prefill and step.scheduled:
            step.prefill_budget = cap
        for req in list(self.running):  # 2. unfinished prefills (chunked)
            if min(step.budget, step.prefill_budget) <= 0:
                break
            if req.status is not RUNNING or req.request_id in step.scheduled:
                continue
            remaining = req.num_tokens - req.num_computed_tokens
            if remaining <= 1:
                continue  # a decode the budget had no room for
            n = self._chunk(remaining, min(step.budget, step.prefill_budget))
            if n:
                self._schedule_running(req, n, [], n == remaining, step)
                step.prefill_budget -= n
        if not step.preempted:  # 3. admission
            self._admit(step)
        return StepPlan(scheduled=list(step.scheduled.values()), preempted_ids=step.preempted,
                        load=self._load())

    def _load(self) -> int:
        """The requests running or waiting, at most max_num_seqs: the batch a queue can grow
        the decode steps to (StepPlan.load)."""
        return min(self.num_running + self.num_waiting, self.cfg.max_num_seqs)

    def _tokens_left(self, req: Request) -> int:
        """Tokens req may still emit: up to max_tokens and the end of its context."""
        left = self._max_len(req) - req.num_tokens
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None:
            left = min(left, max_tokens - len(req.output_token_ids))
        return left

    def drafts_after(self, req: Request, num_new: int, drafts: list) -> list:
        """drafts trimmed as _drafts_for will trim them once num_new more tokens of req are
        committed (a relaunched step's drafts, LLMEngine._relaunch: the budget holds them)."""
        left = self._tokens_left(req) - num_new
        return list(drafts[:left - 1]) if left > 1 else []

    def _drafts_for(self, req: Request, budget: int) -> list:
        """The request's drafts, trimmed so this step emits no token past its limits."""
        spec = req.spec_token_ids
        if not spec:
            return []
        k = min(len(spec), self._tokens_left(req) - 1, budget - 1)  # k drafts: <= k + 1 tokens
        return list(spec[:k]) if k > 0 else []

    def _draft_plane_mark(self, req: Request, s, out) -> int:
        """Keep req's draft-plane mark after its step s (out: the runner's output) and return
        it. The step's first pass wrote exact entries for its rows whose next token is
        committed, all of them below num_computed_tokens now, when it ran and started at or
        below the mark. When it did not (the drafter raised), req recomputes from the mark, so
        the next step's first pass rewrites the stale entries before any draft reads them.
        Once per mark: when that step's drafter raises too the request goes on with the
        entries above the mark stale (its drafts may suffer, never its output), or a drafter
        raising every step would recompute forever. A step that skipped req's draft work
        (draft length 0: out.draft_plane_skipped) keeps the mark and recomputes nothing: the
        runner asks for the repair (draft_plane_written False) when req drafts again."""
        mark = req.num_draft_exact_tokens
        if out is not None and out.draft_plane_skipped:
            pass  # drafts nothing: the repair waits until it drafts again (the runner asks it)
        elif (out is None or out.draft_plane_written) and s.num_computed_tokens <= mark:
            req.num_draft_exact_tokens = mark = req.num_computed_tokens
        elif req.num_computed_tokens > mark and req.draft_repair_mark != mark:
            req.draft_repair_mark = mark
            req.num_computed_tokens = mark
        return mark

    def counted_drafts(self, req: Request, num_draft: int, num_accepted: int) -> tuple:
        """(drafts, accepted) of a step as the statistics count them, asked before the step's
        tokens are appended. A chained step may verify drafts past max_tokens (see
        LLMEngine._chain; the tokens past it are dropped in _append); only the drafts that
        could have become output count, as many as _drafts_for would have left an unchained
        step, so the statistics don't depend on overlap."""
        usable = max(self._tokens_left(req) - 1, 0)
        if num_draft <= usable:
            return num_draft, num_accepted
        return usable, min(num_accepted, usable)

    def _chunk(self, remaining: int, budget: int) -> int:
        """Prefill tokens to schedule now; 0 means wait for a step with more room."""
        if remaining <= budget:
            return remaining
        if self.cfg.enable_chunked_prefill or remaining > self.cfg.max_num_batched_tokens:
            return budget  # (chunking off: a prefill longer than any step is chunked anyway)
        return 0

    def _schedule_running(self, req: Request, n: int, drafts: list, sample: bool,
                          step: _Step) -> None:
        lookahead = self.num_lookahead_tokens if sample else 0
        while not self.kv.allocate_slots(req, n, lookahead):
            victim = self.running[-1]
            if victim is req and len(self.running) == 1:
                # Alone and still too big: can't happen while max_len respects the pool;
                # end it rather than loop.
                self._finish_for_capacity(req)
                return
            self._preempt(victim, step)
            if victim is req:
                return
        self._add(req, n, drafts, sample, step)

    def _admit(self, step: _Step) -> None:
        while self.waiting and min(step.budget, step.prefill_budget) > 0 and \
                len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            cached = self.kv.get_computed_blocks(req)
            req.num_computed_tokens = cached
            req.num_draft_exact_tokens = cached  # a hit's draft entries are exact (the trim)
            remaining = req.num_tokens - cached
            n = self._chunk(remaining, min(step.budget, step.prefill_budget))
            sample = n == remaining
            lookahead = self.num_lookahead_tokens if sample else 0
            if n == 0 or not self.kv.allocate_slots(req, n, lookahead):
                self.kv.free(req)  # gives back the touched prefix blocks
                req.num_computed_tokens = 0
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            if req.status is RequestStatus.WAITING:  # first admission (not a resume)
                req.num_cached_tokens = cached
                req.scheduled_time = time.monotonic()
            req.status = RequestStatus.RUNNING
            order = self._order
            bisect.insort(self.running, req, key=lambda r: order[r.request_id])
            self._add(req, n, [], sample, step)
            step.prefill_budget -= n

    def _add(self, req: Request, n: int, drafts: list, sample: bool, step: _Step) -> None:
        step.scheduled[req.request_id] = ScheduledRequest(
            request=req, num_computed_tokens=req.num_computed_tokens, num_new_tokens=n,
            draft_token_ids=drafts, sample=sample)
        req.num_computed_tokens += n
        step.budget -= n

    def _preempt(self, req: Request, step: _Step) -> None:
        self.running.remove(req)
        self.kv.free(req)
        undone = step.scheduled.pop(req.request_id, None)  # scheduled earlier in this step
        if undone is not None:
            step.budget += undone.num_new_tokens
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = req.num_draft_exact_tokens = 0
        req.draft_repair_mark = -1
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        step.preempted.append(req.request_id)

    def _finish_for_capacity(self, req: Request) -> None:
        log.warning("request %s needs more KV blocks than the whole pool holds; ending it with "
                    "finish_reason 'length'", req.request_id)
        self.finish_request(req.request_id, RequestStatus.FINISHED_LENGTH)
        self._finished_pending.append(req)

    # ---- overlap: a step the device launched before its plan was made ----------------------
    def context_has_room(self, req: Request, num_tokens: int) -> bool:
        """Whether req's context holds num_tokens more tokens, with room to spare (a step
        launched ahead writes KV and rope positions for all of them)."""
        return self._max_len(req) - req.num_tokens > num_tokens

    def wants_more_than(self, req: Request, num_tokens: int) -> bool:
        """Whether req has more than num_tokens tokens left before max_tokens."""
        max_tokens = req.sampling_params.max_tokens
        return max_tokens is None or max_tokens - len(req.output_token_ids) > num_tokens

    def reserve_chained(self, requests: list, kd: int, kd_next: Optional[int] = None) -> bool:
        """Blocks, now, for the step a device will launch after the one just scheduled, whose
        outcome isn't known yet: for every request of `requests` or for none (a chain given up
        must not leave some of them holding blocks early, which could preempt another request
        an unchained engine would have kept). Worst case every draft of this step (kd) is
        accepted: the next one then holds 1 + kd tokens past these, its draft loop (kd_next
        steps; default kd) writes up to kd_next - 1 further, and schedule_chained asks for our
        usual lookahead past its tokens."""
        kd_next = kd if kd_next is None else kd_next
        ahead = 1 + kd + max(kd_next, self.num_lookahead_tokens)
        kv = self.kv
        # Counting every request's missing blocks first costs a loop over the batch; skip it
        # when the pool holds the most each reservation can add (the common case)
        if kv.num_free_blocks < len(requests) * (-(-ahead // kv.block_size) + 1) \
                and not kv.can_allocate_all(requests, 0, ahead):
            return False
        for req in requests:
            if not kv.allocate_slots(req, 0, ahead):  # pragma: no cover - checked above
                raise RuntimeError(f"blocks for {req.request_id}'s chained step vanished")
        return True

    def schedule_chained(self, prev: StepPlan) -> StepPlan:
        """The plan of the step the device launched from prev's outputs (LLMEngine.step), made
        after prev's update: every request of prev still running decodes its last token and
        its drafts, in prev's order; nobody is admitted. Its blocks were reserved at launch."""
        step = _Step(budget=self.cfg.max_num_batched_tokens, prefill_budget=0)
        requests, running = self._requests, RequestStatus.RUNNING
        allocate, lookahead, add = self.kv.allocate_slots, self.num_lookahead_tokens, self._add
        for s in prev.scheduled:
            req = s.request
            if requests.get(req.request_id) is not req or req.status is not running:
                continue  # finished or aborted meanwhile: its device row is dropped
            drafts = list(req.spec_token_ids)
            if not allocate(req, 1 + len(drafts), lookahead):
                raise RuntimeError(f"the blocks reserved for {req.request_id}'s chained step "
                                   f"are missing")
            add(req, 1 + len(drafts), drafts, True, step)
        return StepPlan(scheduled=list(step.scheduled.values()), preempted_ids=[],
                        load=self._load())

    # ---- update ---------------------------------------------------------------------------
    def update(self, plan: StepPlan, result: StepResult,
               totals: Optional[SpecStats] = None) -> list:
        """Commit one step's results; returns the requests that got tokens or finished. Each
        request's verified drafts are recorded in its spec_stats (as counted_drafts counts
        them) and in `totals` (the engine's), where an ended request's count too."""
        progressed, self._finished_pending = self._finished_pending, []
        # Local names: at batch 128 this loop is on the host's critical path every step.
        requests, outputs, running = self._requests, result.outputs, RequestStatus.RUNNING
        cache = self.kv.cache_committed if self.kv.enable_caching else None
        for s in plan.scheduled:
            req = s.request
            rid = req.request_id
            out = outputs.get(rid)
            if requests.get(rid) is not req or req.status is not running:
                # aborted or finished (stop string) since schedule(): nothing is committed
                if totals is not None and out is not None and out.num_draft_tokens:
                    totals.record(*self.counted_drafts(req, out.num_draft_tokens,
                                                       out.num_accepted_tokens))
                continue
            tokens = out.token_ids if out is not None else []
            num_draft = len(s.draft_token_ids)
            num_accepted = out.num_accepted_tokens if out is not None else 0
            expected = num_accepted + 1 if s.sample else 0
            if not 0 <= num_accepted <= num_draft or len(tokens) != expected:
                raise RuntimeError(
                    f"runner output for {rid} is inconsistent: {len(tokens)} tokens, "
                    f"{num_accepted} of {num_draft} drafts accepted, sample={s.sample}")
            if num_draft:
                req.num_computed_tokens -= num_draft - num_accepted  # rejected drafts' KV
                counted = self.counted_drafts(req, num_draft, num_accepted)
                req.spec_stats.record(*counted)
                if totals is not None:
                    totals.record(*counted)
            if tokens:
                self._append(req, tokens, out.logprobs)
            mark = self._draft_plane_mark(req, s, out) if self.draft_plane \
                else req.num_computed_tokens
            if cache is not None:
                # Tokens after a stop token were dropped: cache only what is still the sequence,
                # and no block whose draft entries are not exact.
                cache(req, min(req.num_computed_tokens, req.num_tokens, mark))
            if req.status is not running:  # _append ended it
                self.running.remove(req)
                self.kv.free(req)
                req.spec_token_ids = []
                del requests[rid]
                del self._order[rid]
                progressed.append(req)
            else:
                req.spec_token_ids = list(out.next_draft_token_ids) if out is not None else []
                if tokens:
                    progressed.append(req)
        return progressed

    def _append(self, req: Request, tokens: list, logprobs: Optional[list]) -> None:
        """Append tokens one by one, stopping at the first that ends the request (a stop token,
        EOS, max_tokens or the end of the context, checked in that order)."""
        sp = req.sampling_params
        out = req.output_token_ids
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        stop_ids = req.stop_id_set
        eos = () if sp.ignore_eos else req.eos_token_ids
        max_tokens = sp.max_tokens
        # the output length at which the context is full
        out_cap = self._max_len(req) - len(req.prompt_token_ids)
        n = len(out)
        for i, t in enumerate(tokens):
            out.append(t)
            n += 1
            if logprobs is not None and i < len(logprobs):
                req.output_logprobs.append(logprobs[i])
            if t in stop_ids:
                req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, t
            elif t in eos:
                req.status = RequestStatus.FINISHED_STOPPED  # stop_reason None: EOS (as vLLM)
            elif (max_tokens is not None and n >= max_tokens) or n >= out_cap:
                req.status = RequestStatus.FINISHED_LENGTH
            else:
                continue
            return
