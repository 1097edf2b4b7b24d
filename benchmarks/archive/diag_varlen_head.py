"""Where a head engine's first step of a batch goes (GPU machine): the step that prefills several
prompts at once replays a varlen graph, samples, then runs the head's pass over every prompt
row and its draft loop eagerly. Run 24 measured batch-8 TTFT 2.9 ms without a head and 7.5 ms
with EAGLE-3 (k = 2); this times that step's phases, each between two device synchronizations
(so a phase's time includes its GPU work), for no-spec and EAGLE-3 engines built as
`bench smol` builds them.

    python benchmarks/diag_varlen_head.py --gguf PATH [--out DIR] [--batches 8,32]
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import diag_setup, make_heads, run_engine  # noqa: E402
from benchmarks.archive.diag_step import PhaseTimer  # noqa: E402


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def first_step_phases(eng, prompts, batch: int, reps: int = 3) -> dict:
    from outpace import SamplingParams
    from outpace.runner.cuda_graph import GraphRunner
    from outpace.runner.model_runner import ModelRunner
    from outpace.runner.sampling_step import SamplingStep
    from outpace.speculative.head_proposer import HeadProposer
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                        output_kind="final_only")
    proposer = eng.runner.proposer
    wrapped = [(ModelRunner, "execute"), (GraphRunner, "run_varlen"), (SamplingStep, "run"),
               (ModelRunner, "_propose")]
    if proposer is not None:
        wrapped += [(HeadProposer, "propose"), (type(proposer), "step"),
                    (type(proposer), "first_hidden"), (HeadProposer, "draft_ids")]
    timer = PhaseTimer(sync=True)
    first = 0.0
    for r in range(reps):
        for j, p in enumerate(prompts[:batch]):
            eng.add_request(f"v{r}-{j}-{time.monotonic_ns()}", p, sp)
        _sync()
        for cls, fn in wrapped:
            timer.wrap(cls, fn)
        try:
            t = time.perf_counter()
            eng.step()  # the varlen step: every prompt's prefill
            _sync()
            first += time.perf_counter() - t
        finally:
            timer.restore()
        while eng.has_unfinished_requests():
            eng.step()
    return {"batch": batch, "first_step_us": round(1e6 * first / reps, 1),
            "varlen_replays": getattr(eng.runner.graphs, "varlen_replays", None),
            "us_per_step": {k: round(1e6 * v / reps, 1) for k, v in sorted(timer.t.items())},
            "calls_per_step": {k: v / reps for k, v in sorted(timer.n.items())}}


def main():
    args, loaded, prompts = diag_setup(128, extra=(("--batches", "8,32"),))
    from outpace.engine.engine import LLMEngine
    batches = [int(b) for b in args.batches.split(",")]
    eagle, _ = make_heads(args.gguf, tempfile.mkdtemp())
    configs = [("no-spec", None),
               ("eagle3-fa3-k2", {"method": "eagle3", "model": str(eagle),
                                  "num_speculative_tokens": 2, "force_accept_mean": 3.0})]
    report = {}
    for name, spec in configs:
        eng = LLMEngine.from_args(args.gguf, loaded=loaded, device="cuda", dtype="bfloat16",
                                  speculative_config=spec, max_num_seqs=128,
                                  num_kv_blocks=8192, quiet=True, enable_prefix_caching=False)
        for b in batches:  # warm-up: whatever compiles on a first use does so here
            run_engine(eng, prompts[:b], b, 16)
            run_engine(eng, prompts[:b], b, 16)
        report[name] = [first_step_phases(eng, prompts, b) for b in batches]
        for row in report[name]:
            print(name, json.dumps(row), flush=True)
        del eng
        torch.cuda.empty_cache()
    (Path(args.out) / "diag_varlen_head.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
