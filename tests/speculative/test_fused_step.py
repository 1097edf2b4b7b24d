"""The fused graph step (outpace/runner/fused_step.py) on CPU, with the rerun_capture
stand-in: greedy decode/verify steps run target forward, verify/accept and the head's draft loop
as one captured function over fixed buffers.

* outputs and acceptance statistics equal the eager path token for token, without speculation
  and with n-gram, suffix, EAGLE-3 and MTP drafting, across batch sizes that pad to buckets,
  chunked prefill, prefix hits and preemption;
* the draft KV plane the device-side draft loop writes is exact (dense oracle after every step);
* force-accept (benchmarks) reaches the requested mean acceptance length;
* sampled requests (temperature, top-k, top-p, min-p; seeded or not) run in sampled graphs and
  draw what the general path draws; a seeded request's output is the same with and without
  speculation;
* penalties and logprobs: tests/speculative/test_fused_penalties.py, test_fused_logprobs.py.
"""

from __future__ import annotations

import pytest

from outpace import SamplingParams
from outpace.runner import graph_mode
from tests.engine_helpers import make_engine, run_batch
from tests.speculative.conftest import RerunGraph, rerun_capture
from tests.speculative.spec_helpers import TINY_BLOCK, repetitive_prompts, run_waves
from tests.speculative.test_draft_plane import PlaneChecker, head_spec, waves

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
# Graphs are captured for every batch bucket up to max_num_seqs (the stand-in capture runs each
# step once): 8 covers the at most 6 requests these tests run at once without capturing the
# buckets up to the default 64 that no step uses.
FEW_SEQS = dict(max_num_seqs=8)
SMALL = dict(block_size=TINY_BLOCK, max_num_batched_tokens=16, num_kv_blocks=30, **FEW_SEQS)


def enable_graphs(engine, k: int, capture=rerun_capture, prime=None):
    """Graphs for every verify length up to k + 1 and the fused steps, captured by `capture`
    (the CPU stand-in); prime: enable_cuda_graphs' (None: pdl.prime)."""
    engine.runner.enable_cuda_graphs(tuple(range(1, k + 2)), capture_fused=True,
                                     capture=capture, prime=prime)
    assert engine.runner.fused is not None


def spec_for(tiny_heads, method, k, **opts):
    if method is None:
        return None
    if method in ("ngram", "suffix"):
        return {"method": method, "num_speculative_tokens": k, **opts}
    return head_spec(tiny_heads, method, k, **opts)


# k_schedule [[2, 3]]: no drafting above 2 requests, so the graph runs no head for a while;
# when drafting resumes the requests recompute from their draft-plane marks first.
CASES = [(None, 0, {}), ("ngram", 3, {}), ("suffix", 2, {}), ("eagle3", 1, {}),
         ("eagle3", 3, {}), ("mtp", 3, {}), ("eagle3", 3, {"k_schedule": [[2, 3]]}),
         # k = 2 under the small pool: a chain given up must not leave blocks reserved
         # (Scheduler.reserve_chained), or overlap preempts where eager doesn't
         ("mtp", 2, {}),
         ("eagle3", 3, {"draft_lm_head_dtype": "int8"}),
         ("mtp", 3, {"draft_lm_head_dtype": "int8"}),
         # the suffix enhancer replaces the graph's drafts on the host: steps relaunch with
         # them (the write check on: the relaunched loop's reservation)
         ("eagle3", 3, {"enhancer_min_match": 2, "check_fused_writes": True}),
         ("mtp", 2, {"enhancer_min_match": 2}),
         # a host drafter's steps chain where the next one drafts nothing (above 2 requests)
         ("suffix", 3, {"k_schedule": [[2, 3]], "check_fused_writes": True,
                        "force_accept_mean": 2.0})]
CASE_IDS = [f"{m}-k{k}" + "".join(f"-{o}" for o in opts) for m, k, opts in CASES]
# Sync steps are launched from the host, overlapped ones chained (heads) or relaunched (host
# drafters). What a case adds inside the graph (suffix beside n-gram: another host drafter;
# k = 1: a draft loop of one step; the int8 draft LM head) is the same code either way, so
# those run in one of the two; the rest in both.
ONE_WAY = {("suffix", 2, ()): True, ("eagle3", 1, ()): True,
           ("eagle3", 3, ("draft_lm_head_dtype",)): True,
           ("mtp", 3, ("draft_lm_head_dtype",)): False,
           ("mtp", 2, ("enhancer_min_match",)): True,
           ("suffix", 3, ("k_schedule", "check_fused_writes", "force_accept_mean")): True}
EQUAL_CASES = [(f"{cid}-{'overlap' if overlap else 'sync'}", *case, overlap)
               for cid, case in zip(CASE_IDS, CASES) for overlap in (False, True)
               if ONE_WAY.get((case[0], case[1], tuple(case[2])), overlap) == overlap]


def record_drafts(engine, into: list, graphs_k=None):
    """Wrap the runner so every step's proposed drafts land in `into` (by request id: run_waves
    names requests by wave and index, so both engines use the same ids)."""
    if graphs_k is not None:
        enable_graphs(engine, graphs_k)
    runner = engine.runner
    inner_execute, inner_collect = runner.execute, runner.collect

    def execute(plan):
        result = inner_execute(plan)
        into.append({rid: o.next_draft_token_ids for rid, o in result.outputs.items()})
        return result

    def collect(launched, plan):  # the overlapped path's steps
        result = inner_collect(launched, plan)
        into.append({rid: o.next_draft_token_ids for rid, o in result.outputs.items()})
        return result
    runner.execute, runner.collect = execute, collect


@pytest.mark.parametrize("method,k,opts,overlap", [c[1:] for c in EQUAL_CASES],
                         ids=[c[0] for c in EQUAL_CASES])
def test_fused_step_equals_eager(tiny_loaded, tiny_heads, method, k, opts,
                                 overlap):
    spec = spec_for(tiny_heads, method, k, **opts)
    want_drafts, got_drafts = [], []
    eager = run_waves(tiny_loaded, waves(), GREEDY, speculative_config=spec,
                      on_engine=lambda e: record_drafts(e, want_drafts), **SMALL)
    fused = run_waves(tiny_loaded, waves(), GREEDY, overlap=overlap,
                      on_engine=lambda e: record_drafts(e, got_drafts, graphs_k=k),
                      speculative_config=spec, **SMALL)
    assert fused.outputs == eager.outputs
    assert fused.stats["spec"] == eager.stats["spec"]
    assert got_drafts == want_drafts, "the proposed drafts differ from the eager path's"
    runner = fused.engine.runner
    assert runner.fused.replays > 20, "the fused step served too few steps"
    host_drafter = method in ("ngram", "suffix")
    if "enhancer_min_match" in opts:  # never chained: relaunched with the host's drafts
        assert runner.fused.chained == 0
        assert (runner.fused.relaunched > 10) == overlap, runner.fused.relaunched
        # the random head's drafts are rarely accepted: the enhancer's matches were
        assert fused.stats["spec"]["num_accepted_tokens"] > 20
    elif overlap and not host_drafter:
        assert runner.fused.chained > 10, "no step was launched from its predecessor's outputs"
    elif overlap and "k_schedule" in opts:  # while the schedule drafts nothing: chained
        assert runner.fused.chained > 5, "no host drafter's step chained while it drafted none"
    else:  # host drafters chain only then: their steps are relaunched from the previous carry
        assert runner.fused.chained == 0
    if overlap and host_drafter:
        assert runner.fused.relaunched > 10, "no step was relaunched from the carry"
    elif "enhancer_min_match" not in opts:
        assert runner.fused.relaunched == 0
    assert {key[0] for key in runner.fused.table.greedy} >= {4}, "no batch padded to a bucket"
    if k:
        # (fewer where the schedule drafts nothing above 2 requests)
        least = 20 if "k_schedule" in opts else 50
        assert sum(len(d) for step in got_drafts for d in step.values()) > least
    if "k_schedule" in opts and not host_drafter:  # drafting went off and came back
        assert {key[2] for key in runner.fused.table.greedy} == {0, k}
    if method in ("ngram", "suffix"):  # (a random head's drafts are rarely accepted)
        assert fused.stats["spec"]["num_accepted_tokens"] > 0
    # the scenario happened: preemption and prefix hits, as in the eager run
    assert fused.stats["num_preemptions_total"] > 0
    assert fused.engine.kv.prefix_cache_hit_tokens > 0


@pytest.mark.parametrize("method,overlap", [("ngram", False), ("ngram", True),
                                            ("suffix", True)])
def test_host_drafter_failures_in_the_fused_step(tiny_loaded, method,
                                                 overlap):
    """A host drafter that raises (injected) inside the fused step's output: no drafts for
    that step (with overlap its successor relaunched without drafts), every failure counted,
    the output as without speculation. (A head drafts inside the fused graphs, where nothing
    raises; its failures on the general path: test_draft_plane.py.)"""
    want = run_waves(tiny_loaded, waves(), GREEDY, **SMALL).outputs
    run = run_waves(tiny_loaded, waves(), GREEDY, overlap=overlap,
                    on_engine=lambda e: enable_graphs(e, 3),
                    speculative_config=spec_for(None, method, 3, inject_draft_failures=2),
                    **SMALL)
    assert run.outputs == want
    injected = run.engine.runner.proposer.injected
    assert injected.raised >= 10 and run.stats["num_draft_failures_total"] == injected.raised
    assert run.engine.runner.fused.replays > 20
    if overlap:
        assert run.engine.runner.fused.relaunched > 10


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_enhancer_failures_in_the_fused_step(tiny_loaded, tiny_heads,
                                             overlap):
    """The suffix enhancer raising after a fused graph drafted (every third match): no drafts
    for that step, every failure counted, the step after it not relaunched (the scheduler
    repairs the head's plane first), the output as without speculation."""
    want = run_waves(tiny_loaded, waves(), GREEDY, **SMALL).outputs
    calls = []

    def on_engine(engine):
        enable_graphs(engine, 3)
        enhancer = engine.runner.proposer.enhancer
        inner = enhancer.match

        def match(*args):
            calls.append(1)
            if len(calls) % 3 == 0:
                raise RuntimeError("injected enhancer failure")
            return inner(*args)
        enhancer.match = match
    run = run_waves(tiny_loaded, waves(), GREEDY, overlap=overlap, on_engine=on_engine,
                    speculative_config=spec_for(tiny_heads, "eagle3", 3, enhancer_min_match=2),
                    **SMALL)
    assert run.outputs == want
    assert run.stats["num_draft_failures_total"] >= 5
    fused = run.engine.runner.fused
    assert fused.replays > 20 and fused.chained == 0
    if overlap:  # relaunched between the failures
        assert fused.relaunched > 5


@pytest.mark.parametrize("method,k,opts", [
    ("eagle3", 4, {"force_accept_mean": 3.5}), ("mtp", 3, {"force_accept_mean": 2.5}),
    # the enhancer's drafts replace the loop's: the next step's first pass rewrites the
    # entries the loop wrote for the head's own drafts
    ("eagle3", 3, {"enhancer_min_match": 2})], ids=["eagle3", "mtp", "eagle3-enhancer"])
def test_device_draft_loop_writes_an_exact_draft_plane(tiny_loaded, tiny_heads, method, k, opts):
    checker = PlaneChecker(tiny_loaded)
    # overlap off: the checker reads the plane between steps, which with a step in flight
    # holds that step's writes past the committed tokens (drafts equal the eager path's with
    # overlap on too: test_fused_step_equals_eager)
    run = run_waves(tiny_loaded, waves(), GREEDY, after_step=checker, overlap=False,
                    on_engine=lambda e: enable_graphs(e, k),
                    speculative_config=head_spec(tiny_heads, method, k, **opts), **SMALL)
    assert run.engine.runner.fused.replays > 10
    assert checker.entries_checked > 500
    per_pos = [run.stats["spec"]["num_drafts"]] + run.stats["spec"]["accepted_per_position"]
    by_count = [a - b for a, b in zip(per_pos, per_pos[1:] + [0])]
    assert sum(n > 0 for n in by_count) >= 2, f"acceptance never varied: {per_pos}"


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_prefill_head_graph_equals_eager(tiny_loaded, tiny_heads, method):
    """One request at a time: its prefill chunks run in prefill graphs, and the head's pass
    over each chunk (alone for a chunk that samples nothing, with the draft loop for the last)
    replays the fused step's prefill-head graph. Drafts, outputs and the draft plane equal the
    eager head's."""
    k = 3
    prompts = repetitive_prompts(3, 11) + [list(range(1, 10))]  # 2 chunks of <= 16; 1 chunk
    runs = []
    for graphs in (False, True):
        drafts, checker = [], PlaneChecker(tiny_loaded)
        run = run_waves(tiny_loaded, [[p] for p in prompts], GREEDY, after_step=checker,
                        overlap=False,
                        on_engine=lambda e: record_drafts(e, drafts, k if graphs else None),
                        speculative_config=head_spec(tiny_heads, method, k),
                        **{**SMALL, "max_num_seqs": 1})
        assert checker.entries_checked > 100
        runs.append((run, drafts))
    (eager, want), (fused, got) = runs
    assert fused.outputs == eager.outputs
    assert got == want, "the prefill-head graph's drafts differ from the eager head's"
    # every prefill step of the fused engine: 2 chunks for each of the 3 long prompts, 1 short
    assert fused.engine.runner.fused.prefill.replays == 7
    assert any(d for step in got[:2] for d in step.values())  # the first prefill drafted


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_fused_draft_loop_at_the_context_end(tiny_loaded, tiny_heads,
                                             overlap):
    """A request that runs into max_model_len = max_position_embeddings: the graph's draft loop
    runs its k steps for it although the host trims its drafts, so the discarded steps reach
    positions past the model's last one; the rope tables hold a margin for them
    (rotary.POSITION_MARGIN; without it the CPU stand-in raises an IndexError there and a GPU
    reads past the table). Output equals the eager engine's, which stops its loop at k."""
    k = 4
    prompt = [(7 * i + 3) % 90 + 1 for i in range(490)]
    params = SamplingParams(max_tokens=512 - len(prompt), temperature=0.0, ignore_eos=True)
    outs = []
    for graphs in (False, True):
        eng = make_engine(tiny_loaded, block_size=TINY_BLOCK, num_kv_blocks=200, max_num_seqs=1,
                          overlap=overlap, speculative_config=head_spec(tiny_heads, "eagle3", k))
        if graphs:
            enable_graphs(eng, k)
        outs.append(run_batch(eng, [prompt], params)[0])
    assert len(prompt) + len(outs[0]) == 512  # up to the context's end
    assert outs[1] == outs[0]
    assert eng.runner.fused.replays > 3


def test_force_accept_mean_on_the_fused_path(tiny_loaded, tiny_heads):
    k, mean = 4, 3.0
    eng = make_engine(tiny_loaded, max_num_seqs=8, speculative_config=head_spec(
        tiny_heads, "eagle3", k, force_accept_mean=mean))
    eng.runner.enable_cuda_graphs(tuple(range(1, k + 2)), capture_fused=True,
                                  capture=rerun_capture)
    captured = set(eng.runner.fused.table.greedy)
    # buckets 1 2 4 8 (max_num_seqs 8) x q 1..k+1, and each bucket's chained step (q = k+1)
    assert sum(not key[3] for key in captured) == 4 * (k + 1)
    assert {key for key in captured if key[3]} == {(b, k + 1, k, True) for b in (1, 2, 4, 8)}
    captures = eng.runner.fused.table.captures
    assert captures == sum(len(t) for t in eng.runner.fused.table.by_mode.values())
    prompts = repetitive_prompts(6, 7)
    run_batch(eng, prompts, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    assert set(eng.runner.fused.table.greedy) == captured, "steady decoding captured more graphs"
    assert eng.runner.fused.table.captures == captures  # (what benchmarks/methods.py reports)
    spec = eng.stats()["spec"]
    assert eng.runner.fused.replays > 15
    # steps verifying drafts: accepted/steps + 1 ~ mean (steps near max_tokens draft fewer)
    steps = spec["num_drafts"]
    measured = 1 + spec["num_accepted_tokens"] / steps
    assert abs(measured - mean) < 0.15, (measured, spec)


# Sampled requests beside a greedy one, seeded and not: with a mask each (top-p, top-k, min-p:
# the masked graphs), and with a temperature alone (the sampled graphs). waves() has 8 prompts.
MASKED = [SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True),
          SamplingParams(max_tokens=24, temperature=1.2, top_k=12, ignore_eos=True),
          GREEDY,
          SamplingParams(max_tokens=24, temperature=0.6, min_p=0.05, seed=-5, ignore_eos=True)]
PLAIN = [SamplingParams(max_tokens=24, temperature=0.8, seed=3, ignore_eos=True),
         SamplingParams(max_tokens=24, temperature=1.2, ignore_eos=True), GREEDY]
SAMPLED = {graph_mode.MASKED: MASKED, graph_mode.SAMPLE: PLAIN}
SAMPLED_CASES = [(None, 0), ("ngram", 3), ("eagle3", 3), ("mtp", 2)]
# Each drafter in both graph families (sample, masked) and both launches (sync, overlap), in
# two of the four pairings, so that each family runs sync with two drafters and overlapped with
# the other two (as in test_fused_penalties): what a family's graph computes does not depend on
# how its step was launched, so the other pairings run no code these don't.
SAMPLED_EQUAL = [(m, k, overlap, mode) for i, (m, k) in enumerate(SAMPLED_CASES)
                 for overlap, mode in (((False, graph_mode.MASKED), (True, graph_mode.SAMPLE))
                                       if i % 2 == 0 else
                                       ((False, graph_mode.SAMPLE), (True, graph_mode.MASKED)))]


def sampled_params(mode: graph_mode.GraphMode = graph_mode.MASKED) -> list:
    kinds = SAMPLED[mode]
    return [kinds[i % len(kinds)] for i in range(sum(len(w) for w in waves()))]


@pytest.mark.parametrize("method,k,overlap,mode", SAMPLED_EQUAL,
                         ids=[f"{m}-{'overlap' if o else 'sync'}-{md}"
                              for m, _, o, md in SAMPLED_EQUAL])
def test_sampled_fused_step_equals_eager(tiny_loaded, tiny_heads, method,
                                         k, overlap, mode):
    spec = spec_for(tiny_heads, method, k)
    eager = run_waves(tiny_loaded, waves(), sampled_params(mode), speculative_config=spec,
                      **SMALL)
    fused = run_waves(tiny_loaded, waves(), sampled_params(mode), overlap=overlap,
                      on_engine=lambda e: enable_graphs(e, k), speculative_config=spec,
                      **SMALL)
    assert fused.outputs == eager.outputs
    assert fused.stats["spec"] == eager.stats["spec"]
    steps = fused.engine.runner.fused
    assert steps.mode_steps[mode] > 20, f"the {mode} graphs served too few steps"
    if overlap and method not in ("ngram", "suffix"):
        assert steps.chained > 10, "no sampled step was launched from its predecessor's"
    # the requests did sample: the seeded ones differ from their greedy output
    greedy = run_waves(tiny_loaded, waves(), GREEDY, speculative_config=spec, **SMALL)
    assert sum(a != b for a, b in zip(fused.outputs, greedy.outputs)) >= 4


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("method,k", SAMPLED_CASES[1:], ids=[m for m, _ in SAMPLED_CASES[1:]])
def test_sampled_output_is_the_same_with_and_without_speculation(
        tiny_loaded, tiny_heads, method, k, graphs):
    """The race keys each token by (seed, position): verifying drafts against it emits what
    plain decoding would have drawn, for seeded and unseeded requests (the engine seed)."""
    plain = run_waves(tiny_loaded, waves(), sampled_params(), **SMALL)
    spec = run_waves(tiny_loaded, waves(), sampled_params(),
                     speculative_config=spec_for(tiny_heads, method, k),
                     on_engine=(lambda e: enable_graphs(e, k)) if graphs else None, **SMALL)
    assert spec.outputs == plain.outputs
    assert spec.stats["spec"]["num_drafts"] > 50
    if method == "ngram":  # repetitive prompts: drafts that match the samples get accepted
        assert spec.stats["spec"]["num_accepted_tokens"] > 0


@pytest.mark.parametrize("mode", [graph_mode.MASKED, graph_mode.SAMPLE], ids=str)
@pytest.mark.parametrize("method,k", [(None, 0), ("eagle3", 2), ("mtp", 2)])
def test_sampled_prefill_launched_like_a_decode_step(tiny_loaded, tiny_heads, method, k, mode):
    """A sampled request's prefill is launched like a decode step too (its family's prefill
    tail draws the token on the device, the race with the request's seed and position), and
    its decode steps chain from it in that family's graphs: token for token the eager
    engine's, seeded or not."""
    spec = spec_for(tiny_heads, method, k)
    eng = make_engine(tiny_loaded, speculative_config=spec, overlap=True, **SMALL)
    enable_graphs(eng, k)
    eager = make_engine(tiny_loaded, speculative_config=spec, **SMALL)
    fused = eng.runner.fused
    prompts = repetitive_prompts(3, 13, period=4, repeats=3)  # one chunk each
    # hot enough that a token drawn with the wrong key (seed, position) would differ
    hot = dict(max_tokens=12, ignore_eos=True)
    params = ([SamplingParams(temperature=4.0, top_p=0.95, seed=1, **hot),
               SamplingParams(temperature=5.0, top_k=12, **hot),
               SamplingParams(temperature=3.0, min_p=0.01, seed=2, **hot)]
              if mode == graph_mode.MASKED
              else [SamplingParams(temperature=t, seed=s, **hot)
                    for t, s in ((4.0, 1), (5.0, None), (3.0, 2))])
    for n, (prompt, p) in enumerate(zip(prompts, params)):
        launches, chained, steps = fused.prefill.launches, fused.chained, fused.mode_steps[mode]
        got = run_batch(eng, [prompt], p)
        assert got == run_batch(eager, [prompt], p), n
        assert fused.prefill.launches - launches == 1, (n, len(prompt))
        assert fused.chained - chained >= 1 and fused.mode_steps[mode] - steps >= 5
    assert eng.stats()["spec"] == eager.stats()["spec"]


def test_warm_up_leaves_nothing_behind(tiny_loaded, tiny_heads):
    """LLMEngine.warm_up (run at start-up on CUDA) leaves no request, block or count behind,
    and the engine's outputs afterwards are those of a fresh engine."""
    spec = head_spec(tiny_heads, "eagle3", 3)
    prompts = repetitive_prompts(3, 9)
    want = run_batch(make_engine(tiny_loaded, speculative_config=spec), prompts, GREEDY)
    eng = make_engine(tiny_loaded, speculative_config=spec)
    eng.warm_up()
    stats = eng.stats()
    assert not eng.has_unfinished_requests() and stats["num_running"] == 0
    assert stats["kv_blocks_used"] == 0
    assert stats["prompt_tokens_total"] == 0 and stats["generation_tokens_total"] == 0
    assert stats["spec"]["num_drafts"] == 0 and eng.kv.prefix_cache_query_tokens == 0
    assert run_batch(eng, prompts, GREEDY) == want


@pytest.mark.parametrize("method,k", [(None, 0), ("eagle3", 3), ("mtp", 2), ("ngram", 3)])
def test_overlap_with_arrivals_aborts_and_stops(tiny_loaded, tiny_heads,
                                                method, k):
    """Overlapped steps while requests arrive, get aborted and stop (stop token, stop string,
    max_tokens) mid-chain: every output equals the eager engine's for that request. (n-gram:
    relaunched steps, FusedStep.relaunch.)"""
    spec = spec_for(tiny_heads, method, k)
    tok = tiny_loaded[2]
    prompts = repetitive_prompts(6, 21)

    def params(**kw):
        return SamplingParams(**{"max_tokens": 30, "temperature": 0.0, "ignore_eos": True, **kw})
    probe = make_engine(tiny_loaded, speculative_config=spec)
    free = [run_batch(probe, [p], params())[0] for p in prompts]
    plist = [params() for _ in prompts]
    plist[1] = params(stop_token_ids=[free[1][12]])
    plist[2] = params(stop=[tok.decode(free[2])[15:17]])
    plist[3] = params(max_tokens=7)
    eager = make_engine(tiny_loaded, speculative_config=spec)
    want = [run_batch(eager, [p], sp)[0] for p, sp in zip(prompts, plist)]

    eng = make_engine(tiny_loaded, speculative_config=spec, overlap=True, **FEW_SEQS)
    enable_graphs(eng, k)
    got, steps = {}, 0

    def step():
        nonlocal steps
        steps += 1
        for o in eng.step():
            if o.finished:
                got[o.request_id] = o.token_ids
    for i in (0, 1, 2):
        eng.add_request(f"o{i}", prompts[i], plist[i])
    fused = eng.runner.fused

    def overlapped():  # steps launched before their predecessor's commit
        return fused.relaunched if method == "ngram" else fused.chained
    for _ in range(4):
        step()
    chained_before_arrivals = overlapped()
    for i in (3, 4):  # arrive while a step is in flight
        eng.add_request(f"o{i}", prompts[i], plist[i])
    for _ in range(5):
        step()
    eng.abort_request("o4")  # aborted while a step is in flight
    eng.add_request("o5", prompts[5], plist[5])
    while eng.has_unfinished_requests():
        step()
    assert chained_before_arrivals > 0 and overlapped() > chained_before_arrivals
    for i in (0, 1, 2, 3, 5):
        assert got[f"o{i}"] == want[i], f"request {i} ({plist[i]})"
    assert "o4" not in got
    assert len(want[1]) < 30 and len(want[2]) < 30 and len(want[3]) == 7  # the stops happened


@pytest.mark.parametrize("method,k", [(None, 0), ("eagle3", 2), ("mtp", 3)])
@pytest.mark.parametrize("force", [False, True], ids=["greedy", "force-accept"])
def test_steps_chain_up_to_max_tokens(tiny_loaded, tiny_heads, method, k,
                                      force):
    """A step is chained from its predecessor's device outputs whenever that predecessor
    can't finish the request (LLMEngine._chain), also when the new step may pass max_tokens
    (its tokens past it are dropped): at every max_tokens around a step boundary, without
    drafts and with every draft accepted (force-accept at mean k + 1, as the benchmark's
    k = 2 rows), no decode step is launched from the host: the prefill step is launched like
    one (PrefillGraphs.launch) and the first decode step chains from it. Greedy with random
    heads (drafts mostly rejected): outputs and acceptance statistics equal the eager
    engine's, and the statistics count no draft past max_tokens."""
    if force and not method:
        pytest.skip("force-accept needs drafts")
    spec = spec_for(tiny_heads, method, k, **({"force_accept_mean": k + 1.0} if force else {}))
    prompt = repetitive_prompts(1, 31)[0]
    eng = make_engine(tiny_loaded, speculative_config=spec, overlap=True, max_num_seqs=1)
    enable_graphs(eng, k)
    eager = make_engine(tiny_loaded, speculative_config=spec)
    fused = eng.runner.fused
    for max_tokens in range(3 * (k + 1) + 1, 4 * (k + 1) + 2):  # 3 full steps, then 0 .. k + 1
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        replays, chained, stats = fused.replays, fused.chained, eng.stats()["spec"]
        prefills = fused.prefill.launches
        got = run_batch(eng, [prompt], params)
        assert len(got[0]) == max_tokens
        replays, chained = fused.replays - replays, fused.chained - chained
        assert fused.prefill.launches - prefills == 1
        accepted = eng.stats()["spec"]["num_accepted_tokens"] - stats["num_accepted_tokens"]
        if force:  # every step kept k + 1 tokens but the last, which kept what was left
            assert replays == -(-(max_tokens - 1) // (k + 1))
            assert accepted == max_tokens - 1 - replays  # no draft past max_tokens counted
        if force or not method:
            assert replays >= 3 and replays == chained, (max_tokens, replays, chained)
        if not force:
            assert got == run_batch(eager, [prompt], params)
            assert eng.stats()["spec"] == eager.stats()["spec"], max_tokens


@pytest.mark.parametrize("method,k", [(None, 0), ("eagle3", 2), ("mtp", 2)])
def test_prefill_launched_like_a_decode_step(tiny_loaded, tiny_heads,
                                             method, k):
    """A greedy single-request prefill is launched like a decode step (FusedStep's
    PrefillGraphs.launch) and the first decode step chains from it: it is in flight when the step
    that committed the first token returns. At the edges too: one token wanted (nothing to
    chain), the first token a stop token (the chained step is launched, then drained), a
    prefix-cache hit (the chunk starts past 0) and a prompt over the token budget (only its
    last chunk samples). Token for token the eager engine's, and the same statistics."""
    spec = spec_for(tiny_heads, method, k)
    eng = make_engine(tiny_loaded, speculative_config=spec, overlap=True, **SMALL)
    enable_graphs(eng, k)
    eager = make_engine(tiny_loaded, speculative_config=spec, **SMALL)
    fused = eng.runner.fused
    short = repetitive_prompts(1, 11, period=4, repeats=2)[0]  # 8 tokens
    long = repetitive_prompts(1, 12, period=6, repeats=4)[0]  # 24 > 16 (the token budget)
    first = run_batch(eager, [short], SamplingParams(max_tokens=1, temperature=0.0))[0][0]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    stop = SamplingParams(max_tokens=9, temperature=0.0, stop_token_ids=[first])
    # (prompt, params, first decode step chained, still in flight after the prefill's step)
    cases = [(short, one, 0, False), (short, stop, 1, False), (short, GREEDY, 1, True),
             (short, GREEDY, 1, True), (long, GREEDY, 1, True)]  # 4th: a prefix hit
    for n, (prompt, params, want_chained, want_inflight) in enumerate(cases):
        eng.add_request(f"p{n}", prompt, params)
        launches, chained = fused.prefill.launches, fused.chained
        tokens, outs = None, []
        while tokens is None:  # the prefill's steps, up to the one that samples
            outs += eng.step()
            tokens = next((o.token_ids for o in outs if o.token_ids), None)
        assert fused.prefill.launches - launches == 1, (n, len(prompt))
        assert (fused.chained - chained, eng._inflight is not None) == (want_chained,
                                                                         want_inflight)
        while eng.has_unfinished_requests():
            outs += eng.step()
        got = next(o.token_ids for o in reversed(outs) if o.finished)
        assert got == run_batch(eager, [prompt], params)[0], n
    assert eng.stats()["spec"] == eager.stats()["spec"]


@pytest.mark.parametrize("method,k", [(None, 0), ("ngram", 3), ("eagle3", 3)])
def test_host_launched_graphs_prime_pdl_and_chained_steps_do_not(tiny_loaded, tiny_heads, method,
                                                                 k):
    """Every graph replayed from the host (a step's launch, a host drafter's relaunch, a
    prefill graph and the tail after it, a varlen step and the head's graph after it) is
    preceded by kernels/pdl.prime, since eager kernels may have run before it; a chained step
    follows a graph and is not (the prime costs a launch). (pdl.prime itself launches nothing
    on CPU; tests/gpu/test_pdl.py runs it.)"""
    events, devices, sites = [], [], []  # events: "prime", "chained" (a chained step's
    # replay next), "replay"
    recording = [False]  # events count from the first batch on (not during capture)

    def prime(device, site="step"):  # the runner's primer (pdl.prime's stand-in)
        if recording[0]:
            events.append("prime")
            devices.append(device)
            sites.append(site)

    class TaggedRerun(RerunGraph):
        def replay(self):
            if recording[0]:
                events.append("replay")
            super().replay()

    def capture(fn):
        g = TaggedRerun(fn)
        return g, g.outs

    eng = make_engine(tiny_loaded, speculative_config=spec_for(tiny_heads, method, k),
                      overlap=True, **FEW_SEQS)
    enable_graphs(eng, k, capture=capture, prime=prime)
    fused, graphs = eng.runner.fused, eng.runner.graphs
    before = (fused.prefill.launches, graphs.varlen_replays,
              fused.prefill.replays + fused.prefill.varlen_head_replays)
    fused_replay = fused._replay

    def tagging(*args, chained=False, **kw):
        if chained:
            events.append("chained")
        return fused_replay(*args, chained=chained, **kw)
    fused._replay = tagging  # this engine's fused step only (an instance attribute)
    recording[0] = True
    run_batch(eng, repetitive_prompts(3, 11), GREEDY)  # its first step: a varlen graph
    run_batch(eng, repetitive_prompts(1, 11), GREEDY)  # a batch-1 prefill
    # every replay follows a prime, or is a chained step's
    pairs = list(zip(events, events[1:]))
    replays = events.count("replay")
    assert replays == pairs.count(("prime", "replay")) + pairs.count(("chained", "replay"))
    assert events.count("prime") == pairs.count(("prime", "replay"))  # each primes a replay
    # the sites (KernelOptions.pdl_prime_skip decides which of them launch the primer): a varlen step,
    assert graphs.varlen_replays > before[1] and "varlen" in sites
    if method == "eagle3":  # the head's graph after it,
        assert fused.prefill.replays + fused.prefill.varlen_head_replays > before[2]
        assert "head" in sites
    assert "step" in sites  # host-launched steps
    if fused.chainable:  # chained steps (no prime), a fused prefill
        assert events.count("chained") > 10
        assert fused.prefill.launches > before[0] and "prefill" in sites
    else:  # a host drafter's steps are relaunched from the host: each primes
        assert fused.relaunched > 10 and fused.chained == 0 and "chained" not in events
    assert all(d == eng.runner.device for d in devices)
