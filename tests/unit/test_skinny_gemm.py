"""outpace.kernels.skinny_gemm on CPU: the references are the unfused torch compositions the model
runs today (HF's arithmetic), the dispatchers fall back to them off CUDA, and the launch
configuration is a function of shapes only. The kernels themselves are checked against these
references in test_kernels_interpret.py (interpreter) and tests/gpu/test_kernels.py."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from outpace.kernels import next_pow2
from outpace.kernels.norm import rms_norm_ref
from outpace.kernels.skinny_gemm import (SMALL_M_MAX, norm_small_linear,
                                          norm_small_linear_ref, norm_small_linear_silu_mul,
                                          norm_small_linear_silu_mul_ref, silu_mul, silu_mul_ref,
                                          small_linear, small_linear_ref, small_linear_silu_mul,
                                          small_linear_silu_mul_ref)
from outpace.kernels.skinny_gemm.blocks import (_ONE_ROW_M, _ROW_WARPS, _ROW_WARPS_MAX_K,
                                                 _SUM_ROWS, choose_blocks, row_warps_blocks)

DTYPES = [torch.float32, torch.bfloat16]


def _inputs(m, n, k, dtype, seed=0, *, w_dtype=None):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 2).to(dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(w_dtype or dtype)
    nw = (1 + 0.2 * torch.randn(k, generator=g)).to(w_dtype or dtype)
    return x, w, nw


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_norm_small_linear_ref_is_norm_then_linear(dtype):
    x, w, nw = _inputs(5, 48, 64, dtype)
    assert torch.equal(norm_small_linear_ref(x, nw, 1e-6, w),
                       F.linear(rms_norm_ref(x, nw, 1e-6), w))


@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_refs_and_dispatchers_fp32_activations_over_16bit_weights(w_dtype):
    """weight_dtype: fp32 x (and RMSNorm weight, residual) over a bf16 / fp16 weight compute in
    fp32 with the weight upcast: exactly the fp32 results over the rounded weight, fp32 out."""
    x, w32, nw = _inputs(3, 2 * 20, 64, torch.float32, seed=5)
    r = torch.randn(3, 40)
    w = w32.to(w_dtype)
    wf = w.float()
    assert not torch.equal(small_linear_ref(x, w), small_linear_ref(x, w32))  # rounding shows
    for fn in (small_linear_ref, small_linear, small_linear_silu_mul_ref,
               small_linear_silu_mul):
        y = fn(x, w)
        assert y.dtype == torch.float32 and torch.equal(y, fn(x, wf))
    for fn in (small_linear_ref, small_linear):
        y = fn(x, w, residual=r)
        assert y.dtype == torch.float32 and torch.equal(y, fn(x, wf, residual=r))
    for fn in (norm_small_linear_ref, norm_small_linear, norm_small_linear_silu_mul_ref,
               norm_small_linear_silu_mul):
        y = fn(x, nw, 1e-5, w)
        assert y.dtype == torch.float32 and torch.equal(y, fn(x, nw, 1e-5, wf))
    assert torch.equal(norm_small_linear_ref(x, nw, 1e-5, w),
                       F.linear(rms_norm_ref(x, nw, 1e-5), wf))


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=str)
def test_silu_mul_ref_is_silu_times_up(dtype):
    gu = (torch.randn(7, 2 * 33) * 4).to(dtype)
    g, u = gu[:, :33], gu[:, 33:]
    assert torch.equal(silu_mul_ref(gu), F.silu(g) * u)
    a = F.silu(g)  # outpace.models.llama.LlamaMLP's in-place form
    a.mul_(u)
    assert torch.equal(silu_mul_ref(gu), a)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gate_up_refs_are_the_mlp_composition(dtype):
    x, w, nw = _inputs(4, 2 * 24, 64, dtype, seed=1)
    gu = F.linear(rms_norm_ref(x, nw, 1e-6), w)
    assert torch.equal(norm_small_linear_silu_mul_ref(x, nw, 1e-6, w),
                       F.silu(gu[:, :24]) * gu[:, 24:])
    gu = F.linear(x, w)
    assert torch.equal(small_linear_silu_mul_ref(x, w), F.silu(gu[:, :24]) * gu[:, 24:])


def test_small_linear_ref_residual_rounds_once():
    x, w, _ = _inputs(3, 40, 64, torch.float32, seed=2)
    r = torch.randn(3, 40)
    assert torch.equal(small_linear_ref(x, w), F.linear(x, w))
    assert torch.equal(small_linear_ref(x, w, residual=r), r + F.linear(x, w))  # fp32: as torch
    xb, wb = x.bfloat16(), w.bfloat16()
    y = small_linear_ref(xb, wb, residual=r)  # fp32 residual stream over bf16 weights
    assert y.dtype == torch.float32
    assert torch.equal(y, r + F.linear(xb.float(), wb.float()))
    rb = r.bfloat16()
    y = small_linear_ref(xb, wb, residual=rb)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, (rb.float() + F.linear(xb.float(), wb.float())).bfloat16())
    # one rounding is within one bf16 ulp of torch's two (linear, then add)
    torch.testing.assert_close(y, rb + F.linear(xb, wb), atol=2 ** -6, rtol=2 ** -7)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dispatchers_on_cpu_return_the_reference(dtype):
    x, w, nw = _inputs(3, 2 * 20, 48, dtype, seed=3)
    r = torch.randn(3, 40).to(dtype)
    pairs = [
        (small_linear(x, w), small_linear_ref(x, w)),
        (small_linear(x, w, residual=r), small_linear_ref(x, w, residual=r)),
        (norm_small_linear(x, nw, 1e-6, w), norm_small_linear_ref(x, nw, 1e-6, w)),
        (norm_small_linear_silu_mul(x, nw, 1e-6, w),
         norm_small_linear_silu_mul_ref(x, nw, 1e-6, w)),
        (small_linear_silu_mul(x, w), small_linear_silu_mul_ref(x, w)),
        (silu_mul(r), silu_mul_ref(r)),
    ]
    for got, want in pairs:
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_dispatcher_fills_out_buffer_on_cpu():
    x, w, nw = _inputs(2, 30, 48, torch.float32, seed=4)
    out = torch.full((2, 30), float("nan"))
    y = norm_small_linear(x, nw, 1e-6, w, out=out)
    assert y is out and torch.equal(out, norm_small_linear_ref(x, nw, 1e-6, w))
    out = torch.empty(2, 15)
    assert silu_mul(out.new_ones(2, 30), out=out) is out


SHAPES = [(960, 576), (576, 576), (1536, 576), (576, 1536), (49152, 576), (6144, 4096),
          (4096, 4096), (14336, 4096), (4096, 14336), (128256, 4096), (50, 72), (40, 600)]


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 16])
def test_choose_blocks_is_a_valid_shape_policy(m):
    for n, k in SHAPES:
        b = choose_blocks(m, n, k)
        assert b == choose_blocks(m, n, k)  # a pure function of the shapes
        for v in (b.block_m, b.block_n, b.block_k):
            assert v == next_pow2(v)  # Triton block shapes are powers of two
        assert b.block_n <= 128
        if b.use_dot:  # one row block covers every row
            assert b.block_m >= m and min(b.block_m, b.block_n, b.block_k) >= 16
        elif b.rw_steps:  # a warp a row: whole 256-column steps covering the row
            assert m in _ROW_WARPS and k <= _ROW_WARPS_MAX_K
            assert (b.block_m, b.block_n) == _ROW_WARPS[m] and b.num_warps == b.block_m
            assert b.block_k == 256 and not b.tail_k
            assert (b.rw_steps * 256 <= k or b.rw_steps == 1)  # one masked step: K < 256
            assert k <= b.rw_steps * 256 + b.rw_rest * b.rw_rest_w
            assert b.rw_rest_w == 256 or (b.rw_rest == 1 and b.rw_rest_w < 256)
            rest = k - b.rw_steps * 256  # covered by the narrowest power of two of steps
            assert b.rw_rest == 0 or (b.rw_rest * b.rw_rest_w) // 2 < rest
        else:  # rows in blocks of at most _SUM_ROWS, of one at _ONE_ROW_M (more programs);
            # the product tile stays within the register budget
            assert b.block_m == (1 if m in _ONE_ROW_M else min(next_pow2(m), _SUM_ROWS))
            assert b.block_m * b.block_n * b.block_k <= 16384
        if m == 1 and 576 <= n <= 3072:
            assert -(-n // b.block_n) >= 100  # small weights spread over the SMs
        if b.tail_k:  # whole block_k steps plus one narrower tile that covers the rest
            assert not b.use_dot and b.tail_k == next_pow2(b.tail_k)
            assert b.block_k <= k and 0 < k % b.block_k <= b.tail_k
            assert b.block_k + b.tail_k < next_pow2(k)  # less padding than one tile
    assert choose_blocks(SMALL_M_MAX, 576, 576).block_m == SMALL_M_MAX


def test_one_row_programs_keep_one_padded_tile():
    for n, k in [(576, 576), (576, 1536), (49152, 576)]:
        assert choose_blocks(1, n, k).tail_k == 0


@pytest.fixture
def no_row_warps():
    """choose_blocks with the broadcast path's several-row programs, which 2-4 rows of up to
    _ROW_WARPS_MAX_K columns no longer take (a warp a row instead): still the policy for wider
    rows, and what KernelOptions.row_warps_rows without those rows turns back on."""
    return functools.partial(choose_blocks, row_warps=frozenset())


@pytest.mark.parametrize("m", [3])
def test_several_row_programs_split_off_their_padding(m, no_row_warps):
    """K = 576 (SmolLM2's hidden size) reads 512 + 64 columns, not a 1024-wide tile of which
    448 are masked; K = 1536 reads 1024 + 512; a power of two, or a K whose split saves
    nothing (960 = 512 + 448 -> 512 + 512), keeps one tile."""
    assert (no_row_warps(m, 576, 576).block_k, no_row_warps(m, 576, 576).tail_k) == (512, 64)
    assert (no_row_warps(m, 1536, 576, gate_up=True).block_k,
            no_row_warps(m, 1536, 576, gate_up=True).tail_k) == (512, 64)
    assert (no_row_warps(m, 576, 1536).block_k, no_row_warps(m, 576, 1536).tail_k) == (1024, 512)
    for k in (512, 1024, 960):
        assert no_row_warps(m, 576, k).tail_k == 0
        assert no_row_warps(m, 576, k).block_k == next_pow2(k)


def test_three_rows_take_one_warp_a_row_a_program():
    """The k = 2 verify runs a one-warp program per row and column block, the row read as
    256-column steps and a rest (run 32, EAGLE-3 k = 2 step graph 0.6435 -> 0.5935 ms); rows
    wider than measured keep a broadcast program per row."""
    for n, k, gate_up in [(480, 576, True), (576, 576, False), (1536, 576, True),
                          (576, 1536, False)]:
        b = choose_blocks(3, n, k, gate_up=gate_up)
        assert (b.block_m, b.block_n, b.num_warps) == (1, 2, 1)
        assert (b.rw_steps, b.rw_rest, b.rw_rest_w) == ((2, 1, 64) if k == 576
                                                        else (4, 2, 256))
    b = choose_blocks(3, 576, 1728)  # EAGLE-3's fc
    assert b.block_m == 1 and not b.rw_steps


def test_two_and_four_rows_take_a_warp_a_row():
    """Batch-2 and batch-4 decode (run 25, step graphs: 0.596 -> 0.528 and 0.675 -> 0.604 ms):
    programs of two rows in two warps, each row read as 256-column steps and a rest (576 =
    2 x 256 + 64, 1536 = 4 x 256 + 2 x 256); rows wider than measured keep the other path."""
    for n, k, gate_up in [(480, 576, True), (576, 576, False), (1536, 576, True),
                          (576, 1536, False)]:
        for m, block_n in ((2, 2), (4, 4)):
            b = choose_blocks(m, n, k, gate_up=gate_up)
            assert (b.block_m, b.block_n, b.num_warps) == (2, block_n, 2)
            assert (b.rw_steps, b.rw_rest, b.rw_rest_w) == ((2, 1, 64) if k == 576
                                                            else (4, 2, 256))
    assert not choose_blocks(2, 576, 1728).rw_steps  # EAGLE-3's fc
    assert row_warps_blocks(64, 2, 2)[-3:] == (1, 0, 256)
    assert row_warps_blocks(1728, 2, 2)[-3:] == (4, 4, 256)
    assert row_warps_blocks(1152, 2, 2)[-3:] == (4, 1, 128)


def test_several_row_broadcast_programs_run_one_warp(no_row_warps):
    """Several-row broadcast programs (3 rows of every SmolLM2 projection) run one warp (run
    14: 0.825 -> 0.803 ms a step); one-row programs and larger products keep 4 warps."""
    for n, k, gate_up in [(480, 576, False), (576, 576, False), (1536, 576, True),
                          (576, 1536, False), (576, 1728, False)]:  # the last: EAGLE-3's fc
        assert no_row_warps(3, n, k, gate_up=gate_up).num_warps == 1
        assert no_row_warps(1, n, k, gate_up=gate_up).num_warps == 4
    big = no_row_warps(4, 3072, 2048)  # a [2, 4, 2048] product
    assert not big.use_dot and big.num_warps == 4


# ---- int8 weights (a draft LM head, HeadProposer's draft_lm_head_dtype) ----------------------


def test_quantize_int8_rows_round_trip_and_scales():
    """Per row: the largest |w| maps to +-127, every value to the nearest integer step (error at
    most half a step), an all-zero row to zeros with scale 1."""
    from outpace.kernels.int8_linear import quantize_int8_rows
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 96, generator=g) * torch.linspace(0.01, 3.0, 40)[:, None]
    w[7] = 0.0
    q, scale = quantize_int8_rows(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (40,)
    assert torch.equal(scale[7], torch.tensor(1.0)) and not q[7].any()
    nonzero = [i for i in range(40) if i != 7]
    assert (q[nonzero].abs().amax(dim=1) == 127).all()
    err = (q.float() * scale[:, None] - w).abs()
    assert (err <= scale[:, None] / 2 + 1e-7).all()
    torch.testing.assert_close(scale[nonzero], w[nonzero].abs().amax(dim=1) / 127)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_int8_linear_ref_and_dispatcher(dtype):
    """(x @ q.T) * scale summed in fp32, one rounding to x's dtype; off CUDA the dispatcher is the
    reference, and it also takes the integers held as fp32 (what HeadProposer keeps on CPU)."""
    from outpace.kernels.int8_linear import int8_linear, int8_linear_ref, quantize_int8_rows
    x, w, _ = _inputs(3, 50, 64, dtype, seed=4, w_dtype=torch.float32)
    q, scale = quantize_int8_rows(w)
    y = int8_linear_ref(x, q, scale)
    assert y.dtype == dtype and y.shape == (3, 50)
    want = ((x.double() @ q.double().T) * scale.double()).to(dtype)
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(int8_linear(x, q, scale), y)
    assert torch.equal(int8_linear(x, q.float(), scale), y)
    # close to the unquantized product: the error is the rounding of the weights
    torch.testing.assert_close(y.float(), (x.float() @ w.T), atol=0.1, rtol=0.05)


@pytest.mark.parametrize("m", [17, 33, 64, 65, 96, 128, 129, 192, 256])
def test_prefill_rows_take_row_blocks_of_tl_dot(m):
    """Above SMALL_M_MAX rows (a short prefill: small_linear.mid_rows_ok) tl.dot programs take
    16 rows up to 64, 32 above, twice that for a weight of 2048+ rows (gate_up's two tiles of
    1536), 16 columns (32 for a one-tile launch above 128 rows), with K steps of at most 128
    (H200 sweeps, bench_small_linear_run27*.json); one block of every row lost on every
    SmolLM2 projection there."""
    rows = 16 if m <= 64 else 32
    wide_plain = 32 if m > 128 else 16
    for n, k, gate_up, want in [(480, 576, True, (rows, 16)), (576, 576, False, (rows, wide_plain)),
                                (576, 1536, False, (rows, wide_plain)),
                                (1536, 576, True, (2 * rows, 16)), (480, 1152, True, (rows, 16))]:
        b = choose_blocks(m, n, k, gate_up=gate_up)
        assert b.use_dot and (b.block_m, b.block_n) == want and b.block_k <= 128
        assert min(b.block_m, b.block_n, b.block_k) >= 16
    assert choose_blocks(16, 576, 576, use_dot=True).block_m == 16  # one block up to 16 rows


def test_mid_rows_ok_takes_narrow_16_bit_projections_of_17_to_128_rows():
    """The shape rule only (use_triton is CUDA's; triton_ok stands in for it here): bf16 / fp16
    x of its weight's dtype, 17..MID_M_MAX rows, K <= 2048, at most 4096 columns split."""
    from outpace.kernels import skinny_gemm as sl

    def ok(m, n, k, dtype=torch.bfloat16, w_dtype=None, n_cols=None, triton_ok=True):
        x, w = torch.zeros(m, k, dtype=dtype), torch.zeros(n, k, dtype=w_dtype or dtype)
        return sl.mid_rows_ok(x, w, n_cols, triton_ok=triton_ok)

    assert ok(17, 960, 576) and ok(sl.MID_M_MAX, 3072, 576, n_cols=1536)
    assert ok(40, 960, 1152, torch.float16)
    assert not ok(16, 960, 576)  # the few-row kernels' own range
    assert not ok(sl.MID_M_MAX + 1, 960, 576)  # cuBLAS beyond (row blocks not measured)
    assert not ok(64, 960, 576, torch.float32)  # fp32 rows: split_mm / cuBLAS
    assert not ok(64, 960, 576, torch.float32, torch.bfloat16)  # the faithful mode
    assert not ok(64, 6144, 4096)  # 8B-wide: not measured
    assert not ok(64, 28672, 4096, n_cols=14336)
    assert not ok(64, 960, 576, triton_ok=False)  # CPU
    assert not ok(64, 960, 576, triton_ok=None)  # use_triton's own answer on a CPU tensor
