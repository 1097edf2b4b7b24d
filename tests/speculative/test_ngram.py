"""n-gram prompt lookup against a brute-force reference (stateless and incremental forms)."""

import random
import time

import pytest

from outpace.errors import ConfigError
from outpace.speculative.ngram import NgramDrafter, NgramState, ngram_options
from tests.speculative.spec_helpers import random_tokens


def ref_propose(tokens, k, min_n, max_n, periodic=False):
    """Longest suffix n-gram (n in [min_n, max_n]) occurring earlier; its most recent start."""
    length = len(tokens)
    if k <= 0:
        return []
    for n in range(max_n, min_n - 1, -1):
        if n > length - 1:
            continue
        suffix = tokens[length - n:]
        for i in range(length - n - 1, -1, -1):  # occurrence must end at <= L-2
            if tokens[i:i + n] == suffix:
                out = []
                for t in range(k):
                    j = i + n + t
                    if j < length:
                        out.append(tokens[j])
                    elif periodic:
                        out.append(out[j - length])
                    else:
                        break
                return out
    return []


@pytest.mark.parametrize("seed", range(4))
def test_stateless_matches_reference(seed):
    rng = random.Random(seed)
    for _ in range(150):
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        periodic = rng.random() < 0.3
        drafter = NgramDrafter(min_n, max_n, periodic=periodic)
        tokens = random_tokens(rng, rng.randint(0, 80), rng.randint(1, 6))
        k = rng.randint(0, 7)
        assert drafter.propose(tokens, k) == ref_propose(tokens, k, min_n, max_n, periodic), \
            (tokens, k, min_n, max_n, periodic)


@pytest.mark.parametrize("seed", range(4))
def test_incremental_matches_reference_and_stateless(seed):
    rng = random.Random(100 + seed)
    for _ in range(30):
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        periodic = rng.random() < 0.3
        vocab = rng.randint(1, 6)
        drafter = NgramDrafter(min_n, max_n, periodic=periodic)
        prompt = random_tokens(rng, rng.randint(0, 20), vocab)
        state = drafter.new_state(prompt)
        tokens = list(prompt)
        for _step in range(25):
            if rng.random() < 0.8:  # the engine proposes most steps, but not necessarily every one
                k = rng.randint(1, 6)
                expected = ref_propose(tokens, k, min_n, max_n, periodic)
                assert state.propose(k) == expected, (tokens, k, min_n, max_n)
                assert drafter.propose(tokens, k) == expected
            new = random_tokens(rng, rng.randint(1, 5), vocab)  # 1..k+1 committed tokens
            tokens += new
            if rng.random() < 0.5:
                state.extend(new)
            else:
                state.update(tokens)
            assert len(state) == len(tokens)


def test_longest_n_first_and_most_recent_occurrence():
    tokens = [1, 2, 3, 9, 5, 2, 3, 8, 7, 1, 2, 3]
    # 3-gram [1,2,3] occurs at 0 -> continue with 9 ...
    assert NgramDrafter(1, 4).propose(tokens, 3) == [9, 5, 2]
    # with max_n=2 the 2-gram [2,3] most recently occurred at 5 -> continue with 8 ...
    assert NgramDrafter(1, 2).propose(tokens, 3) == [8, 7, 1]
    state = NgramState(1, 2)
    state.extend(tokens)
    assert state.propose(3) == [8, 7, 1]


def test_min_n_respected_and_empty_when_nothing_matches():
    tokens = [5, 1, 6, 7, 1]  # only the 1-gram [1] recurs
    assert NgramDrafter(1, 4).propose(tokens, 2) == [6, 7]
    assert NgramDrafter(2, 4).propose(tokens, 2) == []
    assert NgramDrafter(1, 4).propose(list(range(50)), 4) == []
    assert NgramDrafter(1, 4).propose([], 4) == []
    assert NgramDrafter(1, 4).propose([3], 4) == []
    assert NgramDrafter(1, 4).propose([3, 3], 0) == []
    state = NgramState(2, 4)
    state.extend(tokens)
    assert state.propose(2) == []


def test_suffix_itself_is_not_an_earlier_occurrence():
    # [4, 4]: the 1-gram [4] ending at L-2 is earlier; the continuation is the last token only.
    assert NgramDrafter(1, 4).propose([4, 4], 5) == [4]
    assert NgramDrafter(1, 4, periodic=True).propose([4, 4], 5) == [4] * 5
    assert NgramDrafter(1, 4, periodic=True).propose([1, 2, 3, 1, 2, 3], 5) == [1, 2, 3, 1, 2]


def test_bad_ranges_and_shrinking_lists_raise():
    with pytest.raises(ConfigError):
        NgramDrafter(0, 3)
    with pytest.raises(ConfigError):
        NgramDrafter(3, 2)
    with pytest.raises(ConfigError):
        NgramState(2, 1)
    state = NgramState()
    state.extend([1, 2, 3])
    with pytest.raises(ValueError):
        state.update([1, 2])


def test_speed_on_long_context():
    rng = random.Random(7)
    tokens = random_tokens(rng, 8192 + 1024, 1000)
    drafter = NgramDrafter()
    start = time.perf_counter()
    state = drafter.new_state(tokens[:8192])
    for step in range(256):
        state.propose(4)
        state.extend(tokens[8192 + 4 * step:8192 + 4 * step + 4])
    incremental = time.perf_counter() - start
    start = time.perf_counter()
    for step in range(256):
        drafter.propose(tokens[:8192 + 4 * step], 4)
    stateless = time.perf_counter() - start
    assert incremental < 0.5, f"NgramState took {incremental:.3f}s for 256 steps at 8k tokens"
    assert stateless < 0.8, f"NgramDrafter took {stateless:.3f}s for 256 calls at 8k tokens"


def test_options_mapping():
    from outpace.speculative_config import SpecConfig
    assert ngram_options(SpecConfig()) == {"min_n": 1, "max_n": 4}
    spec = SpecConfig.from_dict({"prompt_lookup_min": 2, "prompt_lookup_max": 3})
    assert ngram_options(spec) == {"min_n": 2, "max_n": 3}
    assert NgramDrafter(**ngram_options(spec)).max_n == 3
    with pytest.raises(ConfigError, match="'prompt_lookup_max' must be an integer"):
        SpecConfig.from_dict({"prompt_lookup_max": "four"})
    with pytest.raises(ConfigError, match="prompt_lookup_min .3. must be <= prompt_lookup_max"):
        SpecConfig.from_dict({"prompt_lookup_min": 3, "prompt_lookup_max": 2})
