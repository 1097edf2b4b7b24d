"""The server renders a chat template off the event loop: a long rendering (content up to the
body limit) does not hold up other requests and streams (issue 38)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from outpace.entrypoints.openai.serving_chat import render_prompt


def test_the_loop_runs_while_a_chat_template_renders():
    started, release = threading.Event(), threading.Event()

    def render_chat(messages, add_generation_prompt=True):
        started.set()
        # set by a coroutine of the loop: it can run only if this does not block the loop
        assert release.wait(10), "the event loop stood still while the template rendered"
        return ("rendered", messages, add_generation_prompt)

    ctx = SimpleNamespace(engine=SimpleNamespace(tokenizer=SimpleNamespace(
        render_chat=render_chat)))
    req = SimpleNamespace(template_messages=lambda: [{"role": "user", "content": "hi"}],
                          add_generation_prompt=True)

    async def scenario():
        task = asyncio.ensure_future(render_prompt(ctx, req))
        for _ in range(1000):  # the rendering is under way ...
            await asyncio.sleep(0.01)
            if started.is_set():
                break
        release.set()  # ... and another coroutine runs meanwhile
        return await task

    assert asyncio.run(scenario()) == ("rendered", [{"role": "user", "content": "hi"}], True)
