"""RunnerConfig.weight_dtype and kv_cache_dtype: their values, the combinations with dtype they
allow (weights / KV cache as wide as the activations or, under fp32 activations, in bf16 /
fp16), the errors that say what to change, and the engine builder's check of a lent model's
weight storage."""

from __future__ import annotations

import pytest
import torch

from outpace.errors import ConfigError
from outpace.runner_config import RunnerConfig


@pytest.mark.parametrize("device,dtype,weight_dtype,act,weight", [
    ("cpu", "auto", "auto", torch.float32, torch.float32),
    ("cuda", "auto", "auto", torch.bfloat16, torch.bfloat16),
    ("cuda", "bfloat16", "auto", torch.bfloat16, torch.bfloat16),
    ("cuda", "float32", "bfloat16", torch.float32, torch.bfloat16),
    ("cpu", "auto", "bfloat16", torch.float32, torch.bfloat16),
    ("cuda", "float32", "float16", torch.float32, torch.float16),
    ("cuda", "auto", "bfloat16", torch.bfloat16, torch.bfloat16),
    ("cuda", "float16", "float16", torch.float16, torch.float16),
])
def test_allowed_combinations(device, dtype, weight_dtype, act, weight):
    cfg = RunnerConfig(device=device, dtype=dtype, weight_dtype=weight_dtype)
    assert cfg.torch_dtype == act and cfg.torch_weight_dtype == weight


def test_unknown_weight_dtype():
    with pytest.raises(ConfigError, match="weight_dtype must be auto, float32, float16 or "
                                          "bfloat16, got 'int8'"):
        RunnerConfig(weight_dtype="int8")


@pytest.mark.parametrize("device,dtype,weight_dtype", [
    ("cpu", "bfloat16", "float32"), ("cuda", "auto", "float32"), ("cuda", "float16", "float32")])
def test_weights_wider_than_activations(device, dtype, weight_dtype):
    with pytest.raises(ConfigError, match=r"weight_dtype float32 is wider than dtype \w+: .*"
                                          r"use weight_dtype auto .*or dtype float32"):
        RunnerConfig(device=device, dtype=dtype, weight_dtype=weight_dtype)


@pytest.mark.parametrize("dtype,weight_dtype", [("bfloat16", "float16"),
                                                ("float16", "bfloat16")])
def test_other_16_bit_format(dtype, weight_dtype):
    with pytest.raises(ConfigError, match=f"weight_dtype {weight_dtype} with dtype {dtype} is "
                                          f"not supported.*dtype float32 for float32 "
                                          f"activations over {weight_dtype} weights"):
        RunnerConfig(dtype=dtype, weight_dtype=weight_dtype)


def test_engine_rejects_a_lent_model_stored_otherwise():
    """build_engine does not cast a model it was lent (shared with other engines): a
    weight_dtype that differs from the storage is a clear error; auto takes it as it is."""
    from outpace.models.weight_dtype import store_weights_in_
    from tests.engine_helpers import make_engine
    from tests.speculative.spec_helpers import tiny_target
    loaded = tiny_target(seed=0)
    with pytest.raises(ConfigError, match="stores its weights in torch.float32, not "
                                          "weight_dtype bfloat16; cast it first"):
        make_engine(loaded, weight_dtype="bfloat16")
    store_weights_in_(loaded[0], torch.bfloat16)
    assert loaded[0].layers[0].self_attn.qkv_weight.dtype == torch.bfloat16
    make_engine(loaded, weight_dtype="bfloat16")
    make_engine(loaded)  # auto


@pytest.mark.parametrize("device,dtype,kv_cache_dtype,kv", [
    ("cpu", "auto", "auto", torch.float32), ("cuda", "auto", "auto", torch.bfloat16),
    ("cuda", "float32", "auto", torch.float32), ("cuda", "float32", "bfloat16", torch.bfloat16),
    ("cpu", "float32", "float16", torch.float16), ("cuda", "bfloat16", "bfloat16", torch.bfloat16),
    ("cuda", "auto", "bfloat16", torch.bfloat16)])
def test_kv_cache_dtype_combinations(device, dtype, kv_cache_dtype, kv):
    cfg = RunnerConfig(device=device, dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    assert cfg.torch_kv_cache_dtype == kv


def test_unknown_kv_cache_dtype():
    with pytest.raises(ConfigError, match="kv_cache_dtype must be auto, float32, float16 or "
                                          "bfloat16, got 'fp8'"):
        RunnerConfig(kv_cache_dtype="fp8")


@pytest.mark.parametrize("dtype,kv_cache_dtype", [("bfloat16", "float32"),
                                                  ("bfloat16", "float16"),
                                                  ("float16", "bfloat16")])
def test_kv_cache_wider_or_other_16_bit(dtype, kv_cache_dtype):
    with pytest.raises(ConfigError, match=f"kv_cache_dtype {kv_cache_dtype} with dtype {dtype} "
                                          f"is not supported.*use kv_cache_dtype auto"):
        RunnerConfig(device="cuda", dtype=dtype, kv_cache_dtype=kv_cache_dtype)


def test_engine_pool_takes_kv_cache_dtype():
    """The pool is allocated in kv_cache_dtype, and its size in blocks is counted in its bytes:
    a bf16 pool under fp32 activations fits twice the blocks of the same byte budget."""
    from outpace.config import CacheConfig
    from outpace.kvcache.sizing import num_kv_blocks
    from tests.engine_helpers import make_engine
    from tests.speculative.spec_helpers import tiny_target
    loaded = tiny_target(seed=0)
    eng = make_engine(loaded, kv_cache_dtype="bfloat16")
    assert eng.runner.kv_cache.dtype == torch.bfloat16
    assert eng.runner.model.dtype == torch.float32  # activations stay fp32
    cfg = loaded[1]
    cache = CacheConfig(cpu_kv_bytes=1 << 24)
    fp32 = num_kv_blocks(cache, cfg, cfg.num_hidden_layers, torch.float32, "cpu")
    bf16 = num_kv_blocks(cache, cfg, cfg.num_hidden_layers, torch.bfloat16, "cpu")
    assert bf16 == 2 * fp32
