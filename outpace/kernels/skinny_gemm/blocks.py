"""The few-row projections' launch policy (kernels/skinny_gemm/): how many rows, columns and
K columns a program takes, how many warps, and which path (broadcast multiply-sum, a warp a
row, tl.dot) for a shape. A pure function of shapes and dtype sizes, never of values, so a
captured graph and an eager call pick the same kernel. Every constant is measured on the H200
(docs/decisions.md); benchmarks/archive/diag_few_rows.py swept them in the real step graphs.
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


# The constants below are measured on the H200 (SmolLM2-135M and Llama-8B shapes, bf16,
# CUDA-graph replays with L2-cold weights, and the real step graphs); the measurements are in
# docs/decisions.md (the headings named below, and "Measurements moved out of code comments").
# The broadcast-multiply-sum path materialises a [BLOCK_M, BLOCK_N, BLOCK_K] fp32 product per K
# step; up to 128 values a thread (4 warps) it stays in registers.
_PRODUCT_BUDGET = 16384
_SUM_ONE_STEP_K = 2048  # up to this K the broadcast path reads a row in one step...
_SUM_K = 1024  # ...beyond it in steps of this (faster than 2048 or 512 on Llama-8B shapes)
_DOT_K = 256  # K step of the tl.dot path
# ...over an int8 weight (a draft LM head): 64-column K steps read the int8 tiles faster than
# 128 or 256 (decisions-log.md, "an int8 draft LM head", its "Measured")
_DOT_K_INT8 = 64
_DOT_STAGES = 3  # its software pipeline: faster than 2 stages on every shape, 4 no better
_DOT_SMEM = 64 * 1024  # its pipeline buffers: wide tiles get shorter K steps (LM head: 128 x 64)
_SUM_MAX_N = 16384  # wider weights (LM heads) take the tl.dot path even at M = 1
_DOT_ONE_BLOCK_M = 16  # tl.dot launches of more rows than this split them into row blocks
_DOT_K_ROW_BLOCKS = 128  # ...with K steps of at most this (the sweep's; 256 not measured)
# Rows a broadcast-path program handles; more rows take more programs, each reading the same
# weight tile (an L2 hit). Two at most: blocks of 4 are slower in the k = 2 verify graph
# (decisions-log.md, "Broadcast-path rows in blocks of 2").
_SUM_ROWS = 2
# ...and one at these row counts: one-warp programs (below) multiply their rows in turn, so a
# block of two rows is twice one row's critical path, and a program per row is faster (each
# reads the same weight tile, an L2 hit after the first). This serves rows wider than
# _ROW_WARPS_MAX_K, since 2 and 3 rows take a warp a row below. 4 rows keep blocks of 2:
# four reads of every tile cost more than the shorter path saves (decisions-log.md, "Two or
# three rows: one row a program").
_ONE_ROW_M = (2, 3)
# A broadcast-path program with more than one row runs one warp when its product has at most
# this many values (256 a thread): it is reduced over K inside the warp (shuffles), with no
# exchange through shared memory between warps, which is faster than 2 or 4 warps for these
# products. One-row programs keep 4 warps (one warp makes them slower), and so do larger
# products (not measured with fewer). decisions-log.md, "Several-row broadcast programs run
# one warp".
_ONE_WARP_PRODUCT = 8192
# Rows up to which a small weight (K <= 2048, N <= 4096) takes that path. From 5 rows tl.dot
# is faster than row blocks of 4 on every SmolLM2 projection (decisions-log.md, "Few-row
# verify stays on tl.dot above 4 rows").
_SUM_MAX_M = 4
# Row counts whose programs give each row a warp (`row_warps_blocks`): rows -> (rows a program,
# columns a program). One program's warps read the same weight tile (the first from L2, the
# others from L1) with the whole row loaded at once, each multiplying its own row, and the rest
# of K read as its own power of two rather than a masked 256-wide step. Faster than the
# one-warp programs in the step graphs at these row counts: at 2 and 4 rows two rows a program
# (all 4 rows in one program is slower); at 3 rows (the k = 2 verify at batch 1) a row a
# program, three one-warp programs of 2 columns. One row keeps its four-warp program, which is
# faster there. The 3-row gain shows on real requests only with PDL primed before host-launched
# graphs (kernels/pdl.prime). docs/decisions.md: "A warp a row at 2, 3 and 4 rows".
ROW_WARPS_3 = (1, 2)  # 3 rows: rows a program, columns a program
_ROW_WARPS = {2: (2, 2), 3: ROW_WARPS_3, 4: (2, 4)}  # KernelOptions.row_warps_rows picks which
ALL_ROW_WARPS = frozenset(_ROW_WARPS)
_ROW_WARPS_MAX_K = 1536  # measured up to down's 1536; wider rows would hold more registers


@functools.lru_cache(maxsize=4096)  # a pure function of its arguments, asked every launch
def choose_blocks(M: int, N: int, K: int, *, elem_bytes: int = 2, x_bytes: int = 0,
                  gate_up: bool = False, norm: bool = False,
                  use_dot: Optional[bool] = None,
                  row_warps: frozenset = ALL_ROW_WARPS) -> Blocks:
    """Launch configuration of the few-row linear: a pure function of shapes and dtype size
    (never of values), so a captured graph and an eager call pick the same kernel.

    N is the number of output columns the programs split (I for the gate/up kernels, which
    read two weight tiles a step: `gate_up`); elem_bytes is the weight's element size and
    x_bytes x's (0: the same); `norm`: the kernel computes the RMSNorm statistics first.

    Broadcast multiply + sum (M = 1 up to N = 16384, and M <= _SUM_MAX_M on a small weight,
    K <= 2048 and N <= 4096): a program takes at most _SUM_ROWS rows, one at _ONE_ROW_M rows
    (a forced config with more rows runs more programs, each reading the same weight tile);
    at the `row_warps` row counts (K <= _ROW_WARPS_MAX_K) a warp a row instead
    (row_warps_blocks; KernelOptions.row_warps_rows).
    BLOCK_K takes the whole row in one step when K <= 2048, so all of a program's loads are
    in flight at once (a small weight is below the GPU's bandwidth-delay product, and every
    serial K step costs a DRAM latency); longer rows go in steps of 1024.
    With several rows a one-step row that isn't a power of two is two tiles, both loaded up
    front (`tail_k`: K = 576 is 512 + 64 columns, not a 1024-wide tile with 448 masked).
    BLOCK_N is as small as keeps >= 4 programs per SM (576 columns: 288 programs of 2) and grows
    up to the register budget for wide weights. 4 warps, except one for a several-row program
    with a small product (_ONE_WARP_PRODUCT).

    tl.dot otherwise (the rows padded to 16): on Llama-8B shapes the broadcast product over
    several rows is much slower than tensor cores, and on a SmolLM2 LM head (49152 x 576)
    tl.dot with 128 x 64 tiles beats the M = 1 broadcast path. K steps of 256 in a 3-stage
    pipeline, shorter where the stages would pass 64 KB; BLOCK_N is the largest of 16..128
    that keeps >= 2 programs per SM; 2 warps for narrow tiles (faster there), 4 for wide ones
    (2 warps are much slower on a 128-wide tile) and under the norm prologue (its
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
    if M in row_warps and M in _ROW_WARPS and K <= _ROW_WARPS_MAX_K:
        return row_warps_blocks(K, *_ROW_WARPS[M])
    block_m = 1 if M in _ONE_ROW_M else min(next_pow2(M), _SUM_ROWS)
    block_k = k_max if k_max <= _SUM_ONE_STEP_K else _SUM_K
    block_k = min(block_k, max(_PRODUCT_BUDGET // (block_m * 2 * tiles), 16))
    tail_k = 0
    if M > 1 and block_k == k_max and K < k_max:
        # A row read in one step, padded to a power of two: read the largest power of two
        # below K and the rest as a second, narrower tile when that is narrower in all
        # (K = 576: 512 + 64 columns, not 1024; 1536: 1024 + 512, not 2048). Each lane
        # then multiplies only real columns (448 of 1024 are padding at K = 576). That pays
        # for several rows, whose one-warp programs multiply in turn; one-row programs (4
        # warps, few products each) are slower with the split, so they keep one tile
        # (decisions-log.md, "Several-row projections read K in two tiles after all").
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
    the tiles each reads); 16 columns, 32 for a one-tile launch above 128 rows. These are the
    fastest in the H200 sweeps at 64-256 rows of SmolLM2's shapes; one block of every row is
    slower on every projection, and 32 columns are faster than 16 only above 128 rows
    (docs/decisions.md, "Prefill-sized projections as Triton kernels")."""
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
