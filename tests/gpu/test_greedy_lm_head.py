"""The fused greedy LM head (kernels/greedy_lm_head.py) against its reference on fresh random
inputs: bf16 / fp16 / fp32 activations, fp32 over bf16 weights, int8 weights with a scale;
with and without the norm prologue, with EAGLE-3's offsets and the extra outputs; 1-4 rows;
SmolLM2's LM head shapes (49152 and 32000 x 576) and odd ones (a partial last tile, K with and
without a tail, an 8B-wide K); the launch policy's blocks and forced ones.

What is asserted: the logits the kernel compared (stored on request) equal the reference's up
to the fp32 sum's order (one rounding of the activation dtype); the ids are exactly argmax of
those logits (+ offsets); each id's reference logit is within that rounding of the reference
maximum; and with a planted winner the ids equal the reference's exactly."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
triton = pytest.importorskip("triton")

from outpace.kernels.argmax import argmax_ref  # noqa: E402
from outpace.kernels.greedy_lm_head import (GreedyBlocks, choose_greedy_blocks,  # noqa: E402
                                            greedy_lm_head, greedy_lm_head_ref,
                                            greedy_lm_head_triton, greedy_logits_ref)
from outpace.kernels.int8_linear import quantize_int8_rows  # noqa: E402

DEV = "cuda"
SHAPES = [(49152, 576), (32000, 576), (1000, 576), (4099, 64), (777, 960), (2048, 4096)]
# (activation dtype, weight dtype): "int8" is an int8 weight with a per-row scale
DTYPES = [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
          (torch.float32, torch.float32), (torch.float32, torch.bfloat16),
          (torch.bfloat16, "int8"), (torch.float32, "int8")]


def _inputs(m, n, k, x_dtype, w_dtype, norm, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = (torch.randn(m, k, device=DEV, generator=g) * 3).to(x_dtype)
    w = torch.randn(n, k, device=DEV, generator=g) / k ** 0.5
    scale = None
    if w_dtype == "int8":
        w, scale = quantize_int8_rows(w)
    else:
        w = w.to(w_dtype)
    nw = (1 + 0.2 * torch.randn(k, device=DEV, generator=g)).to(x_dtype) if norm else None
    offsets = torch.randint(0, 1000, (n,), device=DEV, generator=g)
    return x, w, scale, nw, offsets


def _tolerance(ref: torch.Tensor) -> float:
    """One rounding of the logits' dtype at their largest magnitude, plus the fp32 sum's
    order (a few fp32 ulps of a sum of K products)."""
    eps = torch.finfo(ref.dtype).eps
    return float(ref.float().abs().max()) * (eps + 1e-5)


def _check(x, w, scale, nw, offsets, blocks=None):
    m, n = x.shape[0], w.shape[0]
    logits = torch.empty(m, n, dtype=x.dtype, device=DEV)
    a1 = torch.full((m, 3), -1, dtype=torch.int64, device=DEV)[:, 1]  # a strided view
    ids = greedy_lm_head_triton(x, w, norm_weight=nw, eps=1e-6, scale=scale, offsets=offsets,
                                also=(a1,), logits=logits, blocks=blocks)
    ref = greedy_logits_ref(x, w, norm_weight=nw, eps=1e-6, scale=scale)
    tol = _tolerance(ref)
    assert (logits.float() - ref.float()).abs().max().item() <= tol
    assert torch.equal(ids, argmax_ref(logits, offsets))
    assert torch.equal(a1, ids)
    raw = argmax_ref(logits)  # the column the kernel picked, before the offsets
    picked = ref.float().gather(1, raw[:, None])[:, 0]
    assert (picked >= ref.float().max(dim=1).values - tol).all()


@pytest.mark.parametrize("x_dtype,w_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,k", SHAPES, ids=str)
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "norm"])
def test_matches_reference(norm, m, n, k, x_dtype, w_dtype):
    if x_dtype == torch.float32 and w_dtype == torch.float32 and k == 4096 and m > 2:
        pytest.skip("fp32 8B-wide rows at 3-4 rows: the narrowest tiles, covered at 1-2")
    _check(*_inputs(m, n, k, x_dtype, w_dtype, norm, seed=n + k + m))


@pytest.mark.parametrize("blocks", [GreedyBlocks(8, 1, 4, 512, 64),
                                    GreedyBlocks(32, 4, 8, 512, 64),
                                    GreedyBlocks(64, 2, 4, 512, 64),
                                    GreedyBlocks(16, 3, 2, 512, 64)], ids=str)
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, "int8"], ids=str)
def test_forced_blocks(blocks, w_dtype):
    """Other launch shapes (the sweeps' candidates), SmolLM2's head with a partial last
    program (49152 is no multiple of 3 x 16 x ...: the tiles past N are masked)."""
    _check(*_inputs(2, 49152 - 5, 576, torch.bfloat16, w_dtype, True, seed=7), blocks=blocks)


@pytest.mark.parametrize("w_dtype", [torch.bfloat16, "int8"], ids=str)
def test_planted_winner_is_exact(w_dtype):
    """A column made the clear maximum of its row is found exactly, wherever it lies among
    tiles and programs (the last column, one in the middle, the first): row r is nonzero on
    its own third of K only, and its winner's weight is one there (127 in int8), zero
    elsewhere, so its logit is the sum of |x| over that third."""
    m, n, k = 3, 49152, 576
    x, w, scale, _, _ = _inputs(m, n, k, torch.bfloat16, w_dtype, False, seed=3)
    winners = [n - 1, 20000, 0]
    part = k // m
    for row, col in enumerate(winners):
        seg = slice(row * part, (row + 1) * part)
        keep = x[row, seg].abs()
        x[row].zero_()
        x[row, seg] = keep
        w[col].zero_()
        w[col, seg] = 127 if w_dtype == "int8" else 1
    ids = greedy_lm_head(x, w, scale=scale)
    assert ids.tolist() == winners
    assert torch.equal(ids, greedy_lm_head_ref(x, w, scale=scale))


def test_ties_go_to_the_first_column_and_nan_wins():
    n, k = 49152, 576
    x = torch.ones(2, k, device=DEV, dtype=torch.bfloat16)
    w = torch.zeros(n, k, device=DEV, dtype=torch.bfloat16)
    w[[300, 30000, 45000]] = 1.0  # a three-way tie in row 0
    x[1, 5] = float("nan")  # every logit of row 1 is NaN: the first column wins
    ids = greedy_lm_head(x, w)
    assert ids.tolist() == [300, 0]
    assert ids.tolist() == argmax_ref(greedy_logits_ref(x, w)).tolist()


def test_policy_is_shape_only_and_fits():
    for m in (1, 2, 3, 4):
        for k, eb in ((576, 2), (576, 1), (4096, 2), (960, 4), (64, 2)):
            cfg = choose_greedy_blocks(m, k, eb)
            assert cfg == choose_greedy_blocks(m, k, eb)
            assert cfg.k_main <= k <= cfg.k_main + cfg.k_tail
            assert cfg.block_n & (cfg.block_n - 1) == 0


def test_falls_back_beyond_its_rows():
    """More rows than MAX_ROWS (or a CPU tensor) take the reference, with the same result."""
    x, w, scale, nw, off = _inputs(9, 1000, 576, torch.float32, torch.float32, True, seed=1)
    ids = greedy_lm_head(x, w, norm_weight=nw, eps=1e-6, offsets=off)
    assert torch.equal(ids, greedy_lm_head_ref(x, w, norm_weight=nw, eps=1e-6, offsets=off))
    cpu = greedy_lm_head(x.cpu(), w.cpu(), norm_weight=nw.cpu(), eps=1e-6, offsets=off.cpu())
    assert torch.equal(cpu, ids.cpu())
