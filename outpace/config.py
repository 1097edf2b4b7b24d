"""Frozen configuration dataclasses; all validation lives here.

One config object per component: the model gets `ModelConfig`, the KV cache `CacheConfig`, the
scheduler `SchedulerConfig`, the proposers `SpecConfig`, the runner `RunnerConfig`, the server
`ServerConfig`. `EngineConfig` composes them and is built once by the engine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from outpace.errors import ConfigError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


# The largest value each ModelConfig size may take: well above any released model (Llama 3.1
# 405B: 126 layers, hidden 16384, intermediate 53248, vocab 128256; 1M-token contexts).
MODEL_SIZE_LIMITS = {"vocab_size": 1 << 22, "hidden_size": 1 << 16,
                     "intermediate_size": 1 << 18, "num_hidden_layers": 1 << 10,
                     "num_attention_heads": 1 << 10, "num_key_value_heads": 1 << 10,
                     "head_dim": 1 << 11, "max_position_embeddings": 1 << 24}
ROPE_SCALING_KEYS = {"linear": ("factor",),
                     "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                "original_max_position_embeddings"),
                     "freq_factors": ("factors",)}


def check_rope_scaling(sc) -> None:
    """A rope_scaling dict outpace computes: a known type with its numbers present and > 0."""
    if sc is None:
        return
    if not isinstance(sc, dict):
        raise ConfigError(f"rope_scaling must be an object (or null), got {type(sc).__name__}")
    kind = sc.get("rope_type", sc.get("type"))
    if kind not in ROPE_SCALING_KEYS:
        raise ConfigError(f"rope_scaling type {kind!r} is not supported; outpace computes "
                          f"{', '.join(sorted(ROPE_SCALING_KEYS))}")
    for key in ROPE_SCALING_KEYS[kind]:
        v = sc.get(key)
        if key == "factors":
            ok = isinstance(v, (list, tuple)) and all(
                isinstance(x, (int, float)) and x > 0 for x in v)
        else:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1e9
        if not ok:
            raise ConfigError(f"rope_scaling type {kind!r} needs {key} > 0, got {v!r}")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (read from config.json or GGUF metadata)."""

    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None  # {"rope_type": "llama3", "factor": ..., ...} or None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple = ()

    def __post_init__(self):
        # Every size is checked with Python integers before anything is allocated from it: a
        # lie in a config file is an error that names the field, not a huge allocation.
        for name, top in MODEL_SIZE_LIMITS.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= top:
                raise ConfigError(f"{name} must be an integer in 1..{top}, got {v!r}")
        for name, lo, hi in (("rms_norm_eps", 0.0, 1.0), ("rope_theta", 0.0, 1e12)):
            v = getattr(self, name)
            if (isinstance(v, bool) or not isinstance(v, (int, float))
                    or not lo < float(v) < hi or v != v):
                raise ConfigError(f"{name} must be a number in ({lo:g}, {hi:g}), got {v!r}")
        if self.max_position_embeddings < 2:
            raise ConfigError(f"max_position_embeddings must be >= 2, got "
                              f"{self.max_position_embeddings}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even (rope rotates pairs), got {self.head_dim}")
        check_rope_scaling(self.rope_scaling)
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"architecture {self.architecture!r} is not supported; outpace runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        ids = (() if self.bos_token_id is None else (self.bos_token_id,)) + tuple(
            self.eos_token_ids)
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise ConfigError(f"bos_token_id and eos_token_id must be token ids (integers >= "
                              f"0, or null), got {self.bos_token_id!r:.40} and "
                              f"{self.eos_token_ids!r:.60}")

    @staticmethod
    def from_hf_dict(d: dict[str, Any]) -> "ModelConfig":
        """Build from a transformers config.json dict."""
        from outpace.models.registry import architecture_of  # models own the name mapping
        arch = architecture_of(d)
        for key in ("num_attention_heads", "hidden_size"):  # divided below: checked first
            v = d.get(key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{key} must be an integer >= 1, got {v!r}")
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        rope_scaling = d.get("rope_scaling")
        rope_theta = d.get("rope_theta")
        params = d.get("rope_parameters")  # transformers >= 5 folds theta and scaling in here
        if isinstance(params, dict):
            rope_theta = params.get("rope_theta", rope_theta)
            if params.get("rope_type", "default") != "default":
                rope_scaling = params
        if rope_scaling is not None and not isinstance(rope_scaling, dict):
            raise ConfigError(f"rope_scaling must be an object (or null), got "
                              f"{type(rope_scaling).__name__}")
        if rope_scaling is not None and rope_scaling.get("rope_type",
                                                         rope_scaling.get("type")) == "default":
            rope_scaling = None
        return ModelConfig(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=dict(rope_scaling) if rope_scaling else None,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", arch == "qwen2")),
            qk_norm=arch == "qwen3",
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _share(name: str, v) -> None:
    """A share of memory: a number in (0, 1]."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 < v <= 1.0:
        raise ConfigError(f"{name} must be a number in (0, 1], got {v!r}", option=name)


def check_int(name: str, v, lo: int, hi: Optional[int] = None, why: str = "") -> None:
    """An integer option (not a bool) in lo..hi; the error names it (ConfigError.option)."""
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        bound = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
        raise ConfigError(f"{name} must be an integer {bound}{why}, got {v!r}", option=name)


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV pool. Size from `num_blocks`, or else from memory (kvcache/sizing.py)."""

    block_size: int = 16
    num_blocks: Optional[int] = None
    memory_fraction: float = 0.85  # of free device memory (CUDA) after weights, when num_blocks is None
    # vLLM's meaning: the share of the GPU's total memory the engine may use; the KV pool gets
    # what is left of it once the weights are loaded. Set, it replaces memory_fraction. CUDA
    # only: a CPU pool is cpu_kv_bytes.
    gpu_memory_utilization: Optional[float] = None
    cpu_kv_bytes: int = 1 << 30  # pool size on CPU when num_blocks is None
    enable_prefix_caching: bool = True

    def __post_init__(self):
        check_int("block_size", self.block_size, 1, 1 << 12)
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}",
                              option="block_size")
        if self.num_blocks is not None:
            check_int("num_blocks", self.num_blocks, 1)
        _share("memory_fraction", self.memory_fraction)
        if self.gpu_memory_utilization is not None:
            _share("gpu_memory_utilization", self.gpu_memory_utilization)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # running requests at once
    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decodes)
    max_model_len: Optional[int] = None  # None: the model's max_position_embeddings
    enable_chunked_prefill: bool = True
    max_waiting_requests: Optional[int] = None  # bound of the waiting queue (server answers 503)
    # prefill tokens a step may carry beside decodes (0: up to the budget): a long prompt then
    # delays running streams by at most one such chunk a step (with chunked prefill only)
    max_prefill_with_decodes: int = 0

    def __post_init__(self):
        check_int("max_prefill_with_decodes", self.max_prefill_with_decodes, 0,
                  why=" (0: no bound)")
        check_int("max_num_seqs", self.max_num_seqs, 1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, 2,
                      why=" (tokens of prompt and output)")
        if self.max_waiting_requests is not None:
            check_int("max_waiting_requests", self.max_waiting_requests, 1,
                      why=" (it bounds the queue; leave it unset for no bound)")


SPEC_METHODS = ("ngram", "suffix", "mtp", "eagle3")
MAX_DRAFT_TOKENS = 16  # num_speculative_tokens at most (the verify graphs' query lengths)


def _int(name, v, lo=None, optional=False):
    if v is None and optional:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or (lo is not None and v < lo):
        raise ConfigError(f"speculative option {name!r} must be an integer"
                          + (f" >= {lo}" if lo is not None else "") + f", got {v!r}")
    return v


def _ids(name, v):
    """A token id or a list of them -> tuple (their range is checked against the vocabulary
    when the engine is built)."""
    if v is None:
        return None
    v = [v] if isinstance(v, int) and not isinstance(v, bool) else v
    if (not isinstance(v, (list, tuple)) or not v
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v)):
        raise ConfigError(f"{name} must be a token id or a list of token ids, got {v!r}")
    return tuple(v)


RELAXED_OPTIONS = ("relaxed_top_k", "relaxed_delta", "think_begin_ids", "think_end_ids")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding (vLLM-shaped `speculative_config`). method=None: off. Every option
    is a typed field, validated here; docs/configuration.md describes each."""

    method: Optional[str] = None
    model: Optional[str] = None  # draft head folder (mtp, eagle3)
    num_speculative_tokens: int = 3
    # n-gram prompt lookup (vLLM's names): the longest and shortest n-gram matched
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    # suffix decoding
    suffix_min_match_len: int = 1
    suffix_max_match_len: int = 64
    suffix_cache_requests: Optional[int] = None  # finished requests kept as a global cache
    suffix_periodic: bool = False
    # draft length: ((max_batch_size, k), ...) -> k at that batch size (0 beyond the last);
    # adaptive: each request's k follows its own acceptance (true: up or down by one a step;
    # "cost": the cost model picks every request's k in 0..k for the most tokens per second
    # of measured step time, speculative/cost_model.py)
    k_schedule: Optional[tuple] = None
    adaptive: Union[bool, str] = False
    # draft heads
    enhancer_min_match: Optional[int] = None  # suffix drafts replace the head's at this match
    mtp_mode: Optional[str] = None  # "eagle" | "depths"; None: eagle for one module, else depths
    draft_lm_head_dtype: str = "auto"  # "int8": drafts from an int8 copy of the draft LM head
    # relaxed acceptance inside thinking spans (all four or none)
    relaxed_top_k: Optional[int] = None
    relaxed_delta: Optional[float] = None
    think_begin_ids: Optional[tuple] = None
    think_end_ids: Optional[tuple] = None
    # Benchmarking only: accept drafts at random with this mean acceptance length, to time
    # the speculative step apart from a head's quality (output is then not the target's).
    force_accept_mean: Optional[float] = None
    # Testing only: every n-th propose call raises (speculative/injected_failures.py), to
    # exercise what the engine does after a drafter fails (output unchanged, the draft plane
    # repaired, the failure counted and logged).
    inject_draft_failures: Optional[int] = None
    # Testing only: after every fused step (launched or chained) the slots its graph wrote,
    # target rows and draft loop alike, are read back and checked against the blocks the
    # scheduler reserved for each request (runner/write_check.py); a step syncs the device.
    check_fused_writes: bool = False

    def __post_init__(self):
        if self.method is not None and self.method not in SPEC_METHODS:
            raise ConfigError(f"method {self.method!r} is unknown; use one of "
                              f"{', '.join(SPEC_METHODS)} (speculative decoding methods)",
                              option="method")
        check_int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_DRAFT_TOKENS,
                  why=" (draft tokens per step)")
        if self.method in ("mtp", "eagle3") and not self.model:
            raise ConfigError(f"speculative method {self.method!r} needs a draft head folder "
                              f"(speculative_config['model'])",
                              option="speculative_config['model']")
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ConfigError(f"speculative_config['model'] must be the path of a draft head "
                              f"folder, got {self.model!r}", option="speculative_config['model']")
        _int("prompt_lookup_min", self.prompt_lookup_min, 1)
        _int("prompt_lookup_max", self.prompt_lookup_max, 1)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                              f"prompt_lookup_max ({self.prompt_lookup_max})")
        _int("suffix_min_match_len", self.suffix_min_match_len, 1)
        _int("suffix_max_match_len", self.suffix_max_match_len, 1)
        _int("suffix_cache_requests", self.suffix_cache_requests, 0, optional=True)
        _int("enhancer_min_match", self.enhancer_min_match, 0, optional=True)
        _int("inject_draft_failures", self.inject_draft_failures, 1, optional=True)
        for name in ("suffix_periodic", "adaptive"):
            if name == "adaptive" and self.adaptive == "cost":
                continue
            if getattr(self, name) in (0, 1) and not isinstance(getattr(self, name), float):
                object.__setattr__(self, name, bool(getattr(self, name)))  # 1 / 0 as JSON has them
            if not isinstance(getattr(self, name), bool):
                allowed = ('true, false or "cost" (the draft-length cost model)'
                           if name == "adaptive" else "true or false")
                raise ConfigError(f"speculative option {name!r} must be {allowed}, got "
                                  f"{getattr(self, name)!r}")
        if self.k_schedule is not None:
            try:
                pairs = tuple(sorted((int(b), int(v)) for b, v in self.k_schedule))
            except (TypeError, ValueError):
                raise ConfigError("k_schedule must be a list of [max_batch_size, k] pairs, "
                                  "e.g. [[8, 4], [32, 2], [64, 1]]") from None
            k = self.num_speculative_tokens
            if any(b < 1 or not 0 <= v <= k for b, v in pairs):
                raise ConfigError(f"k_schedule entries need max_batch_size >= 1 and "
                                  f"0 <= k <= {k}")
            object.__setattr__(self, "k_schedule", pairs)
        if self.mtp_mode not in (None, "eagle", "depths"):
            raise ConfigError(f"mtp_mode must be 'eagle' (one module applied k times) or "
                              f"'depths' (one module a depth), got {self.mtp_mode!r}")
        if self.draft_lm_head_dtype not in ("auto", "int8"):
            raise ConfigError(f"draft_lm_head_dtype must be 'auto' (the head's dtype) or "
                              f"'int8', got {self.draft_lm_head_dtype!r}")
        given = [k for k in RELAXED_OPTIONS if getattr(self, k) is not None]
        if given:
            missing = [k for k in RELAXED_OPTIONS if k not in given]
            if missing:
                raise ConfigError(f"relaxed acceptance needs all of {list(RELAXED_OPTIONS)}; "
                                  f"missing {missing} (it only applies inside a thinking span, "
                                  f"so the span's begin and end token ids are required)")
            _int("relaxed_top_k", self.relaxed_top_k, 1)
            d = self.relaxed_delta
            if not isinstance(d, (int, float)) or isinstance(d, bool) or not 0.0 <= d <= 1.0:
                raise ConfigError(f"relaxed_delta must be a number in [0, 1], got {d!r}")
            object.__setattr__(self, "relaxed_delta", float(d))
            for name in ("think_begin_ids", "think_end_ids"):
                object.__setattr__(self, name, _ids(name, getattr(self, name)))
        m = self.force_accept_mean
        if m is not None and (not isinstance(m, (int, float)) or isinstance(m, bool) or m < 1):
            raise ConfigError(f"force_accept_mean must be a number >= 1 (a mean acceptance "
                              f"length, the bonus token included), got {m!r}")

    @property
    def enabled(self) -> bool:
        return self.method is not None

    @property
    def relaxed(self) -> bool:
        return self.relaxed_top_k is not None

    @staticmethod
    def from_dict(d: Optional[dict]) -> "SpecConfig":
        """A vLLM-shaped speculative_config dict -> SpecConfig; unknown keys are an error."""
        if not d:
            return SpecConfig()
        known = [f.name for f in dataclasses.fields(SpecConfig)]
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ConfigError(f"unknown speculative option(s) {unknown}; known: "
                              f"{sorted(known)}")
        return SpecConfig(**d)


DTYPES = ("auto", "float32", "float16", "bfloat16")


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


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: Optional[str] = None
    served_model_name: Optional[str] = None
    max_body_bytes: int = 4 << 20
    # seconds a connection may go without a complete request header: from when it opens, and
    # after each response (uvicorn's keep-alive timeout, applied to fresh connections too)
    timeout_keep_alive: float = 5.0
    # seconds the whole request body may take to arrive once its header has (a body trickled
    # in a byte at a time would otherwise hold a connection and a task forever)
    body_timeout: float = 30.0

    def __post_init__(self):
        check_int("port", self.port, 0, 65535)
        b = self.body_timeout
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 < b <= 3600:
            raise ConfigError(f"body_timeout must be a number of seconds in (0, 3600], got "
                              f"{b!r}", option="body_timeout")
        t = self.timeout_keep_alive
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 3600:
            raise ConfigError(f"timeout_keep_alive must be a number of seconds in (0, 3600], "
                              f"got {t!r}", option="timeout_keep_alive")


@dataclass(frozen=True)
class EngineConfig:
    model: str  # catalog name, HF folder or .gguf path, as the user gave it
    model_config: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len or self.model_config.max_position_embeddings
