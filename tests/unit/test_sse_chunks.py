"""The server's SSE chunks written without json.dumps of the whole event
(entrypoints/openai/serving_common.py): byte for byte what json.dumps writes, for texts that
JSON must escape."""

from __future__ import annotations

import json

import pytest

from outpace.entrypoints.openai.serving_common import (ChunkFormat, chat_delta_json,
                                                       completion_delta_json, sse)

TEXTS = ["", " world", 'a "quoted" \\ back\\slash', "tab\tnew\nline\r\x00\x1f\x7f",
         "é ü 中文 😀 \u2028\u2029", "\ud800 lone surrogate", "</script>"]
HEAD = {"id": "chatcmpl-x\"y", "object": "chat.completion.chunk", "created": 17,
        "model": "mödel"}


@pytest.mark.parametrize("text", TEXTS)
def test_the_fast_choices_are_what_json_dumps_writes(text):
    chat = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
    comp = {"index": 0, "text": text, "logprobs": None, "finish_reason": None,
            "stop_reason": None}
    assert chat_delta_json(text) == json.dumps(chat, ensure_ascii=False)
    assert completion_delta_json(text) == json.dumps(comp, ensure_ascii=False)
    fmt = ChunkFormat(HEAD)
    for choice, fast in ((chat, chat_delta_json(text)), (comp, completion_delta_json(text))):
        want = sse({**HEAD, "choices": [choice], "usage": None})
        assert fmt.chunk(choice) == want
        assert fmt.chunk(fast) == want
        assert json.loads(want[len("data: "):])["choices"][0] == choice
