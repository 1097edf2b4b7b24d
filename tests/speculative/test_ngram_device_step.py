"""The n-gram lookup inside the fused graphs (`"ngram_device": true`, runner/fused_ngram.py) on
CPU, with the fake_graph_capture stand-in, over several waves of requests (padding to buckets,
chunked prefill, prefix hits, preemption):

* outputs equal no speculation's, and the host n-gram drafter's (eager and fused, relaunched):
  the same drafts every step (but a request's last, which nothing verifies), the same
  acceptance counts;
* with overlap the steps chain (launched from the previous step's carry before the host reads
  it), none is relaunched; the blocks each step writes are the ones reserved for it;
* the option's errors.
"""

from __future__ import annotations

import pytest

from outpace.errors import ConfigError
from outpace.speculative.ngram import NgramDrafter
from outpace.speculative_config import SpecConfig
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


CASES = [(3, {}), (2, {"prompt_lookup_min": 2}), (3, {"k_schedule": [[2, 3]]})]
IDS = ["k3", "k2-min2", "k3-schedule"]


@pytest.mark.parametrize("k,opts", CASES, ids=IDS)
def test_device_ngram_chains_with_preemption(tiny_loaded, fake_graph_capture, k, opts):
    """A small pool: requests are preempted (with overlap one step earlier than on the host's
    schedule, so the steps differ); each step's drafts are the lookup's, the output and the
    counted drafts the host drafter's. (Under a k_schedule a chained graph's draft length
    follows the batch size its predecessor was launched with, as a head's does, where the host
    drafter asks at collect: a step after a request ends may draft less, so the counts differ
    there.)"""
    plain = run_waves(tiny_loaded, waves(), GREEDY, **SMALL)
    host = run_waves(tiny_loaded, waves(), GREEDY, speculative_config=ngram(k, False, **opts),
                     **SMALL)
    seen = []
    spec = ngram(k, True, check_fused_writes=True, **opts)

    def on_engine(engine):
        enable_graphs(engine, k)
        check_against_lookup(engine, spec.get("prompt_lookup_min", 1), 4, seen)
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


@pytest.mark.parametrize("k,opts", CASES[:2], ids=IDS[:2])
def test_device_ngram_equals_host_ngram_step_by_step(tiny_loaded, fake_graph_capture, k,
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
    device = run_waves(tiny_loaded, waves(), GREEDY, overlap=True,
                       speculative_config=ngram(k, True, **opts),
                       on_engine=lambda e: record_drafts(e, got_drafts, graphs_k=k), **roomy)
    assert device.outputs == host.outputs == relaunched.outputs
    assert device.stats["spec"] == host.stats["spec"] == relaunched.stats["spec"]
    assert device.stats["num_preemptions_total"] == 0
    assert relaunch_drafts == want_drafts
    assert verified(got_drafts) == verified(want_drafts)
    assert device.engine.runner.fused.chained > 10
    assert relaunched.engine.runner.fused.relaunched > 10


def test_device_ngram_without_overlap_equals_host(tiny_loaded, fake_graph_capture):
    """Every step launched from the host (its history filled from the committed tokens)."""
    want_drafts, got_drafts = [], []
    host = run_waves(tiny_loaded, waves(), GREEDY, speculative_config=ngram(3, False),
                     on_engine=lambda e: record_drafts(e, want_drafts), **SMALL)
    device = run_waves(tiny_loaded, waves(), GREEDY, overlap=False,
                       speculative_config=ngram(3, True),
                       on_engine=lambda e: record_drafts(e, got_drafts, graphs_k=3), **SMALL)
    assert device.outputs == host.outputs
    assert device.stats["spec"] == host.stats["spec"]
    assert got_drafts == want_drafts
    fused = device.engine.runner.fused
    assert fused.replays > 20 and fused.chained == 0


def test_a_step_chained_after_a_kd_0_graph_verifies_no_drafts(tiny_loaded, fake_graph_capture):
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
