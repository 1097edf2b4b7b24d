"""POST /tokenize and /detokenize, shaped as vLLM's.

    /tokenize    {"model", "prompt"} or {"model", "messages", "add_generation_prompt"}
                 -> {"count", "max_model_len", "tokens", "token_strs"}
    /detokenize  {"model", "tokens"} -> {"prompt"}

Messages are tokenized exactly as a chat completion tokenizes them (the same ids reach the
model). The tokenizer runs in the engine's tokenizer-owning thread, as for every request (it is
not shared across threads): the engine thread, or beside an engine process the front end's
tokenizer thread; the chat template renders in a worker thread (serving_chat.render_prompt)."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse

from outpace.entrypoints.openai.errors import APIError
from outpace.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest, validate
from outpace.entrypoints.openai.serving_chat import render_prompt
from outpace.entrypoints.openai.serving_common import ServingContext


async def tokenize(ctx: ServingContext, body: dict, _http_request: Request):
    req = validate(TokenizeRequest, body)
    ctx.check_model(req.model)
    req.check()
    chat = await render_prompt(ctx, req.chat()) if req.messages is not None else None

    def encode(tok) -> tuple:
        if chat is not None:
            ids = tok.encode_chat(chat)
        else:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
        return ids, tok.convert_ids_to_tokens(ids) if req.return_token_strs else None

    ids, strs = await ctx.engine.run_tokenizer(encode)
    return JSONResponse({"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids,
                         "token_strs": strs})


async def detokenize(ctx: ServingContext, body: dict, _http_request: Request):
    req = validate(DetokenizeRequest, body)
    ctx.check_model(req.model)

    def decode(tok) -> str:
        bad = next((t for t in req.tokens if not 0 <= t < tok.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is not in this tokenizer's vocabulary "
                           f"(0..{tok.vocab_size - 1})", param="tokens")
        # special tokens kept, as vLLM keeps them: the text is what the ids stand for
        return tok.decode(req.tokens, skip_special_tokens=False)

    return JSONResponse({"prompt": await ctx.engine.run_tokenizer(decode)})
