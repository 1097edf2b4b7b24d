"""`RunnerConfig` (device, dtypes, graphs, overlap, seed) and the `KernelOptions` it carries: the
CUDA fast path's switches."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from outpace.errors import ConfigError

DTYPES = ("auto", "float32", "float16", "bfloat16")


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' where CUDA is available, else 'cpu'; any other device as given."""
    if device != "auto":
        return device
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


GRAPH_KINDS = frozenset({"step", "prefill", "varlen", "head", "plain"})


@dataclass(frozen=True)
class KernelOptions:
    """The switches of the CUDA fast path (kernels/options.py puts them in force); each field
    turns one kernel-level choice off, for benchmarks' ablations and tests that pin a path."""

    # Programmatic dependent launch for the step's Triton kernels (kernels/pdl.py; Hopper+).
    pdl: bool = True
    # One empty PDL kernel before a graph replayed from the host (kernels/pdl.prime) ...
    pdl_prime: bool = True
    # ... except before these kinds of graph (decisions-log.md, "Prime more graphs?").
    pdl_prime_skip: frozenset = frozenset({"varlen", "head", "plain"})
    # At most SMALL_M_MAX rows: the few-row Triton projections with the norms fused in.
    few_row_kernels: bool = True
    # The qkv projection also applies rope and stores K/V: one kernel less a layer (else a
    # separate rope + store kernel).
    fused_qkv_rope_store: bool = True
    # SMALL_M_MAX < rows <= MID_M_MAX (a short prefill, a small varlen step, a mid-sized
    # batch): the qkv projection with rope and the KV store in its epilogue, o_proj, and gate_up
    # with silu * mul as Triton kernels where skinny_gemm.mid_rows_ok takes the shapes; down_proj
    # stays cuBLAS (docs/decisions.md, "Prefill-sized projections as Triton kernels").
    mid_row_kernels: bool = True
    # Logprobs in two Triton passes (else the PyTorch reference on CUDA too).
    triton_logprobs: bool = True
    # Split-KV attention merges in its last split (else a separate merge kernel).
    fused_split_merge: bool = True
    # The device n-gram lookup (`ngram_device`) as one Triton kernel (kernels/ngram_lookup.py;
    # else the tensor-op reference, speculative/ngram_device.ngram_propose_ref, on CUDA too).
    ngram_lookup_kernel: bool = True
    # The row counts whose few-row projections run a warp a row (kernels/skinny_gemm/blocks.py).
    row_warps_rows: frozenset = frozenset({2, 3, 4})

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type == "bool" and not isinstance(v, bool):
                raise ConfigError(f"kernel option {f.name} must be true or false, got {v!r}")
        object.__setattr__(self, "pdl_prime_skip", frozenset(self.pdl_prime_skip))
        object.__setattr__(self, "row_warps_rows", frozenset(self.row_warps_rows))
        unknown = self.pdl_prime_skip - GRAPH_KINDS
        if unknown:
            raise ConfigError(f"pdl_prime_skip names unknown graph kinds {sorted(unknown)}; "
                              f"the kinds are {sorted(GRAPH_KINDS)}")
        if not self.row_warps_rows <= {2, 3, 4}:
            raise ConfigError(f"row_warps_rows may hold 2, 3 and 4 (the row counts with a "
                              f"warp-a-row layout), got {sorted(self.row_warps_rows)}")

    def ablate(self, name: str) -> "KernelOptions":
        """These options with one switch off, by field name ("pdl", "few_row_kernels", ...), or
        "row_warps_N" for the warp-a-row layout at N rows (benchmarks' --ablate)."""
        if name.startswith("row_warps_") and name[len("row_warps_"):].isdigit():
            return dataclasses.replace(
                self, row_warps_rows=self.row_warps_rows - {int(name[len("row_warps_"):])})
        switches = [f.name for f in dataclasses.fields(self) if f.type == "bool"]
        if name not in switches:
            raise ConfigError(f"unknown ablation {name!r}; use one of {', '.join(switches)} "
                              f"or row_warps_2 / row_warps_3 / row_warps_4")
        return dataclasses.replace(self, **{name: False})



@dataclass(frozen=True)
class RunnerConfig:
    device: str = "cpu"
    dtype: str = "auto"  # activations, residual stream, arithmetic, and the KV cache unless
    # kv_cache_dtype says otherwise; auto: float32 on CPU, bfloat16 on CUDA
    # How the projection matrices, the embedding and the LM head are stored (models/
    # weight_dtype.py); auto: in `dtype`. float32 activations over bfloat16 weights keep the
    # bf16 weight bytes (memory, bandwidth) with fp32 arithmetic: greedy output as close to
    # fp32 as bf16 weights allow (docs/decisions.md).
    weight_dtype: str = "auto"
    # The KV pool's dtype; auto: `dtype`. float32 activations over a bfloat16 pool keep bf16's
    # cache size and attention bytes; K and V are rounded to it once, when stored.
    kv_cache_dtype: str = "auto"
    enforce_eager: bool = False  # True: no CUDA graphs
    seed: int = 0
    # Launch the next greedy decode step before reading this one's outputs (with CUDA graphs;
    # see LLMEngine.step): the host's work for a step then runs while the GPU runs the next,
    # which lowers TPOT; outputs are equal (tests/gpu/test_fused_step.py). Measured on the
    # H200; see decisions-log.md, "Overlap chains fused steps".
    overlap: bool = True
    kernel_options: KernelOptions = field(default_factory=KernelOptions)

    def __post_init__(self):
        if not isinstance(self.device, str) or (self.device not in ("cpu", "cuda") and not (
                self.device.startswith("cuda:") and self.device[5:].isdigit())):
            raise ConfigError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}",
                              option="device")
        if self.dtype not in DTYPES:
            raise ConfigError(
                f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}",
                option="dtype")
        if self.weight_dtype not in DTYPES:
            raise ConfigError(f"weight_dtype must be auto, float32, float16 or bfloat16, got "
                              f"{self.weight_dtype!r}", option="weight_dtype")
        # torch's seed, and the source of requests' sampling seeds: 64 bits, as torch takes it
        if (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                or not -(1 << 63) <= self.seed < 1 << 64):
            raise ConfigError(f"seed must be an integer that fits in 64 bits (-2**63 .. "
                              f"2**64 - 1), got {self.seed!r}", option="seed")
        act, weight = self._resolved(self.dtype), self._resolved(self.weight_dtype)
        # A weight is upcast to the activation dtype exactly; a wider (or merely different
        # 16-bit) one would be rounded on every use, which stores more bytes for nothing.
        if weight != act and act != "float32":
            what = (f"weight_dtype {weight} is wider than dtype {act}" if weight == "float32"
                    else f"weight_dtype {weight} with dtype {act} is not supported (neither "
                    f"format holds all of the other's values)")
            fix = ("dtype float32 to run in float32" if weight == "float32" else
                   f"dtype float32 for float32 activations over {weight} weights")
            raise ConfigError(f"{what}: weights may be stored narrower than the activations, "
                              f"never wider; use weight_dtype auto (or {act}), or {fix}",
                              option="weight_dtype")
        if self.kv_cache_dtype not in DTYPES:
            raise ConfigError(f"kv_cache_dtype must be auto, float32, float16 or bfloat16, got "
                              f"{self.kv_cache_dtype!r}", option="kv_cache_dtype")
        kv = self._resolved(self.kv_cache_dtype)
        if kv != act and act != "float32":  # the same rule as for weights
            raise ConfigError(f"kv_cache_dtype {kv} with dtype {act} is not supported: the KV "
                              f"cache may be narrower than the activations, never wider or "
                              f"another 16-bit format; use kv_cache_dtype auto (or {act}), or "
                              f"dtype float32 for float32 activations over a {kv} cache",
                              option="kv_cache_dtype")

    def _resolved(self, name: str) -> str:
        """A dtype option's value with auto resolved (weight_dtype / kv_cache_dtype auto:
        dtype's)."""
        if name != "auto":
            return name
        if self.dtype != "auto":
            return self.dtype
        return "float32" if self.device == "cpu" else "bfloat16"

    @property
    def dtype_name(self) -> str:
        """The activation dtype's name, auto resolved ("float32" on CPU, else "bfloat16")."""
        return self._resolved(self.dtype)

    @property
    def torch_dtype(self):
        """The activation (and KV cache) dtype."""
        import torch
        return getattr(torch, self._resolved(self.dtype))

    @property
    def torch_kv_cache_dtype(self):
        """The KV pool's dtype (== torch_dtype unless set)."""
        import torch
        return getattr(torch, self._resolved(self.kv_cache_dtype))

    @property
    def torch_weight_dtype(self):
        """The dtype the large weight matrices are stored in (== torch_dtype unless set)."""
        import torch
        return getattr(torch, self._resolved(self.weight_dtype))
