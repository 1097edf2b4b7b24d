"""Draft heads read in bf16 on the CPU (`"draft_weight_dtype": "bfloat16"`, the default there
where the CPU multiplies bf16): the output is still the target's, the target's own weights and
logits keep fp32, and MTP's eagle mode drafts through a bf16 copy of the target's LM head."""

from __future__ import annotations

import pytest

from outpace import SamplingParams
from outpace.models.cpu_fast_paths import cpu_packs_bf16
from tests.engine_helpers import make_engine, run_batch
from tests.speculative.spec_helpers import TINY_BLOCK, repetitive_prompts

pytestmark = pytest.mark.skipif(not cpu_packs_bf16(),
                                reason="oneDNN's bf16 packed linear is not on this CPU")

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def bf16_keys(module) -> list:
    return [f"{name}.{key}" for name, m in module.named_modules()
            for key in m.__dict__ if key.endswith("_bf16")]


@pytest.fixture(scope="module")
def want(tiny_loaded):
    prompts = repetitive_prompts(4, 5)
    eng = make_engine(tiny_loaded, block_size=TINY_BLOCK)
    return prompts, run_batch(eng, prompts, GREEDY)


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_bf16_drafts_keep_the_targets_output(tiny_loaded, tiny_heads, want, method):
    prompts, ref = want
    spec = {"method": method, "model": str(tiny_heads[method]), "num_speculative_tokens": 3,
            "draft_weight_dtype": "bfloat16", "enhancer_min_match": 2}
    if method == "mtp":
        spec["mtp_mode"] = "eagle"
    eng = make_engine(tiny_loaded, block_size=TINY_BLOCK, speculative_config=spec)
    proposer = eng.runner.proposer
    assert bf16_keys(proposer.head)  # the head reads its bf16 copies...
    assert not bf16_keys(tiny_loaded[0])  # ...and the target has none
    if method == "mtp":  # MTP drafts through its own copy of the target's LM head
        assert proposer._draft_lm_head is not None
        assert proposer._draft_lm_head.lm_head_weight is tiny_loaded[0].lm_head_weight
    assert run_batch(eng, prompts, GREEDY) == ref
    assert eng.spec_stats.as_dict()["num_accepted_tokens"] > 0


def test_float32_makes_no_bf16_copies(tiny_loaded, tiny_heads):
    spec = {"method": "mtp", "model": str(tiny_heads["mtp"]), "num_speculative_tokens": 2,
            "mtp_mode": "eagle", "draft_weight_dtype": "float32"}
    eng = make_engine(tiny_loaded, block_size=TINY_BLOCK, speculative_config=spec)
    assert not bf16_keys(eng.runner.proposer.head)
    assert eng.runner.proposer._draft_lm_head is None
