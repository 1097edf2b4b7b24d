"""The synchronous engine: add_request / step / abort_request, with incremental detokenization.

    add_request -> Scheduler.waiting
    step():  Scheduler.schedule() -> StepPlan -> ModelRunner.execute() -> StepResult
             -> Scheduler.update() -> detokenize, stop strings -> RequestOutput list
"""

from __future__ import annotations

import logging
import time
from typing import Optional, Union

from outpace.engine.detokenize import IncrementalDetokenizer
from outpace.errors import InvalidRequestError
from outpace.types import (CompletionOutput, Request, RequestOutput, RequestStatus,
                           SamplingParams, SpecStats)

log = logging.getLogger(__name__)


def check_text_length(tokenizer, max_model_len: int, text: str) -> None:
    """InvalidRequestError for a text that holds a context's worth of tokens by its length
    alone (Tokenizer.fewest_tokens): O(1), before anything tokenizes it."""
    n = tokenizer.fewest_tokens(text)
    if n >= max_model_len:
        raise InvalidRequestError(
            f"the prompt has {len(text)} characters, so at least {n} tokens, but the context "
            f"is {max_model_len} tokens (prompt and output together); shorten the prompt",
            option="max_model_len")


class LLMEngine:
    def __init__(self, config, tokenizer, scheduler, kv_manager, runner, model_name: str):
        self.config = config
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.kv = kv_manager
        self.runner = runner
        self.model_name = model_name
        self.max_model_len = config.max_model_len
        self.vocab_size = config.model_config.vocab_size
        self._requests: dict = {}  # request_id -> Request (unfinished)
        self._detok: dict = {}  # request_id -> IncrementalDetokenizer
        self._emitted: dict = {}  # request_id -> output tokens already fed to the detokenizer
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.spec_stats = SpecStats()
        self.num_preemptions_total = 0
        self.num_draft_failures_total = 0  # drafter calls that raised (the runner logs them)
        self.overlap = config.runner.overlap
        self._inflight = None  # (plan, launched step) read by the next step() call

    @classmethod
    def from_args(cls, model: str, **kwargs) -> "LLMEngine":
        """An engine from keyword arguments: EngineArgs' fields (an unknown one is an error)."""
        from outpace.engine.args import EngineArgs
        return cls.from_engine_args(EngineArgs.from_kwargs(model, **kwargs))

    @classmethod
    def from_engine_args(cls, args) -> "LLMEngine":
        from outpace.engine.builder import build_engine
        return build_engine(cls, args)

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Union[str, list],
                    params: Optional[SamplingParams] = None) -> None:
        params = params or SamplingParams()
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            text = prompt
            self.check_text_length(prompt)
            ids = self.tokenizer.encode(prompt)
        else:
            text = None
            ids = list(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size
                       for t in ids):
                raise InvalidRequestError(
                    f"prompt token ids must be integers in 0..{self.vocab_size - 1}")
        if not ids:
            raise InvalidRequestError("the prompt is empty; give at least one token")
        n = len(ids)
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {n} tokens but the context is {self.max_model_len} tokens "
                f"(prompt and output together); shorten the prompt or raise max_model_len",
                option="max_model_len")
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"this model's context is {self.max_model_len} tokens, but {n + params.max_tokens}"
                f" were asked for ({n} in the prompt, {params.max_tokens} for the output); "
                f"lower max_tokens or shorten the prompt", option="max_tokens")
        eos = () if params.ignore_eos else tuple(self.tokenizer.eos_token_ids)
        req = Request(request_id=request_id, prompt_token_ids=ids, sampling_params=params,
                      eos_token_ids=eos, max_model_len=self.max_model_len, prompt=text)
        self.scheduler.add_request(req)  # may raise QueueFullError: nothing recorded yet
        self.runner.step_clock.interrupt()  # the engine may have idled before this request
        self._requests[request_id] = req
        self._detok[request_id] = IncrementalDetokenizer(
            self.tokenizer, ids, params.skip_special_tokens, params.stop,
            params.include_stop_str_in_output) if params.detokenize else None
        self._emitted[request_id] = 0
        self.runner.begin_request(req)

    def check_text_length(self, text: str) -> None:
        """Refuse a text prompt that holds a context's worth of tokens by its length alone
        (Tokenizer.fewest_tokens), before it is tokenized: O(1), and safe from any thread (it
        reads nothing that changes), so the server calls it before the engine thread sees the
        request."""
        check_text_length(self.tokenizer, self.max_model_len, text)

    def abort_request(self, request_id: str) -> None:
        if request_id not in self._requests:
            return
        self.runner.step_clock.interrupt()  # the engine may idle before its next step
        self.scheduler.abort_request(request_id)
        self._forget(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list:
        """One step's outputs. With overlap, a greedy decode step N is launched on the device,
        step N+1 is launched from N's outputs there (when its shape is known without them:
        `_chain`), and only then are N's outputs read and committed, while N+1 runs; the next
        call continues from N+1. Outputs are the same as without overlap (tested)."""
        if self._inflight is not None:
            plan, launched = self._inflight
            self._inflight = None
        else:
            plan = self.scheduler.schedule()
            self.num_preemptions_total += len(plan.preempted_ids)
            if plan.is_empty:
                return []
            for sr in plan.scheduled:
                sr.block_ids = self.kv.block_ids(sr.request.request_id)
            if not (self.overlap and self.runner.can_launch(plan)):
                return self._commit(plan, self.runner.execute(plan))
            launched = self.runner.launch(plan)
        following = self._chain(plan, launched)
        result = self.runner.collect(launched, plan)
        if following is None:
            following = self._relaunch(plan, launched, result)
        outputs = self._commit(plan, result)
        if following is not None:
            # (its block_ids stay unset: the device launched it, no batch is built from it)
            nxt = self.scheduler.schedule_chained(plan)
            # a relaunched step's staged drafts, or a step chained after the device n-gram's
            # (its own count a row); else every row verifies q - 1
            drafts = following.drafts if following.drafts is not None else launched.next_drafts
            row_of = ({rid: i for i, rid in enumerate(following.rows)} if drafts is not None
                      else None)
            for sr in nxt.scheduled:
                rid = sr.request.request_id
                # a chained step verifies q - 1 drafts a row (the graph before it drafted them)
                want = following.key[1] - 1 if drafts is None else drafts[row_of[rid]]
                if len(sr.draft_token_ids) != want:  # the preconditions make it equal
                    raise RuntimeError(f"chained step of {rid}: {len(sr.draft_token_ids)} "
                                       f"drafts on the host, {want} on the device")
            if nxt.scheduled:
                self._inflight = (nxt, following)
            else:  # everyone finished: drain it (its outputs belong to nobody)
                self.runner.collect(following, nxt)
        return outputs

    def _chain(self, plan, launched):
        """Launch the step after `launched` from its device outputs, or None when its shape
        isn't known without them or it would serve nobody: a request waits to be admitted,
        a request may reach the end of its context (its drafts would be trimmed), every
        request may reach max_tokens in `launched`, the draft length may change (adaptive k,
        another batch size, the cost model's choice of several lengths: StepDraftLengths.chained_kd,
        which also gives the chained step's own draft-loop length), or its blocks can't be
        reserved ahead.

        A request that may reach max_tokens in the next step doesn't stop the chain: that
        step verifies all its drafts, and the tokens past max_tokens are dropped when they
        are committed (Scheduler._append; the statistics count only the drafts that could
        have become output, Scheduler.counted_drafts). The output is the same, and the last
        steps of every request don't wait for the host, which would make each of them take
        about twice a chained step (docs/decisions.md, "Steps chain up to max_tokens")."""
        sched = self.scheduler
        fused = self.runner.fused
        if sched.num_waiting or not (fused.chainable or fused.relaunchable):
            return None  # (a host drafter's steps chain only when they draft nothing)
        kd = launched.kd
        if len(launched.rows) * (kd + 1) > self.config.scheduler.max_num_batched_tokens:
            return None
        needed = False
        alive, has_room, wants = self._requests, sched.context_has_room, sched.wants_more_than
        for sr in plan.scheduled:
            req = sr.request
            d = len(sr.draft_token_ids)
            # N emits up to d + 1 tokens, N+1 up to kd + 1; one more keeps N+1's drafts whole
            if req.request_id not in alive or not has_room(req, d + kd + 3):
                return None
            needed = needed or wants(req, d + 1)  # left after N's tokens
        if not needed:
            return None
        kd_next = self.runner.chained_kd(launched, plan)
        if kd_next is None:
            return None
        if not sched.reserve_chained([sr.request for sr in plan.scheduled], kd, kd_next):
            return None
        table = self.kv.block_table  # read before anything changes them (ChainedTables)
        return self.runner.chain(launched, [table(rid) for rid in launched.rows], kd_next)

    def _relaunch(self, plan, launched, result):
        """A host drafter's next step (or a head's with the suffix enhancer), launched from
        `launched`'s carry on the device with the drafts `result` proposes
        (FusedStep.relaunch), before `result` is committed; or None under _chain's conditions,
        which here know each request's tokens: a request waits, may reach the end of its
        context, nobody wants more tokens, or blocks can't be reserved. The drafts are trimmed
        as the scheduler would plan them after the commit (Scheduler.drafts_after), so the
        step is the one an unchained engine would run."""
        sched, fused = self.scheduler, self.runner.fused
        if not fused.relaunchable or sched.num_waiting:
            return None
        if result.num_draft_failures and self.runner.proposer.num_kv_layers:
            return None  # a head's failure: the scheduler plans its plane's repair first
        drafts = {}
        needed = False
        kd = launched.kd  # the relaunched step's own draft loop (a host drafter's: 0)
        for sr in plan.scheduled:
            req = sr.request
            out = result.outputs.get(req.request_id)
            if req.request_id not in self._requests or out is None:
                return None
            n = len(out.token_ids)
            # the drafts the scheduler would plan after this commit (none past max_tokens)
            d = sched.drafts_after(req, n, out.next_draft_token_ids or [])
            # (a head's relaunched graph drafts kd more: the enhancer's)
            if not sched.context_has_room(req, n + len(d) + 2 + kd):
                return None
            needed = needed or sched.wants_more_than(req, n)
            drafts[req.request_id] = d
        q = fused.relaunch_q(max(len(d) for d in drafts.values()))
        if not needed or q is None or \
                len(launched.rows) * q > self.config.scheduler.max_num_batched_tokens:
            return None
        if not sched.reserve_chained([sr.request for sr in plan.scheduled], q - 1,
                                     max(q - 1, kd)):
            return None
        for rid, d in drafts.items():  # the commit makes them the requests' next drafts
            result.outputs[rid].next_draft_token_ids = d
        return self.runner.relaunch(launched, [drafts.get(rid, []) for rid in launched.rows],
                                    [self.kv.block_table(rid) for rid in launched.rows])

    def _commit(self, plan, result) -> list:
        self.num_draft_failures_total += result.num_draft_failures
        progressed = self.scheduler.update(plan, result, totals=self.spec_stats)
        outs = (self._output_of(req) for req in progressed if req.request_id in self._requests)
        return [out for out in outs if out is not None]

    def _output_of(self, req: Request) -> Optional[RequestOutput]:
        rid = req.request_id
        detok = self._detok[rid]
        done = self._emitted[rid]
        ids = req.output_token_ids
        if done == 0 and ids:
            self.prompt_tokens_total += req.num_prompt_tokens
        # without a detokenizer (detokenize=False) the tokens are only counted
        add_token = detok.add_token if detok is not None else None
        for i in range(done, len(ids) if add_token is not None else done):
            stop = add_token(ids[i])
            if stop is not None:
                # Everything after the token that completed the stop string is dropped.
                del ids[i + 1:]
                del req.output_logprobs[i + 1:]
                if not req.is_finished:
                    self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED, stop)
                else:
                    req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop
                break
        self.generation_tokens_total += len(ids) - done
        self._emitted[rid] = len(ids)
        finished = req.is_finished
        if not finished and req.sampling_params.output_kind == "final_only":
            return None  # detokenized (stop strings) and counted; nobody reads this output
        lps = None
        if req.sampling_params.logprobs is not None:
            lps = [{**top, tok: lp} for tok, (lp, top) in
                   zip(req.output_token_ids, req.output_logprobs)]
        completion = CompletionOutput(
            text=detok.visible_text(finished) if detok is not None else "",
            token_ids=list(req.output_token_ids),
            finish_reason=req.finish_reason, stop_reason=req.stop_reason, logprobs=lps)
        out = RequestOutput(
            request_id=rid, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            outputs=[completion], finished=finished, num_cached_tokens=req.num_cached_tokens,
            spec_stats=req.spec_stats,
            metrics={"arrival_time": req.arrival_time, "scheduled_time": req.scheduled_time,
                     "first_token_time": req.first_token_time,
                     "num_preemptions": req.num_preemptions})
        if finished:
            out.metrics["finished_time"] = time.monotonic()
            self._forget(rid)
        return out

    def _forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._detok.pop(request_id, None)
        self._emitted.pop(request_id, None)
        self.runner.release(request_id)

    # ---- start-up ---------------------------------------------------------------------------
    def warm_up(self) -> None:
        """Run throwaway prefills of a few lengths so that the GPU kernels they use are compiled
        now, not inside a user's first requests: Triton compiles a kernel per query-length class
        (tile shape, and lengths that are 1 or a multiple of 16), a few hundred ms each the
        first time. Counters are reset afterwards; no request or block is left behind."""
        from outpace.kvcache.prefix_cache import PrefixCacheStats
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        for n in (1, 2, 3, 5, 9, 16, 17, 33):
            if n + 1 >= self.max_model_len:
                break
            rid = f"__warm_up_{n}"
            # distinct first tokens: no prefix-cache hit shortens the prefill
            self.add_request(rid, [(n + i) % self.vocab_size for i in range(n)], params)
            while rid in self._requests:
                self.step()
        self.prompt_tokens_total = self.generation_tokens_total = 0
        self.num_preemptions_total = self.num_draft_failures_total = 0
        self.spec_stats = SpecStats()
        self.kv.stats = PrefixCacheStats()

    def measure_step_times(self) -> None:
        """Give the draft-length cost model (`"adaptive": "cost"`) the step times of this
        engine's steps, measured now (runner/step_timing.py: graph replays, or a few eager
        forwards); nothing without it. Run at start-up, and again by whoever changes how steps
        run (capturing graphs later)."""
        proposer = self.runner.proposer
        if proposer is None or proposer.policy.cost_model is None:
            return
        proposer.policy.set_step_times(self.runner.measure_step_times(proposer.policy.k))

    def shutdown(self) -> None:
        """Stop what the engine started beside this process (tensor-parallel ranks); the engine
        computes nothing after it. Idempotent; also done when the engine is collected."""
        self.runner.shutdown()

    # ---- introspection --------------------------------------------------------------------
    def stats(self) -> dict:
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "kv_blocks_used": self.kv.num_used_blocks,
            "kv_blocks_total": self.kv.num_blocks,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "num_preemptions_total": self.num_preemptions_total,
            "num_draft_failures_total": self.num_draft_failures_total,
            "spec": self.spec_stats.as_dict(),
        }
