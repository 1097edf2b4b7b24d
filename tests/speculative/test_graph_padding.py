"""GraphRunner's bucketing and padding, on CPU: a stand-in "graph" re-runs the captured function
on replay and copies into the captured outputs, exactly as a CUDA graph re-reads the fixed
input buffers (the rerun_capture stand-in). Greedy output with graphs must equal eager
output token for token."""

import pytest

from outpace import SamplingParams
from tests.engine_helpers import make_engine, run_batch
from tests.speculative.conftest import rerun_capture
from tests.speculative.spec_helpers import EXACT_DRAFTS


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3}])
def test_graph_padding_matches_eager(tiny_loaded, spec):
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11], [12, 13, 14, 15, 16, 12, 13, 14]]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    eager = make_engine(tiny_loaded, speculative_config=spec, max_num_seqs=8)
    want = run_batch(eager, prompts, params)
    graphed = make_engine(tiny_loaded, speculative_config=spec, max_num_seqs=8)
    k = spec["num_speculative_tokens"] if spec else 0
    graphed.runner.enable_cuda_graphs(tuple(range(1, k + 2)), capture=rerun_capture)
    graphed.runner.fused = None  # the target-only graphs (sampling steps); fused: its own test
    replays = []
    inner = graphed.runner.graphs.run
    graphed.runner.graphs.run = lambda hb: (replays.append(len(hb.seq_lens)), inner(hb))[1]
    got = run_batch(graphed, prompts, params)
    assert got == want
    assert replays, "no step went through a graph"
    assert 3 in replays, "a batch of 3 (padded to bucket 4) should have replayed"
    # ModelRunner.choose_path names each step's path: the eager engine's are all eager
    steps = eager.runner.path_steps
    assert steps["eager"] > 0 and sum(steps.values()) == steps["eager"]
    steps = graphed.runner.path_steps
    assert steps["decode_graph"] == len(replays) and steps["fused"] == 0


def _count_prefill_replays(engine) -> list:
    """Record the padded size of every prefill graph replay of engine."""
    sizes = []
    graphs = engine.runner.graphs
    inner = graphs.run_prefill
    graphs.run_prefill = lambda hb, **kw: (sizes.append(len(hb.input_ids)), inner(hb, **kw))[1]
    return sizes


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3},
                                  "eagle3", "mtp"])
def test_prefill_graphs_match_eager(tiny_loaded, tiny_heads, spec):
    """Single-request prefills (whole, and chunked by a small token budget) replay from prefill
    graphs padded to 16 .. 512 tokens; outputs (and with a head, its drafts from the prefill's
    hidden states) equal the eager engine's token for token. Prompts near the context end and
    past the largest graph run eagerly."""
    import random
    if spec in ("eagle3", "mtp"):
        spec = {"method": spec, "model": str(tiny_heads[spec]), "num_speculative_tokens": 3,
                **EXACT_DRAFTS}
    rng = random.Random(3)
    vocab = tiny_loaded[1].vocab_size
    lengths = [1, 15, 16, 17, 50, 130, 460]
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    kw = dict(speculative_config=spec, max_num_seqs=4, max_model_len=480,
              enable_prefix_caching=False)
    eager = make_engine(tiny_loaded, **kw)
    graphed = make_engine(tiny_loaded, **kw)
    k = spec["num_speculative_tokens"] if spec else 0
    graphed.runner.enable_cuda_graphs(tuple(range(1, k + 2)), capture=rerun_capture)
    graphed.runner.fused = None
    sizes = _count_prefill_replays(graphed)
    for p in prompts:  # one at a time: batch-1 prefills
        assert run_batch(graphed, [p], params) == run_batch(eager, [p], params), len(p)
    # Same drafts proposed and accepted: a drafter that raised on the padded rows (it is
    # caught, and the step goes on without drafts) would leave the tokens equal.
    assert graphed.stats()["spec"] == eager.stats()["spec"]
    # A 1-token prompt is a decode step (the q = 1 graph); 15 -> 16, 16 -> 16, 17 -> 32,
    # 50 -> 64, 130 -> 192; 460 would pad past the context (480): eager.
    assert sizes == [16, 16, 32, 64, 192]
    # A small token budget chunks a prompt: its chunks replay too, only the last one samples.
    chunked = make_engine(tiny_loaded, max_num_batched_tokens=48, **kw)
    chunked.runner.enable_cuda_graphs(tuple(range(1, k + 2)), capture=rerun_capture)
    chunked.runner.fused = None
    sizes = _count_prefill_replays(chunked)
    assert run_batch(chunked, [prompts[5]], params) == run_batch(eager, [prompts[5]], params)
    assert sizes[:3] == [48, 48, 48], sizes  # 130 = 48 + 48 + 34


def test_prefill_graph_rejects_what_it_cannot_replay(tiny_loaded):
    from outpace.attention.inputs import build_host_batch
    engine = make_engine(tiny_loaded, max_num_seqs=4)
    engine.runner.enable_cuda_graphs((1,), capture=rerun_capture)
    graphs = engine.runner.graphs
    assert graphs.prefill_q[0] == 16 and graphs.prefill_q[-1] == 512
    assert graphs.prefill_q_for(513) is None and graphs.prefill_q_for(0) == 16
    two = build_host_batch([([1] * 16, 0, [1], [15]), ([2] * 16, 0, [2], [15])], 16)
    with pytest.raises(ValueError, match="no prefill graph"):
        graphs.run_prefill(two)
    odd = build_host_batch([([1] * 20, 0, [1, 3], [19])], 16)
    with pytest.raises(ValueError, match="no prefill graph"):
        graphs.run_prefill(odd)


def test_graph_dummy_batches_forget_the_tables(tiny_loaded):
    """fill_dummy zeroes the block tables directly: put_if_changed must upload again after it
    (attention/inputs.py)."""
    import numpy as np
    import torch
    engine = make_engine(tiny_loaded, max_num_seqs=4)
    engine.runner.enable_cuda_graphs((1,), capture=rerun_capture)
    buf, graphs = engine.runner.inputs, engine.runner.graphs
    a = np.full((1, buf.max_blocks), 3, dtype=np.int32)
    buf.put_if_changed(buf.block_tables, a)
    graphs.fill_dummy(1, 1)  # zeroes the tables
    buf.put_if_changed(buf.block_tables, a)
    assert torch.equal(buf.block_tables[:1], torch.from_numpy(a))
