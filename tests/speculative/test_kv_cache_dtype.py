"""fp32 activations over a bf16 KV pool (RunnerConfig kv_cache_dtype="bfloat16" with dtype
"float32"), on CPU.

The oracle: fp32 attention over an fp32 pool whose K and V were rounded to bf16 before they were
stored. The reference backend over a bf16 pool must give its outputs (and hold its values) on
both of its paths, while the unrounded pool's outputs are further off, so the comparison can
fail; engines over a bf16 pool give the oracle engine's greedy tokens on SmolLM2, and with an
EAGLE-3 or MTP head (whose KV shares the pool) the output without speculation.
"""

from __future__ import annotations

import pytest
import torch

from outpace import SamplingParams
from outpace.attention.torch_ref import TorchRefBackend, make_decode_plan
from tests.engine_helpers import chat_ids, make_engine, run_batch
from tests.speculative.spec_helpers import head_spec, repetitive_prompts
from tests.unit.kernel_cases import make_batch

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
KV_BF16 = dict(dtype="float32", kv_cache_dtype="bfloat16")
SCALE = 0.125


def _bf16(t):
    return t.bfloat16().float()


@pytest.mark.parametrize("seqs,decode_plan", [([(1, 37), (1, 5), (1, 64)], True),
                                              ([(3, 20), (1, 9), (2, 30)], True),
                                              ([(17, 40), (1, 9)], False)])
def test_backend_bf16_pool_equals_rounded_kv(seqs, decode_plan):
    b = make_batch(seqs, 3, 3, 64, torch.float32, "cpu", seed=len(seqs))
    assert (make_decode_plan(b.meta, 16) is not None) == decode_plan
    narrow = TorchRefBackend(b.initial_cache.bfloat16(), 9, 3, 64, SCALE)
    oracle = TorchRefBackend(_bf16(b.initial_cache), 9, 3, 64, SCALE)
    wide = TorchRefBackend(b.initial_cache.clone(), 9, 3, 64, SCALE)
    got = narrow.forward(b.layer, b.q, b.k, b.v, b.meta)
    want = oracle.forward(b.layer, b.q, _bf16(b.k), _bf16(b.v), b.meta)
    far = wide.forward(b.layer, b.q, b.k, b.v, b.meta)
    assert got.dtype == torch.float32 and narrow.kv_cache.dtype == torch.bfloat16
    tol = dict(atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got, want, **tol)
    assert not torch.allclose(far, want, **tol), "rounding K/V to bf16 made no difference"
    torch.testing.assert_close(narrow.kv_cache.float(), oracle.kv_cache, atol=0, rtol=0,
                               equal_nan=True)


def rounding_kv_(engine):
    """Make an fp32 engine the oracle: K and V rounded to bf16 before its fp32 pool stores them
    (the CPU model hands every layer's K / V to backend.forward)."""
    backend = engine.runner.backend
    inner = backend.forward

    def forward(layer, q, k, v, meta):
        return inner(layer, q, _bf16(k), _bf16(v), meta)
    backend.forward = forward
    return engine


def test_smollm2_greedy_equals_rounded_kv(loaded_default):
    model, cfg, tok = loaded_default
    prompts = chat_ids(tok, ["What is the capital of France?", "Write a haiku about rain.",
                             "List three prime numbers."])
    want = run_batch(rounding_kv_(make_engine(loaded_default, max_num_seqs=4)), prompts, GREEDY)
    eng = make_engine(loaded_default, max_num_seqs=4, **KV_BF16)
    assert eng.runner.kv_cache.dtype == torch.bfloat16
    assert run_batch(eng, prompts, GREEDY) == want


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_spec_equals_no_spec_over_a_bf16_pool(tiny_loaded, tiny_heads, method):
    prompts = repetitive_prompts(4, 21)
    want = run_batch(make_engine(tiny_loaded, max_num_seqs=8, **KV_BF16), prompts, GREEDY)
    eng = make_engine(tiny_loaded, max_num_seqs=8,
                      speculative_config=head_spec(tiny_heads, method),
                      **KV_BF16)
    assert eng.runner.kv_cache.dtype == torch.bfloat16
    assert run_batch(eng, prompts, GREEDY) == want
    s = eng.stats()["spec"]
    assert s["num_drafts"] > 0 and s["num_accepted_tokens"] > 0, s
