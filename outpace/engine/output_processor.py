"""The front end's side of an engine-core process's outputs: each request's new token ids
turned into the `StreamItem`s the server streams (text, stop strings, logprobs' token pieces,
timing), as vLLM V1's output processor does beside its engine core.

The engine core runs its requests with `detokenize=False` and no stop strings (it schedules and
steps, nothing else); here each request's tokens are fed one at a time to its
`IncrementalDetokenizer`, so a stop string ends the output at exactly the token that completed
it, as the in-process engine ends it. A request a stop string ended is reported in `stopped`:
the caller aborts it in the engine core (its KV blocks are freed there), whose later tokens for
it are ignored.

Not thread-safe: one thread (the front end's tokenizer thread) owns it and the tokenizer.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import NamedTuple, Optional

from outpace.engine.detokenize import IncrementalDetokenizer
from outpace.engine.request_stream import RequestStream, RequestTiming, StreamItem
from outpace.types import SamplingParams


class CoreOutput(NamedTuple):
    """What one engine step gave one request (engine core -> front end; a plain tuple)."""

    request_id: str
    new_token_ids: list
    finish_reason: Optional[str]  # None while it runs
    stop_reason: object  # a stop token id, or None
    new_logprobs: Optional[list]  # per new token {token_id: logprob}, or None (not asked)
    num_prompt_tokens: int
    num_cached_tokens: int
    # on a request's first output with tokens, and only there: the engine's stamps of it
    # (ENGINE_TIME_KEYS of RequestOutput.metrics) as time.time(), a clock both processes share
    engine_times: Optional[dict]


def merge_run(outs: list) -> CoreOutput:
    """One request's outputs of several steps in a row as one: the tokens (and logprobs) of all,
    the last one's end and counts, the first engine stamps (its first token's); an output after
    a finished one (none comes) is dropped. Linear in their tokens: a front end far behind
    merges hundreds of steps, and pairwise joins would copy a request's tokens once a step."""
    ids, lps, any_lps, times, last = [], [], False, None, outs[0]
    for o in outs:
        last = o
        ids.extend(o.new_token_ids)
        if o.new_logprobs is not None:
            any_lps = True
            lps.extend(o.new_logprobs)
        times = times or o.engine_times
        if o.finish_reason is not None:  # nothing comes after the end
            break
    return last._replace(new_token_ids=ids, new_logprobs=lps if any_lps else None,
                         engine_times=times)


def coalesce_messages(msgs: list) -> list:
    """The engine core's messages as they queued up at a front end behind it, with each run of
    consecutive step messages ("out", acks, outputs, failed, stats) made one: its acks, each
    request's outputs merged in the order the requests first appear, its failures, its last
    stats. Processed as one, a run costs each request one item (one streamed chunk) instead
    of one a step, so a front end that fell behind catches up instead of falling further.
    Any other message ends a run and keeps its place."""
    result, run = [], []

    def flush():
        if len(run) == 1:
            result.append(run[0])
        elif run:
            acks, failed, stats, merged = [], [], None, {}
            for _, a, outputs, f, st in run:
                acks.extend(a)
                failed.extend(f)
                stats = st if st is not None else stats
                for out in outputs:
                    merged.setdefault(out.request_id, []).append(out)
            result.append(("out", acks, [outs[0] if len(outs) == 1 else merge_run(outs)
                                         for outs in merged.values()], failed, stats))
        run.clear()

    for msg in msgs:
        if msg[0] == "out":
            run.append(msg)
        else:
            flush()
            result.append(msg)
    flush()
    return result


ENGINE_TIME_KEYS = ("arrival_time", "scheduled_time", "first_token_time")


def wall_clock_times(metrics: dict) -> dict:
    """The engine's monotonic stamps of a request (its RequestOutput.metrics) as time.time()
    (the engine core's side of CoreOutput.engine_times)."""
    offset = time.time() - time.monotonic()
    return {k: None if metrics.get(k) is None else metrics[k] + offset
            for k in ENGINE_TIME_KEYS}


def core_params(params: SamplingParams) -> SamplingParams:
    """The request as the engine core runs it: token ids out, no text, no stop strings (they
    are matched here); a request with stop strings gets its tokens every step, so that a stop
    string found here stops it at once."""
    return dataclasses.replace(
        params, stop=[], include_stop_str_in_output=False, detokenize=False,
        output_kind="cumulative" if params.stop else params.output_kind)


def token_piece(tokenizer, token_id: int) -> str:
    """A token's own text, special tokens included (logprobs name every token)."""
    try:
        return tokenizer.decode([token_id], skip_special_tokens=False)
    except TypeError:  # a tokenizer without the keyword
        return tokenizer.decode([token_id])


@dataclass
class _State:
    stream: RequestStream
    timing: RequestTiming
    detok: IncrementalDetokenizer
    want_logprobs: bool
    final_only: bool  # the request's one output comes at its end (not streamed)
    num_tokens: int = 0


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._states: dict = {}  # request_id -> _State, while the request runs

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def add(self, request_id: str, prompt_ids: list, params: SamplingParams,
            stream: RequestStream, timing: RequestTiming) -> None:
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens,
                                       params.stop, params.include_stop_str_in_output)
        self._states[request_id] = _State(stream, timing, detok,
                                          want_logprobs=params.logprobs is not None,
                                          final_only=params.output_kind == "final_only")

    def pop(self, request_id: str) -> Optional[_State]:
        """Forget a request (aborted, failed, refused); its state, or None if unknown."""
        return self._states.pop(request_id, None)

    def pop_all(self) -> list:
        """Forget every request (the engine core is gone); their states."""
        states = list(self._states.values())
        self._states.clear()
        return states

    def abort_item(self, state: _State) -> StreamItem:
        """The finished item of a request aborted by its consumer; its timing closed."""
        state.timing.finished = time.monotonic()
        state.timing.finish_reason = "abort"
        return StreamItem(num_tokens=state.num_tokens, finished=True, finish_reason="abort")

    def process(self, outputs: list, now: float) -> tuple:
        """One engine step's CoreOutputs -> (batch [(stream, item)], finished [RequestTiming],
        stopped [request ids a stop string ended while the engine core still runs them])."""
        batch, finished, stopped = [], [], []
        for out in outputs:
            state = self._states.get(out.request_id)
            if state is None:  # aborted or stopped while the step ran
                continue
            item, stop_here = self._item(out, state, now)
            batch.append((state.stream, item))
            if item.finished:
                del self._states[out.request_id]
                finished.append(state.timing)
                if stop_here:
                    stopped.append(out.request_id)
        return batch, finished, stopped

    def _item(self, out: CoreOutput, state: _State, now: float) -> tuple:
        new_ids, lps = out.new_token_ids, out.new_logprobs
        finish, stop_reason, stop_here = out.finish_reason, out.stop_reason, False
        add_token = state.detok.add_token
        for i, token in enumerate(new_ids):
            stop = add_token(token)
            if stop is not None:
                # everything after the token that completed the stop string is dropped
                new_ids = new_ids[:i + 1]
                lps = lps[:i + 1] if lps is not None else None
                stop_here = finish is None
                finish, stop_reason = "stop", stop
                break
        state.num_tokens += len(new_ids)
        n = state.num_tokens
        timing = state.timing
        done = finish is not None
        if new_ids:
            if timing.first_token is None:
                if out.engine_times is not None:  # time.time() -> this process's monotonic
                    timing.take_engine_times(out.engine_times, time.time() - time.monotonic())
                timing.take_first_token(now, final=done and state.final_only)
            timing.last_token = now
        timing.num_prompt_tokens = out.num_prompt_tokens
        timing.num_output_tokens = n
        pieces = {}
        if state.want_logprobs:
            lps = [dict(d) for d in (lps or [])]
            tok = self.tokenizer
            pieces = {t: token_piece(tok, t) for d in lps for t in d}
        else:
            lps = None
        if done:
            timing.finished = now
            timing.finish_reason = finish
        return StreamItem(text=state.detok.visible_text(done), num_tokens=n,
                          new_token_ids=list(new_ids), new_logprobs=lps, token_pieces=pieces,
                          finished=done, finish_reason=finish, stop_reason=stop_reason,
                          num_prompt_tokens=out.num_prompt_tokens,
                          num_cached_tokens=out.num_cached_tokens), stop_here
