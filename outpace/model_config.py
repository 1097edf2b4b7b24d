"""`ModelConfig`: a Llama-family decoder's architecture (from config.json or GGUF metadata), every
size checked with Python numbers before anything is allocated from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

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
