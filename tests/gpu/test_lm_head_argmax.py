"""The fused (RMSNorm ->) LM head -> argmax kernel (kernels/lm_head_argmax.py) on CUDA, against
the unfused ops, at the LM heads it serves: SmolLM2's (49152 x 576), a 32000-id EAGLE-3 draft
head, Llama-8B's (128256 x 4096); in bf16, fp32, and fp32 over a bf16 weight (weight_dtype)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("triton")

from outpace.kernels.lm_head_argmax import (_counters, greedy_ids, lm_head_argmax,  # noqa: E402
                                            lm_head_argmax_ok)
from outpace.kernels.norm import rms_norm_ref  # noqa: E402

DEV = "cuda"
HEADS = [(49152, 576), (32000, 576), (128256, 4096)]
# (activation dtype, weight dtype)
DTYPES = [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
          (torch.float32, torch.bfloat16)]


def _case(m, v, k, dtype, w_dtype, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = (torch.randn(m, k, device=DEV, generator=g) * 2).to(dtype)
    w = (torch.randn(v, k, device=DEV, generator=g) / k ** 0.5).to(w_dtype)
    nw = (1 + 0.2 * torch.rand(k, device=DEV, generator=g)).to(w_dtype)
    return x, w, nw


def _logits(x, w, nw):
    """The unfused path's logits in x's dtype, widened to fp32 exactly (fp32 products: the
    reference the kernel's accumulation is compared with)."""
    h = rms_norm_ref(x, nw, 1e-5).to(x.dtype) if nw is not None else x
    return F.linear(h.float(), w.float()).to(x.dtype).float()


@pytest.mark.parametrize("dtype,w_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("v,k", HEADS)
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("norm", [False, True])
def test_lm_head_argmax_matches_the_unfused_path(dtype, w_dtype, v, k, m, norm):
    """Each token is its row's maximum of the reference logits: exactly the argmax in fp32;
    otherwise within a rounding of the maximum (the kernel and the reference sum in different
    orders, so a near-tie may round either way; fp32 over a bf16 weight runs in three bf16
    pieces whose error grows with K, ~2e-4 at K = 4096: small_linear.py)."""
    x, w, nw = _case(m, v, k, dtype, w_dtype, seed=m + v + norm)
    nw = nw if norm else None
    got = lm_head_argmax(x, w, norm_weight=nw, eps=1e-5)
    assert int(_counters[x.device]) == 0
    logits = _logits(x, w, nw)
    best = logits.max(-1).values
    if dtype == w_dtype == torch.float32:
        assert torch.equal(got, logits.argmax(-1))
    else:
        tol = best.abs() * 2.0 ** -7 if dtype == torch.bfloat16 else 1e-3 * (1 + best.abs())
        assert (logits.gather(1, got[:, None])[:, 0] >= best - tol).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_ties_go_to_the_first_column_and_offsets_apply(dtype):
    """Equal weight rows tie exactly whatever the rounding: the first column wins, across
    programs; d2t-like offsets are added to it; NaN counts as the maximum."""
    m, v, k = 4, 49152, 576
    x, w, nw = _case(m, v, k, dtype, dtype, seed=3)
    for r in range(m):
        w[100 + r] = w[v - 1 - r] = (x[r].float().sign() * 4 / k ** 0.5).to(dtype)
    x[3, 7] = float("nan")  # every logit NaN: index 0, as torch.argmax
    off = torch.randint(-50, 50, (v,), device=DEV)
    got = lm_head_argmax(x, w, norm_weight=nw, eps=1e-5, offsets=off)
    want = torch.tensor([100, 101, 102, 0], device=DEV)
    assert torch.equal(got, want + off[want])


def test_a_row_gets_the_same_token_alone_and_among_others():
    """Per row the result does not depend on the other rows: a verify's rows and a decode's
    one agree exactly (bf16, where summation order would show)."""
    x, w, nw = _case(3, 49152, 576, torch.bfloat16, torch.bfloat16, seed=4)
    three = lm_head_argmax(x, w, norm_weight=nw, eps=1e-5)
    for r in range(3):
        one = lm_head_argmax(x[r:r + 1], w, norm_weight=nw, eps=1e-5)
        assert torch.equal(one, three[r:r + 1])


@pytest.mark.parametrize("num_also", [0, 2])
def test_in_a_cuda_graph_with_new_values(num_also):
    """Captured after one eager call: every replay sees new inputs and offsets, leaves the
    counter zero, and writes the `also` columns and nothing else of them."""
    x, w, nw = _case(3, 32000, 576, torch.bfloat16, torch.bfloat16, seed=5)
    off = torch.randint(-100, 100, (32000,), device=DEV)
    outs = [torch.full((3, 4), -7, dtype=torch.long, device=DEV) for _ in range(num_also)]
    also = tuple(o[:, 2] for o in outs)
    lm_head_argmax(x, w, norm_weight=nw, eps=1e-5, offsets=off, also=also)  # eager first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = lm_head_argmax(x, w, norm_weight=nw, eps=1e-5, offsets=off, also=also)
    for seed in range(3):
        g = torch.Generator(device=DEV).manual_seed(seed)
        x.copy_(torch.randn(3, 576, device=DEV, generator=g).to(x.dtype) * 2)
        off.copy_(torch.randint(-100, 100, (32000,), device=DEV, generator=g))
        graph.replay()
        want = lm_head_argmax(x, w, norm_weight=nw, eps=1e-5, offsets=off)  # eager
        assert torch.equal(got, want)
        assert int(_counters[x.device]) == 0
        for o in outs:
            assert torch.equal(o[:, 2], want) and (o[:, [0, 1, 3]] == -7).all()


def test_dispatcher_falls_back_beyond_few_rows():
    """greedy_ids: the fused kernel up to 16 rows, the unfused ops above (same tokens on
    well-separated logits)."""
    x, w, nw = _case(40, 4096, 576, torch.float32, torch.float32, seed=6)
    assert lm_head_argmax_ok(x[:16], w) and not lm_head_argmax_ok(x, w)
    assert not lm_head_argmax_ok(x[:3].bfloat16(), w)  # a weight wider than the activations
    want = _logits(x, w, None).argmax(-1)
    assert torch.equal(greedy_ids(x, w, lambda h: F.linear(h, w)), want)
    assert torch.equal(greedy_ids(x[:16], w, lambda h: F.linear(h, w)), want[:16])
