"""POST /v1/chat/completions, non-streaming and SSE streaming.

The prompt is the chat template (the model's, from its tokenizer files, or --chat-template)
rendered over the messages, with the assistant turn opened; text in a message's content is
plain text, never a special token."""

from __future__ import annotations

import asyncio
from typing import Optional

from fastapi import Request
from fastapi.responses import JSONResponse

from outpace.chat_template import ChatPrompt
from outpace.entrypoints.openai.errors import APIError
from outpace.entrypoints.openai.protocol import (ChatCompletionRequest, chat_logprobs, new_id,
                                                 now_s, usage, validate)
from outpace.entrypoints.openai.serving_common import (DeltaTracker, ServingContext, SSEResponse,
                                                       chat_delta_json, collect, finish_reason,
                                                       sse_events)
from outpace.errors import InvalidRequestError


# Messages with at most this much content (characters, all messages together) are rendered on
# the event loop: their rendering takes about as long as a hop to a worker thread and back.
INLINE_RENDER_CHARS = 4096


async def render_prompt(ctx: ServingContext, req) -> ChatPrompt:
    """The request's messages rendered with the chat template; tokenized later, in the thread
    that owns the tokenizer (the engine thread, or the front end's tokenizer thread beside an
    engine process), with special tokens only where the template put them
    (Tokenizer.encode_chat).

    Longer conversations are rendered in a worker thread: the rendering's time grows with the
    messages' content (up to the body limit), and on the event loop it would hold up every
    other request and stream meanwhile. Rendering is Jinja alone, safe beside the engine
    thread's tokenizer calls."""
    messages = req.template_messages()
    render = ctx.engine.tokenizer.render_chat
    try:
        if sum(len(m["content"]) for m in messages) <= INLINE_RENDER_CHARS and \
                len(messages) <= 64:
            return render(messages, add_generation_prompt=req.add_generation_prompt)
        return await asyncio.to_thread(render, messages,
                                       add_generation_prompt=req.add_generation_prompt)
    except InvalidRequestError as e:
        raise APIError(400, str(e), param="messages") from e
    except Exception as e:  # noqa: BLE001 -- jinja raises plain exceptions on bad conversations
        raise APIError(400, f"the chat template could not render these messages: "
                       f"{type(e).__name__}: {e}", param="messages") from e


async def create_chat_completion(ctx: ServingContext, body: dict, http_request: Request,
                                 arrival: Optional[float] = None):
    """arrival: time.monotonic() when the handler began (the request's TTFT starts there)."""
    req = validate(ChatCompletionRequest, body)
    ctx.check_model(req.model)
    req.check(ctx.max_model_len)
    prompt = await render_prompt(ctx, req)
    n_top = (req.top_logprobs or 0) if req.logprobs else None
    params = req.sampling_params(req.max_tokens, n_top)
    rid = new_id("chatcmpl")
    stream = await ctx.admit(rid, prompt, params, arrival=arrival)
    created = now_s()
    if req.stream:
        return SSEResponse(_stream(ctx, req, rid, created, stream, params.stop, n_top), stream)

    last, token_ids, lps = await collect(stream, http_request)
    choice = {"index": 0, "message": {"role": "assistant", "content": last.text},
              "logprobs": None, "finish_reason": last.finish_reason,
              "stop_reason": last.stop_reason}
    if n_top is not None:
        choice["logprobs"] = chat_logprobs(token_ids, lps or [], last.token_pieces, n_top)
    return JSONResponse({
        "id": rid, "object": "chat.completion", "created": created, "model": ctx.served_name,
        "choices": [choice], "system_fingerprint": None,
        "usage": usage(last.num_prompt_tokens, last.num_tokens, last.num_cached_tokens)})


async def _stream(ctx: ServingContext, req: ChatCompletionRequest, rid: str, created: int,
                  stream, stop: list, n_top):
    tracker = DeltaTracker(stop)
    head = {"id": rid, "object": "chat.completion.chunk", "created": created,
            "model": ctx.served_name}
    # The role comes first, on its own, as OpenAI sends it.
    role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
            "finish_reason": None}

    def make_choice(item):
        delta = tracker.delta(item.text, item.finished)
        lp = None
        if n_top is not None and item.new_token_ids:
            lp = chat_logprobs(item.new_token_ids, item.new_logprobs or [], item.token_pieces,
                               n_top)
        if lp is None and not item.finished:
            return chat_delta_json(delta) if delta else None
        choice = {"index": 0, "delta": {"content": delta} if delta or lp else {},
                  "logprobs": lp, "finish_reason": finish_reason(item)}
        if item.finished:
            choice["stop_reason"] = item.stop_reason
        return choice

    async for event in sse_events(stream, head, req.include_usage, make_choice, first=role,
                                 on_first_chunk=ctx.first_chunk_observer()):
        yield event
