"""The fused step's write check (SpecConfig.check_fused_writes, runner/write_check.py): with
forced full acceptance and overlap on (chained steps push the frontier and the draft loop as far
as they go), every slot a launched or chained step's graph wrote, read from its device-side
metadata, lies in the blocks the scheduler reserved for that request. Scheduler.reserve_chained
cut to 1 + kd positions fails it (checked by hand: the draft loop of a chained step writes past
the reserved blocks; see docs/decisions.md, "A write check for chained steps")."""

from __future__ import annotations

import pytest

from tests.speculative.spec_helpers import TINY_BLOCK, run_waves
from tests.speculative.test_draft_plane import GREEDY, head_spec, waves
from tests.speculative.test_fused_step import enable_graphs


@pytest.mark.parametrize("method,k", [("eagle3", 2), ("eagle3", 4), ("mtp", 3)])
def test_chained_steps_write_inside_reserved_blocks(tiny_loaded, tiny_heads, fake_graph_capture,
                                                   method, k):
    spec = head_spec(tiny_heads, method, k, force_accept_mean=k + 0.9, check_fused_writes=True)
    run = run_waves(tiny_loaded, waves(), GREEDY, overlap=True,
                    on_engine=lambda e: enable_graphs(e, k), speculative_config=spec,
                    block_size=TINY_BLOCK, max_num_batched_tokens=16, num_kv_blocks=26)
    fused = run.engine.runner.fused
    check = fused.write_check
    assert fused.chained > 5 and check.chained_steps == fused.chained
    assert check.steps >= fused.replays and check.slots > 100
    # (nearly) full acceptance: chains reach their worst case, every draft accepted
    spec_stats = run.stats["spec"]
    assert spec_stats["num_accepted_tokens"] > 0.8 * spec_stats["num_draft_tokens"]


def test_write_check_is_off_by_default(tiny_loaded, tiny_heads, fake_graph_capture):
    run = run_waves(tiny_loaded, [waves()[0][:2]], GREEDY, overlap=True,
                    on_engine=lambda e: enable_graphs(e, 2),
                    speculative_config=head_spec(tiny_heads, "eagle3", 2),
                    block_size=TINY_BLOCK)
    assert run.engine.runner.fused.write_check is None
