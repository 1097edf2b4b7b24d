"""`outpace bench latency | throughput | serve` end to end: the first two on the tiny model (in
this process), serve against the shared `outpace serve` fixture and against a small fake
OpenAI-compatible server (another server's habits: no usage, failures)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from outpace.entrypoints.cli import main
from tests.e2e.server_helpers import API_KEY, MAX_MODEL_LEN, NUM_KV_BLOCKS

ENGINE = ["--device", "cpu", "--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-model-len",
          str(MAX_MODEL_LEN), "--quiet"]


def _run(argv, capsys) -> tuple:
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _increasing(values) -> bool:
    return all(a <= b for a, b in zip(values, values[1:]))


def test_latency_times_every_iteration(tiny_model_dir, tmp_path, capsys):
    out_json = tmp_path / "lat.json"
    rc, out, err = _run(["bench", "latency", str(tiny_model_dir), *ENGINE, "--input-len", "8",
                         "--output-len", "4", "--batch-size", "3", "--num-iters", "4",
                         "--num-iters-warmup", "1", "--output-json", str(out_json)], capsys)
    assert rc == 0, err
    r = json.loads(out_json.read_text())
    lat = r["latencies"]
    assert len(lat) == 4 and all(x > 0 for x in lat)
    pct = [r["percentiles"][p] for p in ("10", "25", "50", "75", "90", "99")]
    assert min(lat) <= pct[0] and _increasing(pct) and pct[-1] <= max(lat)
    assert r["avg_latency"] == pytest.approx(sum(lat) / 4)
    assert r["config"]["batch_size"] == 3 and r["config"]["input_len"] == 8
    assert "Avg latency (s):" in out and "P99 latency (s):" in out
    assert "Mean acceptance length" not in out and "spec" not in r


def test_throughput_counts_every_token_and_acceptance_with_speculation(tiny_model_dir, tmp_path,
                                                                       capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in
                            ("the cat sat on the mat " * 3, "one two three four " * 3,
                             "a b a b a b a b")))
    out_json = tmp_path / "tput.json"
    rc, out, err = _run(["bench", "throughput", "--model", str(tiny_model_dir), *ENGINE,
                         "--dataset", str(data), "--num-prompts", "5", "--output-len", "6",
                         "--spec", "ngram", "--k", "2", "--output-json", str(out_json)],
                        capsys)
    assert rc == 0, err
    r = json.loads(out_json.read_text())
    assert r["num_requests"] == 5
    assert r["total_output_tokens"] == 5 * 6  # the end-of-sequence token ignored
    assert r["total_prompt_tokens"] > 5 and r["elapsed_time"] > 0
    assert r["total_num_tokens"] == r["total_prompt_tokens"] + r["total_output_tokens"]
    assert r["tokens_per_second"] == pytest.approx(r["total_num_tokens"] / r["elapsed_time"])
    assert r["requests_per_second"] == pytest.approx(5 / r["elapsed_time"])
    assert r["output_tokens_per_second"] == pytest.approx(30 / r["elapsed_time"])
    spec = r["spec"]
    assert spec["num_drafts"] > 0 and 1.0 <= spec["mean_acceptance_length"] <= 3.0
    assert spec["mean_acceptance_length"] == pytest.approx(
        1 + spec["num_accepted_tokens"] / spec["num_drafts"])
    assert "Mean acceptance length:" in out and "Request throughput (req/s):" in out


def test_requests_run_in_a_closed_loop_under_max_in_flight(tiny_model_dir):
    """offline.run_requests with max_in_flight: never more requests in the engine than that,
    the next given as one finishes; each step timed; outputs in prompt order."""
    from outpace.bench import offline
    from outpace.engine.engine import LLMEngine
    from outpace.types import SamplingParams
    engine = LLMEngine.from_args(str(tiny_model_dir), device="cpu", max_model_len=MAX_MODEL_LEN,
                                 num_kv_blocks=NUM_KV_BLOCKS, quiet=True)
    prompts = [[5 + i, 6, 7 + i] for i in range(5)]
    params = SamplingParams(max_tokens=3, ignore_eos=True, output_kind="final_only")
    steps, finished_at = [], {}

    def on_finished(out):  # the step it finished in (steps has that step's time by then)
        finished_at[out.request_id] = len(steps)

    seconds, outs = offline.run_requests(engine, prompts, params, tag="loop",
                                         on_finished=on_finished, max_in_flight=2,
                                         step_times=steps)
    assert [o.request_id for o in outs] == [f"loop-{i}" for i in range(5)]
    assert all(len(o.token_ids) == 3 for o in outs)
    # alike requests two at a time: two finish together, then the next two, then the last
    at = [finished_at[f"loop-{i}"] for i in range(5)]
    assert at[0] == at[1] < at[2] == at[3] < at[4] == len(steps)
    assert 0 < sum(steps) <= seconds
    with pytest.raises(ValueError, match="max_in_flight"):
        offline.run_requests(engine, prompts, params, tag="zero", max_in_flight=0)


def test_throughput_of_random_prompts_as_chat_refused(tiny_model_dir, capsys):
    """--as-chat with random token prompts is refused (they are ids, not text)."""
    rc = main(["bench", "throughput", str(tiny_model_dir), *ENGINE, "--as-chat"])
    assert rc == 2 and "--as-chat applies to --dataset prompts" in capsys.readouterr().err


def _check_serve_result(r: dict, n: int, output_len: int) -> None:
    assert r["completed"] == n and r["failed"] == 0 and r["num_prompts"] == n
    assert r["total_output_tokens"] == n * output_len and r["total_input_tokens"] > 0
    assert r["duration"] > 0
    assert r["output_throughput"] == pytest.approx(n * output_len / r["duration"])
    for m in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < r[f"median_{m}_ms"] <= r[f"p99_{m}_ms"], m
        assert r[f"mean_{m}_ms"] > 0
    assert r["mean_ttft_ms"] < r["mean_e2el_ms"]


def test_serve_against_an_outpace_server(server, tmp_path, capsys):
    out_json = tmp_path / "serve.json"
    rc, out, err = _run(["bench", "serve", "--base-url", server.url + "/v1", "--api-key",
                         API_KEY, "--num-prompts", "6", "--max-concurrency", "3",
                         "--input-len", "12", "--output-len", "8", "--ignore-eos", "--quiet",
                         "--output-json", str(out_json)], capsys)
    assert rc == 0, err
    r = json.loads(out_json.read_text())
    _check_serve_result(r, 6, 8)
    assert r["model"] == server.model  # the first of /v1/models
    assert r["config"]["request_rate"] == r["request_rate"] == "inf"  # as vLLM writes it
    assert "api_key" not in r["config"]
    assert "Mean TTFT (ms):" in out and "Failed requests:" in out


def test_serve_chat_endpoint_at_a_request_rate_from_a_dataset(server, tmp_path, capsys):
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps([{"conversations": [{"from": "human", "value": f"question {i}"},
                                                   {"from": "gpt", "value": "answer"}]}
                                for i in range(3)]))
    out_json = tmp_path / "chat.json"
    rc, _, err = _run(["bench", "serve", "--base-url", server.url, "--api-key", API_KEY,
                       "--endpoint", "/v1/chat/completions", "--dataset", str(data),
                       "--num-prompts", "4", "--request-rate", "40", "--output-len", "5",
                       "--ignore-eos", "--model", server.model, "--quiet",
                       "--output-json", str(out_json)], capsys)
    assert rc == 0, err
    _check_serve_result(json.loads(out_json.read_text()), 4, 5)


def test_serve_without_the_key_is_one_error_line(server, capsys):
    rc = main(["bench", "serve", "--base-url", server.url, "--num-prompts", "1", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("outpace: error: the server at") and "--api-key" in err[0]


class _FakeOpenAI(BaseHTTPRequestHandler):
    """Another server's habits: no usage in the stream (tokens are then counted per chunk),
    `data:` without a space, and a 500 for a prompt that says `fail`."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        self._send(200, b'{"data": [{"id": "fake-model"}]}', "application/json")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if "fail" in body["prompt"]:
            self._send(500, b'{"error": {"message": "boom"}}', "application/json")
            return
        assert body["model"] == "fake-model" and body["stream"] is True
        chunks = [{"choices": [{"text": f"t{i}", "finish_reason": None}]}
                  for i in range(body["max_tokens"])]
        chunks[-1]["choices"][0]["finish_reason"] = "length"
        self._send(200, "".join(f"data:{json.dumps(c)}\n\n" for c in chunks).encode()
                   + b"data: [DONE]\n\n", "text/event-stream")

    def _send(self, status, data: bytes, ctype: str):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def fake_server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _FakeOpenAI)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield httpd.server_address[1]
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_serve_counts_chunks_without_usage_and_failed_requests(fake_server, tmp_path, capsys):
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "fine"}\n{"prompt": "please fail"}\n{"prompt": "also fine"}\n')
    out_json = tmp_path / "fake.json"
    rc, out, err = _run(["bench", "serve", "--port", str(fake_server), "--dataset", str(data),
                         "--num-prompts", "6", "--output-len", "4", "--quiet",
                         "--output-json", str(out_json)], capsys)
    assert rc == 1  # some requests failed
    r = json.loads(out_json.read_text())
    assert r["model"] == "fake-model"
    assert r["completed"] == 4 and r["failed"] == 2 and r["num_prompts"] == 6
    assert r["total_output_tokens"] == 4 * 4 and r["total_input_tokens"] == 0
    assert all(e.startswith("HTTP 500") for e in r["errors"]) and len(r["errors"]) == 2
    assert "failed request: HTTP 500" in err
    assert _increasing([r["median_itl_ms"], r["p99_itl_ms"]])
