"""A non-streaming request asks the engine for its final output only (SamplingParams.output_kind
"final_only"): the engine hands the server one output when it finishes, not one a step; the
response and the TTFT the metrics see come out as with per-step outputs.

In-process, through httpx's ASGI transport (no port, no subprocess)."""

from __future__ import annotations

import asyncio
import json

import httpx

from outpace.config import ServerConfig
from outpace.engine.async_engine import AsyncEngine
from outpace.engine.engine import LLMEngine
from outpace.entrypoints.openai.server import build_app

from tests.e2e.server_helpers import MAX_MODEL_LEN, NUM_KV_BLOCKS


def test_non_streaming_requests_get_final_outputs_only(tiny_model_dir):
    engine = LLMEngine.from_args(str(tiny_model_dir), device="cpu", max_model_len=MAX_MODEL_LEN,
                                 num_kv_blocks=NUM_KV_BLOCKS,
                                 quiet=True)
    timings = []
    aengine = AsyncEngine(engine, on_finished=timings.append)
    app = build_app(aengine, ServerConfig())
    kinds, outputs_seen = {}, []  # outputs_seen: (output_kind, finished) of every output
    real_step, real_add = engine.step, engine.add_request

    def step():
        outs = real_step()
        outputs_seen.extend((kinds[o.request_id], o.finished) for o in outs)
        return outs

    def add_request(rid, prompt, params):
        kinds[rid] = params.output_kind
        return real_add(rid, prompt, params)

    engine.step, engine.add_request = step, add_request
    body = {"model": engine.model_name, "prompt": "hi there", "max_tokens": 6,
            "temperature": 0.0, "ignore_eos": True}

    async def scenario():
        aengine.start()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://localhost") as c:
            whole = (await c.post("/v1/completions", json=body)).json()
            text = ""
            async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        text += json.loads(line[6:])["choices"][0]["text"]
        aengine.shutdown()
        return whole, text

    whole, streamed = asyncio.run(scenario())
    assert whole["choices"][0]["text"] == streamed
    assert whole["usage"]["completion_tokens"] == 6
    final_only = [f for kind, f in outputs_seen if kind == "final_only"]
    cumulative = [f for kind, f in outputs_seen if kind == "cumulative"]
    assert final_only == [True], "a non-streaming request got per-step outputs"
    assert len(cumulative) >= 6 and cumulative[-1] is True  # the stream got one a step
    t = timings[0]  # the non-streaming request's: its first token before it finished
    assert t.num_output_tokens == 6 and t.first_token < t.finished
    assert t.arrival <= t.first_token
