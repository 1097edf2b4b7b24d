"""How a Llama-family model splits over `size` tensor-parallel ranks (Megatron's layout, as vLLM
and SGLang shard it): attention heads and the MLP's intermediate columns split evenly
(column-parallel q/k/v and gate/up, row-parallel o and down with one all-reduce each), the
embedding and LM head by vocabulary rows. KV heads split too; with fewer KV heads than ranks
each rank keeps the one KV head its query heads read (replicated on size / KV ranks).
Every check is on the config's integers, before anything is built."""

from __future__ import annotations

import dataclasses

from outpace.errors import ConfigError


def check_shardable(cfg, size: int) -> None:
    """A ConfigError naming what does not divide, and the sizes that would."""
    if size == 1:
        return
    heads, kv, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    ok = [n for n in range(1, min(heads, 64) + 1)
          if heads % n == 0 and inter % n == 0 and (kv % n == 0 or n % kv == 0)]
    fits = f"; this model shards over {', '.join(map(str, ok))} rank(s)"
    if heads % size:
        raise ConfigError(f"tensor_parallel_size={size} does not divide the model's "
                          f"{heads} attention heads{fits}", option="tensor_parallel_size")
    if kv % size and size % kv:
        raise ConfigError(f"tensor_parallel_size={size} neither divides the model's {kv} KV "
                          f"heads nor is a multiple of them{fits}",
                          option="tensor_parallel_size")
    if inter % size:
        raise ConfigError(f"tensor_parallel_size={size} does not divide the model's MLP width "
                          f"{inter}{fits}", option="tensor_parallel_size")


def local_config(cfg, size: int):
    """The config of one rank's part: its heads, KV heads and MLP width (what its KV pool and
    attention see); the hidden size and vocabulary stay whole."""
    if size == 1:
        return cfg
    check_shardable(cfg, size)
    return dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // size,
                               num_key_value_heads=max(cfg.num_key_value_heads // size, 1),
                               intermediate_size=cfg.intermediate_size // size)


def kv_head_start(cfg, rank: int, size: int) -> int:
    """The first of rank `rank`'s KV heads in the full model (its query heads read them)."""
    kv = cfg.num_key_value_heads
    if kv >= size:
        return rank * (kv // size)
    return rank // (size // kv)  # size / kv ranks share each KV head


def vocab_rows(vocab: int, size: int) -> int:
    """Rows of each rank's embedding / LM head shard: ceil(vocab / size) (the last rank's
    rows past the vocabulary are zeros, and their logits are cut after the gather)."""
    return -(-vocab // size)


def vocab_range(vocab: int, rank: int, size: int) -> tuple:
    """(first id, ids held) of rank `rank`'s vocabulary shard."""
    rows = vocab_rows(vocab, size)
    start = min(rank * rows, vocab)
    return start, min(rows, vocab - start)
