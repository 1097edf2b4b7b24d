"""fp32 activations over bf16-stored weights (RunnerConfig weight_dtype="bfloat16" with dtype
"float32"; outpace/models/weight_dtype.py), on CPU.

The oracle: an fp32 model whose matrices (every 2-D parameter) were rounded to bf16 beforehand.
The mixed engine must give exactly its greedy tokens and its logits to 1e-5, on the tiny random
target and on the real SmolLM2; the unrounded fp32 model's logits must be further off, so the
comparison can fail. With an EAGLE-3 or MTP head (its matrices in bf16 too), greedy output
with speculation equals the output without it.
"""

from __future__ import annotations

import copy

import pytest
import torch

from outpace import SamplingParams
from outpace.models.weight_dtype import store_weights_in_, weight_bytes
from tests.engine_helpers import chat_ids, engines_made, make_engine, run_batch
from tests.speculative.spec_helpers import dense_target, head_spec, repetitive_prompts

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
MIXED = dict(dtype="float32", weight_dtype="bfloat16")


def round_matrices_(model):
    """Round every matrix of the fp32 model to bf16 in place, held in fp32."""
    for p in model.parameters():
        if p.dim() == 2:
            p.data = p.data.bfloat16().float()
    return model.eval()


def rounded_fp32(model):
    return round_matrices_(copy.deepcopy(model))


def stored_in_bf16(model):
    m = copy.deepcopy(model)
    store_weights_in_(m, torch.bfloat16)
    return m.eval()


def assert_matrices_bf16(module):
    """Matrices (projections, embedding, LM head, fc / eh_proj) bf16, norm weights fp32."""
    params = dict(module.named_parameters())
    assert params, "no parameters"
    for name, p in params.items():
        assert p.dtype == (torch.bfloat16 if p.dim() == 2 else torch.float32), name


def assert_logits_match(ref, mixed, unrounded, cfg, ids):
    """Mixed logits == the rounded model's to 1e-5 relative; the unrounded model's are not."""
    assert_logits_close(dense_target(ref, cfg, ids)[2], dense_target(mixed, cfg, ids)[2],
                        dense_target(unrounded, cfg, ids)[2])


def assert_logits_close(want, got, far):
    """got (the mixed model's logits) == want (the rounded model's) to 1e-5 relative; far (the
    unrounded model's) are not."""
    assert got.dtype == torch.float32
    scale = want.abs().max().item()
    tol = dict(atol=1e-5 * scale, rtol=1e-5)
    torch.testing.assert_close(got, want, **tol)
    assert not torch.allclose(far, want, **tol), "bf16 rounding of the weights made no difference"


@pytest.fixture(scope="module")
def tiny_pair(tiny_loaded):
    """(rounded fp32 loaded, bf16-stored loaded) copies of the tiny target."""
    model, cfg, tok = tiny_loaded
    return (rounded_fp32(model), cfg, tok), (stored_in_bf16(model), cfg, tok)


def test_tiny_weights_are_bf16_and_half_the_bytes(tiny_loaded, tiny_pair):
    mixed = tiny_pair[1][0]
    assert_matrices_bf16(mixed)
    assert mixed.dtype == torch.float32  # the activation dtype
    ratio = weight_bytes(mixed) / weight_bytes(tiny_loaded[0])
    assert 0.5 <= ratio < 0.52, ratio  # only the norm weights stay fp32


def test_tiny_greedy_equals_rounded_fp32(tiny_loaded, tiny_pair):
    (ref, cfg, _), (mixed, _, _) = tiny_pair
    prompts = repetitive_prompts(5, 7)
    want = run_batch(make_engine(tiny_pair[0], max_num_seqs=8), prompts, GREEDY)
    eng = make_engine(tiny_pair[1], max_num_seqs=8, **MIXED)
    assert eng.runner.kv_cache.dtype == torch.float32  # the KV pool is the activation dtype
    assert run_batch(eng, prompts, GREEDY) == want
    for ids in prompts[:2]:
        assert_logits_match(ref, mixed, tiny_loaded[0], cfg, ids)


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_spec_equals_no_spec_with_bf16_weights(tiny_pair, tiny_heads, method):
    mixed = tiny_pair[1]
    prompts = repetitive_prompts(4, 21)
    want = run_batch(make_engine(mixed, max_num_seqs=8, **MIXED), prompts, GREEDY)
    eng = make_engine(mixed, max_num_seqs=8, speculative_config=head_spec(tiny_heads, method),
                      **MIXED)
    assert_matrices_bf16(eng.runner.proposer.head)
    assert run_batch(eng, prompts, GREEDY) == want
    s = eng.stats()["spec"]
    assert s["num_drafts"] > 0 and s["num_accepted_tokens"] > 0, s


def test_smollm2_greedy_equals_rounded_fp32(default_model_path, loaded_default):
    """The real model through the loader (GGUF dequantized to fp32, then stored in bf16, CPU
    weight copies in fp32) against the fp32 load with its matrices rounded."""
    from outpace.models.loader import load_model
    cpu = torch.device("cpu")
    model, cfg, tok = loaded_default
    prompts = chat_ids(tok, ["What is the capital of France?", "Write a haiku about rain.",
                             "List three prime numbers."])
    # The rounded oracle runs first and is freed before the mixed model loads: each is a
    # whole model with its CPU weight copies, beside the session's default model.
    ref = round_matrices_(load_model(str(default_model_path), dtype=torch.float32, device=cpu,
                                     quiet=True)[0])
    ref.add_cpu_weight_copies_()  # the loader's copies hold the unrounded values
    want = run_released((ref, cfg, tok), prompts)
    want_logits = dense_target(ref, cfg, prompts[0])[2]
    del ref
    mixed = load_model(str(default_model_path), dtype=torch.float32,
                       weight_dtype=torch.bfloat16, device=cpu, quiet=True)
    assert_matrices_bf16(mixed[0])
    assert mixed[0].lm_head_weight is mixed[0].embed_weight  # still tied
    ratio = weight_bytes(mixed[0]) / weight_bytes(model)
    assert 0.5 <= ratio < 0.501, ratio
    got = run_released(mixed, prompts, **MIXED)
    assert got == want
    assert_logits_close(want_logits, dense_target(mixed[0], cfg, prompts[0])[2],
                        dense_target(model, cfg, prompts[0])[2])


def run_released(loaded, prompts, **kw) -> list:
    """run_batch's greedy outputs from a fresh engine over `loaded` that is let go on return
    (its leaked-blocks check done here), so that its model can be freed within the test."""
    eng = make_engine(loaded, max_num_seqs=4, num_kv_blocks=32, **kw)  # 3 short requests
    out = run_batch(eng, prompts, GREEDY)
    assert not eng.has_unfinished_requests() and eng.kv.num_used_blocks == 0
    engines_made().remove(eng)
    return out
