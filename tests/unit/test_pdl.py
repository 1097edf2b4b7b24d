"""kernels/pdl.py on CPU: when programmatic dependent launch is used, and that every kernel that
may be launched with it follows the protocol (waits on the grid dependency). The GPU side (a
chain of PDL kernels equals plain launches, eager and in a graph) is tests/gpu/test_pdl.py."""

from __future__ import annotations

import inspect
import re
from types import SimpleNamespace

import pytest
import torch

from outpace.kernels import pdl

triton = pytest.importorskip("triton")


def test_never_on_cpu_tensors():
    assert pdl.launch_options(torch.empty(1)) == {"USE_PDL": False}
    assert not pdl.supported(torch.device("cpu"))


@pytest.mark.parametrize("capability,hip,triton_ok,want", [
    ((9, 0), None, True, True),        # H100 / H200
    ((10, 0), None, True, True),       # Blackwell
    ((8, 0), None, True, False),       # A100: no PDL
    ((9, 0), None, False, False),      # a triton without launch_pdl
    ((9, 4), "6.2", True, False),      # ROCm (MI300 reports 9.4)
])
def test_supported_only_on_hopper_and_later_nvidia(capability, hip, triton_ok, want):
    facts = (capability, hip, triton_ok)  # what the device query would return
    assert pdl.supported(torch.device("cuda", 0), facts) is want
    t = SimpleNamespace(device=torch.device("cuda", 0))  # launch_options reads only t.device
    opts = pdl.launch_options(t, facts)
    assert opts == ({"USE_PDL": True, "launch_pdl": True} if want else {"USE_PDL": False})
    from outpace.kernels.options import use_kernel_options
    from outpace.runner_config import KernelOptions
    with use_kernel_options(KernelOptions(pdl=False)):
        assert pdl.launch_options(t, facts) == {"USE_PDL": False}


def _pdl_kernels():
    from outpace.attention import triton_paged_kernels
    from outpace.kernels import argmax, norm, rope
    from outpace.kernels.skinny_gemm import kernels as small_linear_kernels
    mods = (triton_paged_kernels, argmax, norm, rope, small_linear_kernels)
    for mod in mods:
        for name, obj in vars(mod).items():
            if isinstance(obj, triton.runtime.JITFunction) and "USE_PDL" in obj.arg_names \
                    and name != "wait_then_release":
                yield f"{mod.__name__}.{name}", obj


def test_every_pdl_kernel_waits_before_reading():
    """A kernel taking USE_PDL calls wait_then_release(USE_PDL) unconditionally, before any
    early return (else a PDL launch could read its predecessor's output too early)."""
    kernels = dict(_pdl_kernels())
    assert len(kernels) >= 8, sorted(kernels)  # projections, silu, attention x2, argmax x2, ...
    for name, k in kernels.items():
        body = inspect.getsource(k.fn)
        call = body.find("wait_then_release(USE_PDL)")
        assert call > 0, f"{name} takes USE_PDL but never waits"
        first_return = re.search(r"^\s+return\b", body, re.M)
        assert first_return is None or first_return.start() > call, \
            f"{name} can return before it waits"
