"""outpace on CPU, side by side, on the default model.

    python benchmarks/bench_cpu.py [--max-tokens 128] [--batch-sizes 1 8] [--out FILE]
    python benchmarks/bench_cpu.py --spec [--spec-configs eagle3-k2,mtp-k1,...]

Default: outpace vs HF transformers (eager): the same chat prompts (MT-bench first turns),
greedy, a fixed number of new tokens per request (EOS ignored) for both systems; writes
benchmarks/results/latest/cpu_smollm2.json.
--spec: outpace without speculation against the shipped EAGLE-3 and MTP heads (real
acceptance), batch 1, fp32, greedy to EOS or --max-tokens (the outputs are the same, so the
token counts are too), in rounds that alternate the configurations; writes
benchmarks/results/latest/cpu_smollm2_spec.json.
Tokens/s = new tokens / wall time, prefill included. Prints a table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import HERE, device_name, load_prompts, print_table, write_result  # noqa: E402


def chat_ids(tokenizer, prompts):
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                           add_generation_prompt=True),
                             add_special_tokens=False) for p in prompts]


def run_outpace(llm, ids_list, batch, max_tokens):
    from outpace import SamplingParams
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    n_tok, t0 = 0, time.perf_counter()
    for i in range(0, len(ids_list), batch):
        outs = llm.generate(ids_list[i:i + batch], sp)
        n_tok += sum(len(o.token_ids) for o in outs)
    return n_tok, time.perf_counter() - t0


def run_hf(model, ids_list, batch, max_tokens, pad_id):
    n_tok, t0 = 0, time.perf_counter()
    for i in range(0, len(ids_list), batch):
        chunk = ids_list[i:i + batch]
        width = max(len(x) for x in chunk)
        inp = torch.tensor([[pad_id] * (width - len(x)) + x for x in chunk])  # left padding
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in chunk])
        with torch.inference_mode():
            out = model.generate(inp, attention_mask=mask, max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad_id)
        n_tok += (out.shape[1] - width) * len(chunk)
    return n_tok, time.perf_counter() - t0


def spec_section(a) -> None:
    """No speculation against the shipped heads at batch 1, alternating round by round."""
    import statistics

    from outpace import LLM, SamplingParams
    from outpace.models.loader import load_model
    loaded = load_model("smollm2-135m", dtype=torch.float32, device=torch.device("cpu"),
                        quiet=True)
    configs = {"no-spec": None}
    for name in a.spec_configs.split(","):
        method, k = name.rsplit("-k", 1)
        configs[name] = {"method": method, "num_speculative_tokens": int(k)}
    llms = {n: LLM("smollm2-135m", device="cpu", dtype="float32", speculative_config=c,
                   quiet=True, loaded=loaded) for n, c in configs.items()}
    ids_list = chat_ids(loaded[2], load_prompts("mtbench", a.num_prompts))
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0)
    for llm in llms.values():  # warm-up
        llm.generate(ids_list[:1], SamplingParams(max_tokens=8, temperature=0.0))
    runs = {n: [] for n in llms}
    outputs, acc = {}, {}
    for rnd in range(a.rounds):
        for n, llm in (list(llms.items())[rnd % len(llms):] + list(llms.items())[:rnd % len(llms)]):
            t0, n_tok, drafts, accepted = time.perf_counter(), 0, 0, 0
            outs = []
            for ids in ids_list:
                o = llm.generate([ids], sp)[0]
                n_tok += len(o.token_ids)
                outs.append(o.token_ids)
                if o.spec_stats is not None:
                    drafts += o.spec_stats.num_drafts
                    accepted += o.spec_stats.num_accepted_tokens
            runs[n].append(n_tok / (time.perf_counter() - t0))
            outputs[n] = outs
            acc[n] = round(1 + accepted / drafts, 3) if drafts else None
        print(f"round {rnd}:", {n: round(v[-1], 1) for n, v in runs.items()}, flush=True)
    med = {n: statistics.median(v) for n, v in runs.items()}
    rows = [{"config": n, "tok_s": round(med[n], 1), "vs_no_spec": round(med[n] / med["no-spec"], 3),
             "mean_acceptance_length": acc[n],
             "same_output_as_no_spec": outputs[n] == outputs["no-spec"],
             "tok_s_runs": [round(x, 1) for x in runs[n]]} for n in llms]
    print_table(rows, ["config", "tok_s", "vs_no_spec", "mean_acceptance_length",
                       "same_output_as_no_spec"])
    out = a.out if a.out != str(HERE / "results" / "latest" / "cpu_smollm2.json") else \
        str(HERE / "results" / "latest" / "cpu_smollm2_spec.json")
    path = write_result(Path(out), {
        "benchmark": "cpu_spec_vs_no_spec", "device": device_name("cpu"),
        "threads": torch.get_num_threads(), "model": "smollm2-135m (Q4_1 GGUF, dequantized fp32)",
        "heads": "shipped (outpace/heads)", "dtype": "float32", "batch": 1,
        "prompts": f"mtbench first {a.num_prompts}", "max_tokens": a.max_tokens,
        "rounds": a.rounds, "greedy": True, "results": rows})
    print(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=str(HERE / "results" / "latest" / "cpu_smollm2.json"))
    ap.add_argument("--spec", action="store_true", help="no-spec vs the shipped heads")
    ap.add_argument("--spec-configs", default="eagle3-k1,eagle3-k2,eagle3-k3,mtp-k1,mtp-k2")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.spec:
        return spec_section(a)

    from transformers import AutoModelForCausalLM

    from outpace import LLM
    from outpace.models.catalog import resolve_model

    gguf = resolve_model("smollm2-135m")
    llm = LLM("smollm2-135m", device="cpu", dtype="float32", quiet=True)
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                              dtype=torch.float32).eval()
    prompts = load_prompts("mtbench", a.num_prompts)
    ids_list = chat_ids(llm.tokenizer, prompts)
    pad = llm.tokenizer.eos_token_ids[0]

    # Warm-up both (first calls allocate and pick kernels).
    run_outpace(llm, ids_list[:1], 1, 8)
    run_hf(hf, ids_list[:1], 1, 8, pad)

    rows = []
    for bs in a.batch_sizes:
        n = max(bs, a.num_prompts if bs == 1 else bs)
        sub = (ids_list * ((n + len(ids_list) - 1) // len(ids_list)))[:n]
        if bs == 1:
            sub = sub[:min(len(sub), 4)]
        o_tok, o_s = run_outpace(llm, sub, bs, a.max_tokens)
        h_tok, h_s = run_hf(hf, sub, bs, a.max_tokens, pad)
        o_tps, h_tps = o_tok / o_s, h_tok / h_s
        rows.append({"batch": bs, "requests": len(sub), "outpace_tok_s": round(o_tps, 1),
                     "hf_eager_tok_s": round(h_tps, 1), "ratio": round(o_tps / h_tps, 2)})
        print(rows[-1], flush=True)

    print_table(rows, ["batch", "requests", "outpace_tok_s", "hf_eager_tok_s", "ratio"])
    path = write_result(Path(a.out), {
        "benchmark": "cpu_outpace_vs_hf", "device": device_name("cpu"),
        "threads": torch.get_num_threads(), "model": "smollm2-135m (Q4_1 GGUF, dequantized fp32)",
        "dtype": "float32", "max_tokens": a.max_tokens, "greedy": True, "k": 0, "results": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
