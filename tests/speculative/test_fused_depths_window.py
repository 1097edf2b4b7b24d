"""MTP depths mode in the fused graph (outpace/runner/fused_depths_window.py), on the CPU
stand-in of CUDA graphs (fake_graph_capture): the window with its geometry computed on the
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

from tests.speculative.spec_helpers import dense_target, run_waves
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


def run_case(setups, kind, D, k, graphs: bool, overlap: bool = False, window=None):
    loaded, heads = setups[kind]
    rec = StepRecorder(loaded)

    def on_engine(engine):
        if window is not None:
            engine.runner.proposer.window = window
        if graphs:
            engine.runner.enable_cuda_graphs(tuple(range(1, k + 2)), capture_fused=True)
        rec.attach(engine)

    run = run_waves(loaded, waves(), GREEDY, on_engine=on_engine, after_step=rec,
                    speculative_config=spec_config(heads[D], k, False), overlap=overlap,
                    **ENGINE_G)
    run.rec = rec
    return run


@pytest.fixture(scope="module")
def references(setups):
    return {kind: run_waves(setups[kind][0], waves(), GREEDY, **ENGINE_G).outputs
            for kind in setups}


@pytest.mark.parametrize("kind,D,k", K_CASES, ids=lambda c: str(c))
def test_fused_window_equals_the_eager_window(setups, references, fake_graph_capture, kind, D,
                                             k):
    eager = run_case(setups, kind, D, k, graphs=False)
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
    common = set(eager.rec.states) & set(fused.rec.states)
    assert len(common) > 50, len(common)
    for key in sorted(common):
        (pe, se), (pf, sf) = eager.rec.states[key], fused.rec.states[key]
        err = float((pe - pf).abs().max())
        assert err < TOL, f"{key}: planes differ by {err:.1e}"
        assert (se is None) == (sf is None) and (se is None or se[:2] == sf[:2]), (key, se, sf)
        if se is not None:
            torch.testing.assert_close(se[2], sf[2], atol=TOL, rtol=0)
    shared = set(eager.rec.drafts) & set(fused.rec.drafts)
    assert len(shared) > 30, len(shared)
    for key in shared:
        e, f = eager.rec.drafts[key], fused.rec.drafts[key]
        assert e == f, f"{key}: eager drafts {e}, fused {f}"
    assert fused.stats["spec"]["num_accepted_tokens"] > 0


def test_fused_window_chains_with_overlap(setups, references, fake_graph_capture):
    """With overlap the window's steps chain (the stash stays on the device between them);
    the output is the target's and the drafts the eager window's."""
    eager = run_case(setups, "bigram", 3, 3, graphs=False)
    fused = run_case(setups, "bigram", 3, 3, graphs=True, overlap=True)
    assert fused.outputs == references["bigram"]
    steps = fused.engine.runner.fused
    assert steps.chained > 5 and steps.replays > 10, (steps.chained, steps.replays)
    shared = set(eager.rec.drafts) & set(fused.rec.drafts)
    assert len(shared) > 30
    assert all(eager.rec.drafts[key] == fused.rec.drafts[key] for key in shared)


def test_fused_window_narrower_than_k_leaves_stale_entries(setups, fake_graph_capture):
    """Negative control: the graph's window with K - 1 rows of width leaves a rejected
    draft's entry at the deepest module, and the dense oracle sees it in the fused steps."""
    run = run_case(setups, "random", 3, 3, graphs=True, window=2)
    assert run.engine.runner.fused.replays > 10
    assert run.rec.errors, "the oracle missed stale entries of a too-narrow fused window"
    assert all("module 2" in e for e in run.rec.errors if "module" in e), run.rec.errors[:3]
