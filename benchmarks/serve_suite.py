"""The serving suite of benchmarks/serve.py (`--start-server MODEL`; issue 36): the server
against the offline engine on the same prompts, in one call.

For each speculative config in turn (`no-spec`, `eagle3-k2`, `mtp-k1`, `ngram-k3`, ...):
  1. `python -m outpace serve MODEL --port P <config's flags> <flags after -->` starts in a
     process group of its own; start-up is timed from the spawn to /health answering 200 and
     to the first streamed token of a one-token chat request;
  2. the load runs at each --concurrency (outpace.bench.serve: chat endpoint, ignore_eos, so
     every request makes --output-len tokens; greedy);
  3. the server's process group is stopped (SIGTERM, SIGKILL after --stop-timeout), also when
     anything fails or the suite is interrupted;
  4. only then the offline engine (`LLMEngine`, the same flags) runs the same prompts, rendered
     with the same chat template, at each concurrency: at most that many requests in the
     engine at once (a closed loop, as the load client keeps them), with max_num_seqs = the
     concurrency (one engine each) or, with --offline-engine shared, one engine with the
     server's flags. It runs in a subprocess of its own: no CUDA memory or context of it
     outlives it, so no server ever shares the GPU with an offline engine. An engine first
     takes the requests the server had before (the start-up request, and a token of each
     prompt of the lower concurrencies), so both prefix caches hold the same prompts.
Per (config, concurrency): the server's output tok/s, the offline engine's, their ratio, TTFT
p50 / p99, TPOT p50 against the offline engine's median step time, start-up seconds; the
prompt tokens of both sides compared (the same prompts, the same template). Then where the
TTFT went: the server's /metrics scraped right before and after each load, the means over the
run of its TTFT and of the TTFT's phases (outpace.bench.server_metrics) beside the client's
mean TTFT, and the client processes' CPU time. Two tables last, and JSON (--out).

    python benchmarks/serve.py --start-server smollm2-135m --device cpu \\
        --configs no-spec,ngram-k2 --concurrency 1 2 --num-prompts 4 --output-len 8 \\
        --out /tmp/serve_suite.json
    python benchmarks/serve.py --start-server MODEL.gguf --device cuda \\
        --configs no-spec,eagle3-k2,mtp-k1,ngram-k3 --out out/gpu_serve.json -- --seed 0

Flags after `--` go to every server and offline engine alike (engine flags, and the server's
own: --engine-process, --api-key, ...); speculation only through --configs
(`METHOD-kN+KEY=VALUE...`: `eagle3-k2+force_accept=3`, `mtp-k1+model=HEAD_DIR`). Servers get
--max-num-seqs of the highest concurrency unless given after `--`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as the offline worker
    sys.path.insert(0, str(REPO))

from benchmarks.common import print_table, serve_prompts, write_result  # noqa: E402
from outpace.errors import ConfigError  # noqa: E402

CHAT = "/v1/chat/completions"
METHODS = ("ngram", "suffix", "mtp", "eagle3")
CONFIG_RE = re.compile(r"^(?P<method>[a-z0-9]+)-k(?P<k>\d+)(?P<opts>(\+[^+=]+=[^+]*)*)$")
# the suite's own flags of `outpace serve`, and the speculative ones --configs gives
OWN_FLAGS = ("host", "port")
SPEC_FLAGS = {"spec": "--spec", "k": "--k", "draft": "--draft", "spec_option": "--spec-option",
              "speculative_config": "--speculative-config"}


def config_flags(name: str) -> list:
    """A --configs entry -> `outpace serve`'s speculative flags: `no-spec`, or METHOD-kN with
    +KEY=VALUE speculative options (`mtp-k1+model=HEAD_DIR` names the draft head)."""
    if name == "no-spec":
        return []
    m = CONFIG_RE.match(name)
    if m is None or m["method"] not in METHODS:
        raise ConfigError(f"--configs: {name!r} is not no-spec or METHOD-kN[+KEY=VALUE...] "
                          f"with METHOD one of {', '.join(METHODS)} (e.g. eagle3-k2)",
                          option="configs")
    flags = ["--spec", m["method"], "--k", m["k"]]
    for opt in filter(None, m["opts"].split("+")):
        flags += ["--spec-option", opt]
    return flags


def prompt_count(num_prompts, concurrency: int) -> int:
    """Requests at a concurrency: --num-prompts, else four rounds of it (16 at least), so the
    batch stays full for most of the run."""
    return num_prompts if num_prompts is not None else max(16, 4 * concurrency)


def file_stem(name: str) -> str:
    """A config's name as a log file's (its +model=PATH may hold slashes)."""
    return re.sub(r"[^A-Za-z0-9_.+=-]", "_", name)


# ---- child processes -------------------------------------------------------------------------

def _die_with_parent() -> None:
    """In a child before exec: on Linux the kernel sends it SIGTERM when the suite dies, so a
    suite killed with SIGKILL leaves no server behind (stop() ends them otherwise)."""
    if sys.platform.startswith("linux"):
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Child:
    """A subprocess in a process group of its own (with whatever it spawns: the server's
    engine-core process), its output in a log file (a pipe could fill up); stop() ends the
    whole group. A context manager: stopped however the block ends."""

    def __init__(self, argv: list, log_path: Path, stop_timeout: float = 30.0):
        self.log_path = Path(log_path)
        self.stop_timeout = stop_timeout
        self._log = open(self.log_path, "wb")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        self.spawned = time.perf_counter()
        self.timeline: list = []  # [seconds from the spawn, line] as read_timeline saw them
        self._read_at = 0  # how far into the log read_timeline has read
        self.proc = subprocess.Popen(argv, cwd=str(REPO), stdout=self._log,
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                     preexec_fn=_die_with_parent)
        self.pid = self.proc.pid

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    def read_timeline(self, max_lines: int = 200) -> None:
        """Note the log's lines written since the last call, each with the seconds from the
        spawn at which this call saw it (so each stamp is late by at most the caller's polling
        interval): the server's start-up as a timeline. Progress-bar redraws are skipped; a
        line still being written waits for the next call."""
        now = time.perf_counter() - self.spawned
        with open(self.log_path, "rb") as f:
            f.seek(self._read_at)
            data = f.read()
        end = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1
        self._read_at += end
        for raw in data[:end].replace(b"\r", b"\n").split(b"\n"):
            line = raw.decode(errors="replace").strip()
            if line and "%|" not in line and len(self.timeline) < max_lines:
                self.timeline.append([round(now, 2), line[:200]])

    def log_tail(self, n: int = 3000) -> str:
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    def _signal_group(self, sig) -> bool:
        """Send sig to the process group -> whether any process of it was there."""
        try:
            os.killpg(self.pid, sig)
            return True
        except ProcessLookupError:
            return False

    def group_alive(self) -> bool:
        return self._signal_group(0)

    def stop(self) -> dict:
        """SIGTERM to the process (a server's own shutdown: it stops what it started), SIGKILL
        to the group after stop_timeout; then whatever of the group is left (its engine-core
        process ends with it), the same way -> {"returncode" (a server that handled SIGTERM
        ends with -15, as uvicorn re-raises it), "group_left": whether any process of the
        group outlived all that}."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.proc.wait()
        for sig in (None, signal.SIGTERM, signal.SIGKILL):  # 5 s each to end
            if sig is not None:
                self._signal_group(sig)
            deadline = time.monotonic() + 5.0
            while self.group_alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            if not self.group_alive():
                break
        if not self._log.closed:
            self._log.close()
        return {"returncode": self.proc.returncode, "group_left": self.group_alive()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SuiteError(Exception):
    """A config's run failed (its server died, timed out, or its offline worker failed)."""


# ---- the server side -------------------------------------------------------------------------

def wait_ready(srv: Child, url: str, timeout: float) -> float:
    """Seconds from the spawn until /health answers 200."""
    import urllib.error
    import urllib.request
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if srv.proc.poll() is not None:
            raise SuiteError(f"the server exited with {srv.proc.returncode} while starting:\n"
                             f"{srv.log_tail()}")
        srv.read_timeline()
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    ready = time.perf_counter() - srv.spawned
                    srv.read_timeline()  # what it wrote before it answered
                    return ready
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.05)
    raise SuiteError(f"the server was not ready after {timeout} s (--startup-timeout):\n"
                     f"{srv.log_tail()}")


async def first_token(srv: Child, url: str, api_key, prompt: str) -> tuple:
    """A one-token streamed chat request -> (the served model's name, seconds from the spawn
    to its first token)."""
    from outpace.bench.serve import ServeBenchConfig, one_request, open_session, served_model
    cfg = ServeBenchConfig(base_url=url, endpoint=CHAT, api_key=api_key, output_len=1,
                           ignore_eos=True)
    async with open_session(cfg) as session:
        model = await served_model(session, cfg)
        sent = time.perf_counter()
        res = await one_request(session, cfg, model, prompt)
    if not res.ok:
        raise SuiteError(f"the start-up request failed: {res.error}\n{srv.log_tail()}")
    return model, sent + res.ttft - srv.spawned


def run_server(a, name: str, argv: list, texts: dict, log_dir: Path) -> dict:
    """One config's server: start-up, the load at each concurrency, stopped -> its record."""
    from outpace.bench.serve import ServeBenchConfig, run_load
    from outpace.bench.server_metrics import run_means, scrape
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "outpace", "serve", *argv, "--port", str(port)]
    rec = {"argv": cmd[1:], "log": str(log_dir / f"{file_stem(name)}.server.log")}
    print(f"[{name}] starting: {' '.join(cmd[1:])}", flush=True)
    srv = Child(cmd, Path(rec["log"]), a.stop_timeout)
    rec["pid"] = srv.pid
    try:
        rec["startup_ready_s"] = wait_ready(srv, url, a.startup_timeout)
        model, rec["startup_first_token_s"] = asyncio.run(
            first_token(srv, url, a.api_key, texts[a.concurrency[0]][0]))
        print(f"[{name}] ready in {rec['startup_ready_s']:.1f} s, first token at "
              f"{rec['startup_first_token_s']:.1f} s", flush=True)
        srv.read_timeline()
        # the server's start-up, line by line (seconds from the spawn): where the time went
        rec["startup_timeline"] = srv.timeline
        for t, line in srv.timeline:
            print(f"[{name}]   {t:6.2f} s  {line[:110]}", flush=True)
        rec["load"] = {}
        for c in a.concurrency:
            cfg = ServeBenchConfig(base_url=url, model=model, endpoint=CHAT, api_key=a.api_key,
                                   num_prompts=len(texts[c]), max_concurrency=c,
                                   output_len=a.output_len, ignore_eos=True, temperature=0.0,
                                   seed=a.seed,
                                   client_processes=min(a.client_processes, c, len(texts[c])))
            before = scrape(url)
            s = run_load(cfg, texts[c])
            s.update(run_means(before, scrape(url)))
            s.pop("config")
            rec["load"][str(c)] = s
            print(f"[{name}] concurrency {c}: {s['output_throughput']:.1f} tok/s, "
                  f"{s['failed']} failed", flush=True)
            if srv.proc.poll() is not None:
                raise SuiteError(f"the server exited with {srv.proc.returncode}:\n"
                                 f"{srv.log_tail()}")
    finally:
        rec.update(srv.stop())
    return rec


# ---- the offline side ------------------------------------------------------------------------

def run_offline(a, name: str, argv: list, texts: dict, log_dir: Path) -> dict:
    """The offline engine over the same prompts, in worker subprocesses (one engine each) ->
    {concurrency: its run}, with the workers' pids."""
    if a.offline_engine == "shared":
        jobs = [(argv, list(a.concurrency))]
    else:  # the batch of the offline engine at batch C: max_num_seqs = C
        jobs = [([*argv, "--max-num-seqs", str(c)], [c]) for c in a.concurrency]
    runs, pids = {}, []
    for job_argv, cs in jobs:
        tag = f"{file_stem(name)}.offline{'' if len(jobs) == 1 else f'-c{cs[0]}'}"
        # what the server had seen before the job's first concurrency, its prefix cache's
        # prompts: the engine prefills them first (a token each, untimed), so both sides'
        # caches hold the same prompts at every concurrency
        before = a.concurrency[:a.concurrency.index(cs[0])]
        job = {"argv": ["serve", *job_argv], "output_len": a.output_len,
               "warmup": texts[a.concurrency[0]][0],
               "history": [t for c in before for t in texts[c]],
               "runs": [{"concurrency": c, "texts": texts[c]} for c in cs]}
        job_path, out_path = log_dir / f"{tag}.job.json", log_dir / f"{tag}.out.json"
        job_path.write_text(json.dumps(job))
        out_path.unlink(missing_ok=True)
        print(f"[{name}] offline engine, concurrency {' '.join(map(str, cs))}", flush=True)
        with Child([sys.executable, str(Path(__file__).resolve()), "offline", str(job_path),
                    str(out_path)], log_dir / f"{tag}.log", a.stop_timeout) as w:
            pids.append(w.pid)
            rc = w.proc.wait()
        if rc != 0 or not out_path.exists():
            raise SuiteError(f"the offline engine exited with {rc}:\n{w.log_tail()}")
        out = json.loads(out_path.read_text())
        for c, r in out["runs"].items():
            runs[c] = {**r, "device_name": out["device_name"]}
    return {"runs": runs, "pids": pids}


def offline_worker(job_path: str, out_path: str) -> int:
    """`serve_suite.py offline JOB OUT`: one engine of the job's `outpace serve` flags; a
    one-token warm-up request (as the server's start-up request) and the server's earlier
    prompts (a token each), then each run's texts as chat prompts, at most `concurrency`
    requests in the engine at once -> OUT."""
    job = json.loads(Path(job_path).read_text())
    from outpace.entrypoints.cli import build_parser, default_openmp_wait_policy
    default_openmp_wait_policy()  # before torch loads, as `outpace serve` has it
    from benchmarks.common import device_name
    from outpace.bench import offline
    from outpace.bench.report import percentile
    from outpace.engine.engine import LLMEngine
    from outpace.entrypoints.cli_options import engine_args
    from outpace.types import SamplingParams
    ns = build_parser().parse_args(job["argv"])
    engine = LLMEngine.from_engine_args(engine_args(ns))
    tok = engine.tokenizer
    if not tok.has_chat_template:
        raise SystemExit("the model has no chat template: the suite sends chat requests")

    def chat(texts):
        return [tok.chat_token_ids([{"role": "user", "content": t}]) for t in texts]

    def params(n):
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                              output_kind="final_only")

    offline.run_requests(engine, chat([job["warmup"]]), params(1), tag="warmup")
    if job["history"]:
        offline.run_requests(engine, chat(job["history"]), params(1), tag="history")
    spec = engine.config.spec.method is not None
    out = {"device_name": device_name(engine.config.runner.device), "runs": {}}
    for run in job["runs"]:
        c = run["concurrency"]
        ids = chat(run["texts"])
        before = offline.spec_counters(engine)
        steps: list = []
        seconds, outs = offline.run_requests(engine, ids, params(job["output_len"]),
                                             tag=f"c{c}", max_in_flight=c, step_times=steps)
        n_out = sum(len(o.token_ids) for o in outs)
        tpots = [(o.metrics["finished_time"] - o.metrics["first_token_time"])
                 / (len(o.token_ids) - 1) for o in outs
                 if len(o.token_ids) > 1 and o.metrics.get("first_token_time")]
        out["runs"][str(c)] = {
            "duration": seconds, "num_requests": len(outs),
            "total_input_tokens": sum(len(p) for p in ids), "total_output_tokens": n_out,
            "output_throughput": n_out / seconds, "steps": len(steps),
            "median_step_ms": 1000 * percentile(steps, 50),
            "mean_step_ms": 1000 * sum(steps) / len(steps),
            "median_tpot_ms": 1000 * percentile(tpots, 50),
            "spec": offline.spec_result(before, offline.spec_counters(engine)) if spec else None}
    Path(out_path).write_text(json.dumps(out))
    return 0


# ---- the suite -------------------------------------------------------------------------------

def row(name: str, c: int, server: dict, off: dict) -> dict:
    """One (config, concurrency) of the report: the server's numbers against the offline
    engine's."""
    s = server["load"][str(c)]
    srv_tps, off_tps = s["output_throughput"], off["output_throughput"]
    return {
        "config": name, "concurrency": c,
        "server_output_tok_s": srv_tps, "offline_output_tok_s": off_tps,
        "ratio": srv_tps / off_tps if off_tps else None,
        "ttft_p50_ms": s["median_ttft_ms"], "ttft_p99_ms": s["p99_ttft_ms"],
        "tpot_p50_ms": s["median_tpot_ms"], "offline_step_ms": off["median_step_ms"],
        "tpot_step_ratio": (s["median_tpot_ms"] / off["median_step_ms"]
                            if off["median_step_ms"] else None),
        "offline_tpot_p50_ms": off["median_tpot_ms"],
        "startup_ready_s": server["startup_ready_s"],
        "startup_first_token_s": server["startup_first_token_s"],
        "failed": s["failed"],
        "server_prompt_tokens": s["total_input_tokens"],
        "offline_prompt_tokens": off["total_input_tokens"],
        "prompt_tokens_match": s["total_input_tokens"] == off["total_input_tokens"],
        "server_output_tokens": s["total_output_tokens"],
        "offline_output_tokens": off["total_output_tokens"],
        "server_duration_s": s["duration"], "offline_duration_s": off["duration"],
        "offline_spec": off["spec"],
        # where the TTFT goes: the client's mean against the server's own (from its handler),
        # and the server's phases of it (outpace.bench.server_metrics), means over the run
        "ttft_mean_ms": s["mean_ttft_ms"], "e2el_mean_ms": s["mean_e2el_ms"],
        "server_ttft_mean_ms": s.get("server_ttft_mean_ms"),
        "server_e2e_mean_ms": s.get("server_e2e_mean_ms"),
        "server_phase_mean_ms": s.get("server_phase_mean_ms") or {},
        "client_cpu_s": s.get("client_cpu_s"), "client_cpu_busiest": s.get("client_cpu_busiest"),
    }


def _fmt(v, nd=2):
    return "" if v is None else f"{v:.{nd}f}" if isinstance(v, float) else v


def print_report(rows: list) -> None:
    cols = ["config", "conc", "server tok/s", "offline tok/s", "ratio", "TTFT p50/p99 ms",
            "TPOT p50 ms", "offline step ms", "TPOT/step", "first token s"]
    print_table([{"config": r["config"], "conc": r["concurrency"],
                  "server tok/s": _fmt(r["server_output_tok_s"], 1),
                  "offline tok/s": _fmt(r["offline_output_tok_s"], 1),
                  "ratio": _fmt(r["ratio"]),
                  "TTFT p50/p99 ms": f"{r['ttft_p50_ms']:.1f} / {r['ttft_p99_ms']:.1f}",
                  "TPOT p50 ms": _fmt(r["tpot_p50_ms"]),
                  "offline step ms": _fmt(r["offline_step_ms"]),
                  "TPOT/step": _fmt(r["tpot_step_ratio"]),
                  "first token s": _fmt(r["startup_first_token_s"])} for r in rows], cols)
    print_phases(rows)


# the phase columns of print_phases: (header, server_metrics phase)
PHASE_COLS = (("http wait", "http_wait"), ("frontend", "frontend"), ("to engine", "to_engine"),
              ("queue", "queue"), ("prefill", "prefill"), ("return", "first_token_return"),
              ("1st chunk", "first_chunk"))


def print_phases(rows: list) -> None:
    """Where the TTFT went, means over each run in ms: the client's TTFT, the server's (from
    its handler's start), the server's phases around it (http wait before it; frontend to
    return add up to it; the first chunk follows), the client's and server's end-to-end
    latency, and the busiest client process's CPU time over the run (near 1: the client may
    be the limit)."""
    cols = ["config", "conc", "TTFT client", "TTFT server", *(h for h, _ in PHASE_COLS),
            "e2e client/server", "client CPU"]

    def line(r):
        ph = r.get("server_phase_mean_ms") or {}
        e2e_c, e2e_s = r.get("e2el_mean_ms"), r.get("server_e2e_mean_ms")
        return {"config": r["config"], "conc": r["concurrency"],
                "TTFT client": _fmt(r.get("ttft_mean_ms"), 1),
                "TTFT server": _fmt(r.get("server_ttft_mean_ms"), 1),
                **{h: _fmt(ph.get(k), 2) for h, k in PHASE_COLS},
                "e2e client/server": f"{_fmt(e2e_c, 1)} / {_fmt(e2e_s, 1)}",
                "client CPU": _fmt(r.get("client_cpu_busiest"))}
    print("\nmean ms over each run: the TTFT, its phases in the server, end-to-end")
    print_table([line(r) for r in rows], cols)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="benchmarks/serve.py --start-server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--start-server", required=True, metavar="MODEL",
                   help="the model `outpace serve` and the offline engine load")
    p.add_argument("--device", default="auto", help="cpu or cuda (auto: cuda when available)")
    p.add_argument("--configs", default="no-spec",
                   help="comma-separated: no-spec, METHOD-kN[+KEY=VALUE...] (default: no-spec)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--num-prompts", type=int, default=None,
                   help="requests at each concurrency (default: 4x it, 16 at least)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens of each request")
    p.add_argument("--dataset", default="mtbench", choices=["mtbench", "humaneval", "random"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--client-processes", type=int, default=4, metavar="N",
                   help="processes sending each load (outpace bench serve --client-processes; "
                   "fewer where the concurrency is lower)")
    p.add_argument("--offline-engine", default="per-concurrency",
                   choices=["per-concurrency", "shared"],
                   help="per-concurrency: an engine of max_num_seqs = C for concurrency C; "
                   "shared: one engine with the server's flags for every concurrency")
    p.add_argument("--startup-timeout", type=float, default=900.0, metavar="SECONDS")
    p.add_argument("--stop-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="after SIGTERM, the wait before SIGKILL")
    p.add_argument("--out", default=None, metavar="FILE.json", help="the results as JSON")
    p.add_argument("--log-dir", default=None, metavar="DIR",
                   help="the servers' and offline engines' logs (default: a temporary folder)")
    return p


def check(a, server_args: list) -> list:
    """Every flag checked before a process starts -> [(config name, `outpace serve` argv less
    the port)]. The flags after `--` are parsed by `outpace serve`'s own parser."""
    from outpace.bench.report import at_least
    from outpace.entrypoints.cli import build_parser as cli_parser
    from outpace.entrypoints.cli_options import engine_args
    for c in a.concurrency:
        at_least(c, 1, "--concurrency")
    at_least(a.num_prompts, 1, "--num-prompts")
    at_least(a.output_len, 1, "--output-len")
    at_least(a.client_processes, 1, "--client-processes")
    if len(set(a.concurrency)) != len(a.concurrency):
        raise ConfigError(f"--concurrency lists a value twice: {a.concurrency}",
                          option="concurrency")
    names = [n.strip() for n in a.configs.split(",") if n.strip()]
    if not names or len(set(names)) != len(names):
        raise ConfigError(f"--configs wants distinct names, got {a.configs!r}", option="configs")
    base = ["--device", a.device]
    parser = cli_parser()
    shared, unknown = parser.parse_known_args(["serve", a.start_server, *base, *server_args])
    if unknown:
        raise ConfigError(f"after `--`: {' '.join(unknown)} is no flag of `outpace serve` (see "
                          f"outpace serve --help)", option="server_args")
    defaults = parser.parse_args(["serve"])
    for key in OWN_FLAGS:
        if getattr(shared, key) != getattr(defaults, key):
            raise ConfigError(f"--{key} after `--`: the suite picks the servers' address",
                              option=key)
    for key, flag in SPEC_FLAGS.items():
        if getattr(shared, key) != getattr(defaults, key):
            raise ConfigError(f"{flag} after `--`: speculation is given by --configs "
                              f"(METHOD-kN+KEY=VALUE...)", option=key)
    a.api_key = shared.api_key
    if not any(x.startswith("--max-num-seqs") for x in server_args):
        base += ["--max-num-seqs", str(max(a.concurrency))]  # every concurrency runs at once
    out = []
    for name in names:
        argv = [a.start_server, *base, *config_flags(name), *server_args]
        engine_args(parser.parse_args(["serve", *argv]))  # the engine's checks, by flag
        out.append((name, argv))
    return out


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    server_args = []
    if "--" in argv:
        i = argv.index("--")
        argv, server_args = argv[:i], argv[i + 1:]
    a = build_parser().parse_args(argv)
    from outpace.errors import OutpaceError
    try:
        configs = check(a, server_args)
    except OutpaceError as e:
        print(f"serve.py: error: {e}", file=sys.stderr)
        return 2
    log_dir = Path(a.log_dir or tempfile.mkdtemp(prefix="serve_suite_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"logs in {log_dir}", flush=True)
    all_texts = serve_prompts(a.dataset, a.seed)
    from outpace.bench.datasets import cycle
    texts = {c: cycle(all_texts, prompt_count(a.num_prompts, c)) for c in a.concurrency}
    result = {"config": {"model": a.start_server, "device": a.device,
                         "configs": [n for n, _ in configs], "concurrency": a.concurrency,
                         "num_prompts": {str(c): len(t) for c, t in texts.items()},
                         "output_len": a.output_len, "dataset": a.dataset,
                         "offline_engine": a.offline_engine, "server_args": server_args},
              "configs": {}, "rows": []}

    def save():
        if a.out:
            write_result(Path(a.out), result)

    def interrupted(signum, frame):  # SIGTERM as Ctrl-C: the servers are stopped on the way
        raise KeyboardInterrupt
    old = None
    try:
        old = signal.signal(signal.SIGTERM, interrupted)
    except ValueError:  # not the main thread
        pass
    ok = True
    try:
        for name, cargv in configs:
            rec = result["configs"][name] = {}
            try:
                rec["server"] = run_server(a, name, cargv, texts, log_dir)
                rec["offline"] = run_offline(a, name, cargv, texts, log_dir)
            except Exception as e:  # recorded; the other configs still run
                print(f"[{name}] failed: {e!r}", file=sys.stderr, flush=True)
                rec["error"] = repr(e)[:4000]
                ok = False
                save()
                continue
            for c in a.concurrency:
                r = row(name, c, rec["server"], rec["offline"]["runs"][str(c)])
                result["rows"].append(r)
                if r["failed"] or not r["prompt_tokens_match"]:
                    ok = False
                    print(f"[{name}] concurrency {c}: {r['failed']} failed requests; prompt "
                          f"tokens server {r['server_prompt_tokens']}, offline "
                          f"{r['offline_prompt_tokens']}", file=sys.stderr, flush=True)
            save()
    except KeyboardInterrupt:
        print("serve.py: interrupted; every server stopped", file=sys.stderr)
        save()
        return 130
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)
    print_report(result["rows"])
    if a.out:
        print("wrote", a.out)
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "offline":
        from benchmarks.common import drop_script_folder
        drop_script_folder()
        sys.exit(offline_worker(sys.argv[2], sys.argv[3]))
    sys.exit(main())
