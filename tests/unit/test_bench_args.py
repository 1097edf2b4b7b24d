"""`outpace bench`: dataset files (JSONL prompts, ShareGPT conversations), percentiles, and every
bad flag one `outpace: error:` line naming it, before a model loads or torch is imported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from outpace.bench.datasets import cycle, load_dataset, random_text_prompts, random_token_prompts
from outpace.bench.report import percentile
from tests.cli_helpers import error_line as _error_line, exit_codes_without
from outpace.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
NO_MODEL = "/no/such/model"


def _write(path: Path, lines) -> str:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


def test_jsonl_prompts_in_order_blank_lines_skipped_and_limited(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": 1, "prompt": "one"}\n\n{"prompt": "two"}\n{"prompt": "three"}\n')
    assert load_dataset(str(f)) == ["one", "two", "three"]
    assert load_dataset(str(f), limit=2) == ["one", "two"]


def test_the_shipped_prompt_sets_load():
    assert len(load_dataset(str(REPO / "benchmarks/prompts/mtbench.jsonl"))) == 80


def test_sharegpt_first_human_turn_from_a_json_array_or_jsonl(tmp_path):
    convs = [{"id": "a", "conversations": [{"from": "human", "value": "hi there"},
                                           {"from": "gpt", "value": "hello"}]},
             {"id": "b", "conversations": [{"from": "gpt", "value": "no human turn"}]},
             {"id": "c", "conversations": [{"from": "system", "value": "sys"},
                                           {"from": "human", "value": "second"}]},
             {"messages": [{"role": "user", "content": "openai shape"}]}]
    arr = tmp_path / "sharegpt.json"
    arr.write_text(json.dumps(convs))
    want = ["hi there", "second", "openai shape"]  # b has no human turn: skipped
    assert load_dataset(str(arr)) == want
    assert load_dataset(_write(tmp_path / "sharegpt.jsonl", convs)) == want
    assert load_dataset(str(arr), limit=1) == ["hi there"]


@pytest.mark.parametrize("content,says", [
    ('{"prompt": "ok"}\nnot json\n', "line 2 is not JSON"),
    ('{"text": "x"}\n', 'line 1 has no "prompt" string, ShareGPT "conversations" or '
                        '"messages" list'),
    ('[1, 2]', "entry 0 has no \"prompt\" string"),
    ('[{"prompt": "a"', "is not valid JSON"),
    ('\n\n', "holds no prompts"),
    ('{"conversations": [{"from": "gpt", "value": "x"}]}\n', "holds no prompts"),
])
def test_a_bad_dataset_names_the_flag_and_the_line(tmp_path, content, says):
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    with pytest.raises(ConfigError, match="--dataset") as e:
        load_dataset(str(f))
    assert says in str(e.value), str(e.value)


def test_a_missing_dataset_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_dataset(str(tmp_path / "nope.jsonl"))
    with pytest.raises(ConfigError, match="is a folder"):
        load_dataset(str(tmp_path))


def test_random_prompts_have_the_length_asked_and_repeat_with_the_seed():
    ids = random_token_prompts(3, 7, 50, seed=1)
    assert [len(p) for p in ids] == [7, 7, 7] and all(0 <= t < 50 for p in ids for t in p)
    assert ids == random_token_prompts(3, 7, 50, seed=1) != random_token_prompts(3, 7, 50, 2)
    texts = random_text_prompts(2, 5, seed=0)
    assert [len(t.split()) for t in texts] == [5, 5]
    assert cycle(["a", "b"], 5) == ["a", "b", "a", "b", "a"]


def test_percentiles_interpolate_as_numpy_does():
    np = pytest.importorskip("numpy")
    xs = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6]
    for p in (0, 10, 25, 50, 90, 99, 100):
        assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)))
    assert percentile([], 50) == 0.0


# (argv, the start of the one error line); the model, where one is given, is NO_MODEL
CASES = [
    (["latency", NO_MODEL, "--batch-size", "0"], "--batch-size must be an integer >= 1, got 0"),
    (["latency", NO_MODEL, "--num-iters", "0"], "--num-iters must be an integer >= 1"),
    (["latency", NO_MODEL, "--num-iters-warmup", "-1"], "--num-iters-warmup must be an integer "
                                                        ">= 0"),
    (["latency", NO_MODEL, "--input-len", "0"], "--input-len must be an integer >= 1"),
    (["latency", NO_MODEL, "--output-len", "0"], "--output-len must be an integer >= 1"),
    (["latency", NO_MODEL, "--temperature", "-1"], "--temperature must be >= 0"),
    (["latency", NO_MODEL, "--max-num-seqs", "0"], "--max-num-seqs must be an integer >= 1"),
    (["latency", NO_MODEL, "--spec", "ngram", "--k", "0"], "--k must be an integer in 1..16"),
    (["latency", NO_MODEL, "--input-len", "400", "--output-len", "200", "--max-model-len",
      "512"], "--input-len 400 + --output-len 200 is more than the context (512 tokens)"),
    (["latency", NO_MODEL, "--as-chat"], "--as-chat applies to --dataset prompts"),
    (["latency", NO_MODEL, "--batch-size", "x"], "argument --batch-size: invalid int value"),
    (["throughput", NO_MODEL, "--num-prompts", "0"], "--num-prompts must be an integer >= 1"),
    (["throughput", NO_MODEL, "--dataset", "/no/such.jsonl"],
     "--dataset '/no/such.jsonl' does not exist"),
    (["throughput", NO_MODEL, "--dataset", "/no/such.jsonl", "--input-len", "8"],
     "--input-len sets random prompts' length"),
    (["throughput", NO_MODEL, "--output-json", "/no/such/dir/r.json"],
     "--output-json '/no/such/dir/r.json': the folder '/no/such/dir' does not exist"),
    (["throughput", NO_MODEL, "--speculative-config", "{"], "--speculative-config is not valid "
                                                            "JSON"),
    (["serve", "--request-rate", "0"], "--request-rate must be > 0 (requests/s) or inf"),
    (["serve", "--request-rate", "nan"], "--request-rate must be > 0"),
    (["serve", "--max-concurrency", "0"], "--max-concurrency must be an integer >= 1"),
    (["serve", "--num-prompts", "0"], "--num-prompts must be an integer >= 1"),
    (["serve", "--base-url", "ftp://x"], "--base-url must start with http:// or https://"),
    (["serve", "--base-url", "http://x", "--port", "1"], "--base-url names the server: leave "
                                                         "out --host and --port"),
    (["serve", "--port", "70000"], "--port must be an integer in 1..65535"),
    (["serve", "--endpoint", "/v1/embeddings"], "argument --endpoint: invalid choice"),
    (["serve", "--timeout", "0"], "--timeout must be a number of seconds > 0"),
    (["serve", "--dataset", "/no/such.jsonl"], "--dataset '/no/such.jsonl' does not exist"),
    (["serve", "--client-processes", "0"], "--client-processes must be an integer >= 1"),
    (["serve", "--client-processes", "3", "--num-prompts", "2"],
     "--num-prompts 2 is less than --client-processes 3"),
    (["serve", "--client-processes", "3", "--max-concurrency", "2"],
     "--max-concurrency 2 is less than --client-processes 3"),
]


@pytest.mark.parametrize("argv,says", CASES, ids=[" ".join(c[0])[:50] for c in CASES])
def test_a_bad_flag_is_one_error_line_naming_it(argv, says, capsys):
    line = _error_line(["bench", *argv], capsys)
    assert line.startswith(says), line


def test_the_model_error_is_what_a_sound_command_line_gets(capsys, tmp_path):
    """The control: with no bad flag, NO_MODEL's own error is the one printed (so the flags'
    errors above came before the model)."""
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hi"}\n')
    for argv in (["latency", NO_MODEL], ["throughput", NO_MODEL, "--dataset", str(f)]):
        assert _error_line(["bench", *argv], capsys).startswith(f"no model at {NO_MODEL}")


def test_an_unreachable_server_is_one_error_line(capsys):
    line = _error_line(["bench", "serve", "--port", "1", "--num-prompts", "2", "--quiet"],
                       capsys)
    assert line.startswith("cannot reach the server at http://127.0.0.1:1"), line


def test_the_checks_run_without_torch_or_aiohttp():
    """The flag errors come before torch (seconds to import) and aiohttp are imported."""
    cases = [["bench", *argv] for argv, _ in CASES]
    assert exit_codes_without(cases, ("torch", "aiohttp")) == [2] * len(cases)


def test_serve_json_writes_an_unbounded_request_rate_as_inf_as_vllm_does(tmp_path):
    """bench serve's JSON spells an infinite --request-rate "inf" (vLLM's spelling), in the
    config and at the top level beside max_concurrency, as vLLM has them; a finite rate is the
    number."""
    from outpace.bench.report import write_json
    from outpace.bench.serve import ServeBenchConfig, summarize
    for rate, written in ((float("inf"), "inf"), (2.5, 2.5)):
        cfg = ServeBenchConfig(base_url="http://127.0.0.1:8000", num_prompts=1,
                               request_rate=rate, max_concurrency=4)
        write_json(str(tmp_path / "s.json"), summarize(cfg, "m", [], 1.0))
        r = json.loads((tmp_path / "s.json").read_text())
        assert r["request_rate"] == written and r["config"]["request_rate"] == written
        assert r["max_concurrency"] == 4
