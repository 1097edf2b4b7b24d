"""MTP depths mode (outpace/speculative/mtp_window.py): lossless, an exact draft plane, the stash.

Every run goes through the real engine (CPU fp32, tiny targets) in one scenario with prefill
chunks mixed into decode steps, prefix-cache hits and preemption, and must give the greedy
output of the same engine without speculation. An oracle wraps the proposer and, after every
step and for every request, recomputes each module's draft KV densely (exact target hiddens of
one dense forward; module d over positions i < min(e, f-1-d), whose tokens t[i+d+1] are all
committed) and compares it with the pool through the request's block table. Entries the request
wrote itself must all be exact, so no rejected draft's entry is ever left behind below the next
window; entries inherited from a prefix hit are checked separately (see test_prefix_hit_inherits_exact_draft_entries). It also
checks the stash: target hiddens of the last K computed positions.

Two set-ups: the peaked tiny target with a random head (drafts nearly always rejected), and an
embedding-dominated twin with a "bigram" head (drafts often accepted at every depth). Negative
controls show the oracle finds the stale entries of a window one row too narrow and of running
all D modules with a k-row window.
"""

from __future__ import annotations

import pytest
import torch

from outpace import SamplingParams
from outpace.attention.base import AttentionMetadata, ForwardContext
from outpace.attention.torch_ref import TorchRefBackend
from outpace.models.draft_loader import mtp_config_dict, save_draft_head
from outpace.models.mtp import MTPHead
from outpace.training.init_draft import random_head_tensors
from tests.speculative.spec_helpers import (EXACT_DRAFTS, MIN_MARGIN, TINY_BLOCK, dense_target,
                                            first_divergence, min_greedy_margin,
                                            repetitive_prompts, run_waves, tiny_target)

ENGINE = dict(block_size=TINY_BLOCK, max_num_batched_tokens=16, num_kv_blocks=40)
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
TOL = 1e-4  # batched vs dense fp32 differ ~1e-6; an entry built from a wrong token by ~1e-1

# (target, D modules, k drafts, suffix enhancer); the "peaked" target gets the random head
# (drafts nearly always rejected), the "bigram" one the bigram head (long accepted runs)
CASES = [("peaked", 3, 1, False), ("peaked", 3, 3, False), ("peaked", 4, 4, True),
         ("bigram", 2, 2, False), ("bigram", 3, 1, False), ("bigram", 4, 3, False)]


def waves():
    system = repetitive_prompts(1, 99, period=10, repeats=1)[0]  # shared: prefix-cache hits
    first = repetitive_prompts(6, 1, prefix=system)
    return [first, repetitive_prompts(2, 2, prefix=system) + [first[0]]]


def bigram_head_tensors(head: MTPHead, seed: int) -> dict:
    """A head that copies the target's bigram part: eh_proj = [I | small] keeps the embedding
    of the input token, the layer adds little, so logits ~ lm_head(norm(embed(t))) like the
    (embedding-dominated) target's. Attention weights stay random so the KV is not trivial."""
    t = random_head_tensors(head, seed)
    h = head.config.hidden_size
    for d in range(head.num_modules):
        # a little of the hidden, so that a wrong h^0 or h^d shows in the draft KV
        eh = t[f"layers.{d}.eh_proj.weight"]
        t[f"layers.{d}.eh_proj.weight"] = torch.cat([torch.eye(h), eh[:, h:]], dim=1)
        t[f"layers.{d}.self_attn.o_proj.weight"] *= 0.5
        t[f"layers.{d}.mlp.down_proj.weight"] *= 0.5
    return t


@pytest.fixture(scope="module")
def head_dirs(tiny_loaded, tmp_path_factory):
    cfg = tiny_loaded[1]
    root = tmp_path_factory.mktemp("mtp_window_heads")
    out = {}
    for kind in ("random", "bigram"):
        for D in (2, 3, 4):
            head = MTPHead(cfg, D, cfg.num_hidden_layers, device="meta")
            tensors = random_head_tensors(head, 1) if kind == "random" else \
                bigram_head_tensors(head, 1)
            out[kind, D] = save_draft_head(mtp_config_dict(cfg, D), tensors, root / f"{kind}{D}")
    return out


def range_ctx(kv: torch.Tensor, lo: int, hi: int, cfg) -> ForwardContext:
    """One sequence querying positions lo..hi-1 over pool `kv`, position p in slot bs + p."""
    bs, n = kv.shape[3], hi - lo
    backend = TorchRefBackend(kv, cfg.num_attention_heads, cfg.num_key_value_heads,
                              cfg.head_dim, cfg.head_dim ** -0.5)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(bs + lo, bs + hi),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([hi], dtype=torch.int32),
        block_tables=torch.arange(1, hi // bs + 2, dtype=torch.int32).unsqueeze(0),
        query_start_loc_host=[0, n], seq_lens_host=[hi], max_query_len=n, max_seq_len=hi)
    return ForwardContext(backend, meta)


class PlaneOracle:
    """Wraps the proposer's propose(): after each call, checks every request's draft plane and
    stash against dense references. Records problems (the runner swallows exceptions)."""

    def __init__(self, engine, loaded):
        self.engine, (self.model, self.cfg, _) = engine, loaded
        self.proposer = engine.runner.proposer
        self.kv_errors, self.stash_errors = [], []  # entries this request wrote; the stash
        self.inherited_errors = []  # entries below a prefix hit (written by other requests)
        self.num_checked = 0  # (request, depth) pairs with at least one exact entry compared
        self.num_diverted = 0  # drafts sent out that differ from the ones fed to the window
        self._prev, self._admitted = {}, {}
        inner = self.proposer.propose

        def propose(batch, k):
            drafts = inner(batch, k)
            try:
                self.check(batch, drafts)
            except Exception as e:  # noqa: BLE001 - report, the runner would hide it
                self.kv_errors.append(f"oracle raised {e!r}")
            return drafts

        self.proposer.propose = propose

    @torch.inference_mode()
    def check(self, batch, drafts) -> None:
        for i, req in enumerate(batch.requests):
            rid, a, n = req.request_id, batch.row_start[i], batch.row_end[i] - batch.row_start[i]
            s = int(batch.positions[a])
            committed = batch.committed[i]
            e = min(s + n, len(committed) - 1)  # KV positions computed after this step
            admitted = self._prev.get(rid) != (s, req.num_preemptions)  # (re)admitted here
            if admitted:
                self._admitted[rid] = s
            self._prev[rid] = (e, req.num_preemptions)
            hidden, _, _ = dense_target(self.model, self.cfg, committed[:e])  # [e, H] exact h^0
            self._check_stash(rid, e, hidden, drafts[i])
            table = torch.tensor(batch.block_ids[i], dtype=torch.long)
            adm = self._admitted[rid]
            # Entries this request wrote (positions >= adm), given the inherited ones below.
            for d, pos, got, want in self._compare(committed, hidden, table, adm, e):
                bad = pos[(got - want).abs().amax(dim=(0, 2, 3)) > TOL].tolist()
                self.num_checked += 1
                if bad:
                    self.kv_errors.append(f"{rid}: module {d} entries at {bad} stale (s={s}, "
                                          f"e={e}, f={len(committed)}, admitted at {adm})")
            if admitted and adm > 0:  # inherited entries, against a full dense recompute
                for d, pos, got, want in self._compare(committed, hidden, table, 0, adm):
                    bad = pos[(got - want).abs().amax(dim=(0, 2, 3)) > TOL].tolist()
                    if bad:
                        self.inherited_errors.append(
                            f"{rid}: module {d} entries at {bad} of a prefix hit at {adm}")

    def _compare(self, committed, hidden, table, lo, hi):
        """Yield (depth, positions, pool K/V, reference K/V) for the exact entries at lo..hi-1:
        module d at i is exact when t[i+d+1] is committed. Entries below lo are taken from the
        pool as they are (the reference continues from them)."""
        cfg, pool, L = self.cfg, self.engine.runner.kv_cache, self.cfg.num_hidden_layers
        K = self.proposer.depth
        ref = torch.zeros(L + K, 2, hi // TINY_BLOCK + 2, TINY_BLOCK, cfg.num_key_value_heads,
                          cfg.head_dim)

        def pool_at(d, pos):  # [2, len(pos), Hkv, D] through the request's block table
            bs = pool.shape[3]
            return pool[L + d][:, table[pos // bs], pos % bs]

        below = torch.arange(lo)
        for d in range(K):
            ref[L + d].flatten(1, 2)[:, TINY_BLOCK:TINY_BLOCK + lo] = pool_at(d, below)
        h = hidden[lo:hi]  # [rows, H]: h^d of positions lo..
        for d in range(K):
            c = min(hi, len(committed) - 1 - d)
            if c <= lo:
                return
            h = self.proposer.head(d, h[:c - lo], torch.tensor(committed[lo + d + 1:c + d + 1]),
                                   torch.arange(lo, c), range_ctx(ref, lo, c, cfg),
                                   embed_fn=self.model.embed_tokens)
            pos = torch.arange(lo, c)
            want = ref[L + d].flatten(1, 2)[:, TINY_BLOCK + lo:TINY_BLOCK + c]
            yield d, pos, pool_at(d, pos), want

    def _check_stash(self, rid, e, hidden, sent) -> None:
        prop = self.proposer
        st = prop.stash.get(rid)
        start = max(e - prop.window, self._admitted[rid], 0)
        if st is None or (st.start, st.end) != (start, e):
            have = None if st is None else (st.start, st.end)
            self.stash_errors.append(f"{rid}: stash covers {have}, want {start}..{e - 1}")
        elif not torch.allclose(st.hidden, hidden[start:e], atol=TOL):
            self.stash_errors.append(f"{rid}: stash hiddens differ from the target's")
        elif st.fed and sent and list(sent[:len(st.fed)]) != st.fed[:len(sent)]:
            self.num_diverted += 1


def spec_config(head_dir, k, enhancer, **opts):
    cfg = {"method": "mtp", "model": str(head_dir), "num_speculative_tokens": k,
           "mtp_mode": "depths", **EXACT_DRAFTS, **opts}
    if enhancer:
        cfg["enhancer_min_match"] = 2
    return cfg


def checked_run(loaded, head_dir, k, enhancer=False, window=None, **opts):
    box = {}

    def on_engine(eng):
        if window is not None:
            eng.runner.proposer.window = window
        box["oracle"] = PlaneOracle(eng, loaded)

    run = run_waves(loaded, waves(), GREEDY, on_engine=on_engine,
                    speculative_config=spec_config(head_dir, k, enhancer, **opts), **ENGINE)
    run.oracle = box["oracle"]
    return run


@pytest.fixture(scope="module")
def targets(tiny_loaded):
    """{"peaked": the shared tiny target, "bigram": its twin with a 10x embedding, whose greedy
    output depends mostly on the last token (what the bigram head copies)}."""
    model, cfg, tok = tiny_target(seed=0)
    with torch.no_grad():
        model.embed_weight.mul_(10.0)
    return {"peaked": tiny_loaded, "bigram": (model, cfg, tok)}


@pytest.fixture(scope="module")
def references(targets):
    out = {}
    prompts = waves()[0] + waves()[1]
    for name, (model, cfg, tok) in targets.items():
        run = run_waves(targets[name], waves(), GREEDY, **ENGINE)
        margin = min_greedy_margin(model, cfg, [p + o for p, o in zip(prompts, run.outputs)],
                                   [len(p) for p in prompts])
        assert margin > MIN_MARGIN, f"{name} reference has a near-tie ({margin:.1e})"
        out[name] = run.outputs
    return out


@pytest.fixture(scope="module")
def runs(targets, head_dirs):
    cache = {}

    def get(case):
        if case not in cache:
            target, D, k, enhancer = case
            head = "random" if target == "peaked" else "bigram"
            cache[case] = checked_run(targets[target], head_dirs[head, D], k, enhancer)
        return cache[case]
    return get


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-D{c[1]}-k{c[2]}"
                         + ("-enhancer" if c[3] else ""))
def test_lossless_exact_plane_and_stash(case, runs, references, targets):
    run = runs(case)
    eng = run.engine
    assert eng.runner.draft_failures.total == 0, "the proposer raised"
    assert run.stats["num_preemptions_total"] > 0, "no preemption: pool too large"
    assert eng.kv.prefix_cache_hit_tokens > 0, "no prefix-cache hit"
    assert run.stats["spec"]["num_draft_tokens"] > 0, "no drafts were proposed"
    model, cfg, _ = targets[case[0]]
    prompts = waves()[0] + waves()[1]
    for p, want, got in zip(prompts, references[case[0]], run.outputs):
        if want != got:
            pytest.fail(first_divergence(model, cfg, p, want, got))
    oracle = run.oracle
    assert oracle.num_checked > 100
    assert not oracle.kv_errors, f"{len(oracle.kv_errors)} stale: {oracle.kv_errors[:3]}"
    assert not oracle.stash_errors, oracle.stash_errors[:3]


@pytest.mark.parametrize("target,D,k", [("peaked", 3, 3), ("bigram", 4, 3)])
def test_drafter_failures_are_repaired(targets, head_dirs, references, target, D, k):
    """Every third window raises (injected), in turn before any depth ran, after depth 0
    rewrote its rows, and after every depth did: the engine recomputes from the draft-plane
    mark, the next window starts from the stash the last good step left, and every entry the
    oracle checks is exact again; the output is the target's and every failure is counted."""
    run = checked_run(targets[target], head_dirs["random" if target == "peaked" else "bigram",
                                                 D], k, inject_draft_failures=3)
    injected = run.engine.runner.proposer.injected
    assert injected.raised >= 10 and run.stats["num_draft_failures_total"] == injected.raised
    assert run.outputs == references[target]
    oracle = run.oracle
    assert oracle.num_checked > 100
    assert not oracle.kv_errors, f"{len(oracle.kv_errors)} stale: {oracle.kv_errors[:3]}"
    assert not oracle.stash_errors, oracle.stash_errors[:3]
    # (a step that starts above the last checked one looks like an admission to the oracle:
    # what lies below it is checked as inherited)
    assert not oracle.inherited_errors, oracle.inherited_errors[:3]
    assert run.stats["num_preemptions_total"] > 0


def test_both_paths_are_exercised(runs):
    """The random head's drafts are rejected, the bigram head's often accepted at every depth,
    and the enhancer sends drafts other than the fed ones: the checks above cover all three."""
    rejected = runs(("peaked", 3, 3, False)).stats["spec"]
    assert rejected["acceptance_rate"] < 0.2, rejected
    accepted = runs(("bigram", 4, 3, False)).stats["spec"]
    assert accepted["mean_acceptance_length"] > 1.5, accepted
    assert min(accepted["accepted_per_position"]) > 5, accepted
    assert runs(("peaked", 4, 4, True)).oracle.num_diverted > 0


def test_window_narrower_than_k_leaves_stale_entries(targets, head_dirs):
    """Negative control: with K-1 rows per window a rejected draft's entry at the deepest
    module survives below the next window, and the oracle sees it (outputs stay lossless)."""
    run = checked_run(targets["peaked"], head_dirs["random", 3], 3, window=2)
    assert run.oracle.kv_errors, "the oracle missed stale entries of a too-narrow window"
    assert all("module 2" in e for e in run.oracle.kv_errors), run.oracle.kv_errors[:3]


def test_prefix_hit_inherits_exact_draft_entries(runs):
    run = runs(("bigram", 4, 3, False))
    assert not run.oracle.inherited_errors, run.oracle.inherited_errors[:3]


def test_all_modules_with_a_k_row_window_leave_stale_entries(targets, head_dirs, monkeypatch):
    """Why only the first k modules run: module d's entry at i reads t[i+d+1], so a rejected
    draft taints rows down to f_new - 1 - D at the deepest module, below a k-row window when
    k < D. Running all D modules (3) with W = k (1) leaves stale entries; only d >= k do."""
    import outpace.speculative.mtp_window as mtp_window

    class AllModules(mtp_window.MTPWindowProposer):
        def __init__(self, spec, policy, target, head):
            super().__init__(spec, policy, target, head)
            self.depth = self.num_kv_layers = head.num_modules  # the window stays k rows

    monkeypatch.setattr(mtp_window, "MTPWindowProposer", AllModules)
    run = checked_run(targets["peaked"], head_dirs["random", 3], 1)
    errors = run.oracle.kv_errors
    assert errors and not any("module 0" in e for e in errors), errors[:3]


def test_k_larger_than_block_size_is_refused(tiny_loaded, head_dirs):
    from outpace.errors import ConfigError
    from tests.engine_helpers import make_engine
    with pytest.raises(ConfigError, match="block_size"):
        make_engine(tiny_loaded, block_size=2, num_kv_blocks=64,
                    speculative_config=spec_config(head_dirs["random", 3], 3, False))


def test_padded_graph_steps(targets, head_dirs):
    """Decode/verify steps padded to a captured query length and batch bucket (CUDA graphs;
    on CPU a stand-in re-runs the captured function on replay), which run the fused step's
    window (runner/fused_depths_window.py): padding rows must not shift a request's window.
    Output and draft plane as in eager mode."""
    from tests.engine_helpers import make_engine, run_batch
    from tests.speculative.conftest import rerun_capture
    loaded = targets["bigram"]
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11], [12, 13, 14, 15, 16, 12, 13, 14]]
    want = run_batch(make_engine(loaded, max_num_seqs=8), prompts, GREEDY)
    eng = make_engine(loaded, max_num_seqs=8, block_size=TINY_BLOCK,
                      speculative_config=spec_config(head_dirs["bigram", 3], 3, False))
    eng.runner.enable_cuda_graphs((1, 2, 3, 4), capture=rerun_capture)
    oracle = PlaneOracle(eng, loaded)
    padded = []  # (requests, bucket) of each fused step launched from the host
    inner = eng.runner.fused.launch
    eng.runner.fused.launch = lambda plan, hb, q: (
        lambda out: (padded.append((len(plan.scheduled), out.key[0])), out)[1])(
            inner(plan, hb, q))
    assert run_batch(eng, prompts, GREEDY) == want
    assert (3, 4) in padded, "no padded batch went through a graph"
    assert eng.stats()["spec"]["num_accepted_tokens"] > 0
    assert not oracle.kv_errors and not oracle.stash_errors, oracle.kv_errors[:3]
