"""One access-log line per request: client, method, path, status and duration.

A plain ASGI layer (streamed responses pass through untouched), outermost, so that every answer
is logged, the middlewares' own (403, 415) included. A streamed response is logged when its
stream ends, its duration the whole stream's."""

from __future__ import annotations

import logging
import time


class AccessLog:
    def __init__(self, app, logger: logging.Logger):
        self.app, self.logger = app, logger

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = None

        async def send_and_watch(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        except BaseException:
            # the server's error layer, outside this one, answers 500 for what escapes
            status = status or 500
            raise
        finally:
            client = scope.get("client")
            who = f"{client[0]}:{client[1]}" if client else "-"
            self.logger.info('%s "%s %s" %s %.1f ms', who, scope.get("method", "-"),
                             scope.get("path", "-"), status if status is not None else "-",
                             (time.perf_counter() - start) * 1e3)
