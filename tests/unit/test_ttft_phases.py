"""The TTFT's phases in ServerMetrics: a request records the phases it reached, each from its
own two stamps, and nothing for a stamp it never got (an abort before its first token)."""

from __future__ import annotations

import pytest

from outpace.bench.server_metrics import PHASES, TTFT, histogram_totals
from outpace.engine.request_stream import RequestTiming
from outpace.entrypoints.openai.metrics import ServerMetrics


class _Engine:  # what the engine-stats collector reads at scrape time
    healthy = True

    def stats(self) -> dict:
        return {}


def _totals(m: ServerMetrics) -> dict:
    return histogram_totals(m.render().decode())


def test_a_finished_request_records_every_phase_and_an_aborted_one_those_it_reached():
    m = ServerMetrics(_Engine(), "m")
    done = RequestTiming("a", arrival=10.0, submitted=10.001, engine_queued=10.003,
                         scheduled=10.006, engine_first_token=10.010, first_token=10.015,
                         last_token=10.02, finished=10.02, num_output_tokens=2,
                         finish_reason="length")
    m.on_request_finished(done)
    done.first_chunk = 10.021
    m.on_first_chunk(done)
    t = _totals(m)
    expect = {"frontend": 0.001, "to_engine": 0.002, "queue": 0.003, "prefill": 0.004,
              "first_token_return": 0.005, "first_chunk": 0.006}
    for phase, h in PHASES[1:]:
        assert t[h] == [pytest.approx(expect[phase]), 1.0], phase
    assert t[TTFT] == [pytest.approx(0.015), 1.0]

    # aborted before its first token: the engine's stamps, which come with it, never came
    m.on_request_finished(RequestTiming("b", arrival=20.0, submitted=20.002, finished=20.5,
                                        finish_reason="abort"))
    t = _totals(m)
    counts = {phase: t[h][1] for phase, h in PHASES[1:]}
    assert counts == {"frontend": 2, "to_engine": 1, "queue": 1, "prefill": 1,
                      "first_token_return": 1, "first_chunk": 1}
    assert t["request_frontend_time_seconds"][0] == pytest.approx(0.001 + 0.002)
    assert t[TTFT][1] == 1


def test_the_wait_before_the_handler_is_recorded_where_the_protocol_stamped_it():
    m = ServerMetrics(_Engine(), "m")
    m.on_handler_start(None, 5.0)  # the h11 protocol: no stamp, nothing recorded
    m.on_handler_start(4.998, 5.0)
    assert PHASES[0][0] == "http_wait"
    assert _totals(m)[PHASES[0][1]] == [pytest.approx(0.002), 1.0]
