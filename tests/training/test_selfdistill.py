"""Self-distillation through the engine: answers are the target's own greedy output, the cache
is reused (and extended) instead of regenerated, and damaged or mismatched caches are errors."""

from __future__ import annotations

import json

import pytest

from outpace import SamplingParams
from outpace.errors import ConfigError
from outpace.training.selfdistill import read_prompts, regenerate
from tests.engine_helpers import make_engine


def test_answers_are_the_targets_greedy_output_and_the_cache_is_reused(tiny_loaded,
                                                                       tiny_prompts, tmp_path):
    prompts = read_prompts(tiny_prompts, limit=6)
    cache = tmp_path / "a.jsonl"
    recs = regenerate("tiny", prompts, cache, loaded=tiny_loaded, device="cpu", max_tokens=12)
    assert [r["id"] for r in recs] == [p["id"] for p in prompts]
    eng = make_engine(tiny_loaded)
    for r in recs[:3]:
        eng.add_request(r["id"], r["prompt_ids"], SamplingParams(max_tokens=12, temperature=0.0))
    want = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                want[o.request_id] = o.token_ids
    for r in recs[:3]:
        assert r["answer_ids"] == want[r["id"]]
    stamp = cache.read_bytes()
    # the same request again generates nothing (a loaded model that can't run would fail)
    again = regenerate("tiny", prompts, cache, loaded=(None, tiny_loaded[1], tiny_loaded[2]),
                       device="cpu", max_tokens=12)
    assert again == recs and cache.read_bytes() == stamp
    # one sampled answer each: only those are generated, appended to the same cache
    more = regenerate("tiny", prompts, cache, loaded=tiny_loaded, device="cpu", max_tokens=12,
                      samples=1, seed=0)
    assert [(r["id"], r["sample"]) for r in more] == \
        [(p["id"], s) for p in prompts for s in (0, 1)]
    assert cache.read_bytes().startswith(stamp)
    # seeded: a second cache with the same settings holds the same sampled answers
    other = regenerate("tiny", prompts, tmp_path / "b.jsonl", loaded=tiny_loaded, device="cpu",
                       max_tokens=12, samples=1, seed=0)
    assert other == more


def test_damaged_or_mismatched_caches_are_errors(tiny_loaded, tiny_prompts, tmp_path):
    prompts = read_prompts(tiny_prompts, limit=3)
    cache = tmp_path / "a.jsonl"
    regenerate("tiny", prompts, cache, loaded=tiny_loaded, device="cpu", max_tokens=8)
    with pytest.raises(ConfigError, match="max_tokens: 8 there, 9 now"):
        regenerate("tiny", prompts, cache, loaded=tiny_loaded, device="cpu", max_tokens=9)
    # a run killed mid-write leaves a truncated last line: that answer is generated again
    lines = cache.read_text().splitlines()
    cache.write_text("\n".join(lines[:-1] + [lines[-1][:10]]) + "\n")
    recs = regenerate("tiny", prompts, cache, loaded=tiny_loaded, device="cpu", max_tokens=8)
    assert len(recs) == 3
    broken = tmp_path / "broken.jsonl"
    broken.write_text("\n".join([lines[0], "{oops", lines[1]]) + "\n")
    with pytest.raises(ConfigError, match="broken.jsonl:2 is not valid JSON"):
        regenerate("tiny", prompts, broken, loaded=tiny_loaded, device="cpu", max_tokens=8)
    (tmp_path / "other.jsonl").write_text(json.dumps({"x": 1}) + "\n")
    with pytest.raises(ConfigError, match="not an outpace self-distillation cache"):
        regenerate("tiny", prompts, tmp_path / "other.jsonl", loaded=tiny_loaded,
                   device="cpu", max_tokens=8)


@pytest.mark.parametrize("content,msg", [
    ('{"id": 1, "prompt": "a"}\n{"id": 1, "prompt": "b"}\n', "repeats the id '1'"),
    ('{"id": 1, "text": ""}\n', "has no prompt text"),
    ('[1, 2]\n', "is a JSON list, not an object"),
    ('\n\n', "holds no prompts"),
])
def test_bad_prompt_files(tmp_path, content, msg):
    p = tmp_path / "p.jsonl"
    p.write_text(content)
    with pytest.raises(ConfigError, match=msg):
        read_prompts(p)


def test_prompt_files_take_the_benchmark_shapes(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": 81, "turns": ["first", "second"]}\n{"question": "q"}\n')
    assert read_prompts(p) == [{"id": "81", "prompt": "first"}, {"id": "2", "prompt": "q"}]


def test_extra_answers_of_another_seed_join_and_mismatches_are_errors(tiny_loaded, tiny_prompts,
                                                                      tmp_path):
    """An earlier run's cache (another seed, gzip) adds its sampled answers to the run's own
    prompts only; other settings, this run's own seed, or not a cache: errors naming the file."""
    import gzip

    from outpace.training.selfdistill import read_extra_answers
    prompts = read_prompts(tiny_prompts, limit=4)
    cfg = tiny_loaded[1]
    old = tmp_path / "seed7.jsonl"
    recs = regenerate("tiny", prompts, old, loaded=tiny_loaded, device="cpu", max_tokens=8,
                      samples=2, seed=7)
    packed = tmp_path / "seed7.jsonl.gz"
    packed.write_bytes(gzip.compress(old.read_bytes()))
    got = read_extra_answers([packed], prompts[:3], cfg, 8, 0.8, 0.95, seed=8)
    assert got == [r for r in recs if r["sample"] >= 1 and r["id"] != prompts[3]["id"]]
    assert len(got) == 6
    # a prompt whose text changed is not answered by the old cache
    changed = [dict(prompts[0], prompt=prompts[0]["prompt"] + "!")]
    assert read_extra_answers([old], changed, cfg, 8, 0.8, 0.95, seed=8) == []
    with pytest.raises(ConfigError, match="max_tokens: 8 there, 9 now"):
        read_extra_answers([old], prompts, cfg, 9, 0.8, 0.95, seed=8)
    with pytest.raises(ConfigError, match="this run's seed"):
        read_extra_answers([old], prompts, cfg, 8, 0.8, 0.95, seed=7)
    (tmp_path / "x.jsonl").write_text('{"nope": 1}\n')
    with pytest.raises(ConfigError, match="not an outpace self-distillation cache"):
        read_extra_answers([tmp_path / "x.jsonl"], prompts, cfg, 8, 0.8, 0.95, seed=8)
    with pytest.raises(ConfigError, match="no such file"):
        read_extra_answers([tmp_path / "none.jsonl"], prompts, cfg, 8, 0.8, 0.95, seed=8)
    (tmp_path / "bad.jsonl.gz").write_bytes(gzip.compress(old.read_bytes())[:-30])
    with pytest.raises(ConfigError, match="can't be read"):
        read_extra_answers([tmp_path / "bad.jsonl.gz"], prompts, cfg, 8, 0.8, 0.95, seed=8)
