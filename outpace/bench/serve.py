"""`outpace bench serve`: a load client for a running OpenAI-compatible server (outpace's or any
other), as `vllm bench serve` measures one.

Streaming requests go to /v1/completions (or /v1/chat/completions) at --request-rate (Poisson
arrivals; inf: all at once) under --max-concurrency, and are measured with vLLM's definitions:
    TTFT  time from sending the request to the first streamed token
    TPOT  per request: (latency - TTFT) / (output tokens - 1)
    ITL   gaps between consecutive streamed chunks (one chunk may carry several tokens)
    E2EL  time from sending to the last byte
    output throughput = output tokens of completed requests / benchmark duration
Token counts come from the server's `usage` (stream_options.include_usage); a server that sends
none is counted a token per streamed chunk that carries text."""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

from outpace.bench.datasets import cycle, load_dataset, random_text_prompts
from outpace.bench.report import (at_least, check_output_json, mean, percentile, print_result,
                                  progress, write_json)
from outpace.errors import ConfigError, OutpaceError

NAME = "serve"
HELP = "drive a running OpenAI-compatible server: TTFT, TPOT, ITL, throughput"
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True)
class ServeBenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: Optional[str] = None  # None: the first of the server's /v1/models
    endpoint: str = "/v1/completions"
    api_key: Optional[str] = None
    num_prompts: Optional[int] = 100  # stop after this many requests (None: no bound)
    duration_s: Optional[float] = None  # stop sending after this long (None: no bound)
    request_rate: float = float("inf")  # requests/s, Poisson; inf: as fast as concurrency allows
    max_concurrency: Optional[int] = None
    output_len: int = 128
    ignore_eos: bool = False
    temperature: float = 0.0
    seed: int = 0
    timeout_s: float = 600.0
    client_processes: int = 1  # processes sending the load (bench/load_processes.py)


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    chunks: int = 0  # streamed chunks that carried text
    finish_reason: Optional[str] = None


def _payload(cfg: ServeBenchConfig, model: str, prompt: str) -> dict:
    body = {"model": model, "max_tokens": cfg.output_len, "temperature": cfg.temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    if cfg.ignore_eos:  # vLLM's extension: sent only when asked, strict servers refuse it
        body["ignore_eos"] = True
    if cfg.endpoint.endswith("/chat/completions"):
        return {**body, "messages": [{"role": "user", "content": prompt}]}
    return {**body, "prompt": prompt}


async def one_request(session, cfg: ServeBenchConfig, model: str, prompt: str) -> RequestResult:
    """One streamed request through `session` (open_session's) -> its RequestResult."""
    import aiohttp
    res = RequestResult()
    t0 = time.perf_counter()
    last = t0
    try:
        async with session.post(cfg.base_url + cfg.endpoint,
                                json=_payload(cfg, model, prompt)) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.read())[:200]!r}"
                return res
            async for raw in r.content:  # one line at a time
                if not raw.startswith(b"data:"):
                    continue
                data = raw[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    err = chunk["error"]
                    res.error = err.get("message", "stream error") if isinstance(err, dict) \
                        else str(err)
                    return res
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"].get("prompt_tokens") or 0
                    res.output_tokens = chunk["usage"].get("completion_tokens") or 0
                for ch in chunk.get("choices") or []:
                    piece = ch.get("text") if "text" in ch else (ch.get("delta") or {}).get(
                        "content")
                    now = time.perf_counter()
                    if piece:
                        res.chunks += 1
                        if res.ttft == 0.0:
                            res.ttft = now - t0
                        else:
                            res.itl.append(now - last)
                        last = now
                    if ch.get("finish_reason"):
                        res.finish_reason = ch["finish_reason"]
        res.latency = time.perf_counter() - t0
        if not res.output_tokens:
            res.output_tokens = res.chunks
        res.ok = res.finish_reason is not None
        if not res.ok:
            res.error = "stream ended without a finish_reason"
    except (aiohttp.ClientError, aiohttp.http_exceptions.HttpProcessingError,
            asyncio.TimeoutError, ValueError, AttributeError, TypeError) as e:
        res.error = f"{type(e).__name__}: {e}"  # (a line over twice read_bufsize included)
    return res


def open_session(cfg: ServeBenchConfig):
    """The client's aiohttp session (use it as an async context manager): as many connections
    as requests in flight (no bound without max_concurrency: a pool smaller than the load would
    queue requests in the client and count it in their TTFT), cfg.timeout_s a request."""
    import aiohttp
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    return aiohttp.ClientSession(
        headers=headers, connector=aiohttp.TCPConnector(limit=cfg.max_concurrency or 0),
        timeout=aiohttp.ClientTimeout(total=cfg.timeout_s),
        read_bufsize=1 << 20)  # a streamed line may be twice this; a longer one fails its request


async def served_model(session, cfg: ServeBenchConfig) -> str:
    """The model to ask for: cfg.model, else the first the server lists. The server is
    reached here first, so a wrong address or key is one error, not a failed request each."""
    import aiohttp
    try:
        async with session.get(cfg.base_url + "/v1/models",
                               timeout=aiohttp.ClientTimeout(total=30)) as r:
            status, body = r.status, await r.read()
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise OutpaceError(f"cannot reach the server at {cfg.base_url} ({type(e).__name__}: "
                           f"{e}); start it, or give its address (--base-url, or --host and "
                           f"--port)") from None
    if status in (401, 403):
        raise OutpaceError(f"the server at {cfg.base_url} refused the API key (HTTP "
                           f"{status}); give --api-key (or OPENAI_API_KEY)")
    if cfg.model is not None:
        return cfg.model
    try:
        if status != 200:
            raise ValueError(status)
        return json.loads(body)["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise OutpaceError(f"{cfg.base_url}/v1/models lists no model (HTTP {status}); "
                           f"give --model") from None


async def drive(session, cfg: ServeBenchConfig, model: str, prompts: list,
                on_done: Optional[Callable] = None, ready=None) -> tuple:
    """Send the load (prompts in order, repeated as needed) -> (results, start, end, cpu), the
    start and end as time.perf_counter(), cpu the process's CPU seconds between them
    (time.process_time). on_done(result) as each request ends; ready(): called once, just
    before the first request (a multi-process load's start line)."""
    rng = random.Random(cfg.seed)
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    results: list = []

    async def run_one(prompt):
        try:
            res = await one_request(session, cfg, model, prompt)
            results.append(res)
            if on_done is not None:
                on_done(res)
        finally:
            if sem is not None:
                sem.release()

    if ready is not None:
        await asyncio.get_running_loop().run_in_executor(None, ready)
    tasks = []
    cpu0 = time.process_time()
    start = time.perf_counter()
    i = 0
    while cfg.num_prompts is None or i < cfg.num_prompts:
        if sem is not None:  # the slot is taken here and handed to the request
            await sem.acquire()
        if cfg.duration_s is not None and time.perf_counter() - start >= cfg.duration_s:
            if sem is not None:
                sem.release()
            break
        tasks.append(asyncio.create_task(run_one(prompts[i % len(prompts)])))
        i += 1
        if cfg.request_rate != float("inf"):
            await asyncio.sleep(rng.expovariate(cfg.request_rate))
    await asyncio.gather(*tasks)
    return results, start, time.perf_counter(), time.process_time() - cpu0


def check_load(cfg: ServeBenchConfig) -> None:
    for name in ("num_prompts", "max_concurrency"):
        value = getattr(cfg, name)
        if value is not None and value < cfg.client_processes:
            raise ValueError(f"{name} {value} is less than client_processes "
                             f"{cfg.client_processes}: every process needs a share of one")
    if cfg.num_prompts is None and cfg.duration_s is None:
        raise ValueError("give num_prompts or duration_s, or the load never ends")
    if cfg.duration_s is not None and cfg.max_concurrency is None \
            and cfg.request_rate == float("inf"):
        raise ValueError("a timed run needs max_concurrency or a finite request_rate")


async def run_benchmark(cfg: ServeBenchConfig, prompts: list,
                        on_done: Optional[Callable] = None) -> dict:
    """The load from this process (cfg.client_processes aside: see run_load) -> the summary
    (what --output-json holds). on_done(result) as each request ends."""
    check_load(cfg)
    async with open_session(cfg) as session:
        model = await served_model(session, cfg)
        results, start, end, cpu = await drive(session, cfg, model, prompts, on_done)
    return summarize(cfg, model, results, end - start, [cpu])


def run_load(cfg: ServeBenchConfig, prompts: list, on_progress: Optional[Callable] = None) -> dict:
    """The load from cfg.client_processes processes (one: this one) -> the summary.
    on_progress(n): n more requests ended."""
    check_load(cfg)
    if cfg.client_processes == 1:
        done = (lambda _: on_progress(1)) if on_progress is not None else None
        return asyncio.run(run_benchmark(cfg, prompts, done))
    from outpace.bench.load_processes import run_in_processes
    return run_in_processes(cfg, prompts, on_progress)


def _stats_ms(name: str, xs: list) -> dict:
    ms = [x * 1000.0 for x in xs]
    return {f"mean_{name}_ms": mean(ms), f"median_{name}_ms": percentile(ms, 50),
            f"p99_{name}_ms": percentile(ms, 99)}


def summarize(cfg: ServeBenchConfig, model: str, results: list, duration: float,
              client_cpu_s: Optional[list] = None) -> dict:
    """vLLM's result keys over the requests' results, and the client's CPU time:
    client_cpu_s, each client process's (user + system, time.process_time) summed;
    client_cpu_busiest, the busiest process's over the duration (near 1: a core's worth, the
    client may be what limits the load's numbers)."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    errors = [r.error for r in results if not r.ok]
    # an unbounded rate is the string "inf", as vLLM writes it (JSON has no infinity)
    rate = "inf" if math.isinf(cfg.request_rate) else cfg.request_rate
    config = {k: v for k, v in asdict(cfg).items() if k != "api_key"}
    return {
        "config": {**config, "request_rate": rate},
        "model": model, "request_rate": rate, "max_concurrency": cfg.max_concurrency,
        "duration": duration, "num_prompts": len(results),
        "completed": len(ok), "failed": len(errors), "errors": errors[:10],
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
        **_stats_ms("ttft", [r.ttft for r in ok]), **_stats_ms("tpot", tpots),
        **_stats_ms("itl", [x for r in ok for x in r.itl]),
        **_stats_ms("e2el", [r.latency for r in ok]),
        "client_cpu_s": sum(client_cpu_s) if client_cpu_s else None,
        "client_cpu_busiest": (max(client_cpu_s) / duration
                               if client_cpu_s and duration else None),
    }


def print_summary(s: dict, out=None) -> None:
    rows = [("Successful requests", s["completed"]), ("Failed requests", s["failed"]),
            ("Benchmark duration (s)", s["duration"]),
            ("Total input tokens", s["total_input_tokens"]),
            ("Total generated tokens", s["total_output_tokens"]),
            ("Request throughput (req/s)", s["request_throughput"]),
            ("Output token throughput (tok/s)", s["output_throughput"]),
            ("Total token throughput (tok/s)", s["total_token_throughput"])]
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL")):
        rows += [(f"Mean {label} (ms)", s[f"mean_{name}_ms"]),
                 (f"Median {label} (ms)", s[f"median_{name}_ms"]),
                 (f"P99 {label} (ms)", s[f"p99_{name}_ms"])]
    if s.get("client_cpu_s") is not None:
        rows += [("Client CPU time (s)", s["client_cpu_s"]),
                 ("Busiest client process's CPU / duration", s["client_cpu_busiest"])]
    print_result("Serving Benchmark Result", rows, out=out or sys.stdout)


# ---- the command line ----------------------------------------------------------------------

def add_arguments(p) -> None:
    p.add_argument("--base-url", default=None, metavar="URL",
                   help="the server, e.g. http://127.0.0.1:8000 (default: --host and --port)")
    p.add_argument("--host", default=None, help="the server's host (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="the server's port (default: 8000)")
    p.add_argument("--endpoint", default=ENDPOINTS[0], choices=ENDPOINTS,
                   help="the API the requests stream from")
    p.add_argument("--model", default=None,
                   help="the model name to ask for (default: the first the server lists)")
    p.add_argument("--api-key", default=None,
                   help="sent as 'Authorization: Bearer KEY' (default: OPENAI_API_KEY, if set)")
    p.add_argument("--num-prompts", type=int, default=64, help="requests")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s, Poisson arrivals; inf: all at once (up to "
                   "--max-concurrency)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="requests in flight at most (default: no bound)")
    p.add_argument("--input-len", type=int, default=None,
                   help="words of each random prompt (about a token each) (default: 64; not "
                   "with --dataset)")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens of each request")
    p.add_argument("--dataset", default=None, metavar="FILE",
                   help='prompts from a file: JSONL of {"prompt": ...} (as '
                   'benchmarks/prompts/*.jsonl), or ShareGPT conversations (JSON or JSONL; '
                   'the first human turn) (default: random words)')
    p.add_argument("--ignore-eos", action="store_true",
                   help="send vLLM's ignore_eos, so every output is --output-len tokens "
                   "(outpace and vLLM take it)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--seed", type=int, default=0, help="random prompts and arrival times")
    p.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                   help="a request's time limit")
    p.add_argument("--client-processes", type=int, default=1, metavar="N",
                   help="processes that send the load, each a share of the prompts, the "
                   "concurrency and the rate: a client process parses streamed chunks at a "
                   "bounded rate, so a fast server needs several for its numbers to be its own")
    p.add_argument("--output-json", default=None, metavar="FILE",
                   help="write the results as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress output")


def config_from_args(a) -> ServeBenchConfig:
    """The flags, checked (errors name them)."""
    if a.base_url is not None and (a.host is not None or a.port is not None):
        raise ConfigError("--base-url names the server: leave out --host and --port, or give "
                          "those alone", option="base_url")
    if a.base_url is not None:
        if not a.base_url.startswith(("http://", "https://")):
            raise ConfigError(f"--base-url must start with http:// or https://, got "
                              f"{a.base_url!r}", option="base_url")
        base_url = a.base_url.rstrip("/")
        if base_url.endswith("/v1"):  # the OpenAI client's habit: the endpoints add /v1
            base_url = base_url[:-3]
    else:
        port = 8000 if a.port is None else a.port
        if not 1 <= port <= 65535:
            raise ConfigError(f"--port must be an integer in 1..65535, got {port}",
                              option="port")
        host = a.host or "127.0.0.1"
        base_url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    at_least(a.num_prompts, 1, "--num-prompts")
    at_least(a.max_concurrency, 1, "--max-concurrency")
    at_least(a.input_len, 1, "--input-len")
    at_least(a.output_len, 1, "--output-len")
    if math.isnan(a.request_rate) or a.request_rate <= 0:
        raise ConfigError(f"--request-rate must be > 0 (requests/s) or inf, got "
                          f"{a.request_rate}", option="request_rate")
    if not math.isfinite(a.temperature) or a.temperature < 0:
        raise ConfigError(f"--temperature must be >= 0, got {a.temperature}",
                          option="temperature")
    if not (a.timeout > 0 and math.isfinite(a.timeout)):
        raise ConfigError(f"--timeout must be a number of seconds > 0, got {a.timeout}",
                          option="timeout")
    at_least(a.client_processes, 1, "--client-processes")
    for flag, value in (("--num-prompts", a.num_prompts), ("--max-concurrency", a.max_concurrency)):
        if value is not None and value < a.client_processes:
            raise ConfigError(f"{flag} {value} is less than --client-processes "
                              f"{a.client_processes}: every process needs a share of at least one",
                              option="client_processes")
    if a.dataset is not None and a.input_len is not None:
        raise ConfigError("--input-len sets random prompts' length: leave it out with "
                          "--dataset, or leave --dataset out", option="input_len")
    return ServeBenchConfig(base_url=base_url, model=a.model, endpoint=a.endpoint,
                            api_key=a.api_key or os.environ.get("OPENAI_API_KEY") or None,
                            num_prompts=a.num_prompts, request_rate=a.request_rate,
                            max_concurrency=a.max_concurrency, output_len=a.output_len,
                            ignore_eos=a.ignore_eos, temperature=a.temperature, seed=a.seed,
                            timeout_s=a.timeout, client_processes=a.client_processes)


def run(a) -> int:
    cfg = config_from_args(a)
    check_output_json(a.output_json)
    if a.dataset is not None:
        prompts = cycle(load_dataset(a.dataset, limit=cfg.num_prompts), cfg.num_prompts)
    else:
        prompts = random_text_prompts(cfg.num_prompts, a.input_len or 64, cfg.seed)
    bar = progress(cfg.num_prompts, "req", a.quiet)
    try:
        s = run_load(cfg, prompts, on_progress=bar.update)
    finally:
        bar.close()
    print_summary(s)
    for e in s["errors"]:
        print(f"outpace bench serve: failed request: {e}", file=sys.stderr)
    write_json(a.output_json, s)
    return 0 if s["failed"] == 0 else 1
