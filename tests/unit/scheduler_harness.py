"""Shared harness of the scheduler tests: a toy model, a fake runner over a token-level KV pool.

The fake runner keeps a token-level copy of the paged KV pool (slot -> (position, token)),
writes every scheduled token through the request's block table and feeds its toy model only
what it reads back from that pool. A lost, stale or wrongly shared block therefore changes the
output, which the tests compare with a plain per-request reference.
"""

import random

import pytest

from outpace.config import CacheConfig, SchedulerConfig
from outpace.kvcache.manager import KVCacheManager
from outpace.scheduler.scheduler import Scheduler
from outpace.types import (Request, RequestStepOutput, SamplingParams, StepPlan, StepResult)

BS = 4
EOS = 7


def model_next(ctx) -> int:
    """Toy deterministic 'model': the next token is a function of the whole context."""
    h = len(ctx)
    for t in ctx:
        h = (h * 31 + t) % 1000003
    return 5 + h % 45


def reference(prompt, sp: SamplingParams, eos=(EOS,), max_len=1 << 30) -> list:
    seq, out = list(prompt), []
    while True:
        t = model_next(seq)
        seq.append(t)
        out.append(t)
        if t in sp.stop_token_ids or (not sp.ignore_eos and t in eos):
            return out
        if sp.max_tokens is not None and len(out) >= sp.max_tokens:
            return out
        if len(seq) >= max_len:
            return out


class FakeRunner:
    def __init__(self, sched: Scheduler, spec_k: int = 0, accuracy: float = 0.7, seed: int = 0):
        self.sched, self.kv = sched, sched.kv
        self.slots = {}  # slot -> (position, token)
        self.spec_k, self.accuracy = spec_k, accuracy
        self.rng = random.Random(seed)

    def _read(self, table, p):
        pos, tok = self.slots[table[p // BS] * BS + p % BS]
        assert pos == p, f"slot of position {p} holds position {pos}"
        return tok

    def execute(self, plan: StepPlan) -> StepResult:
        res = StepResult()
        for s in plan.scheduled:
            r, rid = s.request, s.request.request_id
            table = self.kv.block_ids(rid)
            seq = r.all_token_ids + s.draft_token_ids
            c, n, nd = s.num_computed_tokens, s.num_new_tokens, len(s.draft_token_ids)
            assert r.num_computed_tokens == c + n
            assert c + n == (len(seq) if s.sample else c + n) and c + n <= len(seq)
            if s.sample:  # lookahead for draft KV is reserved before the step runs
                look = self.sched.num_lookahead_tokens
                need = min(c + n + look, max(c + n, self.kv.max_model_len))
                assert len(table) * BS >= need
            for p in range(c, c + n):
                b = table[p // BS]
                assert b != 0, "wrote into the null block"
                assert self.kv.pool.block_hash(b) is None, "overwrote a findable cached block"
                self.slots[b * BS + p % BS] = (p, seq[p])
            if not s.sample:
                res.outputs[rid] = RequestStepOutput(token_ids=[])
                continue
            ctx = [self._read(table, p) for p in range(c + n)]
            assert ctx == seq[:c + n]
            base = c + n - nd  # context before the first draft
            emitted = []
            for i in range(nd + 1):
                t = model_next(ctx[:base + i])
                emitted.append(t)
                if i < nd and s.draft_token_ids[i] != t:
                    break
            committed = seq[:base] + emitted
            res.outputs[rid] = RequestStepOutput(
                token_ids=emitted, logprobs=[(-0.5, {}) for _ in emitted], num_draft_tokens=nd,
                num_accepted_tokens=len(emitted) - 1, next_draft_token_ids=self._propose(committed))
        return res

    def _propose(self, committed):
        drafts, seq = [], list(committed)
        for _ in range(self.spec_k):
            t = model_next(seq)
            if self.rng.random() > self.accuracy:
                t = 5 + (t - 5 + 1 + self.rng.randrange(40)) % 45  # a wrong guess
            drafts.append(t)
            seq.append(t)
        return drafts


def make(num_blocks=64, budget=32, max_num_seqs=8, lookahead=0, max_model_len=256,
         chunked=True, caching=True, max_waiting=None, prefill_with_decodes=0):
    kv = KVCacheManager(CacheConfig(block_size=BS, enable_prefix_caching=caching), num_blocks,
                        max_model_len)
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                          enable_chunked_prefill=chunked, max_waiting_requests=max_waiting,
                          max_prefill_with_decodes=prefill_with_decodes)
    return Scheduler(cfg, kv, max_model_len, num_lookahead_tokens=lookahead, block_size=BS)


@pytest.fixture
def track():
    """Every scheduler a test builds must end with an empty queue and an all-free pool."""
    made = []

    def factory(**kw):
        s = make(**kw)
        made.append(s)
        return s
    yield factory
    for s in made:
        assert not s.has_unfinished()
        assert s.kv.num_free_blocks == s.kv.num_blocks and s.kv.num_used_blocks == 0


def planned(plan) -> list:
    """[(request id, tokens scheduled)] of a plan, in its order."""
    return [(s.request.request_id, s.num_new_tokens) for s in plan.scheduled]


def new_req(rid, prompt, **sp):
    sp.setdefault("max_tokens", 8)
    return Request(request_id=rid, prompt_token_ids=list(prompt),
                   sampling_params=SamplingParams(**sp), eos_token_ids=(EOS,))


def drive(sched, runner, max_steps=2000, check=None):
    done, steps = {}, 0
    while sched.has_unfinished():
        plan = sched.schedule()
        assert not plan.is_empty, "scheduler stalled with unfinished requests"
        assert plan.num_tokens <= sched.cfg.max_num_batched_tokens
        assert sched.num_running <= sched.cfg.max_num_seqs
        if check:
            check(plan)
        for r in sched.update(plan, runner.execute(plan)):
            if r.is_finished:
                done[r.request_id] = r
        steps += 1
        assert steps < max_steps
    return done


def prompt_of(rng, n, shared=()):
    return list(shared) + [rng.randrange(8, 50) for _ in range(n - len(shared))]


class StubResult:
    """Build a StepResult by hand for one scheduled request."""

    @staticmethod
    def of(plan, tokens, accepted=0, drafts_next=()):
        return StubResult.each(plan, (tokens, accepted, drafts_next))

    @staticmethod
    def each(plan, *per_request):
        """Per scheduled request, in order: (tokens, accepted, drafts_next)."""
        return StepResult(outputs={s.request.request_id: RequestStepOutput(
            token_ids=list(toks), num_draft_tokens=len(s.draft_token_ids),
            num_accepted_tokens=acc, next_draft_token_ids=list(nxt))
            for s, (toks, acc, nxt) in zip(plan.scheduled, per_request)})


