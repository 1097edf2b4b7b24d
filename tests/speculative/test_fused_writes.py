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
from tests.speculative.test_fused_step import FEW_SEQS, enable_graphs


@pytest.mark.parametrize("method,k", [("eagle3", 2), ("eagle3", 4), ("mtp", 3)])
def test_chained_steps_write_inside_reserved_blocks(tiny_loaded, tiny_heads,
                                                   method, k):
    spec = head_spec(tiny_heads, method, k, force_accept_mean=k + 0.9, check_fused_writes=True)
    run = run_waves(tiny_loaded, waves(), GREEDY, overlap=True,
                    on_engine=lambda e: enable_graphs(e, k), speculative_config=spec,
                    block_size=TINY_BLOCK, max_num_batched_tokens=16, num_kv_blocks=26,
                    **FEW_SEQS)
    fused = run.engine.runner.fused
    check = fused.write_check
    assert fused.chained > 5 and check.chained_steps == fused.chained
    assert check.steps >= fused.replays and check.slots > 100
    # (nearly) full acceptance: chains reach their worst case, every draft accepted
    spec_stats = run.stats["spec"]
    assert spec_stats["num_accepted_tokens"] > 0.8 * spec_stats["num_draft_tokens"]


def test_write_check_is_off_by_default(tiny_loaded, tiny_heads):
    run = run_waves(tiny_loaded, [waves()[0][:2]], GREEDY, overlap=True,
                    on_engine=lambda e: enable_graphs(e, 2),
                    speculative_config=head_spec(tiny_heads, "eagle3", 2),
                    block_size=TINY_BLOCK, **FEW_SEQS)
    assert run.engine.runner.fused.write_check is None


def test_chains_under_a_k_schedule_at_zero(tiny_loaded, tiny_heads):
    """A batch-size schedule that drafts only at batch <= 2, with overlap: chains of kd = 0
    steps (no head) and of drafting ones, requests finishing while their chain goes on (their
    rows write only the null block) and recomputes from the mark before drafting again; every
    write inside the reserved blocks, output identical, the plane exact where drafts are held."""
    from tests.speculative.test_draft_plane import SMALL, PlaneChecker
    from tests.speculative.test_draft_skip import drafting_plane_exact
    want = run_waves(tiny_loaded, waves(), GREEDY, **SMALL).outputs
    drafting, seen = drafting_plane_exact(tiny_loaded)
    at_mark = PlaneChecker(tiny_loaded, upto="mark")
    k = 3
    spec = head_spec(tiny_heads, "eagle3", k, k_schedule=[[2, k]], check_fused_writes=True)
    run = run_waves(tiny_loaded, waves(), GREEDY, overlap=True,
                    on_engine=lambda e: enable_graphs(e, k),
                    after_step=lambda e: (drafting(e), at_mark(e)),
                    speculative_config=spec, max_num_seqs=8, **SMALL)
    fused = run.engine.runner.fused
    assert run.outputs == want
    assert fused.chained > 5 and fused.write_check.chained_steps == fused.chained
    assert run.engine.runner.proposer.work.skipped_rows > 20
    assert seen["requests"] > 5 and at_mark.entries_checked > 100
