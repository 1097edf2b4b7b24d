"""eval-draft through the engine (tiny target, a trained head), and the two commands' flags."""

from __future__ import annotations

import json

import pytest

from outpace.entrypoints.cli import build_parser, main
from outpace.training.config import TrainConfig
from outpace.training.evaluate import eval_draft
from outpace.training.trainer import Trainer


def test_eval_draft_reports_chain_acceptance_per_k(tiny_loaded, tiny_prompts, tmp_path):
    head = Trainer(TrainConfig(method="eagle3", target="tiny", data=str(tiny_prompts),
                               out=str(tmp_path / "h"), draft_vocab=48, answer_tokens=24,
                               batch_tokens=256, max_len=64, epochs=6, lr=3e-3, ttt_steps=3,
                               quiet=True), loaded=tiny_loaded).run()
    res = eval_draft("eagle3", str(head), "tiny", {"tiny": tiny_prompts}, ks=(1, 3),
                     max_tokens=24, max_prompts=6, device="cpu", loaded=tiny_loaded,
                     out_json=tmp_path / "e.json", out_png=tmp_path / "e.png", quiet=True)
    assert json.loads((tmp_path / "e.json").read_text()) == json.loads(json.dumps(res))
    rows = res["sets"]["tiny"]
    assert set(rows) == {"1", "3"}
    r3 = rows["3"]
    per = r3["acceptance_per_position"]
    assert len(per) == 3 and per == sorted(per, reverse=True)  # a chain: never rises
    assert r3["mean_acceptance_length"] == pytest.approx(1 + sum(per), abs=1e-3)
    assert r3["mean_acceptance_length"] > 1.5  # the trained head drafts the tiny loops
    assert (tmp_path / "e.png").stat().st_size > 1000


def test_eval_draft_cli_prints_its_result_with_quiet_too(tiny_model_dir, tiny_prompts,
                                                         tmp_path, capsys):
    """`outpace eval-draft` prints the mean acceptance length per k and where the JSON went on
    stdout; --quiet drops the progress lines on stderr, not the result."""
    target = str(tiny_model_dir)
    assert main(["init-draft", "--method", "eagle3", "--target", target, "--out",
                 str(tmp_path / "head"), "--quiet"]) == 0
    capsys.readouterr()
    outs = {}
    for quiet in (["--quiet"], []):
        out_json = tmp_path / f"e{len(quiet)}.json"
        assert main(["eval-draft", "--method", "eagle3", "--draft", str(tmp_path / "head"),
                     "--target", target, "--prompts", f"tiny={tiny_prompts}", "--k", "1", "2",
                     "--max-tokens", "4", "--max-prompts", "2", "--device", "cpu",
                     "--out", str(out_json), *quiet]) == 0
        outs[bool(quiet)] = capsys.readouterr()
        res = json.loads(out_json.read_text())
        lines = outs[bool(quiet)].out.splitlines()
        assert lines[0].startswith("mean acceptance length (eagle3, greedy, 4 tokens a prompt)")
        assert lines[1].split() == ["k", "tiny"]
        for line, k in zip(lines[2:4], ("1", "2")):
            assert line.split() == [k, f"{res['sets']['tiny'][k]['mean_acceptance_length']:.2f}"]
        assert lines[4:] == [f"results: {out_json}"]
    assert outs[True].err == ""  # --quiet: no progress
    assert "outpace: eagle3 k=2 tiny: mean acceptance length" in outs[False].err


def test_eval_draft_takes_speculative_options(tiny_model_dir, tiny_prompts, tmp_path, capsys):
    """--spec-option reaches every engine (the dtype the drafts were read in is recorded); the
    keys eval-draft sets itself are refused, naming the flag that sets them."""
    from outpace.models.cpu_fast_paths import cpu_has_bf16_dot
    target = str(tiny_model_dir)
    assert main(["init-draft", "--method", "mtp", "--target", target, "--out",
                 str(tmp_path / "head"), "--quiet"]) == 0
    base = ["eval-draft", "--method", "mtp", "--draft", str(tmp_path / "head"), "--target",
            target, "--prompts", f"tiny={tiny_prompts}", "--k", "2", "--max-tokens", "4",
            "--max-prompts", "2", "--device", "cpu", "--quiet"]
    for opts, want in (([], "bfloat16" if cpu_has_bf16_dot() else "float32"),
                       (["--spec-option", "draft_weight_dtype=float32"], "float32")):
        out_json = tmp_path / f"e{len(opts)}.json"
        assert main([*base, *opts, "--out", str(out_json)]) == 0
        assert json.loads(out_json.read_text())["draft_weights"] == want
    capsys.readouterr()
    assert main([*base, "--spec-option", "num_speculative_tokens=5"]) == 2
    assert "--spec-option num_speculative_tokens: eval-draft sets it from --k" in \
        capsys.readouterr().err


def test_train_draft_flags_reach_the_config():
    a = build_parser().parse_args(["train-draft", "--method", "mtp", "--data", "d.jsonl",
                                   "--out", "o", "--num-modules", "2", "--epochs", "3",
                                   "--lr", "1e-4", "--resume", "o", "--device", "cpu",
                                   "--max-minutes", "5"])
    assert (a.method, a.num_modules, a.epochs, a.lr, a.resume, a.max_minutes) == \
        ("mtp", 2, 3.0, 1e-4, "o", 5.0)
    assert a.loop_tokens == 64  # answers are cut 64 tokens into a loop unless told otherwise
    keep = build_parser().parse_args(["train-draft", "--method", "eagle3", "--data", "d.jsonl",
                                      "--out", "o", "--loop-tokens", "-1"])
    assert keep.loop_tokens == -1
    e = build_parser().parse_args(["eval-draft", "--method", "eagle3", "--prompts",
                                   "mt=a.jsonl", "b.jsonl", "--k", "1", "5"])
    assert e.prompts == ["mt=a.jsonl", "b.jsonl"] and e.k == [1, 5] and e.draft is None


def test_train_draft_with_a_missing_prompt_file_fails_fast(tmp_path, capsys):
    rc = main(["train-draft", "--method", "eagle3", "--data", str(tmp_path / "none.jsonl"),
               "--out", str(tmp_path / "o"), "--quiet"])
    assert rc == 2
    assert "does not exist" in capsys.readouterr().err
