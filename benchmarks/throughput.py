"""Offline tok/s side by side: outpace (with and without speculation) against HF transformers.

On the GPU or the CPU, in one run. Prints a table last and writes JSON (and, on the GPU, a PNG
of it).

    python benchmarks/throughput.py --gguf PATH [--out DIR] [--sections smol,hf,big]
    python benchmarks/throughput.py --device cpu [--max-tokens 128] [--batches 1 8] [--out DIR]
    python benchmarks/throughput.py --spec [--spec-configs eagle3-k2,mtp-k1,...]
    python benchmarks/throughput.py --plot RUN.json [MORE.json ...] [--png FILE.png]

GPU sections (--device cuda, the default; --gguf PATH needed; default smol,hf,big)
  smol    SmolLM2-135M: outpace no-spec, ngram, suffix, EAGLE-3 and MTP random heads with
          force-accept at mean acceptance length 2/3/4; batch 1, 8, 32, 128
  hf      HF transformers eager and static cache + torch.compile (batch 1; eager also at 8), in
          a child process (the hf_here section)
  big     Llama-3.1-8B-shaped random bf16 model, batch 1: step time vs weight bytes / bandwidth,
          with and without overlap
  b128    batch 128, no-spec against the force-accept 3 heads (EAGLE-3 k = 4 and 2, MTP; EAGLE-3
          with the schedule at one draft up to 128 requests), the engines timed in turns round
          by round (host-bound there: a fair pairing)
  overlap SmolLM2-shaped random bf16 model, batch 1, no-spec and EAGLE-3 force-accept 3, with
          and without overlap, and with the qkv + rope + KV store kernel switched the other way
          (no model file needed)
Writes gpu_bench.json in --out (a folder; or a .json file) after every section and every smol
configuration, and at the end gpu_bench.png beside it (with matplotlib, which outpace does not
depend on). --plot draws that PNG from earlier JSONs; several files are merged (e.g. the smol
section of one run and the HF section of another).

CPU sections (--device cpu; the model: --gguf, default the catalog's smollm2-135m)
  vs_hf   outpace vs HF transformers (eager): the same chat prompts (MT-bench first turns),
          greedy, a fixed number of new tokens per request (EOS ignored) for both systems;
          writes benchmarks/results/latest/cpu_smollm2.json (the default section)
  spec    (--spec) outpace without speculation against the shipped EAGLE-3 and MTP heads (real
          acceptance), batch 1 (--spec-batch N: N prompts at once), fp32, greedy to EOS or
          --max-tokens (the outputs are the same, so the token counts are too), in rounds that
          alternate the configurations; writes benchmarks/results/latest/cpu_smollm2_spec.json
          (at --spec-batch N > 1: cpu_smollm2_spec_bN.json)
  --out names a folder for these files, or a .json file (one section).
  Tokens/s = new tokens / wall time, prefill included.

--ablate NAME (repeatable) turns one KernelOptions switch off for every engine of the run (the
switches are the CUDA fast path's: on the CPU they change nothing).
The accuracy checks (check, spec_exact) are benchmarks/accuracy.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (  # noqa: E402
    HERE, PREFIX_CACHING, add_ablate_arg, chat_ids, check_sections, defer_profile, device_name,
    drop_script_folder, fused_graphs, graph_ms, kernel_options, load_prompts, make_eagle3_reduced,
    make_heads, out_file, print_table, profile_graph, profile_host, prompt_set, pyplot,
    run_deferred_profiles, run_engine, run_hf, run_sections, write_result)


# ---- GPU -----------------------------------------------------------------------------------

def smollm2_shaped(tmp: Path):
    """A SmolLM2-135M-shaped model with random bf16 weights on CUDA and a random EAGLE-3 head
    for it (no model file needed) -> (model, ModelConfig, head folder)."""
    from outpace.model_config import ModelConfig
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
                              Path(args.out_dir) / f"profile_shaped_{name}{tag}_b1.txt")
            rows.append(r)
            print("overlap:", r, flush=True)
            del eng
            torch.cuda.empty_cache()
    results["overlap"] = rows



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
        graph_ms = time_fused_graphs(eng, args.batches, spec_k, mode=graph_mode(args))
        for r in rows:
            if r["config"] == name:
                r["graph_ms"] = graph_ms.get(r["batch"])
        save(args, results)  # results["smol"] is rows
        if name in ("no-spec", "eagle3-fa3.0"):
            defer_profile(profile_graph, eng, spec_k, Path(args.out_dir) / f"profile_{name}_b1.txt",
                          20, graph_mode(args))
            defer_profile(profile_host, eng, prompts[:args.batch1_requests], args.max_tokens,
                          Path(args.out_dir) / f"host_profile_{name}_b1.txt")
        del eng
        torch.cuda.empty_cache()


def graph_mode(args):
    """The GraphMode of the fused graphs a run's requests replay (run_engine's
    SamplingParams)."""
    from outpace import SamplingParams
    from outpace.runner.graph_mode import graph_mode as mode_of
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


def time_fused_graphs(eng, batches, k, reps=50, mode=None) -> dict:
    """GPU time of one replay of the fused step's graph (of GraphMode `mode`, None: greedy)
    per batch bucket -> {batch: ms}: the graph steady decoding replays there, at the verify
    length of the draft length the policy gives that batch (q = k_b + 1; k_b = k without a
    schedule). TPOT minus this is host time.
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
        kd = fused.lengths.draft_steps(b)
        graphs = fused_graphs(eng, mode)
        key = next((key for key in ((b, kb + 1, kd, True), (b, kb + 1, kd, False))
                    if key in graphs), None)
        if key is None:
            continue
        graph, _ = graphs[key]
        out[b] = graph_ms(graph, reps)
    return out



def section_hf(args, results):
    """HF transformers in a child process: its static-cache generate compiles with CUDA graphs
    (torch.compile's cudagraph trees), after which replaying the 8B-shaped engine's graph in
    this process hits an illegal memory access (`big` alone, and `big,hf` without it,
    profile fine; decisions-log.md, "The 8B-shaped profile's illegal memory access needs
    HF's section in the process"). The child also keeps HF's timing free of this process's
    state."""
    import subprocess
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, __file__, "--device", "cuda", "--gguf", args.gguf, "--out", out,
               "--sections", "hf_here", "--max-tokens", str(args.max_tokens), "--no-plot"]
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
        kw = dict(cache_implementation="static") if compiled else {}
        return run_hf(model, prompts[:n_req], batch, args.max_tokens, tok.eos_token_id, **kw)

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
    from outpace.model_config import ModelConfig
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
                defer_profile(profile_graph, eng, 0, Path(args.out_dir) / "profile_big_b1.txt")
        del eng
    print("big:", results["big"], flush=True)




def save(args, results) -> None:
    """Write what is measured so far (after each section, and after each smol configuration:
    a call cut off by the device's time limit keeps the rows it finished)."""
    write_result(out_file(args.out, "gpu_bench.json"), {
        "benchmark": "gpu_side_by_side", "device": device_name("cuda"),
        "torch": torch.__version__, "model": "smollm2-135m (Q4_1 GGUF -> bf16)",
        "max_tokens": args.max_tokens, "k": args.k, "prefix_caching": PREFIX_CACHING,
        "ablate": args.ablate, **results})


# ---- CPU -----------------------------------------------------------------------------------

CPU_MODEL = "smollm2-135m"


def cpu_model_label(args) -> str:
    return ("smollm2-135m (Q4_1 GGUF, dequantized fp32)" if args.gguf == CPU_MODEL
            else f"{args.gguf} (dequantized fp32)")


def run_outpace(llm, ids_list, batch, max_tokens):
    from outpace import SamplingParams
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    n_tok, t0 = 0, time.perf_counter()
    for i in range(0, len(ids_list), batch):
        outs = llm.generate(ids_list[i:i + batch], sp)
        n_tok += sum(len(o.token_ids) for o in outs)
    return n_tok, time.perf_counter() - t0


def section_vs_hf(a, results) -> None:
    """outpace against HF transformers eager, CPU fp32, greedy, --max-tokens new tokens each."""
    from transformers import AutoModelForCausalLM

    from outpace import LLM
    from outpace.models.catalog import resolve_model

    gguf = resolve_model(a.gguf)
    llm = LLM(a.gguf, device="cpu", dtype="float32", quiet=True, kernel_options=a.kernel_options)
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                              dtype=torch.float32).eval()
    prompts = load_prompts("mtbench", a.num_prompts)
    ids_list = chat_ids(llm.tokenizer, prompts)
    pad = llm.tokenizer.eos_token_ids[0]

    # Warm-up both (first calls allocate and pick kernels).
    run_outpace(llm, ids_list[:1], 1, 8)
    run_hf(hf, ids_list[:1], 1, 8, pad)

    rows = []
    for bs in a.batches:
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

    results["vs_hf"] = rows
    print_table(rows, ["batch", "requests", "outpace_tok_s", "hf_eager_tok_s", "ratio"])
    path = write_result(out_file(a.out, "cpu_smollm2.json"), {
        "benchmark": "cpu_outpace_vs_hf", "device": device_name("cpu"),
        "threads": torch.get_num_threads(), "model": cpu_model_label(a),
        "dtype": "float32", "max_tokens": a.max_tokens, "greedy": True, "k": 0,
        "ablate": a.ablate, "results": rows})
    print(f"wrote {path}")


def section_spec(a, results) -> None:
    """No speculation against the shipped heads at batch --spec-batch (1: each prompt alone),
    alternating round by round."""
    from outpace import LLM, SamplingParams
    from outpace.models.loader import load_model
    loaded = load_model(a.gguf, dtype=torch.float32, device=torch.device("cpu"), quiet=True)
    configs = {"no-spec": None}
    for name in a.spec_configs.split(","):  # METHOD-kN[+KEY=VALUE...]
        base, *opts = name.split("+")
        method, k = base.rsplit("-k", 1)
        configs[name] = {"method": method, "num_speculative_tokens": int(k),
                         **dict(opt.split("=", 1) for opt in opts)}
    llms = {n: LLM(a.gguf, device="cpu", dtype="float32", speculative_config=c,
                   quiet=True, loaded=loaded, kernel_options=a.kernel_options)
            for n, c in configs.items()}
    ids_list = chat_ids(loaded[2], load_prompts("mtbench", a.num_prompts, spread=True))
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0)
    for llm in llms.values():  # warm-up
        llm.generate(ids_list[:1], SamplingParams(max_tokens=8, temperature=0.0))
    runs = {n: [] for n in llms}
    outputs, acc = {}, {}
    for rnd in range(a.rounds):
        for n, llm in (list(llms.items())[rnd % len(llms):] + list(llms.items())[:rnd % len(llms)]):
            t0, n_tok, drafts, accepted = time.perf_counter(), 0, 0, 0
            outs = []
            for i in range(0, len(ids_list), a.spec_batch):
                for o in llm.generate(ids_list[i:i + a.spec_batch], sp):
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
    results["spec"] = rows
    print_table(rows, ["config", "tok_s", "vs_no_spec", "mean_acceptance_length",
                       "same_output_as_no_spec"])
    name = "cpu_smollm2_spec.json" if a.spec_batch == 1 else \
        f"cpu_smollm2_spec_b{a.spec_batch}.json"
    path = write_result(out_file(a.out, name), {
        "benchmark": "cpu_spec_vs_no_spec", "device": device_name("cpu"),
        "threads": torch.get_num_threads(), "model": cpu_model_label(a),
        "heads": "shipped (outpace/heads)", "dtype": "float32", "batch": a.spec_batch,
        "prompts": f"mtbench {a.num_prompts} spread over the set (one per category at 8)",
        "max_tokens": a.max_tokens,
        "rounds": a.rounds, "greedy": True, "ablate": a.ablate, "results": rows})
    print(f"wrote {path}")


# ---- the PNG -------------------------------------------------------------------------------

def plot(paths: list, out: str = None) -> str:
    """A GPU run's JSON (several are merged: e.g. the smol section of one run and the HF
    section of another) as a PNG: tokens/s against batch size for every outpace configuration,
    with HF transformers' points, and TPOT at batch 1 -> the PNG's path (default: the first
    JSON's, .png)."""
    plt = pyplot()
    data, commits = {}, []
    for f in paths:
        d = json.loads(Path(f).read_text())
        commits.append(d.get("commit", "?"))
        data.update({k: v for k, v in d.items() if k not in data})
    rows = data.get("smol", [])
    configs = list(dict.fromkeys(r["config"] for r in rows))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5))
    for c in configs:
        pts = sorted((r["batch"], r["tok_s"]) for r in rows if r["config"] == c)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"outpace {c}")
    for r in data.get("hf", []):
        ax.scatter([r["batch"]], [r["tok_s"]], marker="x", s=80, zorder=5,
                   label=f"HF {r['config']} (batch {r['batch']})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size (concurrent requests)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"SmolLM2-135M bf16, {data.get('device', '')}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)

    b1 = [r for r in rows if r["batch"] == 1]
    names = [r["config"] for r in b1]
    bx.barh(names, [r["tpot_ms"] for r in b1], label="TPOT (engine step / token)")
    if any(r.get("graph_ms") for r in b1):
        acc = [r.get("mean_acceptance_length") or 1.0 for r in b1]
        bx.barh(names, [(r.get("graph_ms") or 0) / m for r, m in zip(b1, acc)],
                label="graph replay / mean tokens per step", alpha=0.7)
    bx.set_xlabel("ms per output token, batch 1")
    bx.legend(fontsize=8)
    bx.grid(True, axis="x", alpha=0.3)
    fig.suptitle(f"outpace GPU benchmark, commits {', '.join(dict.fromkeys(commits))}")
    fig.tight_layout()
    out = out or str(Path(paths[0]).with_suffix(".png"))
    fig.savefig(out, dpi=110)
    return out


# ---- the command line ----------------------------------------------------------------------

GPU_SECTIONS = {"smol": section_smol, "hf": section_hf, "hf_here": section_hf_here,
                "big": section_big, "b128": section_b128, "overlap": section_overlap}
CPU_SECTIONS = {"vs_hf": section_vs_hf, "spec": section_spec}


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None,
                    help="cuda (the default; --spec: cpu)")
    ap.add_argument("--gguf", default=None,
                    help=f"the model (cuda: a .gguf file, needed; cpu: default {CPU_MODEL})")
    ap.add_argument("--out", default=None,
                    help="a folder for the default file names, or a .json file (cuda: default "
                         "benchmarks/results, gpu_bench.json there; cpu: default "
                         "benchmarks/results/latest, cpu_smollm2.json / cpu_smollm2_spec.json)")
    ap.add_argument("--sections", default=None,
                    help=f"comma-separated; cuda: {', '.join(GPU_SECTIONS)} (default smol,hf,big); "
                         f"cpu: {', '.join(CPU_SECTIONS)} (default vs_hf)")
    ap.add_argument("--batches", "--batch-sizes", dest="batches", type=int, nargs="+",
                    default=None, help="batch sizes (cuda: default 1 8 32 128; cpu: 1 8)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None, help="torch's CPU threads")
    add_ablate_arg(ap)
    ap.add_argument("--no-plot", action="store_true", help="cuda: no PNG after the run")
    ap.add_argument("--plot", nargs="+", default=None, metavar="JSON",
                    help="only draw the PNG of these GPU runs' JSON files (merged) and exit")
    ap.add_argument("--png", default=None, help="with --plot: the PNG (default: the first JSON's)")
    gpu = ap.add_argument_group("cuda")
    gpu.add_argument("--batch1-requests", type=int, default=4)
    gpu.add_argument("--k", type=int, default=4)
    gpu.add_argument("--force-means", type=float, nargs="+", default=[2.0, 3.0, 4.0])
    gpu.add_argument("--configs", default="",
                     help="smol: only these configurations (comma-separated names), e.g. "
                          "no-spec,eagle3-fa3.0")
    gpu.add_argument("--kv-blocks", type=int, default=8192)
    gpu.add_argument("--max-num-batched-tokens", type=int, default=None,
                     help="the smol section's step token budget (default: the engine's)")
    gpu.add_argument("--b128-rounds", type=int, default=5,
                     help="b128: rounds of the paired batch-128 comparison")
    gpu.add_argument("--temperature", type=float, default=0.0,
                     help="smol section: sample at this temperature (and --top-p) instead of "
                          "decoding greedily")
    gpu.add_argument("--top-p", type=float, default=0.9,
                     help="with --temperature: top_p (1.0: no mask, the sampled graphs)")
    gpu.add_argument("--repetition-penalty", type=float, default=1.0,
                     help="smol section: the requests' repetition penalty")
    gpu.add_argument("--frequency-penalty", type=float, default=0.0,
                     help="smol section: the requests' frequency penalty")
    gpu.add_argument("--logprobs", type=int, default=None,
                     help="smol section: the requests' logprobs (top-n)")
    gpu.add_argument("--reps", type=int, default=3,
                     help="smol: timed runs per configuration and batch size (the median's row)")
    cpu = ap.add_argument_group("cpu")
    cpu.add_argument("--spec", action="store_true",
                     help="no-spec vs the shipped heads: --device cpu --sections spec")
    cpu.add_argument("--spec-configs", default="eagle3-k1,eagle3-k2,eagle3-k3,mtp-k1,mtp-k2",
                     help="spec: METHOD-kN[+KEY=VALUE...], the values speculative options "
                     "(eagle3-k3+draft_weight_dtype=float32)")
    cpu.add_argument("--num-prompts", type=int, default=8,
                     help="vs_hf: the first N MT-bench prompts; spec: N spread over the set")
    cpu.add_argument("--rounds", type=int, default=3, help="spec: rounds alternating the configs")
    cpu.add_argument("--spec-batch", type=int, default=1,
                     help="spec: prompts run at once (1: each alone; more: writes "
                     "cpu_smollm2_spec_bN.json)")
    a = ap.parse_args()
    if a.plot:
        return a, []
    if a.spec_batch < 1:
        ap.error(f"--spec-batch must be at least 1, got {a.spec_batch}")
    if a.spec:
        if a.device == "cuda" or a.sections not in (None, "spec"):
            ap.error("--spec is the CPU section spec (--device cpu --sections spec)")
        a.device, a.sections = "cpu", "spec"
    a.device = a.device or "cuda"
    cuda = a.device == "cuda"
    names = (a.sections or ("smol,hf,big" if cuda else "vs_hf")).split(",")
    check_sections(ap, names, GPU_SECTIONS if cuda else CPU_SECTIONS)
    if cuda and a.gguf is None:
        ap.error("--device cuda needs --gguf PATH")
    a.gguf = a.gguf or CPU_MODEL
    a.batches = a.batches or ([1, 8, 32, 128] if cuda else [1, 8])
    a.out = a.out or ("benchmarks/results" if cuda else str(HERE / "results" / "latest"))
    if not cuda and len(names) > 1 and Path(a.out).suffix == ".json":
        ap.error("--out FILE.json takes one CPU section; name a folder for several")
    a.out_dir = str(Path(a.out).parent if Path(a.out).suffix == ".json" else Path(a.out))
    a.kernel_options = kernel_options(ap, a.ablate)
    return a, names


def main():
    drop_script_folder()
    args, names = parse_args()
    if args.plot:
        print(plot(args.plot, args.png))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {}
    if args.device == "cpu":  # each CPU section writes its own file
        run_sections(args, names, CPU_SECTIONS, results, lambda args, results: None)
    else:
        run_sections(args, names, GPU_SECTIONS, results, save)
        run_deferred_profiles()
        rows = [r for r in results.get("smol", [])] + results.get("hf", [])
        print_table(rows, ["system", "config", "batch", "tok_s", "tpot_ms", "graph_ms", "step_ms",
                           "launch_ms", "wait_ms", "unpack_ms", "mean_acceptance_length"])
        if "big" in results:
            print("8B-shaped batch 1:", results["big"])
        if rows and not args.no_plot:
            try:
                print("plot:", plot([str(out_file(args.out, "gpu_bench.json"))]))
            except Exception as e:  # matplotlib is not a dependency of outpace
                print(f"no PNG ({e!r}); plot later: throughput.py --plot JSON", flush=True)
    failed = [s for s in names if f"{s}_error" in results]
    if failed:
        sys.exit(f"failed section(s): {', '.join(failed)}")


if __name__ == "__main__":
    main()
