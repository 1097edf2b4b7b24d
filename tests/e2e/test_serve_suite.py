"""benchmarks/serve.py --start-server (the serving suite, benchmarks/serve_suite.py) end to end
on the tiny model: one config, concurrency 1 and 2, its own `outpace serve` started and
stopped, the offline engine after it. Checks the result's keys, that each ratio is the two
measured numbers' and each rate its own tokens over its own time, that both sides had the same
prompt tokens, and that no process of the suite's is left afterwards; and that bad flags are
refused before anything starts."""

from __future__ import annotations

import json
import os
import signal

import pytest

from benchmarks.serve import main
from outpace.bench.server_metrics import PHASES, TTFT_SUM
from tests.e2e.server_helpers import MAX_MODEL_LEN, NUM_KV_BLOCKS

ROW_KEYS = {"config", "concurrency", "server_output_tok_s", "offline_output_tok_s", "ratio",
            "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "offline_step_ms", "tpot_step_ratio",
            "offline_tpot_p50_ms", "startup_ready_s", "startup_first_token_s", "failed",
            "server_prompt_tokens", "offline_prompt_tokens", "prompt_tokens_match",
            "server_output_tokens", "offline_output_tokens", "server_duration_s",
            "offline_duration_s", "offline_spec", "ttft_mean_ms", "e2el_mean_ms",
            "server_ttft_mean_ms", "server_e2e_mean_ms", "server_phase_mean_ms",
            "client_cpu_s", "client_cpu_busiest"}


def _running(pid: int) -> bool:
    """Whether a process of that id, or of its process group, is still there."""
    for probe in (os.kill, os.killpg):
        try:
            probe(pid, 0)
            return True
        except ProcessLookupError:
            pass
    return False


def _kill_left(pids) -> None:
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_suite_compares_its_own_server_with_the_offline_engine(tiny_model_dir, tmp_path,
                                                               server_mode_args, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the children's: the tiny model's tiny ops
    out = tmp_path / "suite.json"
    argv = ["--start-server", str(tiny_model_dir), "--device", "cpu", "--configs", "no-spec",
            "--concurrency", "1", "2", "--num-prompts", "2", "--output-len", "4",
            "--out", str(out), "--log-dir", str(tmp_path / "logs"),
            "--", "--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-model-len", str(MAX_MODEL_LEN),
            *server_mode_args]
    pids = []
    try:
        rc = main(argv)
        r = json.loads(out.read_text())
        rec = r["configs"]["no-spec"]
        assert "error" not in rec, rec.get("error")
        pids = [rec["server"]["pid"], *rec["offline"]["pids"]]
        # nothing of the suite's outlives it: the server's process group ended before the
        # offline engines ran, and those are gone too
        assert not any(_running(pid) for pid in pids)
        assert rec["server"]["returncode"] is not None and not rec["server"]["group_left"]
        assert len(rec["offline"]["pids"]) == 2  # an engine per concurrency
        # the server's start-up line by line, in the order and at the times the suite saw them:
        # the line that says it serves came before /health answered
        timeline = rec["server"]["startup_timeline"]
        assert [t for t, _ in timeline] == sorted(t for t, _ in timeline)
        serving = [t for t, line in timeline if line.startswith("outpace: serving")]
        assert len(serving) == 1 and 0 < serving[0] <= rec["server"]["startup_ready_s"] + 0.2
        assert rc == 0
    finally:
        _kill_left(pids)

    assert r["config"]["concurrency"] == [1, 2] and r["config"]["num_prompts"] == {"1": 2,
                                                                                   "2": 2}
    rows = r["rows"]
    assert [(x["config"], x["concurrency"]) for x in rows] == [("no-spec", 1), ("no-spec", 2)]
    for row in rows:
        assert set(row) == ROW_KEYS
        c = str(row["concurrency"])
        load, off = rec["server"]["load"][c], rec["offline"]["runs"][c]
        # each rate is its own side's tokens over its own time; the ratio is server / offline
        assert row["server_output_tok_s"] == load["output_throughput"] == pytest.approx(
            row["server_output_tokens"] / row["server_duration_s"])
        assert row["offline_output_tok_s"] == off["output_throughput"] == pytest.approx(
            row["offline_output_tokens"] / row["offline_duration_s"])
        assert row["ratio"] == pytest.approx(row["server_output_tok_s"]
                                             / row["offline_output_tok_s"])
        assert row["tpot_step_ratio"] == pytest.approx(row["tpot_p50_ms"]
                                                       / row["offline_step_ms"])
        assert row["ttft_p50_ms"] == load["median_ttft_ms"] and \
            row["ttft_p99_ms"] == load["p99_ttft_ms"] >= row["ttft_p50_ms"] > 0
        assert row["offline_step_ms"] == off["median_step_ms"] > 0
        # every request made --output-len tokens, on both sides, from the same prompt tokens
        assert row["failed"] == 0 and load["completed"] == off["num_requests"] == 2
        assert row["server_output_tokens"] == row["offline_output_tokens"] == 2 * 4
        assert row["server_prompt_tokens"] == row["offline_prompt_tokens"] > 2
        assert row["prompt_tokens_match"] is True
        assert 0 < row["startup_ready_s"] <= row["startup_first_token_s"]
        assert row["startup_first_token_s"] == rec["server"]["startup_first_token_s"]
        # the server's own means over the run (its /metrics before and after): its TTFT within
        # the client's, its phases adding up to it
        ph = row["server_phase_mean_ms"]
        assert list(ph) == [p for p, _ in PHASES] and all(v >= 0 for v in ph.values()), ph
        assert 0 < row["server_ttft_mean_ms"] <= row["ttft_mean_ms"] == load["mean_ttft_ms"]
        assert sum(ph[p] for p in TTFT_SUM) == pytest.approx(row["server_ttft_mean_ms"],
                                                                  abs=0.1)
        assert 0 < row["server_e2e_mean_ms"] <= row["e2el_mean_ms"]
        assert row["client_cpu_s"] > 0 and 0 < row["client_cpu_busiest"] < 2


@pytest.mark.parametrize("args, message", [
    (["--configs", "no-spec,foo-k2"], "'foo-k2' is not no-spec or METHOD-kN"),
    (["--concurrency", "1", "0"], "--concurrency must be an integer >= 1"),
    (["--", "--port", "9000"], "--port after `--`: the suite picks"),
    (["--", "--spec", "ngram"], "--spec after `--`: speculation is given by --configs"),
    (["--", "--no-such-flag"], "--no-such-flag is no flag of `outpace serve`"),
    (["--configs", "ngram-k0"], "--k must be an integer"),
])
def test_suite_flags_refused_before_anything_starts(tiny_model_dir, tmp_path, capsys, args,
                                                    message):
    rc = main(["--start-server", str(tiny_model_dir), "--device", "cpu", "--log-dir",
               str(tmp_path / "logs"), *args])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("serve.py: error: ") and message in err, err
    assert not (tmp_path / "logs").exists()  # refused before a log, a server or an engine
