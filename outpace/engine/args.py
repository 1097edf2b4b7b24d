"""`EngineArgs`: every argument of an engine, with its default, in one frozen dataclass (vLLM's
name). `LLMEngine.from_args`, `LLM(...)` and the CLI build one from what the user gave;
engine/preflight.py checks it before anything heavy loads, engine/builder.py turns it into the
engine. This is the one place the arguments and their defaults are listed.

Nothing here imports torch: the CLI reads the defaults for its --help.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any, Optional

from outpace.errors import ConfigError


@dataclass(frozen=True)
class EngineArgs:
    """The engine's arguments as the user gives them (None: the engine picks, see each)."""

    model: str = "smollm2-135m"  # catalog name, HF folder, .gguf file or Hugging Face id
    device: str = "auto"  # cpu, cuda or cuda:N; auto: cuda when available
    dtype: str = "auto"  # activations and arithmetic; auto: float32 on CPU, bfloat16 on CUDA
    weight_dtype: str = "auto"  # storage of the weight matrices; auto: dtype
    kv_cache_dtype: str = "auto"  # the KV pool's; auto: dtype
    speculative_config: Optional[dict] = None  # vLLM's speculative_config (SpecConfig's keys)
    max_model_len: Optional[int] = None  # None: the model's positions, or what the pool holds
    num_kv_blocks: Optional[int] = None  # None: sized from memory (kvcache/sizing.py)
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: Optional[int] = None  # None: builder.default_token_budget
    max_waiting_requests: Optional[int] = None  # None: no bound
    max_prefill_with_decodes: Optional[int] = None  # None: builder.default_prefill_with_decodes
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    memory_fraction: Optional[float] = None  # None: CacheConfig's
    gpu_memory_utilization: Optional[float] = None  # vLLM's meaning; replaces memory_fraction
    enforce_eager: bool = False
    overlap: bool = True
    seed: int = 0
    # ranks the model is split over (engine/tp_executor.py; vLLM's name): processes outpace
    # starts, the engine's own being rank 0
    tensor_parallel_size: int = 1
    kernel_options: Optional[Any] = None  # a KernelOptions; None: every fast path on
    # a Jinja template, or the path of a file holding one, in place of the model's
    chat_template: Optional[str] = None
    quiet: bool = False
    download_dir: Optional[str] = None  # where Hugging Face ids are fetched; None: HF's cache
    # An already loaded (model, ModelConfig, Tokenizer) to reuse, e.g. when several engines
    # with different cache or scheduler settings share one set of weights. A weight_dtype other
    # than auto must then be the one its weights are stored in: the engine does not change a
    # model it was lent.
    loaded: Optional[tuple] = None

    @classmethod
    def names(cls) -> list:
        """The keyword arguments an engine takes beside its model, in declaration order."""
        return [f.name for f in dataclasses.fields(cls) if f.name != "model"]

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineArgs":
        """The engine's arguments from keywords; an unknown keyword is a ConfigError naming it,
        listing the arguments there are and the close ones (a misspelling's likely intent)."""
        known = cls.names()
        unknown = sorted(set(kwargs) - set(known))
        if unknown:
            close = [f"{u}: did you mean {' or '.join(m)}?" for u in unknown
                     if (m := difflib.get_close_matches(u, known, n=3))]
            hint = f" ({'; '.join(close)})" if close else ""
            raise ConfigError(f"unknown engine argument(s) {unknown}; the engine takes "
                              f"{', '.join(known)}{hint}")
        return cls(model=model, **kwargs)
