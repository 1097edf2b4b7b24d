"""Frozen configuration dataclasses; all validation lives here.

One config object per component: the model gets `ModelConfig`, the KV cache `CacheConfig`, the
scheduler `SchedulerConfig`, the proposers `SpecConfig`, the runner `RunnerConfig`, the server
`ServerConfig`. `EngineConfig` composes them and is built once by the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from outpace.errors import ConfigError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


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
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"architecture {self.architecture!r} is not supported; outpace runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")

    @staticmethod
    def from_hf_dict(d: dict[str, Any]) -> "ModelConfig":
        """Build from a transformers config.json dict."""
        from outpace.models.registry import architecture_of  # models own the name mapping
        arch = architecture_of(d)
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


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV pool. Size from `num_blocks`, or else from a fraction of free memory."""

    block_size: int = 16
    num_blocks: Optional[int] = None
    memory_fraction: float = 0.85  # of free device memory (CUDA) after weights, when num_blocks is None
    cpu_kv_bytes: int = 1 << 30  # pool size on CPU when num_blocks is None
    enable_prefix_caching: bool = True

    def __post_init__(self):
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ConfigError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # running requests at once
    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decodes)
    max_model_len: Optional[int] = None  # None: the model's max_position_embeddings
    enable_chunked_prefill: bool = True
    max_waiting_requests: Optional[int] = None  # bound of the waiting queue (server answers 503)

    def __post_init__(self):
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_batched_tokens must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError("max_model_len must be >= 2")


SPEC_METHODS = ("ngram", "suffix", "mtp", "eagle3")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding (vLLM-shaped `speculative_config`). method=None: off."""

    method: Optional[str] = None
    model: Optional[str] = None  # draft head folder (mtp, eagle3)
    num_speculative_tokens: int = 3
    options: dict = field(default_factory=dict)  # method-specific extras

    def __post_init__(self):
        if self.method is not None and self.method not in SPEC_METHODS:
            raise ConfigError(
                f"speculative method {self.method!r} is unknown; use one of {', '.join(SPEC_METHODS)}")
        if self.method is not None and not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError("num_speculative_tokens must be in 1..16")
        if self.method in ("mtp", "eagle3") and not self.model:
            raise ConfigError(f"speculative method {self.method!r} needs a draft 'model' path")

    @property
    def enabled(self) -> bool:
        return self.method is not None

    @staticmethod
    def from_dict(d: Optional[dict]) -> "SpecConfig":
        if not d:
            return SpecConfig()
        d = dict(d)
        known = {"method", "model", "num_speculative_tokens"}
        return SpecConfig(method=d.get("method"), model=d.get("model"),
                          num_speculative_tokens=int(d.get("num_speculative_tokens", 3)),
                          options={k: v for k, v in d.items() if k not in known})


DTYPES = ("auto", "float32", "float16", "bfloat16")


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
    # H200; see docs/decisions.md, "Overlap chains fused steps".
    overlap: bool = True

    def __post_init__(self):
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(
                f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")
        if self.weight_dtype not in DTYPES:
            raise ConfigError(f"weight_dtype must be auto, float32, float16 or bfloat16, got "
                              f"{self.weight_dtype!r}")
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
                              f"never wider; use weight_dtype auto (or {act}), or {fix}")
        if self.kv_cache_dtype not in DTYPES:
            raise ConfigError(f"kv_cache_dtype must be auto, float32, float16 or bfloat16, got "
                              f"{self.kv_cache_dtype!r}")
        kv = self._resolved(self.kv_cache_dtype)
        if kv != act and act != "float32":  # the same rule as for weights
            raise ConfigError(f"kv_cache_dtype {kv} with dtype {act} is not supported: the KV "
                              f"cache may be narrower than the activations, never wider or "
                              f"another 16-bit format; use kv_cache_dtype auto (or {act}), or "
                              f"dtype float32 for float32 activations over a {kv} cache")

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

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")


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
