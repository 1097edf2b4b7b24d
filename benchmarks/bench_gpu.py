"""The GPU benchmark: checks, then outpace (with and without speculation) and HF transformers side
by side, in one run. Prints a table last and writes JSON.

    python benchmarks/bench_gpu.py --gguf PATH [--out DIR] [--sections check,smol,hf,big]

Sections
  check   greedy GPU output (bf16; fp32; bf16 weights + fp32 activations over an fp32 and a bf16
          KV pool; HF bf16) vs CPU fp32 output (first 64 tokens) on MT-bench/HumanEval
          prompts, and the mixed modes' batch-1 speed
  smol    SmolLM2-135M: outpace no-spec, ngram, suffix, EAGLE-3 and MTP random heads with
          force-accept at mean acceptance length 2/3/4; batch 1, 8, 32, 128
  hf      HF transformers eager and static cache + torch.compile (batch 1; eager also at 8)
  big     Llama-3.1-8B-shaped random bf16 model, batch 1: step time vs weight bytes / bandwidth,
          with and without overlap
  b128    batch 128, no-spec against the force-accept 3 heads (EAGLE-3 k = 4 and 2, MTP; EAGLE-3
          with the schedule at one draft up to 128 requests), the engines timed in turns round
          by round (host-bound there: a fair pairing)
  overlap SmolLM2-shaped random bf16 model, batch 1, no-spec and EAGLE-3 force-accept 3, with
          and without overlap, and with the qkv + rope + KV store kernel switched the other way
          (no model file needed)
  spec_exact  greedy output with speculation (EAGLE-3, MTP, n-gram; verified for real) against
          the same engine without it, on the GPU in bf16 and fp32, one request at a time and
          20 at once: how often the two differ, and where
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import device_name, load_prompts, print_table, write_result  # noqa: E402


# Timed engines run without prefix caching. The warm-up runs use the timed prompts, so with it
# the timed runs would prefill only each prompt's last partial block: tok/s would leave most of
# the prefill out (HF's includes all of it), and the tail prefill's new shapes would compile
# Triton kernels inside the first config's timed runs.
PREFIX_CACHING = False


def chat_ids(tok, prompts):
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}],
                                               add_generation_prompt=True),
                       add_special_tokens=False) for p in prompts]


def prompt_set(tok, n):
    mt = load_prompts("mtbench", 80)
    he = load_prompts("humaneval", 164)
    mixed = [p for pair in zip(mt, he) for p in pair] + he[80:]
    return chat_ids(tok, mixed[:n])


def diag_setup(num_prompts: int, extra: tuple = ()):
    """The start of a GPU diagnostic script (benchmarks/diag_*.py): the options --gguf, --out and
    `extra` ((flag, default) pairs), the model in bf16 on CUDA, the first prompts of the
    benchmark's set -> (args, loaded (model, config, tokenizer), prompts)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--out", default="/tmp/out")
    for flag, default in extra:
        ap.add_argument(flag, default=default)
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    from outpace.models.loader import load_model
    loaded = load_model(args.gguf, dtype=torch.bfloat16, device=torch.device("cuda"), quiet=True)
    return args, loaded, prompt_set(loaded[2], num_prompts)


def run_engine(engine, prompts, batch, max_tokens, temperature: float = 0.0,
               top_p: float = 1.0, penalties: dict = None):
    """Submit `batch` requests at once, repeatedly, over `prompts`; -> metrics dict.
    temperature > 0: sampled (unseeded) at that temperature and top_p. penalties: the
    requests' repetition / frequency / presence penalties (SamplingParams fields)."""
    from outpace import SamplingParams
    # Offline generation, as HF's generate and LLM.generate: only final outputs (per-step
    # outputs cost host time every batch-128 step; docs/decisions.md, "Offline generation
    # returns only final outputs")
    sampled = dict(temperature=temperature, top_p=top_p) if temperature > 0 else \
        dict(temperature=0.0)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, output_kind="final_only",
                        **sampled, **(penalties or {}))
    spec0 = dict(engine.stats()["spec"])
    fused = engine.runner.fused
    fused0 = (fused.replays, dict(fused.timing)) if fused is not None else None
    n_tok, tpots, ttfts, t0 = 0, [], [], time.perf_counter()
    step_s, steps = 0.0, 0
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        for j, p in enumerate(chunk):
            engine.add_request(f"r{i}-{j}-{time.monotonic_ns()}", p, sp)
        while engine.has_unfinished_requests():
            ts = time.perf_counter()
            outs = engine.step()
            step_s += time.perf_counter() - ts
            steps += 1
            for o in outs:
                if o.finished:
                    n = len(o.token_ids)
                    n_tok += n
                    m = o.metrics
                    if n > 1 and m.get("first_token_time"):
                        tpots.append((m["finished_time"] - m["first_token_time"]) / (n - 1))
                    if m.get("first_token_time") and m.get("arrival_time"):
                        ttfts.append(m["first_token_time"] - m["arrival_time"])
    wall = time.perf_counter() - t0
    spec1 = engine.stats()["spec"]
    drafts = spec1["num_drafts"] - spec0["num_drafts"]
    acc = spec1["num_accepted_tokens"] - spec0["num_accepted_tokens"]
    per_pos = [b - (spec0["accepted_per_position"][i] if i < len(spec0["accepted_per_position"]) else 0)
               for i, b in enumerate(spec1["accepted_per_position"])]
    timing = {}
    if fused0 is not None and fused.replays > fused0[0]:
        n = fused.replays - fused0[0]
        timing = {"fused_steps": n, "all_steps": steps,
                  "step_ms": round(1000 * step_s / steps, 4),
                  **{k.replace("_s", "_ms"): round(1000 * (v - fused0[1][k]) / n, 4)
                     for k, v in fused.timing.items()}}
    return {**timing, "tokens": n_tok, "wall_s": round(wall, 3), "tok_s": round(n_tok / wall, 1),
            "tpot_ms": round(1000 * sum(tpots) / max(1, len(tpots)), 3),
            "ttft_ms": round(1000 * sum(ttfts) / max(1, len(ttfts)), 3),
            "mean_acceptance_length": round(1 + acc / drafts, 3) if drafts else None,
            "acceptance_per_position": [round(v / drafts, 3) for v in per_pos] if drafts else []}


def smollm2_shaped(tmp: Path):
    """A SmolLM2-135M-shaped model with random bf16 weights on CUDA and a random EAGLE-3 head
    for it (no model file needed) -> (model, ModelConfig, head folder)."""
    import json
    from outpace.config import ModelConfig
    import outpace.models.llama as llama
    from outpace.models.draft_loader import model_config_dict
    from outpace.training.init_draft import init_draft
    cfg = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576,
                      intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                      tie_word_embeddings=True, max_position_embeddings=8192, eos_token_ids=())
    model = llama.LlamaForCausalLM(cfg, dtype=torch.bfloat16, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for prm in model.parameters():
            prm.normal_(0.0, 0.02, generator=g) if prm.dim() > 1 else prm.fill_(1.0)
    (tmp / "target").mkdir()
    (tmp / "target" / "config.json").write_text(json.dumps(model_config_dict(cfg)))
    eagle = init_draft("eagle3", str(tmp / "target"), tmp / "eagle3", seed=0, quiet=True)
    return model, cfg, eagle


def section_overlap(args, results):
    """Overlap on and off, batch 1, on a SmolLM2-shaped model with random bf16 weights (no
    model file needed): no speculation and an EAGLE-3 random head at force-accept 3."""
    from outpace.engine.engine import LLMEngine
    from outpace.kernels import pdl
    model, cfg, eagle = smollm2_shaped(Path(tempfile.mkdtemp()))
    prompt = list(range(100, 228))
    rows = []
    default_fused_qkv = args.kernel_options.fused_qkv_rope_store
    for name, spec in [("no-spec", None),
                       ("eagle3-fa3.0", {"method": "eagle3", "model": str(eagle),
                                         "num_speculative_tokens": args.k,
                                         "force_accept_mean": 3.0})]:
        # overlap off and on (the defaults otherwise); then overlap on with one switch turned
        # the other way, to measure it: the qkv projection's rope + KV store epilogue
        # (KernelOptions.fused_qkv_rope_store), and programmatic dependent launch (.pdl)
        for overlap, fused_qkv, use_pdl in ((False, default_fused_qkv, True),
                                            (True, default_fused_qkv, True),
                                            (True, not default_fused_qkv, True),
                                            (True, default_fused_qkv, False)):
            opts = dataclasses.replace(args.kernel_options, fused_qkv_rope_store=fused_qkv,
                                       pdl=use_pdl)
            eng = LLMEngine.from_args("smollm2-shaped", loaded=(model, cfg, _NullTokenizer()),
                                      device="cuda", dtype="bfloat16", max_num_seqs=8,
                                      num_kv_blocks=1024, max_model_len=2048, quiet=True,
                                      speculative_config=spec, overlap=overlap,
                                      enable_prefix_caching=PREFIX_CACHING,
                                      kernel_options=opts)
            run_engine(eng, [prompt], 1, 16)
            r = run_engine(eng, [prompt] * 2, 1, args.max_tokens)
            fused = eng.runner.fused
            r.update(config=name, overlap=overlap, chained=fused.chained if fused else 0,
                     fused_qkv_rope_store=fused_qkv, pdl=use_pdl and pdl.supported(
                         torch.device("cuda")))
            if overlap:  # the graph alone, and where its time goes
                kk = args.k if spec else 0
                r["graph_ms"] = time_fused_graphs(eng, [1], kk).get(1)
                tag = ("_qkvrope" if fused_qkv else "_noqkvrope") \
                    if fused_qkv != default_fused_qkv else ("" if use_pdl else "_nopdl")
                defer_profile(profile_graph, eng, kk,
                              Path(args.out) / f"profile_shaped_{name}{tag}_b1.txt")
            rows.append(r)
            print("overlap:", r, flush=True)
            del eng
            torch.cuda.empty_cache()
    results["overlap"] = rows


def section_check(args, results):
    from outpace import LLM, SamplingParams
    n = args.check_prompts
    gpu = LLM(args.gguf, device="cuda", dtype="bfloat16", quiet=True,
              kernel_options=args.kernel_options)
    prompts = prompt_set(gpu.tokenizer, n)
    sp = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    g = [o.token_ids for o in gpu.generate(prompts, sp)]
    del gpu
    g32 = LLM(args.gguf, device="cuda", dtype="float32", quiet=True)
    g_fp32 = [o.token_ids for o in g32.generate(prompts, sp)]
    del g32
    # bf16 weights, fp32 activations and KV cache (weight_dtype): the weights' memory and
    # bandwidth of bf16 with fp32 arithmetic; then the same over a bf16 KV pool
    # (kv_cache_dtype): bf16's memory for weights and cache alike.
    g_mixed, speed = {}, {}
    for kv in ("auto", "bfloat16"):
        mixed = LLM(args.gguf, device="cuda", dtype="float32", weight_dtype="bfloat16",
                    kv_cache_dtype=kv, quiet=True, enable_prefix_caching=PREFIX_CACHING)
        g_mixed[kv] = [o.token_ids for o in mixed.generate(prompts, sp)]
        # Its speed at batch 1 (the smol section's no-spec row is the bf16 one).
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
    cpu = LLM(args.gguf, device="cpu", dtype="float32", quiet=True)
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
                          max_num_seqs=seqs, quiet=True, enable_prefix_caching=PREFIX_CACHING)
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


def make_heads(gguf, tmp):
    from outpace.training.init_draft import init_draft
    eagle = Path(tmp) / "eagle3"
    mtp = Path(tmp) / "mtp"
    init_draft("eagle3", gguf, eagle, seed=0, quiet=True)
    init_draft("mtp", gguf, mtp, seed=0, quiet=True)
    return eagle, mtp


def make_eagle3_reduced(gguf, tmp, draft_vocab_size: int = 32000) -> Path:
    """A random EAGLE-3 head over a reduced draft vocabulary (d2t maps it to target ids): the
    shape trained EAGLE-3 heads have (32000 draft ids: the EAGLE authors' Llama-3.1-8B head,
    of 128256, and SpecForge's default). Its LM head reads 32000 x H weights a draft step
    instead of the whole vocabulary's."""
    from outpace.training.init_draft import init_draft
    out = Path(tmp) / f"eagle3_dv{draft_vocab_size}"
    init_draft("eagle3", gguf, out, seed=0, quiet=True, draft_vocab_size=draft_vocab_size)
    return out


EAGER_MIXED = "@eager-mixed"
# "<config>@general-path": steps with penalized or logprobs requests on the general path (the
# engine before penalties and logprobs were in the fused graphs; older result files name it
# "@general-penalties")
GENERAL_PATH = "@general-path"
# "<config>@torch-logprobs": logprobs through torch's log_softmax and topk instead of
# kernels/logprobs.py, in the graphs and on the general path
TORCH_LOGPROBS = "@torch-logprobs"
# "<config>@old3": the few-row projections' previous launch policy at 3 rows (one-warp
# broadcast programs, K read 512 + 64) instead of a warp a row, for that engine's graphs
OLD3 = "@old3"
# "<config>@noprime": no PDL prime before any graph replayed from the host (kernels/pdl.prime
# off)
NOPRIME = "@noprime"
ARM_ABLATIONS = {TORCH_LOGPROBS: "triton_logprobs", OLD3: "row_warps_3",
                 NOPRIME: "pdl_prime"}


def arm_options(name: str, base):
    """The KernelOptions of a configuration: the run's (--ablate), with the switch its
    "@..." suffix names turned off."""
    for suffix, ablation in ARM_ABLATIONS.items():
        if name.endswith(suffix):
            return base.ablate(ablation)
    return base


def smol_configs(k, force_means, eagle, mtp, eagle_reduced=None) -> list:
    """The SmolLM2 section's (name, speculative_config) pairs; eagle_reduced (a head from
    make_eagle3_reduced) adds its force-accept 3, k = 2 row."""
    configs = [("no-spec", None), ("ngram", {"method": "ngram", "num_speculative_tokens": k}),
               ("suffix", {"method": "suffix", "num_speculative_tokens": k})]
    # k = 1 up to 128 requests, none above. At batch 128 a head engine that drafts nothing is
    # slower than no-spec (every step still runs the head's first pass, and every prefill its
    # pass over the prompts), and one that drafts one token is not (decisions-log.md, "The
    # benchmark's head configurations draft one token at 65-128 requests").
    sched = {"k_schedule": [[32, k], [128, 1]]}
    for m in force_means:
        configs.append((f"eagle3-fa{m}", {"method": "eagle3", "model": str(eagle),
                                          "num_speculative_tokens": k, "force_accept_mean": m,
                                          **sched}))
    configs.append(("mtp-fa3", {"method": "mtp", "model": str(mtp), "num_speculative_tokens": k,
                                 "force_accept_mean": 3.0, **sched}))
    # Mean acceptance length 3 at k = 2: both drafts accepted every step, the k a deployment
    # would tune to when the third and fourth drafts are never accepted (at k = 4 they are
    # drafted and verified for nothing).
    configs.append(("eagle3-fa3-k2", {"method": "eagle3", "model": str(eagle),
                                      "num_speculative_tokens": 2, "force_accept_mean": 3.0,
                                      "k_schedule": [[32, 2], [128, 1]]}))
    if eagle_reduced is not None:
        configs.append(("eagle3-dv32k-fa3-k2", {"method": "eagle3", "model": str(eagle_reduced),
                                                "num_speculative_tokens": 2,
                                                "force_accept_mean": 3.0,
                                                "k_schedule": [[32, 2], [128, 1]]}))
    # The same heads drafting from an int8 copy of their LM head (draft_lm_head_dtype): the
    # largest read of a draft step at half the bytes
    for name, cfg in list(configs[-2:] if eagle_reduced is not None else configs[-1:]):
        configs.append((f"{name}-int8lm", {**cfg, "draft_lm_head_dtype": "int8"}))
    return configs


def model_free_variants(k) -> list:
    """The model-free drafters at k = 2 and with the adaptive per-request k (up to k): run only
    when named in --configs (how much of their slowdown on chat prompts the draft length is)."""
    out = []
    for method in ("ngram", "suffix"):
        out.append((f"{method}-k2", {"method": method, "num_speculative_tokens": 2}))
        out.append((f"{method}-adaptive", {"method": method, "num_speculative_tokens": k,
                                           "adaptive": True}))
    return out


def section_b128(args, results):
    """Batch 128, paired: no speculation and the force-accept 3 head configurations, built
    once and timed in turns, round by round (the order rotating), so that the host's slow and
    fast periods fall on every engine alike. At batch 128 every engine is host-bound, and the
    device host's speed moves by up to ~1.7x between configurations timed a minute apart
    (docs/decisions.md, "Batch 128 is compared in turns"). Reports each
    engine's median tok/s over --b128-rounds rounds and, per head configuration, the median
    of its ratio to no-spec's run of the same round."""
    from outpace.engine.engine import LLMEngine
    from outpace.models.loader import load_model
    loaded = load_model(args.gguf, dtype=torch.bfloat16, device=torch.device("cuda"), quiet=True)
    prompts = prompt_set(loaded[2], 128)
    eagle, mtp = make_heads(args.gguf, tempfile.mkdtemp())
    wanted = ("no-spec", "eagle3-fa3.0", "mtp-fa3", "eagle3-fa3-k2")
    configs = [c for c in smol_configs(args.k, [3.0], eagle, mtp) if c[0] in wanted]
    # The configurations above draft one token at batch 128 (smol_configs' schedule); this
    # one drafts none there (the earlier schedule), the head's first pass still running.
    configs.append(("eagle3-fa3-k0at128", {"method": "eagle3", "model": str(eagle),
                                           "num_speculative_tokens": args.k,
                                           "force_accept_mean": 3.0,
                                           "k_schedule": [[32, args.k], [64, 1]]}))
    engines = []
    for name, spec in configs:
        eng = LLMEngine.from_args(args.gguf, loaded=loaded, device="cuda", dtype="bfloat16",
                                  speculative_config=spec, max_num_seqs=128,
                                  num_kv_blocks=args.kv_blocks // 2, quiet=True,
                                  enable_prefix_caching=PREFIX_CACHING,
                                  kernel_options=args.kernel_options)
        run_engine(eng, prompts, 128, args.max_tokens)  # warm-up at full length
        engines.append((name, eng))
    runs = {name: [] for name, _ in engines}
    for rnd in range(args.b128_rounds):
        shift = rnd % len(engines)
        for name, eng in engines[shift:] + engines[:shift]:
            runs[name].append(run_engine(eng, prompts, 128, args.max_tokens)["tok_s"])
        print(f"b128 round {rnd}:", {n: v[-1] for n, v in runs.items()}, flush=True)
    med = statistics.median
    out = {"rounds": args.b128_rounds, "tok_s_runs": runs,
           "tok_s_median": {n: round(med(v), 1) for n, v in runs.items()},
           "ratio_to_nospec_median": {n: round(med(a / b for a, b in zip(v, runs["no-spec"])), 3)
                                      for n, v in runs.items() if n != "no-spec"}}
    results["b128_paired"] = out
    print("b128 paired:", out, flush=True)
    del engines


def section_smol(args, results):
    from outpace.engine.engine import LLMEngine
    from outpace.models.loader import load_model
    loaded = load_model(args.gguf, dtype=torch.bfloat16, device=torch.device("cuda"), quiet=True)
    prompts = prompt_set(loaded[2], max(args.batches) * 2)
    tmp = tempfile.mkdtemp()
    eagle, mtp = make_heads(args.gguf, tmp)
    configs = smol_configs(args.k, args.force_means, eagle, mtp,
                           make_eagle3_reduced(args.gguf, tmp))
    if args.configs:
        named = args.configs.split(",")
        pool = configs + model_free_variants(args.k)
        # "<config>@eager-mixed": that configuration with its varlen graphs dropped, so steps
        # of several prefill chunks (or chunks beside decodes) run eagerly
        pool += [(f"{n}{EAGER_MIXED}", c) for n, c in pool if f"{n}{EAGER_MIXED}" in named]
        pool += [(f"{n}{GENERAL_PATH}", c) for n, c in pool if f"{n}{GENERAL_PATH}" in named]
        pool += [(f"{n}{TORCH_LOGPROBS}", c) for n, c in pool
                 if f"{n}{TORCH_LOGPROBS}" in named]
        pool += [(f"{n}{OLD3}", c) for n, c in pool if f"{n}{OLD3}" in named]
        pool += [(f"{n}{NOPRIME}", c) for n, c in pool if f"{n}{NOPRIME}" in named]
        configs = [c for c in pool if c[0] in named]
    # Process warm-up: the first engine of a process otherwise pays CUDA's lazy module loading
    # and first-use kernel selection inside its timed runs (seen as slow batch-1 prefill). Full
    # length: Triton compiles a kernel variant per new integer specialization (a length that
    # becomes a multiple of 16), and a step that compiles one can take longer than a whole
    # timed run, in whichever engine meets the shape first.
    budget = ({} if args.max_num_batched_tokens is None
              else {"max_num_batched_tokens": args.max_num_batched_tokens})
    eng = LLMEngine.from_args(args.gguf, loaded=loaded, device="cuda", dtype="bfloat16",
                              max_num_seqs=max(args.batches), num_kv_blocks=args.kv_blocks,
                              quiet=True, enable_prefix_caching=PREFIX_CACHING,
                              kernel_options=args.kernel_options, **budget)
    for b in args.batches:
        run_engine(eng, prompts[:b if b > 1 else args.batch1_requests], b, args.max_tokens)
    del eng
    rows = results["smol"] = []  # filled configuration by configuration (save)
    for name, spec in configs:
        eng = LLMEngine.from_args(args.gguf, loaded=loaded, device="cuda", dtype="bfloat16",
                                  speculative_config=spec, max_num_seqs=max(args.batches),
                                  num_kv_blocks=args.kv_blocks, quiet=True,
                                  enable_prefix_caching=PREFIX_CACHING,
                                  kernel_options=arm_options(name, args.kernel_options),
                                  **budget)
        if name.endswith(EAGER_MIXED) and eng.runner.graphs is not None:
            eng.runner.graphs.varlen_graphs.clear()
        if name.endswith(GENERAL_PATH) and eng.runner.fused is not None:
            extras_off_the_graphs(eng.runner.fused)
        pen = penalties(args)
        spec_k = 0 if spec is None else spec["num_speculative_tokens"]
        # Warm-up at every batch size: Triton compiles a kernel per new tile configuration;
        # the largest batch at full length (a compile there would dwarf its short timed run).
        for b in args.batches:
            run_engine(eng, prompts[:b if b > 1 else args.batch1_requests], b,
                       args.max_tokens if b == max(args.batches) else 4, args.temperature,
                       args.top_p, pen)
        for b in args.batches:
            n = b if b > 1 else args.batch1_requests
            # The median of --reps runs: at batch 128 every engine is host-bound, and the
            # device machine's host varies from run to run (configurations running identical
            # steps there differ by up to ~1.4x, one run each).
            runs = sorted((run_engine(eng, prompts[:n], b, args.max_tokens, args.temperature,
                                      args.top_p, pen)
                           for _ in range(args.reps)), key=lambda r: r["tok_s"])
            r = runs[len(runs) // 2]
            r.update(system="outpace", config=name, batch=b, k=spec_k,
                     temperature=args.temperature, top_p=args.top_p, **pen,
                     tok_s_runs=[x["tok_s"] for x in runs],
                     graph_capture_s=round(getattr(eng.runner.graphs, "capture_s", 0.0), 2))
            rows.append(r)
            print(r, flush=True)
        # Last (it replays over finished requests' freed blocks): the fused step's graph alone.
        graph_ms = time_fused_graphs(eng, args.batches, spec_k, mode=sampling_mode(args))
        for r in rows:
            if r["config"] == name:
                r["graph_ms"] = graph_ms.get(r["batch"])
        save(args, results)  # results["smol"] is rows
        if name in ("no-spec", "eagle3-fa3.0"):
            defer_profile(profile_graph, eng, spec_k, Path(args.out) / f"profile_{name}_b1.txt",
                          20, sampling_mode(args))
            defer_profile(profile_host, eng, prompts[:args.batch1_requests], args.max_tokens,
                          Path(args.out) / f"host_profile_{name}_b1.txt")
        del eng
        torch.cuda.empty_cache()


def fused_graphs(eng, mode: str) -> dict:
    """The fused step's captured graphs of a sampling mode ("greedy", "sample", "masked")."""
    return eng.runner.fused._by_mode[mode]


def sampling_mode(args) -> str:
    """The fused graphs a run's requests replay (run_engine's SamplingParams)."""
    from outpace import SamplingParams
    from outpace.runner.fused_sampling import sampling_mode as mode_of
    sampled = dict(temperature=args.temperature, top_p=args.top_p) if args.temperature > 0 \
        else dict(temperature=0.0)
    return mode_of([SamplingParams(**sampled, **penalties(args))])


def penalties(args) -> dict:
    """The penalties and logprobs run_engine's requests ask for ({}: none)."""
    pen = {}
    if args.repetition_penalty != 1.0:
        pen["repetition_penalty"] = args.repetition_penalty
    if args.frequency_penalty != 0.0:
        pen["frequency_penalty"] = args.frequency_penalty
    if args.logprobs is not None:
        pen["logprobs"] = args.logprobs
    return pen


def extras_off_the_graphs(fused) -> None:
    """'<config>@general-path': steps with a penalized or logprobs request go to the general
    path, as an engine whose fused graphs serve neither would: the A/B's first arm."""
    accepts = fused.accepts
    fused.accepts = lambda plan: accepts(plan) and not any(
        sr.request.sampling_params.needs_penalties
        or sr.request.sampling_params.logprobs is not None for sr in plan.scheduled)


def time_fused_graphs(eng, batches, k, reps=50, mode: str = "greedy") -> dict:
    """GPU time of one replay of the fused step's graph per batch bucket -> {batch: ms}: the
    graph steady decoding replays there, at the verify length of the draft length the policy
    gives that batch (q = k_b + 1; k_b = k without a schedule). TPOT minus this is host time.
    (Timing q = k + 1 at every batch would time, where the k schedule turns drafting down, a
    graph that steady decoding does not run.)
    Each replay moves the last request's sequence on by its accepted tokens, past the blocks it
    held (their table entries read the null block), so a spec graph's time is of a longer
    context than no-spec's: 50 replays add 150 tokens at force-accept 3, against 50."""
    fused = eng.runner.fused
    out = {}
    if fused is None:
        return out
    proposer = eng.runner.proposer
    for b in batches:
        kb = proposer.policy.base_k(b) if proposer is not None and k else 0
        kd = fused.draft_steps(b)
        graphs = fused_graphs(eng, mode)
        key = next((key for key in ((b, kb + 1, kd, True), (b, kb + 1, kd, False))
                    if key in graphs), None)
        if key is None:
            continue
        graph, _ = graphs[key]
        out[b] = graph_ms(graph, reps)
    return out


def graph_ms(graph, reps: int = 50) -> float:
    """GPU milliseconds of one replay of a captured graph (back to back, after one replay)."""
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize()
    return round(1000 * (time.perf_counter() - t0) / reps, 4)


# Profiles run after every section has timed everything: once torch.profiler has run in a
# process, every later kernel and graph launch costs more on the host (CUPTI stays attached;
# decisions-log.md, "Graph launches are cheap; the profiler made them look dear"). So no
# profile may run before any timing.
_DEFERRED_PROFILES: list = []


def defer_profile(fn, *args) -> None:
    """Run fn(*args) at the end of the benchmark (it keeps the engine in args alive)."""
    _DEFERRED_PROFILES.append((fn, args))


def run_deferred_profiles() -> None:
    while _DEFERRED_PROFILES:
        fn, args = _DEFERRED_PROFILES.pop(0)
        try:
            fn(*args)
        except Exception as e:  # a diagnostic: report and go on
            print("profile failed:", repr(e)[:300], flush=True)
        del fn, args
        torch.cuda.empty_cache()


def profile_graph(eng, k, path, reps=20, mode: str = "greedy"):
    """Kernel time table of the batch-1 fused graph (q = k + 1) under torch.profiler."""
    graphs = fused_graphs(eng, mode)
    keys = [key for key in graphs if key[0] == 1 and key[1] == k + 1 and not key[3]]
    if not keys:
        return
    graph, _ = graphs[max(keys, key=lambda key: key[2])]
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
    Path(path).write_text(f"{reps} replays of graph {max(keys)}\n{table}\n")
    print(table[:3000], flush=True)


def profile_host(eng, prompts, max_tokens, path):
    """cProfile of a batch-1 run (an extra run: the profiler slows the host down)."""
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    run_engine(eng, prompts, 1, max_tokens)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(35)
    Path(path).write_text(out.getvalue())


def section_hf(args, results):
    """HF transformers in a child process: its static-cache generate compiles with CUDA graphs
    (torch.compile's cudagraph trees), after which replaying the 8B-shaped engine's graph in
    this process hits an illegal memory access (`big` alone, and `big,hf` without it,
    profile fine; decisions-log.md, "The 8B-shaped profile's illegal memory access needs
    HF's section in the process"). The child also keeps HF's timing free of this process's
    state."""
    import json
    import subprocess
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, __file__, "--gguf", args.gguf, "--out", out,
               "--sections", "hf_here", "--max-tokens", str(args.max_tokens)]
        proc = subprocess.run(cmd, text=True, capture_output=True, timeout=1800)
        print(proc.stdout[-4000:], proc.stderr[-2000:], flush=True)
        child = Path(out) / "gpu_bench.json"
        got = json.loads(child.read_text()) if child.exists() else {}
    results["hf"] = got.get("hf", [])
    if proc.returncode != 0 or "hf_here_error" in got:
        raise RuntimeError(f"the HF child failed (exit {proc.returncode}): "
                           f"{got.get('hf_here_error', proc.stderr[-300:])}")


def section_hf_here(args, results):
    """section_hf's work, in this process."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    p = Path(args.gguf)
    tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name,
                                                 dtype=torch.bfloat16).cuda().eval()
    from outpace.tokenizer import Tokenizer
    prompts = prompt_set(Tokenizer(tok), 8)
    rows = results.setdefault("hf", [])  # filled as measured: a later failure keeps them

    def gen(batch, n_req, compiled):
        total, t0 = 0, time.perf_counter()
        for i in range(0, n_req, batch):
            chunk = prompts[i:i + batch]
            w = max(len(x) for x in chunk)
            inp = torch.tensor([[tok.eos_token_id] * (w - len(x)) + x for x in chunk]).cuda()
            mask = torch.tensor([[0] * (w - len(x)) + [1] * len(x) for x in chunk]).cuda()
            kw = dict(cache_implementation="static") if compiled else {}
            out = model.generate(inp, attention_mask=mask, max_new_tokens=args.max_tokens,
                                 min_new_tokens=args.max_tokens, do_sample=False,
                                 pad_token_id=tok.eos_token_id, **kw)
            total += (out.shape[1] - w) * len(chunk)
        torch.cuda.synchronize()
        return total, time.perf_counter() - t0

    with torch.inference_mode():
        for b in (1, 8):
            gen(b, b, False)
            n, s = gen(b, 4 if b == 1 else b, False)
            rows.append({"system": "hf", "config": "eager", "batch": b, "tok_s": round(n / s, 1)})
            print(rows[-1], flush=True)
        # transformers compiles the forward itself for a static cache (its own CUDA-graph
        # handling); compiling model.forward by hand trips over graph-owned cache outputs.
        # Each prompt length (and cache length) compiles once: warm up on the very prompts
        # that are timed, twice, so the timed pass measures compiled code only.
        gen(1, 4, True)
        gen(1, 4, True)
        n, s = gen(1, 4, True)
        rows.append({"system": "hf", "config": "static+compile", "batch": 1,
                     "tok_s": round(n / s, 1)})
        print(rows[-1], flush=True)


class _NullTokenizer:
    eos_token_ids = ()
    has_chat_template = False

    def decode(self, ids, skip_special_tokens=True):
        return ""

    def encode(self, text, add_special_tokens=True):
        return [1]


def llama8b_shaped():
    """A Llama-3.1-8B-shaped model with random bf16 weights on CUDA -> (model, ModelConfig)."""
    from outpace.config import ModelConfig
    from outpace.models.llama import LlamaForCausalLM
    cfg = ModelConfig(architecture="llama", vocab_size=128256, hidden_size=4096,
                      intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192},
                      max_position_embeddings=8192, eos_token_ids=())
    model = LlamaForCausalLM(cfg, dtype=torch.bfloat16, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for prm in model.parameters():
            prm.normal_(0.0, 0.02, generator=g) if prm.dim() > 1 else prm.fill_(1.0)
    return model, cfg


def section_big(args, results):
    from outpace.engine.engine import LLMEngine
    model, cfg = llama8b_shaped()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # Bandwidth: a large device-to-device copy reads and writes each byte once.
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    bw = 2 * x.numel() * 10 / (time.perf_counter() - t0)
    del x, y
    floor_ms = 1000 * weight_bytes / bw
    results["big"] = {"weight_bytes": weight_bytes, "bandwidth_GBs": round(bw / 1e9, 1),
                      "floor_ms": round(floor_ms, 3)}
    prompt = list(range(100, 228))
    for overlap, use_pdl in ((False, True), (True, True), (True, False)):
        opts = args.kernel_options if use_pdl else args.kernel_options.ablate("pdl")
        eng = LLMEngine.from_args("llama3-8b-shaped", loaded=(model, cfg, _NullTokenizer()),
                                  device="cuda", dtype="bfloat16", max_num_seqs=8,
                                  num_kv_blocks=2048, max_model_len=4096, quiet=True,
                                  overlap=overlap, enable_prefix_caching=PREFIX_CACHING,
                                  kernel_options=opts)
        run_engine(eng, [prompt], 1, 16)
        r = run_engine(eng, [prompt] * 2, 1, args.max_tokens)
        tag = ("overlap" if overlap else "sync") + ("" if use_pdl else "_nopdl")
        results["big"].update({f"tpot_ms_{tag}": r["tpot_ms"], f"tok_s_{tag}": r["tok_s"],
                               f"ratio_to_floor_{tag}": round(r["tpot_ms"] / floor_ms, 3)})
        if overlap:
            results["big"]["graph_ms" + ("" if use_pdl else "_nopdl")] = \
                time_fused_graphs(eng, [1], 0).get(1)
            if use_pdl:
                defer_profile(profile_graph, eng, 0, Path(args.out) / "profile_big_b1.txt")
        del eng
    print("big:", results["big"], flush=True)


def save(args, results) -> None:
    """Write what is measured so far (after each section, and after each smol configuration:
    a call cut off by the device's time limit keeps the rows it finished)."""
    write_result(Path(args.out) / "gpu_bench.json", {
        "benchmark": "gpu_side_by_side", "device": device_name("cuda"),
        "torch": torch.__version__, "model": "smollm2-135m (Q4_1 GGUF -> bf16)",
        "max_tokens": args.max_tokens, "k": args.k, "prefix_caching": PREFIX_CACHING,
        **results})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--sections", default="check,smol,hf,big")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--batch1-requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--force-means", type=float, nargs="+", default=[2.0, 3.0, 4.0])
    ap.add_argument("--check-prompts", type=int, default=20)
    ap.add_argument("--configs", default="",
                    help="smol: only these configurations (comma-separated names), e.g. "
                         "no-spec,eagle3-fa3.0")
    ap.add_argument("--kv-blocks", type=int, default=8192)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="the smol section's step token budget (default: the engine's)")
    ap.add_argument("--b128-rounds", type=int, default=5,
                    help="b128: rounds of the paired batch-128 comparison")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="smol section: sample at this temperature (and --top-p) instead of "
                         "decoding greedily")
    ap.add_argument("--top-p", type=float, default=0.9,
                    help="with --temperature: top_p (1.0: no mask, the sampled graphs)")
    ap.add_argument("--repetition-penalty", type=float, default=1.0,
                    help="smol section: the requests' repetition penalty")
    ap.add_argument("--frequency-penalty", type=float, default=0.0,
                    help="smol section: the requests' frequency penalty")
    ap.add_argument("--logprobs", type=int, default=None,
                    help="smol section: the requests' logprobs (top-n)")
    ap.add_argument("--reps", type=int, default=3,
                    help="smol: timed runs per configuration and batch size (the median's row)")
    ap.add_argument("--ablate", action="append", default=[], metavar="NAME",
                    help="turn one KernelOptions switch off for every engine of the run "
                         "(repeatable): pdl, pdl_prime, few_row_kernels, fused_qkv_rope_store, "
                         "mid_row_kernels, triton_logprobs, fused_split_merge, row_warps_N")
    args = ap.parse_args()
    from outpace.config import KernelOptions
    args.kernel_options = KernelOptions()
    for name in args.ablate:
        args.kernel_options = args.kernel_options.ablate(name)
    results = {}
    for s in args.sections.split(","):
        t0 = time.perf_counter()
        try:
            globals()[f"section_{s}"](args, results)
        except Exception as e:  # keep what the other sections measured
            import traceback
            traceback.print_exc()
            results[f"{s}_error"] = repr(e)
        print(f"[section {s}: {time.perf_counter() - t0:.1f} s]", flush=True)
        save(args, results)
    run_deferred_profiles()
    rows = [r for r in results.get("smol", [])] + results.get("hf", [])
    print_table(rows, ["system", "config", "batch", "tok_s", "tpot_ms", "graph_ms", "step_ms",
                       "launch_ms", "wait_ms", "unpack_ms", "mean_acceptance_length"])
    if "big" in results:
        print("8B-shaped batch 1:", results["big"])
    if "check" in results:
        print("bf16 GPU vs fp32 CPU:", results["check"])


if __name__ == "__main__":
    main()
