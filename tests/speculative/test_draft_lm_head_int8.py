"""A head's drafts from an int8 copy of its LM head (speculative option draft_lm_head_dtype):
the output stays the target's, the drafts are the argmax of the dequantized head's logits, and
bad settings are refused at build."""

from __future__ import annotations

import pytest
import torch

from outpace import SamplingParams
from outpace.errors import ConfigError
from tests.engine_helpers import make_engine
from tests.speculative.spec_helpers import TINY_BLOCK, ChainRecorder, repetitive_prompts, run_waves
from tests.speculative.test_draft_plane import head_spec

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
KW = dict(block_size=TINY_BLOCK, max_num_batched_tokens=32)


def dequantized_lm_head(weight: torch.Tensor) -> torch.Tensor:
    """The int8 head's weight as the test reads the option: each row rounded to 255 levels
    spaced max|row| / 127 apart (written here independently of quantize_int8_rows)."""
    step = weight.float().abs().amax(dim=1, keepdim=True) / 127
    return torch.round(weight.float() / step) * step


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_int8_draft_lm_head_keeps_the_output_and_drafts_from_the_dequantized_head(
        tiny_loaded, tiny_heads, method):
    calls = []  # the draft_ids_normed calls that read the int8 copy

    def count_int8_drafts(proposer):  # wraps this proposer's draft_ids_normed (an instance's)
        inner = proposer.draft_ids_normed

        def counting(normed, also=()):
            if proposer.int8_lm_head_for(normed.shape[0]):
                calls.append(1)
            return inner(normed, also)
        proposer.draft_ids_normed = counting
        return ChainRecorder(proposer)
    prompts = repetitive_prompts(6, seed=11)
    plain = run_waves(tiny_loaded, [prompts], GREEDY, **KW)
    rec = {}
    spec = run_waves(tiny_loaded, [prompts], GREEDY,
                     speculative_config=head_spec(tiny_heads, method, 3,
                                                  draft_lm_head_dtype="int8"),
                     on_engine=lambda e: rec.setdefault(
                         "chains", count_int8_drafts(e.runner.proposer)), **KW)
    assert spec.outputs == plain.outputs  # the target verifies every draft
    assert spec.stats["spec"]["num_drafts"] > 50 and calls, "the int8 head never drafted"

    proposer = spec.engine.runner.proposer
    weight, offsets = proposer.draft_lm_head()
    deq = dequantized_lm_head(weight)
    norm = proposer.draft_norm()
    checked = 0
    for _, _, hiddens, toks in rec["chains"].chains():
        logits = norm(hiddens).float() @ deq.T  # [k, V]
        top2 = logits.topk(2, dim=-1)
        want = top2.indices[:, 0]
        if offsets is not None:
            want = want + offsets[want]
        clear = (top2.values[:, 0] - top2.values[:, 1]) > 1e-4  # summation order aside
        assert toks[clear].tolist() == want[clear].tolist()
        checked += int(clear.sum())
    assert checked > 50


def test_int8_draft_lm_head_settings_are_checked(tiny_loaded, tiny_heads):
    with pytest.raises(ConfigError, match="draft_lm_head_dtype must be"):
        make_engine(tiny_loaded, speculative_config=head_spec(
            tiny_heads, "eagle3", 2, draft_lm_head_dtype="fp4"))
    spec = head_spec(tiny_heads, "mtp", 1, draft_lm_head_dtype="int8")
    spec["mtp_mode"] = "depths"
    with pytest.raises(ConfigError, match="mtp_mode 'depths'"):
        make_engine(tiny_loaded, speculative_config=spec)
    eng = make_engine(tiny_loaded, speculative_config=head_spec(tiny_heads, "eagle3", 2))
    assert eng.runner.proposer._int8_lm_head is None  # off unless asked for


def test_int8_draft_lm_head_serves_few_rows_only(tiny_loaded, tiny_heads):
    """Up to SMALL_M_MAX rows (a draft step at small batch) the int8 copy gives the logits; more
    rows take the head's own LM head, whose one read they share (no int8 kernel for them)."""
    from outpace.kernels.skinny_gemm import SMALL_M_MAX
    eng = make_engine(tiny_loaded, speculative_config=head_spec(
        tiny_heads, "eagle3", 2, draft_lm_head_dtype="int8"))
    proposer = eng.runner.proposer
    weight, offsets = proposer.draft_lm_head()
    deq = dequantized_lm_head(weight)
    g = torch.Generator().manual_seed(5)
    many = torch.randn(SMALL_M_MAX + 4, weight.shape[1], generator=g)
    assert torch.equal(proposer.draft_ids_normed(many), proposer.draft_ids_from_lm_head(many))
    few = many[:SMALL_M_MAX]
    want = (few @ deq.T).argmax(-1)
    got = proposer.draft_ids_normed(few)
    assert torch.equal(got, want + offsets[want])
