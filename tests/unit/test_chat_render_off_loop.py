"""The server renders a long chat off the event loop: a long rendering (content up to the body
limit) does not hold up other requests and streams (issue 38); a short one, about as long as a
hop to a thread and back, is rendered on the loop."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from outpace.entrypoints.openai.serving_chat import INLINE_RENDER_CHARS, render_prompt

LONG = [{"role": "user", "content": "x" * (INLINE_RENDER_CHARS + 1)}]


def test_the_loop_runs_while_a_chat_template_renders():
    started, release = threading.Event(), threading.Event()

    def render_chat(messages, add_generation_prompt=True):
        started.set()
        # set by a coroutine of the loop: it can run only if this does not block the loop
        assert release.wait(10), "the event loop stood still while the template rendered"
        return ("rendered", messages, add_generation_prompt)

    ctx = SimpleNamespace(engine=SimpleNamespace(tokenizer=SimpleNamespace(
        render_chat=render_chat)))
    req = SimpleNamespace(template_messages=lambda: LONG, add_generation_prompt=True)

    async def scenario():
        task = asyncio.ensure_future(render_prompt(ctx, req))
        for _ in range(1000):  # the rendering is under way ...
            await asyncio.sleep(0.01)
            if started.is_set():
                break
        release.set()  # ... and another coroutine runs meanwhile
        return await task

    assert asyncio.run(scenario()) == ("rendered", LONG, True)


def test_a_short_chat_renders_on_the_loop():
    threads = []

    def render_chat(messages, add_generation_prompt=True):
        threads.append(threading.current_thread())
        return ("rendered", messages)

    ctx = SimpleNamespace(engine=SimpleNamespace(tokenizer=SimpleNamespace(
        render_chat=render_chat)))
    short = [{"role": "user", "content": "hi"}]
    req = SimpleNamespace(template_messages=lambda: short, add_generation_prompt=True)
    assert asyncio.run(render_prompt(ctx, req)) == ("rendered", short)
    assert threads == [threading.main_thread()]
