"""A short prompt's prefill with and without the mid-row Triton projections (llama's
MID_ROW_KERNELS: qkv + rope + KV store, o_proj and gate_up + silu * mul as Triton kernels for
17..256 rows instead of cuBLAS + the rope and silu kernels), on the GPU machine: batch-1 TTFT,
tok/s and the prefill step's wall time (host and device), no-spec and EAGLE-3 k = 2
force-accept 3, the two settings in turn (off, on, off, on) so that drift shows. Other batch
sizes (--batches) add their tok/s: there a decode or verify step of 17..256 rows (no-spec
batch 32 and 128, EAGLE-3's 3-row verify at batch 6..85) takes the kernels too. EAGLE-3 drafts
one token at batch 128 (the benchmark's k schedule). --variants adds the short-prefill
attention tiles (triton_paged._SHORT_PREFILL_Q): "off" (neither), "mid" (the projections only),
"mid+attn" (both); the default compares off and mid.

    python benchmarks/diag_mid_rows.py --gguf PATH [--out DIR] [--rounds 2] [--batches 1,32]
        [--variants off,mid,mid+attn]
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import diag_setup, make_heads, run_engine  # noqa: E402
from benchmarks.common import graph_ms as gpu_ms  # noqa: E402
from benchmarks.archive.diag_request import prefill_phases  # noqa: E402


def main():
    args, loaded, prompts = diag_setup(256, extra=(("--rounds", "2"), ("--batches", "1"),
                                                   ("--variants", "off,mid")))
    import outpace.attention.triton_paged as tp
    short_q = tp._SHORT_PREFILL_Q
    batches = [int(b) for b in args.batches.split(",")]
    import outpace.models.llama as llama
    from outpace.engine.engine import LLMEngine
    eagle, _ = make_heads(args.gguf, tempfile.mkdtemp())
    engines = [("no-spec", None),
               ("eagle3-fa3-k2", {"method": "eagle3", "model": str(eagle),
                                  "num_speculative_tokens": 2, "force_accept_mean": 3.0,
                                  "k_schedule": [[32, 2], [128, 1]]})]
    rows = []
    for rnd in range(int(args.rounds)):
        for variant in args.variants.split(","):
            mid = variant != "off"
            llama.MID_ROW_KERNELS = mid
            tp._SHORT_PREFILL_Q = short_q if variant == "mid+attn" else 0
            tp.choose_tiles.cache_clear()
            for name, spec in engines:
                eng = LLMEngine.from_args(args.gguf, loaded=loaded, device="cuda",
                                          dtype="bfloat16", speculative_config=spec,
                                          max_num_seqs=max(max(batches), 8),
                                          num_kv_blocks=6144, quiet=True,
                                          enable_prefix_caching=False)
                run_engine(eng, prompts[:2], 1, 16)
                r = run_engine(eng, prompts[:4], 1, 128)
                ph = prefill_phases(eng, prompts[4:8])
                row = {"round": rnd, "variant": variant, "mid_row_kernels": mid, "engine": name,
                       "tok_s": r["tok_s"], "ttft_ms": r["ttft_ms"], "tpot_ms": r["tpot_ms"],
                       "prefill_step_us": ph["first_step_us"], "prefill_q": ph["prefill_q"],
                       "collect_us": ph["host_us_per_prefill"].get("FusedStep.collect")}
                for b in batches:
                    if b == 1:
                        continue
                    run_engine(eng, prompts[:b], b, 4)
                    rb = run_engine(eng, prompts[:2 * b], b, 128)
                    row[f"b{b}"] = {k: rb.get(k) for k in ("tok_s", "ttft_ms", "tpot_ms",
                                                          "step_ms")}
                # every bucket's steady (chained) decode graph, GPU time without the host
                row["graph_ms"] = {f"b{key[0]}_q{key[1]}": gpu_ms(g) for key, (g, _)
                                   in sorted(eng.runner.fused._captured.items()) if key[3]}
                rows.append(row)
                print(row, flush=True)
                del eng
                torch.cuda.empty_cache()
    llama.MID_ROW_KERNELS = True
    tp._SHORT_PREFILL_Q = short_q
    tp.choose_tiles.cache_clear()
    (Path(args.out) / "diag_mid_rows.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
