"""ServerConfig's choice of where the engine loop runs: unset, a process of its own beside a GPU
engine and a thread of the server's process beside a CPU one; set, as set; several front ends
always over a process; and the device that choice reads ('auto' resolved as the engine does)."""

from __future__ import annotations

import pytest
import torch

from outpace.config import ServerConfig
from outpace.errors import ConfigError
from outpace.runner_config import resolve_device


@pytest.mark.parametrize("device,expected", [("cpu", False), ("cuda", True), ("cuda:1", True)])
def test_unset_the_engine_gets_a_process_on_a_gpu_and_a_thread_on_the_cpu(device, expected):
    assert ServerConfig().engine_process is None
    assert ServerConfig().runs_engine_process(device) is expected


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_set_it_is_as_set_on_any_device(device):
    assert ServerConfig(engine_process=True).runs_engine_process(device) is True
    assert ServerConfig(engine_process=False).runs_engine_process(device) is False


def test_unset_a_lent_model_keeps_the_engine_in_a_thread_even_on_a_gpu():
    """EngineArgs.loaded (a model lent in the server's process) cannot go to an engine process
    (EngineCoreClient refuses it): unset, the GPU's default must not pick one."""
    assert ServerConfig().runs_engine_process("cuda", lent_model=True) is False
    assert ServerConfig(engine_process=True).runs_engine_process("cuda", lent_model=True)


def test_several_front_ends_always_run_over_an_engine_process():
    assert ServerConfig(api_server_count=2).runs_engine_process("cpu") is True
    assert ServerConfig(api_server_count=2, engine_process=True).runs_engine_process("cpu")
    with pytest.raises(ConfigError, match="api_server_count above 1 runs the engine in a "
                                          "process") as e:
        ServerConfig(api_server_count=2, engine_process=False)
    assert e.value.option == "api_server_count"


@pytest.mark.parametrize("bad", ["yes", 1, 0])
def test_engine_process_must_be_a_bool_or_unset(bad):
    with pytest.raises(ConfigError, match="engine_process must be true, false or unset") as e:
        ServerConfig(engine_process=bad)
    assert e.value.option == "engine_process"


def test_resolve_device():
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    for device in ("cpu", "cuda", "cuda:1"):
        assert resolve_device(device) == device


@pytest.mark.parametrize("loaded,expected", [(None, True), (("model", "cfg", "tok"), False)])
def test_the_server_on_a_gpu_serves_a_lent_model_in_a_thread(loaded, expected):
    """The server's choice (server.engine_in_process, what _run_server asks) as a GPU machine
    makes it: unset, a process, except for a lent model, which only a thread can serve."""
    from outpace.engine.args import EngineArgs
    from outpace.entrypoints.openai.server import engine_in_process
    args = EngineArgs(model="tiny", loaded=loaded)
    assert engine_in_process(args, ServerConfig(), device="cuda") is expected
    assert engine_in_process(args, ServerConfig(), device="cpu") is False
    assert engine_in_process(EngineArgs(model="tiny", device="cpu"), ServerConfig()) is False
