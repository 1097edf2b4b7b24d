"""Engine-level behaviour of speculative decoding: per-request and global stats, draft-head
validation at load, draft length (schedule by batch size, adaptive), forced acceptance, the
suffix enhancer of neural heads, and the CLI's --spec-stats."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from outpace import SamplingParams
from outpace.errors import ConfigError, ModelLoadError
from outpace.models.draft_loader import model_config_dict
from outpace.training.init_draft import init_draft
from tests.engine_helpers import make_engine
from tests.speculative.spec_helpers import TINY_BLOCK, repetitive_prompts, run_waves, tiny_config

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
KW = dict(block_size=TINY_BLOCK, max_num_batched_tokens=32)


def eagle3(heads, k, **opts):
    return {"method": "eagle3", "model": str(heads["eagle3"]), "num_speculative_tokens": k, **opts}


class StepLog:
    """Records, per step, each scheduled request's drafts, output growth and batch size."""

    def __init__(self, engine):
        self.steps = []  # [(batch size, {rid: (num drafts, tokens gained)})]
        inner_schedule, inner_step = engine.scheduler.schedule, engine.step

        def schedule():
            plan = inner_schedule()
            self._before = {sr.request.request_id: (len(sr.draft_token_ids),
                                                    len(sr.request.output_token_ids), sr.request)
                            for sr in plan.scheduled if sr.sample}
            self._size = len(plan.scheduled)
            return plan

        def step():
            self._before, self._size = {}, 0
            outs = inner_step()
            self.steps.append((self._size, {rid: (nd, len(req.output_token_ids) - n0)
                                            for rid, (nd, n0, req) in self._before.items()}))
            return outs

        engine.scheduler.schedule, engine.step = schedule, step


def logged_run(loaded, prompts, params, **kwargs):
    rec = {}
    run = run_waves(loaded, [prompts], params, on_engine=lambda e: rec.setdefault(
        "log", StepLog(e)), **kwargs)
    run.log = rec["log"]
    return run


# ---- stats -----------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_spec_stats_per_request_match_the_steps_and_sum_to_the_engine(tiny_loaded, tiny_heads,
                                                                      method):
    spec = ({"method": "ngram", "num_speculative_tokens": 4} if method == "ngram"
            else eagle3(tiny_heads, 4, enhancer_min_match=2))
    run = logged_run(tiny_loaded, repetitive_prompts(5, 11), GREEDY, speculative_config=spec,
                     **KW)
    total = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
             "accepted_per_position": [0] * 4}
    for i, o in enumerate(run.outs):
        s = o.spec_stats
        # independent count from the steps: a verify step of d drafts that gained g tokens
        # accepted g - 1 of them
        steps = [rids[o.request_id] for _, rids in run.log.steps
                 if o.request_id in rids and rids[o.request_id][0] > 0]
        assert s.num_drafts == len(steps) > 0
        assert s.num_draft_tokens == sum(d for d, _ in steps)
        assert s.num_accepted_tokens == sum(g - 1 for _, g in steps)
        want_per_pos = [sum(g - 1 > j for _, g in steps) for j in range(4)]
        assert s.accepted_per_position + [0] * (4 - len(s.accepted_per_position)) == want_per_pos
        assert s.mean_acceptance_length == pytest.approx(1 + s.num_accepted_tokens / s.num_drafts)
        assert s.acceptance_rate == pytest.approx(s.num_accepted_tokens / s.num_draft_tokens)
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            total[key] += getattr(s, key)
        for j, v in enumerate(s.accepted_per_position):
            total["accepted_per_position"][j] += v
    g = run.stats["spec"]
    assert total["num_accepted_tokens"] > 0
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert g[key] == total[key], key
    assert g["accepted_per_position"] == total["accepted_per_position"]
    assert g["mean_acceptance_length"] == pytest.approx(
        1 + total["num_accepted_tokens"] / total["num_drafts"])
    # non-spec engines report empty stats
    plain = run_waves(tiny_loaded, [repetitive_prompts(1, 11)], GREEDY, **KW)
    assert plain.stats["spec"]["num_drafts"] == 0
    assert plain.outs[0].spec_stats.mean_acceptance_length == 1.0


# ---- draft heads that don't fit the target ---------------------------------------------------


def head_for(tmp_path, method, name, **over):
    cfg = tiny_config()
    d = model_config_dict(cfg)
    d.update(over)
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(d))
    return init_draft(method, str(folder), tmp_path / f"{name}-{method}", quiet=True)


@pytest.mark.parametrize("method,over,needles", [
    ("eagle3", {"hidden_size": 32, "head_dim": 8}, ["hidden_size=32", "hidden_size=64"]),
    ("mtp", {"hidden_size": 32, "head_dim": 8}, ["hidden_size=32", "hidden_size=64"]),
    ("eagle3", {"vocab_size": 100}, ["vocab_size=100", "another tokenizer"]),
    ("mtp", {"vocab_size": 100}, ["vocab_size=100", "another tokenizer"]),
    ("eagle3", {"num_hidden_layers": 12}, ["outside the target's 4 layers", "deeper model"]),
    ("mtp", {"num_key_value_heads": 4}, ["num_key_value_heads=4", "KV pool"]),
])
def test_draft_head_that_does_not_fit_the_target_fails_at_load(tiny_loaded, tmp_path, method,
                                                               over, needles):
    head = head_for(tmp_path, method, "other", **over)
    with pytest.raises(ModelLoadError) as e:
        make_engine(tiny_loaded, speculative_config={"method": method, "model": str(head),
                                                     "num_speculative_tokens": 3})
    for needle in needles:
        assert needle in str(e.value), str(e.value)


def test_missing_head_folder_and_unknown_option_fail_at_build(tiny_loaded, tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        make_engine(tiny_loaded, speculative_config={"method": "eagle3",
                                                     "model": str(tmp_path / "nope")})
    with pytest.raises(ConfigError, match="unknown speculative option"):
        make_engine(tiny_loaded, speculative_config={"method": "ngram", "lookahead": 3})
    with pytest.raises(ConfigError, match="k_schedule"):
        make_engine(tiny_loaded, speculative_config={"method": "ngram", "k_schedule": [[0, 9]]})


# ---- draft length ----------------------------------------------------------------------------


def test_k_schedule_by_batch_size(tiny_loaded):
    """[[1, 4], [2, 1]]: alone k=4, two running k=1, three or more: no drafts at all."""
    prompts = repetitive_prompts(3, 12)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
              for n in (10, 22, 44)]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "k_schedule": [[1, 4], [2, 1]]}
    run = logged_run(tiny_loaded, prompts, params, speculative_config=spec, **KW)
    seen = {}
    # drafts verified in step i+1 were proposed after step i, for step i's batch size
    for (size, _), (_, nxt) in zip(run.log.steps, run.log.steps[1:]):
        for nd, _ in nxt.values():
            seen.setdefault(size, set()).add(nd)
    assert seen[3] == {0}, seen
    assert seen[2] <= {0, 1} and 1 in seen[2], seen
    assert max(seen[1]) == 4, seen
    want = run_waves(tiny_loaded, [prompts], params, **KW).outputs
    assert run.outputs == want


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_k_schedule_counts_waiting_requests(tiny_loaded, tiny_heads, method):
    """Four requests, max_num_seqs=4, a token budget that schedules two a step at first, under
    [[2, 4]]: while more than two run or wait the load is above 2, so nothing is drafted,
    although a ramp-up step holds at most 2 requests (drafting then would be verified at the
    batch the queue is about to fill). Once two or fewer remain, k = 4 again. Outputs equal the
    plain engine's."""
    prompts = repetitive_prompts(4, 12)  # 18..21 tokens: a 20-token budget prefills one and
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
              for n in (8, 12, 30, 40)]
    spec = schedule_spec(method, tiny_heads, [[2, 4]])
    steps = []  # (plan load, planned requests, drafts per request)
    kw = {**KW, "max_num_batched_tokens": 20}  # a chunk of the next a step
    run = run_waves(tiny_loaded, [prompts], params, on_engine=record_plans(steps),
                    max_num_seqs=4, speculative_config=spec, **kw)
    assert any(load > 2 and n <= 2 for load, n, _ in steps), steps  # the queue was seen
    for (load, _, _), (_, _, drafts) in zip(steps, steps[1:]):
        if load > 2:  # drafts verified next were proposed for this step's load
            assert not any(drafts), steps
    assert any(max(d, default=0) == 4 for _, _, d in steps), steps  # drafting came back
    want = run_waves(tiny_loaded, [prompts], params, max_num_seqs=4, **kw).outputs
    assert run.outputs == want


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_k_schedule_load_stops_at_max_num_seqs(tiny_loaded, tiny_heads, method):
    """max_num_seqs=2 under [[2, 4]] with four requests: two wait, but the decode batch can
    never pass 2, so the load is 2 and the running requests draft k = 4 while the others wait.
    Outputs equal the plain engine's."""
    prompts = repetitive_prompts(4, 12)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    steps = []
    run = run_waves(tiny_loaded, [prompts], params, on_engine=record_plans(steps),
                    max_num_seqs=2, speculative_config=schedule_spec(method, tiny_heads,
                                                                     [[2, 4]]), **KW)
    assert all(load <= 2 for load, _, _ in steps), steps
    engine = run.engine
    assert engine.scheduler.num_waiting == 0
    # some step drafted 4 while requests still waited (their prefill came later)
    drafted_early = [i for i, (_, _, d) in enumerate(steps) if max(d, default=0) == 4]
    assert drafted_early and drafted_early[0] < len(steps) // 2, steps
    want = run_waves(tiny_loaded, [prompts], params, max_num_seqs=2, **KW).outputs
    assert run.outputs == want


def schedule_spec(method: str, heads, schedule: list) -> dict:
    opts = {"k_schedule": schedule}
    return ({"method": "ngram", "num_speculative_tokens": 4, **opts} if method == "ngram"
            else eagle3(heads, 4, **opts))


def record_plans(steps: list):
    """on_engine for run_waves: each planned step's (load, requests, drafts per request) into
    `steps`."""
    def record(engine):
        inner = engine.scheduler.schedule

        def schedule():
            plan = inner()
            steps.append((plan.load, len(plan.scheduled),
                          [len(sr.draft_token_ids) for sr in plan.scheduled]))
            return plan
        engine.scheduler.schedule = schedule
    return record


def draft_lengths(run, rid="w0-0"):
    return [rids[rid][0] for _, rids in run.log.steps if rid in rids and rids[rid][0]]


def test_adaptive_k_shrinks_on_rejection_and_grows_on_full_acceptance(tiny_loaded, tiny_heads):
    """Random head: every draft rejected, so k steps down 4, 3, 2, 1 and stays at 1. Then the
    test switches to forced full acceptance: k steps back up to 4."""
    spec = eagle3(tiny_heads, 4, adaptive=True)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    switched = {}

    def after_step(engine):
        log = switched["log"]
        lens = [rids["w0-0"][0] for _, rids in log.steps if rids.get("w0-0", (0,))[0]]
        if not switched.get("on") and lens[-3:] == [1, 1, 1]:
            engine.runner.sampling.force_accept_mean = 10.0  # accept everything from now on
            switched["on"] = True

    run = run_waves(tiny_loaded, [repetitive_prompts(1, 13)], params, after_step=after_step,
                    on_engine=lambda e: switched.setdefault("log", StepLog(e)),
                    speculative_config=spec, **KW)
    run.log = switched["log"]
    lens = draft_lengths(run)
    assert lens[:5] == [4, 3, 2, 1, 1], lens
    up = lens[lens.index(1) + 3:]
    assert up[:4] == [1, 2, 3, 4] or up[:4] == [2, 3, 4, 4], lens
    # without `adaptive` the same head keeps drafting 4
    fixed = logged_run(tiny_loaded, repetitive_prompts(1, 13), params,
                       speculative_config=eagle3(tiny_heads, 4), **KW)
    assert set(draft_lengths(fixed)[:-3]) == {4}


# ---- forced acceptance (benchmarks) ----------------------------------------------------------


@pytest.mark.parametrize("mean", [2.0, 2.5, 3.0, 4.2])
def test_force_accept_mean_gives_the_requested_acceptance_length(tiny_loaded, tiny_heads, mean):
    params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    run = run_waves(tiny_loaded, [repetitive_prompts(4, 14)], params,
                    speculative_config=eagle3(tiny_heads, 4, force_accept_mean=mean), **KW)
    s = run.stats["spec"]
    print(f"\nforce_accept_mean={mean}: measured {s['mean_acceptance_length']:.3f} "
          f"over {s['num_drafts']} verify steps")
    assert s["num_drafts"] >= 60
    assert abs(s["mean_acceptance_length"] - mean) < 0.3, s


# ---- the suffix enhancer ---------------------------------------------------------------------


def test_suffix_enhancer_raises_acceptance_of_a_random_head(tiny_loaded, tiny_heads):
    prompts = repetitive_prompts(4, 15, period=8, repeats=3)
    want = run_waves(tiny_loaded, [prompts], GREEDY, **KW).outputs
    alone = run_waves(tiny_loaded, [prompts], GREEDY, speculative_config=eagle3(tiny_heads, 4),
                      **KW)
    enhanced = run_waves(tiny_loaded, [prompts], GREEDY,
                         speculative_config=eagle3(tiny_heads, 4, enhancer_min_match=2), **KW)
    a, e = alone.stats["spec"], enhanced.stats["spec"]
    print(f"\nrandom EAGLE-3 head alone: mean acceptance length "
          f"{a['mean_acceptance_length']:.2f}; with the suffix enhancer "
          f"{e['mean_acceptance_length']:.2f}")
    assert alone.outputs == want and enhanced.outputs == want
    assert a["num_drafts"] > 50 and e["mean_acceptance_length"] > a["mean_acceptance_length"] + 0.3


# ---- the CLI ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_generate_prints_spec_stats(default_model_path):
    cmd = [sys.executable, "-m", "outpace.entrypoints.cli", "generate",
           "Repeat this sentence twice: the quick brown fox jumps over the lazy dog.",
           "--model", str(default_model_path), "--device", "cpu", "--dtype", "float32",
           "--spec", "ngram", "--k", "3", "--spec-stats", "--max-tokens", "40", "--quiet"]
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert proc.returncode == 0, proc.stderr
    assert "quick brown fox" in proc.stdout
    m = re.search(r"mean acceptance length ([\d.]+), drafts (\d+), draft tokens (\d+), "
                  r"accepted (\d+), acceptance per position \[([\d., ]+)\]", proc.stderr)
    assert m, proc.stderr
    mal, drafts, draft_tokens, accepted = (float(m[1]), int(m[2]), int(m[3]), int(m[4]))
    per_pos = [float(x) for x in m[5].split(",")]
    print(f"\nCLI: {proc.stderr.strip()}")
    assert drafts > 0 and accepted > 0 and draft_tokens <= 3 * drafts
    assert mal == pytest.approx(1 + accepted / drafts, abs=0.006)
    assert len(per_pos) == 3 and sum(per_pos) == pytest.approx(accepted / drafts, abs=0.02)
