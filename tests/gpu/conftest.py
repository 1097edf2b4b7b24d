"""Fixtures of the CUDA tests: a tiny random target on the GPU (fp32) and draft heads for it."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def cuda_loaded():
    from tests.speculative.spec_helpers import tiny_target
    model, cfg, tok = tiny_target(seed=0)
    return model.to("cuda"), cfg, tok


@pytest.fixture(scope="module")
def cuda_heads(cuda_loaded, tmp_path_factory):
    from outpace.training.init_draft import init_draft
    from tests.speculative.spec_helpers import write_target_folder
    root = tmp_path_factory.mktemp("gpu_heads")
    target = write_target_folder(cuda_loaded[1], root / "target")
    return {m: init_draft(m, str(target), root / m, seed=1, quiet=True) for m in ("eagle3", "mtp")}

