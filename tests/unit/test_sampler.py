"""Sampler and logits processing: masks on handcrafted logits, penalties against a per-row
reference, seeds and positions (the race, sample/gumbel.py), empirical distributions (chi-square)
and logprobs."""

import math

import pytest
import torch

from outpace.sample.logits_processing import SamplingRow, process_logits
from outpace.sample.sampler import Sampler, probs_from_processed
from outpace.types import SamplingParams


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells with expected count < 5 are pooled."""
    counts, probs = counts.double(), probs.double()
    if counts[probs == 0].sum() > 0:
        return 0.0  # a token the distribution can't produce was drawn
    expected = probs * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def row(**kw) -> SamplingRow:
    history = kw.pop("history", [])
    prompt_len = kw.pop("prompt_len", 0)
    race_seed = kw.pop("race_seed", None)
    return SamplingRow(SamplingParams(**kw), history, prompt_len, race_seed)


# Handcrafted distribution, stored out of rank order so masks must find the ranks themselves.
PROBS = [0.05, 0.4, 0.02, 0.15, 0.25, 0.03, 0.1]  # ranks: 1, 4, 3, 6, 0, 5, 2
LOGITS = torch.log(torch.tensor(PROBS)).unsqueeze(0)  # [1, 7]


def kept(**kw) -> set:
    out = process_logits(LOGITS, [row(**kw)])
    return set(torch.nonzero(torch.isfinite(out[0])).flatten().tolist())


def test_greedy_is_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    rows = [row(temperature=0.0, top_k=k) for k in (0, 1, 3, 0, 5, 2)]
    out = Sampler(seed=0)(logits, rows)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    # Greedy rows get no temperature or mask: processed == raw logits.
    assert torch.equal(out.processed_logits, logits)


@pytest.mark.parametrize("kw, expected", [
    (dict(top_k=3), {1, 4, 3}),
    (dict(top_k=1), {1}),
    (dict(top_k=100), set(range(7))),
    (dict(top_p=0.5), {1, 4}),  # mass above: 0, .4 | .65
    (dict(top_p=0.7), {1, 4, 3}),  # 0, .4, .65 | .8
    (dict(top_p=1.0), set(range(7))),
    (dict(min_p=0.3), {1, 4, 3}),  # p >= .12
    (dict(min_p=0.5), {1, 4}),  # p >= .2
    (dict(top_k=4, top_p=0.7), {1, 4}),  # after top-4 renorm: .444, .278 | .167: top-p on the rest
    (dict(temperature=0.5, top_p=0.7), {1, 4}),  # sharper: .618, .242 | ...
    (dict(top_k=5, min_p=0.2), {1, 4, 3, 6}),  # min-p .08 drops .05 (top-5 already dropped .03)
    (dict(temperature=0.0, top_k=1, top_p=0.1, min_p=0.9), set(range(7))),  # greedy: no masks
])
def test_masks_keep_expected_tokens(kw, expected):
    assert kept(**kw) == expected


def test_temperature_scales_kept_logits():
    out = process_logits(LOGITS, [row(temperature=2.0, top_k=3)])
    keep = torch.isfinite(out[0])
    assert torch.allclose(out[0][keep], LOGITS[0][keep] / 2.0)
    assert torch.equal(out[0][~keep], torch.full((4,), -math.inf))


def reference_penalties(logits, history, prompt_len, p: SamplingParams):
    out = logits.clone()
    for t in set(history):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    counts = {}
    for t in history[prompt_len:]:
        counts[t] = counts.get(t, 0) + 1
    for t, c in counts.items():
        out[t] -= c * p.frequency_penalty + p.presence_penalty
    return out


def test_penalties_match_per_row_reference():
    g = torch.Generator().manual_seed(1)
    vocab, rows, refs = 40, [], []
    logits = torch.randn(8, vocab, generator=g) * 3
    for i in range(8):
        n = int(torch.randint(0, 30, (1,), generator=g))
        history = torch.randint(0, vocab // 2, (n,), generator=g).tolist()  # repeats likely
        prompt_len = int(torch.randint(0, n + 1, (1,), generator=g))
        pen = dict(repetition_penalty=[1.0, 1.3, 0.8, 2.0][i % 4],
                   frequency_penalty=[0.0, 0.5, -0.7, 1.5][(i // 2) % 4],
                   presence_penalty=[0.0, -1.0, 0.4][i % 3])
        # Temperature 1 with no masks must give the same as greedy: penalties only.
        temp = 0.0 if i % 2 else 1.0
        rows.append(row(temperature=temp, history=history, prompt_len=prompt_len, **pen))
        refs.append(reference_penalties(logits[i], history, prompt_len, rows[-1].params))
    out = process_logits(logits, rows)
    assert torch.allclose(out, torch.stack(refs), atol=1e-5)
    assert not torch.equal(out, logits)  # penalties actually did something


def test_history_token_outside_vocab_raises():
    with pytest.raises(ValueError, match="vocabulary"):
        process_logits(torch.zeros(1, 5), [row(repetition_penalty=1.2, history=[1, 7])])
    with pytest.raises(ValueError):
        process_logits(torch.zeros(2, 5), [row()])


def sample_sequence(seed, logits_steps, position, others):
    """Sample the seeded row at `position` of a batch with `others` for every step (step i
    samples the token at position i: a history of i tokens)."""
    sampler = Sampler(seed=123)
    tokens = []
    for step, logits in enumerate(logits_steps):
        rows = list(others)
        rows.insert(position, row(temperature=0.9, top_k=20, race_seed=seed, history=[0] * step))
        other_gen = torch.Generator().manual_seed(step)
        batch = torch.randn(len(rows), logits.shape[0], generator=other_gen)
        batch[position] = logits
        tokens.append(int(sampler(batch, rows).token_ids[position]))
    return tokens


def test_seeded_sampling_is_reproducible_and_batch_independent():
    g = torch.Generator().manual_seed(5)
    steps = [torch.randn(64, generator=g) for _ in range(30)]
    alone = sample_sequence(42, steps, 0, [])
    others = [row(temperature=1.0), row(temperature=0.5, race_seed=9),
              row(temperature=0.0), row(temperature=1.2, top_p=0.8)]
    assert sample_sequence(42, steps, 0, []) == alone
    assert sample_sequence(42, steps, 2, others) == alone
    assert sample_sequence(42, steps, 4, others[:1] + others[2:] + [row()]) == alone
    assert sample_sequence(43, steps, 0, []) != alone


def test_a_row_is_a_function_of_seed_and_position_only():
    """The race keys a row by its seed and the position of the token it samples: the same pair
    draws the same token in any call (a verify step and a plain step agree), another position
    or seed draws afresh."""
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(1, 500, generator=g)
    sampler = Sampler(seed=0)

    def draw(seed, pos):
        return int(sampler(logits, [row(temperature=1.0, race_seed=seed, history=[1] * pos)],
                           num_logprobs=None).token_ids[0])
    assert [draw(7, p) for p in range(20)] == [draw(7, p) for p in range(20)]
    assert len({draw(7, p) for p in range(20)}) > 10  # 500 near-uniform ids: fresh draws
    assert [draw(7, p) for p in range(20)] != [draw(8, p) for p in range(20)]


def test_empirical_distribution_matches_softmax_over_temperature():
    n, temp = 20000, 0.7
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.0, 1.5, 0.7])
    rows = [row(temperature=temp)] * n
    tokens = Sampler(seed=0)(logits.expand(n, -1), rows, num_logprobs=None).token_ids
    counts = torch.bincount(tokens, minlength=8)
    assert chi2_pvalue(counts, torch.softmax(logits / temp, -1)) > 1e-3
    # Negative control: the same samples must reject the untempered distribution.
    assert chi2_pvalue(counts, torch.softmax(logits, -1)) < 1e-6


def test_empirical_distribution_with_masks_along_one_seeded_sequence():
    logits = LOGITS[0]
    # Expected: top-5 {1,4,3,6,0} renormalised (.4,.25,.15,.1,.05)/.95, then top-p .8 keeps
    # mass-above < .8: .421, .263, .158 (cum .842) -> {1, 4, 3}.
    expected = torch.zeros(7)
    expected[[1, 4, 3]] = torch.tensor([0.4, 0.25, 0.15]) / 0.8
    sampler = Sampler(seed=0)
    # one seed, successive positions: the noise of one request's tokens, position by position
    rows = [row(temperature=1.0, top_k=5, top_p=0.8, race_seed=77, history=[0] * i)
            for i in range(3000)]
    tokens = sampler(LOGITS.expand(3000, -1), rows, num_logprobs=None).token_ids
    counts = torch.bincount(tokens, minlength=7)
    assert chi2_pvalue(counts, expected) > 1e-3
    assert chi2_pvalue(counts, torch.tensor(PROBS)) < 1e-6


def test_logprobs_are_raw_log_softmax_and_top_n_sorted():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 30, generator=g)
    rows = [row(temperature=0.0), row(temperature=0.6, top_k=3),
            row(temperature=1.0, repetition_penalty=1.5, history=[1, 2, 3]),
            row(temperature=2.0, min_p=0.1), row(temperature=1.0, top_p=0.5)]
    out = Sampler(seed=0)(logits, rows, num_logprobs=4)
    ref = torch.log_softmax(logits, -1)
    assert torch.allclose(out.logprobs, ref.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.top_logprobs.shape == (5, 4) and out.top_logprob_ids.shape == (5, 4)
    assert torch.all(out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:])
    assert torch.allclose(out.top_logprobs, ref.gather(1, out.top_logprob_ids))
    assert torch.equal(out.top_logprob_ids[:, 0], logits.argmax(-1))
    # Sampled tokens come from the processed distribution's support.
    assert torch.all(torch.isfinite(out.processed_logits.gather(1, out.token_ids[:, None])))
    # num_logprobs 0: the chosen token only; None: nothing.
    zero = Sampler(seed=0)(logits, rows, num_logprobs=0)
    assert zero.logprobs is not None and zero.top_logprobs is None
    assert Sampler(seed=0)(logits, rows, num_logprobs=None).logprobs is None


def test_processed_logprobs_mode_and_probs_from_processed():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 20, generator=g)
    rows = [row(temperature=0.5, top_k=4)] * 3
    out = Sampler(seed=0, logprobs_mode="processed")(logits, rows, num_logprobs=2)
    ref = torch.log_softmax(out.processed_logits, -1)
    assert torch.allclose(out.logprobs, ref.gather(1, out.token_ids[:, None]).squeeze(1))
    probs = probs_from_processed(out.processed_logits)
    assert torch.allclose(probs.sum(-1), torch.ones(3))
    assert torch.equal((probs > 0).sum(-1), torch.full((3,), 4))
    with pytest.raises(ValueError):
        Sampler(logprobs_mode="bogus")


def test_sampling_params_from_tensors_equal_the_masks_one_by_one():
    """apply_sampling_params (what a masked graph runs; min-p reads the row maximum off the
    top-k / top-p sort) gives exactly the values of temperature, top-k / top-p and min-p applied
    one by one, and its masks that keep everything are exact no-ops (process_logits skips
    them)."""
    from outpace.sample.logits_processing import (apply_min_p, apply_sampling_params,
                                                  apply_top_k_top_p)
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(6, 300, generator=g) * 3
    logits[2, 10:20] = logits[2].max()  # ties at the top
    temp = torch.tensor([0.7, 1.0, 1.3, 0.5, 1.0, 2.0])
    top_k = torch.tensor([0, 5, 0, 40, 0, 1])
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.95, 1.0, 1.0])
    min_p = torch.tensor([0.05, 0.0, 0.1, 0.0, 0.2, 0.3])
    got = apply_sampling_params(logits, temp, top_k, top_p, min_p)
    want = apply_min_p(apply_top_k_top_p(logits / temp.unsqueeze(1), top_k, top_p), min_p)
    assert torch.equal(got, want)
    off = apply_sampling_params(logits, temp, torch.zeros(6, dtype=torch.long),
                                torch.ones(6), torch.zeros(6))
    assert torch.equal(off, logits / temp.unsqueeze(1))


def test_top_p_never_drops_the_top_token():
    """Even a top_p that is 0 where it is compared (float32) keeps each row's best token;
    SamplingParams refuses such a top_p before it gets there."""
    from outpace.errors import InvalidRequestError
    from outpace.sample.logits_processing import apply_top_k_top_p
    from outpace.types import SamplingParams
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 50, generator=g)
    masked = apply_top_k_top_p(x, torch.zeros(3, dtype=torch.long),
                               torch.tensor([0.0, 1e-30, 1.0]))
    kept = masked > float("-inf")
    assert kept[:2].sum(1).tolist() == [1, 1] and bool(kept[2].all())
    assert torch.equal(masked.argmax(1), x.argmax(1))
    with pytest.raises(InvalidRequestError, match="smallest normal float32"):
        SamplingParams(temperature=1.0, top_p=1e-46)
    SamplingParams(temperature=1.0, top_p=1e-30)
