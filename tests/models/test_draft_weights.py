"""A draft head's matrices read as bf16 on the CPU (SpecConfig.draft_weight_dtype,
models/draft_weights.py): the choice per device and CPU, the bf16 product against its
reference, the head's copies, and the early errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from outpace.errors import ConfigError
from outpace.models.cpu_fast_paths import (add_weight_copies_, cpu_has_bf16_dot,
                                           cpu_packs_bf16, linear)
from outpace.models.draft_weights import DraftWeights, draft_weights
from outpace.runner_config import RunnerConfig
from outpace.speculative_config import SpecConfig

BF16_CPU = "processor\t: 0\nflags\t\t: fpu sse avx512f avx512bw avx512_bf16\n"
PLAIN_CPU = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512bw\n"
needs_bf16_linear = pytest.mark.skipif(not cpu_packs_bf16(),
                                       reason="oneDNN's bf16 packed linear is not on this CPU")


@needs_bf16_linear
def test_cpu_flags_decide_bf16_dot():
    assert cpu_has_bf16_dot(BF16_CPU)
    assert cpu_has_bf16_dot(BF16_CPU.replace("avx512_bf16", "amx_bf16"))
    assert not cpu_has_bf16_dot(PLAIN_CPU)
    assert not cpu_has_bf16_dot("")


@needs_bf16_linear
def test_auto_reads_bf16_on_a_bf16_cpu_under_fp32():
    fp32 = RunnerConfig(device="cpu")
    assert draft_weights("auto", fp32, BF16_CPU) == DraftWeights(torch.float32, torch.bfloat16)
    assert draft_weights("auto", fp32, PLAIN_CPU) == DraftWeights(torch.float32, None)
    # bf16 weights over fp32 activations: the head stored as the target's, read in bf16
    mixed = RunnerConfig(device="cpu", weight_dtype="bfloat16")
    assert draft_weights("auto", mixed, BF16_CPU) == DraftWeights(torch.bfloat16, torch.bfloat16)
    # forced either way, whatever the CPU
    assert draft_weights("float32", fp32, BF16_CPU) == DraftWeights(torch.float32, None)
    assert draft_weights("bfloat16", fp32, PLAIN_CPU) == DraftWeights(torch.float32,
                                                                      torch.bfloat16)


def test_auto_elsewhere_is_the_targets_weight_dtype():
    # no GPU needed: the choice is a function of the config
    assert draft_weights("auto", RunnerConfig(device="cuda"), BF16_CPU) == \
        DraftWeights(torch.bfloat16, None)
    assert draft_weights("auto", RunnerConfig(device="cuda", dtype="float32"), BF16_CPU) == \
        DraftWeights(torch.float32, None)
    assert draft_weights("bfloat16", RunnerConfig(device="cuda", dtype="float32")) == \
        DraftWeights(torch.bfloat16, None)  # stored bf16, upcast (weight_dtype's path)
    assert draft_weights("auto", RunnerConfig(device="cpu", dtype="bfloat16"), BF16_CPU) == \
        DraftWeights(torch.bfloat16, None)


def test_wider_than_the_activations_is_refused():
    with pytest.raises(ConfigError, match="is wider than the engine's dtype bfloat16") as e:
        draft_weights("float32", RunnerConfig(device="cuda"))
    assert e.value.option == "draft_weight_dtype"
    with pytest.raises(ConfigError, match="bfloat16 does not hold every value of the engine's "
                                          "dtype float16"):
        draft_weights("bfloat16", RunnerConfig(device="cuda", dtype="float16"))
    assert draft_weights("bfloat16", RunnerConfig(device="cuda")) == \
        DraftWeights(torch.bfloat16, None)
    with pytest.raises(ConfigError, match="draft_weight_dtype must be"):
        draft_weights("int8", RunnerConfig(device="cpu"))


def test_spec_config_checks_the_option():
    SpecConfig(method="eagle3", model="/x", draft_weight_dtype="bfloat16")
    with pytest.raises(ConfigError, match="draft_weight_dtype must be") as e:
        SpecConfig(method="eagle3", model="/x", draft_weight_dtype="bf16")
    assert e.value.option == "draft_weight_dtype"
    with pytest.raises(ConfigError, match="has none"):
        SpecConfig(method="ngram", draft_weight_dtype="float32")


def test_preflight_refuses_float32_over_bf16_before_loading(tmp_path):
    from outpace.engine.args import EngineArgs
    from outpace.engine.preflight import check_engine_args
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text("{}")
    (head / "model.safetensors").write_bytes(b"")
    args = EngineArgs(model=str(tmp_path / "never-read.gguf"), device="cpu", dtype="bfloat16",
                      speculative_config={"method": "eagle3", "model": str(head),
                                          "draft_weight_dtype": "float32"})
    with pytest.raises(ConfigError, match="never wider") as e:
        check_engine_args(args)
    assert e.value.option == "draft_weight_dtype"
    spec = dict(args.speculative_config, draft_weight_dtype="bfloat16")
    with pytest.raises(ConfigError, match="does not hold every value"):
        check_engine_args(dataclasses.replace(args, dtype="float16", speculative_config=spec))


class _Proj(nn.Module):
    def __init__(self, n, k, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.lm_head_weight = nn.Parameter(torch.randn(n, k, generator=g), requires_grad=False)
        self.fc_weight = nn.Parameter(torch.randn(k, 3 * k, generator=g), requires_grad=False)


@needs_bf16_linear
@pytest.mark.parametrize("rows", [1, 3, 4, 9])
def test_bf16_copies_compute_the_bf16_product(rows):
    m = _Proj(200, 64, seed=rows)
    add_weight_copies_(m, torch.float32, narrow=torch.bfloat16)
    assert "lm_head_weight_bf16" in m.__dict__ and "fc_weight_bf16" in m.__dict__
    assert not any(k.endswith(("_t", "_packed")) for k in m.__dict__)  # no fp32 copies too
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(100 + rows))
    got = linear(x, m, "lm_head_weight")
    assert got.dtype == torch.float32 and got.shape == (rows, 200)
    # the reference: both operands rounded to bf16, the products summed in fp32
    want = x.bfloat16().float() @ m.lm_head_weight.bfloat16().float().t()
    torch.testing.assert_close(got, want, rtol=1e-2, atol=2e-2)
    # ...which is not the fp32 product (the copies are really read)
    assert (got - x @ m.lm_head_weight.t()).abs().max() > 1e-3
    bias = torch.randn(64)
    x3 = torch.randn(rows, 192)
    got = linear(x3, m, "fc_weight", bias=bias)
    want = bias.bfloat16().float() + x3.bfloat16().float() @ m.fc_weight.bfloat16().float().t()
    torch.testing.assert_close(got, want, rtol=1e-2, atol=5e-2)


@needs_bf16_linear
def test_a_module_keeps_one_kind_of_copy():
    m = _Proj(32, 16, seed=0)
    add_weight_copies_(m, torch.float32)
    assert "lm_head_weight_t" in m.__dict__
    add_weight_copies_(m, torch.float32, narrow=torch.bfloat16)
    assert not any(k.endswith(("_t", "_packed")) for k in m.__dict__)
    add_weight_copies_(m, torch.float32)
    assert not any(k.endswith("_bf16") for k in m.__dict__)
    x = torch.randn(1, 16)
    torch.testing.assert_close(linear(x, m, "lm_head_weight"), x @ m.lm_head_weight.t())


@needs_bf16_linear
def test_storing_the_weights_again_drops_the_bf16_copies():
    from outpace.models.weight_dtype import store_weights_in_
    m = _Proj(32, 16, seed=0)
    add_weight_copies_(m, torch.float32, narrow=torch.bfloat16)
    store_weights_in_(m, torch.bfloat16)
    assert "lm_head_weight_bf16" not in m.__dict__
