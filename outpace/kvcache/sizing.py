"""How many KV blocks the pool gets.

The pool tensor is [slots, K|V, num_blocks, block_size, Hkv, D] (attention/base.py), so one block
costs 2 * slots * block_size * Hkv * D * itemsize bytes, where slots counts the target's layers
plus every draft-head layer (the draft KV plane). The count returned here includes the null
block (block 0), i.e. it is the tensor's num_blocks dimension.
"""

from __future__ import annotations

import logging
from typing import Optional

from outpace.config import CacheConfig, ModelConfig
from outpace.errors import ConfigError

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


def num_kv_blocks(cache_cfg: CacheConfig, model_cfg: ModelConfig, num_layer_slots: int, dtype,
                  device, max_model_len: Optional[int] = None) -> int:
    """Blocks in the pool, null block included.

    cache_cfg.num_blocks when set; else memory_fraction of the free CUDA memory (call this after
    the weights are loaded); else, on CPU, cache_cfg.cpu_kv_bytes.
    """
    import torch
    per_block = kv_bytes_per_block(cache_cfg, model_cfg, num_layer_slots, dtype)
    if cache_cfg.num_blocks is not None:
        n = cache_cfg.num_blocks
        source = "num_blocks"
    else:
        dev = torch.device(device)
        if dev.type == "cuda":
            free, _total = torch.cuda.mem_get_info(dev)
            budget = int(free * cache_cfg.memory_fraction)
            source = (f"{cache_cfg.memory_fraction:.2f} of {free / 2**30:.2f} GiB free device "
                      f"memory")
        else:
            budget = cache_cfg.cpu_kv_bytes
            source = f"cpu_kv_bytes={budget}"
        n = budget // per_block
    if n < 2:
        raise ConfigError(
            f"the KV pool gets {n} blocks from {source} ({per_block} bytes per block), but it "
            f"needs at least 2 (block 0 is reserved); give it more memory (raise "
            f"memory_fraction or cpu_kv_bytes, or set num_blocks >= 2) or lower block_size")
    if max_model_len is not None:
        need = -(-max_model_len // cache_cfg.block_size)
        if n - 1 < need:
            log.warning("the KV pool holds %d tokens, fewer than one %d-token request; long "
                        "requests will end early with finish_reason 'length'. Give the pool "
                        "more memory to avoid this.", (n - 1) * cache_cfg.block_size,
                        max_model_len)
    return n
