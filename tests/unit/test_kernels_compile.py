"""The step's Triton kernels compile for the H200 (sm_90: frontend, LLVM and triton's bundled
ptxas) on a machine without a GPU. The interpreter checks (test_kernels_interpret.py) run a
kernel's Python, not its compilation; GPU time is scarce, so a variant that only the compiler
would reject is caught here first. Each case is a configuration the launchers pick."""

from __future__ import annotations

import re

import pytest
import torch

triton = pytest.importorskip("triton")

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except Exception:  # pragma: no cover - a triton without these entry points
    pytest.skip("this triton has no ahead-of-time compile entry points", allow_module_level=True)

H200 = GPUTarget("cuda", 90, 32)


def compile_for_h200(fn, pointers: dict, floats: tuple, constexprs: dict, num_warps: int,
                     num_stages: int = 2, aligned: tuple = (), options: dict = None):
    """fn's arguments: pointers (name -> element type), float scalars, constexprs; the rest are
    i32 scalars. `aligned`: i32 arguments divisible by 16, as a launch specializes them (and
    then every pointer 16-byte aligned): the loads' vector width, and so their layouts,
    depend on it. -> the compiled kernel."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = "*" + pointers[name]
        else:
            sig[name] = "fp32" if name in floats else "i32"
        if aligned and (name in pointers or name in aligned):
            attrs[(i,)] = [["tt.divisibility", 16]]
    try:
        src = ASTSource(fn=fn, signature=sig, attrs=attrs or None,
                        constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    except TypeError as e:  # pragma: no cover - another triton's ASTSource signature
        pytest.skip(f"this triton's ASTSource takes other arguments: {e}")
    try:
        return triton.compile(src, target=H200, options={
            "num_warps": num_warps, "num_stages": num_stages, "launch_pdl": True,
            **(options or {})})
    except FileNotFoundError as e:  # pragma: no cover - a triton wheel without ptxas
        pytest.skip(f"no CUDA toolchain in this triton: {e}")


# (PREFETCH, NUM_SPLITS, head_dim, group): SmolLM2's batch-1 decode / verify (prefetch, split-KV
# with the fused merge), the same without the prefetch, the 8B shape, one split
ATTN = [(True, 4, 64, 3), (False, 4, 64, 3), (False, 4, 128, 4), (True, 1, 64, 3),
        (False, 1, 128, 4)]


# (q and out, the KV pool): bf16; fp32 (tf32x3 dots); fp32 over a bf16 pool (kv_cache_dtype:
# bf16 pieces of q and p, kernels/bf16x3.py)
PRECISIONS = {"bf16": ("bf16", "bf16"), "fp32": ("fp32", "fp32"),
              "fp32-over-bf16": ("fp32", "bf16")}


@pytest.mark.parametrize("precision", sorted(PRECISIONS))
@pytest.mark.parametrize("prefetch,splits,head_dim,group", ATTN, ids=str)
def test_attention_kernel_compiles(prefetch, splits, head_dim, group, precision):
    from outpace.attention.triton_paged_kernels import _paged_attn_kernel
    act, pool = PRECISIONS[precision]
    fp32 = act == "fp32"
    if fp32 and head_dim > 64:
        pytest.skip("fp32 decode tiles of 64 columns are for heads of at most 64")
    io = {"q_ptr": act, "out_ptr": act, "kc_ptr": pool, "vc_ptr": pool}
    ws = {n: "fp32" for n in ("ws_acc_ptr", "ws_m_ptr", "ws_l_ptr")}
    i32 = {n: "i32" for n in ("cnt_ptr", "qsl_ptr", "seq_lens_ptr", "bt_ptr", "tile_ptr")}
    gp = 1 << (group - 1).bit_length()
    k = compile_for_h200(_paged_attn_kernel, {**io, **ws, **i32}, ("qk_scale",), {
        "BLOCK_SIZE": 16, "GROUP": group, "GROUP_PAD": gp, "BLOCK_Q": 16 // gp, "BLOCK_M": 16,
        "BLOCK_N": 64, "BLOCK_D": head_dim, "NUM_SPLITS": splits, "IS_FP32": fp32,
        "FUSED_MERGE": splits > 1, "PREFETCH": prefetch, "TILE_MAP": False, "USE_PDL": True},
        num_warps=4)
    assert k.asm["cubin"]
    assert "mma" in k.asm["ptx"]  # fp32 too: tensor cores (tf32x3 / bf16 pieces), not FMA
    if pool == "bf16":
        assert "bf16" in k.asm["ptx"]  # the bf16 pieces: bf16 tensor-core instructions


@pytest.mark.parametrize("q_len", [96, 256])
def test_attention_kernel_compiles_for_a_short_prefill(q_len):
    """A short prompt's prefill graph (no tile map): choose_tiles' 64-row, 4-warp tiles."""
    from outpace.attention.triton_paged import choose_tiles
    from outpace.attention.triton_paged_kernels import _paged_attn_kernel
    cfg = choose_tiles(q_len, 3, 64, torch.bfloat16)
    assert (cfg.block_m, cfg.num_warps) == (64, 4)
    io = {"q_ptr": "bf16", "out_ptr": "bf16", "kc_ptr": "bf16", "vc_ptr": "bf16"}
    ws = {n: "fp32" for n in ("ws_acc_ptr", "ws_m_ptr", "ws_l_ptr")}
    i32 = {n: "i32" for n in ("cnt_ptr", "qsl_ptr", "seq_lens_ptr", "bt_ptr", "tile_ptr")}
    k = compile_for_h200(_paged_attn_kernel, {**io, **ws, **i32}, ("qk_scale",), {
        "BLOCK_SIZE": 16, "GROUP": 3, "GROUP_PAD": 4, "BLOCK_Q": cfg.block_q,
        "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_D": 64, "NUM_SPLITS": 1,
        "IS_FP32": False, "FUSED_MERGE": False, "PREFETCH": False, "TILE_MAP": False,
        "USE_PDL": True}, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    assert k.asm["cubin"]
    assert "mma" in k.asm["ptx"]


@pytest.mark.parametrize("act", ["bf16", "fp32"])
def test_attention_kernel_compiles_with_a_tile_map(act):
    """A varlen graph's launch: prefill tiles (SmolLM2's group of 3, heads of 64), programs
    from a (sequence, query block) map, one split."""
    from outpace.attention.triton_paged import choose_tiles
    from outpace.attention.triton_paged_kernels import _paged_attn_kernel
    cfg = choose_tiles(64, 3, 64, torch.bfloat16 if act == "bf16" else torch.float32,
                       tile_map=True)
    io = {"q_ptr": act, "out_ptr": act, "kc_ptr": act, "vc_ptr": act}
    ws = {n: "fp32" for n in ("ws_acc_ptr", "ws_m_ptr", "ws_l_ptr")}
    i32 = {n: "i32" for n in ("cnt_ptr", "qsl_ptr", "seq_lens_ptr", "bt_ptr", "tile_ptr")}
    k = compile_for_h200(_paged_attn_kernel, {**io, **ws, **i32}, ("qk_scale",), {
        "BLOCK_SIZE": 16, "GROUP": 3, "GROUP_PAD": 4, "BLOCK_Q": cfg.block_q,
        "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_D": 64, "NUM_SPLITS": 1,
        "IS_FP32": act == "fp32", "FUSED_MERGE": False, "PREFETCH": False, "TILE_MAP": True,
        "USE_PDL": True}, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    assert k.asm["cubin"]
    assert "mma" in k.asm["ptx"]


# (HAS_NORM, SILU_MUL, ROPE_STORE, HAS_RESIDUAL, BLOCK_M, BLOCK_K, TAIL_K, warps): SmolLM2's
# 3-row verify projections, one row a program with K = 576 split 512 + 64 (norm + gate_up +
# silu, norm + qkv + rope + store, o + residual) and down (1536 = 1024 + 512); 4 rows' blocks
# of two; one row's padded tile
LINEAR = [(True, True, False, False, 1, 512, 64, 1), (True, False, True, False, 1, 512, 64, 1),
          (False, False, False, True, 1, 512, 64, 1), (False, False, False, True, 1, 1024, 512, 1),
          (True, True, False, False, 2, 512, 64, 1), (False, False, False, True, 2, 1024, 512, 1),
          (True, True, False, False, 1, 1024, 0, 4)]
_ALIGNED = ("N", "K", "stride_xm", "stride_rm", "stride_om")


def _linear_constexprs(norm, silu, rope, residual, block_m, block_n, block_k, tail_k,
                       rw_steps=0, rw_rest=0, rw_rest_w=256):
    return {"HAS_NORM": norm, "NORM_ROUND": norm, "HAS_RESIDUAL": residual, "SILU_MUL": silu,
            "W_SCALE": False, "ROPE_STORE": rope, "TWO_TILES": silu or rope, "HALF": 32,
            "HQ": 9, "HKV": 3, "CACHE_BLOCK": 16, "USE_DOT": False, "BLOCK_M": block_m,
            "BLOCK_N": block_n, "BLOCK_K": block_k, "TAIL_K": tail_k, "RW_STEPS": rw_steps,
            "RW_REST": rw_rest, "RW_REST_W": rw_rest_w, "USE_PDL": True}


_LINEAR_PTRS = {**{n: "bf16" for n in ("x_ptr", "nw_ptr", "w_ptr", "r_ptr", "out_ptr", "kc_ptr",
                                       "vc_ptr")},
                "cos_ptr": "fp32", "sin_ptr": "fp32", "pos_ptr": "i64", "slot_ptr": "i64",
                "scale_ptr": "fp32"}


@pytest.mark.parametrize("norm,silu,rope,residual,block_m,block_k,tail_k,warps", LINEAR, ids=str)
def test_small_linear_kernel_compiles(norm, silu, rope, residual, block_m, block_k, tail_k,
                                      warps):
    from outpace.kernels.skinny_gemm.kernels import _small_linear_kernel
    k = compile_for_h200(_small_linear_kernel, _LINEAR_PTRS, ("eps",), _linear_constexprs(
        norm, silu, rope, residual, block_m, 2, block_k, tail_k), num_warps=warps)
    assert k.asm["cubin"]


# (HAS_NORM, SILU_MUL, ROPE_STORE, HAS_RESIDUAL, rows, K): choose_blocks' warp-a-row launches
# (2 and 4 rows: programs of 2 warps; 3 rows: of one) for SmolLM2's norm + gate_up + silu, norm + qkv + rope +
# store, o and down (K = 1536: 4 + 2 steps)
ROW_WARPS = [(True, True, False, False, 2, 576), (True, False, True, False, 4, 576),
             (False, False, False, True, 2, 576), (False, False, False, True, 4, 1536),
             (True, True, False, False, 3, 576), (False, False, False, True, 3, 1536)]


@pytest.mark.parametrize("norm,silu,rope,residual,m,k", ROW_WARPS, ids=str)
def test_small_linear_row_warps_layout(norm, silu, rope, residual, m, k):
    """The warp-a-row launch compiles to what it is for: the weight tile [steps, BLOCK_N,
    BLOCK_M, 256] with 8 bf16 a lane, the lanes along K and one warp a row (were the warps on
    K, each would hold a slice of every row and the sums would meet in shared memory)."""
    from outpace.kernels.skinny_gemm import choose_blocks
    from outpace.kernels.skinny_gemm.kernels import _small_linear_kernel
    cfg = choose_blocks(m, 1536 if silu else 576, k, gate_up=silu or rope, norm=norm)
    assert cfg.rw_steps and cfg.num_warps == cfg.block_m == (1 if m == 3 else 2)
    kern = compile_for_h200(_small_linear_kernel, _LINEAR_PTRS, ("eps",), _linear_constexprs(
        norm, silu, rope, residual, cfg.block_m, cfg.block_n, cfg.block_k, 0, cfg.rw_steps,
        cfg.rw_rest, cfg.rw_rest_w), num_warps=cfg.num_warps, aligned=_ALIGNED)
    ttgir = kern.asm["ttgir"]
    layouts = dict(re.findall(r"^(#blocked\d*) = #ttg\.blocked<(.*)>$", ttgir, re.M))
    tiles = re.findall(rf"tt\.load .*: tensor<(\d+)x{cfg.block_n}x{cfg.block_m}x256x"
                       rf"!tt\.ptr<bf16>, (#blocked\d*)>", ttgir)
    # the steps' tile, and the rest's when it is whole steps too (K = 576's 64 columns are not)
    assert {int(s) for s, _ in tiles} == {cfg.rw_steps} | (
        {cfg.rw_rest} if cfg.rw_rest_w == 256 else set())
    for _, name in tiles:
        assert ("sizePerThread = [1, 1, 1, 8], threadsPerWarp = [1, 1, 1, 32], "
                f"warpsPerCTA = [1, 1, {cfg.num_warps}, 1]") in layouts[name], layouts[name]


@pytest.mark.parametrize("norm,m", [(False, 1), (True, 3), (False, 16)])
def test_small_linear_dot_over_bf16_weights_compiles(norm, m):
    """fp32 x over a bf16 weight on the tl.dot path (x cut into three bf16 pieces), as
    choose_blocks picks it for SmolLM2's LM head (49152 x 576)."""
    from outpace.kernels.skinny_gemm import choose_blocks
    from outpace.kernels.skinny_gemm.kernels import _small_linear_kernel
    cfg = choose_blocks(m, 49152, 576, elem_bytes=2, x_bytes=4, norm=norm)
    assert cfg.use_dot
    ptrs = {n: "fp32" for n in ("x_ptr", "nw_ptr", "r_ptr", "out_ptr", "kc_ptr", "vc_ptr",
                                "cos_ptr", "sin_ptr")}
    ptrs.update({"w_ptr": "bf16", "pos_ptr": "i64", "slot_ptr": "i64", "scale_ptr": "fp32"})
    k = compile_for_h200(_small_linear_kernel, ptrs, ("eps",), {
        "HAS_NORM": norm, "NORM_ROUND": norm, "HAS_RESIDUAL": False, "SILU_MUL": False,
        "W_SCALE": False, "ROPE_STORE": False, "TWO_TILES": False, "HALF": 1, "HQ": 0, "HKV": 0,
        "CACHE_BLOCK": 1, "USE_DOT": True, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k, "TAIL_K": 0, "RW_STEPS": 0, "RW_REST": 0, "RW_REST_W": 256,
        "USE_PDL": True}, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    assert k.asm["cubin"]
    assert "mma" in k.asm["ptx"]  # tensor cores, not an fp32 FMA loop


@pytest.mark.parametrize("m", [40, 128, 256])
@pytest.mark.parametrize("kind", ["qkv_rope_store", "gate_up_silu", "o"])
def test_small_linear_prefill_rows_compile(kind, m):
    """The mid-row launches (small_linear.mid_rows_ok) as choose_blocks picks them for SmolLM2's
    prefill: tl.dot in row blocks of 16-64 with the rope + store or silu * mul epilogue, within
    sm_90's shared memory and registers."""
    from outpace.kernels.skinny_gemm import choose_blocks
    from outpace.kernels.skinny_gemm.kernels import _small_linear_kernel
    rope, silu = kind == "qkv_rope_store", kind == "gate_up_silu"
    n = {"qkv_rope_store": 480, "gate_up_silu": 1536, "o": 576}[kind]
    cfg = choose_blocks(m, n, 576, gate_up=rope or silu)
    assert cfg.use_dot and cfg.block_m < m
    consts = _linear_constexprs(False, silu, rope, False, cfg.block_m, cfg.block_n, cfg.block_k,
                                0)
    consts["USE_DOT"] = True
    k = compile_for_h200(_small_linear_kernel, _LINEAR_PTRS, ("eps",), consts,
                         num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    assert k.asm["cubin"]
    assert "mma" in k.asm["ptx"]


@pytest.mark.parametrize("x_dtype", ["bf16", "fp32"])
def test_small_linear_dot_over_int8_weights_compiles(x_dtype):
    """An int8 draft LM head (draft_lm_head_dtype) on the tl.dot path as choose_blocks picks it
    for SmolLM2's 49152 x 576 head at one row: the int8 tile converted in registers still
    feeds the tensor cores, with the per-column scale in the epilogue."""
    from outpace.kernels.skinny_gemm import choose_blocks
    from outpace.kernels.skinny_gemm.kernels import _small_linear_kernel
    cfg = choose_blocks(1, 49152, 576, elem_bytes=1, x_bytes=2 if x_dtype == "bf16" else 4)
    assert cfg.use_dot
    ptrs = {n: x_dtype for n in ("x_ptr", "nw_ptr", "r_ptr", "out_ptr", "kc_ptr", "vc_ptr",
                                 "cos_ptr", "sin_ptr")}
    ptrs.update({"w_ptr": "i8", "scale_ptr": "fp32", "pos_ptr": "i64", "slot_ptr": "i64"})
    k = compile_for_h200(_small_linear_kernel, ptrs, ("eps",), {
        "HAS_NORM": False, "NORM_ROUND": False, "HAS_RESIDUAL": False, "SILU_MUL": False,
        "W_SCALE": True, "ROPE_STORE": False, "TWO_TILES": False, "HALF": 1, "HQ": 0,
        "HKV": 0, "CACHE_BLOCK": 1, "USE_DOT": True, "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "TAIL_K": 0, "RW_STEPS": 0, "RW_REST": 0,
        "RW_REST_W": 256, "USE_PDL": True},
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    assert k.asm["cubin"]
    assert "mma" in k.asm["ptx"]


@pytest.mark.parametrize("kernel", ["chained_inputs", "chained_inputs_host_drafts", "accept",
                                    "loop_inputs"])
def test_step_glue_kernels_compile_with_pdl(kernel):
    """The fused step's bookkeeping kernels, launched with PDL (they wait first); the chained
    inputs also in their host-drafts variant (a relaunched n-gram / suffix step)."""
    from outpace.runner import step_bookkeeping as sg
    i64 = "i64"
    if kernel.startswith("chained_inputs"):
        fn, ptrs = sg._chained_inputs_kernel, {n: i64 for n in (
            "carry_pos_ptr", "carry_tok_ptr", "ids_ptr", "pos_ptr", "slot_ptr", "nd_ptr",
            "hd_ptr")}
        ptrs.update({"real_ptr": "i1", "bt_ptr": "i32", "lens_ptr": "i32", "qsl_ptr": "i32"})
        consts = {"BS": 16, "Q": 3, "QP": 4, "HOST_DRAFTS": kernel.endswith("drafts"),
                  "USE_PDL": True}
        floats = ()
    elif kernel == "accept":
        fn, ptrs = sg._accept_kernel, {n: i64 for n in (
            "tgt_ptr", "ids_ptr", "nd_ptr", "pos_ptr", "packed_ptr", "next_ptr",
            "last_rows_ptr", "first_ptr", "carry_pos_ptr", "carry_tok_ptr")}
        ptrs["u_ptr"] = "fp32"
        consts = {"FORCE": True, "HEAD": True, "CHAIN": True, "Q": 3, "QP": 4, "USE_PDL": True}
        floats = ("force_base",)
    else:
        fn, ptrs = sg._loop_inputs_kernel, {n: i64 for n in ("first_ptr", "pos_ptr",
                                                             "slot_ptr")}
        ptrs.update({"bt_ptr": "i32", "lens_ptr": "i32"})
        consts = {"BS": 16, "STEPS": 3, "USE_PDL": True}
        floats = ()
    k = compile_for_h200(fn, ptrs, floats, consts, num_warps=1)
    assert k.asm["cubin"] and "griddepcontrol.wait" in k.asm["ptx"]


@pytest.mark.parametrize("gather", [False, True])
def test_rms_norm_kernel_compiles(gather):
    """The RMSNorm kernel, and its gather variant (a head's drafting rows and their norm)."""
    from outpace.kernels.norm import _rms_norm_kernel
    ptrs = {n: "bf16" for n in ("x_ptr", "r_ptr", "w_ptr", "out_ptr", "res_out_ptr")}
    ptrs["rows_ptr"] = "i64"
    k = compile_for_h200(_rms_norm_kernel, ptrs, ("eps",), {
        "HAS_RESIDUAL": False, "GATHER": gather, "BLOCK": 1024, "USE_PDL": True}, num_warps=4)
    assert k.asm["cubin"]


def test_split_pieces_kernel_compiles():
    """split_mm's first step: fp32 rows cut into three bf16 pieces (cvt to bf16 three times)."""
    from outpace.kernels.bf16x3 import _split_pieces_kernel
    k = compile_for_h200(_split_pieces_kernel, {"x_ptr": "fp32", "out_ptr": "bf16"}, (),
                         {"BLOCK": 1024}, num_warps=4)
    assert k.asm["cubin"] and "bf16" in k.asm["ptx"]


@pytest.mark.parametrize("race,temp", [(False, False), (True, False), (True, True)])
def test_argmax_chunks_kernel_compiles(race, temp):
    """Pass 1 of the row argmax, and as the sampling race (kernels/argmax.py): the hash's xors
    and 32-bit products, only logical shifts (an arithmetic one would differ from the
    reference's on words with the top bit set), and with a temperature an IEEE division
    (div.rn, as torch's: an approximate one would give other values than process_logits)."""
    from outpace.kernels.argmax import _argmax_chunks_kernel
    ptrs = {"x_ptr": "fp32", "vals_ptr": "fp32", "idx_ptr": "i32", "words_ptr": "i64",
            "pos_ptr": "i64", "temp_ptr": "fp32"}
    k = compile_for_h200(_argmax_chunks_kernel, ptrs, (), {
        "CHUNK": 2048, "RACE": race, "TEMP": temp, "USE_PDL": True}, num_warps=4)
    ptx = k.asm["ptx"]
    assert k.asm["cubin"] and "griddepcontrol.wait" in ptx
    assert ("xor.b32" in ptx) == race and ("mul.lo.s32" in ptx) == race
    assert "shr.s32" not in ptx
    assert ("div.rn.f32" in ptx) == temp and "div.full.f32" not in ptx


@pytest.mark.parametrize("logits", ["fp32", "bf16"])
def test_masked_race_kernels_compile(logits):
    """kernels/masked_gumbel.py: the chunks' pass (the race's hash and an IEEE division, as the
    argmax's) and the descent (a while loop around passes over the row; the top-k bisection's
    unsigned compares of ordered keys, logical shifts only)."""
    from outpace.kernels.masked_gumbel import _descent_kernel, _race_chunks_kernel
    part = {"ybest_ptr": "fp32", "yidx_ptr": "i32", "xmax_ptr": "fp32", "zsum_ptr": "fp32"}
    k1 = compile_for_h200(_race_chunks_kernel, {
        "x_ptr": logits, "y_ptr": "fp32", **part, "words_ptr": "i64", "pos_ptr": "i64",
        "temp_ptr": "fp32"}, (), {"CHUNK": 2048, "USE_PDL": True}, num_warps=4)
    ptx = k1.asm["ptx"]
    assert k1.asm["cubin"] and "griddepcontrol.wait" in ptx and "div.rn.f32" in ptx
    assert "xor.b32" in ptx and "shr.s32" not in ptx
    k2 = compile_for_h200(_descent_kernel, {
        "x_ptr": logits, "y_ptr": "fp32", **part, "words_ptr": "i64", "temp_ptr": "fp32",
        "topk_ptr": "i64", "topp_ptr": "fp32", "minp_ptr": "fp32", "out_ptr": "i64"}, (),
        {"CBLOCK": 16, "CHUNK": 4096, "SPAN": 4, "USE_PDL": True}, num_warps=32)
    ptx = k2.asm["ptx"]
    assert k2.asm["cubin"] and "griddepcontrol.wait" in ptx and "div.rn.f32" in ptx
    assert "setp.ge.u32" in ptx or "setp.lt.u32" in ptx  # the keys compare unsigned
    assert "shr.s32" not in ptx


@pytest.mark.parametrize("fusion", [False, True])
def test_penalty_kernels_compile(fusion):
    """sample/penalty_kernels.py: the penalties with an IEEE division and, as launched
    (enable_fp_fusion=False), no fused multiply-add, so freq * counts is rounded before the
    subtraction as torch rounds it (with fusion the compiler does fuse it: the check bites);
    the count kernel's float atomics."""
    from outpace.sample.penalty_kernels import _count_kernel, _penalize_kernel
    k = compile_for_h200(_penalize_kernel, {
        "logits_ptr": "fp32", "prompt_ptr": "u8", "counts_ptr": "fp32", "ids_ptr": "i64",
        "rep_ptr": "fp32", "freq_ptr": "fp32", "pres_ptr": "fp32"}, (),
        {"Q": 3, "Q_POW2": 4, "BLOCK": 2048, "USE_PDL": True}, num_warps=4,
        options={"enable_fp_fusion": fusion})
    ptx = k.asm["ptx"]
    assert k.asm["cubin"] and "griddepcontrol.wait" in ptx and "div.rn.f32" in ptx
    assert ("fma.rn.f32" in ptx) == fusion
    k = compile_for_h200(_count_kernel, {"packed_ptr": "i64", "counts_ptr": "fp32"}, (),
                         {"Q": 3, "Q_POW2": 4, "USE_PDL": True}, num_warps=1)
    assert "atom.global" in k.asm["ptx"] and "griddepcontrol.wait" in k.asm["ptx"]


def test_logprobs_kernels_compile():
    """kernels/logprobs.py as launched for a 49152-id row and the top 20: the pieces' pass (up
    to 20 of 2048 keys, as many as the count says) and the merge (24 pieces' candidates), both
    after the PDL wait."""
    from outpace.kernels.logprobs import _chunks_kernel, _merge_kernel
    k = compile_for_h200(_chunks_kernel, {"x_ptr": "fp32", "count_ptr": "i32",
                                          "max_ptr": "fp32", "sum_ptr": "fp32",
                                          "cand_ptr": "i64"}, (),
                         {"TOP": 20, "CHUNK": 2048, "USE_PDL": True},
                         num_warps=4)
    assert k.asm["cubin"] and "griddepcontrol.wait" in k.asm["ptx"]
    k = compile_for_h200(_merge_kernel, {"x_ptr": "fp32", "tok_ptr": "i64", "count_ptr": "i32",
                                         "max_ptr": "fp32", "sum_ptr": "fp32", "cand_ptr": "i64",
                                         "out_ptr": "fp32"},
                         (), {"TOP": 20, "CHUNKS_POW2": 32, "CANDS_POW2": 512,
                              "USE_PDL": True}, num_warps=4)
    assert k.asm["cubin"] and "griddepcontrol.wait" in k.asm["ptx"]


def test_pdl_primer_kernel_compiles():
    """kernels/pdl.prime's empty kernel: the grid-dependency wait and release, launched with
    PDL."""
    from outpace.kernels.pdl import _primer_kernel
    k = compile_for_h200(_primer_kernel, {}, (), {"USE_PDL": True}, num_warps=1)
    assert k.asm["cubin"] and "griddepcontrol.wait" in k.asm["ptx"]
    assert "griddepcontrol.launch_dependents" in k.asm["ptx"]
