"""Suffix-automaton drafter against brute-force references (per request and across requests)."""

import random
import time

import pytest

from outpace.errors import ConfigError
from outpace.speculative.suffix import SuffixAutomaton, SuffixCache, SuffixDrafter
from tests.speculative.spec_helpers import random_tokens


def first_occurrence_end(text, pattern, last_end):
    """Smallest e <= last_end with text[e-len+1 : e+1] == pattern, else None."""
    n = len(pattern)
    for e in range(n - 1, last_end + 1):
        if text[e - n + 1:e + 1] == pattern:
            return e
    return None


def ref_local(tokens, k, cap, periodic=False):
    """Longest suffix (<= cap) occurring in tokens[:-1]; continuation after its first occurrence."""
    length = len(tokens)
    for n in range(min(length - 1, cap), 0, -1):
        e = first_occurrence_end(tokens, tokens[length - n:], length - 2)
        if e is not None:
            text = list(tokens)  # periodic: the proposal continues copying itself
            while periodic and len(text) < e + 1 + k:
                text.append(text[len(text) - (length - 1 - e)])
            return text[e + 1:e + 1 + k], n
    return [], 0


def ref_cached(tokens, k, cap, entry):
    """Longest suffix (<= cap) occurring in an entry with at least one token after it."""
    for n in range(min(len(tokens), cap), 0, -1):
        e = first_occurrence_end(entry, tokens[len(tokens) - n:], len(entry) - 2)
        if e is not None:
            return entry[e + 1:e + 1 + k], n
    return [], 0


def ref_propose(tokens, k, cap, min_len, entries=(), cache_below=None, periodic=False):
    if k <= 0:
        return [], 0
    best, best_len = ref_local(tokens, k, cap, periodic)
    if entries and best_len < (cap if cache_below is None else cache_below):
        cached, cached_len = [], 0
        for entry in reversed(entries):  # newest first, strictly longer wins
            cand, cand_len = ref_cached(tokens, k, cap, entry)
            if cand_len > cached_len:
                cached, cached_len = cand, cand_len
        if cached_len > best_len:
            best, best_len = cached, cached_len
    if best_len < min_len or not best:
        return [], 0
    return best, best_len


@pytest.mark.parametrize("seed", range(3))
def test_automaton_accepts_exactly_the_substrings(seed):
    rng = random.Random(seed)
    for _ in range(40):
        text = random_tokens(rng, rng.randint(0, 40), rng.randint(1, 4))
        sam = SuffixAutomaton.build(text)
        substrings = {tuple(text[i:j])
                      for i in range(len(text)) for j in range(i + 1, len(text) + 1)}
        for length in range(1, 7):
            for _ in range(15):
                probe = tuple(random_tokens(rng, length, 4))
                node = 0
                for t in probe:
                    node = sam.next[node].get(t)
                    if node is None:
                        break
                assert (node is not None) == (probe in substrings), (text, probe)
                if node is not None:  # firstpos is the end of the first occurrence
                    first = first_occurrence_end(text, list(probe), len(text) - 1)
                    assert sam.firstpos[node] == first
        assert len(sam.maxlen) <= max(2 * len(text), 1)


@pytest.mark.parametrize("seed", range(4))
def test_incremental_proposals_match_reference(seed):
    rng = random.Random(10 + seed)
    for _ in range(25):
        cap = rng.randint(1, 12)
        min_len = rng.randint(1, min(cap, 3))
        vocab = rng.randint(1, 5)
        periodic = rng.random() < 0.3
        drafter = SuffixDrafter(min_match_len=min_len, max_match_len=cap, periodic=periodic)
        prompt = random_tokens(rng, rng.randint(0, 15), vocab)
        state = drafter.new_state(prompt)
        tokens = list(prompt)
        for _step in range(30):
            k = rng.randint(0, 6)
            expected = ref_propose(tokens, k, cap, min_len, periodic=periodic)
            assert drafter.propose(state, k) == expected, (tokens, k, cap, min_len, periodic)
            new = random_tokens(rng, rng.randint(1, 5), vocab)
            tokens += new
            if rng.random() < 0.5:
                state.extend(new)
            else:
                state.update(tokens)
            # the tracked state holds the match: maxlen(link) < match_len <= maxlen(state)
            sam = state.sam
            if state.match_len:
                node = state.state
                assert sam.maxlen[sam.link[node]] < state.match_len <= sam.maxlen[node]
            assert sam.size == len(tokens) - 1  # the automaton stays one token behind


@pytest.mark.parametrize("seed", range(3))
def test_incremental_equals_from_scratch(seed):
    rng = random.Random(20 + seed)
    for _ in range(20):
        drafter = SuffixDrafter(max_match_len=rng.randint(1, 20))
        tokens = random_tokens(rng, rng.randint(1, 120), rng.randint(1, 4))
        state = drafter.new_state(tokens[:5])
        pos = 5
        while pos < len(tokens):
            step = rng.randint(1, 6)
            state.extend(tokens[pos:pos + step])
            pos += step
        scratch = drafter.new_state(tokens)
        assert (state.match_len, drafter.propose(state, 8)) == \
            (scratch.match_len, drafter.propose(scratch, 8))
        assert state.sam.maxlen == scratch.sam.maxlen and state.sam.link == scratch.sam.link


def test_long_match_and_its_continuation():
    a = [11, 12, 13, 14, 15, 16]
    tokens = [1] + a + [2, 3] + a[:4]
    tokens_, match_len = SuffixDrafter().propose(SuffixDrafter().new_state(tokens), 4)
    assert (tokens_, match_len) == ([15, 16, 2, 3], 4)
    # a loop: the 9-token match's first occurrence leaves 3 tokens; `periodic` keeps copying
    loop = [7, 8, 9] * 4
    assert SuffixDrafter().propose(SuffixDrafter().new_state(loop), 5) == ([7, 8, 9], 9)
    periodic = SuffixDrafter(periodic=True)
    assert periodic.propose(periodic.new_state(loop), 5) == ([7, 8, 9, 7, 8], 9)
    assert periodic.propose(periodic.new_state([4, 4]), 3) == ([4, 4, 4], 1)
    # max_match_len caps the reported length (and uses the first occurrence of the capped suffix)
    assert SuffixDrafter(max_match_len=2).propose(SuffixDrafter(max_match_len=2).new_state(loop),
                                                  5) == ([7, 8, 9, 7, 8], 2)


def test_empty_when_nothing_matches_or_match_too_short():
    drafter = SuffixDrafter(min_match_len=2)
    assert drafter.propose(drafter.new_state(list(range(30))), 4) == ([], 0)
    assert drafter.propose(drafter.new_state([]), 4) == ([], 0)
    assert drafter.propose(drafter.new_state([5]), 4) == ([], 0)
    state = drafter.new_state([5, 6, 1, 2, 5])  # only a 1-token match: below min_match_len
    assert drafter.propose(state, 4) == ([], 0)
    state.extend([6])  # now [5, 6] matches
    assert drafter.propose(state, 4) == ([1, 2, 5, 6], 2)
    assert drafter.propose(state, 0) == ([], 0)


def test_cache_finds_continuation_from_previous_request():
    drafter = SuffixDrafter(min_match_len=2, cache_max_requests=4)
    prev = drafter.new_state([900, 901, 902])  # prompt: kept out of the cache
    prev.extend([40, 41, 42, 43, 44, 45, 46])  # output
    drafter.finish(prev)
    assert len(drafter.cache) == 1
    cur = drafter.new_state([1, 2, 3, 40, 41])
    assert drafter.propose(cur, 3) == ([42, 43, 44], 2)
    cur.extend([42, 43])
    assert drafter.propose(cur, 3) == ([44, 45, 46], 4)
    # the previous request's prompt is not in the cache
    other = drafter.new_state([5, 900, 901])
    assert drafter.propose(other, 3) == ([], 0)
    # without a cache the same request finds nothing
    plain = SuffixDrafter(min_match_len=2)
    assert plain.propose(plain.new_state([1, 2, 3, 40, 41]), 3) == ([], 0)


def test_cache_eviction_and_local_preference():
    drafter = SuffixDrafter(cache_max_requests=1)
    drafter.cache.add([1, 2, 3, 4])
    drafter.cache.add([1, 2, 9, 9])  # evicts the first entry
    state = drafter.new_state([7, 1, 2])
    assert drafter.propose(state, 2) == ([9, 9], 2)
    # a local match of equal length wins over the cache
    state = drafter.new_state([1, 2, 5, 6, 1, 2])
    assert drafter.propose(state, 2) == ([5, 6], 2)
    # cache_below: with a local match this long, the cache is not consulted
    drafter = SuffixDrafter(cache_max_requests=2, cache_below=1)
    drafter.cache.add([3, 1, 2, 8])
    state = drafter.new_state([6, 2, 9, 1, 2])
    assert drafter.propose(state, 1) == ([9], 1)


@pytest.mark.parametrize("seed", range(3))
def test_cache_matches_reference(seed):
    rng = random.Random(30 + seed)
    for _ in range(15):
        cap = rng.randint(1, 10)
        vocab = rng.randint(2, 6)
        cache_below = rng.choice([None, rng.randint(1, cap)])
        drafter = SuffixDrafter(min_match_len=rng.randint(1, 2) if cap > 1 else 1,
                                max_match_len=cap, cache_max_requests=rng.randint(1, 4),
                                cache_below=cache_below)
        entries = []

        def add_entry():
            entry = random_tokens(rng, rng.randint(0, 30), vocab)
            drafter.cache.add(entry)
            if len(entry) >= 2:
                entries.append(entry)
            del entries[:-drafter.cache.max_requests]

        for _ in range(rng.randint(0, 4)):
            add_entry()
        tokens = random_tokens(rng, rng.randint(0, 10), vocab)
        state = drafter.new_state(tokens)
        for _step in range(25):
            if rng.random() < 0.7:  # proposals skip some steps: exercises the lazy cache catch-up
                k = rng.randint(1, 5)
                expected = ref_propose(tokens, k, cap, drafter.min_match_len, entries, cache_below)
                assert drafter.propose(state, k) == expected, (tokens, entries, k, cap)
            if rng.random() < 0.15:  # another request finishes meanwhile
                add_entry()
            new = random_tokens(rng, rng.randint(1, 4), vocab)
            tokens += new
            state.extend(new)


def test_bad_options_raise():
    with pytest.raises(ConfigError):
        SuffixDrafter(max_match_len=0)
    with pytest.raises(ConfigError):
        SuffixDrafter(min_match_len=5, max_match_len=4)
    with pytest.raises(ConfigError):
        SuffixCache(max_requests=0)
    with pytest.raises(ConfigError):
        SuffixDrafter(cache_below=-1)
    state = SuffixDrafter().new_state([1, 2, 3])
    with pytest.raises(ValueError):
        state.update([1])


def test_speed_on_long_context():
    rng = random.Random(5)
    tokens = random_tokens(rng, 8192 + 1024, 1000)
    drafter = SuffixDrafter(cache_max_requests=8)
    for _ in range(8):
        drafter.cache.add(random_tokens(rng, 1024, 1000))
    start = time.perf_counter()
    state = drafter.new_state(tokens[:8192])
    for step in range(256):
        drafter.propose(state, 4)
        state.extend(tokens[8192 + 4 * step:8192 + 4 * step + 4])
    elapsed = time.perf_counter() - start
    assert elapsed < 0.8, f"suffix drafter took {elapsed:.3f}s for an 8k prompt and 256 steps"
