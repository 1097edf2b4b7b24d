"""Builds an LLMEngine from user-level arguments (the ones `LLM(...)` and the CLI take)."""

from __future__ import annotations

import dataclasses
import gc
import logging
import os

import torch

from outpace.config import CacheConfig, EngineConfig, SchedulerConfig
from outpace.engine.args import EngineArgs
from outpace.errors import ConfigError, OutpaceError
from outpace.runner_config import KernelOptions, RunnerConfig, resolve_device

log = logging.getLogger(__name__)


def limit_host_threads(quiet: bool = False) -> None:
    """A CUDA engine's host work is Python and tiny CPU tensor ops (staging copies), which
    parallel CPU ops only slow down: each wakes torch's OpenMP workers, and with the default
    wait policy they then spin for a while beside the engine loop, slowing every call of the
    host side, at random (docs/decisions.md, "CUDA engines run torch's CPU ops on one
    thread"). So torch's CPU threads go to 1, as vLLM's GPU workers do, unless the user chose
    a number with OMP_NUM_THREADS."""
    n = torch.get_num_threads()
    if "OMP_NUM_THREADS" in os.environ or n == 1:
        return
    torch.set_num_threads(1)
    if not quiet:
        log.info("outpace: torch CPU threads %d -> 1 for the CUDA engine's host loop (set "
                 "OMP_NUM_THREADS to choose)", n)


# A step's token budget when none is given. On GPUs of 70 GiB or more (vLLM's threshold for its
# server default) 8192 tokens: a large batch of prompts is then prefilled in a few steps rather
# than many, each of which pays milliseconds of host launching, so TTFT and throughput at large
# batch improve (measured on the H200; docs/decisions.md, "The step token budget defaults to
# 8192 on big GPUs"). A larger budget lengthens the steps that mix new prompts into running
# decodes; smaller GPUs keep 2048 for activation headroom.
_BIG_GPU_BYTES = 70 * 2**30

# See default_prefill_with_decodes.
_CPU_PREFILL_WITH_DECODES = 8


def default_prefill_with_decodes(device: torch.device) -> int:
    """Prefill tokens a step may carry beside decodes by default. On a CPU a step's time grows
    with every token it computes, so a bound keeps a running stream's gap near its normal one
    while a long prompt is prefilled (docs/decisions.md, "A bound on the prefill beside decodes
    on the CPU"); on a GPU a decode step is not slowed much by a chunk beside it: 0, the whole
    budget."""
    return _CPU_PREFILL_WITH_DECODES if device.type == "cpu" else 0


def default_token_budget(device: torch.device, total_memory: int | None = None) -> int:
    """The step token budget an engine on `device` gets unless given one: 8192 on a GPU of
    _BIG_GPU_BYTES or more, else 2048. total_memory: the GPU's bytes (None: queried)."""
    if device.type != "cuda":
        return 2048
    if total_memory is None:
        total_memory = torch.cuda.get_device_properties(device).total_memory
    return 8192 if total_memory >= _BIG_GPU_BYTES else 2048


def pool_tokens_at_most(cache_cfg: CacheConfig, model_cfg, kv_dtype, device) -> int:
    """An upper bound, known before the weights load, of the tokens one request can hold in
    the KV pool: the pool sized for the target's layers alone (draft heads add layers) from the
    memory free now (the weights take some). The context, and so the rope tables, never need
    more."""
    from outpace.kvcache.sizing import num_kv_blocks as size_kv
    blocks = size_kv(cache_cfg, model_cfg, model_cfg.num_hidden_layers, kv_dtype, device)
    return (blocks - 1) * cache_cfg.block_size


def kv_headroom(model_cfg, spec_cfg, max_num_tokens: int, max_num_seqs: int,
                max_model_len: int, act_bytes: int, graphs: bool,
                lookup_kernel: bool = False) -> int:
    """Bytes a KV pool sized from free GPU memory leaves free: a step's activations
    (kvcache/sizing.activation_bytes, with the logits of every verify row), and where the
    fused graphs run the n-gram lookup (`ngram_device`, graphs on) its device history, a
    fill's row moves and the lookup's temporaries (runner/fused_ngram.StepNgram.device_bytes),
    which the graphs allocate after the pool: none where the lookup runs as the Triton kernel
    (lookup_kernel)."""
    from outpace.kvcache.sizing import activation_bytes
    max_k = spec_cfg.num_speculative_tokens if spec_cfg.enabled else 0
    headroom = activation_bytes(model_cfg, max_num_tokens, max_num_seqs * (max_k + 1),
                                act_bytes)
    if graphs and spec_cfg.enabled and spec_cfg.ngram_device:
        from outpace.runner.fused_ngram import StepNgram
        headroom += StepNgram.device_bytes(max_num_seqs, max_model_len, lookup_kernel)
    return headroom


@dataclasses.dataclass
class Assembled:
    """What `assemble` builds for one rank: the engine's parts."""

    config: EngineConfig
    tokenizer: object  # None on a tensor-parallel rank other than 0
    scheduler: object
    kv: object
    runner: object
    graphs: bool


def build_engine(cls, args: EngineArgs):
    """The engine `cls` of `args` (checked here first: engine/preflight.py); with
    tensor_parallel_size > 1 the other ranks' processes first (engine/tp_executor.py)."""
    # Every argument is checked before torch's work and the model's load (which take seconds);
    # the scheduler's again below with the model's context length.
    from outpace.engine.preflight import check_engine_args
    from outpace.parallel.group import SINGLE
    checked = check_engine_args(args)
    a = args
    if a.tensor_parallel_size == 1:
        parts = assemble(a, checked, SINGLE)
        runner = parts.runner
    else:
        from outpace.engine.tp_executor import TensorParallelRunner, WorkerDiedError, WorkerSet
        if a.device == "auto":
            if torch.cuda.is_available():
                raise ConfigError(f"tensor_parallel_size={a.tensor_parallel_size} runs on the "
                                  f"CPU for now: pass device cpu (--device cpu), or "
                                  f"tensor_parallel_size 1 on the GPU",
                                  option="tensor_parallel_size")
            a = dataclasses.replace(a, device="cpu")  # the ranks build what rank 0 does
        workers = WorkerSet(a, a.tensor_parallel_size)
        try:
            parts = assemble(a, checked, workers.tp)
        except Exception as e:
            # rank 0's own error when it is one a user can act on (every rank meets it), else
            # the error of the rank whose end broke rank 0's collective
            dead = None if isinstance(e, OutpaceError) else workers.dead_reason(" while loading")
            workers.stop(timeout=2.0)
            if dead is not None:
                raise WorkerDiedError(dead) from e
            raise
        except BaseException:
            workers.stop(timeout=2.0)
            raise
        runner = TensorParallelRunner(parts.runner, workers)
    device = parts.config.runner.device
    torch_device = torch.device(device)
    engine = cls(parts.config, parts.tokenizer, parts.scheduler, parts.kv, runner,
                 model_name=a.model)
    engine.measure_step_times()  # the draft-length cost model's table, where it is used
    if torch_device.type == "cuda":
        limit_host_threads(a.quiet)
        engine.warm_up()  # compile the prefill kernels now (see LLMEngine.warm_up)
        # Everything alive now (weights, graphs, tokenizer, library objects) lives as long as
        # the engine: keep it out of the garbage collector's scans, which otherwise land in
        # the middle of decode steps as pauses that grow with the heap.
        gc.collect()
        gc.freeze()
    return engine


def assemble(args: EngineArgs, checked, tp) -> Assembled:
    """Rank `tp.rank`'s parts of the engine of `args` (checked by preflight: `checked`): its
    share of the model and its KV pool, a runner over them, and the scheduler (used on rank 0).
    Every rank runs this with the same arguments; the sizes all ranks must share (the KV
    blocks) are agreed on here."""
    from outpace.engine.preflight import check_max_model_len
    from outpace.parallel.shard import local_config
    a = args
    model, device, max_num_seqs, block_size = a.model, a.device, a.max_num_seqs, a.block_size
    max_num_batched_tokens = a.max_num_batched_tokens
    max_prefill_with_decodes = a.max_prefill_with_decodes
    from outpace.kvcache.manager import KVCacheManager
    from outpace.kvcache.sizing import num_kv_blocks as size_kv
    from outpace.models.loader import load_model
    from outpace.runner.model_runner import ModelRunner
    from outpace.scheduler.scheduler import Scheduler
    from outpace.speculative.factory import build_proposer

    device = resolve_device(device)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' was asked for but CUDA is not available; use --device "
                          "cpu", option="device")
    runner_cfg = RunnerConfig(device=device, dtype=a.dtype, weight_dtype=a.weight_dtype,
                              kv_cache_dtype=a.kv_cache_dtype, enforce_eager=a.enforce_eager,
                              seed=a.seed, overlap=a.overlap,
                              kernel_options=a.kernel_options or KernelOptions())
    spec_cfg, cache_cfg, chat_template = checked.spec, checked.cache, checked.chat_template
    if tp.size > 1 and not device.startswith("cuda"):
        # the ranks share the host's memory: a CPU pool's bytes are split between them (each
        # rank's tokens cost 1 / size of the bytes, so the pool holds as many tokens)
        cache_cfg = dataclasses.replace(cache_cfg, cpu_kv_bytes=cache_cfg.cpu_kv_bytes // tp.size)
    first = tp.rank == 0  # the rank that speaks for the engine in the log
    if spec_cfg.force_accept_mean is not None and first:
        log.warning("outpace: WARNING: speculative option force_accept_mean=%s is for "
                    "benchmarking: drafts are accepted at random, so the output is NOT what the "
                    "model would write", spec_cfg.force_accept_mean)
    if max_prefill_with_decodes is None:
        max_prefill_with_decodes = default_prefill_with_decodes(torch.device(device))
    if a.gpu_memory_utilization is not None and not device.startswith("cuda") and first:
        # Accepted, as vLLM's CPU backend accepts it, so a vLLM command line runs unchanged.
        log.warning("gpu_memory_utilization (--gpu-memory-utilization) is ignored on %s: a CPU "
                    "KV pool is %d MiB (or set num_kv_blocks)", device,
                    CacheConfig().cpu_kv_bytes >> 20)
    torch_device = torch.device(device)
    torch.manual_seed(a.seed)
    graphs = torch_device.type == "cuda" and not a.enforce_eager
    from outpace.kernels import triton_available
    # the device n-gram lookup runs as the kernel where kernels/ngram_lookup.use_ngram_kernel
    # will hold in the runner (a CUDA device, triton, the option on)
    lookup_kernel = (graphs and runner_cfg.kernel_options.ngram_lookup_kernel
                     and triton_available())
    spec_cfg = spec_cfg.with_ngram_device(lookup_kernel).with_default_schedule(
        torch_device.type == "cuda")

    if a.loaded is not None:
        target, model_cfg, tokenizer = a.loaded
        stored = target.embed_weight.dtype
        if a.weight_dtype != "auto" and stored != runner_cfg.torch_weight_dtype:
            raise ConfigError(f"the loaded model stores its weights in {stored}, not "
                              f"weight_dtype {a.weight_dtype}; cast it first "
                              f"(outpace.models.weight_dtype.store_weights_in_) or pass "
                              f"weight_dtype auto")
        check_max_model_len(a.max_model_len, model_cfg)
    else:
        # The rope tables are built only for the positions the engine can reach (the model's
        # config, read by the checks, may claim millions).
        model_cfg = checked.model_config
        positions = a.max_model_len or min(
            model_cfg.max_position_embeddings,
            pool_tokens_at_most(cache_cfg, local_config(model_cfg, tp.size),
                                runner_cfg.torch_kv_cache_dtype, torch_device))
        target, model_cfg, tokenizer = load_model(model, dtype=runner_cfg.torch_dtype,
                                                  weight_dtype=runner_cfg.torch_weight_dtype,
                                                  device=torch_device,
                                                  quiet=a.quiet or tp.rank > 0,
                                                  download_dir=a.download_dir,
                                                  max_positions=positions, tp=tp,
                                                  tokenizer=tp.rank == 0)
    if chat_template is not None and tokenizer is not None:
        tokenizer = tokenizer.with_chat_template(chat_template)
    rank_cfg = local_config(model_cfg, tp.size)  # this rank's heads: its pool and attention
    limit = model_cfg.max_position_embeddings
    if max_num_batched_tokens is None:
        max_num_batched_tokens = default_token_budget(torch_device)
    sched_cfg = SchedulerConfig(max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=max_num_batched_tokens,
                                max_model_len=a.max_model_len or limit,
                                enable_chunked_prefill=a.enable_chunked_prefill,
                                max_waiting_requests=a.max_waiting_requests,
                                max_prefill_with_decodes=max_prefill_with_decodes)
    config = EngineConfig(model=model, model_config=model_cfg, cache=cache_cfg,
                          scheduler=sched_cfg, spec=spec_cfg, runner=runner_cfg)

    proposer = build_proposer(spec_cfg, target, model_cfg, runner_cfg) if spec_cfg.enabled else None
    num_slots = model_cfg.num_hidden_layers + (proposer.num_kv_layers if proposer else 0)
    max_k = spec_cfg.num_speculative_tokens if proposer else 0
    max_num_tokens = max_num_batched_tokens + max_num_seqs * (max_k + 1)
    # a step's activations stay out of the pool (on a GPU; a CPU pool has its own size), and
    # the device n-gram's buffers; the context is at most what the rope tables cover (the
    # pool may shorten it below)
    headroom = kv_headroom(model_cfg, spec_cfg, max_num_tokens, max_num_seqs,
                           min(config.max_model_len, target.rotary.max_positions),
                           runner_cfg.torch_dtype.itemsize, graphs, lookup_kernel)
    # every rank's block tables are rank 0's: the pool is the size the smallest rank holds
    num_blocks = tp.all_min(size_kv(cache_cfg, rank_cfg, num_slots,
                                    runner_cfg.torch_kv_cache_dtype, torch_device,
                                    headroom=headroom))
    lookahead = proposer.num_lookahead_tokens if proposer else 0
    # One request of the whole context must fit the pool (block 0 is the null block), or the
    # engine would advertise a context it cuts short.
    fits = (num_blocks - 1) * block_size - lookahead
    if fits < config.max_model_len:
        where = ("num_kv_blocks (--num-kv-blocks)" if a.num_kv_blocks is not None
                 else "gpu_memory_utilization (or set num_kv_blocks)"
                 if a.gpu_memory_utilization is not None and torch_device.type == "cuda"
                 else "memory_fraction (or set num_kv_blocks)")
        if a.max_model_len is not None or fits < 2:
            less = f", less {lookahead} of draft lookahead" if lookahead else ""
            raise ConfigError(
                f"the KV cache holds {max(fits, 0)} tokens of one request ({num_blocks - 1} "
                f"blocks of {block_size}{less}), fewer than max_model_len="
                f"{config.max_model_len}: raise {where} or lower max_model_len "
                f"(--max-model-len)")
        if first:
            log.warning("the KV cache holds %d tokens of one request, fewer than the model's "
                        "%d positions: max_model_len is %d (raise %s for more)", fits,
                        config.max_model_len, fits, where)
        sched_cfg = dataclasses.replace(sched_cfg, max_model_len=fits)
        config = dataclasses.replace(config, scheduler=sched_cfg)
    if target.rotary.max_positions < config.max_model_len:  # a model lent with `loaded`
        raise ConfigError(f"the loaded model's rope tables cover {target.rotary.max_positions} "
                          f"positions, fewer than max_model_len={config.max_model_len}: load "
                          f"it with max_positions >= {config.max_model_len} or lower "
                          f"max_model_len")
    kv = KVCacheManager(cache_cfg, num_blocks, config.max_model_len,
                        **({"trim_last_matched_block": True}
                           if proposer is not None and proposer.num_kv_layers else {}))
    scheduler = Scheduler(sched_cfg, kv, config.max_model_len, num_lookahead_tokens=lookahead,
                          block_size=block_size,
                          draft_plane=proposer is not None and proposer.num_kv_layers > 0)
    runner = ModelRunner(target, rank_cfg, num_blocks=num_blocks, block_size=block_size,
                         max_model_len=config.max_model_len, max_num_tokens=max_num_tokens,
                         max_num_seqs=max_num_seqs, device=torch_device,
                         kv_dtype=runner_cfg.torch_kv_cache_dtype, proposer=proposer,
                         seed=a.seed, kernel_options=runner_cfg.kernel_options)
    if graphs:
        # Graphs for plain decode (q = 1) and every verify length (q = 2 .. k + 1).
        runner.enable_cuda_graphs(tuple(range(1, max_k + 2)), capture_fused=True)
    if not a.quiet and first:
        dtypes = str(runner_cfg.torch_dtype)
        if runner_cfg.torch_weight_dtype != runner_cfg.torch_dtype:
            dtypes += f", weights {runner_cfg.torch_weight_dtype}"
        if runner_cfg.torch_kv_cache_dtype != runner_cfg.torch_dtype:
            dtypes += f", KV cache {runner_cfg.torch_kv_cache_dtype}"
        ranks = f", {tp.size} tensor-parallel ranks" if tp.size > 1 else ""
        log.info("outpace: %s on %s (%s%s), %d KV blocks of %d tokens", model, device, dtypes,
                 ranks, num_blocks, block_size)
    return Assembled(config=config, tokenizer=tokenizer, scheduler=scheduler, kv=kv,
                     runner=runner, graphs=graphs)
