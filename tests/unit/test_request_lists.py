"""A request's lists are bounded and checked per token in time independent of their size: stop
strings, stop token ids (issue 36's fairness rule: one request must not slow the others)."""

from __future__ import annotations

import random

import pytest

from outpace import SamplingParams
from outpace.engine.detokenize import _partial_stop
from outpace.errors import InvalidRequestError
from outpace.types import (MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS,
                           Request)


@pytest.mark.parametrize("kw,msg", [
    (dict(stop=["x"] * (MAX_STOP_STRINGS + 1)), "at most 64"),
    (dict(stop=["y" * (MAX_STOP_STRING_CHARS + 1)]), "at most 256 characters"),
    (dict(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1))), "at most 1024"),
])
def test_oversized_lists_are_a_bad_request(kw, msg):
    with pytest.raises(InvalidRequestError, match=msg):
        SamplingParams(**kw)
    # the bounds themselves are fine
    SamplingParams(stop=["x"] * MAX_STOP_STRINGS, stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)))


def test_stop_ids_are_a_set_on_the_request():
    sp = SamplingParams(stop_token_ids=[5, 7, 5])
    req = Request("r", [1, 2], sp)
    assert req.stop_id_set == frozenset({5, 7})


def _held_back_reference(text: str, stop: str) -> int:
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0


def test_partial_stop_equals_the_quadratic_reference():
    """The text held back while a stop string may still complete: the longest proper prefix of
    the stop string that the text ends with, on random texts over a small alphabet (where
    overlaps are common)."""
    rng = random.Random(0)
    for _ in range(5000):
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 14)))
        stop = "".join(rng.choice("abc") for _ in range(rng.randint(1, 9)))
        assert _partial_stop(text, stop) == _held_back_reference(text, stop), (text, stop)
