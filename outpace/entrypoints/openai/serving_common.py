"""What completions and chat share: the serving context, SSE framing, streamed-text deltas,
collecting a non-streamed result, and aborting a request whose client went away."""

from __future__ import annotations

import asyncio
import json
import json.encoder
import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

from fastapi import Request
from starlette.responses import StreamingResponse

from outpace.engine.async_engine import AsyncEngine
from outpace.engine.request_stream import RequestStream, StreamItem
from outpace.entrypoints.openai.errors import APIError, error_body, to_api_error

log = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


@dataclass
class ServingContext:
    engine: AsyncEngine
    served_name: str  # what /v1/models lists and responses carry
    accepted_names: frozenset  # model names a request may use
    metrics: Optional[object] = None  # ServerMetrics

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def first_chunk_observer(self) -> Optional[Callable]:
        """What sse_events calls with a stream's timing once its first chunk is written."""
        return self.metrics.on_first_chunk if self.metrics is not None else None

    def check_model(self, name: Optional[str]) -> None:
        """A request may name the served model or leave `model` out (it is the only one)."""
        if name is not None and name not in self.accepted_names:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                           f"{self.served_name!r} (see /v1/models)", param="model",
                           code="model_not_found")

    async def admit(self, request_id: str, prompt, params, add_special_tokens: bool = True,
                    arrival: Optional[float] = None) -> RequestStream:
        """arrival: time.monotonic() when the request's handler began (its TTFT starts there)."""
        try:
            return await self.engine.add_request(request_id, prompt, params, add_special_tokens,
                                                 arrival=arrival)
        except Exception as e:
            err = to_api_error(e)
            if err.status == 503 and err.code == "queue_full" and self.metrics is not None:
                self.metrics.rejected.labels(self.served_name).inc()
            raise err from e


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


# A str as json.dumps(..., ensure_ascii=False) writes it (the function json.dumps itself calls).
json_str = json.encoder.encode_basestring


def chat_delta_json(text: str) -> str:
    """json.dumps of a streamed chat choice that carries only `text` (no logprobs, not the
    last), written without building the dict: a stream's most frequent chunk."""
    return (f'{{"index": 0, "delta": {{"content": {json_str(text)}}}, "logprobs": null, '
            f'"finish_reason": null}}')


def completion_delta_json(text: str) -> str:
    """chat_delta_json's completions twin."""
    return (f'{{"index": 0, "text": {json_str(text)}, "logprobs": null, "finish_reason": null, '
            f'"stop_reason": null}}')


class ChunkFormat:
    """One stream's SSE chunks: its constant fields (id, object, created, model) serialized once;
    a chunk's text is then that prefix, the choice's JSON and the closing."""

    def __init__(self, head: dict):
        self._prefix = f'data: {json.dumps(head, ensure_ascii=False)[:-1]}, "choices": ['

    def chunk(self, choice) -> str:
        """choice: a dict, or its JSON already (chat_delta_json's) -> the event's text, equal to
        sse({**head, "choices": [choice], "usage": None})."""
        body = choice if isinstance(choice, str) else json.dumps(choice, ensure_ascii=False)
        return f'{self._prefix}{body}], "usage": null}}\n\n'


def sse_error(exc: BaseException) -> str:
    err = to_api_error(exc)
    return sse(error_body(err.status, err.message, err.param, err.code))


async def sse_events(stream, head: dict, include_usage: bool, make_choice, first=None,
                     on_first_chunk: Optional[Callable] = None):
    """The SSE framing both endpoints share: one chunk per stream item that `make_choice(item)`
    turns into a choice (a dict, or its JSON; None: skip), the usage chunk if asked, errors
    in-band (the status line is gone by then), the request aborted on the way out (a no-op when
    it finished), [DONE]. `first`: a choice sent before any item (chat's role chunk).
    on_first_chunk(timing): called once the first item's chunk was written (the HTTP layer's
    send returned), its time in the stream's timing.first_chunk (ServerMetrics.on_first_chunk)."""
    from outpace.entrypoints.openai.protocol import usage
    last = None
    fmt = ChunkFormat(head)
    try:
        if first is not None:
            yield fmt.chunk(first)
        # the first item's chunk apart, so the stamp costs the other chunks nothing
        async for item in stream:
            last = item
            choice = make_choice(item)
            if choice is not None:
                yield fmt.chunk(choice)
                timing = getattr(stream, "timing", None)
                if on_first_chunk is not None and timing is not None:
                    timing.first_chunk = time.monotonic()
                    on_first_chunk(timing)
                break
        async for item in stream:  # (after the break: the rest; else it has ended)
            last = item
            choice = make_choice(item)
            if choice is not None:
                yield fmt.chunk(choice)
        if include_usage and last is not None:
            yield sse({**head, "choices": [],
                       "usage": usage(last.num_prompt_tokens, last.num_tokens,
                                      last.num_cached_tokens)})
    except Exception as e:  # noqa: BLE001
        yield sse_error(e)
    finally:
        stream.abort()
    yield DONE


class DeltaTracker:
    """Cuts the streamed text so that the chunks, joined, equal the final (non-streamed) text.

    Until a request finishes it holds back (a) the last max(len(stop)) - 1 characters, which a
    stop string completed by a later token could still remove, and (b) trailing U+FFFD, the mark
    of a UTF-8 character whose remaining bytes are in the next token."""

    def __init__(self, stop: list):
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.num_sent = 0

    def delta(self, text: str, finished: bool) -> str:
        if not finished:
            if self.hold:
                text = text[:max(len(text) - self.hold, 0)]
            text = text.rstrip("\ufffd")
        if len(text) <= self.num_sent:
            return ""
        out = text[self.num_sent:]
        self.num_sent = len(text)
        return out


class SSEResponse(StreamingResponse):
    """An event stream that aborts its engine request however the response ends (client gone,
    server shutdown, error), so the request's KV blocks are freed at once.

    A client that goes away ends the request's stream (`RequestStream.end_here`), and so the
    response; a plain asyncio task waits for the disconnect beside the streaming. (Starlette's
    own response streams inside an anyio task group whose cancel scope ends the stream: per
    request, that machinery cost more than the rest of the response's set-up.)"""

    def __init__(self, content, stream: RequestStream):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._stream = stream

    async def __call__(self, scope, receive, send):
        watcher = asyncio.create_task(_end_on_disconnect(receive, self._stream))
        try:
            await self.stream_response(send)
        finally:
            watcher.cancel()
            self._stream.abort()  # no-op when it finished


async def _end_on_disconnect(receive, stream: RequestStream) -> None:
    # The body has been read, so the next ASGI message is the disconnect.
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            stream.end_here()
            return


async def collect(stream: RequestStream, http_request: Request) -> tuple:
    """Run a request to the end; returns (last item, all token ids, all logprobs or None).

    A client that disconnects while waiting gets its request aborted and its stream ended
    (`RequestStream.end_here`): a 499 nobody reads."""
    watcher = asyncio.create_task(_end_on_disconnect(http_request.receive, stream))
    token_ids, lps, last = [], None, None
    try:
        async for item in stream:
            token_ids.extend(item.new_token_ids)
            if item.new_logprobs is not None:
                lps = (lps or []) + item.new_logprobs
                pieces = (last.token_pieces if last else {}) | item.token_pieces
                item.token_pieces = pieces
            elif last is not None:
                item.token_pieces = last.token_pieces
            last = item
    finally:
        watcher.cancel()
        stream.abort()
    if last is None or not last.finished:
        raise APIError(499, "the client closed the connection; the request was aborted")
    return last, token_ids, lps


def finish_reason(item: StreamItem) -> Optional[str]:
    return item.finish_reason if item.finished else None
