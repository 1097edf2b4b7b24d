"""Verification: greedy prefix match, lossless rejection sampling (chi-square against the target
distribution, with negative controls), relaxed acceptance and the thinking-span tracker."""

import pytest
import torch

from outpace.errors import ConfigError
from outpace.speculative.verify import (ThinkingSpanTracker, draw_verify_randomness,
                                 greedy_verify, greedy_verify_batched, rejection_verify,
                                 rejection_verify_batched, relaxed_accept,
                                 relaxed_accept_batched)

V = 8


def chi2_stat(counts: torch.Tensor, probs: torch.Tensor) -> tuple:
    """Pearson chi-square statistic and degrees of freedom; cells with expected count < 5 are
    pooled into one. A count where probs is 0 gives an infinite statistic."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    if counts[probs == 0].sum() > 0:
        return float("inf"), 1  # a token the distribution can't produce was emitted
    expected = probs * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    obs, exp = obs[exp > 0], exp[exp > 0]
    return float(((obs - exp) ** 2 / exp).sum()), obs.numel() - 1


def _pvalue(stat: float, dof: int) -> float:
    if dof <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return _pvalue(*chi2_stat(counts, probs))


def chi2_pvalue_rows(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of each row of counts [R, V] to its row of probs [R, V], pooled (the
    statistics and degrees of freedom of independent rows add up)."""
    stats = [chi2_stat(c, p) for c, p in zip(counts, probs) if c.sum() > 0]
    return _pvalue(sum(s for s, _ in stats), sum(d for _, d in stats))


def dist(seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.softmax(torch.randn(V, generator=torch.Generator().manual_seed(seed)) * scale, -1)


# ---------------------------------------------------------------- greedy

@pytest.mark.parametrize("drafts, expected", [
    ([5, 6, 7], ([5, 6, 7, 8], 3)),  # all accepted -> bonus
    ([1, 6, 7], ([5], 0)),  # first rejected -> recovered target argmax
    ([5, 9, 7], ([5, 6], 1)),  # middle rejected (a later match doesn't count)
    ([5, 6, 1], ([5, 6, 7], 2)),  # last rejected
])
def test_greedy_verify(drafts, expected):
    assert greedy_verify(torch.tensor([5, 6, 7, 8]), drafts) == expected


def test_greedy_verify_no_drafts():
    assert greedy_verify(torch.tensor([4]), []) == ([4], 0)
    with pytest.raises(ValueError):
        greedy_verify(torch.tensor([4, 5]), [])


def test_greedy_verify_batched_matches_per_row():
    g = torch.Generator().manual_seed(0)
    b, k = 64, 5
    target = torch.randint(0, V, (b, k + 1), generator=g)
    # A good drafter: 85% of drafts match, so every acceptance length occurs.
    good = torch.rand(b, k, generator=g) < 0.85
    drafts = torch.where(good, target[:, :k], torch.randint(0, V, (b, k), generator=g))
    num = torch.randint(0, k + 1, (b,), generator=g)
    # Padding equal to the target argmax must still not be accepted.
    pad = torch.arange(k).unsqueeze(0) >= num.unsqueeze(1)
    drafts = torch.where(pad, target[:, :k], drafts)
    out, acc = greedy_verify_batched(target, drafts, num)
    for i in range(b):
        n = int(num[i])
        toks, a = greedy_verify(target[i, :n + 1], drafts[i, :n])
        assert int(acc[i]) == a
        assert out[i, :a + 1].tolist() == toks
        assert torch.all(out[i, a + 1:] == -1)
    assert set(acc.tolist()) == set(range(k + 1))  # every acceptance length was exercised


def test_greedy_verify_batched_relaxed_mask():
    target = torch.tensor([[1, 2, 3, 4]])
    drafts = torch.tensor([[1, 9, 3]])
    relaxed = torch.tensor([[False, True, False]])
    out, acc = greedy_verify_batched(target, drafts, torch.tensor([3]), relaxed)
    assert acc.tolist() == [3] and out.tolist() == [[1, 9, 3, 4]]  # relaxed draft is emitted


class _NoHostSync:
    """Makes every host-syncing tensor call raise, to prove the batched paths use none."""

    NAMES = ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__",
             "__index__")

    def __enter__(self):
        self.saved = {n: getattr(torch.Tensor, n) for n in self.NAMES}

        def boom(*a, **k):
            raise AssertionError("host sync in a batched verify path")
        for n in self.NAMES:
            setattr(torch.Tensor, n, boom)

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(torch.Tensor, n, f)


def test_batched_paths_have_no_host_sync():
    g = torch.Generator().manual_seed(1)
    b, k = 4, 3
    probs = torch.softmax(torch.randn(b, k + 1, V, generator=g), -1)
    drafts = torch.randint(0, V, (b, k), generator=g)
    num = torch.tensor([3, 0, 2, 1])
    uniforms, noise = draw_verify_randomness([None, make_gen(1), None, make_gen(2)], k, V, "cpu")
    with _NoHostSync():
        greedy_verify_batched(probs.argmax(-1), drafts, num)
        relaxed = relaxed_accept_batched(probs, drafts, 3, 0.2)
        rejection_verify_batched(probs, drafts, None, num, uniforms, noise, relaxed)
        rejection_verify_batched(probs, drafts, probs[:, :k], num, uniforms, noise)
    with pytest.raises(AssertionError), _NoHostSync():
        torch.tensor([1]).item()


def make_gen(seed):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- rejection sampling

def run_batched(p_rows, q_rows, n, seed, k=1, one_hot_draft=None, relaxed=None):
    """n independent verify steps with target [n, k+1, V] and drafter q [n, k, V] (or a
    deterministic drafter proposing `one_hot_draft`). Drafts are drawn from q, as a real
    drafter would."""
    g = make_gen(seed)
    if one_hot_draft is not None:
        drafts = torch.full((n, k), one_hot_draft)
        q = None
    else:
        q = q_rows
        drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(n, k)
    uniforms = torch.rand(n, k, generator=g)
    noise = torch.empty(n, V).exponential_(generator=g)
    return rejection_verify_batched(p_rows, drafts, q, torch.full((n,), k), uniforms, noise,
                                    relaxed)


P = dist(10)
LOW = int(P.argmin())
Q_CASES = {
    "q_equals_p": P.clone(),
    "uniform": torch.full((V,), 1.0 / V),
    "peaked_on_low_p": torch.full((V,), 0.1 / (V - 1)).index_fill(0, torch.tensor([LOW]), 0.9),
    "sharper_than_p": dist(10, 3.0),
}
N = 20000


@pytest.mark.parametrize("seed, name", list(enumerate(Q_CASES)))
def test_first_token_follows_target(seed, name):
    q = Q_CASES[name]
    out, acc = run_batched(P.expand(N, 2, V), q.expand(N, 1, V), N, seed=seed)
    assert chi2_pvalue(torch.bincount(out[:, 0], minlength=V), P) > 1e-3
    if name != "q_equals_p":
        assert chi2_pvalue(torch.bincount(out[:, 0], minlength=V), q) < 1e-6
    else:
        assert torch.all(acc == 1)  # p == q accepts every draft


def test_first_token_follows_target_with_disjoint_support():
    p = torch.tensor([0.4, 0.3, 0.2, 0.1, 0, 0, 0, 0])
    q = torch.tensor([0, 0, 0, 0, 0.1, 0.2, 0.3, 0.4])
    out, acc = run_batched(p.expand(N, 2, V), q.expand(N, 1, V), N, seed=3)
    assert torch.all(acc == 0)  # nothing q proposes is possible under p
    assert chi2_pvalue(torch.bincount(out[:, 0], minlength=V), p) > 1e-3


@pytest.mark.parametrize("draft", [int(P.argmax()), LOW])
def test_first_token_follows_target_with_greedy_drafter(draft):
    out, _ = run_batched(P.expand(N, 2, V), None, N, seed=draft, one_hot_draft=draft)
    assert chi2_pvalue(torch.bincount(out[:, 0], minlength=V), P) > 1e-3


def test_position_dependent_second_and_bonus_tokens():
    """k=2 with a target whose distribution depends on the previous token: the emitted pair
    (first, second) must follow p0(a) * P1[a](b), and the bonus must follow P2[previous]."""
    n, g = 40000, make_gen(11)
    p0 = dist(20)
    p1 = torch.stack([dist(100 + a) for a in range(V)])  # [V(prev), V]
    p2 = torch.stack([dist(200 + a, 0.5) for a in range(V)])
    q0 = dist(30, 0.5)
    q1 = torch.stack([dist(300 + a, 2.0) for a in range(V)])
    d0 = torch.multinomial(q0.expand(n, V), 1, generator=g).squeeze(1)
    d1 = torch.multinomial(q1[d0], 1, generator=g).squeeze(1)
    target = torch.stack([p0.expand(n, V), p1[d0], p2[d1]], dim=1)  # [n, 3, V]
    drafts = torch.stack([d0, d1], 1)
    q = torch.stack([q0.expand(n, V), q1[d0]], dim=1)
    uniforms = torch.rand(n, 2, generator=g)
    noise = torch.empty(n, V).exponential_(generator=g)
    out, acc = rejection_verify_batched(target, drafts, q, torch.full((n,), 2), uniforms, noise)
    # Where the step stopped after one token, the next step would draw from P1[first] afresh.
    nxt = torch.multinomial(p1[out[:, 0]], 1, generator=g).squeeze(1)
    second = torch.where(acc >= 1, out[:, 1], nxt)
    pair = torch.bincount(out[:, 0] * V + second, minlength=V * V)
    assert chi2_pvalue(pair, (p0[:, None] * p1).flatten()) > 1e-3
    # Conditional on the first draft being accepted, the second token alone follows P1[first].
    sel = acc >= 1
    cond = torch.bincount(out[sel, 0] * V + out[sel, 1], minlength=V * V).view(V, V).double()
    assert chi2_pvalue_rows(cond, p1) > 1e-3
    # The bonus (all accepted) follows P2[second].
    sel = acc == 2
    bonus = torch.bincount(out[sel, 1] * V + out[sel, 2], minlength=V * V).view(V, V).double()
    assert chi2_pvalue_rows(bonus, p2) > 1e-3
    assert int(sel.sum()) > 2000  # the bonus path was exercised


def test_negative_controls_position_dependent():
    """The k=2 checks catch a verifier that reads the wrong target position."""
    n, g = 20000, make_gen(12)
    p0, q0 = dist(20), dist(30, 0.5)
    p1 = torch.stack([dist(100 + a) for a in range(V)])
    p2 = torch.stack([dist(200 + a, 0.5) for a in range(V)])
    d = torch.multinomial(q0.expand(n, V), 2, replacement=True, generator=g)  # [n, 2]
    q = q0.expand(n, 2, V)
    uniforms, noise = torch.rand(n, 2, generator=g), torch.empty(n, V).exponential_(generator=g)
    # Bonus drawn from position k-1 instead of k (an off-by-one).
    shifted = torch.stack([p0.expand(n, V), p1[d[:, 0]], p1[d[:, 0]]], dim=1)
    out, acc = rejection_verify_batched(shifted, d, q, torch.full((n,), 2), uniforms, noise)
    sel = acc == 2
    bonus = torch.bincount(out[sel, 1] * V + out[sel, 2], minlength=V * V).view(V, V)
    assert chi2_pvalue_rows(bonus, p2) < 1e-6
    # Second position scored without the first draft as context.
    flat = torch.stack([p0.expand(n, V), p1[0].expand(n, V), p2[d[:, 1]]], dim=1)
    out, acc = rejection_verify_batched(flat, d, q, torch.full((n,), 2), uniforms, noise)
    sel = acc >= 1
    cond = torch.bincount(out[sel, 0] * V + out[sel, 1], minlength=V * V).view(V, V)
    assert chi2_pvalue_rows(cond, p1) < 1e-6


def test_negative_controls_fail_the_same_test():
    """Deliberately wrong samplers must be caught by the chi-square test used above."""
    q = Q_CASES["uniform"]
    # Always accept (relaxed everywhere): the first token follows q.
    out, _ = run_batched(P.expand(N, 2, V), q.expand(N, 1, V), N, seed=5,
                         relaxed=torch.ones(N, 1, dtype=torch.bool))
    assert chi2_pvalue(torch.bincount(out[:, 0], minlength=V), P) < 1e-6
    # Recover from p instead of norm(max(p - q, 0)): biased towards q's mass.
    g = make_gen(6)
    d = torch.multinomial(q.expand(N, V), 1, generator=g).squeeze(1)
    accept = torch.rand(N, generator=g) * q[d] < P[d]
    wrong = torch.where(accept, d, torch.multinomial(P.expand(N, V), 1, generator=g).squeeze(1))
    assert chi2_pvalue(torch.bincount(wrong, minlength=V), P) < 1e-6
    # Accept with probability p(d), ignoring q.
    accept = torch.rand(N, generator=g) < P[d]
    res = (P - q).clamp(min=0)
    wrong = torch.where(accept, d, torch.multinomial(res.expand(N, V), 1, generator=g).squeeze(1))
    assert chi2_pvalue(torch.bincount(wrong, minlength=V), P) < 1e-6


def test_rejection_verify_single_row():
    q = Q_CASES["peaked_on_low_p"]
    target = torch.stack([P, dist(40), dist(41)])  # [k+1=3, V]
    g = make_gen(8)
    first = []
    for _ in range(3000):
        drafts = torch.multinomial(q, 2, replacement=True, generator=g)
        toks, acc = rejection_verify(target, drafts, q.expand(2, V), g)
        assert len(toks) == acc + 1 and toks[:acc] == drafts[:acc].tolist()
        first.append(toks[0])
    assert chi2_pvalue(torch.bincount(torch.tensor(first), minlength=V), P) > 1e-3
    # Same generator state -> same result; one-hot drafter and k = 0 work.
    a = rejection_verify(target, [1, 2], None, make_gen(3))
    assert a == rejection_verify(target, [1, 2], None, make_gen(3))
    toks, acc = rejection_verify(target[:1], [], None, make_gen(3))
    assert acc == 0 and len(toks) == 1


def test_rejection_batched_equals_single_rows_and_seeds_are_batch_independent():
    g = make_gen(9)
    b, k = 6, 3
    target = torch.softmax(torch.randn(b, k + 1, V, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(b, k, V, generator=g), -1)
    drafts = torch.multinomial(q.view(-1, V), 1, generator=g).view(b, k)
    num = torch.tensor([3, 2, 0, 3, 1, 3])
    gens = [make_gen(1000 + i) for i in range(b)]
    uniforms, noise = draw_verify_randomness(gens, k, V, "cpu")
    out, acc = rejection_verify_batched(target, drafts, q, num, uniforms, noise)
    for i in range(b):
        n = int(num[i])
        toks, a = rejection_verify(target[i, :n + 1], drafts[i, :n], q[i, :n],
                                   make_gen(1000 + i) if n == k else None)
        if n == k:  # same seed, same number of draws -> same result as alone
            assert (toks, a) == (out[i, :a + 1].tolist(), int(acc[i]))
        assert int(acc[i]) <= n and torch.all(out[i, int(acc[i]) + 1:] == -1)


# ---------------------------------------------------------------- relaxed acceptance

ROW = torch.tensor([0.5, 0.3, 0.15, 0.05])


@pytest.mark.parametrize("draft, top_k, delta, ok", [
    (0, 1, 0.0, True),  # the top-1 itself
    (1, 2, 0.25, True),
    (1, 2, 0.1, False),  # too far below the top-1
    (2, 2, 1.0, False),  # not in the top-2
    (2, 3, 0.4, True),
    (3, 4, 0.4, False),
])
def test_relaxed_accept(draft, top_k, delta, ok):
    assert relaxed_accept(ROW, draft, top_k, delta) is ok


def test_relaxed_accept_validation_and_batched():
    with pytest.raises(ConfigError):
        relaxed_accept(ROW, 0, 0, 0.1)
    with pytest.raises(ConfigError):
        relaxed_accept(ROW, 0, 2, -0.1)
    g = make_gen(12)
    probs = torch.softmax(torch.randn(5, 4, V, generator=g), -1)
    drafts = torch.randint(0, V, (5, 3), generator=g)
    eligible = torch.rand(5, 3, generator=g) < 0.7
    out = relaxed_accept_batched(probs, drafts, 3, 0.3, eligible)
    for b in range(5):
        for i in range(3):
            ref = relaxed_accept(probs[b, i], int(drafts[b, i]), 3, 0.3) and bool(eligible[b, i])
            assert bool(out[b, i]) == ref


def test_relaxed_accept_in_rejection_verify():
    # A one-hot drafter proposing the second-best token: lossless acceptance happens with
    # probability p(d) only; relaxed acceptance takes it every time.
    target = torch.tensor([[0.5, 0.4, 0.1, 0, 0, 0, 0, 0]] * 2).unsqueeze(0)  # [1, 2, V]
    drafts = torch.tensor([[1]])
    relaxed = relaxed_accept_batched(target, drafts, 2, 0.2)
    uniforms = torch.full((1, 1), 0.99)  # would reject losslessly
    noise = torch.ones(1, V)
    out, acc = rejection_verify_batched(target, drafts, None, torch.tensor([1]), uniforms, noise)
    assert acc.tolist() == [0] and out[0, 0] != 1
    out, acc = rejection_verify_batched(target, drafts, None, torch.tensor([1]), uniforms, noise,
                                        relaxed)
    assert acc.tolist() == [1] and out[0, 0] == 1


# ---------------------------------------------------------------- thinking spans

def test_thinking_span_tracker():
    t = ThinkingSpanTracker(begin_token_ids=10, end_token_ids=11)
    assert not t.inside
    t.update([1, 10, 2])
    assert t.inside
    assert t.relaxed_eligible([3, 11, 4]) == [True, False, False]
    assert t.inside  # relaxed_eligible doesn't change the state
    t.update([5, 11])
    assert not t.inside
    assert t.relaxed_eligible([10, 3, 11]) == [False, True, False]
    t.update([10, 10])  # a repeated begin stays inside
    assert t.inside


def test_thinking_span_tracker_several_ids_and_rebuild():
    t = ThinkingSpanTracker.from_tokens([10, 12], [11, 13], [1, 12, 4, 13, 10])
    assert t.inside
    assert ThinkingSpanTracker([10], [11], inside=True).inside
    with pytest.raises(ConfigError):
        ThinkingSpanTracker(10, 10)
    with pytest.raises(ConfigError):
        ThinkingSpanTracker([], [11])
