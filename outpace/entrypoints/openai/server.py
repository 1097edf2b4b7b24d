"""The OpenAI-compatible HTTP server: FastAPI app factory and uvicorn runner.

    GET  /health               200 while the engine (thread or process) runs, else 503
    GET  /metrics              Prometheus text (see metrics.py)
    GET  /version              {"version": outpace's}
    GET  /v1/models            the served model
    POST /v1/completions       serving_completion.py
    POST /v1/chat/completions  serving_chat.py
    POST /tokenize, /detokenize  serving_tokenize.py

Bodies are read and parsed here (not by FastAPI) so that a body that is too big, not UTF-8 or
not JSON gets an OpenAI-style 4xx that says what is wrong, like every other malformed request.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import os
import sys
import time
from contextlib import asynccontextmanager, suppress
from typing import TYPE_CHECKING, Callable, Optional

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from outpace import __version__
from outpace.config import ServerConfig
from outpace.engine.args import EngineArgs
from outpace.engine.async_engine import AsyncEngine
from outpace.entrypoints.openai.access_log import AccessLog
from outpace.entrypoints.openai.errors import (APIError, error_response, install_error_handlers,
                                               to_api_error)
from outpace.entrypoints.openai.http_protocol import HEADER_PARSED
from outpace.entrypoints.openai.protocol import now_s, parse_body
from outpace.entrypoints.openai.serving_chat import create_chat_completion
from outpace.entrypoints.openai.serving_common import ServingContext
from outpace.entrypoints.openai.serving_completion import create_completion
from outpace.entrypoints.openai.serving_tokenize import detokenize, tokenize

if TYPE_CHECKING:  # prometheus_client is imported by build_app: run_server sets up its mode first
    from outpace.entrypoints.openai.metrics import ServerMetrics

log = logging.getLogger(__name__)

# A body this many times over the limit is not drained (the connection is dropped instead).
_DRAIN_FACTOR = 16


LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})


def host_name(host_header: str) -> str:
    """The name of a Host header, without its port ("[::1]:8000" -> "::1")."""
    h = host_header.strip().lower()
    if h.startswith("["):
        return h[1:h.find("]")] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


def host_allowed(host_header: str) -> bool:
    """Whether a keyless loopback server answers a request with this Host header: a loopback
    name, an IP address (no DNS name, so no rebinding) or none (HTTP/1.0)."""
    name = host_name(host_header).rstrip(".")
    if not name or name in LOOPBACK:
        return True
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


class LoopbackNamesOnly:
    """ASGI middleware: a 403 for a request whose Host is another DNS name (host_allowed); a
    plain ASGI layer, so streamed responses pass through untouched."""

    def __init__(self, app, bound: str, on_reject=None):
        self.app, self.bound, self.on_reject = app, bound, on_reject

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            host = dict(scope.get("headers") or ()).get(b"host", b"").decode("latin-1")
            if not host_allowed(host):
                if self.on_reject is not None:
                    self.on_reject()
                response = error_response(APIError(
                    403, f"the Host header {host!r} is not a loopback name: this server listens "
                    f"on {self.bound} without an API key, so it answers only requests to "
                    f"localhost, 127.0.0.1, [::1] or an IP address (set --api-key to serve other "
                    f"names)", code="host_not_allowed"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def is_json_media_type(content_type: Optional[str]) -> bool:
    """No Content-Type (a script's bare request) or a JSON one. A browser's cross-site form or
    text/plain post, sent without a CORS preflight, is neither."""
    if content_type is None:
        return True
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/")
                                           and media.endswith("+json"))


async def read_json(request: Request, limit: int, deadline_s: float = 30.0) -> dict:
    """The request's JSON body, at most `limit` bytes, received within `deadline_s` seconds
    (APIError 408 otherwise)."""
    try:
        async with asyncio.timeout(deadline_s):
            return await _read_json(request, limit)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {deadline_s:g} s "
                       f"(server option body_timeout)") from None


async def _read_json(request: Request, limit: int) -> dict:
    if not is_json_media_type(request.headers.get("content-type")):
        raise APIError(415, f"the request body must be JSON: send the header 'Content-Type: "
                       f"application/json', not {request.headers.get('content-type')!r}")
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit * _DRAIN_FACTOR):
        raise APIError(413, f"the request body is larger than the limit of {limit} bytes")
    size, chunks = 0, []
    async for chunk in request.stream():
        size += len(chunk)
        if size <= limit:
            chunks.append(chunk)
        elif size > limit * _DRAIN_FACTOR:
            break
    if size > limit:
        # Read to the end first (above) so the client, still sending, sees the answer.
        raise APIError(413, f"the request body has {size} bytes or more; the limit is {limit} "
                       "bytes (server option max_body_bytes)")
    return parse_body(b"".join(chunks))


def build_app(engine: AsyncEngine, server_cfg: ServerConfig,
              metrics: Optional[ServerMetrics] = None,
              before_shutdown: Optional[Callable[[], None]] = None,
              metrics_dir: Optional[str] = None,
              after_shutdown: Optional[Callable[[], None]] = None) -> FastAPI:
    """The app around an AsyncEngine or an EngineCoreClient (the same interface; started by
    the app's lifespan, stopped at shutdown, after `before_shutdown`: the server's further
    front ends, which drain their streams while the engine still runs; `after_shutdown` runs
    last, when nothing is served or recorded any more). metrics_dir: the front ends' metric
    files (frontends.metrics_dir), or None for this process's alone."""
    from outpace.entrypoints.openai.metrics import CONTENT_TYPE_LATEST, ServerMetrics

    served = server_cfg.served_model_name or engine.model_name
    metrics = metrics or ServerMetrics(engine, served, multiprocess_dir=metrics_dir)
    if engine.on_finished is None:
        engine.on_finished = metrics.on_request_finished
    ctx = ServingContext(engine=engine, served_name=served,
                         accepted_names=frozenset({served, engine.model_name}), metrics=metrics)

    @asynccontextmanager
    async def lifespan(_app):
        engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            try:
                if before_shutdown is not None:
                    await asyncio.to_thread(before_shutdown)
            finally:
                try:
                    engine.shutdown()
                finally:
                    if after_shutdown is not None:
                        after_shutdown()

    app = FastAPI(title="outpace", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    install_error_handlers(app, on_error=lambda s: metrics.http_errors.labels(str(s)).inc())

    if server_cfg.api_key is None and host_name(server_cfg.host) in LOOPBACK:
        # A server on loopback without a key trusts whoever can reach it, which a web page can
        # do through DNS rebinding (a name of the attacker's that resolves to 127.0.0.1): so it
        # answers only requests addressed to a loopback name or an IP address.
        app.add_middleware(LoopbackNamesOnly, bound=server_cfg.host,
                           on_reject=lambda: metrics.http_errors.labels("403").inc())
    app.add_middleware(AccessLog, logger=log)  # added last: outermost, sees every answer

    async def check_api_key(request: Request) -> None:
        if server_cfg.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), server_cfg.api_key.encode()):
            what = "is missing" if not auth else "is wrong"
            raise APIError(401, f"the API key {what}; send the header "
                           "'Authorization: Bearer <key>' with the server's --api-key",
                           code="invalid_api_key")

    auth = [Depends(check_api_key)]

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if not engine.healthy:
            raise APIError(503, f"the engine is not running ({engine.dead_error!r})",
                           code="engine_dead")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics_endpoint():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        return JSONResponse({"version": __version__})

    def model_card() -> dict:
        return {"id": served, "object": "model", "created": now_s(), "owned_by": "outpace",
                "root": engine.model_name, "max_model_len": engine.max_model_len}

    @app.get("/v1/models", dependencies=auth)
    async def list_models():
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}", dependencies=auth)
    async def get_model(model_id: str):
        ctx.check_model(model_id)
        return JSONResponse(model_card())

    async def serve(request: Request, handler, **kw):
        try:
            body = await read_json(request, server_cfg.max_body_bytes,
                                   server_cfg.body_timeout)
            return await handler(ctx, body, request, **kw)
        except Exception as e:  # noqa: BLE001 -- answered here so the connection stays usable
            raise to_api_error(e) from e

    # A generation's arrival, where its TTFT and latency start, is its handler's start: the
    # time before it (accept, HTTP parsing, the event loop's delay in starting the request, the
    # middlewares) is the client's TTFT less the server's; from the header parsed to here is
    # measured on its own (metrics.on_handler_start).
    def arrived(request: Request) -> float:
        now = time.monotonic()
        metrics.on_handler_start(request.scope.get(HEADER_PARSED), now)
        return now

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request):
        return await serve(request, create_completion, arrival=arrived(request))

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request):
        return await serve(request, create_chat_completion, arrival=arrived(request))

    @app.post("/tokenize", dependencies=auth)
    async def tokenize_endpoint(request: Request):
        return await serve(request, tokenize)

    @app.post("/detokenize", dependencies=auth)
    async def detokenize_endpoint(request: Request):
        return await serve(request, detokenize)

    app.state.engine = engine
    app.state.metrics = metrics
    return app


def run_server(engine_args: EngineArgs, server_cfg: ServerConfig,
               log_level: str = "info", sock=None) -> None:
    """Load the engine of `engine_args` (its max_waiting_requests bounds the waiting queue:
    503 above it), then serve until SIGINT/SIGTERM, on `sock` if given (bound before the
    engine loads: listen.bind_socket). Blocks."""
    from outpace.entrypoints.openai.frontends import metrics_dir

    n_front = server_cfg.api_server_count
    # first: with several front ends, prometheus_client's multiprocess mode is set up in this
    # process before its import (build_app's), and the front ends spawned later inherit it
    with metrics_dir(n_front) as mdir:
        _run_server(engine_args, server_cfg, log_level, sock, mdir)


def engine_in_process(engine_args: EngineArgs, server_cfg: ServerConfig,
                      device: Optional[str] = None) -> bool:
    """Whether the server runs its engine in an engine-core process (else in a thread): for
    an engine on `device` (default: engine_args.device resolved, 'auto' as the engine does)."""
    from outpace.runner_config import resolve_device
    return server_cfg.runs_engine_process(device or resolve_device(engine_args.device),
                                          lent_model=engine_args.loaded is not None)


def _run_server(engine_args: EngineArgs, server_cfg: ServerConfig, log_level: str, sock,
                mdir: Optional[str]) -> None:
    import uvicorn

    from outpace.engine.engine import LLMEngine
    from outpace.entrypoints.openai.frontends import remove_metrics_dir
    from outpace.entrypoints.openai.http_protocol import header_deadline_protocol

    n_front = server_cfg.api_server_count
    if n_front > 1 and sock is None:
        from outpace.entrypoints.openai.listen import bind_socket
        sock = bind_socket(server_cfg.host, server_cfg.port)
    if engine_in_process(engine_args, server_cfg):
        from outpace.engine.core_client import EngineCoreClient
        engine = EngineCoreClient(engine_args, frontends=n_front)
        log.info("outpace: the engine runs in process %d", engine.pid)
    else:
        engine = AsyncEngine(LLMEngine.from_engine_args(engine_args))
    frontends = None
    try:
        if n_front > 1:  # the others share the socket, each with its own pipe to the core
            from outpace.entrypoints.openai.frontends import Frontends
            frontends = Frontends(engine.peer_conns, sock, server_cfg, log_level, mdir)
            print(f"outpace: {n_front} front-end processes: {os.getpid()} (this one) and "
                  f"{', '.join(str(p.pid) for p in frontends.procs)}, over the engine process "
                  f"{engine.pid}", file=sys.stderr, flush=True)
        app = build_app(engine, server_cfg,
                        before_shutdown=frontends.stop if frontends is not None else None,
                        metrics_dir=mdir,
                        # here too: uvicorn re-raises a SIGTERM it shut down on, which ends
                        # this process before metrics_dir's own removal runs
                        after_shutdown=None if mdir is None else
                        (lambda: remove_metrics_dir(mdir)))
        if server_cfg.host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("outpace: listening on %s, reachable from other machines%s",
                        server_cfg.host,
                        "" if server_cfg.api_key else " with no API key (--api-key)")
        # the one line a user needs, --quiet or not (the log's level hides the others)
        print(f"outpace: serving {app.state.metrics.model_name!r} on "
              f"http://{server_cfg.host}:{server_cfg.port}", file=sys.stderr, flush=True)
        # The access log is AccessLog's (one line a request, streams logged when they end).
        # uvicorn.run's single-process path, on the socket bound before the engine loaded
        server = uvicorn.Server(uvicorn.Config(
            app, host=server_cfg.host, port=server_cfg.port, log_level=log_level,
            timeout_graceful_shutdown=5, access_log=False, http=header_deadline_protocol(),
            timeout_keep_alive=server_cfg.timeout_keep_alive))
        with suppress(KeyboardInterrupt):
            server.run(sockets=sock and [sock])
        if not server.started:
            raise SystemExit(3)  # uvicorn's STARTUP_FAILURE
    finally:
        if frontends is not None:  # (the app's shutdown stopped them, unless it never ran)
            frontends.stop()
        engine.shutdown()  # whichever way uvicorn ended (the engine process never outlives it)


def serve_main(args) -> int:
    """Run `outpace serve` from the CLI's parsed arguments (the `serve` subparser)."""
    from outpace.entrypoints.cli_commands import cmd_serve
    return cmd_serve(args)


if __name__ == "__main__":
    from outpace.entrypoints.cli import main
    sys.exit(main(["serve", *sys.argv[1:]]))
