"""GraphRunner's bucketing and padding, on CPU: a stand-in "graph" re-runs the captured function
on replay and copies into the captured outputs, exactly as a CUDA graph re-reads the fixed
input buffers (the fake_graph_capture fixture). Greedy output with graphs must equal eager
output token for token."""

import pytest

from outpace import SamplingParams
from tests.engine_helpers import make_engine, run_batch


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3}])
def test_graph_padding_matches_eager(tiny_loaded, fake_graph_capture, spec):
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11], [12, 13, 14, 15, 16, 12, 13, 14]]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    eager = make_engine(tiny_loaded, speculative_config=spec, max_num_seqs=8)
    want = run_batch(eager, prompts, params)
    graphed = make_engine(tiny_loaded, speculative_config=spec, max_num_seqs=8)
    k = spec["num_speculative_tokens"] if spec else 0
    graphed.runner.enable_cuda_graphs(tuple(range(1, k + 2)))
    graphed.runner.fused = None  # the target-only graphs (sampling steps); fused: its own test
    replays = []
    inner = graphed.runner.graphs.run
    graphed.runner.graphs.run = lambda hb: (replays.append(len(hb.seq_lens)), inner(hb))[1]
    got = run_batch(graphed, prompts, params)
    assert got == want
    assert replays, "no step went through a graph"
    assert 3 in replays, "a batch of 3 (padded to bucket 4) should have replayed"
