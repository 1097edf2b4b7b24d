"""RateLimitedLog (outpace/rate_limited_log.py): the first occurrence logged at once, later ones
counted and logged at most once an interval with the count since the last line; and the
drafter-failure counter on /metrics."""

from __future__ import annotations

import logging

import pytest

from outpace.rate_limited_log import RateLimitedLog


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_one_line_an_interval_with_the_count_since_the_last(caplog):
    clock = Clock()
    log = logging.getLogger("test.rate_limited")
    rl = RateLimitedLog(log, "the drafter raised", interval_s=10.0, clock=clock)
    with caplog.at_level(logging.ERROR, logger="test.rate_limited"):
        try:
            raise ValueError("boom 1")
        except ValueError as e:
            assert rl.record(e)  # the first: at once, with its traceback
        assert "boom 1" in caplog.text and "Traceback" in caplog.text
        for i in range(5):  # within the interval: counted only
            clock.now += 1.0
            assert not rl.record(ValueError(f"quiet {i}"))
        clock.now += 5.0  # 10 s after the first line
        assert rl.record(ValueError("boom 2"))
        clock.now += 9.9
        assert not rl.record()
        clock.now += 0.1
        assert rl.record()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert lines[0].startswith("the drafter raised")
    assert "6 times in the last 10 s" in lines[1] and "boom 2" in caplog.text
    assert "quiet" not in caplog.text
    assert "2 times in the last 10 s" in lines[2]
    assert rl.total == 9


def test_zero_interval_logs_every_occurrence(caplog):
    rl = RateLimitedLog(logging.getLogger("test.rl0"), "x", interval_s=0.0, clock=Clock())
    with caplog.at_level(logging.ERROR, logger="test.rl0"):
        assert all(rl.record() for _ in range(3))
    assert len(caplog.records) == 3 and rl.total == 3
    with pytest.raises(ValueError, match="interval_s"):
        RateLimitedLog(logging.getLogger("test.rl0"), "x", interval_s=-1)


def test_draft_failures_reach_metrics():
    """outpace:spec_decode_draft_failures_total is the engine's num_draft_failures_total."""
    from prometheus_client.parser import text_string_to_metric_families

    from outpace.entrypoints.openai.metrics import ServerMetrics

    class Engine:
        healthy = True

        def stats(self):
            return {"num_draft_failures_total": 7, "spec": {}}

    text = ServerMetrics(Engine(), "m").render().decode()
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert values["outpace:spec_decode_draft_failures_total"] == 7
