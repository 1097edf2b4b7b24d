"""The server's front end alone: `outpace serve`'s HTTP, SSE and output path over a stand-in
engine, on the CPU, with no model to run (issue 36: can the front end keep up with a GPU?).

    python benchmarks/frontend.py [--modes thread process] [--step-ms 1.0] [--concurrency 64]
        [--num-prompts 512] [--output-len 128] [--client-processes 1] [--rounds 2]

The stand-in (StubEngine) is an LLMEngine whose step sleeps --step-ms (the GIL released, as
while a GPU step runs) and then gives every running request one token, through the engine's
own output path (detokenization, RequestOutput): as a GPU engine at that step time whose host
work is free. Each mode's server runs in a process of its own (`--serve`; thread: the engine
loop in a thread of the server's process; process: in an engine-core process behind it, the
stand-in built there through EngineCoreClient's build_engine) and `outpace bench serve`'s client
drives it (chat, greedy, ignore_eos) at --concurrency. Reported per mode: output tok/s against
the stand-in's own cadence (concurrency x 1000 / step-ms), TTFT, TPOT, and the CPU time each
output token cost the server's process (and the engine-core process), from /proc (Linux).

Writes benchmarks/results/latest/cpu_frontend.json (--out: a folder or a .json file).
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (  # noqa: E402
    HERE, device_name, drop_script_folder, out_file, print_table, write_result)

MODEL = "smollm2-135m"  # its tokenizer only (--model): the stand-in computes nothing


def stub_engine(step_ms: float, model: str = MODEL, engine_args=None):
    """A StubEngine over `model`'s tokenizer (a catalog name, a .gguf file or a Hugging Face
    folder; engine_args: EngineCoreClient's, not read): module-level, so that a spawned
    engine-core process can build it."""
    from outpace.engine.engine import LLMEngine
    from outpace.models.catalog import resolve_model
    from outpace.models.loader.gguf import GGUFFile, config_from_gguf
    from outpace.tokenizer import Tokenizer
    from outpace.types import Request, RequestStatus, SpecStats

    class _Scheduler:
        num_running = num_waiting = 0

        def finish_request(self, rid, status, stop):
            pass

    class _Runner:
        def release(self, rid):
            pass

    class _KV:
        num_used_blocks, num_blocks = 0, 1

    class StubEngine(LLMEngine):
        def __init__(self, tokenizer):  # (LLMEngine's components are not built)
            self.tokenizer, self.model_name, self.max_model_len = tokenizer, MODEL, 8192
            self.vocab_size = 49152
            self.scheduler, self.runner, self.kv = _Scheduler(), _Runner(), _KV()
            self._requests, self._detok, self._emitted = {}, {}, {}
            self.prompt_tokens_total = self.generation_tokens_total = 0
            self.num_preemptions_total = self.num_draft_failures_total = 0
            self.spec_stats = SpecStats()
            self._rng = random.Random(0)

        def add_request(self, rid, prompt, params=None):
            from outpace.engine.detokenize import IncrementalDetokenizer
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            req = Request(request_id=rid, prompt_token_ids=ids, sampling_params=params,
                          eos_token_ids=(), max_model_len=self.max_model_len)
            req.status = RequestStatus.RUNNING
            self._requests[rid] = req
            self._detok[rid] = IncrementalDetokenizer(
                self.tokenizer, ids, params.skip_special_tokens, params.stop,
                params.include_stop_str_in_output) if params.detokenize else None
            self._emitted[rid] = 0

        def abort_request(self, rid):
            self._requests.pop(rid, None)
            self._detok.pop(rid, None)
            self._emitted.pop(rid, None)

        def step(self):
            time.sleep(step_ms / 1000.0)
            outs = []
            for req in list(self._requests.values()):
                req.output_token_ids.append(self._rng.randrange(300, 20000))
                if req.first_token_time is None:
                    req.first_token_time = time.monotonic()
                if len(req.output_token_ids) >= req.sampling_params.max_tokens:
                    req.status = RequestStatus.FINISHED_LENGTH
                out = self._output_of(req)
                if out is not None:
                    outs.append(out)
            self.scheduler.num_running = len(self._requests)
            return outs

        def shutdown(self):
            pass

    if Path(model).is_dir():
        from outpace.models.loader.safetensors import read_hf_config
        return StubEngine(Tokenizer.from_folder(model, read_hf_config(model).eos_token_ids))
    path = str(resolve_model(model, quiet=True))
    g = GGUFFile(path)
    tok = Tokenizer.from_gguf(path, config_from_gguf(g).eos_token_ids,
                              cache_key=g.metadata_sha256(), quiet=True)
    return StubEngine(tok)


def serve(mode: str, port: int, step_ms: float, model: str = MODEL) -> None:
    """`--serve`: one mode's server on 127.0.0.1:port until killed."""
    import uvicorn

    from outpace.config import ServerConfig
    from outpace.engine.args import EngineArgs
    from outpace.entrypoints.openai.http_protocol import header_deadline_protocol
    from outpace.entrypoints.openai.server import build_app
    from outpace.models.catalog import resolve_model
    if mode == "thread":
        from outpace.engine.async_engine import AsyncEngine
        engine = AsyncEngine(stub_engine(step_ms, model))
    else:
        from outpace.engine.core_client import EngineCoreClient
        where = model if Path(model).is_dir() else str(resolve_model(model, quiet=True))
        args = EngineArgs.from_kwargs(where, device="cpu")
        engine = EngineCoreClient(args, build_engine=functools.partial(stub_engine, step_ms,
                                                                       model))
    app = build_app(engine, ServerConfig(port=port))
    try:
        uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                      access_log=False, http=header_deadline_protocol())).run()
    finally:
        engine.shutdown()


def _tree_cpu_s(pid: int) -> dict:
    """{pid: user + system CPU seconds} of a process and its children (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(entry) == pid or int(fields[1]) == pid:  # fields[1]: the parent's pid
            out[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def one_run(a, mode: str) -> dict:
    import socket
    import urllib.request

    from outpace.bench.datasets import random_text_prompts
    from outpace.bench.serve import ServeBenchConfig, run_load
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = subprocess.Popen([sys.executable, __file__, "--serve", mode, "--port", str(port),
                            "--step-ms", str(a.step_ms), "--model", a.model],
                           stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while True:
            if srv.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the {mode} server did not start: "
                                   f"{srv.stderr.read().decode()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.1)
        cfg = ServeBenchConfig(base_url=f"http://127.0.0.1:{port}", endpoint="/v1/chat/completions",
                               num_prompts=a.num_prompts, max_concurrency=a.concurrency,
                               output_len=a.output_len, ignore_eos=True,
                               client_processes=a.client_processes)
        prompts = random_text_prompts(64, 64, seed=0)
        before = _tree_cpu_s(srv.pid)
        s = run_load(cfg, prompts)
        after = _tree_cpu_s(srv.pid)
    finally:
        srv.kill()
        srv.wait()
    tokens = s["total_output_tokens"] or 1
    front = after.get(srv.pid, 0.0) - before.get(srv.pid, 0.0)
    core = sum(v - before.get(p, 0.0) for p, v in after.items() if p != srv.pid)
    cadence = a.concurrency * 1000.0 / a.step_ms
    return {"mode": mode, "tok_s": round(s["output_throughput"], 1),
            "vs_cadence": round(s["output_throughput"] / cadence, 3),
            "ttft_p50_ms": round(s["median_ttft_ms"], 1), "ttft_p99_ms": round(s["p99_ttft_ms"], 1),
            "tpot_p50_ms": round(s["median_tpot_ms"], 2), "failed": s["failed"],
            "front_cpu_us_per_token": round(front / tokens * 1e6, 1),
            "core_cpu_us_per_token": round(core / tokens * 1e6, 1) if mode == "process" else None}


def main():
    drop_script_folder()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", default=["thread", "process"],
                    choices=["thread", "process"])
    ap.add_argument("--step-ms", type=float, default=1.0, help="the stand-in's step time")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--client-processes", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2, help="the modes in turns, this often")
    ap.add_argument("--out", default=str(HERE / "results" / "latest"))
    ap.add_argument("--model", default=MODEL,
                    help="whose tokenizer the front end runs: a catalog name, a .gguf file or a "
                    "Hugging Face folder (default: %(default)s)")
    ap.add_argument("--serve", choices=["thread", "process"], help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        serve(a.serve, a.port, a.step_ms, a.model)
        return
    if not Path("/proc/self/stat").exists():
        ap.error("the CPU times come from /proc: run it on Linux")
    rows = []
    for rnd in range(a.rounds):
        for mode in a.modes:
            row = {"round": rnd, **one_run(a, mode)}
            print(row, flush=True)
            rows.append(row)
    result = {"device": device_name("cpu"), "args": {k: v for k, v in vars(a).items()
                                                     if k not in ("serve", "port")},
              "runs": rows}
    write_result(out_file(a.out, "cpu_frontend.json"), result)
    print_table(rows, ["round", "mode", "tok_s", "vs_cadence", "ttft_p50_ms", "ttft_p99_ms",
                       "tpot_p50_ms", "front_cpu_us_per_token", "core_cpu_us_per_token"])


if __name__ == "__main__":
    main()
