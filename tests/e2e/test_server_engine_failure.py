"""A failing engine step fails only the requests in flight and the loop goes on; repeated
failures kill the engine thread, and then /health and new requests answer 503.

In-process (the failure is injected into the real engine's `step`), through httpx's ASGI
transport, so no port and no subprocess."""

from __future__ import annotations

import asyncio

import httpx

from outpace.config import ServerConfig
from outpace.engine.async_engine import AsyncEngine
from outpace.engine.engine import LLMEngine
from outpace.entrypoints.openai.server import build_app

from tests.e2e.server_helpers import MAX_MODEL_LEN, NUM_KV_BLOCKS


def _served(tiny_model_dir, max_consecutive_step_failures: int):
    """(engine, its AsyncEngine, the app, a completion request's body)."""
    engine = LLMEngine.from_args(str(tiny_model_dir), device="cpu", max_model_len=MAX_MODEL_LEN,
                                 num_kv_blocks=NUM_KV_BLOCKS, quiet=True)
    aengine = AsyncEngine(engine, max_consecutive_step_failures=max_consecutive_step_failures)
    body = {"model": engine.model_name, "prompt": "hi", "max_tokens": 4, "ignore_eos": True}
    return engine, aengine, build_app(aengine, ServerConfig()), body


def test_step_failure_is_contained_then_fatal(tiny_model_dir):
    engine, aengine, app, body = _served(tiny_model_dir, 2)
    real_step = engine.step

    def boom():
        raise RuntimeError("injected step failure")

    async def scenario():
        aengine.start()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://localhost") as c:
            assert (await c.get("/health")).status_code == 200
            assert (await c.post("/v1/completions", json=body)).status_code == 200

            engine.step = boom  # one failure: that request fails, its KV is released
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 500 and "injected" in r.json()["error"]["message"]
            assert aengine.stats()["kv_blocks_used"] == 0 and aengine.healthy
            engine.step = real_step
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4

            engine.step = boom  # two failures in a row: the engine is dead
            assert (await c.post("/v1/completions", json=body)).status_code == 500
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
            for _ in range(50):
                if not aengine.healthy:
                    break
                await asyncio.sleep(0.02)
            assert (await c.get("/health")).status_code == 503
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
        aengine.shutdown()

    asyncio.run(scenario())


def test_an_engine_that_stopped_is_dead_at_its_first_failure(tiny_model_dir):
    """EngineStoppedError (a tensor-parallel rank ended) is not one step's failure: the loop
    stops at once instead of failing more rounds of requests first."""
    from outpace.errors import EngineStoppedError
    engine, aengine, app, body = _served(tiny_model_dir, 3)

    def stopped():
        raise EngineStoppedError("tensor-parallel rank 1 ended (exit code -9)")

    async def scenario():
        aengine.start()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://localhost") as c:
            engine.step = stopped
            r = await c.post("/v1/completions", json=body)
            assert r.status_code != 200 and "rank 1 ended" in r.json()["error"]["message"]
            for _ in range(50):
                if not aengine.healthy:
                    break
                await asyncio.sleep(0.02)
            assert (await c.get("/health")).status_code == 503
        aengine.shutdown()

    asyncio.run(scenario())
