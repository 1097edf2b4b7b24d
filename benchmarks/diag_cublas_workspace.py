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


def child(case: str) -> None:
    import torch
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.bench_gpu import _NullTokenizer, run_engine, smollm2_shaped
    from outpace.engine.engine import LLMEngine
    model, cfg, _ = smollm2_shaped(Path(tempfile.mkdtemp()))
    eng = LLMEngine.from_args("smollm2-shaped", loaded=(model, cfg, _NullTokenizer()),
                              device="cuda", dtype="bfloat16", max_num_seqs=8,
                              num_kv_blocks=1024, max_model_len=2048, quiet=True,
                              enable_prefix_caching=False)
    run_engine(eng, [list(range(100, 228))], 1, 32)
    torch.cuda.synchronize()
    if "clear_workspaces" in case:
        torch._C._cuda_clearCublasWorkspaces()
    if "empty_cache" in case:
        torch.cuda.empty_cache()
    graphs = eng.runner.fused._captured
    for key, (graph, _) in graphs.items():
        graph.replay()
    torch.cuda.synchronize()
    print(f"VERDICT {case}: {len(graphs)} graphs replayed", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--child", default="")
    args = ap.parse_args()
    if args.child:
        child(args.child)
        return
    rows = []
    for case in CASES:
        p = subprocess.run([sys.executable, __file__, "--child", case], capture_output=True,
                           text=True, timeout=300)
        verdict = next((ln for ln in p.stdout.splitlines() if ln.startswith("VERDICT")), None)
        err = [ln for ln in p.stderr.splitlines() if "Error" in ln or "error" in ln][-3:]
        rows.append({"case": case, "returncode": p.returncode, "verdict": verdict,
                     "errors": err})
        print(rows[-1], flush=True)
    (Path(args.out) / "diag_cublas_workspace.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
