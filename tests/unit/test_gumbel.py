"""The race's noise (sample/gumbel.py): keyed by (seed, position, id), the same on the host's
integers and on tensors, and statistically what Gumbel noise should be."""

import math

import torch

from outpace.sample.gumbel import gumbel_noise, race_tokens, race_key, seed_word


def test_keys_on_ints_equal_keys_on_tensors():
    g = torch.Generator().manual_seed(0)
    seeds = torch.randint(-(1 << 62), 1 << 62, (200,), generator=g).tolist() + [0, -1, 1 << 63]
    positions = torch.randint(0, 1 << 20, (len(seeds),), generator=g).tolist()
    words = [seed_word(s) for s in seeds]
    assert all(0 <= w < 1 << 32 for w in words)
    on_ints = [race_key(w, p) for w, p in zip(words, positions)]
    on_tensors = race_key(torch.tensor(words), torch.tensor(positions)).tolist()
    assert on_ints == on_tensors
    assert len(set(on_ints)) == len(on_ints)  # 203 distinct pairs, distinct keys


def test_seed_words_differ_for_nearby_and_wide_seeds():
    seeds = list(range(-50, 50)) + [1 << 40, (1 << 40) + 1, 1 << 62, -(1 << 63)]
    assert len({seed_word(s) for s in seeds}) == len(seeds)


def test_noise_is_gumbel_and_uncorrelated():
    keys = race_key(torch.full((64,), seed_word(3)), torch.arange(64))
    noise = gumbel_noise(keys, 4096).double()  # [64, 4096]
    assert torch.isfinite(noise).all()
    # Gumbel(0, 1): mean = Euler-Mascheroni, variance pi^2 / 6; 262144 draws
    assert abs(noise.mean().item() - 0.5772157) < 0.01
    assert abs(noise.var().item() - math.pi ** 2 / 6) < 0.03
    # its CDF exp(-exp(-g)) is uniform: every decile holds ~10%
    u = torch.exp(-torch.exp(-noise)).flatten()
    deciles = torch.histc(u, bins=10, min=0.0, max=1.0) / u.numel()
    assert (deciles - 0.1).abs().max().item() < 0.003
    # neighbouring ids and neighbouring positions are not correlated
    centred = noise - noise.mean()
    for a, b in ((centred[:, :-1], centred[:, 1:]), (centred[:-1], centred[1:])):
        corr = (a * b).mean() / (a.std() * b.std())
        assert abs(corr.item()) < 0.01


def test_race_draws_softmax_and_keeps_masks():
    logits = torch.tensor([2.0, 0.5, -1.0, 1.0, 0.0])
    n = 30000
    words, positions = torch.full((n,), seed_word(11)), torch.arange(n)
    tokens = race_tokens(logits.expand(n, -1), words, positions)
    freq = torch.bincount(tokens, minlength=5).double() / n
    assert torch.allclose(freq, torch.softmax(logits.double(), -1), atol=0.01)
    masked = logits.clone()
    masked[[0, 3]] = -math.inf
    tokens = race_tokens(masked.expand(2000, -1), words[:2000], positions[:2000])
    assert not torch.isin(tokens, torch.tensor([0, 3])).any()
    only = torch.full((5,), -math.inf)
    only[2] = 0.0
    assert race_tokens(only.expand(10, -1), words[:10], positions[:10]).eq(2).all()
    # a temperature divides first: at 0.5 the draws follow softmax(2 logits); -1 rows: argmax
    hot = race_tokens(logits.expand(n, -1), words, positions, temperature=torch.full((n,), 0.5))
    freq = torch.bincount(hot, minlength=5).double() / n
    assert torch.allclose(freq, torch.softmax(2 * logits.double(), -1), atol=0.01)
    greedy = race_tokens(logits.expand(3, -1), torch.full((3,), -1), positions[:3])
    assert greedy.eq(0).all()


def test_any_64_bit_seed_is_a_request_seed():
    """SamplingParams takes the seeds the OpenAI server takes (signed or unsigned 64-bit), and
    the race tells them apart (their 64 bits: -1 and 2**64 - 1 are the same bits)."""
    import pytest

    from outpace.errors import InvalidRequestError
    from outpace.types import SamplingParams
    for seed in (-(1 << 63), -1, 0, (1 << 63) - 1, 1 << 63, (1 << 64) - 1):
        assert SamplingParams(seed=seed).seed == seed
    for seed in (-(1 << 63) - 1, 1 << 64, 1.5, True):
        with pytest.raises(InvalidRequestError, match="seed"):
            SamplingParams(seed=seed)
    assert seed_word(-1) == seed_word((1 << 64) - 1)
    assert len({seed_word(s) for s in ((1 << 63) - 1, 1 << 63, (1 << 64) - 2)}) == 3
