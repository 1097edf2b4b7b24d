"""RunnerConfig.weight_dtype: its values, the combinations with dtype it allows (weights stored
as wide as the activations or, under fp32 activations, in bf16 / fp16), the errors that say what
to change, and the engine builder's check of a lent model's weight storage."""

from __future__ import annotations

import pytest
import torch

from outpace.config import RunnerConfig
from outpace.errors import ConfigError


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
    from tests.spec.spec_helpers import tiny_target
    loaded = tiny_target(seed=0)
    with pytest.raises(ConfigError, match="stores its weights in torch.float32, not "
                                          "weight_dtype bfloat16; cast it first"):
        make_engine(loaded, weight_dtype="bfloat16")
    store_weights_in_(loaded[0], torch.bfloat16)
    assert loaded[0].layers[0].self_attn.qkv_weight.dtype == torch.bfloat16
    make_engine(loaded, weight_dtype="bfloat16")
    make_engine(loaded)  # auto
