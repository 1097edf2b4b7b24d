"""A bad flag is one `outpace: error:` line naming the flag, before the model (or a draft head)
loads or downloads, and before torch is imported (issue 38).

The cases run `main` on a model that could not load: a path that does not exist, or a folder
whose config.json is sound but whose weights are not. The flag's error must come first: were the
check made after loading, the model's error would be the one printed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli_helpers import error_line as _error_line, exit_codes_without

NO_MODEL = "/no/such/model"


@pytest.fixture(scope="module")
def unloadable_model(tmp_path_factory) -> Path:
    """A model folder with a sound config.json (512 positions) and weights that can't load."""
    from tests.speculative.spec_helpers import tiny_config, write_target_folder
    folder = write_target_folder(tiny_config(), tmp_path_factory.mktemp("unloadable"))
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    return folder


@pytest.fixture(scope="module")
def head_folders(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("heads")
    (base / "empty").mkdir()
    (base / "no_weights").mkdir()
    (base / "no_weights" / "config.json").write_text("{}")
    (base / "a_file").write_text("x")
    return {k: str(base / k) for k in ("empty", "no_weights", "a_file")}


# (flags, the start of the one error line); the model is NO_MODEL
FLAG_CASES = [
    (["--temperature", "-1"], "--temperature must be >= 0, got -1.0"),
    (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
    (["--top-p", "1e-46"], "--top-p must be at least 1.18e-38"),
    (["--top-k", "-2"], "--top-k must be -1, 0 (off) or a positive integer, got -2"),
    (["--min-p", "2"], "--min-p must be in [0, 1], got 2.0"),
    (["--max-tokens", "0"], "--max-tokens must be an integer >= 1, got 0"),
    (["--sample-seed", str(2 ** 64)], "--sample-seed must fit in 64 bits"),
    (["--repetition-penalty", "0"], "--repetition-penalty must be > 0, got 0.0"),
    (["--frequency-penalty", "2.5"], "--frequency-penalty must be in [-2, 2], got 2.5"),
    (["--presence-penalty", "-3"], "--presence-penalty must be in [-2, 2], got -3.0"),
    (["--spec", "ngram", "--draft", "/tmp"],
     "--spec 'ngram' drafts from the text itself and takes no draft head folder (--draft)"),
    (["--spec", "ngram", "--k", "0"], "--k must be an integer in 1..16 (draft tokens per step), "
                                      "got 0"),
    (["--spec", "ngram", "--k", "17"], "--k must be an integer in 1..16"),
    (["--spec", "ngram", "--spec-option", "num_speculative_tokens=four"],
     "--k must be an integer in 1..16 (draft tokens per step), got 'four'"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 40}'],
     "num_speculative_tokens must be an integer in 1..16"),
    (["--speculative-config", '{"method": "beam"}'], "method 'beam' is unknown"),
    (["--spec", "eagle3", "--draft", "/no/such/head"], "--draft '/no/such/head' does not exist; "
                                                       "give the folder of a draft head"),
    (["--speculative-config", '{"method": "mtp", "model": "/no/such/head"}'],
     "speculative_config['model'] '/no/such/head' does not exist"),
    (["--max-model-len", "0"], "--max-model-len must be an integer >= 2"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be an integer >= 1, got 0"),
    (["--num-kv-blocks", "1"], "--num-kv-blocks must be an integer >= 2"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization must be a number in (0, 1]"),
    (["--seed", str(2 ** 64)], "--seed must be an integer that fits in 64 bits"),
    (["--device", "tpu"], "--device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
    (["--dtype", "bfloat16", "--weight-dtype", "float32"],
     "--weight-dtype float32 is wider than --dtype bfloat16"),
    (["--chat-template", "/no/such.jinja"], "--chat-template '/no/such.jinja' does not exist"),
    (["--spec", "beam"], "argument --spec: invalid choice: 'beam'"),
    (["--max-model-len", "many"], "argument --max-model-len: invalid int value: 'many'"),
]


@pytest.mark.parametrize("flags,says", FLAG_CASES, ids=[" ".join(c[0])[:40] for c in FLAG_CASES])
def test_a_bad_flag_is_one_error_line_naming_it_before_the_model(flags, says, capsys):
    assert _error_line(["generate", "hi", "--model", NO_MODEL, *flags], capsys).startswith(says)


def test_the_model_error_is_what_a_sound_command_line_gets(capsys):
    """The control: with no bad flag, NO_MODEL's own error is the one printed."""
    assert _error_line(["generate", "hi", "--model", NO_MODEL], capsys).startswith(
        f"no model at {NO_MODEL}")


def test_a_folder_that_is_no_draft_head_is_refused_before_the_model(head_folders, capsys):
    for key, says in (("empty", "is not a draft head folder: it has no config.json and no "
                                "*.safetensors weight file"),
                      ("no_weights", "is not a draft head folder: it has no *.safetensors"),
                      ("a_file", "is a file, not a folder")):
        line = _error_line(["generate", "hi", "--model", NO_MODEL, "--spec", "mtp", "--draft",
                            head_folders[key]], capsys)
        assert line.startswith(f"--draft '{head_folders[key]}' {says}"), line


@pytest.fixture(scope="module")
def mtp_head_of_two(tmp_path_factory) -> str:
    """An MTP head folder of 2 modules (config.json) whose weights can't load."""
    folder = tmp_path_factory.mktemp("mtp2")
    (folder / "config.json").write_text(json.dumps({"num_nextn_predict_layers": 2}))
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    return str(folder)


def test_mtp_depths_options_are_checked_against_the_head_config_before_the_model(
        mtp_head_of_two, unloadable_model, capsys):
    """MTP's depths mode (the default for a head of several modules) drafts one token per
    module, needs the modules' own logits and k <= block_size: refused from the head's
    config.json, before the target (here: unloadable) loads."""
    base = ["generate", "hi", "--model", str(unloadable_model), "--device", "cpu", "--quiet",
            "--spec", "mtp", "--draft", mtp_head_of_two]
    assert _error_line(base + ["--k", "3"], capsys) == (
        "mtp_mode 'depths' drafts one token per module: the head has 2 modules, so --k must be "
        "<= 2 (or use mtp_mode 'eagle')")
    line = _error_line(base + ["--k", "2", "--spec-option", "draft_lm_head_dtype=int8"], capsys)
    assert line.startswith("draft_lm_head_dtype applies to EAGLE-3 heads"), line
    # the controls: eagle mode takes any k and the int8 LM head; depths mode within its
    # bounds; each gets as far as the target's weights
    for more in (["--k", "3", "--spec-option", "mtp_mode=eagle",
                  "--spec-option", "draft_lm_head_dtype=int8"], ["--k", "2"]):
        assert "is not a valid safetensors file" in _error_line(base + more, capsys)
    from outpace.engine.args import EngineArgs
    from outpace.engine.preflight import check_engine_args
    from outpace.errors import ConfigError
    with pytest.raises(ConfigError, match=r"needs num_speculative_tokens \(2\) <= block_size "
                                          r"\(1\)") as e:
        check_engine_args(EngineArgs(NO_MODEL, block_size=1, speculative_config={
            "method": "mtp", "model": mtp_head_of_two, "num_speculative_tokens": 2}))
    assert e.value.option == "num_speculative_tokens"


def test_serve_flags_are_checked_before_the_model(capsys):
    for flags, says in ((["--port", "70000"], "--port must be an integer in 0..65535"),
                        (["--max-waiting", "0"], "--max-waiting must be an integer >= 1"),
                        (["--timeout-keep-alive", "-1"], "--timeout-keep-alive must be a number"),
                        (["--api-server-count", "0"],
                         "--api-server-count must be an integer in 1..64"),
                        (["--api-server-count", "2", "--no-engine-process"],
                         "--api-server-count above 1 runs the engine in a process")):
        assert _error_line(["serve", NO_MODEL, *flags], capsys).startswith(says)


def test_max_model_len_beyond_the_config_is_refused_before_the_weights_load(unloadable_model,
                                                                           capsys):
    line = _error_line(["generate", "hi", "--model", str(unloadable_model), "--device", "cpu",
                        "--max-model-len", "513"], capsys)
    assert line == ("--max-model-len=513 is longer than the model's 512 positions; use at most "
                    "512")
    # the control: within the config, the weights are read, and fail
    line = _error_line(["generate", "hi", "--model", str(unloadable_model), "--device", "cpu",
                        "--max-model-len", "512", "--quiet"], capsys)
    assert "is not a valid safetensors file" in line


def test_the_checks_run_without_torch(unloadable_model):
    """Every flag error above comes before torch is imported: a fraction of a second on any
    machine, where importing torch takes seconds."""
    cases = [["generate", "hi", "--model", NO_MODEL, *flags] for flags, _ in FLAG_CASES]
    cases.append(["generate", "hi", "--model", str(unloadable_model), "--max-model-len", "513"])
    assert exit_codes_without(cases, ("torch",)) == [2] * len(cases)


def test_serve_port_in_use_is_an_error_before_the_model_loads(unloadable_model, capsys):
    # the port is bound before the engine loads: with a model whose weights can't load, the
    # port's error is the one printed (issue 36)
    import socket
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        line = _error_line(["serve", str(unloadable_model), "--device", "cpu", "--port",
                            str(port)], capsys)
    assert line == (f"127.0.0.1:{port} is in use (another server holds it); pick another "
                    f"--port or stop what holds it"), line


def test_serve_binds_a_socket_a_server_can_use():
    from outpace.entrypoints.openai.listen import bind_socket
    with bind_socket("127.0.0.1", 0) as sock:
        host, port = sock.getsockname()
        assert host == "127.0.0.1" and port > 0
        sock.listen()  # what the server's event loop does with it
        import socket
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
