"""The engine's step-time table (speculative/step_times.py), measured at start-up for the
draft-length cost model.

With CUDA graphs every (batch bucket, query length) a decode or verify step pads to has a graph:
each is replayed over a dummy batch that writes nowhere (the graphs' capture batch) and timed,
the fastest of REPS replays after one untimed (the fastest: other work on the machine only ever
adds time). Where decode steps run as the fused step the graph timed is the fused one (target,
verify and the head's draft loop): the one a steady step of that length runs
(StepDraftLengths.steady_kd): under the cost model the loop drafts q - 1 tokens (the graph's loop
follows the choice, so the entry of q is the cost of choosing q - 1 drafts, q = 1 running no
head at all); otherwise the target's, and a head drafting outside the graph adds an eager draft
loop the table leaves out.

Without graphs (CPU) steps run eagerly and pad nothing, so the table is modelled
(StepTimes.eager) from timed forwards of one sequence of 1, 2 and k + 1 rows: a step's fixed
cost, what verifying costs more than a one-row decode (another attention path), and a cost per
drafted row; a head's draft step is timed once where the head steps a chain (HeadProposer.step),
else estimated as the target step's share of the head's layers and the LM head. That keeps an
eager engine's start-up to about a dozen forwards.
"""

from __future__ import annotations

import time

import torch

from outpace.attention.base import ForwardContext
from outpace.attention.inputs import build_host_batch
from outpace.speculative.head_proposer import HeadProposer
from outpace.speculative.step_times import StepTimes

REPS = 5  # timed replays per graph
EAGER_REPS = 2  # timed forwards per length without graphs (each is a whole eager forward)


def _timed(fn, reps: int, cuda: bool, warm: bool = True) -> float:
    """The fewest seconds of fn() over reps calls, after one untimed call (warm)."""
    if warm:
        fn()
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return min(times)


@torch.inference_mode()
def measure_step_times(runner, max_draft: int) -> StepTimes:
    """The table of `runner`'s steps for drafts of up to max_draft tokens."""
    if runner.graphs is not None:
        return _from_graphs(runner, REPS)
    return _eager(runner, max_draft, EAGER_REPS)


def _from_graphs(runner, reps: int) -> StepTimes:
    graphs, fused = runner.graphs, runner.fused
    cuda = runner.device.type == "cuda"
    verify = {}
    for bucket in graphs.buckets:
        for q in graphs.q_lens:
            step = fused.table.dummy_step(bucket, q) if fused is not None else None
            if step is None:
                step = graphs.dummy_step(bucket, q)
            verify[(bucket, q)] = max(_timed(step, reps, cuda), 1e-9)
    return StepTimes(tuple(graphs.buckets), tuple(graphs.q_lens), verify)


def _dummy_rows(runner, q: int):
    """Eager inputs of one sequence of q padding rows (slot -1: no KV written), every row
    sampled, as a verify step samples its draft rows."""
    bs = runner.block_size
    rows = [([0] * q, 0, [0] * -(-q // bs), list(range(q)), 0)]
    return runner.inputs.load(build_host_batch(rows, bs))


def _eager(runner, max_draft: int, reps: int) -> StepTimes:
    model, proposer = runner.model, runner.proposer
    capture = proposer.capture_layers if proposer is not None else ()
    cuda = runner.device.type == "cuda"

    def forward(q):
        ids, pos, li, meta = _dummy_rows(runner, q)
        ctx = ForwardContext(runner.backend, meta)

        def run():
            hidden, _ = model(ids, pos, ctx, capture_layers=capture)
            return model.compute_logits(hidden[li])
        return run

    # one sequence of 1, 2 and k + 1 rows, the lengths interleaved so that drift in the
    # machine's speed falls on all three alike
    lengths = sorted({1, min(2, max_draft + 1), max_draft + 1})
    for q in lengths:  # untimed: first calls
        forward(q)()
    best = {q: float("inf") for q in lengths}
    for _ in range(reps):
        for q in lengths:
            best[q] = min(best[q], _timed(forward(q), 1, cuda, warm=False))
    t1, t2, tk = best[1], best[min(2, max_draft + 1)], best[max_draft + 1]
    # a step with drafts costs t1 + verify_s (an eager verify takes another attention path
    # than a one-row decode) + token_s a draft row
    token_s = max(0.0, (tk - t2) / (max_draft - 1)) if max_draft > 1 else max(0.0, t2 - t1)
    verify_s = max(0.0, t2 - t1 - token_s)
    head_step_s = 0.0
    if isinstance(proposer, HeadProposer):
        head_step_s = _head_step(runner, proposer, reps, cuda, t1)
    return StepTimes.eager(runner.max_num_seqs, max_draft, max(t1 - token_s, 1e-9), token_s,
                           head_step_s, verify_s)


def _head_step(runner, proposer, reps: int, cuda: bool, step_s: float) -> float:
    """Seconds of one draft step of the head (one row): timed where the head steps a chain
    (HeadProposer.step), else the target step's share of the head's layers plus the LM head,
    counting the LM head as one layer."""
    if type(proposer).step is HeadProposer.step:
        layers = runner.model_cfg.num_hidden_layers
        return step_s * (proposer.num_kv_layers + 1) / (layers + 1)
    ids, pos, _, meta = _dummy_rows(runner, 1)
    ctx = ForwardContext(runner.backend, meta)
    h = torch.zeros(1, runner.model_cfg.hidden_size, dtype=runner.model.dtype,
                    device=runner.device)
    return _timed(lambda: proposer.draft_ids(proposer.step(h, ids, pos, ctx)), reps, cuda)
