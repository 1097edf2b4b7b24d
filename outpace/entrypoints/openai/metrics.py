"""/metrics: Prometheus exposition through prometheus_client, with vLLM-like names.

Engine-wide counters and gauges (requests running/waiting, KV blocks, token totals, speculative
counters) are read at scrape time from the engine's last stats snapshot (its thread's, or the
one its process last sent) by a custom collector, so the numbers come from one place (the
engine) and can't drift from it. Per-request latencies (TTFT, TPOT, end-to-end) and the phases
of the TTFT (request_stream.TTFT_PHASES) are histograms fed by the async engine's `on_finished`
hook; the phase after it, to a streamed response's first chunk, by the handler
(`on_first_chunk`), and the one before it, from the HTTP header parsed to the handler's start,
by the handler too (`on_handler_start`).
Each server gets its own CollectorRegistry (no module-global state).

With several front-end processes (`serve --api-server-count N`) the per-request metrics use
prometheus_client's multiprocess mode: each process writes its counters and histograms to
files in one directory (frontends.metrics_dir), and /metrics on any front end serves a
MultiProcessCollector that sums them over the processes, beside the engine's collector (never
written to the files: the engine's numbers are one process's, counted once).
"""

from __future__ import annotations

import os
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from outpace.engine.request_stream import FIRST_CHUNK_PHASE, TTFT_PHASES

PREFIX = "outpace:"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
               50.0, 60.0, 120.0, 240.0)
# the TTFT's phases: from a hop between threads up
PHASE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08,
                 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 40.0)

# The phases around a request's TTFT -> (metric name, help): http_wait, before it (the HTTP
# protocol's stamp to the handler's start), then request_stream's TTFT_PHASES and
# FIRST_CHUNK_PHASE. vLLM's names where vLLM has the phase (queue, prefill).
PHASE_METRICS = {
    "http_wait": ("request_http_wait_time_seconds",
                  "Time from the request's HTTP header parsed to its handler's start (before "
                  "the TTFT): the event loop's delay in starting the request, the middlewares "
                  "(the httptools protocol only)."),
    "frontend": ("request_frontend_time_seconds",
                 "Time from arrival (the HTTP handler's start) until the request is handed to "
                 "the engine: body, validation, chat template; with an engine process, "
                 "tokenizing too."),
    "to_engine": ("request_to_engine_time_seconds",
                  "Time from the hand-over until the engine holds the request (its steps run "
                  "meanwhile): the engine thread's command queue and tokenizing, or the pipe "
                  "to the engine process."),
    "queue": ("request_queue_time_seconds",
              "Time in the engine's waiting queue, until first scheduled."),
    "prefill": ("request_prefill_time_seconds",
                "Time from first scheduled to the engine's first token."),
    "first_token_return": ("request_first_token_return_time_seconds",
                           "Time from the engine's first token until the front end has it "
                           "(with an engine process: over the pipe)."),
    "first_chunk": ("request_first_chunk_time_seconds",
                    "Time from the front end's first token until the handler wrote the "
                    "streamed response's first chunk of output (streamed responses only)."),
}

__all__ = ["ServerMetrics", "CONTENT_TYPE_LATEST"]


class _EngineStatsCollector:
    """Turns `AsyncEngine.stats()` into metric families at scrape time."""

    def __init__(self, async_engine, model_name: str):
        self._engine = async_engine
        self._model = model_name

    def collect(self):
        s = self._engine.stats() or {}
        m = [self._model]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            g.add_metric(m, float(value))
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            c.add_metric(m, float(value))
            return c

        used, total = s.get("kv_blocks_used", 0), s.get("kv_blocks_total", 0)
        yield gauge("num_requests_running", "Requests in the running batch.",
                    s.get("num_running", 0))
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.",
                    s.get("num_waiting", 0))
        yield gauge("kv_cache_blocks_used", "KV cache blocks in use by requests.", used)
        yield gauge("kv_cache_blocks_total", "KV cache blocks in the pool.", total)
        yield gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).",
                    used / total if total else 0.0)
        yield gauge("engine_healthy", "1 while the engine (thread or process) runs.",
                    1.0 if self._engine.healthy else 0.0)
        yield counter("prompt_tokens", "Prompt tokens processed.", s.get("prompt_tokens_total", 0))
        yield counter("generation_tokens", "Output tokens generated.",
                      s.get("generation_tokens_total", 0))
        yield counter("num_preemptions", "Requests preempted.", s.get("num_preemptions_total", 0))
        spec = s.get("spec") or {}
        yield counter("spec_decode_num_drafts", "Verify steps that carried drafts.",
                      spec.get("num_drafts", 0))
        yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed.",
                      spec.get("num_draft_tokens", 0))
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                      spec.get("num_accepted_tokens", 0))
        yield counter("spec_decode_draft_failures",
                      "Drafter calls that raised (those steps ran without drafts).",
                      s.get("num_draft_failures_total", 0))
        per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by draft position.",
                                      labels=["model_name", "position"])
        for i, v in enumerate(spec.get("accepted_per_position") or []):
            per_pos.add_metric([self._model, str(i)], float(v))
        yield per_pos


def _check_multiprocess(path: str) -> None:
    """prometheus_client picks its value class (in memory, or a process's files in
    PROMETHEUS_MULTIPROC_DIR) when it is first imported, and the files' folder when a metric is
    made: both must name `path` here."""
    from prometheus_client import values

    if (values.ValueClass is values.MutexValue
            or os.environ.get("PROMETHEUS_MULTIPROC_DIR") != path):
        raise RuntimeError(
            f"the front ends' metrics need prometheus_client's multiprocess mode in {path}: "
            "PROMETHEUS_MULTIPROC_DIR must name it before prometheus_client is first imported "
            "in this process (frontends.metrics_dir sets it)")


class ServerMetrics:
    def __init__(self, async_engine, model_name: str, multiprocess_dir: Optional[str] = None):
        """multiprocess_dir: with several front-end processes, the directory of their metric
        files (prometheus_client's multiprocess mode, set up before its import); None: this
        process's metrics, in memory."""
        self.registry = CollectorRegistry()  # what /metrics serves
        self.model_name = model_name
        self.multiprocess_dir = multiprocess_dir
        record_in = self.registry
        if multiprocess_dir is not None:
            from prometheus_client import multiprocess

            _check_multiprocess(multiprocess_dir)
            # the metrics below write this process's files; /metrics reads every process's
            record_in = None
            multiprocess.MultiProcessCollector(self.registry, path=multiprocess_dir)
        labels = ["model_name"]
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Time from arrival (the HTTP handler's start) to the first output "
                              "token in the front end.", labels,
                              buckets=TTFT_BUCKETS, registry=record_in)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.", labels,
                              buckets=TPOT_BUCKETS, registry=record_in)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "Time from arrival to the last output.", labels,
                             buckets=E2E_BUCKETS, registry=record_in)

        def phase_histogram(name):
            return Histogram(PREFIX + PHASE_METRICS[name][0], PHASE_METRICS[name][1], labels,
                             buckets=PHASE_BUCKETS, registry=record_in)

        self.http_wait = phase_histogram("http_wait")
        # the TTFT's phases: name -> (its histogram, from stamp, to stamp)
        self.phases = {name: (phase_histogram(name), start, end)
                       for name, start, end in (*TTFT_PHASES, FIRST_CHUNK_PHASE)}
        # The model's children, made once: a request's observations then take no label lookup
        # (they run on the engine's thread in thread mode), and every histogram is on /metrics,
        # at zero, before the first request.
        self._ttft, self._tpot, self._e2e, self._http_wait = (
            h.labels(model_name) for h in (self.ttft, self.tpot, self.e2e, self.http_wait))
        self._phases = {name: (hist.labels(model_name), start, end)
                        for name, (hist, start, end) in self.phases.items()}
        self.finished = Counter(PREFIX + "request_success", "Finished requests, by reason.",
                                labels + ["finished_reason"], registry=record_in)
        self.http_errors = Counter(PREFIX + "http_request_errors",
                                   "Requests answered with an error status.",
                                   ["status_code"], registry=record_in)
        self.rejected = Counter(PREFIX + "request_rejected_queue_full",
                                "Requests refused because the waiting queue was full (503).",
                                labels, registry=record_in)
        # Engine-side numbers (gauges and counters alike) come from this front end's copy of the
        # engine's one stats snapshot at scrape time, never from the files: each appears once,
        # so no Gauge (and no multiprocess_mode) is needed for them.
        self.registry.register(_EngineStatsCollector(async_engine, model_name))

    def on_request_finished(self, timing) -> None:
        """The async engine's observer; runs in its engine or tokenizer thread
        (prometheus_client is thread-safe)."""
        if timing.ttft is not None:
            self._ttft.observe(timing.ttft)
        if timing.tpot is not None:
            self._tpot.observe(timing.tpot)
        if timing.e2e is not None:
            self._e2e.observe(timing.e2e)
        for name, _, _ in TTFT_PHASES:  # those a request reached (an abort stops them)
            self._observe_phase(name, timing)
        self.finished.labels(self.model_name, timing.finish_reason or "unknown").inc()

    def on_handler_start(self, header_parsed: Optional[float], now: float) -> None:
        """A generation's handler began at `now`; its HTTP header was parsed at header_parsed
        (None: unknown, the h11 protocol's); runs on the event loop."""
        if header_parsed is not None:
            self._http_wait.observe(now - header_parsed)

    def on_first_chunk(self, timing) -> None:
        """The handler wrote a streamed response's first chunk of output (timing.first_chunk
        set); runs on the event loop."""
        self._observe_phase(FIRST_CHUNK_PHASE[0], timing)

    def _observe_phase(self, name: str, timing) -> None:
        child, start, end = self._phases[name]
        seconds = timing.phase(start, end)
        if seconds is not None:
            child.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
