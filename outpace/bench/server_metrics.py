"""An outpace server's own view of a load run: its /metrics scraped right before and right after
the run, and the mean of each per-request histogram over the run (the difference of its _sum
over the difference of its _count), so a run shows where the server's time to first token
went beside what the client measured.

The histograms read (outpace/entrypoints/openai/metrics.py names them) are the server's TTFT
and end-to-end latency and the phases around the TTFT, in order (each ends where the next
begins; the five of TTFT_SUM add up to the server's TTFT):
    http_wait           HTTP header parsed -> handler start (before the TTFT: a busy event loop)
    frontend            handler start -> handed to the engine (validation, chat template, ...)
    to_engine           -> the engine holds it (the engine thread's queue, or the pipe)
    queue               -> first scheduled (the engine's waiting queue)
    prefill             -> the engine's first token
    first_token_return  -> the front end has the token
    first_chunk         -> the handler wrote the first streamed chunk
The server's TTFT starts at its handler: the client's TTFT less it is the time outside the
handler (the client, the network, accept, HTTP parsing, a busy event loop: http_wait's part of
it is the server's loop from the parsed header on).

A server without these metrics (another server, an older outpace) gives none: the means are
None. The parser reads the Prometheus text format's sample lines only.
"""

from __future__ import annotations

from typing import Optional

PREFIX = "outpace:"
TTFT = "time_to_first_token_seconds"
E2E = "e2e_request_latency_seconds"
# (phase, histogram), in the order of the request's path
PHASES = (
    ("http_wait", "request_http_wait_time_seconds"),
    ("frontend", "request_frontend_time_seconds"),
    ("to_engine", "request_to_engine_time_seconds"),
    ("queue", "request_queue_time_seconds"),
    ("prefill", "request_prefill_time_seconds"),
    ("first_token_return", "request_first_token_return_time_seconds"),
    ("first_chunk", "request_first_chunk_time_seconds"),
)
# the phases that add up to the server's TTFT
TTFT_SUM = ("frontend", "to_engine", "queue", "prefill", "first_token_return")


def histogram_totals(text: str) -> dict:
    """Prometheus text -> {histogram name without the prefix: [sum, count]}, summed over its
    label sets (the model name), for the outpace histograms in it."""
    out: dict = {}
    for line in text.splitlines():
        if not line.startswith(PREFIX):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0][len(PREFIX):]
        for suffix, slot in (("_sum", 0), ("_count", 1)):
            if name.endswith(suffix):
                try:
                    v = float(value)
                except ValueError:
                    break
                out.setdefault(name[:-len(suffix)], [0.0, 0.0])[slot] += v
                break
    return out


def mean_ms(before: dict, after: dict, name: str) -> Optional[float]:
    """The mean of histogram `name` over the requests recorded between two histogram_totals,
    in ms; None when none was (or the server has no such histogram)."""
    if name not in after:
        return None
    s0, c0 = before.get(name, (0.0, 0.0))
    s1, c1 = after[name]
    return 1000.0 * (s1 - s0) / (c1 - c0) if c1 > c0 else None


def run_means(before_text: Optional[str], after_text: Optional[str]) -> dict:
    """Two scrapes (/metrics' text, or None: not scraped) -> {"server_ttft_mean_ms",
    "server_e2e_mean_ms", "server_phase_mean_ms": {phase: ms}}, None where unknown."""
    if before_text is None or after_text is None:
        return {"server_ttft_mean_ms": None, "server_e2e_mean_ms": None,
                "server_phase_mean_ms": {phase: None for phase, _ in PHASES}}
    b, a = histogram_totals(before_text), histogram_totals(after_text)
    return {"server_ttft_mean_ms": mean_ms(b, a, TTFT),
            "server_e2e_mean_ms": mean_ms(b, a, E2E),
            "server_phase_mean_ms": {phase: mean_ms(b, a, h) for phase, h in PHASES}}


def scrape(base_url: str, timeout: float = 10.0) -> Optional[str]:
    """The server's /metrics text; None when it has none or can't be reached (the load's own
    numbers stand without it)."""
    import urllib.error
    import urllib.request
    # no proxy from the environment: the load client (aiohttp) goes straight to the server,
    # and so must its scrape
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(base_url.rstrip("/") + "/metrics", timeout=timeout) as r:
            return r.read().decode("utf-8", errors="replace") if r.status == 200 else None
    except (urllib.error.URLError, OSError, ValueError):
        return None
