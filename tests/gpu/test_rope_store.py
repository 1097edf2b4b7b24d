"""The fused rope + KV store kernel vs rope-then-store references on CUDA, on fresh random
inputs, and the Triton backend's forward_rope vs rope + forward."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("triton")

from outpace.kernels.rope import (apply_rope_and_store_ref,  # noqa: E402
                                  apply_rope_and_store_triton, apply_rope_triton)

DEV = "cuda"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("t,hq,hkv,d,bs", [(1, 9, 3, 64, 16), (5, 9, 3, 64, 16),
                                          (37, 32, 8, 128, 16), (3, 4, 4, 24, 4),
                                          (200, 8, 1, 128, 32)])
def test_rope_and_store_matches_reference(dtype, t, hq, hkv, d, bs):
    g = torch.Generator(device=DEV).manual_seed(t * d + hq)
    blocks = t // bs + 4
    qkv = torch.randn(t, hq + 2 * hkv, d, device=DEV, generator=g).to(dtype)
    tables = torch.randn(300, d, device=DEV, generator=g)  # [max_pos, D] table
    cos, sin = tables.cos(), tables.sin()
    pos = torch.randint(0, 300, (t,), device=DEV, generator=g)
    slots = torch.randperm((blocks - 1) * bs, device=DEV, generator=g)[:t] + bs
    slots[::3] = -1  # padded rows
    cache = torch.full((2, 2, blocks, bs, hkv, d), float("nan"), dtype=dtype, device=DEV)
    ref_cache = cache.clone()
    k, v = qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    k_before = k.clone()
    q_ref = qkv[:, :hq].clone()
    apply_rope_and_store_ref(q_ref, k, v, cos, sin, pos, ref_cache, 1, slots)
    q = qkv[:, :hq]  # a strided view, rotated in place
    apply_rope_and_store_triton(q, k, v, cos, sin, pos, cache, 1, slots)
    # The kernel's fused multiply-adds may round differently in the last bit (then, rarely,
    # the bf16/fp16 value by one ulp); a wrong rotation or slot is off by O(1).
    tol = {torch.float32: dict(atol=1e-6, rtol=1e-6), torch.float16: dict(atol=1e-3, rtol=2 ** -10),
           torch.bfloat16: dict(atol=1e-2, rtol=2 ** -7)}[dtype]
    torch.testing.assert_close(q, q_ref, **tol)
    torch.testing.assert_close(cache[:, :, 1:], ref_cache[:, :, 1:], equal_nan=True, **tol)
    assert torch.isnan(cache[:, :, 0].float()).all(), "a padded row was written"
    assert torch.isnan(cache[0].float()).all(), "another layer slot was written"
    assert torch.equal(k, k_before), "k was modified"


def test_backend_forward_rope_equals_rope_then_forward():
    from outpace.attention.triton_paged import TritonPagedBackend
    from tests.unit.kernel_cases import make_batch
    seqs = [(1, 40), (4, 300), (1, 1), (6, 6)]
    hkv, group, d = 3, 3, 64
    b = make_batch(seqs, hkv, group, d, torch.bfloat16, DEV, seed=5)
    tables = torch.randn(4096, d // 2, device=DEV)
    cos, sin = tables.cos(), tables.sin()
    t = b.q.shape[0]
    pos = torch.randint(0, 4096, (t,), device=DEV)
    k, v = b.k, b.v
    outs = []
    for fused in (False, True):
        cache = b.kv_cache.clone()
        backend = TritonPagedBackend(cache, hkv * group, hkv, d, d ** -0.5)
        q = b.q.clone()
        if fused:
            outs.append(backend.forward_rope(b.layer, q, k.clone(), v, b.meta, cos, sin, pos))
        else:
            kr = k.clone()
            apply_rope_triton(q, kr, cos, sin, pos)
            outs.append(backend.forward(b.layer, q, kr, v, b.meta))
        outs.append(cache)
    torch.testing.assert_close(outs[2], outs[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(outs[3], outs[1], atol=1e-6, rtol=1e-6, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,hq,hkv,d,k", [(1, 9, 3, 64, 576), (5, 9, 3, 64, 576),
                                          (16, 9, 3, 64, 576), (1, 32, 8, 128, 4096),
                                          (7, 4, 4, 24, 100), (3, 9, 3, 64, 1152)])
@pytest.mark.parametrize("with_norm", [True, False])
def test_norm_qkv_rope_store_matches_reference(dtype, m, hq, hkv, d, k, with_norm):
    """The qkv projection with norm (without: an EAGLE-3 head's normalized input), rope and the
    KV store in its epilogue (skinny_gemm/) vs norm_small_linear + rope + store references."""
    from outpace.kernels.skinny_gemm import norm_qkv_rope_store_ref, norm_qkv_rope_store_triton
    g = torch.Generator(device=DEV).manual_seed(m * k + d)
    blocks, bs = m // 4 + 4, 4
    x = (torch.randn(m, k, device=DEV, generator=g) * 2).to(dtype)
    nw = (1 + 0.1 * torch.randn(k, device=DEV, generator=g)).to(dtype) if with_norm else None
    w = (torch.randn((hq + 2 * hkv) * d, k, device=DEV, generator=g) * k ** -0.5).to(dtype)
    table = torch.randn(500, d // 2, device=DEV, generator=g)
    cos, sin = table.cos(), table.sin()
    pos = torch.randint(0, 500, (m,), device=DEV, generator=g)
    slots = torch.randperm((blocks - 1) * bs, device=DEV, generator=g)[:m] + bs
    slots[m // 2] = -1 if m > 1 else slots[0]
    cache = torch.full((2, 2, blocks, bs, hkv, d), float("nan"), dtype=dtype, device=DEV)
    ref_cache = cache.clone()
    want = norm_qkv_rope_store_ref(x, nw, 1e-5, w, hq, hkv, d, cos, sin, pos, ref_cache, 1,
                                   slots)
    got = norm_qkv_rope_store_triton(x, nw, 1e-5, w, hq, hkv, d, cos, sin, pos, cache, 1, slots)
    # summation order moves a projection output by an ulp, and rope mixes the pair
    scale = want.float().abs().max().item()
    tol = dict(atol=1e-5 * scale, rtol=1e-5) if dtype == torch.float32 else dict(
        atol=4 * 2 ** -7 * scale, rtol=2 ** -7)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(cache[:, :, 1:], ref_cache[:, :, 1:], equal_nan=True, **tol)
    assert torch.isnan(cache[:, :, 0].float()).all(), "a padded row was written"
    assert torch.isnan(cache[0].float()).all(), "another layer slot was written"
