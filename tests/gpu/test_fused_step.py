"""The fused graph step on CUDA (outpace/runner/fused_step.py): real CUDA graphs of target
forward + verify/accept + the head's draft loop.

* graph replay gives the same tokens (and drafts) as the eager engine, for plain decode, n-gram,
  EAGLE-3 and MTP drafting (tiny random target, fp32, so rounding can't differ by path), and
  the CUDA engine the same tokens as the CPU engine;
* after warm-up, decode steps run under torch.cuda.set_sync_debug_mode("error"): nothing between
  a step's start and its one output copy waits for the GPU (docs/design.md, "Overlap and no
  host syncs"), with and without overlap (steps launched from their predecessor's outputs
  before those are read).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("triton")

from outpace import SamplingParams  # noqa: E402
from outpace.runner_config import KernelOptions  # noqa: E402
from tests.engine_helpers import make_engine, run_batch  # noqa: E402
from tests.speculative.spec_helpers import repetitive_prompts, tiny_target  # noqa: E402

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def spec_for(heads, method, k, **opts):
    if method is None:
        return None
    if method == "ngram":  # the host lookup unless opts say otherwise (on CUDA the default
        # is the device lookup: the ngram-default case)
        return {"method": "ngram", "num_speculative_tokens": k, "ngram_device": False, **opts}
    spec = {"method": method, "model": str(heads[method]), "num_speculative_tokens": k, **opts}
    if method == "mtp":
        spec["mtp_mode"] = "eagle"
    return spec


def gpu_engine(loaded, spec, eager: bool, overlap: bool = True, **kw):
    return make_engine(loaded, device="cuda", dtype="float32", speculative_config=spec,
                       max_num_seqs=8, enforce_eager=eager, overlap=overlap, **kw)


def record_drafts(engine) -> list:
    """Every step's proposed drafts, in plan order, each as (request id, drafts)."""
    seen = []
    runner = engine.runner
    inner_execute, inner_collect = runner.execute, runner.collect

    def record(plan, result):
        seen.append([(sr.request.request_id,
                      result.outputs[sr.request.request_id].next_draft_token_ids)
                     for sr in plan.scheduled])
        return result
    runner.execute = lambda plan: record(plan, inner_execute(plan))
    runner.collect = lambda launched, plan: record(plan, inner_collect(launched, plan))
    return seen


CASES = [(None, 0), ("ngram", 3), ("eagle3", 3), ("mtp", 2)]
INT8 = {"draft_lm_head_dtype": "int8"}  # drafts from an int8 copy of the draft LM head
# ngram_device unset: on CUDA the engine runs the lookup in the graphs (its steps chain), the
# eager engine on the host (the same drafts)
DEFAULT = {"ngram_device": None}
REPLAY_CASES = ([(m, k, {}) for m, k in CASES] + [("eagle3", 3, INT8), ("mtp", 2, INT8)]
                + [("ngram", 3, DEFAULT)])
REPLAY_IDS = [f"{m}-k{k}" + ("-int8" if o == INT8 else "-default" if o == DEFAULT else "")
              for m, k, o in REPLAY_CASES]


def drafts_by_order(record: list, drop_last: bool) -> list:
    """record_drafts' steps with each request named by the order it first appears (request
    ids differ between engines); drop_last: without each request's last proposal."""
    order, last = {}, {}
    for i, step in enumerate(record):
        for rid, _ in step:
            order.setdefault(rid, len(order))
            last[rid] = i
    return [[(order[rid], d) for rid, d in step if not (drop_last and last[rid] == i)]
            for i, step in enumerate(record)]


def replayed_as_eager(cuda_loaded, spec, overlap, min_replays: int = 20):
    """The graphed engine and the eager one after the same five prompts (bucket 8, 3 padded
    rows): the same tokens and the same drafts, more than min_replays fused replays (fewer
    steps make the tokens where drafts are accepted: force-accept) -> (graphed, eager)."""
    prompts = repetitive_prompts(5, 11)
    eager = gpu_engine(cuda_loaded, spec, eager=True)
    want_drafts = record_drafts(eager)
    want = run_batch(eager, prompts, GREEDY)
    graphed = gpu_engine(cuda_loaded, spec, eager=False, overlap=overlap)
    got_drafts = record_drafts(graphed)
    got = run_batch(graphed, prompts, GREEDY)
    assert got == want
    # Steps chained past max_tokens (the device n-gram's, with overlap) verify every draft, so
    # a request's last proposal, which nothing verifies, comes from tokens the output drops.
    unverified_last = bool(graphed.config.spec.ngram_device) and overlap
    assert drafts_by_order(got_drafts, unverified_last) == drafts_by_order(want_drafts,
                                                                           unverified_last)
    assert graphed.runner.fused.replays > min_replays
    return graphed, eager


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_model_free_drafters_default_to_a_k_schedule_on_cuda(cuda_loaded, method):
    """No k_schedule given: a CUDA engine's n-gram or suffix drafter drafts k up to
    MODEL_FREE_MAX_BATCH requests a step and none above; a given schedule is kept."""
    from outpace.speculative_config import MODEL_FREE_MAX_BATCH as B
    eng = gpu_engine(cuda_loaded, {"method": method, "num_speculative_tokens": 3}, eager=False)
    assert eng.config.spec.k_schedule == ((B, 3),)
    policy = eng.runner.proposer.policy
    assert policy.lengths(["a"], B) == [3] and policy.lengths(["a"], B + 1) == [0]
    given = gpu_engine(cuda_loaded, {"method": method, "k_schedule": [[64, 2]]}, eager=True)
    assert given.config.spec.k_schedule == ((64, 2),)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("method,k,opts", REPLAY_CASES, ids=REPLAY_IDS)
def test_graph_replay_equals_eager(cuda_loaded, cuda_heads, method, k, opts, overlap):
    graphed, eager = replayed_as_eager(cuda_loaded, spec_for(cuda_heads, method, k, **opts),
                                       overlap)
    # the five prompts' prefill step: several requests, a varlen graph (and the head's graph)
    assert graphed.runner.graphs.varlen_replays >= 1
    assert graphed.runner.fused.prefill.varlen_head_replays >= (method in ("eagle3", "mtp"))
    assert graphed.stats()["spec"] == eager.stats()["spec"]
    host = method == "ngram" and not graphed.config.spec.ngram_device  # drafts after the copy
    assert graphed.config.spec.ngram_device is (opts == DEFAULT)
    assert eager.config.spec.ngram_device is False
    chained = graphed.runner.fused.chained
    assert chained > 10 if overlap and not host else chained == 0
    relaunched = graphed.runner.fused.relaunched  # a host drafter's steps, from the carry
    assert relaunched > 10 if overlap and host else relaunched == 0


@pytest.mark.parametrize("fused_qkv", [False, True], ids=["rope-kernel", "qkv-rope-store"])
@pytest.mark.parametrize("num_prompts", [1, 5])
@pytest.mark.parametrize("method,k", CASES, ids=[f"{m}-k{k}" for m, k in CASES])
def test_cuda_engine_equals_cpu_engine(cuda_loaded, cuda_heads, method, k, num_prompts,
                                       fused_qkv, monkeypatch):
    """The CUDA code paths (few-row fused projections up to 16 tokens, cuBLAS with fused norms
    above, fused rope + KV store, Triton attention and argmax, graphs, overlap) against the CPU
    layer-by-layer forward, in fp32: the same tokens. With and without the qkv projection
    doing rope and the KV store (KernelOptions.fused_qkv_rope_store)."""
    spec = spec_for(cuda_heads, method, k)
    prompts = repetitive_prompts(num_prompts, 11)
    cpu = make_engine(tiny_target(seed=0), speculative_config=spec, max_num_seqs=8)
    want = run_batch(cpu, prompts, GREEDY)
    got = run_batch(gpu_engine(cuda_loaded, spec, eager=False,
                               kernel_options=KernelOptions(fused_qkv_rope_store=fused_qkv)),
                    prompts, GREEDY)
    assert got == want


@pytest.mark.parametrize("method,k", [(None, 0), ("eagle3", 3), ("mtp", 2), ("ngram", 3)])
def test_varlen_graphs_with_arrivals_equal_eager(cuda_loaded, cuda_heads, method, k):
    """Requests arriving while others decode, prompts in chunks of a small budget: the steps
    that mix chunks and decodes replay varlen graphs (tile-mapped attention over padded
    sequences), a head's pass and drafts after them its own graphs; tokens and drafts equal
    the eager engine's."""
    spec = spec_for(cuda_heads, method, k)
    prompts = repetitive_prompts(7, 5)

    def run(eager):
        # (no overlap: the steps, and so the arrivals between them, line up with eager's)
        eng = make_engine(cuda_loaded, device="cuda", dtype="float32", speculative_config=spec,
                          max_num_seqs=8, enforce_eager=eager, max_num_batched_tokens=40,
                          overlap=False)
        drafts = record_drafts(eng)
        outs, n = {}, 0
        while n < len(prompts) or eng.has_unfinished_requests():
            if n < len(prompts):  # one arrival every other step
                eng.add_request(f"r{n}", prompts[n], GREEDY)
                n += 1
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = o.token_ids
            if n < len(prompts):
                for o in eng.step():
                    if o.finished:
                        outs[o.request_id] = o.token_ids
        return eng, outs, drafts
    _, want, want_drafts = run(True)
    eng, got, got_drafts = run(False)
    assert got == want and len(got) == len(prompts)
    assert got_drafts == want_drafts
    assert eng.runner.graphs.varlen_replays >= 5
    if method in ("eagle3", "mtp"):
        assert eng.runner.fused.prefill.varlen_head_replays >= 5


@pytest.mark.parametrize("method,k,opts", [(None, 0, {}), ("ngram", 3, {}),
                                           ("eagle3", 3, {"force_accept_mean": 3.0}),
                                           ("eagle3", 3, {}), ("eagle3", 3, INT8)],
                         ids=["plain", "ngram", "eagle3-fa3", "eagle3", "eagle3-int8"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_decode_steps_do_not_sync_with_host(cuda_loaded, cuda_heads, method, k, opts, overlap):
    eng = gpu_engine(cuda_loaded, spec_for(cuda_heads, method, k, **opts), eager=False,
                     overlap=overlap)
    params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    done = steps_without_sync(eng, repetitive_prompts(4, 3), [params] * 4)
    assert done["replays"] == 10
    if overlap and method != "ngram":
        assert done["chained"] >= 9  # (the first of them may start a chain)


def steps_without_sync(eng, prompts: list, params: list, steps: int = 10) -> dict:
    """Run `prompts` once (warm-up: their graphs), start them again, and run `steps` decode
    steps under torch.cuda.set_sync_debug_mode("error") (then the rest) -> what the fused
    step counted in those steps (replays, chained, and steps by GraphMode)."""
    run_batch(eng, prompts, params)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"s{i}", p, sp)
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in eng.scheduler.running) \
            or eng.scheduler.num_waiting:
        eng.step()  # prefill (eager, may sync)
    for _ in range(3):
        eng.step()  # every verify length of the batch has been seen
    fused = eng.runner.fused

    def counts():
        return {"replays": fused.replays, "chained": fused.chained, **fused.mode_steps}
    before = counts()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(steps):
            eng.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    done = {key: n - before[key] for key, n in counts().items()}
    while eng.has_unfinished_requests():
        eng.step()
    return done


@pytest.mark.parametrize("method,k", CASES, ids=[f"{m}-k{k}" for m, k in CASES])
def test_prefill_graphs_equal_eager_and_cpu(cuda_loaded, cuda_heads, method, k):
    """Batch-1 prefills replay from real prefill graphs (runner/cuda_graph.py, padded to 16 ..
    512 tokens): the same tokens and drafts as the eager CUDA engine and the CPU engine, for
    prompts on both sides of graph sizes, up to the largest graph (512 tokens, the context
    of the tiny model). The eager fallbacks are tested on CPU (tests/speculative/test_graph_padding.py).
    """
    import random
    spec = spec_for(cuda_heads, method, k)
    rng = random.Random(5)
    vocab = cuda_loaded[1].vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (15, 17, 64, 130, 300, 470)]
    cpu = make_engine(tiny_target(seed=0), speculative_config=spec, max_num_seqs=8)
    eager = gpu_engine(cuda_loaded, spec, eager=True)
    graphed = gpu_engine(cuda_loaded, spec, eager=False)
    eager_drafts, graphed_drafts = record_drafts(eager), record_drafts(graphed)
    sizes = []  # (graph size, real tokens) of each prefill replay
    graphs = graphed.runner.graphs
    inner = graphs.run_prefill
    graphs.run_prefill = lambda hb, **kw: (sizes.append((len(hb.input_ids),
                                                         int((hb.slot_mapping >= 0).sum()))),
                                           inner(hb, **kw))[1]
    for p in prompts:
        want = run_batch(eager, [p], GREEDY)
        assert run_batch(graphed, [p], GREEDY) == want, len(p)
        assert run_batch(cpu, [p], GREEDY) == want, len(p)
    assert drafts_by_order(graphed_drafts, False) == drafts_by_order(eager_drafts, False)
    assert sizes == [(16, 15), (32, 17), (64, 64), (192, 130), (384, 300), (512, 470)]

