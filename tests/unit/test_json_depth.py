"""protocol.json_depth: how deep a request body nests, in time linear in its size whatever it
holds (it runs on the event loop before the body is parsed)."""

from __future__ import annotations

import time

from outpace.entrypoints.openai.protocol import MAX_JSON_DEPTH, json_depth


def test_depth_counts_brackets_outside_strings():
    assert json_depth('{"a": [1, {"b": "[[[[ {{"}]}') == 3
    assert json_depth('{"a": "x\\"y[", "b": [[[1]]]}') == 4  # an escaped quote in a string
    assert json_depth("[" * 100 + "]" * 100) == MAX_JSON_DEPTH + 1  # stops counting early
    assert json_depth('[["a\\\\", "[", "b\\\\\\"]"]]') == 2  # escaped backslashes, quotes
    assert json_depth('[["abc\\') == 2  # ends inside a string, on a lone backslash


def test_unterminated_strings_take_linear_time():
    """A body of quotes and escaped quotes, never closed: a string pattern that can fail
    re-reads the rest of the body at every quote (hours at 4 MiB)."""
    body = '"' + '\\"' * 400_000
    t = time.perf_counter()
    json_depth(body)
    assert time.perf_counter() - t < 1.0
