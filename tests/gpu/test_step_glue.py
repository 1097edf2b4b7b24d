"""The fused step's bookkeeping kernels (outpace/runner/step_bookkeeping.py) on CUDA against their
PyTorch references, on fresh random inputs: integer outputs, compared exactly. (The Triton
interpreter runs the same comparisons on CPU: tests/unit/test_kernels_interpret.py.)"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
triton = pytest.importorskip("triton")

from outpace.runner.step_bookkeeping import (accept_ref, accept_triton,  # noqa: E402
                                       chained_inputs_ref, chained_inputs_triton,
                                       loop_inputs_ref, loop_inputs_triton)

DEV = "cuda"


def _tables(g, bucket, width=9, blocks=500):
    return torch.randint(1, blocks, (bucket, width), generator=g, dtype=torch.int32).to(DEV)


@pytest.mark.parametrize("bucket,q", [(1, 1), (1, 5), (8, 3), (32, 2), (128, 1), (128, 5)])
def test_chained_inputs(bucket, q):
    g = torch.Generator().manual_seed(bucket + q)
    bs = 16
    real = (torch.rand(bucket, generator=g) < 0.8).to(DEV)
    carry_pos = torch.where(real, torch.randint(0, 130, (bucket,), generator=g).to(DEV), 0)
    carry_tokens = torch.randint(0, 49152, (bucket, 6), generator=g).to(DEV)
    tables = _tables(g, bucket)
    outs = []
    for fn in (chained_inputs_ref, chained_inputs_triton):
        bufs = [torch.full((bucket * q + 3,), -9, dtype=torch.long, device=DEV)
                for _ in range(3)] + [
            torch.full((bucket + 2,), -9, dtype=torch.int32, device=DEV) for _ in range(2)] + [
            torch.full((bucket + 2,), -9, dtype=torch.long, device=DEV)]
        fn(carry_pos, carry_tokens, real, tables, bs, q, *bufs)
        outs.append(bufs)
    for want, got in zip(*outs):
        assert torch.equal(got, want)


@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize("bucket,q", [(1, 1), (1, 3), (4, 5), (128, 2), (128, 1)])
def test_accept(bucket, q, force):
    g = torch.Generator().manual_seed(7 * bucket + q)
    target = torch.randint(0, 40, (bucket * q,), generator=g)
    ids = torch.randint(0, 40, (bucket * q,), generator=g)
    for b in range(bucket):
        m = int(torch.randint(0, q, (1,), generator=g))
        ids[b * q + 1:b * q + 1 + m] = target[b * q:b * q + m]
    target, ids = target.to(DEV), ids.to(DEV)
    nd = torch.randint(0, q, (bucket,), generator=g).to(DEV)
    positions = (torch.randint(10, 900, (bucket, 1), generator=g) + torch.arange(q)).view(-1)
    positions = positions.to(DEV)
    u = torch.rand(bucket, generator=g).to(DEV) if force else None
    packed_ref = torch.full((bucket, q + 3), -7, dtype=torch.long, device=DEV)
    packed = packed_ref.clone()
    want = accept_ref(target, ids, nd, positions, q, packed_ref, u, 3.0)
    carry = (torch.zeros(bucket, dtype=torch.long, device=DEV),
             torch.zeros(bucket, 5, dtype=torch.long, device=DEV))
    got = accept_triton(target, ids, nd, positions, q, packed, u, 3.0, carry=carry)
    assert torch.equal(packed, packed_ref)
    for a, b in zip(got, want[:3]):
        assert torch.equal(a, b)
    assert torch.equal(carry[0], want[2] + 1) and torch.equal(carry[1][:, 0], want[3])


@pytest.mark.parametrize("bucket,steps", [(1, 1), (1, 3), (32, 4), (128, 2)])
def test_loop_inputs(bucket, steps):
    g = torch.Generator().manual_seed(bucket * steps)
    first = torch.randint(0, 130, (bucket,), generator=g).to(DEV)
    tables = _tables(g, bucket)
    for a, b in zip(loop_inputs_triton(first, tables, 16, steps),
                    loop_inputs_ref(first, tables, 16, steps)):
        assert a.dtype == b.dtype and torch.equal(a, b)
