"""CommittedTokens (speculative/base.py): a view of prompt + output + a step's tokens that reads like
their concatenated list, which the model-free drafters take from the fused step."""

import random

import pytest

from outpace.speculative.base import CommittedTokens
from outpace.speculative.ngram import NgramState


def test_reads_like_the_concatenated_list():
    rnd = random.Random(0)
    for _ in range(200):
        parts = [[rnd.randint(0, 9) for _ in range(rnd.randint(0, 6))] for _ in range(3)]
        whole = parts[0] + parts[1] + parts[2]
        view = CommittedTokens(*parts)
        assert len(view) == len(whole) and list(view) == whole
        for i in range(-len(whole), len(whole)):
            assert view[i] == whole[i]
        for a in range(-3, len(whole) + 3):
            for b in range(-3, len(whole) + 3):
                assert view[a:b] == whole[a:b], (parts, a, b)
        assert view[::2] == whole[::2] and view[5:] == whole[5:]
        with pytest.raises(IndexError):
            view[len(whole)]


def test_drafter_state_catches_up_from_a_view():
    prompt, out = [1, 2, 3, 1, 2], [3, 1]
    a, b = NgramState(), NgramState()
    a.extend(prompt)
    b.extend(prompt)
    a.update(prompt + out + [2])
    b.update(CommittedTokens(prompt, out, [2]))
    assert a.tokens == b.tokens and a.propose(3) == b.propose(3) == [3, 1, 2]
