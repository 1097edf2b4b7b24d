"""The few-row projections with a warp a row (small_linear_blocks.row_warps_blocks, the
launch policy's pick at 2, 3 and 4 rows) against the references, for every fused variant: plain,
residual, norm, norm + gate_up + silu, norm + qkv + rope + KV store, an int8 weight; bf16 and
fp32 activations, fp32 over bf16 weights. Each case also runs with the path turned off
(small_linear_blocks' _ROW_WARPS emptied), so the one-row programs it replaced stay covered.
Fresh random inputs from the kernel tests' own helpers."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
triton = pytest.importorskip("triton")

import outpace.kernels.skinny_gemm.blocks as sl  # noqa: E402
from tests.gpu import test_kernels as tk  # noqa: E402
from tests.gpu import test_rope_store as tr  # noqa: E402

ROWS = [2, 3, 4]
# (activation dtype, weight dtype); the last: fp32 over bf16 weights (weight_dtype)
X_W_DTYPES = [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
              (torch.float32, torch.bfloat16)]


@pytest.fixture(params=[True, False], ids=["row-warps", "one-row-programs"])
def row_warps(request):
    from outpace.kernels.options import use_kernel_options
    from outpace.runner_config import KernelOptions
    rows = KernelOptions().row_warps_rows if request.param else frozenset()
    with use_kernel_options(KernelOptions(row_warps_rows=rows)):
        yield request.param


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("name", ["smol-qkv", "smol-o", "smol-down", "smol-gate_up"])
def test_small_linear(row_warps, name, m, dtype):
    n, k = tk.SMOL[name.split("-")[1]]
    from outpace.kernels.options import current  # what the launcher passes choose_blocks
    assert (sl.choose_blocks(m, n, k, row_warps=current().row_warps_rows).rw_steps > 0) \
        == row_warps
    tk.test_small_linear(name, (n, k), m, dtype)


@pytest.mark.parametrize("res_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("name", ["smol-o", "smol-down"])
def test_small_linear_residual(row_warps, name, m, res_dtype):
    tk.test_small_linear_residual(name, m, res_dtype)


@pytest.mark.parametrize("x_dtype,dtype", X_W_DTYPES, ids=str)
@pytest.mark.parametrize("m", ROWS)
def test_norm_small_linear(row_warps, m, x_dtype, dtype):
    tk.test_norm_small_linear("smol-qkv", m, x_dtype, dtype)


@pytest.mark.parametrize("x_dtype,dtype", X_W_DTYPES, ids=str)
@pytest.mark.parametrize("m", ROWS)
def test_gate_up_silu_mul(row_warps, m, x_dtype, dtype):
    tk.test_gate_up_silu_mul("smol-gate_up", m, x_dtype, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("with_norm", [True, False])
def test_norm_qkv_rope_store(row_warps, dtype, m, with_norm):
    tr.test_norm_qkv_rope_store_matches_reference(dtype, m, 9, 3, 64, 576, with_norm)


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("m", ROWS)
def test_int8_linear(row_warps, m, x_dtype):
    """The broadcast path over an int8 weight (forced: an LM head's width takes tl.dot)."""
    tk.test_int8_linear(3000, 576, m, False, x_dtype)
