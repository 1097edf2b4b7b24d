"""The CLI's engine flags reach the engine arguments (no model is loaded)."""

from __future__ import annotations

import pytest

from outpace.entrypoints.cli import build_parser
from outpace.entrypoints.cli_options import engine_kwargs
from outpace.errors import OutpaceError


def _kwargs(*argv):
    return engine_kwargs(build_parser().parse_args(["generate", "hi", *argv]))


def test_defaults_overlap_on_graphs_on():
    kw = _kwargs()
    assert kw["overlap"] is True and kw["enforce_eager"] is False
    assert kw["speculative_config"] is None


def test_no_overlap_and_enforce_eager():
    kw = _kwargs("--no-overlap", "--enforce-eager")
    assert kw["overlap"] is False and kw["enforce_eager"] is True


def test_spec_options_are_parsed():
    kw = _kwargs("--spec", "eagle3", "--draft", "/d", "--k", "4",
                 "--spec-option", "force_accept_mean=3", "--spec-option", "x=true")
    assert kw["speculative_config"] == {"method": "eagle3", "num_speculative_tokens": 4,
                                        "model": "/d", "force_accept_mean": 3, "x": True}


def test_k_defaults_to_3_and_spec_flags_without_spec_are_errors():
    assert _kwargs("--spec", "ngram")["speculative_config"]["num_speculative_tokens"] == 3
    for argv in (["--k", "2"], ["--draft", "/d"], ["--spec-option", "adaptive=true"]):
        with pytest.raises(OutpaceError, match="without --spec .*add --spec"):
            _kwargs(*argv)


def test_malformed_spec_option_is_a_clear_error():
    with pytest.raises(OutpaceError, match="KEY=VALUE"):
        _kwargs("--spec", "ngram", "--spec-option", "oops")


@pytest.mark.parametrize("key,bad", [("weight_dtype", "int8"), ("kv_cache_dtype", "fp8")])
def test_narrow_storage_dtype_flags(key, bad):
    """--weight-dtype / --kv-cache-dtype: default auto, passed through, unknown choices rejected."""
    flag = "--" + key.replace("_", "-")
    assert _kwargs()[key] == "auto"
    kw = _kwargs("--dtype", "float32", flag, "bfloat16")
    assert kw["dtype"] == "float32" and kw[key] == "bfloat16"
    with pytest.raises(SystemExit):  # argparse rejects an unknown choice
        _kwargs(flag, bad)


def test_ctrl_c_stops_the_answer_and_keeps_what_it_wrote():
    """Ctrl-C while a request streams aborts it (the engine releases it) and returns the text so
    far: no traceback, and `chat` keeps the conversation."""
    import io
    from types import SimpleNamespace

    from outpace.entrypoints.cli_commands import _stream

    class Engine:
        def __init__(self):
            self.live, self.steps, self.aborted = set(), 0, []

        def add_request(self, rid, ids, params):
            self.live.add(rid)

        def has_unfinished_requests(self):
            return bool(self.live)

        def abort_request(self, rid):
            self.aborted.append(rid)
            self.live.discard(rid)

        def step(self):
            self.steps += 1
            if self.steps == 3:
                raise KeyboardInterrupt
            return [SimpleNamespace(request_id="r", text="ab"[:self.steps], metrics={},
                                    finished=False)]

    eng, out = Engine(), io.StringIO()
    last, interrupted = _stream(eng, "r", [1, 2], None, out)
    assert interrupted and eng.aborted == ["r"] and not eng.live
    assert last.text == "ab" and out.getvalue() == "ab [interrupted]\n"


def test_speculative_config_as_json_like_vllm():
    spec = {"method": "eagle3", "num_speculative_tokens": 2, "k_schedule": [[8, 2], [32, 1]]}
    import json
    assert _kwargs("--speculative-config", json.dumps(spec))["speculative_config"] == spec
    with pytest.raises(OutpaceError, match="leave out --spec"):
        _kwargs("--speculative-config", json.dumps(spec), "--k", "2")
    with pytest.raises(OutpaceError, match="not valid JSON"):
        _kwargs("--speculative-config", "{method: eagle3}")
    with pytest.raises(OutpaceError, match="must be a JSON object, got list"):
        _kwargs("--speculative-config", "[1]")


def test_spec_option_values_parse_as_json():
    spec = _kwargs("--spec", "ngram", "--spec-option", "k_schedule=[[8,2],[32,1]]",
                   "--spec-option", "suffix_periodic=1", "--spec-option", "adaptive=True",
                   "--spec-option", "mtp_mode=eagle")["speculative_config"]
    assert spec["k_schedule"] == [[8, 2], [32, 1]] and spec["mtp_mode"] == "eagle"
    from outpace.speculative_config import SpecConfig
    cfg = SpecConfig.from_dict(spec)
    assert cfg.k_schedule == ((8, 2), (32, 1)) and cfg.suffix_periodic is True and cfg.adaptive


def test_version(capsys):
    from outpace import __version__
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"outpace {__version__}"


def test_help_shows_every_default():
    """Every option of every subcommand has help, and the help ends with its default wherever
    there is one to show (None, off flags and empty lists say in words what leaving them out
    does)."""
    import argparse
    import re
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == {"generate", "chat", "serve", "init-draft", "train-draft",
                                "eval-draft", "bench"}
    bench = next(a for a in sub.choices["bench"]._actions
                 if isinstance(a, argparse._SubParsersAction))
    assert set(bench.choices) == {"latency", "throughput", "serve"}
    commands = {**{n: sp for n, sp in sub.choices.items() if n != "bench"},
                **{f"bench {n}": sp for n, sp in bench.choices.items()}}
    for name, sp in commands.items():
        text = re.sub(r"\s+", " ", sp.format_help())
        for a in sp._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            assert a.help, f"{name} {a.option_strings or a.dest} has no help"
            if a.default not in (None, False, []):
                assert f"(default: {a.default})" in text, (name, a.option_strings)
    text = re.sub(r"\s+", " ", sub.choices["serve"].format_help())
    assert "--port PORT port (default: 8000)" in text
    assert "--max-num-seqs MAX_NUM_SEQS requests running at once (default: 64)" in text


def test_gpu_memory_utilization_flag():
    assert _kwargs()["gpu_memory_utilization"] is None
    assert _kwargs("--gpu-memory-utilization", "0.9")["gpu_memory_utilization"] == 0.9


class _ChatEngine:
    """A stand-in engine for the chat loop: a prompt's tokens are its messages' words plus two
    a message; each answer is 'w' tokens, as many as max_tokens allows, at most 6."""

    max_model_len = 20

    def __init__(self):
        self.live, self.asked, self.seen = {}, [], []
        engine = self

        class Tok:
            def chat_token_ids(self, messages, add_generation_prompt=True):
                engine.seen.append([m["content"] for m in messages])
                if messages[-1]["content"] == "INTERRUPT":
                    raise KeyboardInterrupt
                return [1] * sum(len(m["content"].split()) + 2 for m in messages)

        self.tokenizer = Tok()

    def add_request(self, rid, ids, params):
        self.asked.append(params.max_tokens)
        self.live[rid] = min(params.max_tokens, 6)

    def has_unfinished_requests(self):
        return bool(self.live)

    def abort_request(self, rid):
        self.live.pop(rid, None)

    def step(self):
        from types import SimpleNamespace
        (rid, n), = self.live.items()
        del self.live[rid]
        return [SimpleNamespace(request_id=rid, text=" ".join(["w"] * n), token_ids=[7] * n,
                                metrics={}, finished=True)]


def test_chat_says_to_reset_once_the_context_is_full_and_survives_ctrl_c():
    """The answer takes what the context has left (at most --max-tokens); a full context says
    /reset; a message that can't fit is dropped with that advice; Ctrl-C before an answer drops
    the message, at the prompt it leaves; no traceback anywhere."""
    import io

    from outpace.entrypoints.cli_commands import run_chat
    from outpace.types import SamplingParams
    lines = iter(["a b c", "d e", "f", "/reset", "INTERRUPT", "g"])

    def read(_prompt):
        try:
            return next(lines)
        except StopIteration:
            raise KeyboardInterrupt from None

    eng, out, err = _ChatEngine(), io.StringIO(), io.StringIO()
    assert run_chat(eng, SamplingParams(max_tokens=256), read=read, out=out, err=err) == 0
    # 5 prompt tokens: 15 left; then 17: 3 left, which fill the context
    assert eng.asked == [15, 3, 17]
    notes = err.getvalue().splitlines()
    assert notes == [
        "(the context is full: 20 tokens; /reset starts a new conversation)",
        "(the conversation fills the context: 25 tokens with this message, of 20; /reset "
        "starts a new one, /exit leaves)",
        "", "(stopped; type the next message, /reset or /exit)"]
    # after /reset and the dropped message, the conversation is the last message alone
    assert eng.seen[-1] == ["g"]
    assert out.getvalue().endswith("w w w w w w\n\n")


def test_ctrl_c_while_the_model_loads_is_no_traceback(default_model_path):
    """Ctrl-C before the answer starts (here while the model loads): exit status 130 (or death
    by SIGINT, which a shell reports as 130) and one line, no traceback. On a quick machine the signal may land in the answer instead (a long
    one is asked for, so the run can't end first): then 130, the answer marked interrupted."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-m", "outpace", "generate", "Write a long story about a dragon.",
         "--model", str(default_model_path), "--device", "cpu", "--quiet", "--max-tokens", "400"],
        cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(repo)},
        # a shell's background job ignores SIGINT, and a child inherits that: Ctrl-C's own
        # disposition for the CLI, as in a terminal
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(0.8)  # past the argument checks, while torch and the model load
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    # A shell reports both as status 130: Python ends by SIGINT itself, however the
    # KeyboardInterrupt was caught, when it was raised inside exec'd code (dataclasses
    # build their methods so while torch imports)
    assert proc.returncode in (130, -signal.SIGINT) and "Traceback" not in err, err
    if out.strip():  # the answer had started
        assert out.rstrip().endswith("[interrupted]") and not err.strip(), (out, err)
    else:
        assert err.strip().splitlines() == ["outpace: interrupted"], err


def test_bare_outpace_prints_its_help(capsys):
    from outpace.entrypoints.cli import main
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: outpace") and "generate" in out and "bench" in out


def test_the_model_as_model_or_as_model_flag_on_every_engine_command(capsys):
    """chat, serve and bench latency / throughput take the model as MODEL or --model (the same
    model twice is fine); generate only as --model, its positional being the prompt; neither
    gives the default model; two different ones are one error line naming both."""
    from outpace.engine.args import EngineArgs
    from outpace.entrypoints.cli_options import model_of
    from tests.cli_helpers import error_line
    parse = build_parser().parse_args
    default = EngineArgs().model
    for cmd in (["chat"], ["serve"], ["bench", "latency"], ["bench", "throughput"]):
        assert model_of(parse([*cmd, "m1"])) == "m1", cmd
        assert model_of(parse([*cmd, "--model", "m1"])) == "m1", cmd
        assert model_of(parse([*cmd, "--device", "cpu", "m1", "--model", "m1"])) == "m1", cmd
        assert model_of(parse(cmd)) == default, cmd
        line = error_line([*cmd, "m1", "--model", "m2", "--device", "cpu"], capsys)
        assert line == "two models: MODEL 'm1' and --model 'm2'; give one of them", cmd
    g = parse(["generate", "m1"])
    assert (g.prompt, model_of(g)) == ("m1", default)
    assert model_of(parse(["generate", "hi", "--model", "m1"])) == "m1"
