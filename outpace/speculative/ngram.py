"""n-gram prompt lookup: draft the tokens that followed the last earlier occurrence of the suffix.

For a sequence T of length L, find the largest n in [max_n .. min_n] such that the suffix
T[L-n:L] also occurs earlier, i.e. at a start i with i + n <= L - 1 (the suffix itself is not an
"earlier" occurrence). Take the most recent such i and propose T[i+n : i+n+k]. Because the
earlier occurrence ends at L-2 at the latest, a match always yields at least one token.

    T:  . . . [a b c] x y z . . . . . . [a b c]
                i     ^-- proposal starts here       ^-- suffix, L-n .. L-1

Two implementations, same results (tests check both against a brute-force reference):

* `NgramDrafter.propose(token_ids, k)` is stateless: numpy candidate filtering. It keeps the
  positions where the suffix's first token occurs, then filters them by each following token.
  Cost per call: O(L) vectorised (plus converting the list to an array, O(L)); no memory kept.
* `NgramState` is the per-request incremental form the engine should use: one dict per n from
  the n-gram (a tuple) to its most recent start, updated as tokens are appended. Cost:
  O((max_n - min_n + 1) * max_n) per appended token, O(max_n^2) per propose, independent of L;
  memory O(L * (max_n - min_n + 1)) dict entries.

The stateless call's cost grows with L (mostly the list -> array conversion); `NgramState`'s
per-step cost does not, after a one-off pass that indexes the prompt, at a few hundred bytes of
memory per token (measured on the 2-core CPU machine; decisions-log.md, "Measurements moved
out of code comments"). The state wins for the per-step engine loop; the stateless call is
there for one-off use.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from outpace.errors import ConfigError


def _check_range(min_n: int, max_n: int) -> None:
    if not isinstance(min_n, int) or not isinstance(max_n, int) or min_n < 1 or max_n < min_n:
        raise ConfigError(
            f"n-gram sizes must satisfy 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}; "
            "set the 'prompt_lookup_min'/'prompt_lookup_max' speculative options accordingly")


def _continuation(tokens: Sequence[int], start: int, k: int, periodic: bool) -> list:
    """tokens[start:start+k]; with `periodic`, keep copying past the end (LZ77-style overlap).

    A match at distance d from the end says "the text repeats with period d"; when the copy runs
    off the end, the copied tokens are the proposal's own earlier tokens under that hypothesis.
    """
    out = list(tokens[start:start + k])
    if periodic and out:
        length = len(tokens)
        while len(out) < k:
            out.append(out[start + len(out) - length])
    return out


class NgramDrafter:
    """Stateless prompt lookup over a full token list (see the module docstring)."""

    def __init__(self, min_n: int = 1, max_n: int = 4, periodic: bool = False):
        _check_range(min_n, max_n)
        self.min_n = min_n
        self.max_n = max_n
        # periodic: extend a continuation that runs into the end of the text by repeating it
        # (more drafts in repetition loops); off by default to keep the plain lookup semantics.
        self.periodic = periodic

    def match(self, token_ids: Sequence[int]) -> tuple:
        """(n, start): the longest suffix n-gram's most recent earlier start; (0, -1) if none."""
        length = len(token_ids)
        if length < self.min_n + 1:
            return 0, -1
        arr = np.asarray(token_ids, dtype=np.int64)  # [L]
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = arr[length - n:]  # [n]
            # candidate starts i in [0, L-1-n]: the occurrence must end before the last token
            cand = np.flatnonzero(arr[:length - n] == suffix[0])  # [C]
            for j in range(1, n):
                if cand.size == 0:
                    break
                cand = cand[arr[cand + j] == suffix[j]]
            if cand.size:
                return n, int(cand[-1])
        return 0, -1

    def propose(self, token_ids: Sequence[int], k: int) -> list:
        """Up to k tokens that followed the longest matching suffix n-gram; [] if none matches."""
        if k <= 0:
            return []
        n, start = self.match(token_ids)
        if n == 0:
            return []
        return _continuation(token_ids, start + n, k, self.periodic)

    def new_state(self, token_ids: Sequence[int] = ()) -> "NgramState":
        """Per-request incremental state seeded with `token_ids` (the prompt)."""
        state = NgramState(self.min_n, self.max_n, self.periodic)
        state.extend(token_ids)
        return state


class NgramState:
    """Incremental prompt lookup for one request.

    `index[n - min_n]` maps every n-gram that ends at a position <= L-2 to its most recent start.
    The n-grams ending at L-1 (the newest token) are indexed one call late, at the next `extend`
    or `propose`, so a lookup of the current suffix never finds the suffix itself.
    """

    def __init__(self, min_n: int = 1, max_n: int = 4, periodic: bool = False):
        _check_range(min_n, max_n)
        self.min_n = min_n
        self.max_n = max_n
        self.periodic = periodic
        self.tokens: list = []
        self._index: list = [dict() for _ in range(max_n - min_n + 1)]
        self._indexed_end = -1  # n-grams ending at positions <= this are in the index

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new_tokens: Sequence[int]) -> None:
        """Append committed tokens (the engine calls this with the 1..k+1 tokens of a step)."""
        self.tokens.extend(map(int, new_tokens))

    def update(self, token_ids: Sequence[int]) -> None:
        """Sync with the request's full token list, which must extend what this state has seen."""
        have = len(self.tokens)
        if len(token_ids) < have:
            raise ValueError(
                f"token list shrank from {have} to {len(token_ids)}; create a new NgramState "
                "when a request's tokens are replaced")
        self.extend(token_ids[have:])

    def _catch_up(self) -> None:
        tokens = self.tokens
        min_n = self.min_n
        last = len(tokens) - 2  # index every n-gram that ends strictly before the newest token
        for end in range(self._indexed_end + 1, last + 1):
            for n, table in enumerate(self._index, start=min_n):
                start = end - n + 1
                if start < 0:
                    break
                table[tuple(tokens[start:end + 1])] = start
        self._indexed_end = max(self._indexed_end, last)

    def match(self) -> tuple:
        """(n, start) like `NgramDrafter.match`, for the current tokens."""
        self._catch_up()
        tokens = self.tokens
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = self._index[n - self.min_n].get(tuple(tokens[length - n:]))
            if start is not None:
                return n, start
        return 0, -1

    def propose(self, k: int) -> list:
        """Up to k draft tokens for the next step; [] if no suffix n-gram occurred earlier."""
        if k <= 0:
            return []
        n, start = self.match()
        if n == 0:
            return []
        return _continuation(self.tokens, start + n, k, self.periodic)


def ngram_options(spec) -> dict:
    """A SpecConfig's vLLM-style prompt_lookup_min / max as NgramDrafter kwargs."""
    return {"min_n": spec.prompt_lookup_min, "max_n": spec.prompt_lookup_max}
