"""The engine's component configs, frozen and validated where they are built: the KV cache
`CacheConfig`, the scheduler `SchedulerConfig`, the server `ServerConfig`, and `EngineConfig`,
which composes them with the model's (model_config.py), the proposers' (speculative_config.py)
and the runner's (runner_config.py) and is built once by the engine (engine/builder.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from outpace.errors import ConfigError
from outpace.model_config import ModelConfig
from outpace.option_checks import check_int, check_share
from outpace.runner_config import RunnerConfig
from outpace.speculative_config import SpecConfig


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
        check_share("memory_fraction", self.memory_fraction)
        if self.gpu_memory_utilization is not None:
            check_share("gpu_memory_utilization", self.gpu_memory_utilization)


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
    # the engine loop in a process of its own (engine/core_process.py), apart from the HTTP
    # front end; False: in a thread of the server's process (engine/async_engine.py); None:
    # a process on a GPU, where the front end's per-token work bounds the server beside an
    # engine that steps in about a millisecond, and a thread on the CPU, where one process
    # starts sooner and leaves the few cores to the engine (`runs_engine_process`)
    engine_process: Optional[bool] = None
    # HTTP front-end processes over the one engine core (vLLM's --api-server-count): more than
    # one spreads the front end's work over processes, and implies engine_process
    api_server_count: int = 1

    def __post_init__(self):
        check_int("port", self.port, 0, 65535)
        check_int("api_server_count", self.api_server_count, 1, 64)
        if self.engine_process is not None and not isinstance(self.engine_process, bool):
            raise ConfigError(f"engine_process must be true, false or unset (a process on a "
                              f"GPU, a thread on the CPU), got {self.engine_process!r}",
                              option="engine_process")
        if self.engine_process is False and self.api_server_count > 1:
            raise ConfigError("api_server_count above 1 runs the engine in a process of its "
                              "own; leave engine_process unset, or set api_server_count to 1",
                              option="api_server_count")
        b = self.body_timeout
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 < b <= 3600:
            raise ConfigError(f"body_timeout must be a number of seconds in (0, 3600], got "
                              f"{b!r}", option="body_timeout")
        t = self.timeout_keep_alive
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 3600:
            raise ConfigError(f"timeout_keep_alive must be a number of seconds in (0, 3600], "
                              f"got {t!r}", option="timeout_keep_alive")

    def runs_engine_process(self, device: str, lent_model: bool = False) -> bool:
        """Whether the engine loop runs in a process of its own beside an engine on `device`
        (a resolved device: cpu, cuda or cuda:N). lent_model: the engine serves a model lent
        in this process (EngineArgs.loaded), which an engine process cannot take: unset, it
        stays in a thread."""
        if self.api_server_count > 1:
            return True
        if self.engine_process is not None:
            return self.engine_process
        return device.startswith("cuda") and not lent_model


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
