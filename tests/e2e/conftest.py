"""Fixtures of the server tests: real `outpace serve` processes over the tiny random Llama HF
folder (tiny_model_dir, tests/conftest.py: config.json + model.safetensors + the SmolLM2
tokenizer with its chat template, taken from the default GGUF, built once per session).

Each server is a subprocess of `python -m outpace.entrypoints.cli serve` on a free loopback
port, started on first use and kept until the last test of this folder (tests read metric
*deltas*, so sharing one is safe when tests run serially), then stopped, whether tests failed
or not; a server also dies with the pytest process (server_helpers._die_with_parent).
"""

from __future__ import annotations

import pytest

from tests.e2e.server_helpers import API_KEY, ServerProcess


@pytest.fixture(scope="session")
def server_mode_args(pytestconfig) -> list:
    """Flags every test server gets: `pytest --engine-process` runs them all with the engine
    loop in a process of its own (the default: a thread of the server's process)."""
    return ["--engine-process"] if pytestconfig.getoption("--engine-process") else []


@pytest.fixture(scope="package")
def start_server(tiny_model_dir, tmp_path_factory, server_mode_args):
    """start_server(name, extra_args, api_key) -> ServerProcess, started once per name."""
    servers: dict = {}
    log_dir = tmp_path_factory.mktemp("server_logs")

    def start(name: str, extra_args: list, api_key: str | None = None) -> ServerProcess:
        if name not in servers:
            srv = ServerProcess(tiny_model_dir, [*extra_args, *server_mode_args],
                                log_dir / f"{name}.log", api_key)
            servers[name] = srv
            srv.wait_healthy()
        srv = servers[name]
        assert srv.proc.poll() is None, f"server {name} died:\n{srv.log_tail()}"
        return srv

    try:
        yield start
    finally:
        for srv in servers.values():
            srv.stop()


@pytest.fixture(scope="package")
def server(start_server) -> ServerProcess:
    """Plain server with an API key."""
    return start_server("plain", ["--seed", "0"], api_key=API_KEY)


@pytest.fixture(scope="package")
def spec_server(start_server) -> ServerProcess:
    """Same model with n-gram speculation (k=3), no API key."""
    return start_server("spec", ["--seed", "0", "--spec", "ngram", "--k", "3"])
