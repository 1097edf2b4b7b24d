"""outpace.bench.server_metrics: the means over a run from two /metrics texts (the difference of
each histogram's _sum over that of its _count, summed over its label sets)."""

from __future__ import annotations

import pytest

from outpace.bench.server_metrics import PHASES, histogram_totals, run_means


def _text(ttft: tuple, queue: tuple, other_model_ttft: tuple = (0.0, 0)) -> str:
    """/metrics text with the TTFT histogram of two models and a queue-time histogram
    ((sum, count) each), with the lines a parser must pass over."""
    return "\n".join([
        "# HELP outpace:time_to_first_token_seconds Time from arrival to the first output token.",
        "# TYPE outpace:time_to_first_token_seconds histogram",
        'outpace:time_to_first_token_seconds_bucket{le="0.1",model_name="a"} 3.0',
        f'outpace:time_to_first_token_seconds_count{{model_name="a"}} {ttft[1]}',
        f'outpace:time_to_first_token_seconds_sum{{model_name="a"}} {ttft[0]}',
        'outpace:time_to_first_token_seconds_created{model_name="a"} 1.7e+09',
        f'outpace:time_to_first_token_seconds_count{{model_name="b"}} {other_model_ttft[1]}',
        f'outpace:time_to_first_token_seconds_sum{{model_name="b"}} {other_model_ttft[0]}',
        f'outpace:request_queue_time_seconds_sum{{model_name="a"}} {queue[0]}',
        f'outpace:request_queue_time_seconds_count{{model_name="a"}} {queue[1]}',
        'outpace:request_success_total{finished_reason="length",model_name="a"} 9.0',
        'other_histogram_sum 5.0', 'other_histogram_count 1.0', ""])


def test_histogram_totals_sum_label_sets_and_skip_other_lines():
    t = histogram_totals(_text((1.5, 3), (0.25, 3), (0.5, 1)))
    assert t == {"time_to_first_token_seconds": [2.0, 4.0],
                 "request_queue_time_seconds": [0.25, 3.0]}


def test_run_means_are_the_runs_own():
    before = _text((1.0, 2), (0.5, 2))
    after = _text((1.0 + 0.6, 2 + 4), (0.5, 2), (0.2, 1))  # 5 requests, none queued
    m = run_means(before, after)
    assert m["server_ttft_mean_ms"] == pytest.approx(1000 * 0.8 / 5)
    assert m["server_e2e_mean_ms"] is None  # not in the text
    ph = m["server_phase_mean_ms"]
    assert list(ph) == [p for p, _ in PHASES]
    assert ph["queue"] is None  # recorded nothing during the run
    assert ph["prefill"] is None  # absent
    # a histogram first seen after the run (its first request's label set) counts from 0
    m = run_means("", after)
    assert m["server_ttft_mean_ms"] == pytest.approx(1000 * 1.8 / 7)
    assert m["server_phase_mean_ms"]["queue"] == pytest.approx(1000 * 0.5 / 2)


def test_without_scrapes_every_mean_is_unknown():
    m = run_means(None, _text((1.0, 1), (1.0, 1)))
    assert m["server_ttft_mean_ms"] is None
    assert set(m["server_phase_mean_ms"].values()) == {None}
