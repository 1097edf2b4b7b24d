"""Shared helpers of the benchmark scripts: prompts and prompt sets, environment facts, JSON
output, the command line's --ablate and --sections, engine runs, random draft heads, CUDA graph
timing and the deferred profiles. torch and outpace are imported where used: serve.py imports
this module without them."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Timed engines run without prefix caching. The warm-up runs use the timed prompts, so with it
# the timed runs would prefill only each prompt's last partial block: tok/s would leave most of
# the prefill out (HF's includes all of it), and the tail prefill's new shapes would compile
# Triton kernels inside the first config's timed runs.
PREFIX_CACHING = False


def load_prompts(name: str, n: int, spread: bool = False) -> list:
    """First n prompts of benchmarks/prompts/<name>.jsonl; spread: n prompts spaced evenly
    over the whole set instead (MT-bench is ordered by category, so the first few are all of
    one kind: 8 spread prompts take the first of each of its 8 categories)."""
    rows = [json.loads(line) for line in open(HERE / "prompts" / f"{name}.jsonl")]
    if spread and 0 < n < len(rows):
        rows = [rows[i * len(rows) // n] for i in range(n)]
    return [r["prompt"] for r in rows[:n]]


def serve_prompts(dataset: str, seed: int) -> list:
    """The texts serve.py sends: a prompt set of prompts/ (mtbench, humaneval), or 256 random
    texts of 24 words."""
    if dataset == "random":
        from outpace.bench.datasets import random_text_prompts
        return random_text_prompts(256, 24, seed)
    return load_prompts(dataset, 10 ** 6)


def git_commit() -> str:
    """OUTPACE_COMMIT when set (the device machine's copy of the tree may carry a stale .git),
    else the checkout's HEAD."""
    if os.environ.get("OUTPACE_COMMIT"):
        return os.environ["OUTPACE_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=HERE,
                                       text=True, stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("OUTPACE_COMMIT", "unknown")


def device_name(device: str) -> str:
    import torch
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"{platform.processor() or platform.machine()} CPU x{os.cpu_count()}"


def write_result(path: Path, payload: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"commit": git_commit(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               **payload}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def print_table(rows: list, cols: list) -> None:
    widths = [max([len(c)] + [len(f"{r.get(c, '')}") for r in rows]) for c in cols]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(f"{r.get(c, '')}".ljust(w) for c, w in zip(cols, widths)))


def pyplot():
    """matplotlib.pyplot with the file-only backend. matplotlib is not a dependency of outpace."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_args(out_required: bool = True):
    """The plot scripts' command line (RUN.json ... --out FILE.png) and matplotlib.pyplot
    with the file-only backend -> (args, plt)."""
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("json", nargs="+")
    ap.add_argument("--out", required=out_required, default=None)
    args = ap.parse_args()
    return args, pyplot()


# ---- the command line ----------------------------------------------------------------------

def drop_script_folder() -> None:
    """Take this folder off sys.path, where running a script of it puts it first: a module here
    must not shadow a package of the same name that a dependency imports (transformers imports
    `kernels` when it is installed). The scripts import benchmarks.common from the repo root."""
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]


def add_ablate_arg(ap) -> None:
    ap.add_argument("--ablate", action="append", default=[], metavar="NAME",
                    help="turn one KernelOptions switch off for every engine of the run "
                         "(repeatable): pdl, pdl_prime, few_row_kernels, fused_qkv_rope_store, "
                         "mid_row_kernels, triton_logprobs, fused_split_merge, "
                         "ngram_lookup_kernel, row_warps_N")


def kernel_options(ap, ablate: list):
    """The run's KernelOptions: the defaults with each --ablate NAME's switch off (an unknown
    name is the command line's error)."""
    from outpace.errors import ConfigError
    from outpace.runner_config import KernelOptions
    options = KernelOptions()
    try:
        for name in ablate:
            options = options.ablate(name)
    except ConfigError as e:
        ap.error(str(e))
    return options


def out_file(out: str, default_name: str) -> Path:
    """--out names a folder (the result file gets its default name there) or a .json file."""
    path = Path(out)
    return path if path.suffix == ".json" else path / default_name


def check_sections(ap, names: list, known: dict) -> None:
    unknown = [s for s in names if s not in known]
    if unknown:
        ap.error(f"unknown section(s) {', '.join(unknown)}; this script's: {', '.join(known)}")


def run_sections(args, names: list, sections: dict, results: dict, save) -> None:
    """Run the named sections in turn; a failing one is reported (results["<name>_error"]) and
    the others still run. save(args, results) after each: a call cut off by the device's time
    limit keeps what it finished."""
    for s in names:
        t0 = time.perf_counter()
        try:
            sections[s](args, results)
        except Exception as e:  # keep what the other sections measured
            import traceback
            traceback.print_exc()
            results[f"{s}_error"] = repr(e)
        print(f"[section {s}: {time.perf_counter() - t0:.1f} s]", flush=True)
        save(args, results)


# ---- prompts, engines and heads ------------------------------------------------------------

def chat_ids(tok, prompts):
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}],
                                               add_generation_prompt=True),
                       add_special_tokens=False) for p in prompts]


def prompt_set(tok, n):
    """The GPU benchmarks' prompts: MT-bench and HumanEval interleaved (then the rest of
    HumanEval), the first n, as chat-templated token ids."""
    mt = load_prompts("mtbench", 80)
    he = load_prompts("humaneval", 164)
    mixed = [p for pair in zip(mt, he) for p in pair] + he[80:]
    return chat_ids(tok, mixed[:n])


def diag_setup(num_prompts: int, extra: tuple = ()):
    """The start of a GPU diagnostic script (benchmarks/archive/diag_*.py): the options --gguf,
    --out and `extra` ((flag, default) pairs), the model in bf16 on CUDA, the first prompts of
    the benchmark's set -> (args, loaded (model, config, tokenizer), prompts)."""
    import argparse

    import torch
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
               top_p: float = 1.0, penalties: dict = None, ignore_eos: bool = True):
    """Submit `batch` requests at once, repeatedly, over `prompts`; -> metrics dict.
    temperature > 0: sampled (unseeded) at that temperature and top_p. penalties: the
    requests' repetition / frequency / presence penalties (SamplingParams fields).
    ignore_eos False: each request ends at its EOS (or max_tokens)."""
    from outpace import SamplingParams
    # Offline generation, as HF's generate and LLM.generate: only final outputs (per-step
    # outputs cost host time every batch-128 step; docs/decisions.md, "Offline generation
    # returns only final outputs")
    sampled = dict(temperature=temperature, top_p=top_p) if temperature > 0 else \
        dict(temperature=0.0)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, output_kind="final_only",
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


def run_hf(model, ids_list, batch, max_tokens, pad_id, **generate_kw):
    """HF transformers' generate over ids_list, `batch` prompts at a time (left padding),
    greedy, exactly max_tokens new tokens each, on the model's device -> (new tokens, seconds).
    generate_kw: more generate() options (cache_implementation="static")."""
    import torch
    n_tok, t0 = 0, time.perf_counter()
    for i in range(0, len(ids_list), batch):
        chunk = ids_list[i:i + batch]
        width = max(len(x) for x in chunk)
        inp = torch.tensor([[pad_id] * (width - len(x)) + x for x in chunk])  # left padding
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in chunk])
        with torch.inference_mode():
            out = model.generate(inp.to(model.device), attention_mask=mask.to(model.device),
                                 max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=pad_id, **generate_kw)
        n_tok += (out.shape[1] - width) * len(chunk)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    return n_tok, time.perf_counter() - t0


def make_heads(gguf, tmp):
    """Random EAGLE-3 and MTP heads for the model (seed 0) in tmp -> (eagle3 dir, mtp dir)."""
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


# ---- CUDA graphs and profiles --------------------------------------------------------------

def fused_graphs(eng, mode=None) -> dict:
    """The fused step's captured graphs of a GraphMode (runner/graph_mode.py; None: greedy)."""
    from outpace.runner.graph_mode import GREEDY
    return eng.runner.fused._by_mode[GREEDY if mode is None else mode]


def graph_ms(graph, reps: int = 50) -> float:
    """GPU milliseconds of one replay of a captured graph (back to back, after one replay)."""
    import torch
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
    import torch
    while _DEFERRED_PROFILES:
        fn, args = _DEFERRED_PROFILES.pop(0)
        try:
            fn(*args)
        except Exception as e:  # a diagnostic: report and go on
            print("profile failed:", repr(e)[:300], flush=True)
        del fn, args
        torch.cuda.empty_cache()


def profile_graph(eng, k, path, reps=20, mode=None):
    """Kernel time table of the batch-1 fused graph (q = k + 1; of GraphMode `mode`, None:
    greedy) under torch.profiler."""
    import torch
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
