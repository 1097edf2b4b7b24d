"""RequestStream (outpace/engine/request_stream.py): at most one unread item, later ones folded
into it, so a consumer behind by many steps reads them all in one item at the cost of one."""

from __future__ import annotations

import asyncio

import pytest

from outpace.engine.request_stream import RequestStream, StreamItem


class Owner:
    def __init__(self):
        self.aborted = []

    def abort(self, rid):
        self.aborted.append(rid)


def step_item(i: int, n: int, **kw) -> StreamItem:
    return StreamItem(text="w" * (i + 1), num_tokens=i + 1, new_token_ids=[100 + i],
                      num_prompt_tokens=n, **kw)


def read_all(stream) -> list:
    async def go():
        return [item async for item in stream]
    return asyncio.run(go())


def test_items_put_before_a_read_are_folded_into_one():
    stream = RequestStream("r", Owner())
    produced = [step_item(i, 7) for i in range(5)]
    lists = [it.new_token_ids for it in produced]  # the producers' own list objects
    for it in produced:
        stream._put(it)
    stream._put(StreamItem(text="wwwwwx", num_tokens=6, new_token_ids=[200], finished=True,
                           finish_reason="length"))
    stream._put(step_item(9, 7))  # after the end: dropped
    items = read_all(stream)
    assert len(items) == 1
    it = items[0]
    assert it.new_token_ids == [100, 101, 102, 103, 104, 200]
    assert (it.text, it.num_tokens, it.finished, it.finish_reason) == ("wwwwwx", 6, True, "length")
    assert it.num_prompt_tokens == 7
    assert lists == [[100], [101], [102], [103], [104]]  # the producers' lists untouched


def test_a_consumer_reading_each_step_gets_each_item_and_logprobs_fold_in_order():
    async def go():
        stream = RequestStream("r", Owner())
        got = []

        async def consume():
            async for item in stream:
                got.append(item)

        task = asyncio.create_task(consume())
        await asyncio.sleep(0)
        stream._put(step_item(0, 3, new_logprobs=[{100: -0.5}], token_pieces={100: "a"}))
        await asyncio.sleep(0)  # read here: one item
        lps = [{101: -1.0}]  # the producer's list: it must not grow
        stream._put(step_item(1, 3, new_logprobs=lps, token_pieces={101: "b"}))
        stream._put(StreamItem(text="ww!", num_tokens=3, new_token_ids=[102],
                               new_logprobs=[{102: -2.0}], token_pieces={102: "c"},
                               finished=True, finish_reason="stop", stop_reason=102))
        await task
        assert lps == [{101: -1.0}]
        return got

    got = asyncio.run(go())
    assert [g.new_token_ids for g in got] == [[100], [101, 102]]
    assert got[1].new_logprobs == [{101: -1.0}, {102: -2.0}]
    assert got[1].token_pieces == {101: "b", 102: "c"}
    assert (got[1].finish_reason, got[1].stop_reason, got[1].num_prompt_tokens) == ("stop", 102, 3)


def test_an_error_item_ends_the_stream_with_the_error():
    stream = RequestStream("r", Owner())
    stream._put(step_item(0, 1))
    stream._put(StreamItem(finished=True, finish_reason="error", error=RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        read_all(stream)
    assert stream.finished


def test_abort_tells_the_owner_once():
    owner = Owner()
    stream = RequestStream("r", owner)
    stream.abort()
    stream.abort()
    assert owner.aborted == ["r"] and read_all(stream) == []


def test_end_here_stops_a_reader_waiting_for_the_next_item():
    """A client gone: the reader waiting for an item the engine may never send (a dead engine)
    stops at once, the request aborted once; an item that arrives before the reader resumes,
    or later, is not read."""
    for race in (False, True):
        owner = Owner()
        stream = RequestStream("r", owner)

        async def go():
            got = []

            async def read():
                async for item in stream:
                    got.append(item.num_tokens)
            reader = asyncio.create_task(read())
            stream._put(step_item(0, 3))
            for _ in range(3):
                await asyncio.sleep(0)
            assert stream._waiter is not None and not reader.done()  # waiting again
            stream.end_here()
            if race:  # delivered between the wake-up and the reader's turn
                stream._put(step_item(1, 3))
            await asyncio.wait_for(reader, 1.0)
            stream._put(StreamItem(finished=True, finish_reason="abort"))
            stream.end_here()  # again: nothing more
            with pytest.raises(StopAsyncIteration):
                await stream.__anext__()
            return got
        assert asyncio.run(go()) == [1], race
        assert owner.aborted == ["r"]


def test_an_event_stream_ends_when_its_client_goes_even_if_the_engine_never_answers():
    """SSEResponse: the client's disconnect ends the response (its body closed) while the body
    waits for an item that never comes, and while a send is blocked until the disconnect (a
    client that stopped reading); the request is aborted once."""
    from outpace.entrypoints.openai.serving_common import SSEResponse

    for blocked_send in (False, True):
        owner = Owner()
        stream = RequestStream("r", owner)
        sent = []

        async def go():
            gone = asyncio.Event()

            async def body():
                async for item in stream:
                    yield f"data: {item.num_tokens}\n\n"
                yield "data: [DONE]\n\n"

            async def receive():
                await asyncio.sleep(0.05)
                gone.set()
                return {"type": "http.disconnect"}

            async def send(message):
                if blocked_send and message.get("more_body") and not gone.is_set():
                    await gone.wait()
                sent.append(message)
            stream._put(step_item(0, 3))  # one item, then nothing: the engine never answers
            await asyncio.wait_for(SSEResponse(body(), stream)({"type": "http"}, receive, send),
                                   2.0)
        asyncio.run(go())
        assert owner.aborted == ["r"], blocked_send
        assert sent[0]["type"] == "http.response.start"
        assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
