"""The few-row projections' launch policy (kernels/skinny_gemm/): how many rows, columns and
K columns a program takes, how many warps, and which path (broadcast multiply-sum, a warp a
row, tl.dot) for a shape. A pure function of shapes and dtype sizes, never of values, so a
captured graph and an eager call pick the same kernel. Every constant is a measurement on the
H200; benchmarks/diag_few_rows.py sweeps them in the real step graphs.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

from outpace.kernels import next_pow2

_NUM_SMS = 132  # H200; only sets the program-count target of choose_blocks (a shape policy)


class Blocks(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    use_dot: bool
    tail_k: int = 0  # > 0: K is whole block_k steps plus a remainder read as a tile this wide
    # > 0: a warp a row (num_warps = block_m), the row read as rw_steps 256-column steps and
    # rw_rest more (row_warps_blocks)
    rw_steps: int = 0
    rw_rest: int = 0
    rw_rest_w: int = 256  # ...of this many columns each


# Numbers below are from benchmarks/bench_small_linear.py on an H200 (SmolLM2-135M and Llama-8B
# shapes, bf16, CUDA-graph replays with L2-cold weights).
# The broadcast-multiply-sum path materialises a [BLOCK_M, BLOCK_N, BLOCK_K] fp32 product per K
# step; up to 128 values a thread (4 warps) it stays in registers.
_PRODUCT_BUDGET = 16384
_SUM_ONE_STEP_K = 2048  # up to this K the broadcast path reads a row in one step...
_SUM_K = 1024  # ...beyond it in steps of this (faster than 2048 or 512 on Llama-8B shapes)
_DOT_K = 256  # K step of the tl.dot path
# ...over an int8 weight (a draft LM head): SmolLM2's 49152 x 576 head read twice in a step
# shaped like EAGLE-3 k = 2's took 11.6 + 9.0 us with 64-column steps, 11.9 + 10.5 with 128 and
# 15-18 + 13-16 with 256 (H200, benchmarks/diag_draft_lm_head.py, 128-column tiles, 3 stages)
_DOT_K_INT8 = 64
_DOT_STAGES = 3  # its software pipeline (3 beat 2 by ~20% on every shape, 4 was no better)
_DOT_SMEM = 64 * 1024  # its pipeline buffers: wide tiles get shorter K steps (LM head: 128 x 64)
_SUM_MAX_N = 16384  # wider weights (LM heads) take the tl.dot path even at M = 1
_DOT_ONE_BLOCK_M = 16  # tl.dot launches of more rows than this split them into row blocks
_DOT_K_ROW_BLOCKS = 128  # ...with K steps of at most this (the sweep's; 256 not measured)
# Rows a broadcast-path program handles; more rows take more programs, each reading the same
# weight tile (an L2 hit). Two at most: in the k = 2 verify graph (3 rows) blocks of 2 beat
# blocks of 4, 0.846 vs 0.864 ms a step (run 10, benchmarks/diag_few_rows.py).
_SUM_ROWS = 2
# ...and one at these row counts (one-warp programs, below, multiply their rows in turn; rows
# wider than _ROW_WARPS_MAX_K, since 2 and 3 rows take a warp a row below). Step
# graphs on the H200 (run 18, diag_few_rows_run18c.json; rows = batch x query length): 2 rows
# 0.667 -> 0.620 ms, 3 rows (k = 2 verify) 0.754 -> 0.727; 4 rows 0.713 -> 0.785 (each weight
# tile read four times, not two), so 4 keeps blocks of 2.
_ONE_ROW_M = (2, 3)
# A broadcast-path program with more than one row runs one warp when its product has at most
# this many values (256 a thread): it is reduced over K inside the warp (shuffles), with no
# exchange through shared memory between warps. In the k = 2 verify graph (3 rows, every
# SmolLM2 projection's product 4096-8192 values): 0.825 ms with 4 warps, 0.858 with 2, 0.803
# with 1 (run 14, diag_few_rows_run14b.json). One-row programs keep 4 (1 warp there: no-spec
# 0.544 -> 0.588 ms), and so do larger products (not measured with fewer).
_ONE_WARP_PRODUCT = 8192
# Rows up to which a small weight (K <= 2048, N <= 4096) takes that path. At M = 5 and 8 the
# row blocks of 4 lost to tl.dot on every SmolLM2 projection (qkv 3.8 vs 2.7 us, gate/up 7.2
# vs 3.1; run 8 sweep, with PDL), so beyond 4 rows tl.dot it is.
_SUM_MAX_M = 4
# Row counts whose programs give each row a warp (`row_warps_blocks`): rows -> (rows a program,
# columns a program). One program's warps read the same weight tile (the first from L2, the
# others from L1) with the whole row loaded at once, each multiplying its own row. Step graphs
# on the H200 (run 25, diag_few_rows_run25b-g.json; no-spec batch 2 / 4 decode, rows = batch):
# 2 rows 0.596 -> 0.528 ms, 4 rows 0.675 -> 0.604 (2 rows, 4 columns a program; all 4 rows in
# one program of 4 warps: 0.733; the rest of K = 576 as a masked 256-wide step instead of 64
# columns: 0.548 / 0.648). 3 rows (k = 2 verify at batch 1) lost in every form then (one
# program of 4 warps 0.636 -> 0.787 ms, two of 2 warps 0.679-0.795, one row a program 0.702),
# measured before the rest of K got its own width. Since, one row a program (three one-warp
# programs, 2 columns each) wins: the EAGLE-3 k = 2 step graph 0.6435 -> 0.5935 ms with every
# launch of up to 16 rows taking it (run 32, diag_few_rows_run32b.json "inv_rw1"; no-spec's
# one-row step lost 0.474 -> 0.514 that way, so one row keeps its four-warp program). Its gain
# on real requests first moved from run to run: the step graph's replays ran at a speed set by
# the last kernel launched eagerly before them, which the engine now keeps a PDL kernel
# (kernels/pdl.prime). Since (run 33, bench batches 1 8 32): EAGLE-3 k = 2 4315 -> 4606 tok/s.
ROW_WARPS_3 = (1, 2)  # 3 rows: rows a program, columns a program (bench's "@old3" arm: without)
_ROW_WARPS = {2: (2, 2), 3: ROW_WARPS_3, 4: (2, 4)}
_ROW_WARPS_MAX_K = 1536  # measured up to down's 1536; wider rows would hold more registers


@functools.lru_cache(maxsize=4096)  # a pure function of its arguments, asked every launch
def choose_blocks(M: int, N: int, K: int, *, elem_bytes: int = 2, x_bytes: int = 0,
                  gate_up: bool = False, norm: bool = False,
                  use_dot: Optional[bool] = None) -> Blocks:
    """Launch configuration of the few-row linear: a pure function of shapes and dtype size
    (never of values), so a captured graph and an eager call pick the same kernel.

    N is the number of output columns the programs split (I for the gate/up kernels, which
    read two weight tiles a step: `gate_up`); elem_bytes is the weight's element size and
    x_bytes x's (0: the same); `norm`: the kernel computes the RMSNorm statistics first.

    Broadcast multiply + sum (M = 1 up to N = 16384, and M <= _SUM_MAX_M on a small weight,
    K <= 2048 and N <= 4096): a program takes at most _SUM_ROWS rows, one at _ONE_ROW_M rows
    (a forced config with more rows runs more programs, each reading the same weight tile);
    at _ROW_WARPS rows (K <= _ROW_WARPS_MAX_K) a warp a row instead (row_warps_blocks).
    BLOCK_K takes the whole row in one step when K <= 2048, so all of a program's loads are
    in flight at once (a small weight is below the GPU's bandwidth-delay product, and every
    serial K step costs a DRAM latency); longer rows go in steps of 1024.
    With several rows a one-step row that isn't a power of two is two tiles, both loaded up
    front (`tail_k`: K = 576 is 512 + 64 columns, not a 1024-wide tile with 448 masked).
    BLOCK_N is as small as keeps >= 4 programs per SM (576 columns: 288 programs of 2) and grows
    up to the register budget for wide weights. 4 warps, except one for a several-row program
    with a small product (_ONE_WARP_PRODUCT).

    tl.dot otherwise (the rows padded to 16): on Llama-8B shapes the broadcast product over
    several rows was 1.5-5x slower than tensor cores, and on a SmolLM2 LM head (49152 x 576)
    tl.dot with 128 x 64 tiles beat the M = 1 broadcast path (17 vs 21 us). K steps of 256 in a
    3-stage pipeline, shorter where the stages would pass 64 KB; BLOCK_N is the largest of
    16..128 that keeps >= 2 programs per SM; 2 warps for narrow tiles (up to 15% faster), 4 for
    wide ones (2 warps were 2x slower on a 128-wide tile) and under the norm prologue (its
    [16, BLOCK_K] statistics tile). `use_dot` forces a path (tests, sweeps).
    """
    if use_dot is None:
        use_dot = not ((M == 1 and N <= _SUM_MAX_N)
                       or (M <= _SUM_MAX_M and K <= _SUM_ONE_STEP_K and N <= 4096))
    k_max = max(next_pow2(K), 16)
    tiles = 2 if gate_up else 1
    if use_dot:
        block_m = max(next_pow2(M), 16)
        block_n = 16  # tl.dot's minimum tile
        block_k = min(k_max, _DOT_K if elem_bytes > 1 else _DOT_K_INT8)
        if M > _DOT_ONE_BLOCK_M:  # a prefill's rows (small_linear.MID_M_MAX): row blocks
            block_m, block_n = _dot_row_tile(M, N, tiles)
            block_k = min(block_k, _DOT_K_ROW_BLOCKS)
        while block_n < 128 and _cdiv(N, block_n * 2) >= 2 * _NUM_SMS:
            block_n *= 2
        x_bytes = x_bytes or elem_bytes
        while (block_k > 32 and _DOT_STAGES * block_k
               * (tiles * block_n * elem_bytes + block_m * x_bytes) > _DOT_SMEM):
            block_k //= 2
        return Blocks(block_m, block_n, block_k,
                      num_warps=4 if norm or block_n > 32 else 2,
                      num_stages=_DOT_STAGES, use_dot=True)
    if M in _ROW_WARPS and K <= _ROW_WARPS_MAX_K:
        return row_warps_blocks(K, *_ROW_WARPS[M])
    block_m = 1 if M in _ONE_ROW_M else min(next_pow2(M), _SUM_ROWS)
    block_k = k_max if k_max <= _SUM_ONE_STEP_K else _SUM_K
    block_k = min(block_k, max(_PRODUCT_BUDGET // (block_m * 2 * tiles), 16))
    tail_k = 0
    if M > 1 and block_k == k_max and K < k_max:
        # A row read in one step, padded to a power of two: read the largest power of two
        # below K and the rest as a second, narrower tile when that is narrower in all
        # (K = 576: 512 + 64 columns, not 1024; 1536: 1024 + 512, not 2048). Each lane
        # then multiplies only real columns: 44% fewer products at K = 576. For several
        # rows, whose one-warp programs multiply in turn: the k = 2 verify graph went from
        # 0.806 to 0.767 ms; one-row programs (4 warps, few products each) went from 0.544
        # to 0.633 ms with the split, so they keep one tile (H200, diag_few_rows_run16.json).
        main = k_max // 2
        rest = max(next_pow2(K - main), 16)
        if main + rest < k_max:
            block_k, tail_k = main, rest
    block_n = 2
    while (block_n * 2 * tiles * block_m * block_k <= _PRODUCT_BUDGET
           and _cdiv(N, block_n * 2) >= 4 * _NUM_SMS):
        block_n *= 2
    one_warp = M > 1 and block_m * block_n * tiles * (block_k + tail_k) <= _ONE_WARP_PRODUCT
    return Blocks(block_m, block_n, block_k, num_warps=1 if one_warp else 4, num_stages=2,
                  use_dot=False, tail_k=tail_k)


def _dot_row_tile(M: int, N: int, tiles: int) -> tuple:
    """(rows, columns) of a tl.dot program when a launch has more than _DOT_ONE_BLOCK_M rows:
    16 rows up to 64, 32 above, twice that for a weight of 2048+ rows (N columns split times
    the tiles each reads); 16 columns, 32 for a one-tile launch above 128 rows. H200 sweeps at
    64-256 rows, SmolLM2 shapes (bench_small_linear_run27.json, _run27b.json): one block of
    every row lost on every projection (qkv 3.46 / 5.00 us against 3.18 / 4.13 at 64 / 128
    rows; down 5.86 / 10.15 against 5.32 / 8.12); blocks of 32 / 64 rows were the best for the
    3072-row gate_up weight (4.02 / 5.04), and gate_up + silu * mul in blocks of 64 took 6.1 /
    6.3 us at 192 / 256 rows; at 192 / 256 rows o took 3.40 / 3.87 us with 32 columns against
    3.52 / 4.13 with 16, at 128 rows 4.44 against 4.05."""
    rows = 16 if M <= 64 else 32
    if N * tiles >= 2048:
        return rows * 2, 16
    return rows, 32 if M > 128 and tiles == 1 else 16


def row_warps_blocks(K: int, block_m: int, block_n: int) -> Blocks:
    """A broadcast-path launch with a warp a row (block_m warps): the row read as one tile of
    rw_steps 256-column steps (32 lanes x 8 values each: wider steps would put warps on K)
    and one of the rest, rw_rest steps of rw_rest_w columns (the rest's own power of two when
    it is narrower than a step: K = 576 is 2 x 256 + 64), both loaded before the PDL wait and
    masked past K. block_k (256) serves the norm statistics' loop."""
    steps = 1
    while steps * 2 * 256 <= K:
        steps *= 2
    rest = K - steps * 256
    rest_steps, rest_w = (next_pow2(_cdiv(rest, 256)), 256) if rest > 0 else (0, 256)
    if 0 < rest < 256:
        rest_w = max(next_pow2(rest), 16)
    return Blocks(block_m, block_n, 256, num_warps=block_m, num_stages=2, use_dot=False,
                  rw_steps=steps, rw_rest=rest_steps, rw_rest_w=rest_w)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
