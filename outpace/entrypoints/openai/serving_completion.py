"""POST /v1/completions, non-streaming and SSE streaming."""

from __future__ import annotations

from typing import Optional

from fastapi import Request
from fastapi.responses import JSONResponse

from outpace.entrypoints.openai.protocol import (CompletionRequest, completion_logprobs, new_id,
                                                 now_s, usage, validate)
from outpace.entrypoints.openai.serving_common import (DeltaTracker, ServingContext, SSEResponse,
                                                       collect, completion_delta_json,
                                                       finish_reason, sse_events)


async def create_completion(ctx: ServingContext, body: dict, http_request: Request,
                            arrival: Optional[float] = None):
    """arrival: time.monotonic() when the handler began (the request's TTFT starts there)."""
    req = validate(CompletionRequest, body)
    ctx.check_model(req.model)
    req.check(ctx.max_model_len)
    prompt = req.prompt_input()
    params = req.sampling_params(req.max_tokens, req.logprobs)
    rid = new_id("cmpl")
    stream = await ctx.admit(rid, prompt, params, arrival=arrival)
    created = now_s()
    if req.stream:
        return SSEResponse(_stream(ctx, req, rid, created, stream, params.stop), stream)

    last, token_ids, lps = await collect(stream, http_request)
    choice = {"index": 0, "text": last.text, "logprobs": None,
              "finish_reason": last.finish_reason, "stop_reason": last.stop_reason}
    if req.logprobs is not None:
        choice["logprobs"] = completion_logprobs(token_ids, lps or [], last.token_pieces,
                                                 req.logprobs, 0)
    return JSONResponse({
        "id": rid, "object": "text_completion", "created": created, "model": ctx.served_name,
        "choices": [choice], "system_fingerprint": None,
        "usage": usage(last.num_prompt_tokens, last.num_tokens, last.num_cached_tokens)})


async def _stream(ctx: ServingContext, req: CompletionRequest, rid: str, created: int, stream,
                  stop: list):
    tracker = DeltaTracker(stop)
    head = {"id": rid, "object": "text_completion", "created": created, "model": ctx.served_name}
    text_offset = 0

    def make_choice(item):
        nonlocal text_offset
        delta = tracker.delta(item.text, item.finished)
        lp = None
        if req.logprobs is not None and item.new_token_ids:
            lp = completion_logprobs(item.new_token_ids, item.new_logprobs or [],
                                     item.token_pieces, req.logprobs, text_offset)
            text_offset += sum(len(t) for t in lp["tokens"])
        if lp is None and not item.finished:
            return completion_delta_json(delta) if delta else None
        return {"index": 0, "text": delta, "logprobs": lp, "finish_reason": finish_reason(item),
                "stop_reason": item.stop_reason if item.finished else None}

    async for event in sse_events(stream, head, req.include_usage, make_choice,
                                 on_first_chunk=ctx.first_chunk_observer()):
        yield event
