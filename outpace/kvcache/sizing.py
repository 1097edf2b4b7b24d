"""How many KV blocks the pool gets.

The pool tensor is [slots, K|V, num_blocks, block_size, Hkv, D] (attention/base.py), so one block
costs 2 * slots * block_size * Hkv * D * itemsize bytes, where slots counts the target's layers
plus every draft-head layer (the draft KV plane). The count returned here includes the null
block (block 0), i.e. it is the tensor's num_blocks dimension.
"""

from __future__ import annotations

import logging
from typing import Optional

from outpace.config import CacheConfig
from outpace.errors import ConfigError
from outpace.model_config import ModelConfig

log = logging.getLogger(__name__)


def _itemsize(dtype) -> int:
    import torch
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return torch.empty((), dtype=dtype).element_size()


def kv_bytes_per_block(cache_cfg: CacheConfig, model_cfg: ModelConfig, num_layer_slots: int,
                       dtype) -> int:
    return (2 * num_layer_slots * cache_cfg.block_size * model_cfg.num_key_value_heads
            * model_cfg.head_dim * _itemsize(dtype))


# Kept out of the KV pool besides a step's activations: cuBLAS and Triton workspaces, CUDA graph
# pools and the allocator's fragmentation, which no formula of the model's sizes bounds.
GPU_RESERVE_BYTES = 512 << 20


def activation_bytes(model_cfg: ModelConfig, max_num_tokens: int, logit_rows: int,
                     act_bytes: int) -> int:
    """A bound of one step's activation memory on the GPU, that the KV pool must leave free:
    the largest step (max_num_tokens rows) through a layer, kept twice over (a layer's input
    and output live beside its temporaries), plus the float32 logits of the rows that are
    sampled and the sampling's copies of them, plus GPU_RESERVE_BYTES."""
    m = model_cfg
    per_row = (4 * m.hidden_size + (m.num_attention_heads + 2 * m.num_key_value_heads)
               * m.head_dim + 3 * m.intermediate_size)
    layer = 2 * max_num_tokens * per_row * act_bytes
    logits = 4 * logit_rows * m.vocab_size * 4  # fp32 logits, probabilities, masks, noise
    return layer + logits + GPU_RESERVE_BYTES


def gpu_kv_budget(cache_cfg: CacheConfig, free: int, total: int,
                  headroom: int = 0) -> tuple[int, str]:
    """Bytes of GPU memory for the KV pool, given the device's free and total bytes now (after
    the weights load) and the activations' headroom (activation_bytes) -> (bytes, where they
    come from, for messages).

    gpu_memory_utilization (vLLM's meaning): the engine may use that share of the total, so the
    pool gets it less what is in use now (the weights, and whatever else holds memory on the
    device) and less the activations' headroom: at 1.0 the pool takes what the activations
    leave, never the memory a step needs. Else memory_fraction of what is free, and never more
    than what the headroom leaves.
    """
    gib = 2 ** 30
    util = cache_cfg.gpu_memory_utilization
    room = f", less {headroom / gib:.2f} GiB for activations" if headroom else ""
    if util is not None:
        return (int(total * util) - (total - free) - headroom,
                f"gpu_memory_utilization={util:g} of {total / gib:.2f} GiB, less "
                f"{(total - free) / gib:.2f} GiB in use{room}")
    return (min(int(free * cache_cfg.memory_fraction), free - headroom),
            f"memory_fraction={cache_cfg.memory_fraction:g} of {free / gib:.2f} GiB free device "
            f"memory{room}")


def num_kv_blocks(cache_cfg: CacheConfig, model_cfg: ModelConfig, num_layer_slots: int, dtype,
                  device, max_model_len: Optional[int] = None, headroom: int = 0) -> int:
    """Blocks in the pool, null block included.

    cache_cfg.num_blocks when set; else, on CUDA, what gpu_kv_budget gives with `headroom`
    bytes left for activations and whatever else is allocated after the pool (the engine's:
    engine/builder.kv_headroom; call this after the weights are loaded); else, on CPU,
    cache_cfg.cpu_kv_bytes.
    """
    import torch
    per_block = kv_bytes_per_block(cache_cfg, model_cfg, num_layer_slots, dtype)
    if cache_cfg.num_blocks is not None:
        n = cache_cfg.num_blocks
        source = "num_blocks"
        more = "set num_blocks >= 2"
    else:
        dev = torch.device(device)
        if dev.type == "cuda":
            budget, source = gpu_kv_budget(cache_cfg, *torch.cuda.mem_get_info(dev), headroom)
            more = ("raise gpu_memory_utilization" if cache_cfg.gpu_memory_utilization
                    is not None else "raise memory_fraction") + " or set num_blocks"
        else:
            budget = cache_cfg.cpu_kv_bytes
            source = f"cpu_kv_bytes={budget}"
            more = "raise cpu_kv_bytes or set num_blocks"
        n = max(budget, 0) // per_block
    if n < 2:
        raise ConfigError(
            f"the KV pool gets {n} blocks from {source} ({per_block} bytes per block), but it "
            f"needs at least 2 (block 0 is reserved); give it more memory ({more}) or lower "
            f"block_size")
    if max_model_len is not None:
        need = -(-max_model_len // cache_cfg.block_size)
        if n - 1 < need:
            log.warning("the KV pool holds %d tokens, fewer than one %d-token request; long "
                        "requests will end early with finish_reason 'length'. Give the pool "
                        "more memory to avoid this.", (n - 1) * cache_cfg.block_size,
                        max_model_len)
    return n
