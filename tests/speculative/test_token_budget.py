"""The step token budget's default (builder.default_token_budget): 8192 on GPUs of 70 GiB or
more, else 2048; an engine built without one gets it, and an explicit one wins."""

import torch

from outpace.engine import builder
from tests.engine_helpers import make_engine


def test_default_budget_by_device():
    assert builder.default_token_budget(torch.device("cpu")) == 2048
    for gib, want in ((141, 8192), (80, 8192), (70, 8192), (48, 2048), (24, 2048)):
        assert builder.default_token_budget(torch.device("cuda"), gib * 2**30) == want, gib


def test_engine_takes_the_default_unless_given(tiny_loaded):
    assert make_engine(tiny_loaded).config.scheduler.max_num_batched_tokens == 2048
    eng = make_engine(tiny_loaded, max_num_batched_tokens=512)
    assert eng.config.scheduler.max_num_batched_tokens == 512
