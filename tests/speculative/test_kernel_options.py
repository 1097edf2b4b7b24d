"""KernelOptions travel with the engine: the runner puts them in force around everything it
runs (and nowhere else), so two engines in one process can run different options."""

from __future__ import annotations

import pytest

from outpace.errors import ConfigError
from outpace.kernels.options import current, use_kernel_options
from outpace.runner_config import KernelOptions
from tests.engine_helpers import make_engine, run_batch
from outpace import SamplingParams


GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _seen_while_running(engine) -> list:
    seen, model = [], engine.runner.model  # (the engines share one model: restored after)
    model.forward = lambda *a, **kw: seen.append(current()) or type(model).forward(model, *a,
                                                                                    **kw)
    try:
        run_batch(engine, [[5, 6, 7, 8], [9, 10]], GREEDY)
    finally:
        del model.forward
    return seen


def test_each_engine_runs_under_its_own_options(tiny_loaded):
    off = KernelOptions(pdl=False, few_row_kernels=False, row_warps_rows=frozenset({2}))
    a = make_engine(tiny_loaded, kernel_options=off)
    b = make_engine(tiny_loaded)
    assert a.runner.kernel_options == off and b.runner.kernel_options == KernelOptions()
    seen_a, seen_b = _seen_while_running(a), _seen_while_running(b)
    assert seen_a and set(seen_a) == {off}
    assert seen_b and set(seen_b) == {KernelOptions()}
    assert current() == KernelOptions()  # nothing leaks out of the runner


def test_scoped_options_and_ablations():
    with use_kernel_options(KernelOptions().ablate("triton_logprobs")):
        assert not current().triton_logprobs
        with use_kernel_options(KernelOptions().ablate("row_warps_3")):
            assert current().row_warps_rows == frozenset({2, 4}) and current().triton_logprobs
        assert not current().triton_logprobs
    assert current() == KernelOptions()
    with pytest.raises(ConfigError, match="unknown ablation 'pdll'; use one of pdl, "):
        KernelOptions().ablate("pdll")
    with pytest.raises(ConfigError, match="pdl_prime_skip names unknown graph kinds"):
        KernelOptions(pdl_prime_skip=frozenset({"decode"}))
    with pytest.raises(ConfigError, match="kernel option pdl must be true or false"):
        KernelOptions(pdl="yes")
