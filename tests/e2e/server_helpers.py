"""Helpers of the server tests: the tiny model folder, `outpace serve` subprocesses, /metrics."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
API_KEY = "test-key"
MAX_MODEL_LEN = 256
# KV blocks of every test engine over the tiny model (16 tokens each, 16 KiB): 64 requests of
# up to MAX_MODEL_LEN tokens at once. The CPU default (cpu_kv_bytes, 1 GiB, written at start-up)
# would make each server and in-process engine cost a GiB of memory.
NUM_KV_BLOCKS = 64 * MAX_MODEL_LEN // 16 + 1


def build_tiny_llama(folder: Path, gguf: Path) -> Path:
    """A tiny random Llama HF folder with the default model's tokenizer (taken from its GGUF)."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4,  # no GQA: SDPA enable_gqa is slow on CPU
        max_position_embeddings=512,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(str(folder), safe_serialization=True)
    tok.save_pretrained(str(folder))
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the server child before exec: on Linux, the kernel sends it SIGTERM when the pytest
    process dies, so a run killed from outside (Ctrl-C twice, the OOM killer) leaves no server
    behind; the fixtures stop the servers themselves otherwise."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


class ServerProcess:
    """One `outpace serve` subprocess; its output goes to a log file (a pipe could fill up)."""

    def __init__(self, model_dir: Path, extra_args: list, log_path: Path,
                 api_key: str | None = None, max_model_len: int | None = MAX_MODEL_LEN,
                 env: dict | None = None):
        """max_model_len: --max-model-len, or None for none (the model's context); env: more
        environment variables for the server."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.model = str(model_dir)
        self.log_path = log_path
        cmd = [sys.executable, "-m", "outpace.entrypoints.cli", "serve", "--model", str(model_dir),
               "--device", "cpu", "--port", str(self.port), "--num-kv-blocks",
               str(NUM_KV_BLOCKS), *extra_args]
        if max_model_len is not None:
            cmd += ["--max-model-len", str(max_model_len)]
        if api_key:
            cmd += ["--api-key", api_key]
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=str(REPO), stdout=self._log,
                                     stderr=subprocess.STDOUT, env=env,
                                     preexec_fn=_die_with_parent)

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log_tail(self, n: int = 3000) -> str:
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    def wait_healthy(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"server not healthy after {timeout} s:\n{self.log_tail()}")

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=60, **kw)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


def scrape(srv: ServerProcess) -> dict:
    """/metrics parsed with prometheus_client's parser: {sample name + labels: value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(srv.url + "/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            extra = {k: v for k, v in s.labels.items() if k != "model_name"}
            key = s.name + ("" if not extra else
                            "{" + ",".join(f"{k}={v}" for k, v in sorted(extra.items())) + "}")
            out[key] = s.value
    return out


def wait_for(pred, timeout: float = 10.0, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(interval)
    return last
