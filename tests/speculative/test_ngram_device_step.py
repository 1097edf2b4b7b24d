"""The n-gram lookup inside the fused graphs (`"ngram_device": true`, runner/fused_ngram.py) on
CPU, with the rerun_capture stand-in, over several waves of requests (padding to buckets,
chunked prefill, prefix hits, preemption):

* outputs equal no speculation's, and the host n-gram drafter's (eager and fused, relaunched):
  the same drafts every step (but a request's last, which nothing verifies), the same
  acceptance counts;
* with overlap the steps chain (launched from the previous step's carry before the host reads
  it), none is relaunched; the blocks each step writes are the ones reserved for it;
* the device history equals every request's committed tokens after each fill and each step,
  and a fill uploads only the tokens no row holds (`HistoryCheck`; the rows' bookkeeping
  alone in `test_fill_*`);
* the option's errors.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from outpace.errors import ConfigError
from outpace.runner.fused_ngram import StepNgram
from outpace.runner.graph_mode import GraphMode
from outpace.speculative.ngram import NgramDrafter
from outpace.speculative_config import SpecConfig
from outpace.types import Request, SamplingParams
from tests.speculative.spec_helpers import run_waves
from tests.speculative.test_draft_plane import waves
from tests.speculative.test_fused_step import GREEDY, SMALL, enable_graphs, record_drafts


def ngram(k: int, device: bool, **opts) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "ngram_device": device, **opts}


def verified(record: list) -> list:
    """record_drafts' steps without each request's last proposal, which no step verifies: a
    chained step verifies every draft past max_tokens (LLMEngine._chain), so the tokens its
    last step emits, and the drafts proposed from them, may differ from a host-scheduled one's,
    whose drafts the scheduler trims; the output and the counted drafts do not."""
    last = {rid: i for i, step in enumerate(record) for rid in step}
    return [{rid: d for rid, d in step.items() if last[rid] != i}
            for i, step in enumerate(record)]


def check_against_lookup(engine, min_n: int, max_n: int, seen: list) -> None:
    """Wrap the runner's collect: every fused step's next drafts are NgramDrafter.propose's
    over the request's committed tokens after the step (its draft-loop length kd, never past
    the context). seen: one entry a request and step checked, its drafts."""
    runner, lookup = engine.runner, NgramDrafter(min_n, max_n)
    inner = runner.collect

    def collect(launched, plan):
        result = inner(launched, plan)
        for sr in plan.scheduled:
            out = result.outputs[sr.request.request_id]
            tokens = sr.request.all_token_ids + out.token_ids
            room = sr.request.max_model_len - len(tokens) - 1
            want = lookup.propose(tokens, max(0, min(launched.kd, room)))
            assert (out.next_draft_token_ids or []) == want, (sr.request.request_id, tokens)
            seen.append(want)
        return result
    runner.collect = collect


class HistoryCheck:
    """Wraps a device n-gram engine's fill and collect (on_engine, after the graphs exist):

    * after each fill, row i holds request i's committed tokens (its `lengths` entry and its
      history);
    * after each step is collected, each row's history holds its request's tokens after the
      step (committed plus emitted), and the host's count of them (`held_len`) is theirs: the
      device's own length, where no later step already ran (`exact`), else at most it;
    * the tokens a fill uploads lie between what a model of the rows allows (`lower`,
      `upper`): a request in the previous fill's batch lacks the tokens committed since that
      the graphs did not append; one seen before, unpreempted, but not in it, at most its
      whole text (its row may have been given away); one new or preempted since, its whole
      text. `naive`: the tokens a fill of every row's whole text would upload."""

    def __init__(self, engine, exact: bool):
        self.fused = engine.runner.fused
        self.ngram = ng = self.fused.ngram
        self.exact = exact
        self.lower = self.upper = self.naive = 0
        self.fills = self.steps = 0
        self.state = {}  # rid -> [tokens the device had at its last fill plus emitted since,
        #                          its num_preemptions then]
        self.prev = set()  # the requests of the last fill
        inner_fill, inner_collect = ng.fill, self.fused.collect

        def fill(plan, bucket):
            self._expect(plan)
            inner_fill(plan, bucket)
            self._check_fill(plan)

        def collect(launched, plan):
            result = inner_collect(launched, plan)
            self._check_collect(launched, plan, result)
            return result
        ng.fill, self.fused.collect = fill, collect

    def _expect(self, plan):
        width = self.ngram.width
        for sr in plan.scheduled:
            req = sr.request
            n = min(req.num_tokens, width)
            had = self.state.get(req.request_id)
            self.naive += n
            if had is None or had[1] != req.num_preemptions:
                self.lower += n
                self.upper += n
            else:
                lack = n - min(had[0], n)
                self.lower += lack
                self.upper += lack if req.request_id in self.prev else n
            self.state[req.request_id] = [n, req.num_preemptions]
        self.prev = {sr.request.request_id for sr in plan.scheduled}

    def _check_fill(self, plan):
        ng = self.ngram
        self.fills += 1
        for i, sr in enumerate(plan.scheduled):
            tokens = sr.request.all_token_ids[:ng.width]
            assert int(ng.lengths[i]) == len(tokens) == ng.held_len[i]
            assert ng.history[i, :len(tokens)].tolist() == tokens, sr.request.request_id

    def _check_collect(self, launched, plan, result):
        if launched.prefill:
            return
        ng, q = self.ngram, launched.key[1]
        self.steps += 1
        emitted = (launched.host.numpy()[:, :q] >= 0).sum(axis=1)
        by_id = {sr.request.request_id: sr.request for sr in plan.scheduled}
        for i, rid in enumerate(launched.rows):
            if rid in self.state:
                self.state[rid][0] += int(emitted[i])
            req = by_id.get(rid)
            if req is None:  # ended in an earlier step of the chain
                continue
            tokens = (req.all_token_ids + result.outputs[rid].token_ids)[:ng.width]
            assert ng.held_len[i] == len(tokens), (rid, ng.held_len[i], len(tokens))
            assert ng.history[i, :len(tokens)].tolist() == tokens, rid
            device_len = int(ng.lengths[i])
            assert device_len == len(tokens) if self.exact else device_len >= len(tokens)

    def check_uploads(self, exact: bool):
        """The fills uploaded what the model allows (exactly its count: `exact`, where no row
        is given away while its request runs), and far less than whole texts."""
        got = self.ngram.uploaded_tokens
        assert self.fills >= 3 and self.steps >= self.fills
        assert self.lower <= got <= self.upper, (self.lower, got, self.upper)
        if exact:
            assert got == self.lower == self.upper
        assert got < self.naive if self.fills < 10 else got * 3 < self.naive, (got, self.naive)


CASES = [(3, {}), (2, {"prompt_lookup_min": 2}), (3, {"k_schedule": [[2, 3]]})]
IDS = ["k3", "k2-min2", "k3-schedule"]


@pytest.mark.parametrize("k,opts", CASES, ids=IDS)
def test_device_ngram_chains_with_preemption(tiny_loaded, k, opts):
    """A small pool: requests are preempted (with overlap one step earlier than on the host's
    schedule, so the steps differ); each step's drafts are the lookup's, the output and the
    counted drafts the host drafter's. (Under a k_schedule a chained graph's draft length
    follows the batch size its predecessor was launched with, as a head's does, where the host
    drafter asks at collect: a step after a request ends may draft less, so the counts differ
    there.)"""
    plain = run_waves(tiny_loaded, waves(), GREEDY, **SMALL)
    host = run_waves(tiny_loaded, waves(), GREEDY, speculative_config=ngram(k, False, **opts),
                     **SMALL)
    seen, checks = [], []
    spec = ngram(k, True, check_fused_writes=True, **opts)

    def on_engine(engine):
        enable_graphs(engine, k)
        check_against_lookup(engine, spec.get("prompt_lookup_min", 1), 4, seen)
        checks.append(HistoryCheck(engine, exact=False))
    device = run_waves(tiny_loaded, waves(), GREEDY, overlap=True, speculative_config=spec,
                       on_engine=on_engine, **SMALL)
    assert device.outputs == plain.outputs == host.outputs
    if "k_schedule" not in opts:
        assert device.stats["spec"] == host.stats["spec"]
    assert device.stats["spec"]["num_accepted_tokens"] > 10
    assert len(seen) > 50 and sum(map(bool, seen)) > 15
    fused = device.engine.runner.fused
    assert fused.ngram is not None and fused.host_drafter is None
    assert fused.replays > 20
    assert fused.chained > 10, "no step was launched from its predecessor's carry"
    assert fused.relaunched == 0
    assert device.stats["num_preemptions_total"] > 0
    assert device.engine.kv.prefix_cache_hit_tokens > 0
    if "k_schedule" in opts:  # drafting went off and came back
        assert {key[2] for key in fused.table.greedy} == {0, k}
    checks[0].check_uploads(exact=False)


@pytest.mark.parametrize("k,opts", CASES[:2], ids=IDS[:2])
def test_device_ngram_equals_host_ngram_step_by_step(tiny_loaded, k,
                                                     opts):
    """A pool that preempts nobody: the same steps as the host drafter's, eager or relaunched,
    with the same drafts in each."""
    roomy = dict(SMALL, num_kv_blocks=120)
    want_drafts, got_drafts, relaunch_drafts = [], [], []
    host = run_waves(tiny_loaded, waves(), GREEDY, speculative_config=ngram(k, False, **opts),
                     on_engine=lambda e: record_drafts(e, want_drafts), **roomy)
    relaunched = run_waves(tiny_loaded, waves(), GREEDY, overlap=True,
                           speculative_config=ngram(k, False, **opts),
                           on_engine=lambda e: record_drafts(e, relaunch_drafts, graphs_k=k),
                           **roomy)
    checks = []

    def on_engine(engine):
        record_drafts(engine, got_drafts, graphs_k=k)
        checks.append(HistoryCheck(engine, exact=False))
    device = run_waves(tiny_loaded, waves(), GREEDY, overlap=True,
                       speculative_config=ngram(k, True, **opts), on_engine=on_engine, **roomy)
    assert device.outputs == host.outputs == relaunched.outputs
    assert device.stats["spec"] == host.stats["spec"] == relaunched.stats["spec"]
    assert device.stats["num_preemptions_total"] == 0
    assert relaunch_drafts == want_drafts
    assert verified(got_drafts) == verified(want_drafts)
    assert device.engine.runner.fused.chained > 10
    assert relaunched.engine.runner.fused.relaunched > 10
    checks[0].check_uploads(exact=True)


def test_device_ngram_without_overlap_equals_host(tiny_loaded):
    """Every step launched from the host (its history filled from the committed tokens)."""
    want_drafts, got_drafts, checks = [], [], []
    host = run_waves(tiny_loaded, waves(), GREEDY, speculative_config=ngram(3, False),
                     on_engine=lambda e: record_drafts(e, want_drafts), **SMALL)

    def on_engine(engine):
        record_drafts(engine, got_drafts, graphs_k=3)
        checks.append(HistoryCheck(engine, exact=True))
    device = run_waves(tiny_loaded, waves(), GREEDY, overlap=False,
                       speculative_config=ngram(3, True), on_engine=on_engine, **SMALL)
    assert device.outputs == host.outputs
    assert device.stats["spec"] == host.stats["spec"]
    assert got_drafts == want_drafts
    fused = device.engine.runner.fused
    assert fused.replays > 20 and fused.chained == 0
    checks[0].check_uploads(exact=device.stats["num_preemptions_total"] == 0)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_device_ngram_sampled_penalized_with_logprobs_equals_host(tiny_loaded, overlap):
    """The device lookup under the other step modes (it is the default where graphs run):
    seeded sampling, a presence penalty and logprobs, each request its own seed; the same
    tokens, logprobs and counts as the host n-gram's eager steps."""
    params = [SamplingParams(max_tokens=24, temperature=0.8, seed=100 + i, ignore_eos=True,
                             presence_penalty=0.5, logprobs=2) for i in range(8)]
    host = run_waves(tiny_loaded, waves(), params, speculative_config=ngram(3, False), **SMALL)
    device = run_waves(tiny_loaded, waves(), params, overlap=overlap,
                       speculative_config=ngram(3, True),
                       on_engine=lambda e: enable_graphs(e, 3), **SMALL)
    assert sum(len(o) for o in host.outputs) == 8 * 24
    assert device.outputs == host.outputs
    # the same top ids; the values as close as fp32 steps of other batch shapes round
    for got, want in zip(device.outs, host.outs):
        got, want = got.outputs[0].logprobs, want.outputs[0].logprobs
        assert len(got) == len(want) == 24
        for g, w in zip(got, want):
            assert list(g) == list(w)
            assert all(abs(g[t] - w[t]) < 1e-4 for t in w)
    assert device.stats["spec"] == host.stats["spec"]
    assert device.stats["spec"]["num_accepted_tokens"] > 0
    fused = device.engine.runner.fused
    mode = GraphMode(samples=True, penalties=True, logprobs=True)
    assert fused.replays > 10 and fused.mode_steps[mode] > 10
    assert fused.chained > 10 if overlap else fused.chained == 0
    assert fused.relaunched == 0
    # the penalty is in force: without it the samples differ
    plain = [dataclasses.replace(p, presence_penalty=0.0) for p in params]
    unpenalized = run_waves(tiny_loaded, waves(), plain, speculative_config=ngram(3, False),
                            **SMALL)
    assert sum(a != b for a, b in zip(unpenalized.outputs, host.outputs)) >= 2


def test_a_step_chained_after_a_kd_0_graph_verifies_no_drafts(tiny_loaded):
    """Under a k_schedule that turns drafting off above 2 requests, a kd = 0 graph drafts
    nothing, so the q = 1 step chained from it must verify no drafts: its num_drafts come from
    the device n-gram's counts, which the kd = 0 graph sets to 0 (they held an earlier step's).
    Force-accept takes min(mean - 1, num_drafts) drafts, so stale counts gave accepted counts
    past the step's one row (an index error here, garbage tokens on the GPU)."""
    k = 3
    spec = ngram(k, True, k_schedule=[[2, k]], force_accept_mean=k + 1.0,
                 check_fused_writes=True)
    after_skip = []  # steps chained from a kd = 0 graph after drafting ones ran

    def on_engine(engine):
        enable_graphs(engine, k)
        runner, inner = engine.runner, engine.runner.chain

        def chain(launched, block_tables, kd_next):
            if launched.kd == 0 and runner.fused.kd_steps.get(k, 0):
                after_skip.append(launched.key)
            return inner(launched, block_tables, kd_next)
        runner.chain = chain
    run = run_waves(tiny_loaded, waves(), GREEDY, overlap=True, speculative_config=spec,
                    on_engine=on_engine, **dict(SMALL, num_kv_blocks=120))
    fused = run.engine.runner.fused
    assert fused.kd_steps.get(0, 0) > 5 and fused.kd_steps.get(k, 0) > 0  # off and on
    assert len(after_skip) > 5, after_skip
    vocab = run.engine.runner.model_cfg.vocab_size
    assert all(0 <= t < vocab for out in run.outputs for t in out)
    spec_stats = run.stats["spec"]
    assert 0 < spec_stats["num_accepted_tokens"] <= spec_stats["num_draft_tokens"]


def test_ngram_device_option_errors():
    assert SpecConfig.from_dict(ngram(3, True)).ngram_device is True
    assert SpecConfig.from_dict(ngram(3, 1)).ngram_device is True  # JSON's 1
    with pytest.raises(ConfigError, match="'ngram_device'.*needs method 'ngram', got 'suffix'"):
        SpecConfig.from_dict({"method": "suffix", "ngram_device": True})
    with pytest.raises(ConfigError, match="'ngram_device'.*needs 'adaptive': false"):
        SpecConfig.from_dict(ngram(3, True, adaptive="cost"))
    with pytest.raises(ConfigError, match="'ngram_device' must be true or false"):
        SpecConfig.from_dict(ngram(3, "yes"))


def fill_ngram(max_seqs: int = 4, width: int = 32) -> StepNgram:
    return StepNgram(max_seqs, width, SimpleNamespace(prompt_lookup_min=1, prompt_lookup_max=4),
                     torch.device("cpu"))


def fill(ng: StepNgram, reqs: list, bucket: int) -> int:
    """Fill rows [0, bucket) with reqs -> the tokens uploaded; every row then holds its
    request's committed tokens."""
    before = ng.uploaded_tokens
    ng.fill(SimpleNamespace(scheduled=[SimpleNamespace(request=r) for r in reqs]), bucket)
    for i, r in enumerate(reqs):
        tokens = r.all_token_ids[:ng.width]
        assert int(ng.lengths[i]) == len(tokens) == ng.held_len[i], r.request_id
        assert ng.history[i, :len(tokens)].tolist() == tokens, r.request_id
    assert not ng.lengths[len(reqs):bucket].any()
    return ng.uploaded_tokens - before


def graph_step(ng: StepNgram, reqs: list, bucket: int, emitted: list) -> None:
    """A graph's append of each row's emitted tokens, its collect, and their commit."""
    q = max(map(len, emitted))
    packed = torch.full((bucket, q + 1), -1, dtype=torch.long)
    for i, e in enumerate(emitted):
        packed[i, :len(e)] = torch.tensor(e)
    ng.advance(packed, q, bucket, torch.arange(bucket) < len(reqs))
    ng.collected(packed.numpy(), q, len(reqs))
    for r, e in zip(reqs, emitted):
        r.output_token_ids += e
        assert ng.held_len[reqs.index(r)] == int(ng.lengths[reqs.index(r)]) == r.num_tokens


def test_fill_uploads_only_what_no_row_holds():
    """Tails after the graph's appends and the general path's commits; rows moved, not
    uploaded, when a batch's rows shift or swap; padding rows keep their tokens; a request
    preempted since, or no longer held, uploaded whole; the context's width."""
    def request(rid, n, base):
        return Request(request_id=rid, prompt_token_ids=list(range(base, base + n)),
                       sampling_params=SamplingParams())
    ng = fill_ngram()
    a, b, c = request("a", 5, 100), request("b", 3, 200), request("c", 4, 300)
    assert fill(ng, [a, b], 2) == 8
    graph_step(ng, [a, b], 2, [[7, 8], [9]])
    graph_step(ng, [a, b], 2, [[5], [6, 4, 3]])
    assert fill(ng, [a, b], 2) == 0  # the graphs appended what the host committed
    a.output_token_ids += [1, 2, 3]  # the general path's steps (no graph)
    assert fill(ng, [a, b], 2) == 3
    assert ng.moved_rows == 0
    assert fill(ng, [b, c], 2) == 4  # a ended: b moves up a row, c is new
    assert ng.moved_rows == 1
    graph_step(ng, [b, c], 2, [[11], [12, 13]])
    assert fill(ng, [c, b], 2) == 0 and ng.moved_rows == 3  # swapped in place
    assert fill(ng, [c], 1) == 0  # b's row is padding: it keeps b's tokens
    b.output_token_ids += [14]
    assert fill(ng, [c, b], 4) == 1 and ng.moved_rows == 3
    b.num_preemptions += 1  # recomputed since: whole again
    assert fill(ng, [c, b], 2) == b.num_tokens
    d = request("d", 3, 400)
    assert fill(ng, [d, b], 2) == 3  # d takes c's row
    assert fill(ng, [d, b, c], 4) == c.num_tokens  # c's row was given away
    e = request("e", 40, 500)  # longer than the history's width: its first 32 tokens
    assert fill(ng, [e, d], 2) == 32
    assert fill(ng, [e, d], 2) == 0 and int(ng.lengths[0]) == 32


def test_the_engine_decides_an_unset_ngram_device(tiny_loaded):
    """The built engine's spec (and its proposer's) says where the lookup runs: unset, the host
    on CPU (no graphs); a set value is kept, even where it changes nothing."""
    from tests.engine_helpers import make_engine
    unset = make_engine(tiny_loaded, speculative_config={"method": "ngram"}, **SMALL)
    assert unset.config.spec.ngram_device is False
    assert unset.runner.proposer.spec.ngram_device is False
    # (the model-free drafters' default k_schedule is CUDA's: none here)
    assert unset.config.spec.k_schedule is None and unset.runner.proposer.policy.schedule is None
    kept = make_engine(tiny_loaded, speculative_config=ngram(3, True), **SMALL)
    assert kept.config.spec.ngram_device is True
