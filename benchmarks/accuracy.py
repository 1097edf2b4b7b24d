"""GPU accuracy checks: precision against CPU fp32, and speculation's output against none.

Precision: greedy output of the GPU's dtypes against CPU fp32. Speculation's exactness: greedy
output with speculation against the same engine without it. Prints what it finds and writes
JSON.

    python benchmarks/accuracy.py --gguf PATH [--out DIR] [--sections check,spec_exact]

Sections
  check       greedy GPU output (bf16; fp32; bf16 weights + fp32 activations over an fp32 and a
              bf16 KV pool; HF bf16) vs CPU fp32 output (first 64 tokens) on MT-bench/HumanEval
              prompts, and the mixed modes' batch-1 speed
  spec_exact  greedy output with speculation (EAGLE-3, MTP, n-gram; verified for real) against
              the same engine without it, on the GPU in bf16 and fp32, one request at a time and
              20 at once: how often the two differ, and where

--out: a folder (the JSON is gpu_accuracy.json there) or a .json file. --ablate NAME turns one
KernelOptions switch off for every engine of the run. On the CPU the same comparisons are tests
(tests/, fp32 against HF transformers, speculation against none).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (PREFIX_CACHING, add_ablate_arg, check_sections,  # noqa: E402
                               device_name, drop_script_folder, kernel_options, make_heads,
                               out_file, prompt_set, run_engine, run_sections, write_result)


def section_check(args, results):
    from outpace import LLM, SamplingParams
    n = args.check_prompts
    opts = args.kernel_options
    gpu = LLM(args.gguf, device="cuda", dtype="bfloat16", quiet=True, kernel_options=opts)
    prompts = prompt_set(gpu.tokenizer, n)
    sp = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    g = [o.token_ids for o in gpu.generate(prompts, sp)]
    del gpu
    g32 = LLM(args.gguf, device="cuda", dtype="float32", quiet=True, kernel_options=opts)
    g_fp32 = [o.token_ids for o in g32.generate(prompts, sp)]
    del g32
    # bf16 weights, fp32 activations and KV cache (weight_dtype): the weights' memory and
    # bandwidth of bf16 with fp32 arithmetic; then the same over a bf16 KV pool
    # (kv_cache_dtype): bf16's memory for weights and cache alike.
    g_mixed, speed = {}, {}
    for kv in ("auto", "bfloat16"):
        mixed = LLM(args.gguf, device="cuda", dtype="float32", weight_dtype="bfloat16",
                    kv_cache_dtype=kv, quiet=True, enable_prefix_caching=PREFIX_CACHING,
                    kernel_options=opts)
        g_mixed[kv] = [o.token_ids for o in mixed.generate(prompts, sp)]
        # Its speed at batch 1 (throughput.py's smol no-spec row is the bf16 one).
        run_engine(mixed.engine, prompts[:args.batch1_requests], 1, 4)
        r = run_engine(mixed.engine, prompts[:args.batch1_requests], 1, args.max_tokens)
        speed[kv] = {k: r[k] for k in ("tok_s", "tpot_ms", "ttft_ms")}
        del mixed
    # The engines' KV pools go back to the device before HF runs: with them still allocated,
    # HF's cuDNN attention fails to run.
    import gc
    gc.collect()
    torch.cuda.empty_cache()
    torch.set_num_threads(min(16, os.cpu_count() or 1))
    cpu = LLM(args.gguf, device="cpu", dtype="float32", quiet=True, kernel_options=opts)
    c = [o.token_ids for o in cpu.generate(prompts, sp)]
    try:
        hf_bf16 = hf_greedy(args.gguf, prompts, 64)
    except RuntimeError as e:  # keep outpace's comparisons
        print("HF bf16 greedy failed:", repr(e), flush=True)
        hf_bf16 = None

    def compare(x):
        same = [a == b for a, b in zip(x, c)]
        first = [next((i for i, (u, v) in enumerate(zip(a, b)) if u != v), min(len(a), len(b)))
                 for a, b in zip(x, c)]
        return {"identical_64": sum(same), "fraction": sum(same) / n,
                "first_divergence_of_others": [d for d, s in zip(first, same) if not s]}

    results["check"] = {"prompts": n, "reference": "outpace CPU fp32 (== HF fp32, tested in CI)",
                        "outpace_gpu_bf16": compare(g), "outpace_gpu_fp32": compare(g_fp32),
                        "outpace_gpu_bf16_weights_fp32_activations": compare(g_mixed["auto"]),
                        "outpace_gpu_bf16_weights_bf16_kv_fp32_activations":
                            compare(g_mixed["bfloat16"]),
                        "hf_gpu_bf16_eager": compare(hf_bf16) if hf_bf16 else "failed",
                        "bf16_weights_fp32_activations_b1": speed["auto"],
                        "bf16_weights_bf16_kv_fp32_activations_b1": speed["bfloat16"]}
    print("check:", results["check"], flush=True)


def section_spec_exact(args, results):
    """Greedy output with speculation against the same engine without it, on the GPU. The CPU
    tests find the two equal in fp32 (a row's sums may move by ~1e-7 with the step's row count
    there, too little to flip a token in them). On the GPU a verify step's rows go through
    launches of k + 1 rows a request
    where a plain decode step's row goes through a one-row launch, and the few-row kernels
    choose their layout (and so their order of summation) from the row count: a logit can
    differ in its last bits, and where two logits nearly tie a token can flip. This measures
    how often that happens. The random heads are verified for real (no force-accept): nearly
    all their drafts are rejected, so nearly every token comes from row 0 of a verify step."""
    from outpace import LLM, SamplingParams
    tmp = tempfile.mkdtemp()
    eagle, mtp = make_heads(args.gguf, tmp)
    specs = [("eagle3-k2", {"method": "eagle3", "model": str(eagle),
                            "num_speculative_tokens": 2}),
             ("mtp-k2", {"method": "mtp", "model": str(mtp), "num_speculative_tokens": 2,
                         "mtp_mode": "eagle"}),
             ("ngram-k4", {"method": "ngram", "num_speculative_tokens": 4})]
    n, max_tokens = args.check_prompts, args.max_tokens
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    out = {"prompts": n, "max_tokens": max_tokens}
    for dtype in ("bfloat16", "float32"):
        for seqs in (1, n):
            rows = {}
            ref = None
            for name, spec in [("no-spec", None)] + specs:
                llm = LLM(args.gguf, device="cuda", dtype=dtype, speculative_config=spec,
                          max_num_seqs=seqs, quiet=True, enable_prefix_caching=PREFIX_CACHING,
                          kernel_options=args.kernel_options)
                prompts = prompt_set(llm.tokenizer, n)
                got = [o.token_ids for o in llm.generate(prompts, sp)]
                stats = llm.engine.stats()["spec"]
                del llm
                if ref is None:
                    ref = got
                    continue
                first = [next((i for i, (u, v) in enumerate(zip(a, b)) if u != v),
                              min(len(a), len(b))) for a, b in zip(got, ref)]
                drafts = stats.get("num_drafts") or 0
                rows[name] = {
                    "identical": sum(a == b for a, b in zip(got, ref)),
                    "identical_64": sum(a[:64] == b[:64] for a, b in zip(got, ref)),
                    "first_divergence_of_others": [d for d, a, b in zip(first, got, ref)
                                                   if a != b],
                    "mean_acceptance_length": (round(1 + stats["num_accepted_tokens"] / drafts,
                                                     3) if drafts else None)}
            out[f"{dtype}_max_num_seqs_{seqs}"] = rows
            print(f"spec_exact {dtype} max_num_seqs={seqs}:", rows, flush=True)
    results["spec_exact"] = out


def hf_greedy(gguf, prompts, max_tokens):
    """HF transformers bf16 eager greedy on the GPU, one prompt at a time (no padding)."""
    from transformers import AutoModelForCausalLM
    p = Path(gguf)
    model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name,
                                                 dtype=torch.bfloat16).cuda().eval()
    out = []
    with torch.inference_mode():
        for ids in prompts:
            o = model.generate(torch.tensor([ids]).cuda(), max_new_tokens=max_tokens,
                               do_sample=False, eos_token_id=None, pad_token_id=0)
            out.append(o[0, len(ids):].tolist())
    del model
    torch.cuda.empty_cache()
    return out


SECTIONS = {"check": section_check, "spec_exact": section_spec_exact}


def save(args, results) -> None:
    """Write what is checked so far (after each section)."""
    write_result(out_file(args.out, "gpu_accuracy.json"), {
        "benchmark": "gpu_accuracy", "device": device_name("cuda"),
        "torch": torch.__version__, "model": "smollm2-135m (Q4_1 GGUF -> bf16)",
        "max_tokens": args.max_tokens, "prefix_caching": PREFIX_CACHING,
        "ablate": args.ablate, **results})


def main():
    drop_script_folder()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--out", default="benchmarks/results",
                    help="a folder (gpu_accuracy.json there) or a .json file")
    ap.add_argument("--sections", default="check,spec_exact",
                    help=f"comma-separated, of: {', '.join(SECTIONS)}")
    ap.add_argument("--check-prompts", type=int, default=20,
                    help="prompts compared (check), and the requests at once (spec_exact)")
    ap.add_argument("--max-tokens", type=int, default=128,
                    help="spec_exact: tokens compared; check: tokens of its batch-1 speed runs "
                         "(its comparison is over 64)")
    ap.add_argument("--batch1-requests", type=int, default=4,
                    help="check: requests of the mixed modes' batch-1 speed runs")
    add_ablate_arg(ap)
    args = ap.parse_args()
    names = args.sections.split(",")
    check_sections(ap, names, SECTIONS)
    args.kernel_options = kernel_options(ap, args.ablate)
    results = {}
    run_sections(args, names, SECTIONS, results, save)
    if "check" in results:
        print("bf16 GPU vs fp32 CPU:", results["check"])
    if "spec_exact" in results:
        print("speculation vs none:", results["spec_exact"])


if __name__ == "__main__":
    main()
