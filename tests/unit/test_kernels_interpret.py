"""Triton kernels vs their PyTorch references on CPU, through Triton's interpreter.

TRITON_INTERPRET=1 must be set before any kernel is decorated (triton.jit reads it then), and other
tests in this process may already have imported the kernel modules without it. So the one
`test_*` function here reruns this file in a fresh subprocess with the variable set, where pytest
collects the `check_*` functions instead (`-o python_functions=check_*`). The subprocess starts
when collection ends (tests/unit/conftest.py), so that it runs beside the rest of the suite.

Interpreter limits worked around here (the GPU tests cover what is left out):
  - its tl.dot on bfloat16 operands is wrong (it multiplies raw bits), so attention runs in fp32
    and fp16 here; bf16 is still covered for the element-wise kernels (store, norm, rope);
  - its fp32 -> bf16 casts truncate instead of rounding to nearest even, so bf16 results may be
    one bf16 ulp off the reference (1 in 128 relative): bf16 tolerances below allow for it;
  - with numpy >= 2.4 its `range()` over a loaded scalar fails (int() of a 1-element array); the
    child patches that one conversion (`_patch_interpreter_index`).
"""

from __future__ import annotations

import dataclasses
import math
import importlib.util
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[2]
IN_CHILD = os.environ.get("TRITON_INTERPRET") == "1"


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


class InterpreterRun:
    """The subprocess that runs this file's check_* functions under TRITON_INTERPRET=1. Its
    output goes to a file (a pipe nobody reads while the suite runs could fill up and stall
    it); it runs torch on one thread, beside a suite that keeps the other core busy."""

    def __init__(self):
        self.out = tempfile.TemporaryFile(mode="w+")
        env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "-o", "python_functions=check_*", str(pathlib.Path(__file__).resolve())]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.out,
                                     stderr=subprocess.STDOUT, text=True)

    def result(self, timeout: float) -> tuple:
        """-> (exit code, output), waiting for the run at most `timeout` seconds more."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            code = "timed out"
        self.out.seek(0)
        return code, self.out.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


# the run tests/unit/conftest.py starts when collection ends, if this test was collected
INTERPRETER_RUN = pytest.StashKey[InterpreterRun]()


def test_kernels_under_triton_interpreter(request):
    if not triton_installed():
        pytest.skip('triton is not installed (the test extra has it: pip install -e ".[test]")')
    run = request.config.stash.get(INTERPRETER_RUN, None) or InterpreterRun()
    code, out = run.result(timeout=900)
    tail = out[-15000:]
    assert code == 0, tail
    assert " passed" in out and "failed" not in out, tail


def test_split_and_tile_choice_is_shape_only():
    """The launch configuration depends on shapes and the max_query_len bound only."""
    from outpace.attention.triton_paged import choose_splits, choose_tiles
    for group in (1, 3, 4, 8, 16):
        for mql in (1, 4, 16, 17, 96, 256, 257, 2048):
            for d in (64, 128):
                for tile_map in (False, True):
                    cfg = choose_tiles(mql, group, d, torch.bfloat16, tile_map)
                    gp = 1 << (group - 1).bit_length()
                    assert cfg.block_m == cfg.block_q * gp and cfg.block_m >= 16
                    assert cfg.block_q >= 1
    # a tile map's unit is one block_q for every bound above 16 (varlen graphs)
    assert len({choose_tiles(m, 3, 64, torch.bfloat16, True) for m in (17, 96, 2048)}) == 1
    # short prefills without a map: 64-row tiles of 4 warps (H200, run 27), 32 KV columns a
    # step up to 96 tokens; longer ones, and heads wider than measured, the 128-row tiles
    short = choose_tiles(96, 3, 64, torch.bfloat16)
    assert (short.block_m, short.block_n, short.num_warps) == (64, 32, 4)
    assert choose_tiles(200, 3, 64, torch.bfloat16).block_n == 64
    assert choose_tiles(257, 3, 64, torch.bfloat16) == choose_tiles(17, 3, 64, torch.bfloat16,
                                                                    True)
    assert choose_tiles(96, 3, 128, torch.bfloat16).block_m == 128
    assert choose_splits(200, 132, 16) == 1
    assert choose_splits(8, 132, 16) == 16
    assert choose_splits(40, 132, 16) == 4
    assert choose_splits(8, 132, 1) == 1


def test_attention_prefetches_only_where_it_was_measured_faster():
    """The first-tile prefetch before the PDL wait: one sequence's decode / verify with heads
    of at most 64 (SmolLM2's batch-1 graphs were faster with it; batches of 8-128 and the
    8B-shaped heads of 128 slower)."""
    from outpace.attention.triton_paged import prefetches
    assert prefetches(1, 1, 64) and prefetches(5, 1, 64) and prefetches(16, 1, 48)
    assert not prefetches(1, 2, 64) and not prefetches(3, 8, 64)  # several sequences
    assert not prefetches(1, 1, 128)  # wide heads
    assert not prefetches(17, 1, 64) and not prefetches(512, 1, 64)  # prefill chunks


def test_import_and_fallback_without_triton():
    """With triton unimportable: modules import, dispatchers use the references, and the Triton
    backend raises ImportError (the runner's cue to fall back) saying what to install."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from outpace.kernels import triton_available\n"
        "from outpace.kernels.norm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, "
        "rms_norm_ref\n"
        "from outpace.kernels.rope import apply_rope, apply_rope_ref\n"
        "from outpace.kernels.skinny_gemm import norm_small_linear, norm_small_linear_ref\n"
        "from outpace.attention.triton_paged import TritonPagedBackend\n"
        "assert not triton_available()\n"
        "x, r, w = torch.randn(3, 8), torch.randn(3, 8), torch.randn(8)\n"
        "assert torch.equal(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))\n"
        "a, b = fused_add_rms_norm(x, r, w, 1e-6); c, d = fused_add_rms_norm_ref(x, r, w, 1e-6)\n"
        "assert torch.equal(a, c) and torch.equal(b, d)\n"
        "lw = torch.randn(5, 8)\n"
        "assert torch.equal(norm_small_linear(x, w, 1e-6, lw),\n"
        "                   norm_small_linear_ref(x, w, 1e-6, lw))\n"
        "from outpace.kernels.embed_norm_cat import embed_norm_cat, embed_norm_cat_ref\n"
        "from outpace.kernels.argmax import argmax_rows\n"
        "ids, tab = torch.tensor([4, 0, 2]), torch.randn(6, 8)\n"
        "assert torch.equal(embed_norm_cat(ids, tab, w, x, w, 1e-6),\n"
        "                   embed_norm_cat_ref(ids, tab, w, x, w, 1e-6))\n"
        "off = torch.tensor([5, -1, 2, 0, 7, 1, 3, 3])\n"
        "assert torch.equal(argmax_rows(x, off), x.argmax(-1) + off[x.argmax(-1)])\n"
        "q, k = torch.randn(2, 2, 8), torch.randn(2, 1, 8); q2, k2 = q.clone(), k.clone()\n"
        "cs = torch.randn(5, 4); pos = torch.tensor([1, 4])\n"
        "apply_rope(q, k, cs, cs, pos); apply_rope_ref(q2, k2, cs, cs, pos)\n"
        "assert torch.equal(q, q2) and torch.equal(k, k2)\n"
        "try:\n"
        "    TritonPagedBackend(torch.zeros(1, 2, 2, 16, 1, 8), 2, 1, 8, 1.0)\n"
        "except ImportError as e:\n"
        "    assert 'pip install triton' in str(e)\n"
        "else:\n"
        "    raise AssertionError('no ImportError')\n"
        "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


def test_references_match_hf_transformers():
    """rms_norm_ref and apply_rope_ref are HF's LlamaRMSNorm and apply_rotary_pos_emb."""
    hf = pytest.importorskip("transformers.models.llama.modeling_llama")
    from outpace.kernels.norm import rms_norm_ref
    from outpace.kernels.rope import apply_rope_ref
    g = torch.Generator().manual_seed(9)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(4, 3, 64, generator=g) * 2).to(dtype)
        norm = hf.LlamaRMSNorm(64, eps=1e-6)
        norm.weight.data = torch.randn(64, generator=g)
        norm = norm.to(dtype)
        assert torch.equal(rms_norm_ref(x, norm.weight, 1e-6), norm(x))
    t, hq, hkv, d = 6, 4, 2, 32
    inv = 1.0 / 10000.0 ** (torch.arange(0, d, 2).float() / d)
    freqs = torch.outer(torch.arange(50).float(), inv)  # [max_pos, D/2]
    pos = torch.randint(0, 50, (t,), generator=g)
    q, k = torch.randn(t, hq, d, generator=g), torch.randn(t, hkv, d, generator=g)
    emb = torch.cat([freqs, freqs], -1)[pos][None]  # [1, T, D], HF layout
    hq_out, hk_out = hf.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             emb.cos(), emb.sin())
    apply_rope_ref(q, k, freqs.cos(), freqs.sin(), pos)
    torch.testing.assert_close(q, hq_out[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k, hk_out[0].transpose(0, 1), atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------- child only

def _patch_interpreter_index():
    """numpy >= 2.4 refuses int() of a 1-element array, which the interpreter does for range()."""
    import numpy as np
    try:
        int(np.array([1]))
        return
    except TypeError:
        pass
    import triton.runtime.interpreter as interp
    if getattr(interp, "_outpace_patched", False):
        return
    original = interp._patch_lang_tensor

    def index(self):
        return int(self.handle.data.reshape(-1)[0])

    def patched(tensor, *scope):  # triton >= 3.5 passes a patch scope, older ones don't
        original(tensor, *scope)
        if scope:
            scope[0].set_attr(tensor, "__index__", index)
        else:
            tensor.__index__ = index

    interp._patch_lang_tensor = patched
    interp._outpace_patched = True


if IN_CHILD:
    _patch_interpreter_index()
    from outpace.attention.torch_ref import store_kv as store_kv_ref
    from outpace.attention.triton_paged import TritonPagedBackend, paged_attention
    from outpace.kernels.norm import (fused_add_rms_norm_ref, fused_add_rms_norm_triton,
                                      gather_rms_norm_ref, gather_rms_norm_triton,
                                      rms_norm_ref, rms_norm_triton)
    from outpace.kernels.argmax import argmax_ref, argmax_triton
    from outpace.kernels.embed_norm_cat import embed_norm_cat_ref, embed_norm_cat_triton
    from outpace.kernels.bf16x3 import split_pieces_ref, split_pieces_triton
    from outpace.kernels.rope import (apply_rope_and_store_ref, apply_rope_and_store_triton,
                                      apply_rope_ref, apply_rope_triton)
    from outpace.kernels.int8_linear import (int8_linear_ref, int8_linear_triton,
                                             quantize_int8_rows)
    from outpace.kernels.skinny_gemm import (Blocks, choose_blocks, norm_qkv_rope_store_ref,
                                              norm_qkv_rope_store_triton, norm_small_linear_ref,
                                              norm_small_linear_silu_mul_ref,
                                              norm_small_linear_silu_mul_triton,
                                              norm_small_linear_triton, silu_mul_ref,
                                              silu_mul_triton, small_linear_ref,
                                              small_linear_silu_mul_ref,
                                              small_linear_silu_mul_triton, small_linear_triton)
    from outpace.runner.step_bookkeeping import (accept_ref, accept_triton, chained_inputs_ref,
                                           chained_inputs_triton, loop_inputs_ref,
                                           loop_inputs_triton)
    from outpace.kernels.store_kv import store_kv_triton
    from outpace.sample.penalty_kernels import (count_emitted_ref, count_emitted_triton,
                                           penalize_rows_ref, penalize_rows_triton)
    from outpace.kernels.logprobs import row_logprobs_triton
    from outpace.kernels.ngram_lookup import StepOutputs, ngram_lookup_triton
    from outpace.runner.fused_ngram import step_drafts_ref
    from outpace.speculative.ngram_device import ngram_propose_ref
    from tests.unit import logprobs_cases
    from tests.unit.kernel_cases import COMPOSITIONS, make_batch
    from tests.unit.kernel_cases import check_attention as verify_attention
    import triton
    import triton.language as tl
    from outpace.kernels.masked_gumbel import _top_k_mass

    @triton.jit
    def _top_k_mass_probe(x_ptr, xmax_ptr, out_ptr, V, num_chunks, t, m, k,
                          CBLOCK: tl.constexpr, CHUNK: tl.constexpr, SPAN: tl.constexpr):
        # masked_race._top_k_mass of one row x (stride V) with its chunk maxima, into out
        offs = tl.arange(0, CBLOCK)
        xm = tl.load(xmax_ptr + offs, mask=offs < num_chunks, other=float("-inf"))
        tl.store(out_ptr, _top_k_mass(x_ptr, 0, V, V, num_chunks, xm, offs, t, m, k, CHUNK,
                                      SPAN))

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ULP_BF16 = 2.0 ** -7  # largest relative spacing of bf16 numbers
NORM_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
            torch.bfloat16: dict(atol=1e-2, rtol=1e-2 + ULP_BF16)}  # + interpreter truncation
# The residual sum is rounded exactly as torch rounds it (GPU tests demand equality); only the
# interpreter's truncating bf16 cast may move it by one ulp.
EXACT_TOL = {torch.float32: dict(atol=0, rtol=0), torch.float16: dict(atol=0, rtol=0),
             torch.bfloat16: dict(atol=0, rtol=ULP_BF16)}


def _no_host_mirrors(meta):
    """The metadata with the host mirrors blanked: a graph-safe kernel must not need them."""
    return dataclasses.replace(meta, query_start_loc_host=[], seq_lens_host=[], max_seq_len=1)


@pytest.mark.parametrize("dtype", DTYPES)
def check_store_kv_skips_padded_rows(dtype):
    g = torch.Generator().manual_seed(1)
    blocks, bs, hkv, d, t = 6, 16, 3, 64, 11
    cache = torch.full((2, 2, blocks, bs, hkv, d), float("nan"), dtype=dtype)
    slots = torch.randperm((blocks - 1) * bs, generator=g)[:t] + bs  # never the null block
    slots[[2, 7]] = -1
    # k and v as strided head slices of one fused buffer, as a qkv projection produces them
    fused = torch.randn(t, 3 * hkv, d, generator=g).to(dtype)
    k, v = fused[:, hkv:2 * hkv], fused[:, 2 * hkv:]
    ref = cache.clone()
    store_kv_ref(ref, 1, k, v, slots)
    store_kv_triton(cache, 1, k, v, slots)
    torch.testing.assert_close(cache[:, :, 1:], ref[:, :, 1:], atol=0, rtol=0, equal_nan=True)
    assert torch.isnan(cache[:, :, 0].float()).all(), "a padded row was written"
    assert torch.isnan(cache[0].float()).all(), "another layer slot was written"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 64), (3, 100), (2, 3, 48)])
def check_rms_norm(dtype, shape):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype)
    out = rms_norm_triton(x, w, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, rms_norm_ref(x, w, 1e-6), **NORM_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 64), (2, 96)])
def check_fused_add_rms_norm(dtype, shape):
    g = torch.Generator().manual_seed(3)
    x, r = (torch.randn(*shape, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(shape[-1], generator=g).to(dtype)
    x_before, r_before = x.clone(), r.clone()
    normed, new_res = fused_add_rms_norm_triton(x, r, w, 1e-5)
    ref_normed, ref_res = fused_add_rms_norm_ref(x, r, w, 1e-5)
    torch.testing.assert_close(new_res, ref_res, **EXACT_TOL[dtype])
    torch.testing.assert_close(normed, ref_normed, **NORM_TOL[dtype])
    assert torch.equal(x, x_before) and torch.equal(r, r_before)  # inputs untouched


@pytest.mark.parametrize("dtype", DTYPES)
def check_gather_rms_norm(dtype):
    """Rows picked by index (repeats, any order, from a strided view), copied exactly and
    normalized as rms_norm of the copies."""
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(6, 100, generator=g) * 3).to(dtype)[:, :96]  # row stride 100
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
    rows = torch.tensor([5, 0, 5, 2])
    normed, gathered = gather_rms_norm_triton(x, rows, w, 1e-6)
    ref_normed, ref_gathered = gather_rms_norm_ref(x, rows, w, 1e-6)
    assert torch.equal(gathered, ref_gathered)
    torch.testing.assert_close(normed, ref_normed, **NORM_TOL[dtype])


def check_rms_norm_promotes_like_hf():
    """fp16 activations with an fp32 weight give fp32, as HF's `weight * x.to(dtype)` does."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 32, generator=g).half()
    w = torch.randn(32, generator=g)
    out = rms_norm_triton(x, w, 1e-6)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, rms_norm_ref(x, w, 1e-6), atol=1e-5, rtol=1e-5)


def _rope_tables(d, max_pos, theta=10000.0):
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    freqs = torch.outer(torch.arange(max_pos).float(), inv)  # [max_pos, D/2]
    return freqs.cos(), freqs.sin()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 64), (6, 2, 128), (3, 3, 32)])
@pytest.mark.parametrize("layout", ["half", "hf", "signed"])
def check_rope(dtype, hq, hkv, d, layout):
    g = torch.Generator().manual_seed(5)
    t, max_pos = 9, 64
    cos, sin = _rope_tables(d, max_pos)
    ref_cos, ref_sin = cos, sin
    if layout == "hf":  # HF: cat(freqs, freqs)
        cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    elif layout == "signed":  # [-sin, sin] folded sign, as outpace.models.llama precomputes
        cos, sin = torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)
    pos = torch.randint(0, max_pos, (t,), generator=g)
    # q and k as head slices of one fused qkv buffer (non-contiguous views), rotated in place
    qkv = torch.randn(t, hq + 2 * hkv, d, generator=g).to(dtype)
    ref = qkv.clone()
    apply_rope_triton(qkv[:, :hq], qkv[:, hq:hq + hkv], cos, sin, pos)
    apply_rope_ref(ref[:, :hq], ref[:, hq:hq + hkv], ref_cos, ref_sin, pos)
    torch.testing.assert_close(qkv, ref, **NORM_TOL[dtype])
    assert torch.equal(qkv[:, hq + hkv:], ref[:, hq + hkv:])  # v untouched


# Attention cases: (composition, dtype, kv heads, group, head_dim, kv splits, bound slack).
# bound slack > 0 launches with max_query_len above the real maximum, as a captured graph does.
ATTN_CASES = [
    ("prefill", torch.float32, 2, 3, 64, 1, 0),
    ("prefill", torch.float16, 1, 4, 128, 1, 0),
    ("chunk", torch.float32, 2, 1, 128, 1, 0),
    ("chunk", torch.float16, 2, 3, 64, 1, 2),
    ("decode", torch.float32, 2, 4, 64, 1, 0),
    ("decode", torch.float16, 2, 1, 128, 1, 3),
    ("decode", torch.float32, 1, 3, 64, 4, 0),
    ("verify", torch.float32, 2, 3, 128, 1, 0),
    ("verify", torch.float16, 2, 4, 64, 1, 0),
    ("verify", torch.float32, 2, 1, 64, 4, 2),
    ("mixed", torch.float32, 2, 3, 64, 1, 3),
    ("mixed", torch.float16, 2, 4, 128, 1, 0),
    ("mixed", torch.float32, 1, 1, 64, 2, 0),
    ("long_prefill", torch.float32, 1, 1, 64, 1, 0),
    ("long_prefill", torch.float16, 1, 4, 64, 1, 0),
    ("long_decode", torch.float32, 2, 4, 64, 8, 0),
    ("long_decode", torch.float16, 1, 3, 128, 4, 1),
]
EXTRA = {
    "long_prefill": [(150, 170)],  # several query tiles, chunk boundary off the block size
    "long_decode": [(1, 300), (2, 201), (3, 64)],  # multi-split decode and verify
}


# The PREFETCH variant at one case of each composition: the one with KV splits where there is
# one (each split's first tile is then its whole range, part of it, or empty), else the
# non-power-of-two group or the launch bound above the real maximum. The first tile's old and
# new columns are a property of the composition; dtype and head shape are the wait-first
# cases' (the variant differs only in when the first tile is loaded).
PREFETCH_CASES = [ATTN_CASES[i] for i in (0, 3, 6, 9, 12, 14, 16)]


@pytest.mark.parametrize("case,prefetch", [(c, False) for c in ATTN_CASES]
                         + [(c, True) for c in PREFETCH_CASES],
                         ids=lambda c: ("prefetch" if c else "wait-first")
                         if isinstance(c, bool) else f"{c[0]}-{str(c[1])[6:]}-"
                         f"h{c[2]}g{c[3]}d{c[4]}s{c[5]}b{c[6]}")
def check_paged_attention(case, prefetch):
    """Both kernel variants (PREFETCH: the first KV tile loaded before the PDL wait, then the
    step's own tokens added in) at every composition: the first tile is each split's whole
    range, part of it, or empty, and holds old columns, new ones or both. With per-tile
    counters, splits past a short context write nothing and the merge must not read their
    workspace rows: it is filled with NaN first."""
    name, dtype, hkv, group, d, splits, slack = case
    seqs = EXTRA.get(name) or COMPOSITIONS[name]
    b = make_batch(seqs, hkv, group, d, dtype, "cpu", pad_seqs=1, pad_tokens=2,
                   max_query_len=max(q for q, _ in seqs) + slack, seed=len(ATTN_CASES))
    scale = d ** -0.5
    store_kv_triton(b.kv_cache, b.layer, b.k, b.v, b.meta.slot_mapping)
    out = paged_attention(b.q, b.kv_cache, b.layer, _no_host_mirrors(b.meta), scale,
                          num_splits=splits, min_split_tokens=16, prefetch=prefetch)
    verify_attention(b, out, scale)
    if splits > 1:  # the last split of each tile merges (per-tile counters), twice in a row
        counters = torch.zeros(64, dtype=torch.int32)
        for _ in range(2):
            out = paged_attention(b.q, b.kv_cache, b.layer, _no_host_mirrors(b.meta), scale,
                                  num_splits=splits, min_split_tokens=16,
                                  split_counters=counters, prefetch=prefetch, fill=float("nan"))
            verify_attention(b, out, scale)
            assert not counters.any(), "the counters must be left at zero"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def check_backend_forward(dtype):
    """The backend: store + attention in one call, strided q/k/v from a fused projection."""
    b = make_batch(COMPOSITIONS["mixed"], 2, 3, 64, dtype, "cpu", pad_seqs=2, pad_tokens=3,
                   max_query_len=32, seed=7)
    fused = torch.cat([b.q, b.k, b.v], dim=1)  # [T, Hq + 2 Hkv, D]
    hq, hkv = b.q.shape[1], b.k.shape[1]
    q, k, v = fused[:, :hq], fused[:, hq:hq + hkv], fused[:, hq + hkv:]
    backend = TritonPagedBackend(b.kv_cache, hq, hkv, 64, 0.125)
    out = backend.forward(b.layer, q, k, v, _no_host_mirrors(b.meta))
    assert out.shape == b.q.shape and out.dtype == dtype
    verify_attention(b, out, 0.125)


def check_harness_catches_a_wrong_kernel():
    """The comparison must be able to fail: a result off by a little is rejected."""
    b = make_batch(COMPOSITIONS["verify"], 2, 1, 64, torch.float32, "cpu", seed=8)
    store_kv_triton(b.kv_cache, b.layer, b.k, b.v, b.meta.slot_mapping)
    out = paged_attention(b.q, b.kv_cache, b.layer, b.meta, 0.125)
    out[1, 0, 3] += 1e-3
    with pytest.raises(AssertionError):
        verify_attention(b, out, 0.125)


# ----------------------------------------------------------------------------- few-row linears

# (M, N, K): N and K off the block sizes; K = 600 takes several K steps with a ragged last one;
# M = 5 and 16 take several row blocks on the broadcast path. The interpreter runs a kernel's
# programs one after another, and at these sizes N only sets how many column programs there
# are (choose_blocks' branches turn on N only from thousands of columns): so N is small, odd
# and above 16, which leaves a ragged last program on both paths and two on the tl.dot path.
LINEAR_SHAPES = [(1, 19, 72), (3, 17, 576), (5, 21, 160), (16, 19, 600)]
# The fused kernels round bf16 at up to four points (the normalized input, its product with the
# RMSNorm weight, g and u, silu and the product). The interpreter truncates at each, and since
# truncation is biased toward zero its errors add up over K instead of cancelling: a few ulps,
# ~6 at worst over many seeds. (The kernel matches a truncating emulation of the reference
# exactly; the GPU tests, which round to nearest, are tighter.)
FUSED_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5),
             torch.bfloat16: dict(atol=8 * ULP_BF16, rtol=6 * ULP_BF16)}


def _linear_inputs(m, n, k, dtype, seed, *, w_dtype=None, rows=1):
    """x [m, k] as a strided view (row stride > k), w [rows * n, k] scaled so y is O(1), and an
    RMSNorm weight near 1."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k + 24, generator=g) * 2).to(dtype)[:, 5:5 + k]
    w = (torch.randn(rows * n, k, generator=g) / k ** 0.5).to(w_dtype or dtype)
    nw = (1 + 0.2 * torch.randn(k, generator=g)).to(w_dtype or dtype)
    return x, w, nw


def _interp_blocks(m, n, k, w_dtype, use_dot=None):
    """choose_blocks, off tl.dot for a bf16 weight (the interpreter's bf16 tl.dot is wrong; a
    bf16 weight under fp32 activations meets bf16 pieces of x there too)."""
    return choose_blocks(m, n, k, use_dot=False if w_dtype == torch.bfloat16 else use_dot)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", LINEAR_SHAPES)
def check_small_linear(shape, dtype):
    m, n, k = shape
    x, w, _ = _linear_inputs(m, n, k, dtype, seed=20 + m)
    y = small_linear_triton(x, w, blocks=_interp_blocks(m, n, k, dtype))
    assert y.dtype == dtype and y.shape == (m, n)
    torch.testing.assert_close(y, small_linear_ref(x, w), **NORM_TOL[dtype])


@pytest.mark.parametrize("use_dot", [False, True])
def check_small_linear_both_paths(use_dot):
    """The broadcast-sum and the tl.dot path at every row count of the shapes above, in fp16
    (fp32 takes the default path at each row count in check_small_linear and the broadcast
    path at every one in check_fp32_activations_over_bf16_weights; bf16 the broadcast path in
    check_small_linear)."""
    dtype = torch.float16
    for m, n, k in LINEAR_SHAPES:
        x, w, _ = _linear_inputs(m, n, k, dtype, seed=30 + m)
        y = small_linear_triton(x, w, blocks=choose_blocks(m, n, k, use_dot=use_dot))
        torch.testing.assert_close(y, small_linear_ref(x, w), **NORM_TOL[dtype])


# Blocks(block_m, block_n, block_k, num_warps, num_stages, use_dot)
@pytest.mark.parametrize("cfg", [(4, 4, 16, 1, 1, False), (4, 32, 64, 8, 3, False),
                                 (2, 8, 32, 1, 2, False, 32),  # several steps and a tail tile
                                 (16, 16, 32, 4, 1, True), (16, 16, 64, 1, 2, True)], ids=str)
@pytest.mark.parametrize("shape", [(3, 19, 72), (4, 17, 600)])
def check_small_linear_explicit_blocks(shape, cfg):
    """Configurations a benchmark sweep may pick: many K steps, ragged N and K tails, the norm
    statistics over several steps (one warp at K = 600)."""
    blocks = Blocks(*cfg)
    m, n, k = shape
    x, w, nw = _linear_inputs(m, n, k, torch.float32, seed=40)
    torch.testing.assert_close(small_linear_triton(x, w, blocks=blocks), small_linear_ref(x, w),
                               **NORM_TOL[torch.float32])
    torch.testing.assert_close(norm_small_linear_triton(x, nw, 1e-6, w, blocks=blocks),
                               norm_small_linear_ref(x, nw, 1e-6, w), **NORM_TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 37, 576), (3, 19, 96), (2, 17, 600)])
def check_int8_linear(shape, dtype):
    """An int8 weight with a per-column scale (the broadcast path: the interpreter's bf16 tl.dot,
    which the tensor-core path uses for int8 tiles, is wrong; tests/gpu covers that path)."""
    m, n, k = shape
    x, w, _ = _linear_inputs(m, n, k, torch.float32, seed=50 + m)
    q, scale = quantize_int8_rows(w)
    x = x.to(dtype)
    y = int8_linear_triton(x, q, scale, blocks=choose_blocks(m, n, k, elem_bytes=1,
                                                             use_dot=False))
    assert y.dtype == dtype and y.shape == (m, n)
    torch.testing.assert_close(y, int8_linear_ref(x, q, scale), **NORM_TOL[dtype])


# (M, N, K, rows a program, columns a program): K = 576 is 2 steps of 256 and a masked one, 1536
# 4 + 2 steps, 1728 4 + 4 (masked past K), 64 one step; 3 rows in a program of 4, and in three
# one-warp programs (choose_blocks' pick at 3 rows); N: two column programs and a ragged third
ROW_WARPS_CASES = [(2, 5, 576, 2, 2), (4, 9, 1536, 2, 4), (3, 5, 1728, 4, 2),
                   (4, 8, 64, 2, 4), (3, 5, 576, 1, 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", ROW_WARPS_CASES, ids=str)
def check_small_linear_row_warps(case, dtype):
    """A warp a row (row_warps_blocks) for every variant the projections fuse: plain,
    residual, norm, norm + gate_up + silu, an int8 weight, norm + qkv + rope + store."""
    from outpace.kernels.skinny_gemm.blocks import row_warps_blocks
    m, n, k, block_m, block_n = case
    blocks = row_warps_blocks(k, block_m, block_n)
    x, w, nw = _linear_inputs(m, n, k, dtype, seed=60 + m, rows=2)
    res = torch.randn(m, n, generator=torch.Generator().manual_seed(m)).to(dtype)
    q, scale = quantize_int8_rows(w[:n].float())
    pairs = [(small_linear_triton(x, w[:n], blocks=blocks), small_linear_ref(x, w[:n]),
              NORM_TOL),
             (small_linear_triton(x, w[:n], residual=res, blocks=blocks),
              small_linear_ref(x, w[:n], residual=res), NORM_TOL),
             (norm_small_linear_triton(x, nw, 1e-5, w[:n], blocks=blocks),
              norm_small_linear_ref(x, nw, 1e-5, w[:n]), FUSED_TOL),
             (norm_small_linear_silu_mul_triton(x, nw, 1e-6, w, blocks=blocks),
              norm_small_linear_silu_mul_ref(x, nw, 1e-6, w), FUSED_TOL),
             (int8_linear_triton(x, q, scale, blocks=blocks), int8_linear_ref(x, q, scale),
              NORM_TOL)]
    for got, want, tol in pairs:
        assert got.dtype == dtype
        torch.testing.assert_close(got, want, **tol[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,k", [(2, 576), (3, 576), (4, 1536)])
def check_norm_qkv_rope_store_row_warps(dtype, m, k):
    """The rope + store epilogue after a warp-a-row product (choose_blocks' own pick)."""
    import outpace.kernels.skinny_gemm as sl
    assert sl.choose_blocks(m, 20, k, gate_up=True).rw_steps  # (3 + 2) x 8 / 2 columns
    check_norm_qkv_rope_store(dtype, dtype, m, 3, 1, 8, k, True)


def check_small_linear_rejects_a_short_tail():
    """A forced tail narrower than K's remainder would skip columns: refused."""
    x, w, _ = _linear_inputs(3, 50, 72, torch.float32, seed=41)
    with pytest.raises(ValueError, match="tail_k"):
        small_linear_triton(x, w, blocks=Blocks(2, 8, 64, 1, 2, False, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def check_small_linear_residual(dtype):
    """residual of the activation dtype, and an fp32 residual stream over bf16 x and w: one
    fp32 sum, one rounding to the residual's dtype."""
    for (m, n, k), res_dtype in zip(LINEAR_SHAPES, [dtype, torch.float32, torch.float32]):
        x, w, _ = _linear_inputs(m, n, k, dtype, seed=50 + m)
        res = torch.randn(m, n, generator=torch.Generator().manual_seed(m)).to(res_dtype)
        y = small_linear_triton(x, w, residual=res, blocks=_interp_blocks(m, n, k, dtype))
        assert y.dtype == res_dtype
        tol = NORM_TOL[dtype] if res_dtype == dtype else NORM_TOL[torch.float32]
        torch.testing.assert_close(y, small_linear_ref(x, w, residual=res), **tol)


def check_small_linear_out_buffer():
    """out= is written in place (a strided row view of a wider buffer), and returned."""
    m, n, k = 3, 96, 160
    x, w, _ = _linear_inputs(m, n, k, torch.float32, seed=60)
    buf = torch.full((m, n + 8), float("nan"))
    out = buf[:, 4:4 + n]
    y = small_linear_triton(x, w, out=out)
    assert y.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, small_linear_ref(x, w), **NORM_TOL[torch.float32])
    assert torch.isnan(buf[:, :4]).all() and torch.isnan(buf[:, 4 + n:]).all()


# (x dtype, weight dtype, RMSNorm weight dtype): the last two are fp32 activations over bf16
# weights (RunnerConfig.weight_dtype), with a bf16 or an fp32 RMSNorm weight: fp32 results. Their
# tl.dot splits x into bf16 pieces, which the interpreter gets wrong (tests/gpu covers it).
NORM_DTYPES = [(torch.float32,) * 3, (torch.bfloat16,) * 3,
               (torch.float32, torch.bfloat16, torch.bfloat16),
               (torch.float32, torch.bfloat16, torch.float32)]


# (the last of NORM_DTYPES, fp32 over a bf16 weight with an fp32 RMSNorm weight, is
# check_fp32_activations_over_bf16_weights' norm case, on the same path)
@pytest.mark.parametrize("dtypes", NORM_DTYPES[:3],
                         ids=lambda d: "-".join(str(t)[6:] for t in d))
@pytest.mark.parametrize("shape", LINEAR_SHAPES)
def check_norm_small_linear(shape, dtypes):
    m, n, k = shape
    x_dtype, w_dtype, nw_dtype = dtypes
    x, w, nw = _linear_inputs(m, n, k, x_dtype, seed=70 + m, w_dtype=w_dtype)
    nw = nw.to(nw_dtype)
    y = norm_small_linear_triton(x, nw, 1e-5, w, blocks=_interp_blocks(m, n, k, w_dtype))
    assert y.dtype == x_dtype and y.shape == (m, n)
    torch.testing.assert_close(y, norm_small_linear_ref(x, nw, 1e-5, w), **FUSED_TOL[x_dtype])


@pytest.mark.parametrize("dtypes", NORM_DTYPES[:3], ids=lambda d: "-".join(str(t)[6:] for t in d))
@pytest.mark.parametrize("shape", LINEAR_SHAPES)
def check_norm_small_linear_silu_mul(shape, dtypes):
    m, inter, k = shape
    x_dtype, w_dtype, nw_dtype = dtypes
    x, w, nw = _linear_inputs(m, inter, k, x_dtype, seed=80 + m, w_dtype=w_dtype, rows=2)
    nw = nw.to(nw_dtype)
    y = norm_small_linear_silu_mul_triton(x, nw, 1e-6, w,
                                          blocks=_interp_blocks(m, inter, k, w_dtype))
    assert y.dtype == x_dtype and y.shape == (m, inter)
    torch.testing.assert_close(y, norm_small_linear_silu_mul_ref(x, nw, 1e-6, w),
                               **FUSED_TOL[x_dtype])


# (16 rows take the tl.dot path over a bf16 weight; row blocks on the broadcast path: 5 rows)
@pytest.mark.parametrize("use_dot", [False])  # the tl.dot path: tests/gpu/test_weight_dtype.py
@pytest.mark.parametrize("shape", LINEAR_SHAPES[:3])
def check_fp32_activations_over_bf16_weights(shape, use_dot):
    """weight_dtype: fp32 x (RMSNorm weight, residual) over a bf16 weight, on the broadcast
    path: fp32 results matching the references (fp32 over the upcast weight) to fp32
    tolerance; a kernel that rounded the activations to bf16 (as all-bf16 does) would be ~1e-3
    off and fail. (The tl.dot path's bf16 pieces of x are beyond the interpreter's tl.dot.)"""
    m, n, k = shape
    x, w, nw = _linear_inputs(m, n, k, torch.float32, seed=110 + m, w_dtype=torch.bfloat16,
                              rows=2)
    nw = nw.float()
    res = torch.randn(m, 2 * n, generator=torch.Generator().manual_seed(m))
    one, two = (choose_blocks(m, c, k, use_dot=use_dot) for c in (2 * n, n))
    cases = [
        (small_linear_triton(x, w, blocks=one), small_linear_ref(x, w)),
        (small_linear_triton(x, w, residual=res, blocks=one),
         small_linear_ref(x, w, residual=res)),
        (norm_small_linear_triton(x, nw, 1e-5, w, blocks=one),
         norm_small_linear_ref(x, nw, 1e-5, w)),
        (norm_small_linear_silu_mul_triton(x, nw, 1e-6, w, blocks=two),
         norm_small_linear_silu_mul_ref(x, nw, 1e-6, w)),
        (small_linear_silu_mul_triton(x, w, blocks=two), small_linear_silu_mul_ref(x, w)),
    ]
    for got, want in cases:
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, **FUSED_TOL[torch.float32])
    rounded_input = F.linear(rms_norm_ref(x, nw, 1e-5).bfloat16().float(), w.float())
    assert not torch.allclose(cases[2][0], rounded_input, **FUSED_TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", LINEAR_SHAPES)
def check_small_linear_silu_mul(shape, dtype):
    m, inter, k = shape
    x, w, _ = _linear_inputs(m, inter, k, dtype, seed=90 + m, rows=2)
    y = small_linear_silu_mul_triton(x, w, blocks=_interp_blocks(m, inter, k, dtype))
    assert y.dtype == dtype and y.shape == (m, inter)
    torch.testing.assert_close(y, small_linear_silu_mul_ref(x, w), **FUSED_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,inter", [(1, 50), (7, 1500), (40, 3)])
def check_silu_mul(dtype, m, inter):
    g = torch.Generator().manual_seed(100 + m)
    gu = (torch.randn(m, 2 * inter + 6, generator=g) * 3).to(dtype)[:, 2:2 + 2 * inter]
    y = silu_mul_triton(gu)
    assert y.dtype == dtype and y.shape == (m, inter)
    # One rounding after an exact-ish silu: the interpreter may truncate both roundings.
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else NORM_TOL[dtype]
    torch.testing.assert_close(y, silu_mul_ref(gu), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab", [(1, 5000), (3, 4097), (2, 5)])
def check_argmax(dtype, rows, vocab):
    g = torch.Generator().manual_seed(rows + vocab)
    x = (torch.randn(rows, vocab, generator=g) * 4).to(dtype)
    top = x.max(dim=-1).values + 1
    x[:, vocab // 2] = top  # ties in different chunks: the first index wins
    x[:, -1] = top
    if rows > 1:
        x[1] = top[1]  # one value everywhere: index 0
    assert torch.equal(argmax_triton(x), x.argmax(dim=-1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab", [(1, 5000), (3, 4097), (7, 5)])
@pytest.mark.parametrize("with_offsets", [False, True])
def check_argmax_offsets(dtype, rows, vocab, with_offsets):
    """idx + offsets[idx] (EAGLE-3's d2t) added in the reduce kernel; ties to the first index."""
    g = torch.Generator().manual_seed(rows * vocab + with_offsets)
    x = (torch.randn(rows, vocab, generator=g) * 4).to(dtype)
    top = x.max(dim=-1).values + 1
    x[:, vocab // 3] = top  # ties in different chunks: the first one wins
    x[:, -1] = top
    if rows > 2:
        x[2] = top[2]  # one value everywhere: index 0
    # a d2t-like table: every index maps to a distinct target id, offsets of both signs
    offsets = (torch.randperm(vocab + 50, generator=g)[:vocab] - torch.arange(vocab)
               if with_offsets else None)
    got = argmax_triton(x, offsets)
    idx = x.argmax(dim=-1)
    want = idx + offsets[idx] if with_offsets else idx
    assert got.dtype == torch.int64 and torch.equal(got, want), (got, want)
    assert torch.equal(argmax_ref(x, offsets), want)
    assert torch.equal(got[0], want.new_tensor(vocab // 3) + (offsets[vocab // 3]
                                                              if with_offsets else 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(3, 5000), (4, 4097)])
@pytest.mark.parametrize("with_temp", [False, True])
def check_argmax_race(dtype, rows, vocab, with_temp):
    """race: the sampling race (sample/gumbel.py) in pass 1: rows with a seed word take the
    argmax of x / temperature + the reference's Gumbel noise for (key(word, position + offset),
    column), a row with word -1 the plain argmax; a kernel that dropped the noise, hashed
    differently or skipped the division picks other tokens."""
    from outpace.kernels.argmax import Race, argmax_ref, gumbel_noise, race_key
    g = torch.Generator().manual_seed(rows + vocab + with_temp)
    x = torch.randn(rows, vocab, generator=g).to(dtype)  # noise of the logits' own scale
    words = torch.randint(0, 1 << 32, (rows,), generator=g)
    words[1] = -1
    positions = torch.randint(0, 1 << 20, (rows,), generator=g)
    temp = torch.rand(rows, generator=g) * 1.5 + 1.5 if with_temp else None
    if temp is not None:
        temp[1] = 1.0
    race = Race(words, positions, temp, pos_offset=1)
    got = argmax_triton(x, race=race)
    want = argmax_ref(x, race=race)
    assert torch.equal(got, want), (got, want)
    assert got[1] == x[1].float().argmax()
    noisy = [i for i in range(rows) if i != 1]
    assert not torch.equal(got[noisy], x[noisy].float().argmax(-1))  # the noise mattered
    scaled = x.float() / temp.unsqueeze(1) if temp is not None else x.float()
    keys = race_key(words.clamp(min=0), positions + 1)
    ref = (scaled + gumbel_noise(keys, vocab))[noisy].argmax(-1)
    assert torch.equal(want[noisy], ref)
    if temp is not None:  # without the division the draws differ
        assert not torch.equal(got, argmax_ref(x, race=race._replace(temperature=None)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 18 rows: every row kind of masked_gumbel_cases.PARAMS in one case, over five chunks; 14 rows
# in one chunk; a vocabulary of two chunks
@pytest.mark.parametrize("rows,vocab,chunk", [(14, 300, 2048), (18, 300, 64), (6, 2500, 2048)])
def check_masked_race(dtype, rows, vocab, chunk):
    """kernels/masked_gumbel.py against race_tokens over apply_sampling_params' masks: top-k,
    top-p, min-p and their combinations, greedy rows, ties, -inf entries, one chunk or many
    (the passes skip chunks below the current token; tests/unit/masked_gumbel_cases.py); the
    masks changed the draw in some rows."""
    from outpace.kernels.masked_gumbel import masked_race_triton
    from outpace.sample.gumbel import race_tokens
    from tests.unit.masked_gumbel_cases import assert_matches_reference, make_case
    changed = 0
    for seed in range(2):  # (the seed also shifts which row kinds the rows get)
        case = make_case(rows, vocab, seed + rows, dtype)
        got = masked_race_triton(*case, pos_offset=1, chunk=chunk)
        assert_matches_reference(got, case, pos_offset=1)
        logits, words, positions, temp = case[:4]
        changed += int((got != race_tokens(logits.float(), words, positions, temperature=temp,
                                           pos_offset=1)).sum())
    assert changed >= 3


# chunks: 5 (two bisection reads of SPAN), 12 (three, the last partly past the vocabulary), and
# one chunk wider than the vocabulary
@pytest.mark.parametrize("vocab,chunk", [(300, 64), (3000, 256), (2500, 4096)])
def check_masked_race_top_k_mass(vocab, chunk):
    """The top-k set's mass (what top-p renormalises over when both are set), as the descent
    computes it (a bisection that skips chunks below its trial key, SPAN chunks a read,
    stopping at k), against the sum over the sort's first k: k of 1 .. vocab, ties."""
    from outpace.kernels import next_pow2
    from outpace.kernels.masked_gumbel import SPAN
    g = torch.Generator().manual_seed(vocab)
    for row in range(2):  # the second row with ties at the k-th value
        x = torch.randn(vocab, generator=g) * (1 + row)
        if row % 2:
            x = x.round()  # ties at the k-th value
        n = -(-vocab // chunk)
        xmax = torch.nn.functional.pad(x, (0, n * chunk - vocab), value=-math.inf)
        xmax = xmax.view(n, chunk).max(-1).values
        m = float(x.max())
        for k in (1, 7, 64, vocab - 1):
            out = torch.zeros(1)
            _top_k_mass_probe[(1,)](x, xmax, out, vocab, n, 1.0, m, k,
                                    CBLOCK=max(16, next_pow2(n)), CHUNK=chunk, SPAN=SPAN)
            want = torch.exp(x.sort(descending=True).values[:k].double() - m).sum()
            assert abs(float(out) - float(want)) <= 1e-5 * float(want), (row, k, out, want)


@pytest.mark.parametrize("num_also", [1, 2])
def check_argmax_also_writes_strided_columns(num_also):
    """The ids (with offsets) land in the result and in columns of wider int64 tensors (the
    fused step's output and carry), and nowhere else in them."""
    g = torch.Generator().manual_seed(num_also)
    x = torch.randn(3, 4097, generator=g)
    offsets = torch.randint(-50, 50, (4097,), generator=g)
    outs = [torch.full((3, 5), -7, dtype=torch.long) for _ in range(num_also)]
    got = argmax_triton(x, offsets, also=tuple(o[:, 2] for o in outs))
    want = x.argmax(-1) + offsets[x.argmax(-1)]
    assert torch.equal(got, want)
    for o in outs:
        assert torch.equal(o[:, 2], want)
        assert (o[:, [0, 1, 3, 4]] == -7).all()


@pytest.mark.parametrize("m,k", [(1, 40), (5, 576), (3, 2100)])
def check_split_pieces(m, k):
    """x -> three bf16 pieces (split_dot.split_mm's first step) that add up to x exactly, the
    first within a bf16 rounding of x; a strided x, magnitudes from 1e-6 to 1e6."""
    g = torch.Generator().manual_seed(m * k)
    x = (torch.randn(m, k + 8, generator=g) * 10.0 ** torch.randint(-6, 7, (m, k + 8),
                                                                    generator=g))[:, 4:4 + k]
    got = split_pieces_triton(x)
    assert got.dtype == torch.bfloat16 and got.shape == (3, m, k)
    for pieces in (got, split_pieces_ref(x)):
        assert torch.equal(pieces.double().sum(0), x.double())
        assert ((pieces[0].float() - x).abs() <= x.abs() * ULP_BF16).all()


def _head_input_case(t, h, dtype, table_dtype, seed, ids_dtype=torch.long):
    """ids [t] (distinct rows), a table [40, h], weights near 1 and hidden [t, h] as a strided
    view (row stride > h)."""
    g = torch.Generator().manual_seed(seed)
    table = (torch.randn(40, h, generator=g) * 2).to(table_dtype)
    ids = torch.randperm(40, generator=g)[:t].to(ids_dtype)
    ew = (1 + 0.2 * torch.randn(h, generator=g)).to(dtype)
    hw = (1 + 0.2 * torch.randn(h, generator=g)).to(dtype)
    hidden = (torch.randn(t, h + 8, generator=g) * 3).to(dtype)[:, 4:4 + h]
    return ids, table, ew, hidden, hw


# (activation dtype, table dtype): a table stored narrower than the activations (weight_dtype)
HEAD_INPUT_DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                     (torch.float16, torch.float16), (torch.float32, torch.bfloat16),
                     (torch.float32, torch.float16)]


@pytest.mark.parametrize("dtype,table_dtype", HEAD_INPUT_DTYPES)
@pytest.mark.parametrize("t", [1, 3, 7])
@pytest.mark.parametrize("h", [64, 576])
def check_embed_norm_cat(dtype, table_dtype, t, h):
    ids, table, ew, hidden, hw = _head_input_case(t, h, dtype, table_dtype, seed=t * h)
    got = embed_norm_cat_triton(ids, table, ew, hidden, hw, 1e-5)
    want = embed_norm_cat_ref(ids, table, ew, hidden, hw, 1e-5)
    assert got.dtype == dtype and got.shape == (t, 2 * h)
    torch.testing.assert_close(got, want, **NORM_TOL[dtype])
    # the same values as the composition it replaces on CUDA (gather, cast, norm.py's kernel
    # twice, cat), bit for bit: the same arithmetic and roundings
    emb = F.embedding(ids, table).to(dtype)
    comp = torch.cat([rms_norm_triton(emb, ew, 1e-5), rms_norm_triton(hidden, hw, 1e-5)], -1)
    assert torch.equal(got, comp)
    # each half is its own norm of its own input (a swapped weight or half is caught)
    assert not torch.equal(got[:, :h], rms_norm_triton(emb, hw, 1e-5))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def check_embed_norm_cat_wider_table(dtype):
    """A table wider than the activations (int32 ids): its rows are rounded to the activation
    dtype before the statistics. The fp32 entries sit up to 0.5 ulp (random) above a
    representable value, so the interpreter's truncating cast and torch's rounding agree."""
    ids, table, ew, hidden, hw = _head_input_case(3, 64, dtype, dtype, seed=5,
                                                  ids_dtype=torch.int32)
    half_ulp = 2.0 ** (-9 if dtype == torch.bfloat16 else -12)  # relative, at least
    table = table.float() * (1 + half_ulp * torch.rand(table.shape,
                                                       generator=torch.Generator().manual_seed(6)))
    got = embed_norm_cat_triton(ids, table, ew, hidden, hw, 1e-6)
    torch.testing.assert_close(got, embed_norm_cat_ref(ids.long(), table, ew, hidden, hw, 1e-6),
                               **NORM_TOL[dtype])
    emb = F.embedding(ids.long(), table).to(dtype)
    assert torch.equal(got, torch.cat([rms_norm_triton(emb, ew, 1e-6),
                                       rms_norm_triton(hidden, hw, 1e-6)], -1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 24])
def check_rope_and_store(dtype, d):
    g = torch.Generator().manual_seed(d)
    t, hq, hkv, blocks, bs = 7, 4, 2, 5, 4
    qkv = torch.randn(t, hq + 2 * hkv, d, generator=g).to(dtype)
    cos, sin = torch.randn(50, d // 2, generator=g), torch.randn(50, d // 2, generator=g)
    pos = torch.randint(0, 50, (t,), generator=g)
    slots = torch.randperm((blocks - 1) * bs, generator=g)[:t] + bs
    slots[3] = -1
    cache = torch.full((2, 2, blocks, bs, hkv, d), float("nan"), dtype=dtype)
    ref_cache = cache.clone()
    k, v = qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    k_before, q_ref = k.clone(), qkv[:, :hq].clone()
    apply_rope_and_store_ref(q_ref, k, v, cos, sin, pos, ref_cache, 1, slots)
    q = qkv[:, :hq]  # a strided view, rotated in place
    apply_rope_and_store_triton(q, k, v, cos, sin, pos, cache, 1, slots)
    torch.testing.assert_close(q, q_ref, **EXACT_TOL[dtype])
    torch.testing.assert_close(cache[:, :, 1:], ref_cache[:, :, 1:], equal_nan=True,
                               **EXACT_TOL[dtype])
    assert torch.isnan(cache[:, :, 0].float()).all(), "a padded row was written"
    assert torch.isnan(cache[0].float()).all(), "another layer slot was written"
    assert torch.equal(k, k_before), "k was modified"


# (activation dtype, weight dtype); the last: fp32 over bf16 weights (weight_dtype)
QKV_DTYPES = [(torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.float32, torch.bfloat16)]
QKV_SHAPES = [(1, 4, 2, 16, 40, True), (3, 3, 1, 24, 72, True), (16, 2, 2, 8, 96, True),
              (3, 3, 1, 24, 72, False)]
# A prefill's rows (mid_rows_ok): tl.dot in row blocks of 16 (33 rows: a ragged third) and of
# 32 (80 rows), in fp32 (the interpreter's tl.dot is wrong for a bf16 weight, which would take
# the broadcast path here, a path no prefill takes; tests/gpu covers bf16)
QKV_MID_ROWS = [(torch.float32, torch.float32, 33, 3, 1, 16, 64, False),
                (torch.float32, torch.float32, 80, 3, 1, 16, 64, False)]


@pytest.mark.parametrize("dtype,w_dtype,m,hq,hkv,d,k,with_norm",
                         [(*dt, *shape) for shape in QKV_SHAPES for dt in QKV_DTYPES]
                         + QKV_MID_ROWS, ids=str)
def check_norm_qkv_rope_store(dtype, w_dtype, m, hq, hkv, d, k, with_norm):
    g = torch.Generator().manual_seed(m * d + k)
    blocks, bs = max(6, m // 4 + 3), 4
    x = (torch.randn(m, k, generator=g) * 2).to(dtype)
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype) if with_norm else None
    w = (0.2 * torch.randn((hq + 2 * hkv) * d, k, generator=g)).to(w_dtype)
    table = torch.randn(30, d if m == 3 else d // 2, generator=g)  # both table layouts
    cos, sin = table.cos(), table.sin()
    pos = torch.randint(0, 30, (m,), generator=g)
    slots = torch.randperm((blocks - 1) * bs, generator=g)[:m] + bs
    slots[m // 2] = -1 if m > 1 else slots[0]
    cache = torch.full((2, 2, blocks, bs, hkv, d), float("nan"), dtype=dtype)
    ref_cache = cache.clone()
    want = norm_qkv_rope_store_ref(x, nw, 1e-5, w, hq, hkv, d, cos, sin, pos, ref_cache, 1, slots)
    got = norm_qkv_rope_store_triton(x, nw, 1e-5, w, hq, hkv, d, cos, sin, pos, cache, 1, slots,
                                     blocks=_interp_blocks(m, (hq + 2 * hkv) * d // 2, k, w_dtype))
    assert got.dtype == dtype
    # fp32: summation order only. bf16: a projection output an ulp apart (summation order,
    # the interpreter's truncating cast) moves a rotated value by an ulp of the larger of the
    # pair it mixes, so the bound scales with the values' size; a wrong rotation or slot is
    # off by O(1).
    tol = NORM_TOL[dtype] if dtype == torch.float32 else dict(
        atol=4 * ULP_BF16 * want.float().abs().max().item(), rtol=ULP_BF16)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(cache[:, :, 1:], ref_cache[:, :, 1:], equal_nan=True, **tol)
    assert torch.isnan(cache[:, :, 0].float()).all(), "a padded row was written"
    assert torch.isnan(cache[0].float()).all(), "another layer slot was written"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("m", [33, 80, 150])
def check_prefill_rows_in_row_blocks(dtype, m):
    """A short prefill's projections (small_linear.mid_rows_ok: more than SMALL_M_MAX rows)
    take choose_blocks' row blocks of tl.dot (33: two blocks of 16 and a ragged one; 80: 32 and
    64-row blocks; 150: 32 rows and 32 columns a program): plain (o_proj) and gate_up + silu *
    mul, each row against its reference (qkv + rope + KV store: check_norm_qkv_rope_store).
    (fp16, not bf16: the interpreter's bf16 tl.dot is wrong.)"""
    k, n = 64, 40
    x, w, _ = _linear_inputs(m, n, k, dtype, seed=300 + m)
    assert choose_blocks(m, n, k).block_m < m  # several row blocks
    torch.testing.assert_close(small_linear_triton(x, w), small_linear_ref(x, w),
                               **NORM_TOL[dtype])
    x, w, _ = _linear_inputs(m, n, k, dtype, seed=310 + m, rows=2)
    torch.testing.assert_close(small_linear_silu_mul_triton(x, w),
                               small_linear_silu_mul_ref(x, w), **NORM_TOL[dtype])


# ---- the fused step's bookkeeping (runner/step_bookkeeping.py): integers, so exact equality ----------

def _tables(g, bucket, width=5, blocks=40):
    return torch.randint(1, blocks, (bucket, width), generator=g, dtype=torch.int32)


@pytest.mark.parametrize("bucket,q", [(1, 1), (3, 3), (8, 5), (4, 2)])
@pytest.mark.parametrize("host", [False, True], ids=["device-drafts", "host-drafts"])
def check_chained_inputs(bucket, q, host):
    """host: a host drafter's staged drafts (a strided view) make rows 1 .. q - 1, and the
    staged draft counts stay as they are."""
    g = torch.Generator().manual_seed(bucket * 10 + q)
    bs, kmax = 4, 6
    real = torch.rand(bucket, generator=g) < 0.7
    real[0] = True
    carry_pos = torch.where(real, torch.randint(0, 30, (bucket,), generator=g), 0)
    carry_tokens = torch.randint(0, 1000, (bucket, kmax), generator=g)
    drafts = torch.randint(1000, 2000, (bucket, kmax + 2), generator=g)[:, 1:kmax] if host \
        else None
    tables = _tables(g, bucket)
    outs = []
    for fn in (chained_inputs_ref, chained_inputs_triton):
        bufs = [torch.full((bucket * q + 7,), -9, dtype=torch.long) for _ in range(3)] + [
            torch.full((bucket + 2,), -9, dtype=torch.int32) for _ in range(2)] + [
            torch.full((bucket + 2,), -9, dtype=torch.long)]
        fn(carry_pos, carry_tokens, real, tables, bs, q, *bufs, host_drafts=drafts)
        outs.append(bufs)
    for want, got in zip(*outs):
        assert torch.equal(got, want), (got, want)
    assert (outs[0][2][:bucket * q].view(bucket, q)[~real] == -1).all()  # padding: no slot
    ids = outs[0][0][:bucket * q].view(bucket, q)
    assert torch.equal(ids[:, 0], carry_tokens[:, 0])
    assert torch.equal(ids[:, 1:], (drafts if host else carry_tokens[:, 1:])[:, :q - 1])
    assert (outs[0][5][:bucket] == -9).all() if host else \
        torch.equal(outs[0][5][:bucket], torch.where(real, q - 1, 0))


@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize("bucket,q", [(1, 1), (2, 3), (5, 5), (3, 4)])
def check_accept(bucket, q, force):
    g = torch.Generator().manual_seed(bucket * 10 + q + force)
    target = torch.randint(0, 50, (bucket * q,), generator=g)
    ids = torch.randint(0, 50, (bucket * q,), generator=g)
    nd = torch.randint(0, q, (bucket,), generator=g)
    for b in range(bucket):  # drafts agreeing with the target for a random prefix
        m = int(torch.randint(0, q, (1,), generator=g))
        for j in range(min(m, q - 1)):
            ids[b * q + 1 + j] = target[b * q + j]
    positions = (torch.randint(10, 90, (bucket, 1), generator=g) + torch.arange(q)).view(-1)
    u = torch.rand(bucket, generator=g) if force else None
    packed_ref = torch.full((bucket, q + 3), -7, dtype=torch.long)
    packed = packed_ref.clone()
    want = accept_ref(target, ids, nd, positions, q, packed_ref, u, 2.6)
    carry_pos = torch.full((bucket,), -5, dtype=torch.long)
    carry_tok = torch.full((bucket, 4), -5, dtype=torch.long)
    got = accept_triton(target, ids, nd, positions, q, packed, u, 2.6,
                        carry=(carry_pos, carry_tok))
    assert torch.equal(packed, packed_ref), (packed, packed_ref)
    for a, b in zip(got, want[:3]):
        assert torch.equal(a, b), (a, b)
    assert torch.equal(carry_pos, want[2] + 1) and torch.equal(carry_tok[:, 0], want[3])
    assert (carry_tok[:, 1:] == -5).all()
    # the head's outputs can be left out (a plain engine's step)
    packed2 = torch.full((bucket, q + 1), -7, dtype=torch.long)
    assert accept_triton(target, ids, nd, positions, q, packed2, u, 2.6, head=False) == \
        (None, None, None)
    assert torch.equal(packed2, packed_ref[:, :q + 1])


@pytest.mark.parametrize("bucket,steps", [(1, 1), (3, 4), (8, 2)])
def check_loop_inputs(bucket, steps):
    g = torch.Generator().manual_seed(bucket + steps)
    first = torch.randint(0, 25, (bucket,), generator=g)
    tables = _tables(g, bucket)
    for a, b in zip(loop_inputs_triton(first, tables, 4, steps),
                    loop_inputs_ref(first, tables, 4, steps)):
        assert a.dtype == b.dtype and torch.equal(a, b), (a, b)


@pytest.mark.parametrize("bucket,q,vocab", [(1, 1, 300), (2, 3, 5000), (3, 4, 97), (5, 2, 2048)])
def check_penalize_rows(bucket, q, vocab):
    """Every row's penalties over its request's tables plus the drafts before it, bit for bit
    torch's; rows of 1, 0, 0 untouched. Small vocabularies make drafts repeat table tokens."""
    g = torch.Generator().manual_seed(bucket * 7 + q)
    m = bucket + 2  # tables have rows past the bucket
    logits = torch.randn(bucket * q, vocab, generator=g) * 4
    logits[0, :5] = torch.tensor([0.0, -0.0, float("-inf"), 1e-30, -1e-30])
    prompt = torch.rand(m, vocab, generator=g) < 0.2
    counts = torch.randint(0, 3, (m, vocab), generator=g).float() \
        * (torch.rand(m, vocab, generator=g) < 0.3)
    ids = torch.randint(0, min(vocab, 40), (bucket * q,), generator=g)
    rep = 0.5 + 1.5 * torch.rand(m, generator=g)
    freq = torch.rand(m, generator=g) * 2 - 0.5
    pres = torch.rand(m, generator=g) * 2 - 1
    last = bucket - 1  # the last request has no penalties (when there are several)
    if bucket > 1:
        rep[last], freq[last], pres[last] = 1.0, 0.0, 0.0
    want = penalize_rows_ref(logits.clone(), prompt, counts, ids, rep, freq, pres, bucket, q)
    got = penalize_rows_triton(logits.clone(), prompt, counts, ids, rep, freq, pres, bucket, q,
                               block=256)  # several programs a row
    assert torch.equal(got, want), (got - want).abs().max()
    assert not torch.equal(got[:q], logits[:q])
    if bucket > 1:
        assert torch.equal(got[last * q:], logits[last * q:])
    if q > 1:  # the drafts counted: without them the last rows differ
        alone = penalize_rows_ref(logits.clone(), prompt, counts, torch.full_like(ids, vocab - 1),
                                  rep, freq, pres, bucket, q)
        assert not torch.equal(alone, want)


@pytest.mark.parametrize("bucket,q", [(1, 1), (3, 4), (4, 3)])
def check_count_emitted(bucket, q):
    g = torch.Generator().manual_seed(bucket + q)
    vocab = 11
    packed = torch.randint(0, 4, (bucket, q + 3), generator=g)  # repeats within a row
    for b in range(bucket):  # -1 past a random accepted count
        packed[b, int(torch.randint(1, q + 1, (1,), generator=g)):q] = -1
    counts = torch.randint(0, 3, (bucket + 1, vocab), generator=g).float()
    want = counts.clone()
    count_emitted_ref(packed, q, want)
    count_emitted_triton(packed, q, counts)
    assert torch.equal(counts, want)
    assert want.sum() - counts.sum() == 0 and (packed[:, :q] >= 0).sum() > 0


@pytest.mark.parametrize("rows,vocab,top,chunk", [(5, 300, 20, 64), (2, 3000, 20, 2048),
                                                  (6, 97, 5, 32), (1, 20, 20, 16),
                                                  (5, 1000, 0, 256)])
def check_row_logprobs(rows, vocab, top, chunk):
    """Each row's token logprob and its top `top` (ties to the lower id) against the stable
    reference, the pieces (several a row: chunk) merged, and the first of them when a count
    asks for fewer; a garbage row (NaN) still yields ids in range."""
    logits, tokens = logprobs_cases.make_case(rows, vocab, seed=rows * vocab + top)
    want = logprobs_cases.stable_ref(logits, tokens, top)
    logprobs_cases.check(row_logprobs_triton(logits, tokens, top, chunk=chunk), want, top)
    for count in {0, min(3, top)}:  # a graph's count: the first `count` of the top
        cols = [0, *range(1, 1 + count), *range(1 + top, 1 + top + count)]
        # (logits far below 0 too: a slot past the count that were read would win then)
        for shift in (0.0, -100.0):
            got = row_logprobs_triton(logits + shift, tokens, top,
                                      torch.tensor([count], dtype=torch.int32), chunk=chunk)
            logprobs_cases.check(got[:, cols], want[:, cols], count, tol=1e-6 - shift * 1e-6)
    logits[0, ::3] = float("nan")
    ids = row_logprobs_triton(logits, tokens, top, chunk=chunk)[:, 1 + top:]
    assert bool(((ids >= 0) & (ids < vocab)).all())


# ---- the device n-gram lookup (kernels/ngram_lookup.py): integers, so exact equality ----------

def _ngram_case(g, rows, width, vocab, dtype=torch.long):
    """(history [rows, width], lengths [rows]): half the rows repeated motifs (long matches,
    continuations that run into the end), half random ids; lengths 0, 1, 2 and width among
    random ones, one past the width and one below 0 where there are rows enough (both clamped),
    stale ids past every length."""
    hist = torch.randint(0, vocab, (rows, width), generator=g)
    for b in range(0, rows, 2):
        motif = torch.randint(0, vocab, (int(torch.randint(1, 6, (1,), generator=g)),),
                              generator=g)
        hist[b] = motif.repeat(width // motif.numel() + 1)[:width]
        if b % 4 == 0 and width > 4:  # one slip in the motif
            hist[b, int(torch.randint(0, width, (1,), generator=g))] = vocab - 1
    lengths = torch.randint(0, width + 1, (rows,), generator=g)
    fixed = [0, 1, 2, width, width + 7, -3]
    if rows >= len(fixed):
        lengths[:len(fixed)] = torch.tensor(fixed)
    else:
        lengths[0] = width
    return hist.to(dtype), lengths


def _same_ngram(got, want):
    for a, b in zip(got, want):
        assert a.dtype == torch.long and a.shape == b.shape and torch.equal(a, b), (a, b)


@pytest.mark.parametrize("k,min_n,max_n,periodic", [(4, 1, 4, False), (7, 2, 5, True),
                                                    (1, 3, 3, False), (5, 1, 8, True),
                                                    (3, 1, 1, False), (0, 1, 4, False)])
@pytest.mark.parametrize("block", [16, 512])
def check_ngram_lookup(k, min_n, max_n, periodic, block):
    """The kernel's (drafts, counts) equal the tensor-op reference's on random rows, for one
    block covering every row and for several blocks a row (the walk's early stop)."""
    g = torch.Generator().manual_seed(k * 100 + min_n * 10 + max_n + periodic + block)
    proposed = 0
    for rows, width, vocab, dtype in ((9, 300, 2, torch.long), (6, 200, 3, torch.int32),
                                      (1, 130, 5, torch.int32), (3, 40, 4, torch.long)):
        hist, lengths = _ngram_case(g, rows, width, vocab, dtype)
        if dtype == torch.int32:  # int32 lengths too (the kernel loads either)
            lengths = lengths.to(torch.int32)
        want = ngram_propose_ref(hist, lengths, k, min_n, max_n, periodic)
        got = ngram_lookup_triton(hist, lengths, k, min_n, max_n, periodic, block=block)
        _same_ngram(got, want)
        proposed += int(want[1].sum())
    assert k == 0 or proposed > 0  # the cases propose something


@pytest.mark.parametrize("width", [0, 1, 2, 3])
def check_ngram_lookup_narrow(width):
    """Buffers too narrow for max_n (or any n): top_n = width - 1 below min_n proposes
    nothing; a strided history (a view of a wider buffer, as the fused step passes)."""
    wide = torch.full((3, width + 1), 5, dtype=torch.int32)
    hist = wide[:, :width]
    lengths = torch.tensor([0, min(width, 1), width])
    for min_n, max_n in ((1, 4), (2, 3), (3, 3)):
        for periodic in (False, True):
            _same_ngram(ngram_lookup_triton(hist, lengths, 4, min_n, max_n, periodic),
                        ngram_propose_ref(hist, lengths, 4, min_n, max_n, periodic))


def check_ngram_lookup_planted():
    """Rows whose answers are known: the most recent occurrence, the longest n before a more
    recent shorter one, an occurrence ending at L - 2, none at L - 1, a match at position 0."""
    rows = [
        ([7, 8, 9, 7, 8], [9, 7, 8]),  # the 2-gram at 0: its continuation runs to the end
        ([1, 2, 3, 9, 5, 2, 3, 8, 7, 1, 2, 3], [9, 5, 2]),  # the 3-gram at 0, not the 2-gram
        ([4, 6, 1, 4, 6, 2, 4, 6], [2, 4, 6]),  # the most recent of two 2-gram occurrences
        ([3, 3], [3]),  # the 1-gram ending at L - 2 = 0
        ([5, 1, 2, 3], []),  # no earlier occurrence (the suffix itself ends at L - 1)
        ([2, 4, 2, 4, 2], [4, 2]),  # [2, 4, 2] at 0 (n = 3), continuation to the end
    ]
    width = 16
    hist = torch.full((len(rows), width), 9, dtype=torch.long)  # stale 9s past the lengths
    for b, (text, _) in enumerate(rows):
        hist[b, :len(text)] = torch.tensor(text)
    lengths = torch.tensor([len(text) for text, _ in rows])
    for block in (2, 4, 512):
        drafts, counts = ngram_lookup_triton(hist, lengths, 3, 1, 4, block=block)
        have = [d[:c] for d, c in zip(drafts.tolist(), counts.tolist())]
        assert have == [want for _, want in rows], have
        assert not drafts[torch.arange(3) >= counts[:, None]].any()
    drafts, counts = ngram_lookup_triton(hist, lengths, 3, 1, 4, periodic=True)
    assert drafts[5].tolist() == [4, 2, 4] and counts[5] == 3  # period 2 past the end


@pytest.mark.parametrize("k,min_n,max_n", [(3, 1, 4), (5, 2, 3)])
def check_ngram_lookup_step_outputs(k, min_n, max_n):
    """With StepOutputs (the fused step's form): the same writes as the fused step's tensor-op
    path (`step_drafts_ref`) into strided views of wider buffers, counts capped near the
    context and 0 in rows not real, nothing written outside the views."""
    g = torch.Generator().manual_seed(k + min_n)
    rows, width, q = 8, 120, 2
    wide, lengths = _ngram_case(g, rows, width + 1, 3, torch.int32)
    hist = wide[:, :width]  # the history's scratch column left out, as the fused step does
    lengths = lengths.clamp(0, width)
    lengths[6:] = torch.tensor([width - 2, width - 3])  # the context caps these counts
    real = torch.rand(rows, generator=g) < 0.7
    real[6:] = True
    outs = []
    for run in ("ref", "kernel"):
        packed = torch.full((rows, q + 1 + k), -7, dtype=torch.long)
        carry = torch.full((rows, k + 2), -7, dtype=torch.long)
        counts = torch.full((rows + 1,), -7, dtype=torch.long)
        out = StepOutputs(carry[:, 1:1 + k], packed[:, q + 1:], counts[:rows], real, width)
        if run == "ref":
            step_drafts_ref(hist, lengths, k, min_n, max_n, out)
        else:
            assert ngram_lookup_triton(hist, lengths, k, min_n, max_n, step=out)[1] \
                is out.counts
        outs.append((packed, carry, counts))
    for a, b in zip(*outs):
        assert torch.equal(a, b), (a, b)
    packed, carry, counts = outs[1]
    assert (packed[:, :q + 1] == -7).all() and (carry[:, 0] == -7).all() \
        and (carry[:, 1 + k:] == -7).all() and counts[rows] == -7
    assert (counts[:rows][~real] == 0).all() and counts[6] <= 1 and counts[7] <= 2
    assert counts[:rows].sum() > 0


def check_ngram_lookup_strided_vectors():
    """lengths, step.counts and step.real as strided views (columns of wider buffers): read
    and written through their strides, as the reference and step_drafts_ref do, and nothing
    written outside the counts' view."""
    hist = torch.tensor([[1, 2, 1, 2, 1, 2, 0, 0]] * 3)
    lengths = torch.tensor([[6, 0], [2, 0], [5, 0]])[:, 0]  # stride 2
    _same_ngram(ngram_lookup_triton(hist, lengths, 2, 1, 4),
                ngram_propose_ref(hist, lengths, 2, 1, 4))
    real = torch.tensor([[True, False], [True, False], [False, True]])[:, 0]
    outs = []
    for run in ("ref", "kernel"):
        counts = torch.full((3, 2), -7, dtype=torch.long)
        out = StepOutputs(torch.zeros(3, 2, dtype=torch.long),
                          torch.zeros(3, 2, dtype=torch.long), counts[:, 0], real, 8)
        if run == "ref":
            step_drafts_ref(hist, lengths, 2, 1, 4, out)
        else:
            ngram_lookup_triton(hist, lengths, 2, 1, 4, step=out)
        outs.append((out.drafts, out.marked, counts))
    for a, b in zip(*outs):
        assert torch.equal(a, b), (a, b)
    assert (outs[1][2][:, 1] == -7).all() and outs[1][2][:, 0].tolist() == [1, 0, 0]
