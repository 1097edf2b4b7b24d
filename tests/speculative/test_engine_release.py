"""A CUDA engine freezes the heap after start-up (builder: gc.freeze(), so garbage collections
do not scan it mid-decode); objects in a reference cycle are then never collected. So nothing
an engine owns may sit in a cycle: `del engine` must free its KV pool at once, by reference
counting alone. Checked here on CPU with the heap frozen the same way, with every drafter and
with the fused graph step built (its capture stubbed with a graph that keeps no closure)."""

from __future__ import annotations

import gc
import weakref

import pytest

from outpace import SamplingParams
from tests.engine_helpers import make_engine, run_batch
from tests.speculative.spec_helpers import repetitive_prompts
from tests.speculative.test_draft_plane import head_spec


class _InertGraph:
    def replay(self):  # never replayed here: the engine below does not run after capture
        raise AssertionError("not used")


@pytest.mark.parametrize("method,opts", [(None, {}), ("ngram", {}), ("suffix", {}),
                                         ("eagle3", {}), ("mtp", {}),
                                         ("mtp", {"mtp_mode": "depths"})])
@pytest.mark.parametrize("with_fused_step", [False, True])
def test_deleting_a_frozen_engine_frees_its_kv_pool(tiny_loaded, tiny_heads,
                                                     method, opts, with_fused_step):
    if method in ("eagle3", "mtp"):
        k = 1 if opts else 2  # depths mode drafts one token per module (the tiny head has 1)
        spec = {**head_spec(tiny_heads, method, k), **opts}
    else:
        spec = {"method": method, "num_speculative_tokens": 2} if method else None
    # (2 sequence slots: the fused step captures graphs for every bucket up to max_num_seqs)
    eng = make_engine(tiny_loaded, speculative_config=spec, num_kv_blocks=40, max_num_seqs=2)
    run_batch(eng, repetitive_prompts(2, 10),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    if with_fused_step:
        eng.runner.enable_cuda_graphs((1, 2, 3), capture_fused=True,
                                      capture=lambda fn: (_InertGraph(), fn()))
        assert eng.runner.fused is not None
    from tests.engine_helpers import engines_made
    engines_made().remove(eng)  # the helpers' registry would keep it alive
    pool = weakref.ref(eng.runner.kv_cache)
    gc.collect()
    gc.freeze()
    try:
        del eng
        assert pool() is None, "the engine's KV pool outlived it: a reference cycle"
    finally:
        gc.unfreeze()
