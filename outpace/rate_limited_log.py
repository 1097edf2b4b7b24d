"""A log line for an event that may recur every step, at most one per interval.

The first occurrence is logged at once (with its traceback); later ones are counted, and the
first one after `interval_s` has passed since the last line logs that count (the occurrences
since that line, this one included) with the latest traceback. Nothing is lost from the count:
`total` holds every occurrence. The clock is injectable so tests need not wait.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, message: str, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        if interval_s < 0:
            raise ValueError(f"interval_s must be >= 0, got {interval_s}")
        self.logger, self.message, self.interval_s, self.clock = logger, message, interval_s, clock
        self.total = 0  # occurrences, logged or not
        self._since = 0  # occurrences since the last line
        self._last: Optional[float] = None  # the clock at the last line

    def record(self, exc: Optional[BaseException] = None) -> bool:
        """Count one occurrence (exc: its exception, logged with its traceback); -> whether
        this call wrote a line."""
        self.total += 1
        self._since += 1
        now = self.clock()
        if self._last is not None and now - self._last < self.interval_s:
            return False
        info = (type(exc), exc, exc.__traceback__) if exc is not None else None
        if self._last is None:
            self.logger.error("%s (logged at most once every %g s)", self.message,
                              self.interval_s, exc_info=info)
        else:
            self.logger.error("%s: %d times in the last %.0f s; the latest:", self.message,
                              self._since, now - self._last, exc_info=info)
        self._last, self._since = now, 0
        return True
