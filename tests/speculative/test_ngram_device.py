"""The device n-gram lookup (speculative/ngram_device.py) against NgramDrafter.propose, row by row:
random batches of thousands of rows (small vocabularies so that matches happen, lengths 0 ..
Lmax in one batch, stale tokens past each row's length), and the edge cases by name; the bound
of its temporaries (`lookup_bytes`)."""

import random
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from outpace.errors import ConfigError
from outpace.speculative.ngram import NgramDrafter
from outpace.speculative.ngram_device import lookup_bytes, ngram_propose


def batch(rows: list, width: int, rng: random.Random, vocab: int):
    """(history [B, width], lengths [B]): each row's tokens, then stale tokens to the width."""
    hist = [r + [rng.randrange(vocab) for _ in range(width - len(r))] for r in rows]
    return (torch.tensor(hist, dtype=torch.long).reshape(len(rows), width),
            torch.tensor([len(r) for r in rows], dtype=torch.long))


def expected(rows: list, k: int, min_n: int, max_n: int, periodic: bool = False) -> list:
    drafter = NgramDrafter(min_n, max_n, periodic=periodic)
    return [drafter.propose(r, k) for r in rows]


def got(hist, lengths, k, min_n, max_n, periodic=False) -> list:
    drafts, counts = ngram_propose(hist, lengths, k, min_n, max_n, periodic=periodic)
    assert drafts.shape == (hist.shape[0], k) and drafts.dtype == torch.long
    assert counts.shape == (hist.shape[0],)
    out = []
    for d, c in zip(drafts.tolist(), counts.tolist()):
        assert all(x == 0 for x in d[c:])  # zeros past each row's count
        out.append(d[:c])
    return out


def check(rows, width, k, min_n, max_n, periodic=False, rng=None, vocab=4):
    hist, lengths = batch(rows, width, rng or random.Random(0), vocab)
    want = expected(rows, k, min_n, max_n, periodic)
    have = got(hist, lengths, k, min_n, max_n, periodic)
    bad = [(r, w, h) for r, w, h in zip(rows, want, have) if w != h]
    assert not bad, f"{len(bad)} rows differ (min_n={min_n}, max_n={max_n}, k={k}, " \
                    f"periodic={periodic}); first: tokens, expected, got = {bad[0]}"


@pytest.mark.parametrize("seed", range(6))
def test_random_batches_match_ngram_drafter(seed):
    rng = random.Random(seed)
    min_n = 1 + seed % 3
    max_n = min_n + seed % 4
    width = rng.choice([24, 40, 64])
    vocab = rng.choice([2, 3, 5, 8])
    rows = [[rng.randrange(vocab) for _ in range(rng.randint(0, width))] for _ in range(2000)]
    for k in (1, 3, 7):
        for periodic in (False, True):
            check(rows, width, k, min_n, max_n, periodic, rng, vocab)


def test_repetitive_rows_match_ngram_drafter():
    """Text built from repeated motifs: long matches, most-recent ties among many occurrences,
    continuations that run into the end."""
    rng = random.Random(11)
    rows = []
    for _ in range(1500):
        motif = [rng.randrange(6) for _ in range(rng.randint(1, 5))]
        text = (motif * 20)[:rng.randint(0, 48)]
        if text and rng.random() < 0.5:
            text[rng.randrange(len(text))] = rng.randrange(6)
        rows.append(text)
    for min_n, max_n in ((1, 4), (2, 5), (3, 3)):
        for periodic in (False, True):
            check(rows, 48, 6, min_n, max_n, periodic, rng, 6)


def test_edge_cases():
    rows = [
        [],                            # empty
        [3],                           # L < min_n + 1
        [3, 3],                        # the 1-gram ends at L - 2: one token, the last
        [1, 2, 3, 4, 5, 6],            # no match
        [7, 8, 9, 7, 8],               # match at position 0, continuation 9, 7, 8
        [1, 2, 3, 9, 5, 2, 3, 8, 7, 1, 2, 3],  # longest n first (the 3-gram at 0), not the
                                               # more recent 2-gram at 5
        [5, 1, 6, 7, 1],               # only a 1-gram
        [4, 2, 4, 2, 4, 2, 4],         # most recent occurrence of [4, 2, 4]: at 2, truncated
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # full width
    ]
    width = 12
    for min_n, max_n in ((1, 4), (2, 4), (1, 2), (4, 4), (1, 11), (1, 30)):
        for k in (0, 1, 2, 5, 12):
            for periodic in (False, True):
                check(rows, width, k, min_n, max_n, periodic)
    hist, lengths = batch(rows, width, random.Random(0), 4)
    assert got(hist, lengths, 3, 1, 4)[4] == [9, 7, 8]  # the match at position 0
    assert got(hist, lengths, 3, 1, 4)[5] == [9, 5, 2]  # the 3-gram, not the 2-gram at 5
    assert got(hist, lengths, 3, 1, 4)[7] == [2, 4]  # ran into the end
    assert got(hist, lengths, 3, 1, 4, periodic=True)[7] == [2, 4, 2]
    assert got(hist, lengths, 3, 2, 4)[6] == []  # min_n = 2: the 1-gram doesn't count


def test_narrow_buffers_and_clamped_lengths():
    """Widths 0 .. 2 (no earlier occurrence can exist below 2 tokens) and lengths past the
    width, clamped to it (a graph can't refuse them)."""
    for width in (0, 1, 2):
        hist = torch.full((3, width), 5, dtype=torch.long)
        drafts, counts = ngram_propose(hist, torch.tensor([0, min(width, 1), width]), 4, 1, 4)
        assert drafts.shape == (3, 4)
        assert counts.tolist() == ([0, 0, 1] if width == 2 else [0, 0, 0])
    hist = torch.tensor([[1, 2, 1, 2, 9, 9]])
    a = ngram_propose(hist, torch.tensor([100]), 2, 1, 4)
    b = ngram_propose(hist, torch.tensor([6]), 2, 1, 4)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_int32_history_and_lengths():
    rng = random.Random(3)
    rows = [[rng.randrange(3) for _ in range(rng.randint(0, 20))] for _ in range(300)]
    hist, lengths = batch(rows, 20, rng, 3)
    drafts, counts = ngram_propose(hist.int(), lengths.int(), 4, 1, 3)
    ref = ngram_propose(hist, lengths, 4, 1, 3)
    assert torch.equal(drafts, ref[0]) and torch.equal(counts, ref[1])
    assert drafts.dtype == torch.long and counts.dtype == torch.long


def test_bad_arguments_raise():
    hist, lengths = torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ConfigError, match="prompt_lookup_min"):
        ngram_propose(hist, lengths, 2, 0, 3)
    with pytest.raises(ConfigError, match="prompt_lookup_min"):
        ngram_propose(hist, lengths, 2, 3, 2)
    with pytest.raises(ValueError, match="k must be"):
        ngram_propose(hist, lengths, -1, 1, 3)
    with pytest.raises(ValueError, match="history must be"):
        ngram_propose(hist.float(), lengths, 2, 1, 3)
    with pytest.raises(ValueError, match="history must be"):
        ngram_propose(hist[0], lengths, 2, 1, 3)
    with pytest.raises(ValueError, match="lengths must be"):
        ngram_propose(hist, lengths[:1], 2, 1, 3)


class PeakBytes(TorchDispatchMode):
    """The most bytes of tensor storage that ops run under it hold at once: each op's new
    storages counted until they are freed."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak = {}, 0, 0

    def _freed(self, ptr):
        self.now -= self.live.pop(ptr)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr and ptr not in self.live and storage.nbytes():
                self.live[ptr] = storage.nbytes()
                self.now += storage.nbytes()
                self.peak = max(self.peak, self.now)
                weakref.finalize(storage, self._freed, ptr)
        return out


@pytest.mark.parametrize("rows,width", [(1, 64), (8, 512), (32, 2048)])
def test_lookup_bytes_bound_the_temporaries(rows, width):
    """What a graph of the lookup holds in its pool (the engine keeps it out of the KV pool:
    StepNgram.device_bytes): at most lookup_bytes at every max_n the options allow
    (speculative_config.NGRAM_DEVICE_MAX_N), and not far above what it uses."""
    from outpace.speculative_config import NGRAM_DEVICE_MAX_N
    hist = torch.randint(0, 3, (rows, width), dtype=torch.int32)
    lengths = torch.full((rows,), width, dtype=torch.long)
    peaks = []
    for max_n in range(1, NGRAM_DEVICE_MAX_N + 1):
        with PeakBytes() as mem:
            drafts, counts = ngram_propose(hist, lengths, 16, 1, max_n)
            del drafts, counts
        peaks.append(mem.peak)
    assert max(peaks) <= lookup_bytes(rows, width) < 2 * max(peaks) + (1 << 16), peaks
