"""fp32 activations over bf16-stored weights (weight_dtype="bfloat16", dtype="float32") on CUDA.

* the few-row kernels (kernels/skinny_gemm/) read the bf16 weight, upcast its tiles and
  compute in fp32: fp32 results matching the references (fp32 over the upcast weight) at
  M = 1, 3 (broadcast-sum path), 5, 8, 16 (tl.dot path), where a kernel that rounded its
  input to bf16 would be far off;
* above 16 rows, kernels/bf16x3.split_mm (three bf16 pieces of x in one cuBLAS GEMM with
  fp32 output) matches the fp64 product to fp32 tolerance, and upcast_linear takes it;
* the engine on CUDA with graphs (few-row kernels, split_mm above 16 rows,
  Triton attention over an fp32 or a bf16 KV pool), with and without a draft head, gives the
  greedy tokens of the CPU fp32 engine whose model had its matrices rounded to bf16 (over the
  same pool dtype).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("triton")

from outpace import SamplingParams  # noqa: E402
from outpace.kernels import skinny_gemm as sl  # noqa: E402
from outpace.kernels.norm import rms_norm_ref  # noqa: E402
from outpace.kernels.bf16x3 import split_mm, split_pieces_ref, split_pieces_triton  # noqa: E402
from outpace.models.weight_dtype import store_weights_in_, upcast_linear, weight_bytes  # noqa: E402
from tests.engine_helpers import make_engine, run_batch  # noqa: E402
from tests.speculative.spec_helpers import repetitive_prompts, tiny_target  # noqa: E402

DEV = "cuda"
SMOL = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
        "lm_head": (49152, 576)}
ROWS = [1, 3, 5, 8, 16]
# fp32 arithmetic in another summation order (tl.dot vs cuBLAS); rounding the input to bf16
# instead would be off by ~1e-2 relative
TOL = dict(atol=1e-4, rtol=1e-4)


def _inputs(m, n, k, seed):
    """fp32 x [m, k] (a strided view), bf16 w [n, k] scaled so outputs are O(1), fp32 RMSNorm
    weight near 1."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = (torch.randn(m, k + 64, device=DEV, generator=g) * 2)[:, 32:32 + k]
    w = (torch.randn(n, k, device=DEV, generator=g) / k ** 0.5).bfloat16()
    nw = 1 + 0.2 * torch.randn(k, device=DEV, generator=g)
    return x, w, nw


def _check(got, want):
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("name", sorted(SMOL))
def test_small_linear(name, m):
    n, k = SMOL[name]
    x, w, _ = _inputs(m, n, k, seed=m + n)
    assert sl._fast(x, w)  # the dispatcher runs the kernel, not the reference
    _check(sl.small_linear_triton(x, w), sl.small_linear_ref(x, w))
    r = torch.randn(m, n, device=DEV)
    _check(sl.small_linear_triton(x, w, residual=r), sl.small_linear_ref(x, w, residual=r))


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("name", ["qkv", "lm_head"])
def test_norm_small_linear(name, m):
    n, k = SMOL[name]
    x, w, nw = _inputs(m, n, k, seed=m + 3 * n)
    got = sl.norm_small_linear_triton(x, nw, 1e-5, w)
    _check(got, sl.norm_small_linear_ref(x, nw, 1e-5, w))
    rounded_input = F.linear(rms_norm_ref(x, nw, 1e-5).bfloat16().float(), w.float())
    assert not torch.allclose(got, rounded_input, **TOL)


@pytest.mark.parametrize("m", ROWS)
def test_gate_up_silu_mul(m):
    n, k = SMOL["gate_up"]
    x, w, nw = _inputs(m, n, k, seed=m + 5 * n)
    _check(sl.norm_small_linear_silu_mul_triton(x, nw, 1e-6, w),
           sl.norm_small_linear_silu_mul_ref(x, nw, 1e-6, w))
    _check(sl.small_linear_silu_mul_triton(x, w), sl.small_linear_silu_mul_ref(x, w))


@pytest.mark.parametrize("m", ROWS)
def test_norm_qkv_rope_store(m):
    hq, hkv, d, k = 9, 3, 64, 576
    x, w, nw = _inputs(m, (hq + 2 * hkv) * d, k, seed=m * k + d)
    g = torch.Generator(device=DEV).manual_seed(m)
    blocks, bs = m // 4 + 4, 4
    table = torch.randn(500, d // 2, device=DEV, generator=g)
    cos, sin = table.cos(), table.sin()
    pos = torch.randint(0, 500, (m,), device=DEV, generator=g)
    slots = torch.randperm((blocks - 1) * bs, device=DEV, generator=g)[:m] + bs
    slots[m // 2] = -1 if m > 1 else slots[0]
    cache = torch.full((2, 2, blocks, bs, hkv, d), float("nan"), device=DEV)  # fp32 pool
    ref_cache = cache.clone()
    args = (hq, hkv, d, cos, sin, pos)
    want = sl.norm_qkv_rope_store_ref(x, nw, 1e-5, w, *args, ref_cache, 1, slots)
    got = sl.norm_qkv_rope_store_triton(x, nw, 1e-5, w, *args, cache, 1, slots)
    scale = want.abs().max().item()
    tol = dict(atol=1e-4 * scale, rtol=1e-4)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(cache[:, :, 1:], ref_cache[:, :, 1:], equal_nan=True, **tol)
    assert torch.isnan(cache[:, :, 0]).all(), "a padded row was written"


@pytest.mark.parametrize("m", [17, 96, 512])
@pytest.mark.parametrize("name", sorted(SMOL))
def test_split_mm_many_rows(name, m):
    """fp32 x over a bf16 weight for prefill chunks and wide batches: the fp64 product to fp32
    tolerance, with a bias through upcast_linear, and far from a product whose input was
    rounded to bf16 (what a plain bf16 GEMM would compute)."""
    n, k = SMOL[name]
    x, w, _ = _inputs(m, n, k, seed=m * n)
    assert torch.equal(split_pieces_triton(x), split_pieces_ref(x))
    want = F.linear(x.double(), w.double()).float()
    got = split_mm(x, w)
    _check(got, want)
    assert torch.equal(upcast_linear(x, w), got)
    bias = torch.randn(n, device=DEV)
    _check(upcast_linear(x, w, bias), want + bias)
    rounded = F.linear(x.bfloat16(), w).float()
    assert not torch.allclose(rounded, want, **TOL)


# ----------------------------------------------------------------------------- engine

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    from outpace.training.init_draft import init_draft
    from tests.speculative.spec_helpers import write_target_folder
    root = tmp_path_factory.mktemp("weight_dtype_heads")
    target = write_target_folder(tiny_target(seed=0)[1], root / "target")
    return {m: init_draft(m, str(target), root / m, seed=1, quiet=True) for m in ("eagle3", "mtp")}


def _spec(heads, method):
    if method is None:
        return None
    spec = {"method": method, "model": str(heads[method]), "num_speculative_tokens": 3}
    if method == "mtp":
        spec["mtp_mode"] = "eagle"
    return spec


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16"])
@pytest.mark.parametrize("num_prompts", [1, 5])
@pytest.mark.parametrize("method", [None, "eagle3", "mtp"])
def test_cuda_engine_equals_cpu_fp32_with_rounded_weights(heads, method, num_prompts,
                                                          kv_cache_dtype):
    """kv_cache_dtype bfloat16: the CPU engine over a bf16 pool is the reference (itself
    checked against rounded K / V in tests/speculative/test_kv_cache_dtype.py)."""
    model, cfg, tok = tiny_target(seed=0)
    ref = copy.deepcopy(model)
    for p in ref.parameters():
        if p.dim() == 2:
            p.data = p.data.bfloat16().float()
    prompts = repetitive_prompts(num_prompts, 11)
    want = run_batch(make_engine((ref, cfg, tok), max_num_seqs=8,
                                 kv_cache_dtype=kv_cache_dtype), prompts, GREEDY)
    store_weights_in_(model, torch.bfloat16)
    fp32_bytes = weight_bytes(ref)
    model = model.to(DEV)
    assert weight_bytes(model) < 0.52 * fp32_bytes
    eng = make_engine((model, cfg, tok), device="cuda", dtype="float32",
                      weight_dtype="bfloat16", kv_cache_dtype=kv_cache_dtype,
                      speculative_config=_spec(heads, method),
                      max_num_seqs=8)  # CUDA graphs and overlap on (the defaults)
    assert eng.runner.kv_cache.dtype == (torch.float32 if kv_cache_dtype == "auto"
                                         else torch.bfloat16)
    if method is not None:  # the head's matrices are stored in bf16 too, its norms not
        for name, p in eng.runner.proposer.head.named_parameters():
            assert p.dtype == (torch.bfloat16 if p.dim() == 2 else torch.float32), name
    assert run_batch(eng, prompts, GREEDY) == want
    assert eng.runner.fused.replays > 10  # the graphs ran
