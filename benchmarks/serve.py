"""Load client for a running `outpace serve` (or any OpenAI-compatible server).

Sends streaming requests at a given request rate (Poisson arrivals, as vLLM's benchmark_serving)
and/or with a bound on concurrency, for a number of prompts or a duration, and measures, with
vLLM's definitions:
    TTFT  time from sending the request to the first streamed token
    TPOT  per request: (latency - TTFT) / (output tokens - 1)
    ITL   gaps between consecutive streamed chunks (one chunk may carry several tokens)
    E2EL  time from sending to the last byte
    output throughput = output tokens of completed requests / benchmark duration
Output tokens come from the server's `usage` (stream_options.include_usage).

    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --max-concurrency 16 \
        --num-prompts 200 --output-len 128 --result-file benchmarks/results/serve.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_prompts, print_table, write_result  # noqa: E402


@dataclass
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: Optional[str] = None  # None: the first of /v1/models
    endpoint: str = "chat"  # chat | completions
    api_key: Optional[str] = None
    dataset: str = "mtbench"  # mtbench | humaneval | random
    num_prompts: Optional[int] = 100  # stop after this many requests (None: no bound)
    duration_s: Optional[float] = None  # stop sending after this long (None: no bound)
    request_rate: float = float("inf")  # requests/s, Poisson; inf: as fast as concurrency allows
    max_concurrency: Optional[int] = None
    output_len: int = 64
    ignore_eos: bool = True
    temperature: float = 0.0
    seed: int = 0
    timeout_s: float = 600.0


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    finish_reason: Optional[str] = None


def make_prompts(cfg: BenchConfig) -> list:
    if cfg.dataset == "random":
        rng = random.Random(cfg.seed)
        words = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "paper", "light"]
        return [" ".join(rng.choice(words) for _ in range(rng.randint(8, 40)))
                for _ in range(256)]
    return load_prompts(cfg.dataset, 10 ** 6)


def _payload(cfg: BenchConfig, model: str, prompt: str) -> tuple:
    common = {"model": model, "max_tokens": cfg.output_len, "temperature": cfg.temperature,
              "stream": True, "stream_options": {"include_usage": True},
              "ignore_eos": cfg.ignore_eos}
    if cfg.endpoint == "chat":
        return "/v1/chat/completions", {**common,
                                        "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {**common, "prompt": prompt}


async def one_request(client: httpx.AsyncClient, cfg: BenchConfig, model: str,
                      prompt: str) -> RequestResult:
    path, body = _payload(cfg, model, prompt)
    res = RequestResult()
    t0 = time.perf_counter()
    last = t0
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = chunk["error"].get("message", "stream error")
                    return res
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                for ch in chunk.get("choices") or []:
                    piece = ch.get("text") if "text" in ch else (ch.get("delta") or {}).get(
                        "content")
                    now = time.perf_counter()
                    if piece:
                        if res.ttft == 0.0:
                            res.ttft = now - t0
                        else:
                            res.itl.append(now - last)
                        last = now
                    if ch.get("finish_reason"):
                        res.finish_reason = ch["finish_reason"]
        res.latency = time.perf_counter() - t0
        res.ok = res.finish_reason is not None
        if not res.ok:
            res.error = "stream ended without a finish_reason"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def _first_model(client: httpx.AsyncClient) -> str:
    r = await client.get("/v1/models")
    r.raise_for_status()
    return r.json()["data"][0]["id"]


async def run_benchmark(cfg: BenchConfig) -> dict:
    """Run the load; returns the metrics dict (also what --result-file holds)."""
    if cfg.num_prompts is None and cfg.duration_s is None:
        raise ValueError("give num_prompts or duration_s, or the load never ends")
    if cfg.duration_s is not None and cfg.max_concurrency is None \
            and cfg.request_rate == float("inf"):
        raise ValueError("a timed run needs max_concurrency or a finite request_rate")
    prompts = make_prompts(cfg)
    rng = random.Random(cfg.seed)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=max(cfg.max_concurrency or 256, 1),
                          max_keepalive_connections=max(cfg.max_concurrency or 256, 1))
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    results: list = []
    async with httpx.AsyncClient(base_url=cfg.base_url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(cfg.timeout_s)) as client:
        model = cfg.model or await _first_model(client)

        async def run_one(prompt):
            try:
                results.append(await one_request(client, cfg, model, prompt))
            finally:
                if sem is not None:
                    sem.release()

        tasks = []
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
        duration = time.perf_counter() - start
    return summarize(cfg, model, results, duration)


def _pct(xs: list, p: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _stats_ms(name: str, xs: list) -> dict:
    ms = [x * 1000.0 for x in xs]
    return {f"mean_{name}_ms": sum(ms) / len(ms) if ms else 0.0,
            f"median_{name}_ms": _pct(ms, 50), f"p99_{name}_ms": _pct(ms, 99)}


def summarize(cfg: BenchConfig, model: str, results: list, duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    errors = [r.error for r in results if not r.ok]
    summary = {
        "config": {k: (None if v == float("inf") else v) for k, v in asdict(cfg).items()
                   if k != "api_key"},
        "model": model, "duration_s": duration, "num_requests": len(results),
        "completed": len(ok), "failed": len(errors), "errors": errors[:10],
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
        **_stats_ms("ttft", [r.ttft for r in ok]), **_stats_ms("tpot", tpots),
        **_stats_ms("itl", [x for r in ok for x in r.itl]),
        **_stats_ms("e2el", [r.latency for r in ok]),
    }
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    d = BenchConfig()
    p.add_argument("--base-url", default=d.base_url)
    p.add_argument("--model", default=None)
    p.add_argument("--endpoint", default=d.endpoint, choices=["chat", "completions"])
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset", default=d.dataset, choices=["mtbench", "humaneval", "random"])
    p.add_argument("--num-prompts", type=int, default=d.num_prompts)
    p.add_argument("--duration", type=float, default=None, help="seconds; overrides --num-prompts")
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--output-len", type=int, default=d.output_len)
    p.add_argument("--no-ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--result-file", default=None, help="JSON path (default: print only)")
    p.add_argument("--note", default="", help="free text stored in the result (server setup)")
    a = p.parse_args(argv)
    cfg = BenchConfig(base_url=a.base_url, model=a.model, endpoint=a.endpoint, api_key=a.api_key,
                      dataset=a.dataset,
                      num_prompts=None if a.duration else a.num_prompts, duration_s=a.duration,
                      request_rate=a.request_rate, max_concurrency=a.max_concurrency,
                      output_len=a.output_len, ignore_eos=not a.no_ignore_eos,
                      temperature=a.temperature, seed=a.seed)
    s = asyncio.run(run_benchmark(cfg))
    if a.note:
        s["note"] = a.note
    rows = [{"metric": k, "value": f"{v:.2f}" if isinstance(v, float) else v}
            for k, v in s.items() if k not in ("config", "errors")]
    print_table(rows, ["metric", "value"])
    for e in s["errors"]:
        print("error:", e, file=sys.stderr)
    if a.result_file:
        print("wrote", write_result(Path(a.result_file), s))
    return 0 if s["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
