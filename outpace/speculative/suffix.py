"""Suffix-automaton drafter: continue the longest earlier match of the sequence's suffix.

Per request, an online suffix automaton (SAM) indexes the prompt and output. After every step we
know the longest suffix u of the sequence T (length L) that occurred earlier, i.e. inside
T[:L-1], and propose the tokens that followed u's first occurrence. `match_len` = |u| tells how
trustworthy the proposal is: the enhancer swaps a neural head's drafts for these tokens when it is
long enough.

Why the automaton is kept one token behind. T trivially occurs in T, so "longest suffix of T that
occurs in T" is useless. The automaton holds S = T[:L-1] and we track (state, len) of u = longest
suffix of T occurring in S (standard matching statistics). When token c is appended:

    1. add T[L-1] (the pending token) to the automaton: S' = T;
    2. u' = longest suffix of T+c occurring in T. Any such u' = w+c with w+c inside T, so w
       occurs in T[:L-1] = S and is a suffix of T: w is a suffix of u. So walk u's suffix links
       until a state has a c-transition (the usual matching step), in the automaton of S'.

Step 1 may split the state holding u: a "clone" takes its shorter strings and becomes its suffix
link. The match needs no fix-up: the clone starts with a copy of the old state's transitions and
firstpos, and step 2 runs right after step 1, so walking from the old state gives the same
result (if it lacks c, so does the clone, and the walk goes on below both). The tests check the
invariant maxlen(link(state)) < len <= maxlen(state) after every extend.

Continuation. Every state stores `firstpos`, the end position of the first occurrence of its
strings (O(1) to maintain online; the most recent occurrence would need an update along the
whole suffix-link path per token, quadratic on runs like "a a a a"). The first occurrence also
leaves the longest continuation before the end of the text. It ends at L-2 at the latest, so a
match always yields at least one token.

Cross-request cache. `SuffixCache` keeps frozen automata of recent finished requests' outputs.
A request's match against each entry is plain matching statistics (entries never change),
advanced lazily only when the drafter consults the cache, over at most `max_match_len` tokens.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional, Sequence

from outpace.errors import ConfigError


class SuffixAutomaton:
    """Online suffix automaton over token ids; state 0 is the root (the empty string).

    Memory: at most 2L states and 3L transitions (one dict per state), ~0.5 KB per token.
    `extend` is amortised O(1) dict operations per token.
    """

    def __init__(self):
        self.maxlen: list = [0]  # longest string of each state
        self.link: list = [-1]  # suffix link
        self.next: list = [{}]  # token -> state
        self.firstpos: list = [-1]  # end position of the first occurrence
        self.last = 0  # the state of the whole text
        self.size = 0  # tokens added

    def extend(self, token: int) -> None:
        maxlen, link, nxt, firstpos = self.maxlen, self.link, self.next, self.firstpos
        cur = len(maxlen)
        maxlen.append(maxlen[self.last] + 1)
        link.append(0)
        nxt.append({})
        firstpos.append(self.size)
        p = self.last
        while p != -1 and token not in nxt[p]:
            nxt[p][token] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][token]
            if maxlen[p] + 1 == maxlen[q]:
                link[cur] = q
            else:
                clone = len(maxlen)
                maxlen.append(maxlen[p] + 1)
                link.append(link[q])
                nxt.append(dict(nxt[q]))
                firstpos.append(firstpos[q])
                while p != -1 and nxt[p].get(token) == q:
                    nxt[p][token] = clone
                    p = link[p]
                link[q] = clone
                link[cur] = clone
        self.last = cur
        self.size += 1

    def normalize(self, state: int, length: int) -> int:
        """The state that holds the length-`length` suffix of the strings of `state`."""
        maxlen, link = self.maxlen, self.link
        while state and length <= maxlen[link[state]]:
            state = link[state]
        return state

    def step(self, state: int, length: int, token: int) -> tuple:
        """Matching statistics: extend the match (state, length) by `token`; the new pair."""
        maxlen, link, nxt = self.maxlen, self.link, self.next
        while state and token not in nxt[state]:
            state = link[state]
            length = maxlen[state]
        target = nxt[state].get(token)
        if target is None:
            return 0, 0
        return target, length + 1

    @staticmethod
    def build(tokens: Sequence[int]) -> "SuffixAutomaton":
        sam = SuffixAutomaton()
        for t in tokens:
            sam.extend(int(t))
        return sam


@dataclass
class _CacheEntry:
    key: int  # unique, increasing: matches are cached per key
    tokens: list
    sam: SuffixAutomaton


class SuffixCache:
    """Frozen automata of the outputs of the last `max_requests` finished requests."""

    def __init__(self, max_requests: int = 16):
        if not isinstance(max_requests, int) or max_requests < 1:
            raise ConfigError(f"suffix cache max_requests must be an integer >= 1, got "
                              f"{max_requests!r}; use None on the drafter to turn the cache off")
        self.max_requests = max_requests
        self.entries: deque = deque(maxlen=max_requests)  # oldest first
        self._next_key = 0

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, tokens: Sequence[int]) -> None:
        """Index a finished request's tokens; evicts the oldest entry beyond `max_requests`."""
        tokens = [int(t) for t in tokens]
        if len(tokens) < 2:  # nothing could be continued from it
            return
        self.entries.append(_CacheEntry(self._next_key, tokens, SuffixAutomaton.build(tokens)))
        self._next_key += 1


class SuffixState:
    """One request's automaton (one token behind), its current match and its cache matches."""

    def __init__(self, max_match_len: int, prompt_len: int = 0):
        self.max_match_len = max_match_len
        self.prompt_len = prompt_len  # tokens before this are the prompt (kept out of the cache)
        self.tokens: list = []
        self.sam = SuffixAutomaton()
        self.state = 0  # (state, match_len): longest suffix of tokens occurring in tokens[:-1]
        self.match_len = 0
        self._cache_match: dict = {}  # entry key -> [state, length, tokens consumed]

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new_tokens: Sequence[int]) -> None:
        """Append committed tokens; keeps the match incremental (amortised O(1) per token)."""
        sam, cap = self.sam, self.max_match_len
        state, length = self.state, self.match_len
        for token in new_tokens:
            token = int(token)
            if self.tokens:
                sam.extend(self.tokens[-1])  # the automaton catches up to T[:L-1]
            state, length = sam.step(state, length, token)
            if length > cap:
                length = cap
                state = sam.normalize(state, length)
            self.tokens.append(token)
        self.state, self.match_len = state, length

    def update(self, token_ids: Sequence[int]) -> None:
        """Sync with the request's full token list, which must extend what this state has seen."""
        have = len(self.tokens)
        if len(token_ids) < have:
            raise ValueError(
                f"token list shrank from {have} to {len(token_ids)}; create a new SuffixState "
                "when a request's tokens are replaced")
        self.extend(token_ids[have:])

    def continuation(self, k: int, periodic: bool = False) -> list:
        """The k tokens after the first earlier occurrence of the current match.

        periodic: when the copy runs into the end of the text, keep copying the proposal's own
        tokens (the match at distance d says "period d"), so loops get k drafts, not d.
        """
        if self.match_len == 0:
            return []
        tokens = self.tokens
        start = self.sam.firstpos[self.state] + 1
        out = tokens[start:start + k]
        if periodic:
            length = len(tokens)
            while len(out) < k:
                out.append(out[start + len(out) - length])
        return out

    def cache_match(self, entry: _CacheEntry) -> tuple:
        """(state, length) of the longest suffix of tokens (<= max_match_len) inside `entry`."""
        window = self.max_match_len
        total = len(self.tokens)
        rec = self._cache_match.get(entry.key)
        if rec is None or total - rec[2] > window:
            # Matches can't be longer than the window, so matching from the root over the last
            # `window` tokens gives the same answer as having followed every token.
            rec = [0, 0, max(0, total - window)]
            self._cache_match[entry.key] = rec
        sam = entry.sam
        state, length = rec[0], rec[1]
        for token in self.tokens[rec[2]:]:
            state, length = sam.step(state, length, token)
            if length > window:
                length = window
                state = sam.normalize(state, length)
        rec[0], rec[1], rec[2] = state, length, total
        return state, length

    def forget_cache_entries(self, live_keys: set) -> None:
        for key in [key for key in self._cache_match if key not in live_keys]:
            del self._cache_match[key]


class SuffixDrafter:
    """Proposes the continuation of the longest earlier match, per request and across requests.

    min_match_len: propose nothing when the best match is shorter.
    max_match_len: matches are capped at this length (the first occurrence of the last
        `max_match_len` tokens is used); it also bounds the work of a cache lookup.
    cache_max_requests: size of the cross-request cache (None: no cache).
    cache_below: consult the cache only when the request's own match is shorter than this
        (default `max_match_len`, i.e. whenever it could be improved); the cache's best match
        is used when strictly longer than the request's own.
    periodic: extend a request's own continuation that runs into the end of the text by
        repeating it (repetition loops get k drafts); off by default (plain continuation).
    """

    def __init__(self, min_match_len: int = 1, max_match_len: int = 64,
                 cache_max_requests: Optional[int] = None, cache_below: Optional[int] = None,
                 periodic: bool = False):
        if not isinstance(max_match_len, int) or max_match_len < 1:
            raise ConfigError(
                f"suffix max_match_len must be an integer >= 1, got {max_match_len!r}")
        if not isinstance(min_match_len, int) or not 1 <= min_match_len <= max_match_len:
            raise ConfigError(f"suffix min_match_len must be in 1..max_match_len "
                              f"({max_match_len}), got {min_match_len!r}")
        self.min_match_len = min_match_len
        self.max_match_len = max_match_len
        self.cache = SuffixCache(cache_max_requests) if cache_max_requests is not None else None
        if cache_below is not None and (not isinstance(cache_below, int) or cache_below < 0):
            raise ConfigError(f"suffix cache_below must be an integer >= 0, got {cache_below!r}")
        self.cache_below = max_match_len if cache_below is None else cache_below
        self.periodic = periodic

    def new_state(self, prompt_token_ids: Sequence[int] = ()) -> SuffixState:
        """Per-request state seeded with the prompt (call once when the request is admitted)."""
        state = SuffixState(self.max_match_len, prompt_len=len(prompt_token_ids))
        state.extend(prompt_token_ids)
        return state

    def propose(self, state: SuffixState, k: int) -> tuple:
        """(tokens, match_len): up to k drafts and the length of the match they continue.

        ([], 0) when nothing matches, when the best match is shorter than `min_match_len`, or
        when k <= 0.
        """
        if k <= 0:
            return [], 0
        tokens, length = state.continuation(k, self.periodic), state.match_len
        if self.cache is not None and self.cache.entries and length < self.cache_below:
            cached, cached_len = self._propose_from_cache(state, k)
            if cached_len > length:
                tokens, length = cached, cached_len
        if length < self.min_match_len or not tokens:
            return [], 0
        return tokens, length

    def _propose_from_cache(self, state: SuffixState, k: int) -> tuple:
        best, best_len = [], 0
        for entry in reversed(self.cache.entries):  # newest first: ties go to the newest
            node, length = state.cache_match(entry)
            sam = entry.sam
            # The entry's text is complete, so an occurrence may end at its very last token and
            # have nothing after it; fall back to shorter suffixes (earlier first occurrences).
            while node and sam.firstpos[node] + 1 >= len(entry.tokens):
                node = sam.link[node]
                length = sam.maxlen[node]
            if length > best_len:
                end = sam.firstpos[node]
                best, best_len = entry.tokens[end + 1:end + 1 + k], length
        state.forget_cache_entries({entry.key for entry in self.cache.entries})
        return best, best_len

    def finish(self, state: SuffixState) -> None:
        """The request finished: put its output in the cross-request cache (if there is one)."""
        if self.cache is not None:
            self.cache.add(state.tokens[state.prompt_len:])
