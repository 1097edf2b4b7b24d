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


class _Tok:  # what the detokenizer reads of a tokenizer: one character a token
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


@pytest.mark.parametrize("kind", ["cumulative", "final_only"])
def test_the_engine_processs_stamps_are_mapped_and_a_streamed_first_token_is_the_front_ends(
        kind):
    """The engine process's stamps (time.time()) land on this process's monotonic clock; a
    request whose first output is also its last keeps the engine's first token as its TTFT's
    end only when it is final-only (its client sees nothing earlier), a streamed one the time
    the front end got it."""
    import time

    from outpace.engine.output_processor import CoreOutput, OutputProcessor
    from outpace.engine.request_stream import RequestStream
    from outpace.types import SamplingParams

    class _Owner:
        def abort(self, rid):
            pass

    proc = OutputProcessor(_Tok())
    now = time.monotonic()
    timing = RequestTiming("r", arrival=now - 1.0)
    proc.add("r", [1, 2], SamplingParams(max_tokens=1, output_kind=kind),
             RequestStream("r", _Owner()), timing)
    wall = time.time()
    engine_times = {"arrival_time": wall - 0.9, "scheduled_time": wall - 0.8,
                    "first_token_time": wall - 0.5}
    out = CoreOutput("r", [5], "length", None, None, 2, 0, engine_times)
    _, finished, _ = proc.process([out], now)
    assert finished == [timing]
    assert timing.engine_queued == pytest.approx(now - 0.9, abs=0.05)
    assert timing.scheduled == pytest.approx(now - 0.8, abs=0.05)
    assert timing.engine_first_token == pytest.approx(now - 0.5, abs=0.05)
    want = timing.engine_first_token if kind == "final_only" else now
    assert timing.first_token == want
