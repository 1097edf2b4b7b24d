"""Acceptance of the model-free drafters on the real default model (SmolLM2-135M, CPU fp32,
greedy, k=5) on copy-heavy prompts: repeat, rewrite with a small change, extract sentences,
summarise a given paragraph. Both drafters must reach a mean acceptance length (tokens per
verify step, bonus included) above 2 on each prompt type. Run with -s to see the table."""

from __future__ import annotations

import pytest

from outpace import SamplingParams
from tests.engine_helpers import chat_ids
from tests.speculative.spec_helpers import run_waves

pytestmark = pytest.mark.slow

TEXT = ("Marie Curie was born in Warsaw in 1867. She moved to Paris to study physics and "
        "mathematics at the Sorbonne. In Paris she met Pierre Curie, and they married in 1895. "
        "Together they discovered the elements polonium and radium. Marie Curie won the Nobel "
        "Prize in Physics in 1903 and the Nobel Prize in Chemistry in 1911. She died in 1934 in "
        "France.")
PROMPTS = {
    "repeat": f"Repeat the following text exactly, word for word.\n\n{TEXT}",
    "rewrite": ("Rewrite the following text, replacing 'Marie Curie' with 'Madame Curie'. Keep "
                f"everything else the same.\n\n{TEXT}"),
    "extract": f"From the text below, copy every sentence that mentions Paris.\n\n{TEXT}",
    "summarise": f"Summarise the following text in two sentences.\n\n{TEXT}",
}
K = 5
PARAMS = SamplingParams(max_tokens=64, temperature=0.0)


def test_model_free_drafters_reach_acceptance_above_two_on_copy_heavy_prompts(loaded_default):
    prompts = chat_ids(loaded_default[2], list(PROMPTS.values()))
    rows, outputs = [], {}
    for method in ("ngram", "suffix"):
        run = run_waves(loaded_default, [prompts], PARAMS, max_num_batched_tokens=512,
                        speculative_config={"method": method, "num_speculative_tokens": K})
        outputs[method] = run.outputs
        for name, o in zip(PROMPTS, run.outs):
            s = o.spec_stats
            per_pos = [round(v / s.num_drafts, 2) for v in s.accepted_per_position]
            rows.append((method, name, len(o.token_ids), s.num_drafts,
                         s.mean_acceptance_length, per_pos))
        g = run.stats["spec"]
        rows.append((method, "all", sum(len(o) for o in run.outputs), g["num_drafts"],
                     g["mean_acceptance_length"],
                     [round(v / g["num_drafts"], 2) for v in g["accepted_per_position"]]))
    print(f"\nSmolLM2-135M fp32 CPU, greedy, k={K}, max_tokens={PARAMS.max_tokens}")
    print(f"{'method':8} {'prompt':10} {'tokens':>6} {'verify':>6} {'tau':>5}  accepted/step "
          "by position")
    for method, name, n, drafts, tau, per_pos in rows:
        print(f"{method:8} {name:10} {n:6d} {drafts:6d} {tau:5.2f}  {per_pos}")
    # both drafters are lossless, so they produce the same greedy text
    assert outputs["ngram"] == outputs["suffix"]
    low = [(m, n, round(t, 2)) for m, n, _, _, t, _ in rows if t <= 2.0]
    assert not low, f"mean acceptance length <= 2: {low}"
