"""MTP depths mode in real CUDA graphs (outpace/runner/fused_depths_window.py): the window runs
in the fused decode step, its geometry computed on the device and its stash in device buffers.

* graph replay gives the same tokens and drafts as the eager engine (the eager window), with
  and without overlap (chained steps keep the stash on the device), tiny fp32 target;
* after warm-up, decode steps run under torch.cuda.set_sync_debug_mode("error"): nothing in a
  depths-mode step waits for the GPU.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("triton")

from outpace import SamplingParams  # noqa: E402
from tests.gpu.test_fused_step import (gpu_engine, replayed_as_eager,  # noqa: E402
                                       steps_without_sync)
from tests.speculative.spec_helpers import repetitive_prompts  # noqa: E402


@pytest.fixture(scope="module")
def depths_head(cuda_loaded, tmp_path_factory):
    """A random 3-module MTP head for the tiny target."""
    from outpace.models.draft_loader import mtp_config_dict, save_draft_head
    from outpace.models.mtp import MTPHead
    from outpace.training.init_draft import random_head_tensors
    cfg = cuda_loaded[1]
    head = MTPHead(cfg, 3, cfg.num_hidden_layers, device="meta")
    return save_draft_head(mtp_config_dict(cfg, 3), random_head_tensors(head, 1),
                           tmp_path_factory.mktemp("depths") / "mtp3")


def depths_spec(head, k, **opts):
    return {"method": "mtp", "model": str(head), "num_speculative_tokens": k,
            "mtp_mode": "depths", **opts}


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("k,opts", [(3, {}), (3, {"force_accept_mean": 3.0}), (2, {})],
                         ids=["k3", "k3-fa3", "k2"])
def test_depths_graph_equals_eager(cuda_loaded, depths_head, k, opts, overlap):
    # (force-accept 3: three tokens a step, so fewer steps)
    graphed, eager = replayed_as_eager(cuda_loaded, depths_spec(depths_head, k, **opts), overlap,
                                       min_replays=10 if opts else 20)
    fused = graphed.runner.fused
    assert fused.window is not None
    assert graphed.stats()["spec"] == eager.stats()["spec"]
    assert fused.chained > (5 if opts else 10) if overlap else fused.chained == 0


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_depths_decode_steps_do_not_sync_with_host(cuda_loaded, depths_head, overlap):
    eng = gpu_engine(cuda_loaded, depths_spec(depths_head, 3, force_accept_mean=3.0),
                     eager=False, overlap=overlap)
    params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    done = steps_without_sync(eng, repetitive_prompts(4, 3), [params] * 4)
    assert done["replays"] == 10
    if overlap:
        assert done["chained"] >= 9
