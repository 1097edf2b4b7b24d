"""What the async engine hands each request's consumer: `StreamItem`s through a `RequestStream`,
and the request's `RequestTiming` when it ends (engine/async_engine.py and, beside an engine-core
process, engine/core_client.py produce them); the event-loop side of handing them over."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class StreamItem:
    """What one request gained in one (or, merged, several) engine steps. Owned by the consumer."""

    text: str = ""  # cumulative visible text
    num_tokens: int = 0  # cumulative output tokens
    new_token_ids: list = field(default_factory=list)  # tokens since the previous item
    new_logprobs: Optional[list] = None  # per new token: {token_id: logprob}, chosen included
    token_pieces: dict = field(default_factory=dict)  # token_id -> text, for ids in new_logprobs
    finished: bool = False
    finish_reason: Optional[str] = None
    stop_reason: object = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: Optional[BaseException] = None

    def absorb(self, later: "StreamItem") -> None:
        """Fold a later item into this one, in place (a slow consumer reads several steps at
        once): the later text, counts and end; the tokens, logprobs and pieces of both."""
        self.new_token_ids.extend(later.new_token_ids)
        if later.new_logprobs is not None:
            if self.new_logprobs is None:
                self.new_logprobs = []
            self.new_logprobs.extend(later.new_logprobs)
        self.token_pieces.update(later.token_pieces)
        self.text, self.num_tokens = later.text, later.num_tokens
        self.finished, self.finish_reason = later.finished, later.finish_reason
        self.stop_reason = later.stop_reason
        self.num_prompt_tokens = later.num_prompt_tokens or self.num_prompt_tokens
        self.num_cached_tokens = later.num_cached_tokens or self.num_cached_tokens
        self.error = later.error or self.error


# The phases of a request's time to its first token, in order, as (name, from, to) over
# RequestTiming's stamps. Each ends where the next begins, so the five of TTFT_PHASES add up to
# the request's TTFT (RequestTiming.ttft); FIRST_CHUNK_PHASE follows, in the HTTP handler.
TTFT_PHASES = (
    ("frontend", "arrival", "submitted"),
    ("to_engine", "submitted", "engine_queued"),
    ("queue", "engine_queued", "scheduled"),
    ("prefill", "scheduled", "engine_first_token"),
    ("first_token_return", "engine_first_token", "first_token"),
)
FIRST_CHUNK_PHASE = ("first_chunk", "first_token", "first_chunk")


@dataclass
class RequestTiming:
    """Per-request timestamps, handed to the `on_finished` observer. All are time.monotonic() of
    the front end's process: the engine's, when the engine runs in another process, are sent as
    time.time() and mapped onto this clock when they arrive (OutputProcessor): the two clocks
    move together (NTP slews both alike; only a step of the wall clock would shift a mapped
    stamp), so the mapping keeps the differences between the processes' stamps.

    Each is taken once a request (none a token, but last_token): arrival, where the HTTP
    handler began (or add_request, when not given); submitted, when the request went to the
    engine (the engine thread's command queue, after validation and the chat template; beside
    an engine process, its pipe, after tokenizing too); engine_queued, scheduled and
    engine_first_token, the engine's Request: made (LLMEngine.add_request), first scheduled,
    first token; first_token, when the front end had that token (the engine thread's or
    tokenizer thread's output path); first_chunk, when a streamed response's first chunk of
    output was written by the handler."""

    request_id: str
    arrival: float
    submitted: Optional[float] = None
    engine_queued: Optional[float] = None
    scheduled: Optional[float] = None
    engine_first_token: Optional[float] = None
    first_token: Optional[float] = None
    first_chunk: Optional[float] = None
    last_token: Optional[float] = None
    finished: Optional[float] = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    finish_reason: Optional[str] = None

    def phase(self, start: str, end: str) -> Optional[float]:
        """Seconds from stamp `start` to stamp `end`; None unless both were taken."""
        a, b = getattr(self, start), getattr(self, end)
        return None if a is None or b is None else b - a

    def take_first_token(self, now: float, final: bool) -> None:
        """The front end has the request's first token at `now`. `final`: it comes in a
        final-only request's one output, whose first token came earlier, at the engine's
        (engine_first_token, if known); a streamed request's reaches its client now, even when
        its first output is also its last."""
        first = self.engine_first_token if final else None
        self.first_token = min(first, now) if first is not None else now

    def take_engine_times(self, metrics: dict, offset: float = 0.0) -> None:
        """The engine's stamps of this request, from its RequestOutput.metrics (times on a
        clock `offset` seconds ahead of this one: 0 in the engine's own process)."""
        for field_, key in (("engine_queued", "arrival_time"), ("scheduled", "scheduled_time"),
                            ("engine_first_token", "first_token_time")):
            t = metrics.get(key)
            setattr(self, field_, None if t is None else t - offset)

    @property
    def ttft(self) -> Optional[float]:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> Optional[float]:
        """Mean time per output token after the first (vLLM's TPOT)."""
        if self.first_token is None or self.num_output_tokens < 2:
            return None
        return (self.last_token - self.first_token) / (self.num_output_tokens - 1)

    @property
    def e2e(self) -> Optional[float]:
        return None if self.finished is None else self.finished - self.arrival


class RequestStream:
    """Async iterator over one request's StreamItems; ends after the finished item.

    It holds at most one item not yet read: an item that arrives while one waits is folded
    into it (StreamItem.absorb), so a consumer that falls behind reads every step's tokens at
    once, and the cost of a step's item stays the same however far behind it is."""

    def __init__(self, request_id: str, owner, timing: Optional["RequestTiming"] = None):
        """owner: the AsyncEngine (its abort()); timing: the request's, for the handler's own
        stamp (first_chunk)."""
        self.request_id = request_id
        self._owner = owner
        self.timing = timing
        self._pending: Optional[StreamItem] = None  # owned here until read
        self._folded = False  # whether _pending's lists are copies of its own already
        self._waiter: Optional[asyncio.Future] = None
        self.finished = False

    def _put(self, item: StreamItem) -> None:  # event loop thread only
        pending = self._pending
        if pending is None:
            self._pending, self._folded = item, False
            if self._waiter is not None and not self._waiter.done():
                self._waiter.set_result(None)
            return
        if pending.finished:  # nothing follows the end (an abort after a finish)
            return
        if not self._folded:  # the producer's lists become this stream's before they grow
            pending.new_token_ids = list(pending.new_token_ids)
            pending.token_pieces = dict(pending.token_pieces)
            if pending.new_logprobs is not None:
                pending.new_logprobs = list(pending.new_logprobs)
            self._folded = True
        pending.absorb(item)

    def __aiter__(self):
        return self

    async def __anext__(self) -> StreamItem:
        if self.finished:
            raise StopAsyncIteration
        while self._pending is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
            if self.finished:  # aborted while waiting: nothing more is read, whatever came
                raise StopAsyncIteration
        item, self._pending = self._pending, None
        if item.finished:
            self.finished = True
        if item.error is not None:
            self.finished = True
            raise item.error
        return item

    def abort(self) -> None:
        """Stop generating (client gone). Safe to call more than once, from any thread."""
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)

    def end_here(self) -> None:  # event loop thread only
        """Abort, and end the iteration now: a reader waiting for the next item stops instead
        of waiting for the engine's abort to come back (which a dead engine never sends)."""
        self.abort()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


# ---- run in the event loop (through call_soon_threadsafe) by the threads that produce items ----

def error_item(error: BaseException) -> StreamItem:
    return StreamItem(finished=True, finish_reason="error", error=error)


def deliver_batch(batch: list) -> None:
    """[(RequestStream, StreamItem)] handed to their streams: one loop callback per batch."""
    for stream, item in batch:
        stream._put(item)


def set_future(fut: asyncio.Future, error: Optional[BaseException], result=None) -> None:
    if fut.done():  # the caller was cancelled
        return
    if error is None:
        fut.set_result(result)
    else:
        fut.set_exception(error)


class LoopCrossing:
    """What a front end's worker threads hand the event loop (`self._loop`): stream items, one
    callback a batch, and the results of futures the loop awaits."""

    _loop: asyncio.AbstractEventLoop

    def _deliver(self, batch: list) -> None:
        if batch:
            self._call_in_loop(deliver_batch, batch)

    def _resolve(self, fut: asyncio.Future, error: Optional[BaseException],
                 result=None) -> None:
        self._call_in_loop(set_future, fut, error, result)

    def _call_in_loop(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed during shutdown: nobody is listening any more
            pass
