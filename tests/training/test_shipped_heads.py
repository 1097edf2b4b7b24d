"""The heads shipped for the default model: found without a draft path, an error naming
train-draft for other targets, and on the real model (CPU fp32) lossless with a real
acceptance floor, so a broken or random head fails here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from outpace import SamplingParams
from outpace.entrypoints.cli import build_parser
from outpace.entrypoints.cli_options import engine_kwargs
from outpace.errors import ConfigError
from outpace.models.shipped_heads import (HEADS_DIR, SHIPPED, catalog_name_of, shipped_head,
                                          with_shipped_head)
from tests.engine_helpers import chat_ids, engines_made, make_engine, run_batch_outputs

PROMPTS = Path(__file__).resolve().parents[2] / "benchmarks" / "prompts" / "mtbench.jsonl"

# The shipped heads' mean acceptance lengths, on 80 MT-bench prompts and on this test's eight
# (the first of each MT-bench category, CPU fp32), are in docs/performance.md. Random heads
# reach ~1.0, so a broken head fails here; the EAGLE-3 floor is issue 33's.
FLOOR = {"eagle3": 2.5, "mtp": 1.8}


def test_every_shipped_head_is_in_the_package_and_small():
    total = 0
    for folder in SHIPPED.values():
        d = HEADS_DIR / folder
        assert (d / "config.json").is_file() and (d / "model.safetensors").is_file(), d
        total += sum(f.stat().st_size for f in d.iterdir())
    assert total <= 32 * 2**20  # the cap on all shipped head files together


def test_lookup_by_name_and_the_error_for_other_targets(tmp_path):
    assert shipped_head("SmolLM2-135M", "eagle3") == HEADS_DIR / "smollm2-135m-eagle3"
    assert shipped_head("smollm2-135m", "mtp") == HEADS_DIR / "smollm2-135m-mtp"
    other = tmp_path / "model.gguf"
    other.write_bytes(b"GGUF" + bytes(60))
    assert catalog_name_of(other) is None and catalog_name_of(tmp_path / "nope") is None
    with pytest.raises(ConfigError, match="outpace train-draft --method eagle3"):
        with_shipped_head({"method": "eagle3"}, str(other))
    # a draft path, or a model-free method, is left as given
    assert with_shipped_head({"method": "eagle3", "model": "/d"}, str(other))["model"] == "/d"
    assert with_shipped_head({"method": "ngram"}, str(other)) == {"method": "ngram"}
    assert with_shipped_head(None, str(other)) is None


def test_the_cli_leaves_the_draft_to_the_lookup():
    kw = engine_kwargs(build_parser().parse_args(["generate", "hi", "--spec", "eagle3"]))
    assert "model" not in kw["speculative_config"]
    got = with_shipped_head(kw["speculative_config"], "smollm2-135m")
    assert got["model"] == str(HEADS_DIR / "smollm2-135m-eagle3")


@pytest.mark.slow
def test_the_default_model_file_is_recognised(default_model_path):
    assert catalog_name_of(default_model_path) == "smollm2-135m"
    assert with_shipped_head({"method": "mtp"}, str(default_model_path))["model"] == \
        str(HEADS_DIR / "smollm2-135m-mtp")


def mt_bench_spread() -> list:
    """The first turn of the first prompt of each MT-bench category (the file is ordered by
    category: 80 prompts, 10 a category)."""
    rows = [json.loads(line) for line in PROMPTS.read_text(encoding="utf-8").splitlines()]
    return [r["prompt"] for r in rows[::10]]


PARAMS = SamplingParams(max_tokens=256, temperature=0.0)


@pytest.fixture(scope="module")
def plain_outputs(loaded_default) -> list:
    """The prompts' output without speculation, which both heads must give: run once, on an
    engine let go here (its leaked-blocks check too) rather than kept by the test helpers'
    registry until the session ends."""
    eng = make_engine(loaded_default)
    outs = run_batch_outputs(eng, chat_ids(loaded_default[2], mt_bench_spread()), PARAMS)
    assert eng.kv.num_used_blocks == 0
    engines_made().remove(eng)
    return [o.token_ids for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize("method,k", [("eagle3", 5), ("mtp", 3)])
def test_shipped_head_is_lossless_and_reaches_its_acceptance_floor(loaded_default, plain_outputs,
                                                                    method, k):
    prompts = chat_ids(loaded_default[2], mt_bench_spread())
    params = PARAMS
    plain = plain_outputs
    # the catalog name: the engine finds the shipped head itself
    spec = make_engine(loaded_default, model="smollm2-135m",
                       speculative_config={"method": method, "num_speculative_tokens": k})
    assert spec.config.spec.model == str(HEADS_DIR / f"smollm2-135m-{method}")
    outs = run_batch_outputs(spec, prompts, params)
    assert [o.token_ids for o in outs] == plain
    drafts = sum(o.spec_stats.num_drafts for o in outs)
    accepted = sum(o.spec_stats.num_accepted_tokens for o in outs)
    tau = 1 + accepted / drafts
    print(f"\n{method} k={k}: mean acceptance length {tau:.3f} over {drafts} verify steps")
    assert tau >= FLOOR[method], tau
