"""Programmatic dependent launch (outpace/kernels/pdl.py) on CUDA: it is really on where the GPU
and triton support it, and a long chain of dependent PDL kernels, eager and replayed from a CUDA
graph, gives bit-for-bit what the same kernels give launched without PDL (a kernel that read its
input before the grid-dependency wait would race with its predecessor and differ)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("triton")

from outpace.kernels import pdl  # noqa: E402
from outpace.kernels.argmax import argmax_rows  # noqa: E402
from outpace.kernels.norm import fused_add_rms_norm, rms_norm  # noqa: E402
from outpace.kernels.options import use_kernel_options  # noqa: E402
from outpace.kernels.skinny_gemm import (norm_small_linear, norm_small_linear_silu_mul,  # noqa: E402,E501
                                          small_linear, small_linear_ref)
from outpace.runner_config import KernelOptions  # noqa: E402

DEV = "cuda"


def test_pdl_is_on_where_supported():
    hopper = torch.cuda.get_device_capability()[0] >= 9
    opts = pdl.launch_options(torch.empty(1, device=DEV))
    print("PDL supported:", pdl.supported(torch.device(DEV)), "options:", opts)
    if hopper:  # the engine's speed on H100/H200 assumes it; a triton without it must show
        assert pdl.supported(torch.device(DEV)) and opts == {"USE_PDL": True, "launch_pdl": True}
    assert pdl.launch_options(torch.empty(1)) == {"USE_PDL": False}  # CPU tensors: never


def _chain(h, weights):
    """A decoder-like chain: every kernel reads what the one before it wrote."""
    for nw, w_qkv, w_o, w_gu, w_down in weights:
        qkv = norm_small_linear(h, nw, 1e-5, w_qkv)
        h = small_linear(qkv[:, :h.shape[1]], w_o, residual=h)
        a = norm_small_linear_silu_mul(h, nw, 1e-5, w_gu)
        h = small_linear(a, w_down, residual=h)
        normed, h = fused_add_rms_norm(h, h, nw, 1e-5)
        h = rms_norm(normed, nw, 1e-5) + 0 * h  # + a torch kernel between two PDL kernels
    return h, argmax_rows(h)


def _weights(hidden, inter, layers, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)

    def r(*shape):
        return (torch.randn(*shape, device=DEV, generator=g) / shape[-1] ** 0.5).to(
            torch.bfloat16)
    return [(1 + 0.1 * r(hidden), r(hidden + 64, hidden), r(hidden, hidden), r(2 * inter, hidden),
             r(hidden, inter)) for _ in range(layers)]


@pytest.mark.parametrize("m", [1, 5, 16])
def test_pdl_chain_equals_plain_launches_eager_and_graph(m):
    weights = _weights(576, 1536, 12, seed=m)
    x = torch.randn(m, 576, device=DEV).to(torch.bfloat16)
    with use_kernel_options(KernelOptions(pdl=False)):
        want_h, want_ids = _chain(x, weights)
    got_h, got_ids = _chain(x, weights)
    assert torch.equal(got_h, want_h) and torch.equal(got_ids, want_ids)

    static_x = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _chain(static_x, weights)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_h, graph_ids = _chain(static_x, weights)
    for seed in range(3):  # new inputs in the same buffer: the replay must see each of them
        x2 = torch.randn(m, 576, device=DEV, generator=torch.Generator(device=DEV)
                         .manual_seed(100 + seed)).to(torch.bfloat16)
        static_x.copy_(x2)
        graph.replay()
        with use_kernel_options(KernelOptions(pdl=False)):
            want_h, want_ids = _chain(x2, weights)
        assert torch.equal(graph_h, want_h) and torch.equal(graph_ids, want_ids)


def test_pdl_consumer_waits_for_a_slow_producer():
    """A slow PDL producer (an 8B-wide gate/up over 5 rows, ~0.2 GB of weights) and its PDL
    consumer, which launches early and prefetches its own weight: the consumer must read the
    producer's final output (equal to the plain launches and close to the reference)."""
    g = torch.Generator(device=DEV).manual_seed(7)
    x = torch.randn(5, 4096, device=DEV, generator=g).to(torch.bfloat16)
    nw = torch.ones(4096, device=DEV, dtype=torch.bfloat16)
    w_gu = (torch.randn(2 * 14336, 4096, device=DEV, generator=g) / 64).to(torch.bfloat16)
    w_down = (torch.randn(4096, 14336, device=DEV, generator=g) / 120).to(torch.bfloat16)

    def run():
        out = []
        for _ in range(3):
            a = norm_small_linear_silu_mul(x, nw, 1e-5, w_gu)
            out.append(small_linear(a, w_down, residual=x))
        return torch.stack(out), a

    got, a = run()
    with use_kernel_options(KernelOptions(pdl=False)):
        want, _ = run()
    assert torch.equal(got, want)
    torch.testing.assert_close(got[-1], small_linear_ref(a, w_down, residual=x), atol=2 ** -5,
                               rtol=2 ** -7)


def test_prime_launches_one_pdl_kernel():
    """pdl.prime: one launch of the empty PDL kernel on the current stream where PDL is on,
    nothing where it is off, nothing at a site in KernelOptions.pdl_prime_skip."""
    from torch.profiler import ProfilerActivity, profile

    def kernels(site="step"):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            pdl.prime(torch.device(DEV), site)
            torch.cuda.synchronize()
        return [e.name for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA]

    pdl.prime(torch.device(DEV))  # compile outside the profile
    if pdl.supported(torch.device(DEV)):
        assert kernels() == ["_primer_kernel"]
        assert kernels("prefill") == ["_primer_kernel"]
    assert kernels("varlen") == []  # skipped by default (KernelOptions.pdl_prime_skip)
    with use_kernel_options(KernelOptions(pdl=False)):
        assert kernels() == []
    with use_kernel_options(KernelOptions(pdl_prime=False)):
        assert kernels() == []
    if pdl.supported(torch.device(DEV)):
        with use_kernel_options(KernelOptions(pdl_prime_skip=frozenset())):
            assert kernels("varlen") == ["_primer_kernel"]
