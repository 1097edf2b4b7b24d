"""Does a captured step graph survive torch's cuBLAS workspace being cleared? (GPU machine.)

Runs 15 and 16 aborted with an illegal memory access when the deferred profile replayed the
8B-shaped engine's graph after the HF section, whose torch.compile (cudagraph trees) calls
torch._C._cuda_clearCublasWorkspaces(). The hypothesis: the cuBLAS workspace that the step
graph's LM head was captured with is then freed back to the graphs' pool, and the next
torch.cuda.empty_cache() releases it, so a later replay writes to unmapped memory.

Each case runs in a child process (an illegal access ruins the CUDA context): a SmolLM2-shaped
engine with random weights decodes one request, then the case's action, then every captured
graph replays; the child prints its verdict and the parent collects them into JSON.

    python benchmarks/diag_cublas_workspace.py [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CASES = ("nothing", "empty_cache", "clear_workspaces", "clear_workspaces_empty_cache")


def child(case: str, big: bool) -> None:
    import torch
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks.common import graph_ms, run_engine
    from benchmarks.throughput import _NullTokenizer, llama8b_shaped, smollm2_shaped
    from outpace.engine.engine import LLMEngine
    model, cfg = llama8b_shaped() if big else smollm2_shaped(Path(tempfile.mkdtemp()))[:2]
    eng = LLMEngine.from_args("shaped", loaded=(model, cfg, _NullTokenizer()),
                              device="cuda", dtype="bfloat16", max_num_seqs=8,
                              num_kv_blocks=1024, max_model_len=2048, quiet=True,
                              enable_prefix_caching=False)
    run_engine(eng, [list(range(100, 228))], 1, 32)
    torch.cuda.synchronize()
    graphs = eng.runner.fused._captured
    ms = graph_ms(graphs[(1, 1, 0, True)][0])  # the batch-1 decode graph (cuBLAS LM head)
    if "clear_workspaces" in case:
        torch._C._cuda_clearCublasWorkspaces()
    if "empty_cache" in case:
        torch.cuda.empty_cache()
    for key, (graph, _) in graphs.items():
        graph.replay()
    torch.cuda.synchronize()
    print(f"VERDICT {case}: {len(graphs)} graphs replayed; batch-1 graph {ms} ms", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--child", default="")
    ap.add_argument("--big", action="store_true", help="the Llama-8B-shaped model")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--no-workspace", action="store_true",
                    help="children run with CUBLAS_WORKSPACE_CONFIG=:0:0 (no cuBLAS workspace)")
    args = ap.parse_args()
    if args.child:
        child(args.child, args.big)
        return
    import os
    env = dict(os.environ)
    if args.no_workspace:
        env["CUBLAS_WORKSPACE_CONFIG"] = ":0:0"
    rows = []
    for case in args.cases.split(","):
        p = subprocess.run([sys.executable, __file__, "--child", case]
                           + (["--big"] if args.big else []), capture_output=True,
                           text=True, timeout=300, env=env)
        verdict = next((ln for ln in p.stdout.splitlines() if ln.startswith("VERDICT")), None)
        err = [ln for ln in p.stderr.splitlines() if "Error" in ln or "error" in ln][-3:]
        rows.append({"case": case, "big": args.big, "no_workspace": args.no_workspace,
                     "returncode": p.returncode, "verdict": verdict, "errors": err})
        print(rows[-1], flush=True)
    name = "diag_cublas_workspace" + ("_big" if args.big else "") + \
        ("_noworkspace" if args.no_workspace else "") + ".json"
    (Path(args.out) / name).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
