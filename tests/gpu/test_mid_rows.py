"""A short prefill's projections as Triton kernels (small_linear.mid_rows_ok, llama's
MID_ROW_KERNELS): more than SMALL_M_MAX and at most MID_M_MAX rows in choose_blocks' tl.dot row
blocks, on fresh random inputs of SmolLM2's shapes against the references (plain o_proj, gate_up
+ silu * mul, qkv + rope + KV store without a norm, the EAGLE-3 head's 1152-wide qkv too); and
engines whose prefills take them (plain and with an EAGLE-3 head: its pass over the prompt
rows) give the tokens of engines that run cuBLAS there."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
triton = pytest.importorskip("triton")

import outpace.models.llama as llama  # noqa: E402
from outpace import SamplingParams  # noqa: E402
from outpace.kernels import skinny_gemm as sl  # noqa: E402
from outpace.runner_config import KernelOptions  # noqa: E402
from tests.engine_helpers import make_engine, run_batch  # noqa: E402
from tests.gpu import test_kernels as tk  # noqa: E402
from tests.gpu import test_rope_store as tr  # noqa: E402
from tests.speculative.spec_helpers import repetitive_prompts, tiny_target  # noqa: E402

DEV = "cuda"
ROWS = [17, 40, 96, 128, 192, sl.MID_M_MAX]
DTYPES = [torch.bfloat16, torch.float16]


def _tol(dtype, fused=False):
    tol = (tk.FUSED_TOL if fused else tk.LIN_TOL)[torch.bfloat16]
    return tol if dtype == torch.bfloat16 else dict(atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("name", ["o", "down"])
def test_small_linear(name, m, dtype):
    n, k = tk.SMOL[name]
    x, w, _ = tk._lin_inputs(m, n, k, dtype, seed=m + n)
    assert sl.mid_rows_ok(x, w) and sl.choose_blocks(m, n, k).block_m < m
    y = sl.small_linear_triton(x, w)
    assert y.dtype == dtype and y.shape == (m, n)
    torch.testing.assert_close(y, sl.small_linear_ref(x, w), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", ROWS)
def test_gate_up_silu_mul(m, dtype):
    n, k = tk.SMOL["gate_up"]
    x, w, _ = tk._lin_inputs(m, n, k, dtype, seed=m + 5 * n)
    assert sl.mid_rows_ok(x, w, n // 2)
    y = sl.small_linear_silu_mul_triton(x, w)
    assert y.shape == (m, n // 2)
    torch.testing.assert_close(y, sl.small_linear_silu_mul_ref(x, w), **_tol(dtype, True))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("k", [576, 1152])  # the target's qkv and the EAGLE-3 head's
def test_qkv_rope_store_without_norm(k, m, dtype):
    hq, hkv, d = 9, 3, 64
    x, w, _ = tk._lin_inputs(m, (hq + 2 * hkv) * d, k, dtype, seed=m + k)
    assert sl.mid_rows_ok(x, w, w.shape[0] // 2)
    tr.test_norm_qkv_rope_store_matches_reference(dtype, m, hq, hkv, d, k, with_norm=False)


# ----------------------------------------------------------------------------- engines

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def eagle_head(tmp_path_factory):
    from outpace.training.init_draft import init_draft
    from tests.speculative.spec_helpers import write_target_folder
    root = tmp_path_factory.mktemp("mid_rows_head")
    target = write_target_folder(tiny_target(seed=0)[1], root / "target")
    return init_draft("eagle3", str(target), root / "eagle3", seed=1, quiet=True)


@pytest.mark.parametrize("num_prompts", [1, 4])
@pytest.mark.parametrize("head", [False, True], ids=["plain", "eagle3"])
def test_engines_equal_with_and_without_the_prefill_kernels(head, num_prompts, eagle_head,
                                                            monkeypatch):
    """Prompts of 21-105 tokens: one at a time their prefills replay graphs padded to 32-128
    rows, four at once a varlen graph of 256; the engine's graphs are built with the Triton
    kernels (counted while they are captured), and the tokens equal an engine's whose prefills
    run cuBLAS (MID_ROW_KERNELS off)."""
    model, cfg, tok = tiny_target(seed=0)
    model = model.to(DEV, torch.bfloat16)  # the kernels take 16-bit activations only
    prompts = [repetitive_prompts(1, 5 + i, period=7, repeats=3 + 4 * i)[0]
               for i in range(num_prompts)]  # 21, 49, 77 and 105 tokens
    assert all(17 <= len(p) <= sl.MID_M_MAX for p in prompts)
    spec = ({"method": "eagle3", "model": str(eagle_head), "num_speculative_tokens": 2}
            if head else None)
    calls = []
    kernel = llama.small_linear_silu_mul_triton

    def counted(x, w, **kw):
        calls.append(x.shape[0])
        return kernel(x, w, **kw)

    def run(mid_rows: bool):
        eng = make_engine((model, cfg, tok), device="cuda", dtype="bfloat16",
                          speculative_config=spec, max_num_seqs=4,
                          kernel_options=KernelOptions(mid_row_kernels=mid_rows))
        return run_batch(eng, prompts, GREEDY)

    monkeypatch.setattr(llama, "small_linear_silu_mul_triton", counted)
    want = run(False)
    assert not calls
    got = run(True)
    assert any(n > sl.SMALL_M_MAX for n in calls)  # the prefills took the kernels
    assert got == want
