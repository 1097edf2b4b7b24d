"""MTP depths mode in the fused graph (outpace/runner/fused_depths_window.py), on the CPU
stand-in of CUDA graphs (): the window with its geometry computed on the
device from the accepted counts, R = K + 1 rows a request, the stash in device buffers.

Against the eager window (speculative/mtp_window.py, the reference) over the scenario of
test_mtp_window.py (chunked prefill beside decodes, prefix-cache hits, preemption): the output
is the target's; after every step, each request's draft plane (every module's entries below its
computed KV) and stash (start, end, hiddens) equal the eager engine's at the same point of the
same request, and the plane the dense oracle's; every draft a step proposes equals the eager
one for the same request and committed length. Most decode steps run fused (and chain, with
overlap). A negative control: a window one row too narrow, in the graph, leaves stale entries
that the oracle finds.
"""

from __future__ import annotations

import pytest
import torch

from outpace import SamplingParams
from tests.speculative.conftest import rerun_capture
from tests.speculative.spec_helpers import dense_target, repetitive_prompts, run_waves
from tests.speculative.test_mtp_window import (ENGINE, GREEDY, TOL, PlaneOracle, bigram_head_tensors,
                                               spec_config, waves)

K_CASES = [("bigram", 3, 3), ("random", 3, 2), ("bigram", 4, 4)]
ENGINE_G = dict(ENGINE, max_num_seqs=8)


@pytest.fixture(scope="module")
def setups(tiny_loaded, tmp_path_factory):
    """{"random": (loaded, {D: head folder}), "bigram": the embedding-heavy twin and the
    bigram heads} as in test_mtp_window.py."""
    from outpace.models.draft_loader import mtp_config_dict, save_draft_head
    from outpace.models.mtp import MTPHead
    from outpace.training.init_draft import random_head_tensors
    from tests.speculative.spec_helpers import tiny_target
    model, cfg, tok = tiny_target(seed=0)
    with torch.no_grad():
        model.embed_weight.mul_(10.0)
    root = tmp_path_factory.mktemp("depths_graph_heads")
    out = {}
    for kind, loaded in (("random", tiny_loaded), ("bigram", (model, cfg, tok))):
        heads = {}
        for D in (3, 4):
            head = MTPHead(cfg, D, cfg.num_hidden_layers, device="meta")
            tensors = random_head_tensors(head, 1) if kind == "random" else \
                bigram_head_tensors(head, 1)
            heads[D] = save_draft_head(mtp_config_dict(cfg, D), tensors, root / f"{kind}{D}")
        out[kind] = (loaded, heads)
    return out


def stash_of(engine, rid):
    """(start, end, hiddens) of a request's stash, read where it is (host or device) without
    moving it; None without one."""
    prop = engine.runner.proposer
    st = prop.stash.get(rid)
    if st is None:
        return None
    hidden = st.hidden
    if hidden is None:
        win = engine.runner.fused.window
        hidden = win.hidden[win.rows[rid], win.K - (st.end - st.start):]
    return st.start, st.end, hidden.clone()


class StepRecorder:
    """after_step: every running request's plane and stash, keyed by (request, computed KV,
    committed length), and the dense oracle's verdict on its plane; drafts by (request,
    committed length)."""

    def __init__(self, loaded):
        self.loaded = loaded
        self.states, self.drafts, self.errors = {}, {}, []
        self.oracle = None

    def attach(self, engine):
        self.oracle = PlaneOracle(engine, self.loaded)  # also checks every eager window
        runner = engine.runner
        inner_execute, inner_collect = runner.execute, runner.collect

        def record(plan, result):
            for sr in plan.scheduled:
                out = result.outputs[sr.request.request_id]
                if out.next_draft_token_ids:
                    f = sr.request.num_tokens + len(out.token_ids)
                    self.drafts[(sr.request.request_id, f)] = list(out.next_draft_token_ids)
            return result
        runner.execute = lambda plan: record(plan, inner_execute(plan))
        runner.collect = lambda launched, plan: record(plan, inner_collect(launched, plan))

    @torch.inference_mode()
    def __call__(self, engine):
        model, cfg = self.loaded[0], self.loaded[1]
        pool, L = engine.runner.kv_cache, cfg.num_hidden_layers
        K = engine.runner.proposer.depth
        for req in engine.scheduler.running:
            rid, e = req.request_id, req.num_computed_tokens
            committed = req.all_token_ids
            if e < 2:
                continue
            table = torch.tensor(engine.kv.block_ids(rid), dtype=torch.long)
            pos = torch.arange(e)
            bs = pool.shape[3]
            plane = torch.stack([pool[L + d][:, table[pos // bs], pos % bs] for d in range(K)])
            self.states[(rid, e, len(committed))] = (plane.clone(), stash_of(engine, rid))
            hidden = dense_target(model, cfg, committed[:e])[0]
            for d, p, got, want in self.oracle._compare(committed, hidden, table, 0, e):
                bad = p[(got - want).abs().amax(dim=(0, 2, 3)) > TOL].tolist()
                if bad:
                    self.errors.append(f"{rid}: module {d} entries at {bad} (e={e})")
            st = stash_of(engine, rid)
            if st is not None and st[1] == e and st[1] > st[0] and not torch.allclose(
                    st[2], hidden[st[0]:st[1]], atol=TOL):
                self.errors.append(f"{rid}: stash {st[:2]} hiddens differ from the target's")


def run_case(setups, kind, D, k, graphs: bool, overlap: bool = False, window=None,
             scenario=None, params=GREEDY, after_step=None):
    """scenario: the waves of prompts (default waves()); after_step(engine) runs after the
    recorder, every step."""
    loaded, heads = setups[kind]
    rec = StepRecorder(loaded)

    def on_engine(engine):
        if window is not None:
            engine.runner.proposer.window = window
        if graphs:
            engine.runner.enable_cuda_graphs(tuple(range(1, k + 2)), capture_fused=True,
                                             capture=rerun_capture)
        rec.attach(engine)

    def step(engine):
        rec(engine)
        if after_step is not None:
            after_step(engine)

    run = run_waves(loaded, waves() if scenario is None else scenario, params,
                    on_engine=on_engine, after_step=step,
                    speculative_config=spec_config(heads[D], k, False), overlap=overlap,
                    **ENGINE_G)
    run.rec = rec
    return run


@pytest.fixture(scope="module")
def eager_runs(setups):
    """eager_runs(kind, D, k) -> run_case's eager run of that case, run once for the module:
    the tests here only read a finished run."""
    runs: dict = {}

    def run(kind, D, k):
        if (kind, D, k) not in runs:
            runs[(kind, D, k)] = run_case(setups, kind, D, k, graphs=False)
        return runs[(kind, D, k)]

    return run


@pytest.fixture(scope="module")
def references(setups):
    return {kind: run_waves(setups[kind][0], waves(), GREEDY, **ENGINE_G).outputs
            for kind in setups}


def assert_same_steps(eager, fused, min_states: int, min_drafts: int) -> None:
    """Two recorders' steps at the same points of each request: the same draft plane, stash
    (start, end, hiddens) and drafts; at least min_states and min_drafts points in common."""
    common = set(eager.states) & set(fused.states)
    assert len(common) >= min_states, len(common)
    for key in sorted(common):
        (pe, se), (pf, sf) = eager.states[key], fused.states[key]
        err = float((pe - pf).abs().max())
        assert err < TOL, f"{key}: planes differ by {err:.1e}"
        assert (se is None) == (sf is None) and (se is None or se[:2] == sf[:2]), (key, se, sf)
        if se is not None:
            torch.testing.assert_close(se[2], sf[2], atol=TOL, rtol=0)
    shared = set(eager.drafts) & set(fused.drafts)
    assert len(shared) >= min_drafts, len(shared)
    for key in shared:
        e, f = eager.drafts[key], fused.drafts[key]
        assert e == f, f"{key}: eager drafts {e}, fused {f}"


@pytest.mark.parametrize("kind,D,k", K_CASES, ids=lambda c: str(c))
def test_fused_window_equals_the_eager_window(setups, references, eager_runs, kind, D, k):
    eager = eager_runs(kind, D, k)
    fused = run_case(setups, kind, D, k, graphs=True)
    for run in (eager, fused):
        assert run.outputs == references[kind]
        assert run.engine.runner.draft_failures.total == 0
        assert not run.rec.errors, run.rec.errors[:3]
        assert not run.rec.oracle.kv_errors
    # (the propose-wrapping oracle's stash check assumes it saw every window: eager only)
    assert not eager.rec.oracle.stash_errors, eager.rec.oracle.stash_errors[:3]
    eng = fused.engine
    steps = eng.runner.fused
    # the scenario: preemption, prefix hits, prefill chunks; most decode steps fused
    assert fused.stats["num_preemptions_total"] > 0 and eng.kv.prefix_cache_hit_tokens > 0
    assert eng.runner.path_steps["varlen_graph"] > 0
    other = eng.runner.path_steps["decode_graph"] + eng.runner.path_steps["eager"]
    assert steps.replays > 10 and steps.replays > 4 * other, (steps.replays,
                                                              eng.runner.path_steps)
    # step by step: the same plane, stash and drafts at the same point of each request
    assert_same_steps(eager.rec, fused.rec, min_states=51, min_drafts=31)
    assert fused.stats["spec"]["num_accepted_tokens"] > 0


def test_fused_window_chains_with_overlap(setups, references, eager_runs):
    """With overlap the window's steps chain (the stash stays on the device between them);
    the output is the target's and the drafts the eager window's."""
    eager = eager_runs("bigram", 3, 3)
    fused = run_case(setups, "bigram", 3, 3, graphs=True, overlap=True)
    assert fused.outputs == references["bigram"]
    steps = fused.engine.runner.fused
    assert steps.chained > 5 and steps.replays > 10, (steps.chained, steps.replays)
    shared = set(eager.rec.drafts) & set(fused.rec.drafts)
    assert len(shared) > 30
    assert all(eager.rec.drafts[key] == fused.rec.drafts[key] for key in shared)


def test_fused_window_narrower_than_k_leaves_stale_entries(setups):
    """Negative control: the graph's window with K - 1 rows of width leaves a rejected
    draft's entry at the deepest module, and the dense oracle sees it in the fused steps."""
    run = run_case(setups, "random", 3, 3, graphs=True, window=2)
    assert run.engine.runner.fused.replays > 10
    assert run.rec.errors, "the oracle missed stale entries of a too-narrow fused window"
    assert all("module 2" in e for e in run.rec.errors if "module" in e), run.rec.errors[:3]


def test_fused_window_after_a_window_without_a_stash(setups):
    """The stash's start where the window's start lo, not e - W, sets it. W = K = 3: a
    decode window with no stash (lo = s) that accepts nothing keeps a stash of position s
    only, and the next step, accepting nothing again, starts at that stash's start (lo = s >
    e - W = s - 1) and keeps s .. s + 1. Windows with no stash run only after an admission,
    which computes more than a block (the prefix-cache trim), so the stash holds W positions
    before any decode step and the scenarios above never get here; so both engines drop one
    request's stash after the same step (as a preemption invalidates it, without the
    recompute). The entries that the stashless window leaves below s are stale (the dense
    oracle sees them at modules >= 1, and their effect on later entries, in both engines
    alike); what is checked is that the fused window does exactly what the eager one does:
    the same stash (start, end, the target's hiddens), plane and drafts, step by step."""
    K, prompt = 3, repetitive_prompts(1, 5, period=4, repeats=3)[0]  # 12 tokens
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    drop_at = len(prompt) + 2  # committed length at which the stash is dropped (e = f - 1)

    def drop(engine):  # both engines: after the same step of the same request
        for req in engine.scheduler.running:
            st = engine.runner.proposer.stash.get(req.request_id)
            if st is not None:  # whose window kept it: the fused graph's leaves it there
                on_device[engine][st.end] = st.hidden is None
            if req.num_tokens == drop_at and req.request_id not in dropped[engine]:
                dropped[engine].add(req.request_id)
                prop = engine.runner.proposer
                prop.stash.pop(req.request_id)
                if prop.device_stash is not None:
                    prop.device_stash.forget(req.request_id)

    dropped, on_device, runs = {}, {}, {}
    for graphs in (False, True):
        def after(engine):
            dropped.setdefault(engine, set())
            on_device.setdefault(engine, {})
            drop(engine)
        runs[graphs] = run_case(setups, "random", K, K, graphs=graphs, scenario=[[prompt]],
                                params=params, after_step=after)
    eager, fused = runs[False], runs[True]
    assert eager.outputs == fused.outputs
    rid, (model, cfg, _) = "w0-0", setups["random"][0]
    assert all(dropped[run.engine] == {rid} for run in (eager, fused))
    assert fused.engine.runner.fused.replays >= 4, fused.engine.runner.path_steps
    for run in (eager, fused):
        assert run.engine.runner.draft_failures.total == 0
        assert not [e for e in run.rec.errors if "stash" in e], run.rec.errors
        assert not [e for e in run.rec.errors if "module 0" in e], run.rec.errors
        # the random head's drafts are rejected: one position a step from the drop on
        states = {e: v for (r, e, f), v in run.rec.states.items() if r == rid and f == e + 1}
        s = drop_at - 1  # the stashless window's first position
        want = {s + 1: (s, s + 1), s + 2: (s, s + 2), s + 3: (s, s + 3), s + 4: (s + 1, s + 4)}
        got = {e: states[e][1][:2] for e in want if e in states}
        assert got == want, (run is fused, got)
        if run is fused:  # the fused window kept these stashes (in its device buffers)
            assert all(on_device[run.engine][e] for e in want), on_device[run.engine]
        hidden = dense_target(model, cfg, (list(prompt) + run.outputs[0])[:s + 4])[0]
        for e, (start, end) in want.items():
            torch.testing.assert_close(states[e][1][2], hidden[start:end], atol=TOL, rtol=0)
    assert_same_steps(eager.rec, fused.rec, min_states=6, min_drafts=5)
