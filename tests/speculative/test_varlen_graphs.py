"""Varlen graphs (runner/cuda_graph.py): every step that neither a decode bucket's graph nor a
single request's prefill graph serves (several prefill chunks, chunks beside decodes) replays
a graph of T tokens over every sequence slot, padded with sequences of its own. On CPU with the
rerun_capture stand-in: outputs, statistics and the draft plane equal the eager engine's,
with and without drafters, chunked prefill, prefix hits and preemption (the statistics up to
the preemptions a chained step's reserved blocks add: check_draft_stats)."""

from __future__ import annotations

import numpy as np
import pytest

from outpace import SamplingParams
from outpace.runner.cuda_graph import VARLEN_TOKENS
from tests.speculative.conftest import rerun_capture
from tests.speculative.spec_helpers import TINY_BLOCK, run_waves
from tests.speculative.test_draft_plane import PlaneChecker, head_spec, waves

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
# A budget of 48 tokens: prompts of ~30 tokens each, so a step holds a chunk or two beside the
# decodes; a pool small enough to preempt. 8 sequence slots hold the waves' at most 5 requests:
# graphs are captured for every bucket up to max_num_seqs, and a varlen graph spans every
# slot (the default 64 would make each capture and replay attend 65 sequences).
KW = dict(block_size=TINY_BLOCK, max_num_batched_tokens=48, num_kv_blocks=40, max_num_seqs=8)


def spec_for(tiny_heads, method, k):
    if method is None:
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k}
    return head_spec(tiny_heads, method, k)


def with_graphs(engine, k: int):
    engine.runner.enable_cuda_graphs(tuple(range(1, k + 2)), capture_fused=True,
                                     capture=rerun_capture)


def check_draft_stats(graphed: dict, eager: dict, k: int, overlap: bool) -> None:
    """The draft statistics are the eager engine's when both preempted as often. With overlap a
    chained step's blocks are reserved at its launch, for every draft accepted
    (Scheduler.reserve_chained), so in a pool this small the graphed engine may preempt more:
    a request recomputed after a preemption gets its next token from that prefill, not from a
    verify step, so each extra preemption may take one draft step (up to k drafts, and what
    they would have accepted) off the counts, and can add none."""
    extra = graphed["num_preemptions_total"] - eager["num_preemptions_total"]
    if extra == 0:
        assert graphed["spec"] == eager["spec"]
        return
    assert overlap and extra > 0, (graphed["num_preemptions_total"],
                                   eager["num_preemptions_total"])
    got, want = graphed["spec"], eager["spec"]
    assert 0 <= want["num_drafts"] - got["num_drafts"] <= extra, (got, want)
    assert 0 <= want["num_draft_tokens"] - got["num_draft_tokens"] <= k * extra, (got, want)
    assert 0 <= want["num_accepted_tokens"] - got["num_accepted_tokens"] <= k * extra, \
        (got, want)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("method,k", [(None, 0), ("ngram", 3), ("eagle3", 3), ("mtp", 2)])
def test_varlen_graphs_equal_eager(tiny_loaded, tiny_heads, method, k,
                                   overlap):
    spec = spec_for(tiny_heads, method, k)
    eager = run_waves(tiny_loaded, waves(), GREEDY, speculative_config=spec, **KW)
    # (the plane is checked between steps only without overlap: a chained step is in flight)
    checker = PlaneChecker(tiny_loaded) if method in ("eagle3", "mtp") and not overlap \
        else None
    graphed = run_waves(tiny_loaded, waves(), GREEDY, speculative_config=spec, overlap=overlap,
                        on_engine=lambda e: with_graphs(e, k), after_step=checker, **KW)
    assert graphed.outputs == eager.outputs
    check_draft_stats(graphed.stats, eager.stats, k, overlap)
    graphs = graphed.engine.runner.graphs
    # VARLEN_TOKENS up to the input buffers' rows, and that many too
    rows = graphed.engine.runner.inputs.max_tokens
    assert set(graphs.varlen_graphs) == {t for t in VARLEN_TOKENS if 16 < t < rows} | {rows}
    assert graphs.varlen_replays >= 5, "no step ran in a varlen graph"
    if method in ("eagle3", "mtp"):  # the head's pass and drafts after them: graphs too
        fused = graphed.engine.runner.fused
        assert fused.prefill.varlen_head_replays >= 5
        assert {kd for _, kd in fused.prefill.varlen_heads} == {0, k}
    assert graphed.stats["num_preemptions_total"] > 0  # the scenario happened
    assert graphed.engine.kv.prefix_cache_hit_tokens > 0
    if checker is not None:
        assert checker.entries_checked > 100


@pytest.mark.parametrize("method,k", [(None, 0), ("eagle3", 2)])
def test_prompts_filling_every_slot_still_take_a_varlen_graph(tiny_loaded, tiny_heads, method, k):
    """As many prompts as the engine has sequence slots, admitted together: their first step
    pads into a varlen graph (the padding's own sequence takes the input buffers' spare slot;
    without it that step ran eagerly, batch-8 TTFT 21.5 ms against 3), with the eager engine's
    tokens."""
    from tests.engine_helpers import make_engine
    prompts = [[3 + i] * (9 + 4 * i) for i in range(4)]

    def run(graphs: bool):
        eng = make_engine(tiny_loaded, max_num_seqs=4, max_num_batched_tokens=64,
                          block_size=TINY_BLOCK, speculative_config=spec_for(tiny_heads, method, k))
        if graphs:
            with_graphs(eng, k)
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, GREEDY)
        outs = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = o.token_ids
        return eng, outs
    _, want = run(False)
    eng, got = run(True)
    assert got == want
    assert eng.runner.graphs.varlen_replays >= 1  # the first step: all four prompts
    assert eng.runner.inputs.max_seqs == 5  # the scheduler's 4 and the padding's
    assert max(eng.runner.graphs.buckets) == 4
    if method is not None:  # the head's graph after it drafts for the scheduler's 4 slots
        fused = eng.runner.fused
        assert fused.prefill.varlen_head_replays >= 1
        assert {outs[0].shape[0] for _, outs in fused.prefill.varlen_heads.values() if outs} == {4}


def test_varlen_padding_is_sequences_of_its_own(tiny_loaded):
    """The staged batch: real sequences first, as the host built them; the padding rows as
    sequences of at most max_model_len tokens reading the null block, writing nowhere; the rest
    empty; a tile map covering each sequence's queries once."""
    from tests.engine_helpers import make_engine
    eng = make_engine(tiny_loaded, max_num_batched_tokens=48, max_model_len=20, max_num_seqs=6)
    with_graphs(eng, 0)
    graphs, buf = eng.runner.graphs, eng.runner.inputs
    from outpace.attention.inputs import build_host_batch
    hb = build_host_batch([([5, 6, 7], 0, [1], [2]), ([8] * 9, 4, [2, 3, 4, 5], [8])], 4)
    m = buf.max_seqs
    assert graphs.max_model_len == 20
    assert m == 7  # max_num_seqs and a slot for the padding
    assert graphs.varlen_t_for(12, 2) == 32 and graphs.varlen_t_for(12, 6) == 32
    assert graphs.varlen_t_for(5, m - 1) is None  # 27 padding rows need two sequences
    graphs.load_varlen(hb, 32)
    qsl = buf.query_start_loc[:m + 1].tolist()
    assert qsl == [0, 3, 12] + [32] * (m - 2)  # 20 padding rows: one sequence of 20
    assert buf.seq_lens[:m].tolist() == [3, 13, 20] + [0] * (m - 3)
    assert buf.slot_mapping[12:32].eq(-1).all() and buf.slot_mapping[:12].ge(0).all()
    assert buf.positions[12:32].tolist() == list(range(20))
    assert not buf.block_tables[2:m].any()
    assert buf.block_tables[1, :5].tolist() == [2, 3, 4, 5, 0]
    hb3 = build_host_batch([([1] * 5, 0, [1, 2], [4])], 4)
    graphs.load_varlen(hb3, 32)  # 27 padding rows: sequences of 20 and 7
    assert buf.query_start_loc[:4].tolist() == [0, 5, 25, 32]
    assert buf.positions[5:32].tolist() == list(range(20)) + list(range(7))


def test_tile_map_covers_each_query_block_once():
    from outpace.attention.triton_paged import tile_map_for
    q = np.array([3, 0, 70, 32, 1, 0])
    tiles = tile_map_for(q, 10, 32)
    real = [tuple(t) for t in tiles if t[1] < 1 << 20]
    assert real == [(0, 0), (2, 0), (2, 1), (2, 2), (3, 0), (4, 0)]
    assert all(t[1] >= 1 << 20 for t in tiles[len(real):])  # spare: past every sequence
    with pytest.raises(ValueError, match="do not fit"):
        tile_map_for(q, 5, 32)
