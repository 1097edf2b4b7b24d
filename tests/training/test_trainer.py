"""train-draft on the tiny target: the loss falls, a resumed run continues bit for bit, options
and checkpoints that can't work fail with errors that say what to change."""

from __future__ import annotations

import json

import pytest
import torch

from outpace.errors import ConfigError
from outpace.training.config import TrainConfig
from outpace.training.trainer import TimeBudget, Trainer, lr_at


def _cfg(tiny_prompts, tmp_path, out, **kw):
    base = dict(method="eagle3", target="tiny", data=str(tiny_prompts), out=str(tmp_path / out),
                draft_vocab=48, answer_tokens=24, batch_tokens=256, max_len=64, epochs=2,
                lr=3e-3, data_cache=str(tmp_path / "answers.jsonl"), quiet=True, save_every=4,
                ttt_steps=3)
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.parametrize("method,modules", [("eagle3", 1), ("mtp", 1), ("mtp", 2)])
def test_training_lowers_the_loss(tiny_loaded, tiny_prompts, tmp_path, method, modules):
    kw = dict(method=method, num_modules=modules, epochs=4)
    if method == "mtp":
        kw.update(draft_vocab=None, ttt_steps=None if modules > 1 else 2)
    tr = Trainer(_cfg(tiny_prompts, tmp_path, "h", **kw), loaded=tiny_loaded)
    first = tr.batches[0]
    before, _, acc0, _ = tr.losses(tr.seqs, first, grad=False)
    while tr.step < tr.total:
        tr.train_step()
    after, _, accs, _ = tr.losses(tr.seqs, first, grad=False)
    assert float(after) < 0.5 * float(before), (float(before), float(after))
    assert all(a > b + 0.1 for a, b in zip(accs, acc0)), (acc0, accs)


def _final_weights(tr):
    return {k: v.clone() for k, v in tr.head.state_dict().items()}


def test_resume_continues_bit_identically(tiny_loaded, tiny_prompts, tmp_path):
    whole = Trainer(_cfg(tiny_prompts, tmp_path, "whole", epochs=3), loaded=tiny_loaded)
    whole.run()
    want = _final_weights(whole)
    # the stop below falls mid-run, past an epoch's end
    assert whole.step == whole.total >= 2 * len(whole.batches) + 2
    cut = Trainer(_cfg(tiny_prompts, tmp_path, "cut", epochs=3), loaded=tiny_loaded)
    cut.run(max_steps=whole.total // 2 + 1)  # stops as a killed run would, after a checkpoint
    again = Trainer(_cfg(tiny_prompts, tmp_path, "cut", epochs=3,
                         resume=str(tmp_path / "cut")), loaded=tiny_loaded)
    assert again.step == whole.total // 2 + 1
    again.run()
    got = _final_weights(again)
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    # the exported heads are the same files
    a = (tmp_path / "whole" / "model.safetensors").read_bytes()
    assert a == (tmp_path / "cut" / "model.safetensors").read_bytes()
    report = json.loads((tmp_path / "cut" / "training.json").read_text())
    assert report["steps"] == whole.total


def test_resume_refuses_other_options_and_missing_checkpoints(tiny_loaded, tiny_prompts,
                                                              tmp_path):
    tr = Trainer(_cfg(tiny_prompts, tmp_path, "a"), loaded=tiny_loaded)
    tr.run(max_steps=2)
    with pytest.raises(ConfigError, match="ttt_steps 3 there, 2 now"):
        Trainer(_cfg(tiny_prompts, tmp_path, "a", ttt_steps=2, resume=str(tmp_path / "a")),
                loaded=tiny_loaded)
    with pytest.raises(ConfigError, match="not a checkpoint"):
        Trainer(_cfg(tiny_prompts, tmp_path, "b", resume=str(tmp_path / "nothing")),
                loaded=tiny_loaded)


@pytest.mark.parametrize("kw,msg", [
    (dict(method="medusa"), "--method 'medusa' is unknown"),
    (dict(method="mtp", draft_vocab=100), "--draft-vocab applies to EAGLE-3 only"),
    (dict(num_modules=2), "--num-modules applies to MTP only"),
    (dict(method="mtp", draft_vocab=None, num_modules=3, ttt_steps=2), "--ttt-steps must be 3"),
    (dict(ttt_steps=0), "--ttt-steps must be in 1..16"),
    (dict(epochs=0), "--epochs must be > 0"),
    (dict(max_len=64, batch_tokens=32), "--batch-tokens >= --max-len"),
    (dict(samples=1, temperature=0.0), "sampled answers need --temperature > 0"),
    (dict(export_dtype="int4"), "--export-dtype must be one of"),
    (dict(aux_layers=(0, 1)), "--aux-layers takes 3 target layer indices"),
    (dict(aux_layers=(0, -1, 1)), "--aux-layers takes 3 target layer indices"),
    (dict(method="mtp", draft_vocab=None, aux_layers=(0, 1, 1)),
     "--aux-layers applies to EAGLE-3 only"),
])
def test_bad_options_name_the_flag(tiny_prompts, tmp_path, kw, msg):
    with pytest.raises(ConfigError, match=msg):
        _cfg(tiny_prompts, tmp_path, "x", **kw)


def test_aux_layers_reach_the_head_its_export_and_resume(tiny_loaded, tiny_prompts, tmp_path):
    n = tiny_loaded[1].num_hidden_layers
    last = (0, n // 2, n - 1)  # the last layer's output, which the default never reads
    tr = Trainer(_cfg(tiny_prompts, tmp_path, "a", aux_layers=last), loaded=tiny_loaded)
    assert tr.capture == last and tuple(tr.head.aux_layer_ids) == last
    out = tr.run()
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(last)
    again = Trainer(_cfg(tiny_prompts, tmp_path, "a", aux_layers=last,
                         resume=str(tmp_path / "a")), loaded=tiny_loaded)
    assert again.step == tr.total
    with pytest.raises(ConfigError, match="aux_layers"):
        Trainer(_cfg(tiny_prompts, tmp_path, "a", resume=str(tmp_path / "a")),
                loaded=tiny_loaded)
    with pytest.raises(ConfigError, match=f"each in 0..{n - 1}"):
        Trainer(_cfg(tiny_prompts, tmp_path, "b", aux_layers=(0, 1, n)), loaded=tiny_loaded)


def test_bad_data_is_a_clear_error(tiny_loaded, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": \n')
    with pytest.raises(ConfigError, match="bad.jsonl:2 is not valid JSON"):
        Trainer(_cfg(bad, tmp_path, "x"), loaded=tiny_loaded)
    with pytest.raises(ConfigError, match="does not exist"):
        Trainer(_cfg(tmp_path / "missing.jsonl", tmp_path, "x"), loaded=tiny_loaded)
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is a file"):
        Trainer(_cfg(bad, tmp_path, "file"), loaded=tiny_loaded)


def test_schedule_warms_up_then_decays_to_the_floor():
    cfg = TrainConfig(method="eagle3", target="t", data="d", out="o", lr=1.0, min_lr_ratio=0.1)
    lrs = [lr_at(s, cfg, 100, 10) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[-1] == pytest.approx(0.1, abs=1e-3)


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_time_budget_follows_the_steps_actually_timed():
    clock = _Clock()
    b = TimeBudget(100.0, start_step=10, skip=2, min_timed=4, clock=clock)
    step = 10
    got = []
    # two slow warm-up steps (untimed), then 1 s steps: 100 s hold ~ 2 + 10 s warm-up ... steps
    for dt in [5.0, 5.0] + [1.0] * 6:
        clock.now += dt
        step += 1
        got.append(b.total(step, planned=10_000))
    assert got[:5] == [None] * 5  # warm-up, then fewer than 4 timed steps
    # 6 timed steps at 1 s, 84 s left -> 84 more steps
    assert got[-1] == step + 84 and b.per_step == pytest.approx(1.0)
    # the steps slow down: the estimate follows them (planned caps it)
    for _ in range(4):
        clock.now += 5.0
        step += 1
    slower = b.total(step, planned=10_000)
    assert step < slower < got[-1]
    assert b.total(step, planned=step + 3) == step + 3
    # past the budget: stop now
    clock.now = 100.0
    assert b.total(step + 1, planned=10_000) == step + 1


def test_a_time_budget_ends_the_run_with_an_export(tiny_loaded, tiny_prompts, tmp_path):
    tr = Trainer(_cfg(tiny_prompts, tmp_path, "b", epochs=1000, max_minutes=0.05),
                 loaded=tiny_loaded)
    assert tr.total == tr.planned
    out = tr.run()
    assert tr.step < tr.planned and tr.total == tr.step
    info = json.loads((out / "training.json").read_text())
    assert info["steps"] == tr.step and info["train_seconds"] < 10


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_init_head_starts_from_the_exported_head(tiny_loaded, tiny_prompts, tmp_path, method):
    kw = dict(method=method) if method == "eagle3" else dict(method=method, draft_vocab=None)
    first = Trainer(_cfg(tiny_prompts, tmp_path, "first", export_dtype="float32", epochs=1,
                         **({"aux_layers": (0, 1, 1)} if method == "eagle3" else {}),
                         **kw), loaded=tiny_loaded)
    first.run()
    # the new run takes the head's weights (and draft vocabulary, aux layers), not its own seed's
    again = Trainer(_cfg(tiny_prompts, tmp_path, "again", init_head=str(tmp_path / "first"),
                         **kw), loaded=tiny_loaded)
    fresh = Trainer(_cfg(tiny_prompts, tmp_path, "fresh", **kw), loaded=tiny_loaded)
    batch = first.batches[0]
    want, _, want_acc, _ = first.losses(first.seqs, batch, grad=False)
    got, _, got_acc, _ = again.losses(again.seqs, batch, grad=False)
    base, _, _, _ = fresh.losses(fresh.seqs, batch, grad=False)
    assert torch.allclose(got, want, rtol=1e-5), (float(got), float(want))
    assert got_acc == want_acc
    assert abs(float(base) - float(want)) > 1e-3  # the check can tell heads apart
    if method == "eagle3":
        assert torch.equal(again.head.d2t, first.head.d2t)
        assert tuple(again.head.aux_layer_ids) == (0, 1, 1)
        with pytest.raises(ConfigError, match="--draft-vocab 32 is smaller"):
            Trainer(_cfg(tiny_prompts, tmp_path, "bad", init_head=str(tmp_path / "first"),
                         draft_vocab=32, **{k: v for k, v in kw.items() if k != "method"},
                         method="eagle3"), loaded=tiny_loaded)
    else:
        with pytest.raises(ConfigError, match="pass --num-modules 1"):
            Trainer(_cfg(tiny_prompts, tmp_path, "bad", init_head=str(tmp_path / "first"),
                         num_modules=2, ttt_steps=2, **kw), loaded=tiny_loaded)


def test_init_head_with_a_larger_draft_vocab_grows_it(tiny_loaded, tiny_prompts, tmp_path):
    """--init-head with a larger --draft-vocab: the head's ids and trained rows stay (its
    drafts over them unchanged), the added ids are the most frequent others with the target's
    LM head rows; the grown run resumes; a smaller size is refused."""
    from outpace.training.draft_vocab import draft_ids_of
    first = Trainer(_cfg(tiny_prompts, tmp_path, "first", export_dtype="float32", epochs=1,
                         draft_vocab=24), loaded=tiny_loaded)
    first.run()
    grown = Trainer(_cfg(tiny_prompts, tmp_path, "grown", init_head=str(tmp_path / "first"),
                         draft_vocab=40, epochs=1), loaded=tiny_loaded)
    old_ids, new_ids = draft_ids_of(first.head.d2t), draft_ids_of(grown.head.d2t)
    assert new_ids.numel() == 40 and set(old_ids.tolist()) <= set(new_ids.tolist())
    pos = torch.searchsorted(new_ids, old_ids)
    lm_old, lm_new = first.head.lm_head_weight, grown.head.lm_head_weight
    assert torch.equal(lm_new[pos], lm_old)
    added = torch.ones(40, dtype=torch.bool)
    added[pos] = False
    # the added rows: the target's, mapped as training mapped the kept rows (a * row + b)
    model = tiny_loaded[0]
    own = model.lm_head_weight[old_ids].float()
    scale = ((lm_old * own).sum(1) / (own * own).sum(1)).median()
    shift = (lm_old - scale * own).mean(0)
    want = scale * model.lm_head_weight[new_ids[added]].float() + shift
    assert torch.allclose(lm_new[added], want, atol=1e-6)
    assert not torch.allclose(want, model.lm_head_weight[new_ids[added]].float(), atol=1e-3)
    assert grown.vocab_coverage >= json.loads(
        (tmp_path / "first" / "training.json").read_text())["draft_vocab_coverage"]
    for name, t in first.head.state_dict().items():  # everything else is the head's
        if name not in ("lm_head_weight", "d2t", "t2d"):
            assert torch.equal(grown.head.state_dict()[name], t), name
    grown.run(max_steps=2)
    again = Trainer(_cfg(tiny_prompts, tmp_path, "grown", init_head=str(tmp_path / "first"),
                         draft_vocab=40, epochs=1, resume=str(tmp_path / "grown")),
                    loaded=tiny_loaded)
    assert again.step == 2 and torch.equal(again.head.d2t, grown.head.d2t)
    with pytest.raises(ConfigError, match="smaller than the draft vocabulary of --init-head"):
        Trainer(_cfg(tiny_prompts, tmp_path, "bad", init_head=str(tmp_path / "first"),
                     draft_vocab=16), loaded=tiny_loaded)


def test_extra_answers_join_the_data_and_the_trajectory(tiny_loaded, tiny_prompts, tmp_path):
    """--extra-answers: an earlier run's sampled answers (another seed) become more training
    sequences; resuming without them is refused (they are part of the trajectory)."""
    from outpace.training.selfdistill import read_prompts, regenerate
    old = tmp_path / "seed5.jsonl"
    regenerate("tiny", read_prompts(tiny_prompts), old, loaded=tiny_loaded, device="cpu",
               max_tokens=24, samples=1, seed=5)
    plain = Trainer(_cfg(tiny_prompts, tmp_path, "a", samples=1), loaded=tiny_loaded)
    more = Trainer(_cfg(tiny_prompts, tmp_path, "b", samples=1, extra_answers=(str(old),)),
                   loaded=tiny_loaded)
    assert len(more.seqs) > len(plain.seqs) and more.data_digest != plain.data_digest
    more.run()
    with pytest.raises(ConfigError, match="extra_answers"):
        Trainer(_cfg(tiny_prompts, tmp_path, "b", samples=1, resume=str(tmp_path / "b")),
                loaded=tiny_loaded)
