"""What a batch-1 step costs as its query grows (session 42, GPU machine, SmolLM2-135M, bf16):
the kernels of one chained step in the middle of an MT-bench request (diag_step's
`request_listing`) for no speculation (q = 1), the device n-gram at k = 3 and 8 (q = 4, 9)
and the shipped EAGLE-3 head at k = 3 and 5.

    python benchmarks/archive/diag_step_q.py MODEL.gguf > listing.txt

Finding (docs/performance.md, "A batch-1 step as its query grows"): the few-row projections
(`_small_linear_kernel`, 120 a step) and the attention kernels, not the drafting, make a
longer verify cost more: q = 4 +22% and +13% over q = 1, q = 9 +93% and +77%.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.archive.diag_step import request_listing  # noqa: E402
from benchmarks.common import chat_ids, load_prompts, run_engine  # noqa: E402


def main():
    from outpace.engine.engine import LLMEngine
    from outpace.models.loader import load_model
    from outpace.models.shipped_heads import shipped_head
    gguf = sys.argv[1]
    loaded = load_model(gguf, dtype=torch.bfloat16, device=torch.device("cuda"), quiet=True)
    mt = chat_ids(loaded[2], load_prompts("mtbench", 80))
    eagle = str(shipped_head(gguf, "eagle3"))
    configs = [("no-spec", None),
               ("ngram-k3", {"method": "ngram", "num_speculative_tokens": 3}),
               ("ngram-k8", {"method": "ngram", "num_speculative_tokens": 8}),
               ("eagle3-k3", {"method": "eagle3", "model": eagle, "num_speculative_tokens": 3}),
               ("eagle3-k5", {"method": "eagle3", "model": eagle, "num_speculative_tokens": 5})]
    for name, spec in configs:
        eng = LLMEngine.from_args(gguf, loaded=loaded, device="cuda", dtype="bfloat16",
                                  speculative_config=spec, max_num_seqs=8, num_kv_blocks=2048,
                                  enable_prefix_caching=False, quiet=True)
        run_engine(eng, mt[:2], 1, 128)  # warm-up: every graph of the run captured
        print("=====", name, flush=True)
        print(request_listing(eng, mt[:1], 128), flush=True)
        del eng


if __name__ == "__main__":
    main()
